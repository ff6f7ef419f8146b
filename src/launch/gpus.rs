//! GPU discovery through NVML, and `--gpus` parsing.
//!
//! NVML is opened with `dlopen` at run time instead of linked, so the binary starts (and
//! `--cpu` runs work) on machines without the NVIDIA driver.

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::sync::OnceLock;

use anyhow::{bail, Result};

/// One GPU as NVML reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuInfo {
    /// NVML index (PCI bus order, as `nvidia-smi` numbers GPUs).
    pub index: usize,
    /// Product name, e.g. "NVIDIA H100 80GB HBM3".
    pub name: String,
    /// Bytes in use, by any process.
    pub memory_used: u64,
    /// Bytes on the device.
    pub memory_total: u64,
    /// Percent of the last sample period a kernel was running (0 when NVML cannot tell).
    pub utilization: u32,
}

/// The GPUs of this machine; empty (not an error) when NVML or the driver is missing or
/// fails to initialise, so callers can treat "no NVML" like "no GPU".
pub fn detect_gpus() -> Vec<GpuInfo> {
    match nvml() {
        Some(lib) => lib.devices(),
        None => Vec::new(),
    }
}

/// The `n` least used GPUs, least used first (memory in use, then utilisation, then index),
/// for `--gpus auto-free`. Returns fewer than `n` when there are fewer GPUs.
pub fn pick_free_gpus(gpus: &[GpuInfo], n: usize) -> Vec<usize> {
    let mut sorted: Vec<&GpuInfo> = gpus.iter().collect();
    sorted.sort_by_key(|g| (g.memory_used, g.utilization, g.index));
    sorted.into_iter().take(n).map(|g| g.index).collect()
}

/// Parses a `--gpus` list such as `0,1,3` (spaces around entries are allowed).
pub fn parse_gpu_list(s: &str) -> Result<Vec<usize>> {
    const HINT: &str = "expected comma-separated GPU indices such as 0,1,3";
    if s.trim().is_empty() {
        bail!("--gpus: empty list; {HINT}");
    }
    let mut ids = Vec::new();
    for (i, item) in s.split(',').enumerate() {
        let item = item.trim();
        if item.is_empty() {
            bail!("--gpus '{s}': entry {} is empty; {HINT}", i + 1);
        }
        match item.parse::<usize>() {
            Ok(id) => ids.push(id),
            Err(_) => bail!("--gpus '{s}': '{item}' is not a GPU index; {HINT}"),
        }
    }
    check_unique(&ids)?;
    Ok(ids)
}

/// Two workers on one GPU is never what was meant (and would usually run out of memory).
pub(super) fn check_unique(ids: &[usize]) -> Result<()> {
    for (i, id) in ids.iter().enumerate() {
        if ids[..i].contains(id) {
            bail!("--gpus: GPU {id} is listed twice; each GPU runs one worker");
        }
    }
    Ok(())
}

type NvmlReturn = c_int;
type Device = *mut c_void;
const NVML_SUCCESS: NvmlReturn = 0;
/// NVML_DEVICE_NAME_V2_BUFFER_SIZE.
const NAME_LEN: usize = 96;

#[repr(C)]
#[derive(Default)]
struct Memory {
    total: u64,
    free: u64,
    used: u64,
}

#[repr(C)]
#[derive(Default)]
struct Utilization {
    gpu: c_uint,
    memory: c_uint,
}

type InitFn = unsafe extern "C" fn() -> NvmlReturn;
type CountFn = unsafe extern "C" fn(*mut c_uint) -> NvmlReturn;
type HandleFn = unsafe extern "C" fn(c_uint, *mut Device) -> NvmlReturn;
type NameFn = unsafe extern "C" fn(Device, *mut c_char, c_uint) -> NvmlReturn;
type MemoryFn = unsafe extern "C" fn(Device, *mut Memory) -> NvmlReturn;
type UtilizationFn = unsafe extern "C" fn(Device, *mut Utilization) -> NvmlReturn;

/// The few NVML entry points used, resolved once.
struct Nvml {
    init: InitFn,
    shutdown: InitFn,
    count: CountFn,
    handle: HandleFn,
    name: NameFn,
    memory: MemoryFn,
    utilization: UtilizationFn,
}

/// Loads NVML the first time; the library stays loaded for the life of the process
/// (unloading buys nothing and NVML documents no guarantee that it is safe).
fn nvml() -> Option<&'static Nvml> {
    static LIB: OnceLock<Option<Nvml>> = OnceLock::new();
    LIB.get_or_init(Nvml::load).as_ref()
}

impl Nvml {
    fn load() -> Option<Nvml> {
        // SAFETY: dlopen/dlsym with NUL-terminated names; each symbol is cast to the
        // signature documented in nvml.h for that exact (versioned) name.
        unsafe {
            let lib = libc::dlopen(
                c"libnvidia-ml.so.1".as_ptr(),
                libc::RTLD_NOW | libc::RTLD_LOCAL,
            );
            if lib.is_null() {
                return None;
            }
            let sym = |name: &CStr| {
                let p = libc::dlsym(lib, name.as_ptr());
                (!p.is_null()).then_some(p)
            };
            use std::mem::transmute;
            Some(Nvml {
                init: transmute::<*mut c_void, InitFn>(sym(c"nvmlInit_v2")?),
                shutdown: transmute::<*mut c_void, InitFn>(sym(c"nvmlShutdown")?),
                count: transmute::<*mut c_void, CountFn>(sym(c"nvmlDeviceGetCount_v2")?),
                handle: transmute::<*mut c_void, HandleFn>(sym(c"nvmlDeviceGetHandleByIndex_v2")?),
                name: transmute::<*mut c_void, NameFn>(sym(c"nvmlDeviceGetName")?),
                memory: transmute::<*mut c_void, MemoryFn>(sym(c"nvmlDeviceGetMemoryInfo")?),
                utilization: transmute::<*mut c_void, UtilizationFn>(sym(
                    c"nvmlDeviceGetUtilizationRates",
                )?),
            })
        }
    }

    fn devices(&self) -> Vec<GpuInfo> {
        // SAFETY: calls follow nvml.h: init before use, out-pointers to live locals of the
        // documented types, a name buffer of NAME_LEN bytes, shutdown to balance init.
        unsafe {
            if (self.init)() != NVML_SUCCESS {
                // Library present but no usable driver (e.g. a container without GPUs).
                return Vec::new();
            }
            let mut n: c_uint = 0;
            let mut gpus = Vec::new();
            if (self.count)(&mut n) == NVML_SUCCESS {
                for i in 0..n {
                    let mut dev: Device = std::ptr::null_mut();
                    if (self.handle)(i, &mut dev) != NVML_SUCCESS {
                        continue;
                    }
                    let mut name = [0 as c_char; NAME_LEN];
                    let name = if (self.name)(dev, name.as_mut_ptr(), NAME_LEN as c_uint)
                        == NVML_SUCCESS
                    {
                        CStr::from_ptr(name.as_ptr()).to_string_lossy().into_owned()
                    } else {
                        String::from("unknown GPU")
                    };
                    let mut mem = Memory::default();
                    let mem_ok = (self.memory)(dev, &mut mem) == NVML_SUCCESS;
                    let mut util = Utilization::default();
                    let util_ok = (self.utilization)(dev, &mut util) == NVML_SUCCESS;
                    gpus.push(GpuInfo {
                        index: i as usize,
                        name,
                        memory_used: if mem_ok { mem.used } else { 0 },
                        memory_total: if mem_ok { mem.total } else { 0 },
                        utilization: if util_ok { util.gpu } else { 0 },
                    });
                }
            }
            (self.shutdown)();
            gpus
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu(index: usize, used_gib: u64, utilization: u32) -> GpuInfo {
        GpuInfo {
            index,
            name: "test".into(),
            memory_used: used_gib << 30,
            memory_total: 80 << 30,
            utilization,
        }
    }

    #[test]
    fn parses_lists() {
        assert_eq!(parse_gpu_list("0,1,3").unwrap(), vec![0, 1, 3]);
        assert_eq!(parse_gpu_list(" 2 , 0 ").unwrap(), vec![2, 0]);
        assert_eq!(parse_gpu_list("7").unwrap(), vec![7]);
    }

    #[test]
    fn rejects_bad_lists_clearly() {
        let err = |s: &str| parse_gpu_list(s).unwrap_err().to_string();
        assert!(err("").contains("empty list"), "{}", err(""));
        assert!(err("0,,1").contains("entry 2 is empty"), "{}", err("0,,1"));
        assert!(err("0,1,").contains("entry 3 is empty"));
        assert!(err("0,x").contains("'x' is not a GPU index"));
        assert!(err("-1").contains("'-1' is not a GPU index"));
        assert!(err("0,1,0").contains("GPU 0 is listed twice"));
        assert!(err("auto").contains("such as 0,1,3"));
    }

    #[test]
    fn picks_least_used_first() {
        let gpus = [gpu(0, 40, 90), gpu(1, 0, 0), gpu(2, 1, 5), gpu(3, 0, 30)];
        assert_eq!(pick_free_gpus(&gpus, 2), vec![1, 3]);
        assert_eq!(pick_free_gpus(&gpus, 4), vec![1, 3, 2, 0]);
        assert_eq!(pick_free_gpus(&gpus, 9).len(), 4);
        assert!(pick_free_gpus(&[], 2).is_empty());
        // Ties fall back to the index, so the choice is stable.
        assert_eq!(pick_free_gpus(&[gpu(5, 0, 0), gpu(4, 0, 0)], 1), vec![4]);
    }

    #[test]
    fn detect_without_driver_is_empty_or_sane() {
        let gpus = detect_gpus();
        if !std::path::Path::new("/proc/driver/nvidia").exists() {
            // No kernel driver (CI): empty, without an error or a panic.
            assert!(gpus.is_empty(), "{gpus:?}");
        }
        for g in gpus {
            assert!(g.memory_used <= g.memory_total);
            assert!(g.utilization <= 100);
        }
    }
}
