//! Helpers for crossing the C ABI: the shims' error convention, C strings, `dlopen`.
//!
//! ## The shims' error convention (also in csrc/ffi_util.hpp)
//! Every function of csrc/*.cpp that can fail returns an `int` status, 0 for success; on failure
//! it also stores in its last parameter, `char** err`, a malloc'd NUL-terminated message that
//! the caller releases with `free()`. A status other than 0 may name an error class the caller
//! acts on (the store's timeout / address-in-use / network classes); 1 is "any other error".
//! No C++ exception crosses the boundary. Functions that cannot fail (destructors, accessors)
//! return their result directly. Every buffer a shim hands out is malloc'd and released with
//! `free()`.
//!
//! Rust calls such a function through [`call`], which owns the `err` message in every case.

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::path::Path;
use std::ptr::NonNull;

/// A shim function that reported failure: its status and message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct ShimError {
    /// The status the function returned (never 0); the shim's error class.
    pub status: c_int,
    /// Its message, or a note that it left none.
    pub message: String,
}

/// Calls a shim function that follows the convention above: `f` receives the `char** err`
/// out-parameter to pass on and returns the function's status.
pub fn call(f: impl FnOnce(*mut *mut c_char) -> c_int) -> Result<(), ShimError> {
    let mut err: *mut c_char = std::ptr::null_mut();
    let status = f(&mut err);
    // SAFETY: by the convention, `err` is NULL or a malloc'd NUL-terminated message that the
    // caller owns; it is taken exactly once, whatever the status (a message left beside a
    // success is freed, not leaked).
    let message = unsafe { take_c_string(err) };
    if status == 0 {
        return Ok(());
    }
    Err(ShimError {
        status,
        message: message.unwrap_or_else(|| format!("error {status} (the shim gave no message)")),
    })
}

/// Takes ownership of a malloc'd C string: copies it (lossily, as UTF-8) and frees it.
/// `None` for NULL.
///
/// # Safety
/// `p` is NULL or a NUL-terminated string allocated with `malloc` in this process, which
/// nothing else frees or uses afterwards.
pub unsafe fn take_c_string(p: *mut c_char) -> Option<String> {
    if p.is_null() {
        return None;
    }
    // SAFETY: by the contract, `p` is a live NUL-terminated string.
    let s = unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned();
    // SAFETY: malloc'd in this process and not used after this.
    unsafe { libc::free(p.cast()) };
    Some(s)
}

/// Copies a borrowed C string (lossily, as UTF-8); `None` for NULL.
///
/// # Safety
/// `p` is NULL or a NUL-terminated string that stays valid for the call.
pub unsafe fn copy_c_string(p: *const c_char) -> Option<String> {
    // SAFETY: by the contract.
    (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
}

/// The calling thread's last `dlopen`/`dlsym` error.
pub fn dlerror() -> String {
    // SAFETY: dlerror returns a thread-local NUL-terminated message (valid until the next dl*
    // call on this thread, and copied before that) or NULL.
    unsafe { copy_c_string(libc::dlerror()) }.unwrap_or_else(|| "unknown dlopen error".to_owned())
}

/// The address of `name` in the process's global scope: the binary and every library loaded
/// with `RTLD_GLOBAL` (libtorch_cuda, and the CUDA runtime and NCCL it brought in); `dlerror`'s
/// text when no loaded object defines it.
pub fn global_symbol(name: &CStr) -> Result<NonNull<c_void>, String> {
    // SAFETY: a NUL-terminated name; RTLD_DEFAULT searches the global scope.
    NonNull::new(unsafe { libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr()) }).ok_or_else(dlerror)
}

/// A loaded shared library. It stays loaded for the life of the process: the libraries loaded
/// here (libtorch_cuda, NVML, the NCCL shim) keep threads and registrations that outlive any
/// handle, and none documents unloading as safe.
#[derive(Debug, Clone, Copy)]
pub struct Library(NonNull<c_void>);

// SAFETY: a dlopen handle is a process-wide token; dlsym may be called from any thread.
unsafe impl Send for Library {}
// SAFETY: as above; `Library` has no interior state.
unsafe impl Sync for Library {}

impl Library {
    /// `dlopen(name, flags)` (a soname searched the usual way, or a path), with `dlerror`'s
    /// text as the error.
    pub fn open(name: &CStr, flags: c_int) -> Result<Library, String> {
        // SAFETY: a NUL-terminated name; dlopen has no other precondition.
        let h = unsafe { libc::dlopen(name.as_ptr(), flags) };
        NonNull::new(h).map(Library).ok_or_else(dlerror)
    }

    /// [`Library::open`] for a file path.
    pub fn open_path(path: &Path, flags: c_int) -> Result<Library, String> {
        let c = CString::new(path.as_os_str().as_encoded_bytes())
            .map_err(|_| format!("{}: a path with a NUL byte", path.display()))?;
        Self::open(&c, flags)
    }

    /// The function `name`, as the function-pointer type `F`.
    ///
    /// # Safety
    /// `F` must be the `unsafe extern "C" fn` type with exactly the symbol's C signature.
    pub unsafe fn function<F: Copy>(&self, name: &CStr) -> Result<F, String> {
        assert_eq!(
            std::mem::size_of::<F>(),
            std::mem::size_of::<*mut c_void>(),
            "Library::function needs a function-pointer type"
        );
        // SAFETY: a live handle and a NUL-terminated name.
        let p = unsafe { libc::dlsym(self.0.as_ptr(), name.as_ptr()) };
        if p.is_null() {
            return Err(format!("no symbol {name:?}: {}", dlerror()));
        }
        // SAFETY: `F` is a function pointer of the symbol's signature (the caller's contract),
        // and the sizes match (checked above).
        Ok(unsafe { std::mem::transmute_copy::<*mut c_void, F>(&p) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A malloc'd copy of `s`, as a shim would hand it out.
    fn malloced(s: &CStr) -> *mut c_char {
        // SAFETY: strdup of a NUL-terminated string.
        unsafe { libc::strdup(s.as_ptr()) }
    }

    #[test]
    fn call_maps_status_and_owns_the_message() {
        assert_eq!(call(|_| 0), Ok(()));
        let e = call(|err| {
            // SAFETY: `err` is the valid out-pointer `call` passes.
            unsafe { *err = malloced(c"store timed out") };
            2
        })
        .unwrap_err();
        assert_eq!((e.status, e.to_string().as_str()), (2, "store timed out"));
        let e = call(|_| 1).unwrap_err();
        assert_eq!(e.message, "error 1 (the shim gave no message)");
    }

    #[test]
    fn c_strings_are_copied_and_null_is_none() {
        // SAFETY: NULL, and a fresh malloc'd string we hand over.
        unsafe {
            assert_eq!(take_c_string(std::ptr::null_mut()), None);
            assert_eq!(take_c_string(malloced(c"héllo")).as_deref(), Some("héllo"));
            assert_eq!(copy_c_string(c"x".as_ptr()).as_deref(), Some("x"));
        }
    }

    #[test]
    fn dlopen_resolves_functions_and_reports_failures() {
        type Strlen = unsafe extern "C" fn(*const c_char) -> usize;
        let libc_so = Library::open(c"libc.so.6", libc::RTLD_NOW | libc::RTLD_LOCAL).unwrap();
        // SAFETY: strlen's C signature.
        let strlen: Strlen = unsafe { libc_so.function(c"strlen") }.unwrap();
        // SAFETY: a NUL-terminated string.
        assert_eq!(unsafe { strlen(c"four".as_ptr()) }, 4);
        // SAFETY: never called.
        let missing = unsafe { libc_so.function::<Strlen>(c"no_such_symbol_here") }.unwrap_err();
        assert!(missing.contains("no_such_symbol_here"), "{missing}");
        assert!(global_symbol(c"malloc").is_ok());
        let e = global_symbol(c"no_such_symbol_here").unwrap_err();
        assert!(e.contains("no_such_symbol_here"), "{e}");
        let e = Library::open(c"libno-such-library.so", libc::RTLD_NOW).unwrap_err();
        assert!(e.contains("libno-such-library.so"), "{e}");
        let e = Library::open_path(Path::new("/nonexistent/x.so"), libc::RTLD_NOW).unwrap_err();
        assert!(e.contains("/nonexistent/x.so"), "{e}");
    }
}
