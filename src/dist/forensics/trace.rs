//! The trace file: one rank's [`Snapshot`] in a fixed binary layout, memory-mapped by the rank
//! (updates are plain stores: no system call per collective) and read with `read(2)` by the
//! launcher on the same node. The page cache keeps what the rank wrote, so the file is as
//! readable while the rank is SIGSTOPped as after it was SIGKILLed.
//!
//! Layout (little-endian):
//! ```text
//! 0   magic "LSTRACE1"        8   pid u32        12  rank u32
//! 16  ready u32               20  phase u32      24  phase_since_ms u64
//! 32  step u64                40  steps_here u64 48  last id written u64   56  reserved
//! 64  HISTORY records of 80 bytes, record of id i in slot i % HISTORY:
//!     0 id u64, 8 seq u64, 16 bytes u64, 24 start_us u64, 32 dur_us u64, 40 outcome u32,
//!     44 op length u32, 48 op (32 bytes, UTF-8, cut)
//! ```
//! A reader may catch a record half-written; it shows one odd line in a report, nothing worse.

use std::fs::OpenOptions;
use std::path::Path;

use anyhow::{bail, Context, Result};
use memmap2::MmapMut;

use super::record::{Outcome, Record, Snapshot, HISTORY};
use crate::sys::phase::Phase;

/// The variable through which `lockstep run` tells a worker where its trace file goes.
pub const TRACE_ENV: &str = "LOCKSTEP_TRACE";

const MAGIC: &[u8; 8] = b"LSTRACE2";
const HEADER: usize = 64;
const RECORD: usize = 80;
const OP_LEN: usize = 32;
/// Size of a trace file.
pub const SIZE: usize = HEADER + HISTORY * RECORD;

/// The writer's side: a mapped file.
pub struct TraceFile {
    map: MmapMut,
}

impl TraceFile {
    /// Creates (or empties) the trace file of `rank` at `path`.
    pub fn create(path: &Path, rank: usize) -> Result<TraceFile> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(path)
            .with_context(|| format!("{}: cannot create the rank's trace file", path.display()))?;
        file.set_len(SIZE as u64)?;
        // SAFETY: the file is ours (just created and sized); the launcher only reads it, and a
        // torn read there is tolerated (see the module docs).
        let map = unsafe { MmapMut::map_mut(&file) }
            .with_context(|| format!("{}: cannot map the trace file", path.display()))?;
        let mut t = TraceFile { map };
        t.put_u32(12, rank as u32);
        t.map[..8].copy_from_slice(MAGIC);
        Ok(t)
    }

    fn put_u32(&mut self, at: usize, v: u32) {
        self.map[at..at + 4].copy_from_slice(&v.to_le_bytes());
    }

    fn put_u64(&mut self, at: usize, v: u64) {
        self.map[at..at + 8].copy_from_slice(&v.to_le_bytes());
    }

    /// Everything but the records.
    pub fn write_header(&mut self, s: &Snapshot) {
        self.put_u32(8, s.pid);
        self.put_u32(12, s.rank as u32);
        self.put_u32(16, u32::from(s.ready));
        self.put_u32(20, s.phase.code());
        self.put_u64(24, s.phase_since_ms);
        self.put_u64(32, s.step);
        self.put_u64(40, s.steps_here);
    }

    /// Writes `r` into its slot, then makes it the newest.
    pub fn write_record(&mut self, r: &Record) {
        let at = HEADER + (r.id as usize % HISTORY) * RECORD;
        self.put_u64(at, r.id);
        self.put_u64(at + 8, r.seq);
        self.put_u64(at + 16, r.bytes);
        self.put_u64(at + 24, r.start_us);
        self.put_u64(at + 32, r.dur_us);
        self.put_u32(at + 40, outcome_code(r.outcome));
        let op = r.op.as_bytes();
        let n = op.len().min(OP_LEN);
        self.put_u32(at + 44, n as u32);
        self.map[at + 48..at + 48 + n].copy_from_slice(&op[..n]);
        let newest = u64::from_le_bytes(self.map[48..56].try_into().unwrap());
        if r.id > newest {
            self.put_u64(48, r.id);
        }
    }
}

fn outcome_code(o: Outcome) -> u32 {
    match o {
        Outcome::Running => 1,
        Outcome::Done => 2,
        Outcome::Failed => 3,
        Outcome::TimedOut => 4,
    }
}

fn outcome_of(code: u32) -> Option<Outcome> {
    Some(match code {
        1 => Outcome::Running,
        2 => Outcome::Done,
        3 => Outcome::Failed,
        4 => Outcome::TimedOut,
        _ => return None,
    })
}

/// Reads a trace file written by [`TraceFile`].
pub fn read(path: &Path) -> Result<Snapshot> {
    let b = std::fs::read(path).with_context(|| format!("{}: cannot read", path.display()))?;
    if b.len() < SIZE || &b[..8] != MAGIC {
        bail!("{}: not a lockstep trace file", path.display());
    }
    let u32_at = |at: usize| u32::from_le_bytes(b[at..at + 4].try_into().unwrap());
    let u64_at = |at: usize| u64::from_le_bytes(b[at..at + 8].try_into().unwrap());
    let newest = u64_at(48);
    let first = newest.saturating_sub(HISTORY as u64 - 1).max(1);
    let mut records = Vec::new();
    for id in first..=newest {
        let at = HEADER + (id as usize % HISTORY) * RECORD;
        let (Some(outcome), true) = (outcome_of(u32_at(at + 40)), u64_at(at) == id) else {
            continue; // before this process's first collective, or caught mid-write
        };
        let n = (u32_at(at + 44) as usize).min(OP_LEN);
        records.push(Record {
            id,
            seq: u64_at(at + 8),
            op: String::from_utf8_lossy(&b[at + 48..at + 48 + n]).into_owned(),
            bytes: u64_at(at + 16),
            start_us: u64_at(at + 24),
            dur_us: u64_at(at + 32),
            outcome,
        });
    }
    Ok(Snapshot {
        pid: u32_at(8),
        rank: u32_at(12) as usize,
        ready: u32_at(16) != 0,
        phase: Phase::from_code(u32_at(20)),
        phase_since_ms: u64_at(24),
        step: u64_at(32),
        steps_here: u64_at(40),
        records,
    })
}
