//! Signal handling for the launcher: SIGINT/SIGTERM (stop the workers) and SIGUSR1 (a hang
//! report, and a snapshot from every worker, without stopping anything).
//!
//! The handler only bumps atomics (async-signal-safe); the supervision loop polls them. The
//! handlers are process-wide, so installation is reference-counted: the first [`Watch`]
//! installs them, the last one dropped restores what was there before. Each watch remembers
//! how many signals it has already seen, so concurrent launches (tests) all see every signal.

use std::sync::atomic::{AtomicI32, AtomicUsize, Ordering};
use std::sync::Mutex;

use anyhow::{bail, Result};

/// Signals the launcher handles.
const HANDLED: [libc::c_int; 3] = [libc::SIGINT, libc::SIGTERM, libc::SIGUSR1];

/// How many SIGINT/SIGTERMs arrived since the process started.
static COUNT: AtomicUsize = AtomicUsize::new(0);
/// How many SIGUSR1s arrived since the process started.
static USR1: AtomicUsize = AtomicUsize::new(0);
/// The most recent handled signal.
static LAST: AtomicI32 = AtomicI32::new(0);

/// Number of live watches and the dispositions to restore when the last one goes.
static INSTALLED: Mutex<(usize, Vec<(libc::c_int, libc::sigaction)>)> = Mutex::new((0, Vec::new()));

extern "C" fn on_signal(sig: libc::c_int) {
    // Only lock-free atomics here: anything else is not async-signal-safe.
    if sig == libc::SIGUSR1 {
        USR1.fetch_add(1, Ordering::SeqCst);
        return;
    }
    LAST.store(sig, Ordering::SeqCst);
    COUNT.fetch_add(1, Ordering::SeqCst);
}

/// Handlers installed for as long as this value lives.
pub(super) struct Watch {
    seen: AtomicUsize,
    seen_usr1: AtomicUsize,
}

impl Watch {
    /// Installs the handlers (if no other watch has) and starts counting from now.
    pub(super) fn install() -> Result<Watch> {
        let mut installed = INSTALLED.lock().unwrap_or_else(|e| e.into_inner());
        if installed.0 == 0 {
            let mut saved = Vec::new();
            for sig in HANDLED {
                match set_handler(sig) {
                    Ok(old) => saved.push((sig, old)),
                    Err(e) => {
                        restore(&saved);
                        return Err(e);
                    }
                }
            }
            installed.1 = saved;
        }
        installed.0 += 1;
        Ok(Watch {
            seen: AtomicUsize::new(COUNT.load(Ordering::SeqCst)),
            seen_usr1: AtomicUsize::new(USR1.load(Ordering::SeqCst)),
        })
    }

    /// Signals received since the last call: how many, and the latest one.
    pub(super) fn take(&self) -> Option<(usize, i32)> {
        let now = COUNT.load(Ordering::SeqCst);
        let before = self.seen.swap(now, Ordering::SeqCst);
        (now > before).then(|| (now - before, LAST.load(Ordering::SeqCst)))
    }

    /// Whether SIGUSR1 arrived since the last call.
    pub(super) fn take_usr1(&self) -> bool {
        let now = USR1.load(Ordering::SeqCst);
        self.seen_usr1.swap(now, Ordering::SeqCst) < now
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        let mut installed = INSTALLED.lock().unwrap_or_else(|e| e.into_inner());
        installed.0 -= 1;
        if installed.0 == 0 {
            restore(&installed.1);
            installed.1.clear();
        }
    }
}

fn set_handler(sig: libc::c_int) -> Result<libc::sigaction> {
    // SAFETY: zeroed sigaction is a valid "no flags, empty mask" value; the handler is an
    // extern "C" fn that only touches atomics; `old` receives the previous disposition.
    unsafe {
        let mut action: libc::sigaction = std::mem::zeroed();
        action.sa_sigaction = on_signal as *const () as libc::sighandler_t;
        // SA_RESTART: the launcher's blocking reads and sleeps simply continue.
        action.sa_flags = libc::SA_RESTART;
        libc::sigemptyset(&mut action.sa_mask);
        let mut old: libc::sigaction = std::mem::zeroed();
        if libc::sigaction(sig, &action, &mut old) != 0 {
            bail!(
                "installing the handler for signal {sig}: {}",
                std::io::Error::last_os_error()
            );
        }
        Ok(old)
    }
}

fn restore(saved: &[(libc::c_int, libc::sigaction)]) {
    for (sig, old) in saved {
        // SAFETY: `old` was filled in by sigaction for this very signal.
        unsafe {
            libc::sigaction(*sig, old, std::ptr::null_mut());
        }
    }
}
