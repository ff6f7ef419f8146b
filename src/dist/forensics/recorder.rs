//! [`Forensics`]: one rank's recorder of its phase and its last collectives.

use std::collections::VecDeque;
use std::sync::{Mutex, MutexGuard};
use std::time::Instant;

use super::clock::{now_ms, now_us};
use super::record::{Outcome, Record, Snapshot, HISTORY};
use super::render::render;
use super::trace;
use crate::sys::phase::Phase;

/// One rank's recorder. The process-wide one is installed by [`install`](super::install);
/// tests make their own.
pub struct Forensics {
    pub(super) state: Mutex<State>,
}

pub(super) struct State {
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
    pub(super) reported: bool,
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

    pub(super) fn lock(&self) -> MutexGuard<'_, State> {
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
    pub(super) fn set_ready(&self) {
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
