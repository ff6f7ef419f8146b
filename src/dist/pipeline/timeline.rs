//! A schedule run against its dependencies: each rank takes its actions in its list's order,
//! each starting when the rank is free and what it depends on has finished (plus the link's
//! time where that was on another rank). This is the check that a schedule is one — every
//! action exactly once on the rank of its stage, each micro-batch's forward before its
//! backward, no rank waiting forever — and, with each action's seconds, the step's length,
//! each rank's idle share (the bubble) and the activations each rank keeps at its peak.
//!
//! Dependencies: stage s's forward of micro-batch i waits for stage s − 1's; its backward (or
//! input gradient) waits for its own forward and for stage s + 1's backward (input gradient)
//! of i; a weight gradient waits for the input gradient. A stage keeps its activations of
//! micro-batch i from the start of its forward to the end of its backward (weight gradient).

use anyhow::{bail, Result};

use super::schedule::{line, Action, Op};
use super::stages::Pipeline;

/// How long each kind of action takes, relative to one another (what a timeline charges).
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

/// What a timeline charges: the seconds of each action, the seconds an activation or its
/// gradient takes from one rank to the next, and the bytes (or any measure) of the
/// activations a stage keeps for one micro-batch.
pub struct Costs<'a> {
    pub seconds: &'a dyn Fn(Action) -> f64,
    pub link: f64,
    pub kept: &'a dyn Fn(usize) -> f64,
}

impl Costs<'static> {
    /// Unit forwards, backwards twice as long (input and weight gradients one each), no link
    /// time, one unit kept per stage and micro-batch: the textbook model.
    pub fn units() -> Costs<'static> {
        Costs {
            seconds: &|a: Action| Durations::UNITS.of(a.op),
            link: 0.0,
            kept: &|_| 1.0,
        }
    }
}

/// A schedule's run.
#[derive(Debug, Clone, PartialEq)]
pub struct Timeline {
    /// From the first action's start to the last one's end.
    pub makespan: f64,
    /// Each rank's seconds of work.
    pub busy: Vec<f64>,
    /// Each rank's peak of kept activations (in `Costs::kept`'s measure).
    pub peak_kept: Vec<f64>,
    /// Each rank's peak count of (stage, micro-batch) activations kept at once.
    pub peak_in_flight: Vec<usize>,
}

impl Timeline {
    /// The share of the step rank `r` is idle: 1 − its work over the step's length.
    pub fn bubble(&self, r: usize) -> f64 {
        1.0 - self.busy[r] / self.makespan
    }

    /// The largest idle share of any rank.
    pub fn worst_bubble(&self) -> f64 {
        (0..self.busy.len())
            .map(|r| self.bubble(r))
            .fold(0.0, f64::max)
    }
}

/// Where an action's time is kept in the flat tables: op, stage, micro-batch.
struct Slots {
    stages: usize,
    micro_batches: usize,
}

impl Slots {
    fn of(&self, a: Action) -> usize {
        let op = match a.op {
            Op::Forward => 0,
            Op::Backward => 1,
            Op::BackwardInput => 2,
            Op::BackwardWeight => 3,
        };
        (op * self.stages + a.stage) * self.micro_batches + a.micro
    }

    fn len(&self) -> usize {
        4 * self.stages * self.micro_batches
    }
}

/// Runs `lists` (one per pipeline rank of `p`) with `costs`; an error names what is wrong with
/// the lists.
pub fn run(p: &Pipeline, lists: &[Vec<Action>], costs: &Costs) -> Result<Timeline> {
    let slots = Slots {
        stages: p.stages(),
        micro_batches: p.micro_batches,
    };
    check_contents(p, lists, &slots)?;
    let stages = p.stages();
    // When each action started and finished (infinite until it has).
    let mut started = vec![f64::INFINITY; slots.len()];
    let mut finished = vec![f64::INFINITY; slots.len()];
    let mut next = vec![0usize; lists.len()];
    let mut free = vec![0.0f64; lists.len()];
    let grad = if p.splits_backward() {
        Op::BackwardInput
    } else {
        Op::Backward
    };
    // What `a` waits for (at most two actions) and whether each is on another rank.
    let deps = |a: Action| -> [Option<(Action, bool)>; 2] {
        let on = |s: usize| p.rank_of(s) != p.rank_of(a.stage);
        let at = |op: Op, stage: usize| Action {
            op,
            stage,
            micro: a.micro,
        };
        match a.op {
            Op::Forward if a.stage == 0 => [None, None],
            Op::Forward => [Some((at(Op::Forward, a.stage - 1), on(a.stage - 1))), None],
            Op::Backward | Op::BackwardInput => [
                Some((at(Op::Forward, a.stage), false)),
                (a.stage + 1 < stages).then(|| (at(grad, a.stage + 1), on(a.stage + 1))),
            ],
            Op::BackwardWeight => [Some((at(Op::BackwardInput, a.stage), false)), None],
        }
    };
    loop {
        let mut progressed = false;
        for (r, list) in lists.iter().enumerate() {
            'rank: while let Some(&a) = list.get(next[r]) {
                let mut ready = free[r];
                for (d, remote) in deps(a).into_iter().flatten() {
                    let t = finished[slots.of(d)];
                    if t.is_infinite() {
                        break 'rank;
                    }
                    ready = ready.max(t + if remote { costs.link } else { 0.0 });
                }
                started[slots.of(a)] = ready;
                free[r] = ready + (costs.seconds)(a);
                finished[slots.of(a)] = free[r];
                next[r] += 1;
                progressed = true;
            }
        }
        if next.iter().zip(lists).all(|(n, l)| *n == l.len()) {
            break;
        }
        if !progressed {
            let stuck: Vec<String> = lists
                .iter()
                .enumerate()
                .filter_map(|(r, l)| l.get(next[r]).map(|a| format!("rank {r} at {a}")))
                .collect();
            bail!(
                "the schedule deadlocks: {} wait for actions that never run",
                stuck.join(", ")
            );
        }
    }
    let makespan = free.iter().copied().fold(0.0, f64::max);
    let busy = lists
        .iter()
        .map(|l| l.iter().map(|&a| (costs.seconds)(a)).sum())
        .collect();
    // Kept activations: from a stage's forward's start to the end of the backward that frees
    // them; at equal times a release comes before an allocation.
    let release = if p.splits_backward() {
        Op::BackwardWeight
    } else {
        Op::Backward
    };
    let mut peak_kept = Vec::new();
    let mut peak_in_flight = Vec::new();
    for list in lists {
        let mut events: Vec<(f64, i8, f64)> = Vec::new();
        for &a in list {
            if a.op == Op::Forward {
                events.push((started[slots.of(a)], 1, (costs.kept)(a.stage)));
            } else if a.op == release {
                events.push((finished[slots.of(a)], -1, -(costs.kept)(a.stage)));
            }
        }
        events.sort_by(|x, y| x.0.total_cmp(&y.0).then(x.1.cmp(&y.1)));
        let (mut kept, mut most, mut count, mut most_count) = (0.0, 0.0f64, 0i64, 0i64);
        for (_, sign, bytes) in events {
            kept += bytes;
            count += i64::from(sign);
            most = most.max(kept);
            most_count = most_count.max(count);
        }
        peak_kept.push(most);
        peak_in_flight.push(most_count as usize);
    }
    Ok(Timeline {
        makespan,
        busy,
        peak_kept,
        peak_in_flight,
    })
}

/// Every action the schedule owes, exactly once, on the rank of its stage, each micro-batch's
/// forward before its backward (and input gradient before weight gradient) in the rank's
/// order.
fn check_contents(p: &Pipeline, lists: &[Vec<Action>], slots: &Slots) -> Result<()> {
    if lists.len() != p.ranks {
        bail!(
            "{} action lists for {} pipeline ranks",
            lists.len(),
            p.ranks
        );
    }
    let ops: &[Op] = if p.splits_backward() {
        &[Op::Forward, Op::BackwardInput, Op::BackwardWeight]
    } else {
        &[Op::Forward, Op::Backward]
    };
    let mut position = vec![usize::MAX; slots.len()];
    for (r, list) in lists.iter().enumerate() {
        for (i, &a) in list.iter().enumerate() {
            if !ops.contains(&a.op) || a.stage >= p.stages() || a.micro >= p.micro_batches {
                bail!("rank {r}: {a} is not an action of this schedule");
            }
            if p.rank_of(a.stage) != r {
                bail!("rank {r}: {a} belongs to rank {}", p.rank_of(a.stage));
            }
            let at = &mut position[slots.of(a)];
            if *at != usize::MAX {
                bail!("rank {r}: {a} twice in {}", line(list));
            }
            *at = i;
        }
    }
    for stage in 0..p.stages() {
        for micro in 0..p.micro_batches {
            let action = |op| Action { op, stage, micro };
            for &op in ops {
                if position[slots.of(action(op))] == usize::MAX {
                    bail!("rank {}: {} is missing", p.rank_of(stage), action(op));
                }
            }
            let order: Vec<usize> = ops
                .iter()
                .map(|&op| position[slots.of(action(op))])
                .collect();
            if order.windows(2).any(|w| w[0] > w[1]) {
                let names: Vec<String> = ops.iter().map(|&op| action(op).to_string()).collect();
                bail!(
                    "rank {}: stage {stage}'s micro-batch {micro} runs {} out of order",
                    p.rank_of(stage),
                    names.join(", ")
                );
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::schedule::actions;
    use super::*;
    use crate::config::PipelineSchedule;

    fn timeline(p: &Pipeline) -> Timeline {
        let lists = actions(p).unwrap();
        run(p, &lists, &Costs::units()).unwrap_or_else(|e| panic!("{p:?}: {e}"))
    }

    /// 1F1B: (m + P − 1) forward-backward times, P − r micro-batches in flight on stage r.
    #[test]
    fn one_f_one_b_takes_m_plus_p_minus_1_slots_and_keeps_p_minus_r() {
        for ranks in 1..=6 {
            for m in 1..=12 {
                let p = Pipeline::new(ranks, PipelineSchedule::OneFOneB, 1, m);
                let t = timeline(&p);
                assert_eq!(t.makespan, 3.0 * (m + ranks - 1) as f64, "P {ranks} m {m}");
                for r in 0..ranks {
                    assert_eq!(
                        t.peak_in_flight[r],
                        (ranks - r).min(m),
                        "P {ranks} m {m} r {r}"
                    );
                }
            }
        }
    }

    /// Interleaved 1F1B: the bubble is (P − 1) stage-times of one V-th of the model:
    /// (m·V + P − 1) chunk forward-backward times in all.
    #[test]
    fn interleaved_shrinks_the_bubble_v_times() {
        for ranks in [1, 2, 3, 4] {
            for v in [2, 3, 4] {
                for m in [ranks, 2 * ranks, 4 * ranks] {
                    let p = Pipeline::new(ranks, PipelineSchedule::Interleaved, v, m);
                    let t = timeline(&p);
                    let slots = (m * v + ranks - 1) as f64;
                    assert_eq!(t.makespan, 3.0 * slots, "P {ranks} V {v} m {m}");
                    let bound = 2 * (ranks - 1) + (v - 1) * ranks + 1;
                    assert!(
                        t.peak_in_flight[0] <= bound.min(m * v),
                        "P {ranks} V {v} m {m}"
                    );
                }
            }
        }
    }

    /// ZB-V: a valid schedule for any P and m, within 1F1B's activation memory (2P stages of
    /// half the depth), and with enough micro-batches a bubble well below 1F1B's.
    #[test]
    fn zbv_keeps_1f1b_memory_and_a_smaller_bubble() {
        for ranks in 1..=8 {
            for m in 1..=24 {
                let p = Pipeline::new(ranks, PipelineSchedule::Zbv, 1, m);
                let t = timeline(&p);
                for r in 0..ranks {
                    assert!(t.peak_in_flight[r] <= 2 * ranks, "P {ranks} m {m}: {t:?}");
                }
                let one = Pipeline::new(ranks, PipelineSchedule::OneFOneB, 1, m);
                let one_f_one_b = timeline(&one).worst_bubble();
                if m >= 2 * ranks && ranks > 1 {
                    assert!(
                        t.worst_bubble() < 0.5 * one_f_one_b,
                        "P {ranks} m {m}: ZB-V {} vs 1F1B {one_f_one_b}",
                        t.worst_bubble()
                    );
                }
            }
        }
    }

    /// With activation checkpointing an input gradient recomputes the forward first; ZB-V
    /// still idles less than interleaved 1F1B with two stages per rank, and by the same
    /// whether the durations are round or not (the figures the schedule's docs quote).
    #[test]
    fn zbv_beats_interleaved_under_recomputation_at_any_durations() {
        for recomputed in [1.0, 0.995] {
            let d = Durations::recomputing(recomputed);
            let seconds = move |a: Action| d.of(a.op);
            let costs = Costs {
                seconds: &seconds,
                link: 0.0,
                kept: &|_| 1.0,
            };
            let bubble = |schedule, v| {
                let p = Pipeline::new(8, schedule, v, 32);
                let lists = actions(&p).unwrap();
                run(&p, &lists, &costs).unwrap().worst_bubble()
            };
            let zbv = bubble(PipelineSchedule::Zbv, 1);
            let interleaved = bubble(PipelineSchedule::Interleaved, 2);
            assert!((zbv - 0.052).abs() < 1e-3, "{recomputed}: {zbv}");
            assert!(
                (interleaved - 0.099).abs() < 1e-3,
                "{recomputed}: {interleaved}"
            );
        }
    }

    #[test]
    fn a_broken_list_is_named() {
        let p = Pipeline::new(2, PipelineSchedule::OneFOneB, 1, 2);
        let mut lists = actions(&p).unwrap();
        // A backward before its forward.
        lists[1].swap(0, 1);
        let e = run(&p, &lists, &Costs::units()).unwrap_err().to_string();
        assert!(
            e.contains("stage 1's micro-batch 0 runs 1F0, 1B0 out of order"),
            "{e}"
        );
        let mut lists = actions(&p).unwrap();
        lists.pop();
        let e = run(&p, &lists, &Costs::units()).unwrap_err().to_string();
        assert!(e.contains("1 action lists for 2 pipeline ranks"), "{e}");
    }

    #[test]
    fn waiting_forever_is_a_deadlock() {
        let p = Pipeline::new(2, PipelineSchedule::OneFOneB, 1, 2);
        let f = |stage, micro| Action {
            op: Op::Forward,
            stage,
            micro,
        };
        let b = |stage, micro| Action {
            op: Op::Backward,
            stage,
            micro,
        };
        // Rank 1 takes micro-batch 1 first, rank 0 waits for micro-batch 0's backward before
        // it sends micro-batch 1.
        let lists = vec![
            vec![f(0, 0), b(0, 0), f(0, 1), b(0, 1)],
            vec![f(1, 1), b(1, 1), f(1, 0), b(1, 0)],
        ];
        let e = run(&p, &lists, &Costs::units()).unwrap_err().to_string();
        assert!(e.contains("deadlocks: rank 0 at 0B0, rank 1 at 1F1"), "{e}");
    }
}
