//! Allocation failures as errors that name the phase they happened in.
//!
//! Design note. libtorch reports a failed allocation by throwing: the CPU allocator's
//! `DefaultCPUAllocator: can't allocate memory: you tried to allocate N bytes` and the CUDA
//! caching allocator's `CUDA out of memory. Tried to allocate …`. tch turns the exception into
//! a `TchError`; its `f_*` functions return it, but the model is written with the plain ones,
//! which `unwrap()` it — a panic, printed with a backtrace and exit code 101 (what a new user
//! met on the production preset). Rewriting every op of the model with `f_*` and `?` would make
//! it unreadable, and the fused AdamW and backward shims already return the message as an error.
//! So both forms are caught once, at the boundary of a phase ([`catch`]): a panic whose message
//! is libtorch's out-of-memory message is caught (`catch_unwind`; the panic hook stays quiet
//! for it), an error whose chain carries that message is recognised, and either becomes an
//! [`OutOfMemory`] naming the phase that was running. Any other panic unwinds as before: it is
//! a bug, and its backtrace is wanted.
//!
//! The phase is the process's marker ([`super::phase`]) the code sets as it goes ([`enter`]): the trainer around
//! model building and checkpoints, the model around its forward and backward, the step before
//! the optimizer. `debug.inject_oom` arms a phase ([`arm`]); entering it then allocates a
//! petabyte — a real failure from libtorch's allocator, not a simulated error.

use std::any::Any;
use std::cell::Cell;
use std::panic::{self, AssertUnwindSafe};
use std::sync::Once;

use tch::{Device, Kind, Tensor};

pub use super::phase::Phase;

thread_local! {
    /// `debug.inject_oom`: the phase to fail in, and the device to allocate on.
    static ARMED: Cell<Option<(Phase, Device)>> = const { Cell::new(None) };
    /// How many [`catch`] calls are running on this thread: inside one, the panic hook leaves
    /// out-of-memory panics to the caller's report.
    static CATCHING: Cell<usize> = const { Cell::new(0) };
    /// Resident bytes when the last out-of-memory panic was raised, before unwinding freed
    /// what the failed phase held.
    static RSS_AT_PANIC: Cell<Option<u64>> = const { Cell::new(None) };
}

/// Run by [`super::phase::enter`] once [`arm`] registered it: if `debug.inject_oom` armed
/// `phase` on this thread, fail here, once, with a real allocation failure.
fn on_enter(phase: Phase) {
    if let Some((armed, device)) = ARMED.with(Cell::get) {
        if armed == phase {
            ARMED.with(|a| a.set(None));
            // 2^48 fp32 elements = 1 PiB: more than any machine's memory, less than the
            // element-count overflow checks, so it reaches the allocator and fails there.
            let _ = Tensor::empty([1i64 << 48], (Kind::Float, device));
        }
    }
}

pub use super::phase::{current, enter};

/// `debug.inject_oom`: the next [`enter`] of `phase` on this thread fails to allocate.
pub fn arm(phase: Phase, device: Device) {
    super::phase::inject_on_enter(on_enter);
    ARMED.with(|a| a.set(Some((phase, device))));
}

/// Whether `message` is libtorch's report of a failed allocation (CPU or CUDA).
pub fn is_oom_message(message: &str) -> bool {
    message.contains("can't allocate memory")
        || message.contains("CUDA out of memory")
        || message.contains("CUDA error: out of memory")
}

/// An allocation failed while `phase` was running.
#[derive(Debug, Clone, thiserror::Error)]
#[error("out of memory in the {phase} phase: {message}")]
pub struct OutOfMemory {
    pub phase: Phase,
    /// Resident bytes of the process when the failure was raised (a panic: before unwinding
    /// released the phase's tensors; an error: when it was seen here).
    pub resident_bytes: Option<u64>,
    /// libtorch's message, first line only (the rest is a C++ backtrace or a hint about
    /// PYTORCH_CUDA_ALLOC_CONF that does not apply here).
    pub message: String,
}

impl OutOfMemory {
    fn new(phase: Phase, message: &str, resident_bytes: Option<u64>) -> OutOfMemory {
        let line = message
            .lines()
            .find(|l| is_oom_message(l))
            .unwrap_or(message);
        // tch's unwrap wraps it as `…: Torch("DefaultCPUAllocator: …`: keep libtorch's part.
        let start = ["DefaultCPUAllocator", "CUDA out of memory", "CUDA error"]
            .iter()
            .filter_map(|m| line.find(m))
            .min()
            .unwrap_or(0);
        let text = &line[start..];
        // …and cut where the Debug form goes on: an escaped newline or the closing `")`.
        let end = ["\\n", "\")"]
            .iter()
            .filter_map(|m| text.find(m))
            .min()
            .unwrap_or(text.len());
        OutOfMemory {
            phase,
            resident_bytes,
            message: text[..end].trim().to_string(),
        }
    }
}

/// Runs `f`. An allocation failure inside it comes back as an [`OutOfMemory`] error naming the
/// phase that was running: a panic from tch's unwrapping functions (caught here, with the panic
/// message left out of stderr) or an error whose chain carries libtorch's message. Other
/// panics and errors pass through unchanged.
pub fn catch<T>(f: impl FnOnce() -> anyhow::Result<T>) -> anyhow::Result<T> {
    install_hook();
    CATCHING.with(|c| c.set(c.get() + 1));
    let result = panic::catch_unwind(AssertUnwindSafe(f));
    CATCHING.with(|c| c.set(c.get() - 1));
    match result {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => {
            if e.downcast_ref::<OutOfMemory>().is_some() {
                return Err(e);
            }
            let chain = format!("{e:#}");
            if is_oom_message(&chain) {
                Err(OutOfMemory::new(current(), &chain, resident_bytes()).into())
            } else {
                Err(e)
            }
        }
        Err(payload) => match panic_message(payload.as_ref()) {
            Some(msg) if is_oom_message(&msg) => {
                let rss = RSS_AT_PANIC.with(|r| r.take()).or_else(resident_bytes);
                Err(OutOfMemory::new(current(), &msg, rss).into())
            }
            _ => panic::resume_unwind(payload),
        },
    }
}

/// VmRSS of this process (the hook cannot reach crate::telemetry, a layer above).
fn resident_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

fn panic_message(payload: &(dyn Any + Send)) -> Option<String> {
    payload
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
}

/// Keeps the default panic output for every panic except an out-of-memory one inside
/// [`catch`], which its caller reports.
fn install_hook() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let previous = panic::take_hook();
        panic::set_hook(Box::new(move |info| {
            let caught = CATCHING.with(Cell::get) > 0
                && panic_message(info.payload()).is_some_and(|m| is_oom_message(&m));
            if caught {
                RSS_AT_PANIC.with(|r| r.set(resident_bytes()));
            } else {
                previous(info);
            }
        }));
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_armed_phase_fails_with_libtorchs_allocation_error_and_is_caught() {
        arm(Phase::Backward, Device::Cpu);
        enter(Phase::Forward); // not the armed phase: nothing happens
        let e = catch(|| {
            enter(Phase::Backward);
            Ok(())
        })
        .unwrap_err();
        let oom = e.downcast_ref::<OutOfMemory>().expect("an OutOfMemory");
        assert_eq!(oom.phase, Phase::Backward);
        assert!(
            oom.message
                .starts_with("DefaultCPUAllocator: can't allocate memory"),
            "{}",
            oom.message
        );
        // Fired once: entering the phase again allocates nothing.
        catch(|| {
            enter(Phase::Backward);
            Ok(())
        })
        .unwrap();
    }

    #[test]
    fn an_error_carrying_the_message_is_recognised_and_others_pass() {
        enter(Phase::Optimizer);
        let e = catch::<()>(|| {
            Err(anyhow::anyhow!(
                "fused AdamW step failed: CUDA out of memory. Tried to allocate 2.00 GiB"
            ))
        })
        .unwrap_err();
        let oom = e.downcast_ref::<OutOfMemory>().unwrap();
        assert_eq!(oom.phase, Phase::Optimizer);
        assert_eq!(
            oom.message,
            "CUDA out of memory. Tried to allocate 2.00 GiB"
        );
        let e = catch::<()>(|| Err(anyhow::anyhow!("disk full"))).unwrap_err();
        assert!(e.downcast_ref::<OutOfMemory>().is_none());
    }

    #[test]
    fn other_panics_still_unwind() {
        let r = panic::catch_unwind(|| catch::<()>(|| panic!("index out of range")));
        assert!(r.is_err());
    }
}
