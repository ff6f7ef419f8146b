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
//! Two stages per rank in a V, backward split into I and W. The order is built as the ZB
//! paper's heuristic builds it, from the actions' relative durations ([`Durations`]: with
//! activation checkpointing an input gradient recomputes the forward first): the ranks are
//! simulated, and whenever one is free it starts the first of these that is ready: a forward if
//! the rank keeps fewer than 2P micro-batch-stages of activations (1F1B's peak on its first
//! rank: P micro-batches of a stage twice as deep), the later stage first; an I (the oldest
//! micro-batch first, the later stage on a tie); else the oldest pending W. A stage's
//! activations are kept from its F to its W. Forwards first, up to the memory, is what keeps
//! the bubble small when an I is longer than a forward (it recomputes one under activation
//! checkpointing): 8 ranks, 32 micro-batches, I twice a forward: 5.2% of the step idle, 13.2%
//! with the I first (interleaved 1F1B with 2 stages per rank: 9.9%).

use std::collections::VecDeque;
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

/// How long each kind of action takes, relative to one another: what the ZB-V schedule is
/// built from (1F1B and interleaved do not depend on it).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Durations {
    pub forward: f64,
    /// The input gradient, with whatever is recomputed before it.
    pub input: f64,
    pub weight: f64,
}

impl Durations {
    /// The textbook model: a forward, an input gradient and a weight gradient alike.
    pub const UNITS: Durations = Durations {
        forward: 1.0,
        input: 1.0,
        weight: 1.0,
    };

    /// A forward and each of the two halves of a backward alike, plus `recomputed` forwards
    /// redone before the input gradient (activation checkpointing: 1 for full, the recomputed
    /// share of a forward for selective).
    pub fn recomputing(recomputed: f64) -> Durations {
        Durations {
            input: 1.0 + recomputed,
            ..Durations::UNITS
        }
    }

    /// The duration of `op`.
    pub fn of(&self, op: Op) -> f64 {
        match op {
            Op::Forward => self.forward,
            Op::Backward => self.input + self.weight,
            Op::BackwardInput => self.input,
            Op::BackwardWeight => self.weight,
        }
    }
}

/// Every rank's actions for one step of `p`, rank by rank; `d` is what ZB-V's order is built
/// from.
pub fn actions(p: &Pipeline, d: &Durations) -> Result<Vec<Vec<Action>>> {
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
        PipelineSchedule::Zbv => zbv(p, d)?,
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

/// ZB-V, built by the greedy of the module docs with each action's duration `d`.
fn zbv(p: &Pipeline, d: &Durations) -> Result<Vec<Vec<Action>>> {
    let (ranks, m, stages) = (p.ranks, p.micro_batches, p.stages());
    let cap = 2 * ranks;
    // When each stage's F and I of each micro-batch finish (infinite until started).
    let mut forward_done = vec![vec![f64::INFINITY; m]; stages];
    let mut input_done = vec![vec![f64::INFINITY; m]; stages];
    // The next micro-batch of each stage's F and I (each stage takes them in order).
    let mut next_forward = vec![0; stages];
    let mut next_input = vec![0; stages];
    let mut pending_weight: Vec<VecDeque<(usize, usize)>> = vec![VecDeque::new(); ranks];
    let mut kept = vec![0; ranks];
    let mut free = vec![0.0f64; ranks];
    let mut lists: Vec<Vec<Action>> = vec![Vec::new(); ranks];
    let mut left = 3 * stages * m;
    let held: Vec<Vec<usize>> = (0..ranks).map(|r| p.stages_of(r)).collect();
    while left > 0 {
        // The earliest moment a rank is free; every rank free by then may start an action.
        let now = free.iter().copied().fold(f64::INFINITY, f64::min);
        let mut started = false;
        for (r, list) in lists.iter_mut().enumerate() {
            if free[r] > now {
                continue;
            }
            let mine = &held[r];
            let input_ready = |s: usize| {
                let i = next_input[s];
                i < m
                    && forward_done[s][i] <= now
                    && (s + 1 == stages || input_done[s + 1][i] <= now)
            };
            let forward_ready = |s: usize| {
                let i = next_forward[s];
                i < m && (s == 0 || forward_done[s - 1][i] <= now)
            };
            let input = mine
                .iter()
                .copied()
                .filter(|&s| input_ready(s))
                .min_by_key(|&s| (next_input[s], std::cmp::Reverse(s)));
            let forward = mine
                .iter()
                .rev()
                .copied()
                .find(|&s| kept[r] < cap && forward_ready(s));
            let action = if let Some(s) = forward {
                let i = next_forward[s];
                next_forward[s] += 1;
                forward_done[s][i] = now + d.forward;
                kept[r] += 1;
                act(Op::Forward, s, i)
            } else if let Some(s) = input {
                let i = next_input[s];
                next_input[s] += 1;
                input_done[s][i] = now + d.input;
                pending_weight[r].push_back((s, i));
                act(Op::BackwardInput, s, i)
            } else if let Some((s, i)) = pending_weight[r].pop_front() {
                kept[r] -= 1;
                act(Op::BackwardWeight, s, i)
            } else {
                continue;
            };
            free[r] = now + d.of(action.op);
            list.push(action);
            left -= 1;
            started = true;
        }
        if started {
            continue;
        }
        // Nothing could start: the idle ranks wait for the next action to finish.
        let next = free
            .iter()
            .copied()
            .filter(|&t| t > now)
            .fold(f64::INFINITY, f64::min);
        if !next.is_finite() {
            bail!(
                "internal: the ZB-V schedule of {ranks} ranks and {m} micro-batches is stuck at \
                 {now}"
            );
        }
        for t in free.iter_mut().filter(|t| **t <= now) {
            *t = next;
        }
    }
    Ok(lists)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pipe(ranks: usize, schedule: PipelineSchedule, v: usize, m: usize) -> Pipeline {
        Pipeline::new(ranks, schedule, v, m)
    }

    #[test]
    fn one_f_one_b_is_warm_up_steady_state_and_cool_down() {
        let lists = actions(
            &pipe(4, PipelineSchedule::OneFOneB, 1, 6),
            &Durations::UNITS,
        )
        .unwrap();
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
        let short = actions(
            &pipe(4, PipelineSchedule::OneFOneB, 1, 2),
            &Durations::UNITS,
        )
        .unwrap();
        assert_eq!(line(&short[0]), "0F0 0F1 0B0 0B1");
    }

    #[test]
    fn interleaved_goes_through_a_stage_in_groups_of_p_micro_batches() {
        let lists = actions(
            &pipe(2, PipelineSchedule::Interleaved, 2, 4),
            &Durations::UNITS,
        )
        .unwrap();
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
        let e = actions(
            &pipe(4, PipelineSchedule::Interleaved, 2, 6),
            &Durations::UNITS,
        )
        .unwrap_err();
        assert!(
            e.to_string().contains("groups of the 4 pipeline ranks"),
            "{e}"
        );
    }

    #[test]
    fn zbv_turns_around_on_rank_0_and_splits_every_backward() {
        let p = pipe(2, PipelineSchedule::Zbv, 1, 4);
        let lists = actions(&p, &Durations::UNITS).unwrap();
        for (r, list) in lists.iter().enumerate() {
            assert_eq!(list.len(), 3 * 2 * 4, "rank {r}: {}", line(list));
            for a in list {
                assert_eq!(p.rank_of(a.stage), r);
                assert_ne!(a.op, Op::Backward);
            }
        }
        // Rank 0 starts with stage 0's forwards and is the first to take a backward (stage 3,
        // the last, is its own).
        assert_eq!(lists[0][0], act(Op::Forward, 0, 0));
        let first_input = lists[0].iter().find(|a| a.op == Op::BackwardInput).unwrap();
        assert_eq!(*first_input, act(Op::BackwardInput, 3, 0));
    }
}
