//! SIGUSR1: print this rank's snapshot and carry on.
//!
//! The handler only writes one byte into a pipe (async-signal-safe); a watcher thread blocked
//! on the other end renders the snapshot and writes it to stderr in one `write`, so its lines
//! stay together in the rank's log. The watcher works while the main thread is busy or blocked
//! in a collective, which is when a snapshot is wanted.

use std::io::Write;
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::Once;

use anyhow::{bail, Result};

use super::recorder::Forensics;

/// Write end of the pipe, for the handler; -1 before installation.
static WAKE: AtomicI32 = AtomicI32::new(-1);

extern "C" fn on_usr1(_: libc::c_int) {
    let fd = WAKE.load(Ordering::Relaxed);
    if fd < 0 {
        return;
    }
    // SAFETY: errno is thread-local and saved/restored around write(2), which is
    // async-signal-safe; the byte lives on this stack frame for the call.
    unsafe {
        let errno = *libc::__errno_location();
        let byte = 1u8;
        libc::write(fd, (&byte as *const u8).cast(), 1);
        *libc::__errno_location() = errno;
    }
}

/// Starts the watcher (once per process) and installs the handler. The watcher always prints
/// the process's current recorder, so a reinstalled recorder needs nothing new here.
pub(super) fn install(forensics: &'static Forensics) -> Result<()> {
    static ONCE: Once = Once::new();
    let mut result = Ok(());
    ONCE.call_once(|| result = start(forensics));
    result
}

fn start(forensics: &'static Forensics) -> Result<()> {
    let mut fds = [0 as libc::c_int; 2];
    // SAFETY: pipe2 fills the two descriptors of `fds`.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        bail!(
            "creating the SIGUSR1 pipe: {}",
            std::io::Error::last_os_error()
        );
    }
    let (read_end, write_end) = (fds[0], fds[1]);
    std::thread::Builder::new()
        .name("lockstep-sigusr1".into())
        .spawn(move || watch(read_end, forensics))?;
    WAKE.store(write_end, Ordering::SeqCst);
    // SAFETY: a zeroed sigaction is a valid "no flags, empty mask"; the handler only touches an
    // atomic, errno and write(2).
    unsafe {
        let mut action: libc::sigaction = std::mem::zeroed();
        action.sa_sigaction = on_usr1 as *const () as libc::sighandler_t;
        action.sa_flags = libc::SA_RESTART;
        libc::sigemptyset(&mut action.sa_mask);
        if libc::sigaction(libc::SIGUSR1, &action, std::ptr::null_mut()) != 0 {
            bail!(
                "installing the SIGUSR1 handler: {}",
                std::io::Error::last_os_error()
            );
        }
    }
    Ok(())
}

fn watch(read_end: libc::c_int, forensics: &'static Forensics) {
    let mut byte = 0u8;
    loop {
        // SAFETY: reads one byte into `byte`, which outlives the call.
        let n = unsafe { libc::read(read_end, (&mut byte as *mut u8).cast(), 1) };
        if n < 0 && std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
            continue;
        }
        if n <= 0 {
            return;
        }
        let text = forensics.render("Snapshot on SIGUSR1 (training continues):");
        let _ = std::io::stderr().lock().write_all(text.as_bytes());
    }
}
