//! A pipeline's shape and the arithmetic of its stages (the module docs of `pipeline` say
//! how layers are cut and stages placed).

use std::ops::Range;

use crate::config::PipelineSchedule;

/// A pipeline's shape: ranks, stages per rank, schedule and micro-batches per step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pipeline {
    /// P: ranks along the pipeline (`system.pipeline_parallel`).
    pub ranks: usize,
    /// Stages each rank holds: 1 (`1f1b`), V (`interleaved`), 2 (`zbv`).
    pub per_rank: usize,
    pub schedule: PipelineSchedule,
    /// m: micro-batches per step and data rank (`training.grad_accum_nums`).
    pub micro_batches: usize,
}

impl Pipeline {
    /// P ranks with `schedule`; `virtual_stages` counts only for `interleaved`.
    pub fn new(
        ranks: usize,
        schedule: PipelineSchedule,
        virtual_stages: usize,
        micro_batches: usize,
    ) -> Pipeline {
        Pipeline {
            ranks: ranks.max(1),
            per_rank: schedule.stages_per_rank(virtual_stages),
            schedule,
            micro_batches: micro_batches.max(1),
        }
    }

    /// The pipeline `cfg` asks for.
    pub fn of(cfg: &crate::config::Config) -> Pipeline {
        let s = &cfg.system;
        Pipeline::new(
            s.pipeline_parallel,
            s.pipeline_schedule,
            s.virtual_stages,
            cfg.training.grad_accum_nums,
        )
    }

    /// S: stages in all.
    pub fn stages(&self) -> usize {
        self.ranks * self.per_rank
    }

    /// Whether backward runs as two actions, the input gradient and then the weight gradient
    /// (`zbv`), rather than one.
    pub fn splits_backward(&self) -> bool {
        self.schedule == PipelineSchedule::Zbv
    }

    /// The pipeline rank that holds `stage`.
    pub fn rank_of(&self, stage: usize) -> usize {
        let p = self.ranks;
        match self.schedule {
            PipelineSchedule::Zbv if stage >= p => 2 * p - 1 - stage,
            _ => stage % p,
        }
    }

    /// The stages `rank` holds, in ascending order.
    pub fn stages_of(&self, rank: usize) -> Vec<usize> {
        let p = self.ranks;
        match self.schedule {
            PipelineSchedule::Zbv => vec![rank, 2 * p - 1 - rank],
            _ => (0..self.per_rank).map(|v| v * p + rank).collect(),
        }
    }

    /// The decoder layers of each stage, for a model of `layers` (at least one per stage: the
    /// config check refuses more stages than layers).
    pub fn layers(&self, layers: usize) -> Vec<Range<usize>> {
        let stages = self.stages();
        let (base, extra) = (layers / stages, layers % stages);
        let mut start = 0;
        (0..stages)
            .map(|s| {
                let n = base + usize::from(s >= 1 && s <= extra);
                start += n;
                start - n..start
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layers_are_cut_contiguously_with_the_remainder_inside() {
        let p = Pipeline::new(4, PipelineSchedule::OneFOneB, 1, 8);
        assert_eq!(p.layers(8), [0..2, 2..4, 4..6, 6..8]);
        assert_eq!(p.layers(10), [0..2, 2..5, 5..8, 8..10]);
        assert_eq!(p.layers(11), [0..2, 2..5, 5..8, 8..11]);
        assert_eq!(p.layers(4), [0..1, 1..2, 2..3, 3..4]);
        // Llama-3.1-405B's 126 layers on 8 ranks × 2 virtual stages.
        let v = Pipeline::new(8, PipelineSchedule::Interleaved, 2, 32);
        let cut = v.layers(126);
        assert_eq!(cut.len(), 16);
        assert_eq!(
            (cut[0].len(), cut[1].len(), cut[14].len(), cut[15].len()),
            (7, 8, 8, 7)
        );
        assert_eq!(cut.last().unwrap().end, 126);
    }

    #[test]
    fn stages_are_placed_as_each_schedule_defines() {
        let one = Pipeline::new(4, PipelineSchedule::OneFOneB, 1, 8);
        assert_eq!(one.stages_of(2), [2]);
        let inter = Pipeline::new(4, PipelineSchedule::Interleaved, 3, 8);
        assert_eq!(inter.stages(), 12);
        assert_eq!(inter.stages_of(1), [1, 5, 9]);
        let v = Pipeline::new(4, PipelineSchedule::Zbv, 1, 8);
        assert_eq!(v.stages(), 8);
        assert_eq!(v.stages_of(0), [0, 7]);
        assert_eq!(v.stages_of(3), [3, 4]);
        for p in [one, inter, v] {
            for s in 0..p.stages() {
                assert!(p.stages_of(p.rank_of(s)).contains(&s));
            }
        }
    }
}
