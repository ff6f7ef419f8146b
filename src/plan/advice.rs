//! The cheapest change that fits: every combination of the knobs that trade memory for time
//! (a smaller micro-batch with more accumulation, LM-head chunks, activation checkpointing,
//! a higher zero stage) is estimated, and of those that fit the one with the shortest
//! estimated step wins. Each knob only moves towards less memory; tokens per step stay the
//! same. The step-time model counts recomputed FLOPs and communication; a smaller micro-batch
//! has the same FLOPs but smaller matmuls, charged as 3% per halving (an assumption, stated in
//! the output).

use serde::Serialize;

use super::{estimate, Layout, Setting};
use crate::config::ZeroStage;
use crate::model::ActivationCheckpointing;

/// A layout to switch to, and what it would cost.
#[derive(Debug, Clone, Serialize)]
pub struct Change {
    pub layout: Layout,
    /// The `--set` overrides that turn the current layout into this one.
    pub sets: Vec<String>,
    pub total_bytes: f64,
    /// Estimated step time relative to the current layout's, minus one.
    pub slowdown: f64,
}

/// Charged per halving of the micro-batch.
const SMALLER_GEMM_PENALTY: f64 = 0.03;

fn strength(m: ActivationCheckpointing) -> u8 {
    match m {
        ActivationCheckpointing::None => 0,
        ActivationCheckpointing::Selective => 1,
        ActivationCheckpointing::Full => 2,
    }
}

/// Every layout that keeps the tokens per step and uses no more memory-hungry setting than
/// `current` on any knob.
fn candidates(s: &Setting, current: &Layout) -> Vec<Layout> {
    let chunk_rank = |c: usize| if c == 0 { usize::MAX } else { c };
    let mut chunks = vec![current.loss_chunk_tokens];
    for c in [1024, 256] {
        if c < chunk_rank(current.loss_chunk_tokens) {
            chunks.push(c);
        }
    }
    let modes: Vec<ActivationCheckpointing> = [
        ActivationCheckpointing::None,
        ActivationCheckpointing::Selective,
        ActivationCheckpointing::Full,
    ]
    .into_iter()
    .filter(|m| strength(*m) >= strength(current.activation_checkpointing))
    .collect();
    // Sharding only saves memory across ranks: alone, a rank keeps the stage it has.
    let stages: Vec<ZeroStage> = if s.world > 1 {
        ZeroStage::ALL
            .into_iter()
            .filter(|z| *z >= current.zero_stage)
            .collect()
    } else {
        vec![current.zero_stage]
    };
    let batches: Vec<usize> = (1..=current.batch)
        .filter(|b| current.batch.is_multiple_of(*b))
        .collect();
    let mut out = Vec::new();
    for &loss_chunk_tokens in &chunks {
        for &activation_checkpointing in &modes {
            for &zero_stage in &stages {
                for &batch in &batches {
                    out.push(Layout {
                        zero_stage,
                        activation_checkpointing,
                        loss_chunk_tokens,
                        batch,
                        grad_accum: current.grad_accum * current.batch / batch,
                    });
                }
            }
        }
    }
    out
}

fn sets(current: &Layout, to: &Layout) -> Vec<String> {
    let mut v = Vec::new();
    if to.batch != current.batch {
        v.push(format!("training.batch_size={}", to.batch));
        v.push(format!("training.grad_accum_nums={}", to.grad_accum));
    }
    if to.loss_chunk_tokens != current.loss_chunk_tokens {
        v.push(format!(
            "training.loss_chunk_tokens={}",
            to.loss_chunk_tokens
        ));
    }
    if to.activation_checkpointing != current.activation_checkpointing {
        v.push(format!(
            "training.activation_checkpointing={}",
            to.activation_checkpointing
        ));
    }
    if to.zero_stage != current.zero_stage {
        v.push(format!("system.zero_stage={}", to.zero_stage));
    }
    v
}

/// The cheapest layout whose estimate is at most `limit` bytes (None when none is); the
/// current layout itself when it already is.
pub fn cheapest_within(s: &Setting, current: &Layout, limit: f64) -> Option<Change> {
    let base = estimate(s, current).step_seconds;
    let mut best: Option<(f64, usize, Change)> = None;
    for l in candidates(s, current) {
        let e = estimate(s, &l);
        if e.total_bytes > limit {
            continue;
        }
        let halvings = (current.batch as f64 / l.batch as f64).log2();
        let cost = e.step_seconds * (1.0 + SMALLER_GEMM_PENALTY * halvings);
        let change = Change {
            layout: l,
            sets: sets(current, &l),
            total_bytes: e.total_bytes,
            slowdown: cost / base - 1.0,
        };
        let n = change.sets.len();
        let better = match &best {
            None => true,
            Some((c, k, b)) => {
                cost < c * (1.0 - 1e-9)
                    || (cost <= c * (1.0 + 1e-9)
                        && (n < *k || (n == *k && change.total_bytes < b.total_bytes)))
            }
        };
        if better {
            best = Some((cost, n, change));
        }
    }
    best.map(|(_, _, c)| c)
}

/// The layout with the least memory of all candidates (what "even the most frugal layout
/// needs" says when nothing fits).
pub fn smallest(s: &Setting, current: &Layout) -> Change {
    let base = estimate(s, current).step_seconds;
    candidates(s, current)
        .into_iter()
        .map(|l| {
            let e = estimate(s, &l);
            Change {
                layout: l,
                sets: sets(current, &l),
                total_bytes: e.total_bytes,
                slowdown: e.step_seconds / base - 1.0,
            }
        })
        .min_by(|a, b| a.total_bytes.total_cmp(&b.total_bytes))
        .expect("the current layout is a candidate")
}

#[cfg(test)]
mod tests {
    use super::super::test_setting;
    use super::*;

    #[test]
    fn stages_go_up_to_3_across_ranks_and_stay_alone() {
        let stages = |world: usize, stage: usize| {
            let (s, l) = test_setting(
                &[
                    "model.vocab_size=128256",
                    &format!("system.zero_stage={stage}"),
                ],
                world,
            );
            let mut v: Vec<usize> = candidates(&s, &l)
                .iter()
                .map(|c| c.zero_stage.number())
                .collect();
            v.sort();
            v.dedup();
            v
        };
        assert_eq!(stages(8, 0), [0, 1, 2, 3]);
        assert_eq!(stages(8, 2), [2, 3]);
        assert_eq!(stages(1, 0), [0]);
        assert_eq!(stages(1, 3), [3]);
    }
}
