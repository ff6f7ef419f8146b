//! Bytes each rank sends per step for each zero stage, and what they cost at a link speed.
//!
//! Ring collectives: an all-reduce of S bytes sends 2·(N−1)/N·S per rank, a reduce-scatter or
//! an all-gather (N−1)/N·S. Stage 0 all-reduces the fp32 gradients once per step; stage 1
//! reduce-scatters them and all-gathers the updated working weights (compute dtype); so does
//! stage 2, unit by unit during the last micro-batch's backward (the full gradients accumulate
//! until then, train/optim/reduce.rs). Stage 3 keeps no full parameters: at every micro-batch each
//! unit is all-gathered (compute dtype) before its forward and again before its backward — the
//! final norm and the head unit once, as they stay gathered from their forward through their
//! backward, and a tied embedding a third time as the head — and its fp32 gradients are
//! reduce-scattered; nothing is gathered after the update. Only the bandwidth term is counted:
//! with 25 MB buckets the per-message latency is small next to it up to a few dozen ranks, and
//! NCCL switches to trees beyond.

use serde::Serialize;

use super::{compute_seconds, Layout, Setting};
use crate::config::ZeroStage;

/// Bytes one rank sends per step at `stage` among `world` ranks.
pub fn bytes_per_step(s: &Setting, l: &Layout, stage: ZeroStage, world: usize) -> f64 {
    if world <= 1 {
        return 0.0;
    }
    let params = s.shape.num_parameters() as f64;
    let f = (world as f64 - 1.0) / world as f64;
    let grads = 4.0 * params;
    let weights = s.compute_bytes() * params;
    match stage {
        ZeroStage::Replicated => 2.0 * f * grads,
        ZeroStage::Optimizer | ZeroStage::Gradients => f * grads + f * weights,
        ZeroStage::Parameters => {
            let micro_batches = l.grad_accum as f64;
            micro_batches * (f * s.compute_bytes() * gathered_per_pass(s) + f * grads)
        }
    }
}

/// Stage 3: parameters (elements) one micro-batch's forward and backward all-gather: every
/// unit for the forward (a tied embedding twice, as the embedding and as the head) and again
/// for the backward, except the final norm and the head, which stay gathered from their forward
/// through their backward.
pub fn gathered_per_pass(s: &Setting) -> f64 {
    let sh = &s.shape;
    let d = sh.hidden_size as f64;
    let head = (sh.vocab_size * sh.hidden_size) as f64;
    let head_once = if sh.tie_word_embeddings { head } else { -head };
    2.0 * sh.num_parameters() as f64 - d + head_once
}

/// The collective bandwidth a ring of `world` ranks gets: a node's links while it fits in one
/// node, the inter-node link (the slowest hop) beyond.
pub fn bandwidth(s: &Setting, world: usize) -> f64 {
    if world <= s.node_size {
        s.intra_bw
    } else {
        s.inter_bw
    }
}

/// Seconds of communication per step at the layout's stage among `world` ranks.
pub fn seconds_per_step(s: &Setting, l: &Layout, world: usize) -> f64 {
    bytes_per_step(s, l, l.zero_stage, world) / bandwidth(s, world)
}

/// Weak scaling (same per-rank batch) at one world size.
#[derive(Debug, Clone, Serialize)]
pub struct Scaling {
    pub ranks: usize,
    pub bytes_per_rank: f64,
    pub comm_seconds: f64,
    /// compute / (compute + communication): the step as it runs today.
    pub efficiency: f64,
    /// compute / max(compute, communication): with the reductions hidden behind backward.
    pub efficiency_overlapped: f64,
}

pub fn scaling(s: &Setting, l: &Layout, world: usize) -> Scaling {
    let compute = compute_seconds(s, l);
    let comm = seconds_per_step(s, l, world);
    Scaling {
        ranks: world,
        bytes_per_rank: bytes_per_step(s, l, l.zero_stage, world),
        comm_seconds: comm,
        efficiency: compute / (compute + comm),
        efficiency_overlapped: compute / compute.max(comm),
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_setting;
    use super::*;

    #[test]
    fn stage_3_gathers_twice_and_reduce_scatters_at_every_micro_batch() {
        for tied in [false, true] {
            let (s, l) = test_setting(
                &[
                    "model.vocab_size=128256",
                    "training.grad_accum_nums=3",
                    &format!("model.tie_word_embeddings={tied}"),
                ],
                16,
            );
            let p = s.shape.num_parameters() as f64;
            let (d, v) = (4096.0, 128_256.0);
            let f = 15.0 / 16.0;
            // The final norm and the head are gathered once; a tied embedding serves as the
            // head too.
            let gathered = if tied {
                2.0 * p - d + v * d
            } else {
                2.0 * p - d - v * d
            };
            let expected = 3.0 * (f * 2.0 * gathered + f * 4.0 * p);
            let sent = bytes_per_step(&s, &l, ZeroStage::Parameters, 16);
            assert!((sent - expected).abs() < 1e-6 * expected, "tied {tied}");
            // Within the head's share of 2·f·c·P + f·4·P per micro-batch.
            let rough = 3.0 * f * (2.0 * 2.0 * p + 4.0 * p);
            assert!((sent / rough - 1.0).abs() < 2.0 * v * d / p);
            assert_eq!(bytes_per_step(&s, &l, ZeroStage::Parameters, 1), 0.0);
        }
    }

    #[test]
    fn stage_2_reduce_scatters_once_per_step() {
        let (s, l) = test_setting(
            &["model.vocab_size=128256", "training.grad_accum_nums=4"],
            8,
        );
        let p = s.shape.num_parameters() as f64;
        let f = 7.0 / 8.0;
        let expected = f * 4.0 * p + f * 2.0 * p;
        for stage in [ZeroStage::Optimizer, ZeroStage::Gradients] {
            let sent = bytes_per_step(&s, &l, stage, 8);
            assert!((sent - expected).abs() < 1e-6 * expected, "{stage}");
        }
    }
}
