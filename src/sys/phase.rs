//! What this process is doing right now: one marker, set with [`enter`] by the trainer, the
//! train step and the model as they go, and read by whoever needs it — the out-of-memory report
//! ([`super::oom`]: "out of memory in backward") and the hang forensics (`dist::forensics`:
//! "rank 1 is stuck in reduce"), which mirrors it into the rank's trace file through the
//! observer it registers. One enum, so the two always speak of the same phases.

use std::sync::OnceLock;

/// The phases of a rank's life. The first four are its own work (see [`Phase::busy`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Assembling the step's micro-batches (and the step's start).
    Data,
    /// A micro-batch's forward pass (for the LM head: a chunk's logits and loss).
    Forward,
    /// A micro-batch's backward pass (with activation checkpointing, the recomputation too).
    Backward,
    /// Clipping, AdamW, zeroing gradients (a sharded optimizer's all-gather included).
    Optimizer,
    /// Before the first step: rendezvous, data, resume.
    Startup,
    /// Gradient synchronisation and the step's agreements across ranks.
    Reduce,
    /// Writing a checkpoint.
    Checkpoint,
    /// The validation loss.
    Eval,
    /// After the last step: the final barrier and summary.
    Finish,
    /// Allocating and initialising (or loading) the parameters and the optimizer state.
    ModelBuild,
}

impl Phase {
    /// Every phase, in the order of their codes (the trace files store the code).
    pub const ALL: [Phase; 10] = [
        Phase::Data,
        Phase::Forward,
        Phase::Backward,
        Phase::Optimizer,
        Phase::Startup,
        Phase::Reduce,
        Phase::Checkpoint,
        Phase::Eval,
        Phase::Finish,
        Phase::ModelBuild,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Phase::Data => "data",
            Phase::Forward => "forward",
            Phase::Backward => "backward",
            Phase::Optimizer => "optimizer",
            Phase::Startup => "startup",
            Phase::Reduce => "reduce",
            Phase::Checkpoint => "checkpoint",
            Phase::Eval => "validation",
            Phase::Finish => "finish",
            Phase::ModelBuild => "model build",
        }
    }

    pub fn code(self) -> u32 {
        Phase::ALL.iter().position(|&p| p == self).unwrap_or(0) as u32
    }

    pub fn from_code(code: u32) -> Phase {
        Phase::ALL
            .get(code as usize)
            .copied()
            .unwrap_or(Phase::Startup)
    }

    /// The rank's own work, as opposed to waiting for the others or for the disk.
    pub fn busy(self) -> bool {
        matches!(
            self,
            Phase::Data | Phase::Forward | Phase::Backward | Phase::Optimizer
        )
    }
}

impl std::fmt::Display for Phase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

static OBSERVER: OnceLock<fn(Phase)> = OnceLock::new();
/// `debug.inject_oom`'s check at every entry, once armed (`sys::oom::arm` registers it, so this
/// module does not depend on that one).
static INJECT: OnceLock<fn(Phase)> = OnceLock::new();

thread_local! {
    /// The phase this thread entered last: what an allocation failure on this thread is
    /// reported in, whatever other threads (tests, a communication thread) entered meanwhile.
    /// Other threads see phase changes through the observer (the hang forensics' trace).
    static ON_THIS_THREAD: std::cell::Cell<Phase> = const { std::cell::Cell::new(Phase::Startup) };
}

/// Marks the start of `p`. If `debug.inject_oom` armed this phase, it fails here, once, with a
/// real allocation failure (the hook `sys::oom::arm` registers).
pub fn enter(p: Phase) {
    ON_THIS_THREAD.with(|c| c.set(p));
    if let Some(observe) = OBSERVER.get() {
        observe(p);
    }
    if let Some(inject) = INJECT.get() {
        inject(p);
    }
}

/// Registers the process's one fault-injection hook, run at every [`enter`].
pub fn inject_on_enter(f: fn(Phase)) {
    let _ = INJECT.set(f);
}

/// The phase entered last on this thread.
pub fn current() -> Phase {
    ON_THIS_THREAD.with(std::cell::Cell::get)
}

/// Registers the process's one observer of phase changes (the hang forensics' trace).
pub fn observe(f: fn(Phase)) {
    let _ = OBSERVER.set(f);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip() {
        for p in Phase::ALL {
            assert_eq!(Phase::from_code(p.code()), p);
        }
        enter(Phase::Reduce);
        assert_eq!(current(), Phase::Reduce);
    }
}
