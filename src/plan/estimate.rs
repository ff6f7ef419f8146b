//! One layout's estimate: its memory and its step.

use serde::Serialize;

use super::memory::{self, Memory};
use super::pipeline::PipelinePlan;
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
    /// With pipeline stages: each rank's memory, the bubble and the sends (`pipeline.rs`;
    /// `memory` is then the rank with the most).
    pub pipeline: Option<PipelinePlan>,
}

pub fn estimate(s: &Setting, l: &Layout) -> Estimate {
    let (memory, time, pipeline) = if s.pipeline_parallel > 1 {
        let run = super::pipeline::run(s, l, s.world);
        (run.memory, run.time, Some(run.plan))
    } else {
        (memory::estimate(s, l), StepTime::of(s, l, s.world), None)
    };
    let total = memory.total();
    Estimate {
        layout: *l,
        memory,
        total_bytes: total,
        fits: total <= s.budget,
        step_seconds: time.total(),
        time,
        efficiency: time.efficiency(),
        pipeline,
    }
}
