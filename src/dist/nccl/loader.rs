//! The NCCL shim (`csrc/nccl_group.cpp`) and its entry points.
//!
//! build.rs compiles the shim into a small shared library linked against libtorch_cuda, and the
//! binary embeds it. A CUDA rank writes it to an anonymous memory file (or, where those may not
//! be executable, a private temp file removed after loading) and dlopens it, so the binary stays
//! one file and CPU runs never load the CUDA stack.

use std::ffi::{c_char, c_int, c_void};

use anyhow::{anyhow, bail, Result};

#[cfg(lockstep_nccl)]
use crate::sys::ffi::Library;
use crate::sys::ffi::{call, take_c_string};

// The shim's signatures (csrc/nccl_group.cpp); the error convention is crate::sys::ffi's: an
// int status and the `char** err` message out-parameter last.
pub(super) type NewFn = unsafe extern "C" fn(
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
pub(super) type TensorOpFn =
    unsafe extern "C" fn(*mut c_void, *mut c_void, c_int, *mut *mut c_char) -> c_int;
/// (group, flat tensor, splits, number of splits, err): the uneven collectives.
pub(super) type PiecesFn =
    unsafe extern "C" fn(*mut c_void, *mut c_void, *const i64, c_int, *mut *mut c_char) -> c_int;
/// (group, flat tensor, splits, number of splits, op: 0 sum / 1 mean, err): the reduce-scatter.
pub(super) type ScatterFn = unsafe extern "C" fn(
    *mut c_void,
    *mut c_void,
    *const i64,
    c_int,
    c_int,
    *mut *mut c_char,
) -> c_int;
/// (group, output, input, output splits, input splits, number of ranks, err): the all-to-all
/// of rows.
pub(super) type AllToAllFn = unsafe extern "C" fn(
    *mut c_void,
    *mut c_void,
    *mut c_void,
    *const i64,
    *const i64,
    c_int,
    *mut *mut c_char,
) -> c_int;
pub(super) type VersionFn = unsafe extern "C" fn(*mut *mut c_char, *mut *mut c_char) -> c_int;
pub(super) type FreeFn = unsafe extern "C" fn(*mut c_void, c_int);

/// The shim's entry points, resolved once per process.
pub(super) struct Shim {
    pub(super) new: NewFn,
    pub(super) all_reduce: TensorOpFn,
    pub(super) broadcast: TensorOpFn,
    pub(super) reduce_scatter: ScatterFn,
    pub(super) all_gather: PiecesFn,
    pub(super) all_to_all: AllToAllFn,
    pub(super) version: VersionFn,
    pub(super) free: FreeFn,
}

#[cfg(lockstep_nccl)]
pub(super) static SHIM_IMAGE: &[u8] = include_bytes!(env!("LOCKSTEP_NCCL_SHIM"));

#[cfg(lockstep_nccl)]
const DLOPEN_FLAGS: c_int = libc::RTLD_NOW | libc::RTLD_LOCAL;

/// dlopens the embedded shim: from an anonymous memory file (nothing on disk), else, where
/// memfds may not be executable (vm.memfd_noexec) or /proc is missing, from a private temp file.
#[cfg(lockstep_nccl)]
fn open_embedded(image: &[u8]) -> Result<Library, String> {
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
        let path = format!("/proc/self/fd/{fd}");
        match Library::open_path(std::path::Path::new(&path), DLOPEN_FLAGS) {
            Ok(h) => return Ok(h),
            Err(e) => {
                memfd_err = e;
                break;
            }
        }
    }
    open_from_temp_file(image).map_err(|e| format!("{memfd_err}; {e}"))
}

/// The fallback: the image in a private temp directory, loaded, then deleted (the mapping
/// outlives the file).
#[cfg(lockstep_nccl)]
pub(super) fn open_from_temp_file(image: &[u8]) -> Result<Library, String> {
    let dir = tempfile::Builder::new()
        .prefix("lockstep-nccl-")
        .tempdir()
        .map_err(|e| format!("no temp dir for the NCCL shim: {e}"))?;
    let path = dir.path().join("liblockstep_nccl.so");
    std::fs::write(&path, image).map_err(|e| format!("{}: {e}", path.display()))?;
    Library::open_path(&path, DLOPEN_FLAGS).map_err(|e| format!("{}: {e}", path.display()))
}

#[cfg(lockstep_nccl)]
fn load() -> Result<Shim, String> {
    let lib = open_embedded(SHIM_IMAGE)?;
    let missing = |e: String| format!("NCCL shim: {e}");
    // SAFETY: each symbol is the extern "C" function of csrc/nccl_group.cpp with exactly the
    // signature of the field it is read into.
    unsafe {
        Ok(Shim {
            new: lib.function(c"ls_nccl_new").map_err(missing)?,
            all_reduce: lib.function(c"ls_nccl_all_reduce").map_err(missing)?,
            broadcast: lib.function(c"ls_nccl_broadcast").map_err(missing)?,
            reduce_scatter: lib.function(c"ls_nccl_reduce_scatter").map_err(missing)?,
            all_gather: lib.function(c"ls_nccl_all_gather").map_err(missing)?,
            all_to_all: lib.function(c"ls_nccl_all_to_all").map_err(missing)?,
            version: lib.function(c"ls_nccl_version").map_err(missing)?,
            free: lib.function(c"ls_nccl_free").map_err(missing)?,
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

/// The shim, loaded on first use; the outcome is kept for the process.
pub(super) fn shim() -> Result<&'static Shim> {
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
    let mut out: *mut c_char = std::ptr::null_mut();
    // SAFETY: both out-pointers are valid for the call.
    call(|err| unsafe { (s.version)(&mut out, err) })
        .map_err(|e| anyhow!("cannot read the NCCL version: {e}"))?;
    // SAFETY: on success `out` is a malloc'd string that we now own.
    Ok(unsafe { take_c_string(out) }.unwrap_or_else(|| "unknown".to_owned()))
}
