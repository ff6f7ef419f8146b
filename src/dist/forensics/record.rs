//! What a rank's record holds: its collectives ([`Record`]) and its state at one moment
//! ([`Snapshot`]), as the recorder keeps them and the trace file stores them.

use super::clock::now_ms;
use crate::sys::phase::Phase;

/// Collectives kept per rank.
pub const HISTORY: usize = 32;

/// How a recorded collective went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Running,
    Done,
    Failed,
    TimedOut,
}

/// One collective.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    /// Its place among every collective this process recorded, the world's and its
    /// subgroups' (orders them; picks its slot in the trace file).
    pub id: u64,
    /// 1-based number of the collective in its group (every rank numbers alike, and as the
    /// group's own error messages do).
    pub seq: u64,
    /// "all-reduce", "broadcast", "barrier", ...; a subgroup's carry its tag,
    /// `reduce-scatter@shard0` (at most 32 bytes are kept in the trace file).
    pub op: String,
    pub bytes: u64,
    /// Wall-clock start, microseconds since the Unix epoch.
    pub start_us: u64,
    /// Duration in microseconds; for a running one, 0.
    pub dur_us: u64,
    pub outcome: Outcome,
}

/// A rank's state at one moment: what [`Forensics`](super::Forensics) holds and what the trace
/// file stores.
#[derive(Debug, Clone, PartialEq)]
pub struct Snapshot {
    pub rank: usize,
    pub pid: u32,
    /// The SIGUSR1 handler is installed (until then SIGUSR1 would kill the process).
    pub ready: bool,
    pub phase: Phase,
    /// When the current phase began, milliseconds since the Unix epoch.
    pub phase_since_ms: u64,
    /// The last completed optimizer step (the run's global step number; 0 before the first).
    pub step: u64,
    /// Optimizer steps this process completed (0 until its first step after a (re)start).
    pub steps_here: u64,
    /// Oldest first; only the last can be running.
    pub records: Vec<Record>,
}

impl Record {
    /// The world's collectives: those the ranks' numbers can be compared on.
    pub fn in_world(&self) -> bool {
        !self.op.contains('@')
    }
}

impl Snapshot {
    pub(super) fn new(rank: usize) -> Snapshot {
        Snapshot {
            rank,
            pid: std::process::id(),
            ready: false,
            phase: Phase::Startup,
            phase_since_ms: now_ms(),
            step: 0,
            steps_here: 0,
            records: Vec::new(),
        }
    }

    /// The world group's collectives (the ranks' numbers compare there), oldest first.
    fn world(&self) -> impl DoubleEndedIterator<Item = &Record> {
        self.records.iter().filter(|r| r.in_world())
    }

    /// The last collective of the world group this rank finished.
    pub fn last_completed(&self) -> Option<&Record> {
        self.world().rev().find(|r| r.outcome == Outcome::Done)
    }

    /// The world group's collective this rank is in or gave up on, if its last one did not
    /// finish.
    pub fn unfinished(&self) -> Option<&Record> {
        self.world().last().filter(|r| r.outcome != Outcome::Done)
    }

    /// The number of the last collective of the world group this rank entered (0 = none).
    pub fn entered(&self) -> u64 {
        self.world().last().map_or(0, |r| r.seq)
    }

    /// Whether this rank gave up on a collective (of the world group or a subgroup), and
    /// whether by timing out.
    pub fn gave_up(&self) -> Option<Outcome> {
        self.records
            .last()
            .map(|r| r.outcome)
            .filter(|o| matches!(o, Outcome::Failed | Outcome::TimedOut))
    }
}
