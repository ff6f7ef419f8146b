//! Starting from a working directory that was deleted: oneMKL, linked into libtorch_cpu, calls
//! `getcwd` in its library constructor and aborts the process ("Intel oneMKL FATAL ERROR: Cannot
//! load libtorch_cpu.so") when it fails, before `main` runs. [`step_out`] runs first (from the
//! executable's `.preinit_array`, which the loader runs before any shared library's
//! constructors): when the working directory is gone it keeps a handle on it and moves to `/`
//! for the libraries' start-up; [`step_back`], first thing in `main`, returns to it, so relative
//! paths mean what they meant (and fail as they would) while `--version` and `env` work.

use std::sync::atomic::{AtomicI32, Ordering};

/// The deleted working directory, open, while the process stands in `/`; -1 otherwise.
static LEFT: AtomicI32 = AtomicI32::new(-1);

/// For `.preinit_array`: leaves a deleted working directory for `/` (see the module docs).
pub extern "C" fn step_out() {
    let mut buf = [0 as libc::c_char; 4096];
    // SAFETY: getcwd writes at most buf.len() bytes into our buffer; open/chdir take C strings
    // we own. Only libc is called: this runs before Rust's runtime is set up.
    unsafe {
        if !libc::getcwd(buf.as_mut_ptr(), buf.len()).is_null()
            || *libc::__errno_location() != libc::ENOENT
        {
            return;
        }
        let fd = libc::open(
            c".".as_ptr(),
            libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC,
        );
        if fd >= 0 && libc::chdir(c"/".as_ptr()) == 0 {
            LEFT.store(fd, Ordering::SeqCst);
        } else if fd >= 0 {
            libc::close(fd);
        }
    }
}

/// Returns to the working directory [`step_out`] left, if it did.
pub fn step_back() {
    let fd = LEFT.swap(-1, Ordering::SeqCst);
    if fd >= 0 {
        // SAFETY: fd is the directory descriptor step_out opened and nothing else uses.
        unsafe {
            libc::fchdir(fd);
            libc::close(fd);
        }
    }
}
