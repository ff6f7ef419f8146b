//! Hang forensics: what every rank was doing when a run stopped making progress.
//!
//! Each rank keeps its current *phase* (data, forward, backward, reduce, optimizer, checkpoint,
//! ...) and a ring buffer of its last [`HISTORY`] collectives: operation, number, bytes, start,
//! duration, outcome.
//! - Collectives are recorded in one place, [`Traced`]: [`crate::dist::init`] wraps every
//!   multi-rank process group in it, so every collective of every backend passes through it.
//! - The phase is set with one-line calls to `sys::phase::enter` from the trainer, the train
//!   step and the model; [`install`] registers this module as its observer.
//!
//! The record is read three ways:
//! - a rank whose collective fails (a timeout, a peer gone) prints it to its log, once;
//! - SIGUSR1 makes a rank print it and carry on (a watcher thread does the printing);
//! - under `lockstep run` every rank mirrors it into a small memory-mapped file
//!   (`logs/<run>/rank_N.trace`, see [`trace`]) that the launcher reads even while the rank is
//!   stopped or after it was killed: the launcher's hang report, and its restart rule for
//!   ranks that fail before their first step, come from there.

mod signal;
pub mod trace;
mod traced;

use std::collections::VecDeque;
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use anyhow::Result;

pub use trace::TRACE_ENV;
pub use traced::Traced;

/// Collectives kept per rank.
pub const HISTORY: usize = 32;

pub use crate::sys::phase::Phase;

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

/// A rank's state at one moment: what [`Forensics`] holds and what the trace file stores.
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
    fn new(rank: usize) -> Snapshot {
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

/// One rank's recorder. The process-wide one is installed by [`install`]; tests make their own.
pub struct Forensics {
    state: Mutex<State>,
}

struct State {
    tag: String,
    snap: Snapshot,
    records: VecDeque<Record>,
    /// Number the world group's next collective gets.
    next_seq: u64,
    /// Each subgroup's next number.
    group_seq: std::collections::HashMap<String, u64>,
    /// The next record's [`Record::id`].
    next_id: u64,
    phase_started: Instant,
    /// Seconds spent in each phase (indexed by `Phase::code`), current phase excluded.
    phase_time: [f64; Phase::ALL.len()],
    file: Option<trace::TraceFile>,
    /// The history was printed after a failed collective (once is enough).
    reported: bool,
}

impl State {
    fn snapshot(&self) -> Snapshot {
        Snapshot {
            records: self.records.iter().cloned().collect(),
            ..self.snap.clone()
        }
    }

    fn write_header(&mut self) {
        if let Some(f) = self.file.as_mut() {
            f.write_header(&self.snap);
        }
    }

    fn write_record(&mut self, r: &Record) {
        if let Some(f) = self.file.as_mut() {
            f.write_record(r);
        }
    }
}

impl Forensics {
    /// A recorder for `rank` whose lines carry `tag`, mirrored into `file` when given.
    pub fn new(rank: usize, tag: &str, file: Option<trace::TraceFile>) -> Forensics {
        let f = Forensics {
            state: Mutex::new(State {
                tag: tag.to_owned(),
                snap: Snapshot::new(rank),
                records: VecDeque::with_capacity(HISTORY),
                next_seq: 1,
                group_seq: Default::default(),
                next_id: 1,
                phase_started: Instant::now(),
                phase_time: [0.0; Phase::ALL.len()],
                file,
                reported: false,
            }),
        };
        f.lock().write_header();
        f
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic elsewhere must not take the forensics of the failure down with it.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The rank's tag (`[GPU3]`), as its lines start.
    pub fn tag(&self) -> String {
        self.lock().tag.clone()
    }

    pub fn set_phase(&self, phase: Phase) {
        let mut s = self.lock();
        if s.snap.phase == phase {
            return;
        }
        let old = s.snap.phase.code() as usize;
        s.phase_time[old] += s.phase_started.elapsed().as_secs_f64();
        s.phase_started = Instant::now();
        s.snap.phase = phase;
        s.snap.phase_since_ms = now_ms();
        s.write_header();
    }

    /// The run continues after step `step` (a resume), which this process did not take.
    pub fn resumed_at(&self, step: usize) {
        let mut s = self.lock();
        s.snap.step = step as u64;
        s.write_header();
    }

    /// Optimizer step `step` (the global number) is complete.
    pub fn step_done(&self, step: usize) {
        let mut s = self.lock();
        s.snap.step = step as u64;
        s.snap.steps_here += 1;
        s.write_header();
    }

    /// Marks the SIGUSR1 handler installed.
    fn set_ready(&self) {
        let mut s = self.lock();
        s.snap.ready = true;
        s.write_header();
    }

    /// Numbers the next collective `seq` (to continue the numbering of collectives made before
    /// the recorder was attached, so the history and the ring's error messages agree).
    pub fn continue_numbering_at(&self, seq: u64) {
        let mut s = self.lock();
        s.next_seq = s.next_seq.max(seq);
    }

    /// Records the start of a collective of the world group; returns its id for
    /// [`Forensics::end`].
    pub fn begin(&self, op: &str, bytes: u64) -> u64 {
        self.begin_in(None, op, bytes)
    }

    /// Records the start of a collective of subgroup `group` (None: the world group), numbered
    /// in its group; returns its id for [`Forensics::end`].
    pub fn begin_in(&self, group: Option<&str>, op: &str, bytes: u64) -> u64 {
        let mut s = self.lock();
        let (seq, op) = match group {
            None => {
                s.next_seq += 1;
                (s.next_seq - 1, op.to_owned())
            }
            Some(g) => {
                let next = s.group_seq.entry(g.to_owned()).or_insert(1);
                *next += 1;
                (*next - 1, format!("{op}@{g}"))
            }
        };
        let id = s.next_id;
        s.next_id += 1;
        let r = Record {
            id,
            seq,
            op,
            bytes,
            start_us: now_us(),
            dur_us: 0,
            outcome: Outcome::Running,
        };
        if s.records.len() == HISTORY {
            s.records.pop_front();
        }
        s.write_record(&r);
        s.records.push_back(r);
        id
    }

    /// Records how the collective `id` ([`Forensics::begin`]) ended. On the first timeout,
    /// returns the history to print (a peer that died is explained by the launcher; a hang
    /// needs every rank's side).
    pub fn end(&self, id: u64, outcome: Outcome) -> Option<String> {
        let mut s = self.lock();
        let idx = s.records.iter().rposition(|r| r.id == id)?;
        let mut r = s.records[idx].clone();
        r.outcome = outcome;
        r.dur_us = now_us().saturating_sub(r.start_us);
        s.write_record(&r);
        s.records[idx] = r.clone();
        if outcome != Outcome::TimedOut || std::mem::replace(&mut s.reported, true) {
            return None;
        }
        let headline = format!(
            "Hang forensics: {} #{} timed out; this rank's phase and its last collectives:",
            r.op, r.seq
        );
        Some(render(&s.snapshot(), &s.tag, &headline, now_ms()))
    }

    pub fn snapshot(&self) -> Snapshot {
        self.lock().snapshot()
    }

    /// The snapshot as the lines a rank prints, headed by `headline`.
    pub fn render(&self, headline: &str) -> String {
        let s = self.lock();
        render(&s.snapshot(), &s.tag, headline, now_ms())
    }

    /// Seconds this rank has spent on its own work (data, forward, backward, optimizer) since
    /// it started, as opposed to waiting in collectives, checkpoints or validation: what tells
    /// a straggler from the ranks that wait for it.
    pub fn busy_seconds(&self) -> f64 {
        let s = self.lock();
        let done: f64 = Phase::ALL
            .iter()
            .filter(|p| p.busy())
            .map(|p| s.phase_time[p.code() as usize])
            .sum();
        let current = if s.snap.phase.busy() {
            s.phase_started.elapsed().as_secs_f64()
        } else {
            0.0
        };
        done + current
    }
}

static GLOBAL: OnceLock<Forensics> = OnceLock::new();

/// Installs this process's recorder for `rank` (lines tagged `tag`): mirrored into the trace
/// file named by `LOCKSTEP_TRACE` when the launcher set it, and printed on SIGUSR1. A second
/// call (tests run several trainings in one process) starts a fresh record.
pub fn install(rank: usize, tag: &str) -> Result<&'static Forensics> {
    let file = match std::env::var_os(TRACE_ENV) {
        Some(path) => Some(trace::TraceFile::create(std::path::Path::new(&path), rank)?),
        None => None,
    };
    crate::sys::phase::observe(on_phase);
    let fresh = Forensics::new(rank, tag, file);
    let global = match GLOBAL.get() {
        Some(g) => {
            let new = fresh.state.into_inner().unwrap_or_else(|e| e.into_inner());
            *g.lock() = new;
            g
        }
        None => GLOBAL.get_or_init(|| fresh),
    };
    signal::install(global)?;
    global.set_ready();
    Ok(global)
}

/// The process's recorder, once [`install`]ed.
pub fn global() -> Option<&'static Forensics> {
    GLOBAL.get()
}

/// Mirrors a phase change into the installed recorder (registered with `sys::phase` by
/// [`install`]).
fn on_phase(p: Phase) {
    if let Some(f) = GLOBAL.get() {
        f.set_phase(p);
    }
}

/// The run continues after step `step` (see [`Forensics::resumed_at`]).
pub fn resumed_at(step: usize) {
    if let Some(f) = GLOBAL.get() {
        f.resumed_at(step);
    }
}

/// Optimizer step `step` is complete (see [`Forensics::step_done`]).
pub fn step_done(step: usize) {
    if let Some(f) = GLOBAL.get() {
        f.step_done(step);
    }
}

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Microseconds since the Unix epoch.
pub fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

/// `hh:mm:ss.mmm` (UTC) of a Unix time in milliseconds: enough to line up several ranks' logs.
pub fn clock(ms: u64) -> String {
    let s = ms / 1000;
    format!(
        "{:02}:{:02}:{:02}.{:03} UTC",
        (s / 3600) % 24,
        (s / 60) % 60,
        s % 60,
        ms % 1000
    )
}

/// `0 B`, `4 B`, `1.25 MB`.
pub fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 4] = ["KB", "MB", "GB", "TB"];
    if n < 1000 {
        return format!("{n} B");
    }
    let mut x = n as f64;
    let mut unit = "B";
    for u in UNITS {
        if x < 1000.0 {
            break;
        }
        x /= 1000.0;
        unit = u;
    }
    format!("{x:.2} {unit}")
}

/// A duration in seconds as `3.1 ms` or `6.02 s`.
pub fn human_secs(s: f64) -> String {
    if s < 1.0 {
        format!("{:.1} ms", s * 1000.0)
    } else {
        format!("{s:.2} s")
    }
}

/// What a record's outcome column says.
pub fn describe(r: &Record, now_ms: u64) -> String {
    let took = r.dur_us as f64 / 1e6;
    match r.outcome {
        Outcome::Done => format!("took {}", human_secs(took)),
        Outcome::Failed => format!("failed after {}", human_secs(took)),
        Outcome::TimedOut => format!("timed out after {}", human_secs(took)),
        Outcome::Running => format!(
            "running for {}",
            human_secs(now_ms.saturating_sub(r.start_us / 1000) as f64 / 1000.0)
        ),
    }
}

/// The lines a rank prints about itself, each tagged.
pub fn render(snap: &Snapshot, tag: &str, headline: &str, now_ms: u64) -> String {
    let mut out = format!("{tag} {headline}\n");
    let since = now_ms.saturating_sub(snap.phase_since_ms) as f64 / 1000.0;
    out += &format!(
        "{tag}   phase {} for {} (since {}), after step {} ({} step{} done by this process)\n",
        snap.phase.name(),
        human_secs(since),
        clock(snap.phase_since_ms),
        snap.step,
        snap.steps_here,
        if snap.steps_here == 1 { "" } else { "s" }
    );
    if snap.records.is_empty() {
        out += &format!("{tag}   no collective yet\n");
        return out;
    }
    out += &format!(
        "{tag}   last {} collective{}, oldest first:\n",
        snap.records.len(),
        if snap.records.len() == 1 { "" } else { "s" }
    );
    for r in &snap.records {
        out += &format!(
            "{tag}     #{:<6} {:<24} {:>10}  started {}  {}\n",
            r.seq,
            r.op,
            human_bytes(r.bytes),
            clock(r.start_us / 1000),
            describe(r, now_ms)
        );
    }
    out
}

#[cfg(test)]
mod tests;
