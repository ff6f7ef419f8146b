//! One layout's estimate: its memory and its step.

use serde::Serialize;

use super::memory::{self, Memory};
use super::setting::{Layout, Setting};
use super::step::StepTime;

/// One layout's estimate.
#[derive(Debug, Clone, Serialize)]
pub struct Estimate {
    pub layout: Layout,
    pub memory: Memory,
    pub total_bytes: f64,
    pub fits: bool,
    /// Seconds per step: computation plus communication that is not overlapped.
    pub step_seconds: f64,
    /// What the step's seconds are spent on.
    pub time: StepTime,
    /// Scaling efficiency among the setting's ranks: computation over the step.
    pub efficiency: f64,
}

pub fn estimate(s: &Setting, l: &Layout) -> Estimate {
    let memory = memory::estimate(s, l);
    let total = memory.total();
    let time = StepTime::of(s, l, s.world);
    Estimate {
        layout: *l,
        memory,
        total_bytes: total,
        fits: total <= s.budget,
        step_seconds: time.total(),
        time,
        efficiency: time.efficiency(),
    }
}
