//! NCCL collectives for CUDA ranks: libtorch's own `c10d::ProcessGroupNCCL` through the C shim
//! in `csrc/nccl_group.cpp`.
//!
//! Why ProcessGroupNCCL rather than NCCL through `cudarc`: it is the code path PyTorch DDP runs
//! (same NCCL build, same communicator setup through the store, same stream semantics: a
//! collective is ordered after the work queued on libtorch's current stream and later work
//! waits for it, with no host synchronisation), and it brings the watchdog, per-collective
//! timeouts, flight recorder and `TORCH_NCCL_*` knobs users already know. With cudarc we would
//! need a C++ shim anyway to reach libtorch's current CUDA stream, and would re-implement
//! the timeout/abort machinery ourselves.
//!
//! Loading: build.rs compiles the shim into a small shared library linked against
//! libtorch_cuda, and the binary embeds it. A CUDA rank writes it to an anonymous memory file
//! (or, where those may not be executable, a private temp file removed after loading) and
//! dlopens it, so the binary stays one file and CPU runs never load the CUDA stack.
//!
//! Which collective goes where:
//! - gradients and parameters (the bulk, on the GPU): NCCL, in place on the device;
//! - scalars (loss, stop requests, the guard's agreement), eval sums and barriers: the CPU
//!   [`RingGroup`] over TCP. Each step's loss agreement runs after the gradient all-reduce
//!   is queued, on the host, so a stalled peer turns into the ring's timeout error naming
//!   the rank that is missing. NCCL's watchdog cannot name it (a collective only knows it did
//!   not finish), so its timeout is set longer, as the backstop that aborts the process if the
//!   ring never gets a chance.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Result};
use tch::Tensor;

use super::group::ProcessGroup;
use super::ring::RingGroup;
use super::store::Store;

// The shim's signatures (csrc/nccl_group.cpp); ints are status codes, `*mut *mut c_char` the
// error message out-parameter.
type NewFn = unsafe extern "C" fn(
    *mut c_void,   // c10d::Store*
    *const c_char, // key prefix
    usize,         // its length
    c_int,         // rank
    c_int,         // world size
    c_int,         // CUDA device
    i64,           // watchdog timeout, ms
    *mut *mut c_void,
    *mut *mut c_char,
) -> c_int;
type TensorOpFn = unsafe extern "C" fn(*mut c_void, *mut c_void, c_int, *mut *mut c_char) -> c_int;
type VersionFn = unsafe extern "C" fn() -> *mut c_char;
type FreeFn = unsafe extern "C" fn(*mut c_void, c_int);

/// The shim's entry points, resolved once per process.
struct Shim {
    new: NewFn,
    all_reduce: TensorOpFn,
    broadcast: TensorOpFn,
    version: VersionFn,
    free: FreeFn,
}

/// Takes ownership of a malloc'd C string from the shim.
fn take_cstr(p: *mut c_char, fallback: &str) -> String {
    if p.is_null() {
        return fallback.to_owned();
    }
    // SAFETY: the shim returns a malloc'd NUL-terminated string that we now own.
    let s = unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned();
    // SAFETY: allocated with malloc in the same process, not used afterwards.
    unsafe { libc::free(p.cast()) };
    s
}

#[cfg(lockstep_nccl)]
fn dl_error() -> String {
    // SAFETY: dlerror returns a thread-local NUL-terminated message or NULL.
    let err = unsafe { libc::dlerror() };
    if err.is_null() {
        "unknown dlopen error".to_owned()
    } else {
        // SAFETY: non-null, NUL-terminated, valid until the next dl* call on this thread.
        unsafe { CStr::from_ptr(err) }
            .to_string_lossy()
            .into_owned()
    }
}

#[cfg(lockstep_nccl)]
static SHIM_IMAGE: &[u8] = include_bytes!(env!("LOCKSTEP_NCCL_SHIM"));

/// dlopens the embedded shim: from an anonymous memory file (nothing on disk), else, where
/// memfds may not be executable (vm.memfd_noexec) or /proc is missing, from a private temp file.
#[cfg(lockstep_nccl)]
fn open_embedded(image: &[u8]) -> Result<*mut c_void, String> {
    use std::io::Write;
    use std::os::fd::FromRawFd;

    let mut memfd_err = String::new();
    for flags in [libc::MFD_CLOEXEC | libc::MFD_EXEC, libc::MFD_CLOEXEC] {
        // SAFETY: a NUL-terminated name and valid flags.
        let fd = unsafe { libc::memfd_create(c"lockstep_nccl".as_ptr(), flags) };
        if fd < 0 {
            // EINVAL: a kernel older than 6.3 that does not know MFD_EXEC; retry without.
            memfd_err = format!("memfd_create: {}", std::io::Error::last_os_error());
            continue;
        }
        // SAFETY: `fd` is a fresh descriptor we own; the File closes it after the dlopen.
        let mut file = unsafe { std::fs::File::from_raw_fd(fd) };
        if let Err(e) = file.write_all(image) {
            memfd_err = format!("writing the memfd: {e}");
            break;
        }
        match dlopen(std::path::Path::new(&format!("/proc/self/fd/{fd}"))) {
            Ok(h) => return Ok(h),
            Err(e) => {
                memfd_err = e;
                break;
            }
        }
    }
    open_from_temp_file(image).map_err(|e| format!("{memfd_err}; {e}"))
}

#[cfg(lockstep_nccl)]
fn dlopen(path: &std::path::Path) -> Result<*mut c_void, String> {
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: dlopen of a complete ELF image with a NUL-terminated path.
    let h = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    if h.is_null() {
        Err(dl_error())
    } else {
        Ok(h)
    }
}

/// The fallback: the image in a private temp directory, loaded, then deleted (the mapping
/// outlives the file).
#[cfg(lockstep_nccl)]
fn open_from_temp_file(image: &[u8]) -> Result<*mut c_void, String> {
    let dir = tempfile::Builder::new()
        .prefix("lockstep-nccl-")
        .tempdir()
        .map_err(|e| format!("no temp dir for the NCCL shim: {e}"))?;
    let path = dir.path().join("liblockstep_nccl.so");
    std::fs::write(&path, image).map_err(|e| format!("{}: {e}", path.display()))?;
    dlopen(&path).map_err(|e| format!("{}: {e}", path.display()))
}

#[cfg(lockstep_nccl)]
fn load() -> Result<Shim, String> {
    let handle = open_embedded(SHIM_IMAGE)?;
    let sym = |name: &CStr| -> Result<*mut c_void, String> {
        // SAFETY: `handle` is a live library handle; `name` is NUL-terminated.
        let p = unsafe { libc::dlsym(handle, name.as_ptr()) };
        if p.is_null() {
            Err(format!("NCCL shim lacks {name:?}: {}", dl_error()))
        } else {
            Ok(p)
        }
    };
    // SAFETY: each symbol is the extern "C" function of csrc/nccl_group.cpp with exactly the
    // signature of the field it is transmuted into.
    unsafe {
        Ok(Shim {
            new: std::mem::transmute::<*mut c_void, NewFn>(sym(c"ls_nccl_new")?),
            all_reduce: std::mem::transmute::<*mut c_void, TensorOpFn>(sym(c"ls_nccl_all_reduce")?),
            broadcast: std::mem::transmute::<*mut c_void, TensorOpFn>(sym(c"ls_nccl_broadcast")?),
            version: std::mem::transmute::<*mut c_void, VersionFn>(sym(c"ls_nccl_version")?),
            free: std::mem::transmute::<*mut c_void, FreeFn>(sym(c"ls_nccl_free")?),
        })
    }
}

#[cfg(not(lockstep_nccl))]
fn load() -> Result<Shim, String> {
    Err(
        "this lockstep was built without the NCCL backend (LOCKSTEP_NO_NCCL was set, or \
         build.rs found no NCCL/CUDA headers: install scripts/requirements.txt and rebuild)"
            .to_owned(),
    )
}

fn shim() -> Result<&'static Shim> {
    static SHIM: std::sync::OnceLock<Result<Shim, String>> = std::sync::OnceLock::new();
    match SHIM.get_or_init(load) {
        Ok(s) => Ok(s),
        Err(e) => bail!(
            "cannot load the NCCL backend: {e}; for CUDA ranks without NCCL set \
             system.dist_backend=ring"
        ),
    }
}

/// The NCCL version libtorch was built with (loads the backend).
pub fn version() -> Result<String> {
    let s = shim()?;
    // SAFETY: the shim returns a malloc'd string or NULL.
    Ok(take_cstr(unsafe { (s.version)() }, "unknown"))
}

/// The key ProcessGroupNCCL's monitor polls at the store's root for a flight-recorder dump
/// signal from another rank (`kStoreDumpKey` in libtorch 2.11).
pub const DUMP_SIGNAL_KEY: &str = "exception_dump";

/// The watchdog's limit for one NCCL collective: longer than the ring's, so that a stalled
/// peer is reported by the ring (which names it) before the watchdog aborts the process.
pub fn watchdog_timeout(collective_timeout: Duration) -> Duration {
    collective_timeout + (collective_timeout / 10).max(Duration::from_secs(60))
}

/// A CUDA rank's process group: NCCL for device tensors, the CPU ring for the rest.
pub struct NcclGroup {
    shim: &'static Shim,
    handle: *mut c_void,
    cpu: RingGroup,
    /// Set by any failed collective: the drop then aborts the communicators instead of
    /// flushing them, since a collective may never finish.
    failed: bool,
    /// An NCCL collective was queued and no ring collective has succeeded since, so a peer may
    /// never have matched it: a drop now must abort too (shutdown would wait for it forever).
    pending: bool,
    // Keeps the store that ProcessGroupNCCL also references alive on the Rust side.
    _store: Arc<Store>,
}

// SAFETY: ProcessGroupNCCL is thread-safe and the handle is only used through `&mut self`.
unsafe impl Send for NcclGroup {}

impl NcclGroup {
    /// Joins the NCCL group on CUDA device `cuda_device` (this process's index), with keys under
    /// `key_prefix` in `store`, and connects eagerly so a broken NCCL setup fails here rather
    /// than at the first all-reduce. `cpu` is the already-formed ring of the same ranks.
    pub fn new(
        store: Arc<Store>,
        cpu: RingGroup,
        cuda_device: usize,
        key_prefix: &str,
        collective_timeout: Duration,
    ) -> Result<NcclGroup> {
        let shim = shim()?;
        let (rank, world) = (cpu.rank(), cpu.world_size());
        let mut handle = std::ptr::null_mut();
        let mut err = std::ptr::null_mut();
        let timeout_ms =
            i64::try_from(watchdog_timeout(collective_timeout).as_millis()).unwrap_or(i64::MAX);
        // SAFETY: the store pointer is live (we hold `store`), the prefix is valid for its
        // length, and the out-pointers are valid.
        let rc = unsafe {
            (shim.new)(
                store.c10d_ptr(),
                key_prefix.as_ptr().cast(),
                key_prefix.len(),
                rank as c_int,
                world as c_int,
                cuda_device as c_int,
                timeout_ms,
                &mut handle,
                &mut err,
            )
        };
        if rc != 0 {
            bail!(
                "rank {rank}: cannot create the NCCL process group on cuda:{cuda_device}: {}",
                take_cstr(err, "no message")
            );
        }
        Ok(NcclGroup {
            shim,
            handle,
            cpu,
            failed: false,
            pending: false,
            _store: store,
        })
    }

    fn check(&mut self, rc: c_int, err: *mut c_char, what: &str, t: &Tensor) -> Result<()> {
        if rc == 0 {
            self.pending = true;
            return Ok(());
        }
        self.failed = true;
        bail!(
            "rank {}: NCCL {what} of {} {:?} elements on {:?} failed: {}",
            self.rank(),
            t.numel(),
            t.kind(),
            t.device(),
            take_cstr(err, "no message")
        )
    }

    /// Ring collectives mark the group failed too (a missing peer also strands NCCL); a ring
    /// collective that succeeds shows every rank has queued the NCCL work that came before it,
    /// so that work will complete.
    fn on_cpu<T>(&mut self, f: impl FnOnce(&mut RingGroup) -> Result<T>) -> Result<T> {
        let r = f(&mut self.cpu);
        match r {
            Ok(_) => self.pending = false,
            Err(_) => self.failed = true,
        }
        r
    }
}

impl ProcessGroup for NcclGroup {
    fn rank(&self) -> usize {
        self.cpu.rank()
    }

    fn world_size(&self) -> usize {
        self.cpu.world_size()
    }

    fn all_reduce_sum_f32(&mut self, buf: &mut [f32]) -> Result<()> {
        self.on_cpu(|c| c.all_reduce_sum_f32(buf))
    }

    fn broadcast_f32(&mut self, buf: &mut [f32], root: usize) -> Result<()> {
        self.on_cpu(|c| c.broadcast_f32(buf, root))
    }

    fn all_reduce_max_f64(&mut self, x: f64) -> Result<f64> {
        self.on_cpu(|c| c.all_reduce_max_f64(x))
    }

    fn barrier(&mut self) -> Result<()> {
        self.on_cpu(|c| c.barrier())
    }

    fn all_reduce_avg_tensor(&mut self, t: &Tensor) -> Result<()> {
        if !t.device().is_cuda() {
            return super::group::through_host(t, |b| self.all_reduce_avg_f32(b));
        }
        let mut err = std::ptr::null_mut();
        // SAFETY: `handle` is live; `t.as_ptr()` is tch's `at::Tensor*`, alive for the call.
        let rc =
            unsafe { (self.shim.all_reduce)(self.handle, t.as_ptr() as *mut c_void, 1, &mut err) };
        self.check(rc, err, "all-reduce", t)
    }

    fn broadcast_tensor(&mut self, t: &Tensor, root: usize) -> Result<()> {
        if !t.device().is_cuda() {
            return super::group::through_host(t, |b| self.broadcast_f32(b, root));
        }
        let mut err = std::ptr::null_mut();
        // SAFETY: as in `all_reduce_avg_tensor`.
        let rc = unsafe {
            (self.shim.broadcast)(
                self.handle,
                t.as_ptr() as *mut c_void,
                root as c_int,
                &mut err,
            )
        };
        self.check(rc, err, "broadcast", t)
    }
}

impl Drop for NcclGroup {
    fn drop(&mut self) {
        let abort = self.failed || self.pending;
        // SAFETY: `handle` is live and never used after this.
        unsafe { (self.shim.free)(self.handle, c_int::from(abort)) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dist::ring::RingConfig;
    use tch::{Device, Kind};

    #[test]
    fn watchdog_outlasts_the_ring() {
        let s = Duration::from_secs;
        assert_eq!(watchdog_timeout(s(600)), s(660));
        assert_eq!(watchdog_timeout(s(5)), s(65));
        assert_eq!(watchdog_timeout(s(3600)), s(3960));
    }

    /// The embedded shim loads on any machine with the wheel's libraries, GPU or not, and
    /// reports an NCCL with average reduction (2.10+), which gradient averaging relies on.
    #[test]
    #[cfg_attr(not(lockstep_nccl), ignore = "built without the NCCL shim")]
    fn shim_loads_and_reports_nccl_version() -> Result<()> {
        let v = version()?;
        let parts: Vec<u32> = v.split('.').map(|p| p.parse()).collect::<Result<_, _>>()?;
        assert_eq!(parts.len(), 3, "{v}");
        assert!((parts[0], parts[1]) >= (2, 10), "{v}");
        Ok(())
    }

    /// The fallback loader works too (the memfd path is the one `version()` takes here), and
    /// leaves no file behind.
    #[cfg(lockstep_nccl)]
    #[test]
    fn shim_loads_from_a_temp_file() {
        let ours = || {
            std::fs::read_dir(std::env::temp_dir())
                .unwrap()
                .filter(|e| {
                    let name = e.as_ref().unwrap().file_name();
                    name.to_string_lossy().starts_with("lockstep-nccl-")
                })
                .count()
        };
        let before = ours();
        let h = open_from_temp_file(SHIM_IMAGE).unwrap();
        // SAFETY: a live handle and a NUL-terminated symbol name.
        assert!(!unsafe { libc::dlsym(h, c"ls_nccl_all_reduce".as_ptr()) }.is_null());
        assert_eq!(ours(), before, "the shim's temp dir was left behind");
    }

    fn group_of_one(store: Arc<Store>) -> Result<NcclGroup> {
        let ring = RingGroup::with_config(
            store.clone(),
            0,
            1,
            Duration::from_secs(10),
            RingConfig::default(),
        )?;
        NcclGroup::new(store, ring, 0, "test/nccl", Duration::from_secs(10))
    }

    /// Without a GPU, creating the group is an error that says so, not an abort. With one (the
    /// lent GPU machine runs the unit tests too), a group of one rank reduces and broadcasts
    /// CUDA tensors through NCCL in place, and CPU tensors through the ring.
    #[test]
    #[cfg_attr(not(lockstep_nccl), ignore = "built without the NCCL shim")]
    fn group_on_this_machine() -> Result<()> {
        let store = Arc::new(Store::server("127.0.0.1", 0, 1, Duration::from_secs(10))?);
        if !crate::train::setup::cuda_available() {
            let err = group_of_one(store).err().expect("no GPU here").to_string();
            assert!(
                err.contains("cannot create the NCCL process group"),
                "{err}"
            );
            assert!(
                err.to_lowercase().contains("gpu") || err.contains("CUDA"),
                "{err}"
            );
            return Ok(());
        }
        let mut g = group_of_one(store)?;
        let x = Tensor::arange(1000, (Kind::Float, Device::Cuda(0)));
        let before = x.copy();
        g.all_reduce_avg_tensor(&x)?;
        g.broadcast_tensor(&x, 0)?;
        assert!(x.equal(&before));
        let y = Tensor::arange(10, (Kind::BFloat16, Device::Cuda(0)));
        g.all_reduce_avg_tensor(&y)?;
        assert!(y.equal(&Tensor::arange(10, (Kind::BFloat16, Device::Cuda(0)))));
        let z = Tensor::ones([4], (Kind::Float, Device::Cpu));
        g.all_reduce_avg_tensor(&z)?;
        assert_eq!(z.sum(Kind::Float).double_value(&[]), 4.0);
        assert_eq!(g.all_reduce_max_f64(2.0)?, 2.0);
        g.barrier()?;
        // A collective the shim rejects is an error carrying libtorch's message.
        let strided = x.view([10, 100]).transpose(0, 1);
        let err = g.all_reduce_avg_tensor(&strided).unwrap_err().to_string();
        assert!(err.contains("NCCL all-reduce"), "{err}");
        Ok(())
    }
}
