//! SIGTERM/SIGINT during training: the first signal asks the loop to checkpoint and exit 0 at
//! the end of the current step (all ranks agree on the step through the loss all-reduce); a
//! second signal exits at once with 128 + signal. Each says so on stderr (from the lead rank),
//! with the step it saves at or the steps a second signal loses. Once training has ended and
//! its last checkpoint is complete ([`finishing`]), only the experiment trackers are waited
//! for: a signal then says so, with the time left, and a second one exits 0 at once.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

/// Low 32 bits: the signals received. High 32 bits: the last step whose stop vote was cast
/// ([`requested`], read once per step before the ranks agree). One word, so that a signal
/// and the vote are ordered: a signal counted before the vote stops at the step in progress,
/// one after it at the next step, and the message says which.
static STATE: AtomicU64 = AtomicU64::new(0);
const COUNT: u64 = 0xffff_ffff;
/// The step being trained.
static STEP: AtomicUsize = AtomicUsize::new(0);
/// The step of the last complete checkpoint; `usize::MAX` while there is none.
static SAVED: AtomicUsize = AtomicUsize::new(usize::MAX);
/// This process speaks for the run (rank 0); the others stay silent.
static LEAD: AtomicBool = AtomicBool::new(false);
/// The rank's tag (`[CPU0]`), set before the handlers: the notice says which rank it is from
/// (srun tasks have no launcher to prefix their lines).
static TAG: std::sync::OnceLock<String> = std::sync::OnceLock::new();
/// Training has ended: the monotonic second until which the trackers are waited for (0 while
/// training).
static FINISHING_UNTIL: AtomicU64 = AtomicU64::new(0);

/// Seconds on the monotonic clock (clock_gettime is async-signal-safe).
fn monotonic_secs() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes into the timespec it is given.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64
}

extern "C" fn on_signal(sig: libc::c_int) {
    let name: &[u8] = if sig == libc::SIGINT {
        b"SIGINT"
    } else {
        b"SIGTERM"
    };
    let before = STATE.fetch_add(1, Ordering::SeqCst);
    let first = before & COUNT == 0;
    let until = FINISHING_UNTIL.load(Ordering::SeqCst);
    if until > 0 {
        if LEAD.load(Ordering::SeqCst) {
            let mut msg = Line::tagged();
            msg.push(b"lockstep: ");
            msg.push(name);
            if first {
                msg.push(
                    b": training has ended and its last checkpoint is complete; waiting up to ",
                );
                msg.number(until.saturating_sub(monotonic_secs()) as usize);
                msg.push(b" s more for the experiment trackers to take the last records; send it again to exit now\n");
            } else {
                msg.push(b" again: exiting now; training has ended and is saved (the trackers may miss their last records; metrics.jsonl has them)\n");
            }
            msg.write();
        }
        if !first {
            // SAFETY: _exit is async-signal-safe.
            unsafe { libc::_exit(0) };
        }
        return;
    }
    if LEAD.load(Ordering::SeqCst) {
        let mut msg = Line::tagged();
        msg.push(b"lockstep: ");
        msg.push(name);
        if first {
            let step = STEP.load(Ordering::SeqCst);
            msg.push(b": saving a checkpoint after step ");
            if stops_at_next(step, (before >> 32) as usize) {
                msg.number(step + 1);
                msg.push(b" (step ");
                msg.number(step);
                msg.push(b" is past the point where the ranks agree to stop)");
            } else {
                msg.number(step);
                msg.push(b" (the step in progress)");
            }
            msg.push(b", then exiting; send it again (Ctrl-C) to exit at once without saving\n");
        } else {
            msg.push(b" again: exiting now without saving; ");
            match SAVED.load(Ordering::SeqCst) {
                usize::MAX => msg.push(b"no checkpoint was completed, so every step is lost\n"),
                saved => {
                    msg.push(b"the steps after the last complete checkpoint (step ");
                    msg.number(saved);
                    msg.push(b") are lost; --resume auto continues from there\n");
                }
            }
        }
        msg.write();
    }
    if !first {
        // SAFETY: _exit is async-signal-safe.
        unsafe { libc::_exit(128 + sig) };
    }
}

/// The state word `w` once `step` has cast its stop vote.
fn voted(w: u64, step: usize) -> u64 {
    (step as u64 & COUNT) << 32 | w & COUNT
}

/// Whether a first signal during `step` stops after the next step: this step's stop vote
/// (the last one cast is `voted`) has already been cast without it.
fn stops_at_next(step: usize, voted: usize) -> bool {
    voted == step
}

/// A message built without allocating (signal handlers may not): a fixed buffer, written to
/// stderr with one write(2).
struct Line {
    buf: [u8; 256],
    len: usize,
}

impl Default for Line {
    fn default() -> Line {
        Line {
            buf: [0; 256],
            len: 0,
        }
    }
}

impl Line {
    /// A line that starts with the rank's tag (a plain OnceLock read: no allocation).
    fn tagged() -> Line {
        let mut line = Line::default();
        if let Some(tag) = TAG.get() {
            line.push(tag.as_bytes());
            line.push(b" ");
        }
        line
    }

    fn push(&mut self, bytes: &[u8]) {
        let n = bytes.len().min(self.buf.len() - self.len);
        self.buf[self.len..self.len + n].copy_from_slice(&bytes[..n]);
        self.len += n;
    }

    fn number(&mut self, mut v: usize) {
        let mut digits = [0u8; 20];
        let mut i = digits.len();
        loop {
            i -= 1;
            digits[i] = b'0' + (v % 10) as u8;
            v /= 10;
            if v == 0 {
                break;
            }
        }
        self.push(&digits[i..]);
    }

    fn write(&self) {
        // SAFETY: write(2) is async-signal-safe; the buffer outlives the call.
        unsafe { libc::write(2, self.buf.as_ptr().cast(), self.len) };
    }
}

/// Installs the handlers for SIGTERM and SIGINT; `lead` = this rank prints what a signal does,
/// its lines tagged `tag`.
pub fn install(lead: bool, tag: &str) {
    LEAD.store(lead, Ordering::SeqCst);
    let _ = TAG.set(tag.to_string());
    for sig in [libc::SIGTERM, libc::SIGINT] {
        // SAFETY: the handler touches atomics, a stack buffer, write(2) and _exit, all
        // async-signal-safe.
        unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = on_signal as *const () as usize;
            libc::sigemptyset(&mut action.sa_mask);
            libc::sigaction(sig, &action, std::ptr::null_mut());
        }
    }
}

/// What a signal's message names: the step being trained, and the last complete checkpoint.
pub fn progress(step: usize, saved: Option<usize>) {
    STEP.store(step, Ordering::SeqCst);
    SAVED.store(saved.unwrap_or(usize::MAX), Ordering::SeqCst);
}

/// Training has ended and its last checkpoint is complete; what is left is waiting up to
/// `wait` for the experiment trackers. From here a signal says so, and a second exits 0.
pub fn finishing(wait: Duration) {
    STATE.store(0, Ordering::SeqCst);
    FINISHING_UNTIL.store(monotonic_secs() + wait.as_secs().max(1), Ordering::SeqCst);
}

/// Whether a stop was requested on this process: the stop vote of the step in progress, read
/// once per step (a signal after it stops at the next step, and says so).
pub fn requested() -> bool {
    let step = STEP.load(Ordering::SeqCst);
    let before = STATE
        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |w| Some(voted(w, step)))
        .expect("the update always applies");
    before & COUNT > 0
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Finding 17 of round 5: a SIGTERM after a step's stop vote said "saving a checkpoint
    /// after step 2", then trained step 3 and saved step_3.
    #[test]
    fn a_signal_after_the_vote_names_the_next_step() {
        // (The statics are left alone: training tests in this binary vote concurrently.)
        let w = voted(0, 1);
        // A signal during step 2 before its vote: step 2 stops, as the message says.
        assert!(!stops_at_next(2, (w >> 32) as usize));
        assert!(voted(w + 1, 2) & COUNT > 0);
        // A signal after step 2's vote (which saw none): the message names step 3, whose vote
        // sees the signal.
        let w = voted(w, 2);
        assert_eq!(w & COUNT, 0);
        assert!(stops_at_next(2, (w >> 32) as usize));
        assert!(voted(w + 1, 3) & COUNT > 0);
    }

    #[test]
    fn lines_format_numbers_without_allocating() {
        let mut l = Line::default();
        l.push(b"step ");
        l.number(0);
        l.push(b" ");
        l.number(1234567);
        assert_eq!(&l.buf[..l.len], b"step 0 1234567");
        let mut full = Line::default();
        full.push(&[b'x'; 300]);
        assert_eq!(full.len, 256, "a long message is cut, not overflowed");
    }
}
