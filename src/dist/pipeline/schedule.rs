//! The schedules as data: for each pipeline rank, the list of actions it runs in one step, in
//! order. The runtime executes a list as it is; the timeline (`timeline.rs`) checks one against
//! the dependencies and times it.
//!
//! An action is a forward (`F`) or a backward (`B`) of one micro-batch on one stage, or with
//! `zbv` the two halves of a backward: the input gradient (`I`, what the previous stage waits
//! for) and the weight gradient (`W`, which nothing waits for and so fills the bubble).
//! Printed as torchtitan prints them: `2F5` is stage 2's forward of micro-batch 5.
//!
//! ## 1F1B (PipeDream-flush)
//! Rank r (stage r) of P runs w = min(P − 1 − r, m) warm-up forwards, then m − w times one
//! forward and one backward, then the w backwards left. At most P − r micro-batches are in
//! flight on stage r.
//!
//! ## Interleaved 1F1B (Megatron's virtual pipeline)
//! Rank r holds stages v·P + r, v < V, and runs m·V forwards and as many backwards. The k-th
//! forward is of micro-batch ⌊k/(P·V)⌋·P + k mod P on its stage ⌊k/P⌋ mod V; the k-th backward
//! the same micro-batch on its stage V − 1 − ⌊k/P⌋ mod V (groups of P micro-batches go through
//! one stage, then the next). Warm-up: min(2(P − 1 − r) + (V − 1)·P, m·V) forwards (the round
//! trip of micro-batch 0 to the last stage and back), then one forward and one backward in
//! turn, then the backwards left. m must be a multiple of P.
//!
//! ## ZB-V
//! Two stages per rank in a V (rank r holds stages r and 2P − 1 − r, chunks 0 and 1), each
//! backward split into I and W, in the pattern of the ZB paper's section 6 (as
//! `torch.distributed.pipelining`'s ScheduleZBVZeroBubble lays it out): on rank r, 2(P − r) − 1
//! forwards of chunk 0; r times a forward of chunk 1 and one of chunk 0; P − r times chunk 1's
//! F, I and W; then, while micro-batches are left, chunk 0's F (while there are more), I and W
//! and chunk 1's F, I and W; then r times the I of chunk 0 and of chunk 1, P − r times chunk
//! 0's I and its oldest W, and the Ws left (chunk 1's, then chunk 0's). With fewer than 2P − 1
//! micro-batches the pattern is laid out for 2P − 1 and the missing ones' actions dropped. At
//! most 2P micro-batch-stages are in flight on a rank: 1F1B's memory (P micro-batches of
//! stages twice as deep). The pattern is fixed, not timed: a greedy order built from the
//! actions' durations (the paper's alternative) was tried and dropped, because the order it
//! finds moves with the last digit of those durations (8 ranks, 32 micro-batches, an I twice a
//! forward: 5.2% of the step idle with the durations exactly 1:2:1, 12.3% at 1:1.995:1, where
//! this pattern stays at 5.2%; interleaved 1F1B with two stages per rank: 9.9%).

use std::fmt;

use anyhow::{bail, Result};

use super::stages::Pipeline;
use crate::config::PipelineSchedule;

/// What an action computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Op {
    /// The stage's forward of the micro-batch.
    Forward,
    /// The whole backward: the input gradient (sent to the previous stage) and the weights'.
    Backward,
    /// `zbv`: the input gradient only.
    BackwardInput,
    /// `zbv`: the weight gradient, after the micro-batch's `BackwardInput`.
    BackwardWeight,
}

impl Op {
    fn letter(self) -> char {
        match self {
            Op::Forward => 'F',
            Op::Backward => 'B',
            Op::BackwardInput => 'I',
            Op::BackwardWeight => 'W',
        }
    }
}

/// One action of a rank: `op` of micro-batch `micro` on stage `stage`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Action {
    pub op: Op,
    pub stage: usize,
    pub micro: usize,
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{}{}", self.stage, self.op.letter(), self.micro)
    }
}

/// A rank's list as one line: `0F0 0F1 0B0 …`.
pub fn line(actions: &[Action]) -> String {
    let words: Vec<String> = actions.iter().map(Action::to_string).collect();
    words.join(" ")
}

/// Every rank's actions for one step of `p`, rank by rank.
pub fn actions(p: &Pipeline) -> Result<Vec<Vec<Action>>> {
    Ok(match p.schedule {
        PipelineSchedule::OneFOneB => (0..p.ranks).map(|r| one_f_one_b(p, r)).collect(),
        PipelineSchedule::Interleaved => {
            if !p.micro_batches.is_multiple_of(p.ranks) {
                bail!(
                    "the interleaved schedule takes micro-batches in groups of the {} pipeline \
                     ranks, and a step has {} (training.grad_accum_nums)",
                    p.ranks,
                    p.micro_batches
                );
            }
            (0..p.ranks).map(|r| interleaved(p, r)).collect()
        }
        PipelineSchedule::Zbv => (0..p.ranks).map(|r| zbv(p, r)).collect(),
    })
}

fn act(op: Op, stage: usize, micro: usize) -> Action {
    Action { op, stage, micro }
}

/// 1F1B on rank (= stage) `r`.
fn one_f_one_b(p: &Pipeline, r: usize) -> Vec<Action> {
    let m = p.micro_batches;
    let warmup = (p.ranks - 1 - r).min(m);
    let mut out: Vec<Action> = (0..warmup).map(|i| act(Op::Forward, r, i)).collect();
    for k in 0..m - warmup {
        out.push(act(Op::Forward, r, warmup + k));
        out.push(act(Op::Backward, r, k));
    }
    out.extend((m - warmup..m).map(|i| act(Op::Backward, r, i)));
    out
}

/// Interleaved 1F1B on rank `r`.
fn interleaved(p: &Pipeline, r: usize) -> Vec<Action> {
    let (ranks, v, m) = (p.ranks, p.per_rank, p.micro_batches);
    let total = m * v;
    let micro = |k: usize| k / (ranks * v) * ranks + k % ranks;
    let forward = |k: usize| act(Op::Forward, (k / ranks % v) * ranks + r, micro(k));
    let backward = |k: usize| act(Op::Backward, (v - 1 - k / ranks % v) * ranks + r, micro(k));
    let warmup = (2 * (ranks - 1 - r) + (v - 1) * ranks).min(total);
    let mut out: Vec<Action> = (0..warmup).map(forward).collect();
    for k in 0..total - warmup {
        out.push(forward(warmup + k));
        out.push(backward(k));
    }
    out.extend((total - warmup..total).map(backward));
    out
}

/// ZB-V on rank `r`, as the module docs define it.
fn zbv(p: &Pipeline, r: usize) -> Vec<Action> {
    let (ranks, m) = (p.ranks, p.micro_batches);
    let n = m.max(2 * ranks - 1);
    let (c0, c1) = (r, 2 * ranks - 1 - r);
    let (mut f0, mut f1, mut b0, mut b1) = (0, 0, 0, 0);
    let mut out = Vec::new();
    let mut push = |op, stage, micro: &mut usize| {
        out.push(act(op, stage, *micro));
        *micro += 1;
    };
    for _ in 0..2 * (ranks - r) - 1 {
        push(Op::Forward, c0, &mut f0);
    }
    for _ in 0..r {
        push(Op::Forward, c1, &mut f1);
        push(Op::Forward, c0, &mut f0);
    }
    for _ in 0..ranks - r {
        push(Op::Forward, c1, &mut f1);
        let mut w = b1;
        push(Op::BackwardInput, c1, &mut b1);
        push(Op::BackwardWeight, c1, &mut w);
    }
    while f1 < f0 || f0 < n {
        if f0 < n {
            push(Op::Forward, c0, &mut f0);
        }
        let mut w = b0;
        push(Op::BackwardInput, c0, &mut b0);
        push(Op::BackwardWeight, c0, &mut w);
        push(Op::Forward, c1, &mut f1);
        let mut w = b1;
        push(Op::BackwardInput, c1, &mut b1);
        push(Op::BackwardWeight, c1, &mut w);
    }
    let (mut w0, mut w1) = (b0, b1);
    for _ in 0..r {
        push(Op::BackwardInput, c0, &mut b0);
        push(Op::BackwardInput, c1, &mut b1);
    }
    for _ in 0..ranks - r {
        push(Op::BackwardInput, c0, &mut b0);
        push(Op::BackwardWeight, c0, &mut w0);
    }
    while w1 < b1 {
        push(Op::BackwardWeight, c1, &mut w1);
    }
    while w0 < b0 {
        push(Op::BackwardWeight, c0, &mut w0);
    }
    out.retain(|a| a.micro < m);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pipe(ranks: usize, schedule: PipelineSchedule, v: usize, m: usize) -> Pipeline {
        Pipeline::new(ranks, schedule, v, m)
    }

    #[test]
    fn one_f_one_b_is_warm_up_steady_state_and_cool_down() {
        let lists = actions(&pipe(4, PipelineSchedule::OneFOneB, 1, 6)).unwrap();
        assert_eq!(
            line(&lists[0]),
            "0F0 0F1 0F2 0F3 0B0 0F4 0B1 0F5 0B2 0B3 0B4 0B5"
        );
        assert_eq!(
            line(&lists[2]),
            "2F0 2F1 2B0 2F2 2B1 2F3 2B2 2F4 2B3 2F5 2B4 2B5"
        );
        assert_eq!(
            line(&lists[3]),
            "3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3F4 3B4 3F5 3B5"
        );
        // Fewer micro-batches than ranks: all forwards, then all backwards.
        let short = actions(&pipe(4, PipelineSchedule::OneFOneB, 1, 2)).unwrap();
        assert_eq!(line(&short[0]), "0F0 0F1 0B0 0B1");
    }

    #[test]
    fn interleaved_goes_through_a_stage_in_groups_of_p_micro_batches() {
        let lists = actions(&pipe(2, PipelineSchedule::Interleaved, 2, 4)).unwrap();
        // Rank 0 holds stages 0 and 2: warm-up 2·1 + 1·2 = 4 forwards.
        assert_eq!(
            line(&lists[0]),
            "0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3"
        );
        // Rank 1 holds stages 1 and 3: warm-up 2 forwards.
        assert_eq!(
            line(&lists[1]),
            "1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3"
        );
        let e = actions(&pipe(4, PipelineSchedule::Interleaved, 2, 6)).unwrap_err();
        assert!(
            e.to_string().contains("groups of the 4 pipeline ranks"),
            "{e}"
        );
    }

    #[test]
    fn zbv_turns_around_on_rank_0_and_splits_every_backward() {
        let p = pipe(2, PipelineSchedule::Zbv, 1, 4);
        let lists = actions(&p).unwrap();
        for (r, list) in lists.iter().enumerate() {
            assert_eq!(list.len(), 3 * 2 * 4, "rank {r}: {}", line(list));
            for a in list {
                assert_eq!(p.rank_of(a.stage), r);
                assert_ne!(a.op, Op::Backward);
            }
        }
        // Rank 0 (stages 0 and 3): 3 forwards of chunk 0, 2 × chunk 1's F, I, W, then the
        // steady pairs and the cool-down; rank 1 (stages 1 and 2): 1 forward, one of each
        // chunk, chunk 1's F, I, W once, ….
        assert_eq!(
            line(&lists[0]),
            "0F0 0F1 0F2 3F0 3I0 3W0 3F1 3I1 3W1 0F3 0I0 0W0 3F2 3I2 3W2 0I1 0W1 3F3 3I3 3W3 \
             0I2 0W2 0I3 0W3"
        );
        assert_eq!(
            line(&lists[1]),
            "1F0 2F0 1F1 2F1 2I0 2W0 1F2 1I0 1W0 2F2 2I1 2W1 1F3 1I1 1W1 2F3 2I2 2W2 1I2 2I3 \
             1I3 1W2 2W3 1W3"
        );
    }
}
