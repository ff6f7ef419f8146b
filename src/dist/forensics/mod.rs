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

mod clock;
mod record;
mod recorder;
mod render;
mod signal;
pub mod trace;
mod traced;

use std::sync::OnceLock;

use anyhow::Result;

pub use clock::{clock, now_ms, now_us};
pub use record::{Outcome, Record, Snapshot, HISTORY};
pub use recorder::Forensics;
pub use render::{describe, human_bytes, human_secs, render};
pub use trace::TRACE_ENV;
pub use traced::Traced;

pub use crate::sys::phase::Phase;

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

#[cfg(test)]
mod tests;
