//! SIGTERM/SIGINT during training: the first signal asks the loop to checkpoint and exit 0 at
//! the end of the current step (all ranks agree on the step through the loss all-reduce); a
//! second signal exits at once with 128 + signal.

use std::sync::atomic::{AtomicUsize, Ordering};

static SIGNALS: AtomicUsize = AtomicUsize::new(0);

extern "C" fn on_signal(sig: libc::c_int) {
    if SIGNALS.fetch_add(1, Ordering::SeqCst) >= 1 {
        // SAFETY: _exit is async-signal-safe.
        unsafe { libc::_exit(128 + sig) };
    }
}

/// Installs the handlers for SIGTERM and SIGINT.
pub fn install() {
    for sig in [libc::SIGTERM, libc::SIGINT] {
        // SAFETY: the handler only touches an atomic and calls _exit, both async-signal-safe.
        unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = on_signal as *const () as usize;
            libc::sigemptyset(&mut action.sa_mask);
            libc::sigaction(sig, &action, std::ptr::null_mut());
        }
    }
}

/// Whether a stop was requested on this process.
pub fn requested() -> bool {
    SIGNALS.load(Ordering::SeqCst) > 0
}
