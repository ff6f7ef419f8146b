//! The GPUs of this machine, through NVIDIA's management library (NVML).
//!
//! NVML is opened with `dlopen` at run time instead of linked, so the binary starts (and CPU
//! runs work) on machines without the NVIDIA driver. It is loaded and initialised once per
//! process, on first use, and stays initialised: the training loop's memory report queries it
//! every few steps, and `nvmlInit` costs far more than the query itself.

use std::ffi::{c_char, c_int, c_uint, c_void};
use std::sync::OnceLock;

use super::ffi::{copy_c_string, Library};

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
        Some(lib) => (0..lib.count()).filter_map(|i| lib.gpu(i)).collect(),
        None => Vec::new(),
    }
}

/// The NVIDIA driver's version (`nvidia-smi`'s "Driver Version", e.g. `580.65.06`); `None`
/// without NVML.
pub fn driver_version() -> Option<String> {
    let lib = nvml()?;
    let mut buf = [0 as c_char; DRIVER_LEN];
    // SAFETY: NVML is initialised; the buffer has the DRIVER_LEN bytes we declare.
    let ok = unsafe { (lib.driver)(buf.as_mut_ptr(), DRIVER_LEN as c_uint) } == NVML_SUCCESS;
    // SAFETY: on success NVML wrote a NUL-terminated string into the buffer.
    ok.then(|| unsafe { copy_c_string(buf.as_ptr()) }).flatten()
}

/// The GPU with NVML index `index`, queried alone; `None` without NVML or such a GPU.
pub fn gpu(index: usize) -> Option<GpuInfo> {
    nvml()?.gpu(c_uint::try_from(index).ok()?)
}

type NvmlReturn = c_int;
type Device = *mut c_void;
const NVML_SUCCESS: NvmlReturn = 0;
/// NVML_DEVICE_NAME_V2_BUFFER_SIZE.
const NAME_LEN: usize = 96;
/// NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE.
const DRIVER_LEN: usize = 80;

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
type DriverFn = unsafe extern "C" fn(*mut c_char, c_uint) -> NvmlReturn;

/// The few NVML entry points used, resolved once, with NVML initialised.
struct Nvml {
    count: CountFn,
    handle: HandleFn,
    name: NameFn,
    memory: MemoryFn,
    utilization: UtilizationFn,
    driver: DriverFn,
}

/// Loads and initialises NVML the first time. It is never shut down: `nvmlShutdown` only
/// balances an init, and the process exit releases everything.
fn nvml() -> Option<&'static Nvml> {
    static LIB: OnceLock<Option<Nvml>> = OnceLock::new();
    LIB.get_or_init(Nvml::load).as_ref()
}

impl Nvml {
    fn load() -> Option<Nvml> {
        let lib = Library::open(c"libnvidia-ml.so.1", libc::RTLD_NOW | libc::RTLD_LOCAL).ok()?;
        // SAFETY: each symbol is read as the signature nvml.h documents for that exact
        // (versioned) name.
        let (init, nvml) = unsafe {
            (
                lib.function::<InitFn>(c"nvmlInit_v2").ok()?,
                Nvml {
                    count: lib.function(c"nvmlDeviceGetCount_v2").ok()?,
                    handle: lib.function(c"nvmlDeviceGetHandleByIndex_v2").ok()?,
                    name: lib.function(c"nvmlDeviceGetName").ok()?,
                    memory: lib.function(c"nvmlDeviceGetMemoryInfo").ok()?,
                    utilization: lib.function(c"nvmlDeviceGetUtilizationRates").ok()?,
                    driver: lib.function(c"nvmlSystemGetDriverVersion").ok()?,
                },
            )
        };
        // SAFETY: nvmlInit_v2 takes no arguments; it may be called from any thread.
        // A failure means the library is present but no usable driver (a container without GPUs).
        (unsafe { init() } == NVML_SUCCESS).then_some(nvml)
    }

    fn count(&self) -> c_uint {
        let mut n: c_uint = 0;
        // SAFETY: NVML is initialised; `n` is a live out-pointer.
        let ok = unsafe { (self.count)(&mut n) } == NVML_SUCCESS;
        if ok {
            n
        } else {
            0
        }
    }

    fn gpu(&self, i: c_uint) -> Option<GpuInfo> {
        // SAFETY: calls follow nvml.h: NVML is initialised, out-pointers are live locals of the
        // documented types, the name buffer has the NAME_LEN bytes we declare.
        unsafe {
            let mut dev: Device = std::ptr::null_mut();
            if (self.handle)(i, &mut dev) != NVML_SUCCESS {
                return None;
            }
            let mut name = [0 as c_char; NAME_LEN];
            let name = if (self.name)(dev, name.as_mut_ptr(), NAME_LEN as c_uint) == NVML_SUCCESS {
                copy_c_string(name.as_ptr())
            } else {
                None
            };
            let mut mem = Memory::default();
            let mem_ok = (self.memory)(dev, &mut mem) == NVML_SUCCESS;
            let mut util = Utilization::default();
            let util_ok = (self.utilization)(dev, &mut util) == NVML_SUCCESS;
            Some(GpuInfo {
                index: i as usize,
                name: name.unwrap_or_else(|| String::from("unknown GPU")),
                memory_used: if mem_ok { mem.used } else { 0 },
                memory_total: if mem_ok { mem.total } else { 0 },
                utilization: if util_ok { util.gpu } else { 0 },
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn detect_without_driver_is_empty_or_sane() {
        let gpus = detect_gpus();
        if !std::path::Path::new("/proc/driver/nvidia").exists() {
            // No kernel driver (CI): empty, without an error or a panic.
            assert!(gpus.is_empty(), "{gpus:?}");
            assert_eq!(gpu(0), None);
            assert_eq!(driver_version(), None);
        }
        for g in &gpus {
            assert!(g.memory_used <= g.memory_total);
            assert!(g.utilization <= 100);
            // One GPU queried alone is the same device (memory and load may have moved).
            assert_eq!(gpu(g.index).map(|one| one.name), Some(g.name.clone()));
        }
    }
}
