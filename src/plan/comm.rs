//! Bytes each rank sends per step for each zero stage, and what they cost at a link speed.
//!
//! Ring collectives: an all-reduce of S bytes sends 2·(N−1)/N·S per rank, a reduce-scatter or
//! an all-gather (N−1)/N·S. Stage 0 all-reduces the fp32 gradients once per step; stage 1
//! reduce-scatters them and all-gathers the updated working weights (compute dtype); stage 2
//! reduce-scatters at every micro-batch (its gradients are sharded, so they cannot wait for the
//! last one) and all-gathers once. Only the bandwidth term is counted: with 25 MB buckets the
//! per-message latency is small next to it up to a few dozen ranks, and NCCL switches to trees
//! beyond.

use serde::Serialize;

use super::{compute_seconds, Layout, Setting};

/// Bytes one rank sends per step at `stage` among `world` ranks.
pub fn bytes_per_step(s: &Setting, l: &Layout, stage: usize, world: usize) -> f64 {
    if world <= 1 {
        return 0.0;
    }
    let params = s.shape.num_parameters() as f64;
    let f = (world as f64 - 1.0) / world as f64;
    let grads = 4.0 * params;
    let weights = s.compute_bytes() * params;
    match stage {
        0 => 2.0 * f * grads,
        1 => f * grads + f * weights,
        _ => l.grad_accum as f64 * f * grads + f * weights,
    }
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
