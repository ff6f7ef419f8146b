//! Bytes each rank sends per step for each zero stage, and what they cost at a link speed.
//!
//! Ring collectives: an all-reduce of S bytes sends 2·(N−1)/N·S per rank, a reduce-scatter or
//! an all-gather (N−1)/N·S. Stage 0 all-reduces the fp32 gradients once per step; stage 1
//! all-reduces them too and all-gathers the updated working weights (compute dtype); stage 2
//! reduce-scatters them instead, unit by unit during the last micro-batch's backward (the full
//! gradients accumulate until then, train/optim/reduce.rs), and all-gathers the weights. Stage 3 keeps no full parameters: at every micro-batch each
//! unit is all-gathered (compute dtype) before its forward and again before its backward — the
//! final norm and the head unit once, as they stay gathered from their forward through their
//! backward, and a tied embedding a third time as the head — and its fp32 gradients are
//! reduce-scattered; nothing is gathered after the update. Only the bandwidth term is counted:
//! with 25 MB buckets the per-message latency is small next to it up to a few dozen ranks, and
//! NCCL switches to trees beyond. Hybrid sharding (`system.shard_degree`) runs all of this
//! inside a shard group and adds an all-reduce of the gradient slices across the groups
//! ([`traffic`]).
//!
//! With tensor parallelism all of this acts on a rank's TP share of the parameters
//! (`tensor::share`) among the data-parallel ranks with the same TP position: D = N/T of them,
//! every T-th rank, so a group of S of them spans S·T consecutive ranks, in a node only when
//! that fits in one. The TP group's own traffic is `tensor.rs`'s.
//!
//! With context parallelism (C) the ranks that hold the same parameters are the D × C ranks
//! with the same TP position (the C ranks of a CP group train parts of the same sequences, so
//! their gradients are summed like those of data-parallel ranks): everything above runs among
//! those, still every T-th rank. The CP group's own traffic is `context.rs`'s.

use super::setting::{Layout, Setting};
use crate::config::ZeroStage;

/// Bytes one rank sends to the data-parallel ranks per step at `stage` among `world` ranks.
pub fn bytes_per_step(s: &Setting, l: &Layout, stage: ZeroStage, world: usize) -> f64 {
    let (inside, across) = traffic(s, l, stage, world);
    inside + across
}

/// Bytes one rank sends per step among the replica ranks of `world` ranks (D × C with the same
/// TP position): (inside its shard group, across the shard groups). Without hybrid sharding
/// the shard group is all R = D × C replica ranks and everything counts as inside. With it
/// (`system.shard_degree` = S < R), the reduce-scatters and all-gathers run inside the group and
/// the gradient slice (4P/S) is all-reduced across the R/S groups. P is the rank's TP share.
///
/// With expert parallelism (E) the dense parameters go among the R replicas as above, and the
/// 1/E of the experts a rank holds among their R/E holders; at stage 3 a decoder layer's
/// experts are gathered among those holders too, twice a micro-batch (forward, backward).
pub fn traffic(s: &Setting, l: &Layout, stage: ZeroStage, world: usize) -> (f64, f64) {
    let data = s.replica_ranks(world);
    let shard = s.shard_ranks(world);
    let share = super::tensor::share(s);
    let ep = s.expert_parallel;
    let all = (share.parameters, gathered_per_pass(s));
    if ep <= 1 {
        return group_traffic(s, l, stage, all, (data, shard));
    }
    let held = share.experts / ep as f64;
    let dense = (all.0 - share.experts, all.1 - 2.0 * share.experts);
    let dense = group_traffic(s, l, stage, dense, (data, shard));
    let experts = group_traffic(
        s,
        l,
        stage,
        (held, 2.0 * held),
        (data / ep, (shard / ep).max(1)),
    );
    (dense.0 + experts.0, dense.1 + experts.1)
}

/// [`traffic`] of `params` elements (the rank's TP share, or a part of it) among `data`
/// replica ranks sharded in groups of `shard`, of which stage 3 gathers `gathered` per
/// micro-batch ([`gathered_per_pass`] of the whole share).
fn group_traffic(
    s: &Setting,
    l: &Layout,
    stage: ZeroStage,
    (params, gathered): (f64, f64),
    (data, shard): (usize, usize),
) -> (f64, f64) {
    if data <= 1 {
        return (0.0, 0.0);
    }
    let ring = |n: usize| (n as f64 - 1.0) / n as f64;
    let (f, fw) = (ring(shard), ring(data));
    let grads = s.reduce_bytes * params;
    let weights = s.compute_bytes() * params;
    let replicas = data / shard;
    let across = if replicas > 1 && stage.shards_gradients() {
        2.0 * ring(replicas) * grads / shard as f64
    } else {
        0.0
    };
    let inside = match stage {
        ZeroStage::Replicated => 2.0 * fw * grads,
        // Stage 1 all-reduces the full gradients over every rank (train/optim/reduce.rs), as
        // stage 0 does, then all-gathers the updated slices (BENCHMARKS §7 measures both).
        ZeroStage::Optimizer => 2.0 * fw * grads + f * weights,
        ZeroStage::Gradients => f * grads + f * weights,
        ZeroStage::Parameters => {
            let micro_batches = l.grad_accum as f64;
            micro_batches * (f * s.compute_bytes() * gathered + f * grads)
        }
    };
    (inside, across)
}

/// Stage 3: parameters (elements of the rank's TP share) one micro-batch's forward and
/// backward all-gather: every unit for the forward (a tied embedding twice, as the embedding
/// and as the head) and again for the backward, except the final norm and the head, which stay
/// gathered from their forward through their backward.
pub fn gathered_per_pass(s: &Setting) -> f64 {
    let share = super::tensor::share(s);
    let d = s.shape.hidden_size as f64;
    let head = share.vocab * d;
    let head_once = if s.shape.tie_word_embeddings {
        head
    } else {
        -head
    };
    2.0 * share.parameters - d + head_once
}

/// The collective bandwidth of a ring whose ranks lie among `span` consecutive ranks: a node's
/// links while they fit in one node, the inter-node link (the slowest hop) beyond.
pub fn bandwidth(s: &Setting, span: usize) -> f64 {
    if span <= s.node_size {
        s.intra_bw
    } else {
        s.inter_bw
    }
}

/// The collective bandwidth of a ring of `ranks` replica ranks (one per TP group: they span
/// `ranks` · T consecutive ranks).
pub fn data_parallel_bandwidth(s: &Setting, ranks: usize) -> f64 {
    bandwidth(s, ranks * s.tensor_parallel)
}

/// Seconds of data-parallel communication per step at the layout's stage among `world` ranks:
/// the shard group's collectives at its own links' speed (a node's, when it fits in one), the
/// traffic across groups at the world's.
pub fn seconds_per_step(s: &Setting, l: &Layout, world: usize) -> f64 {
    let (inside, across) = traffic(s, l, l.zero_stage, world);
    inside / data_parallel_bandwidth(s, s.shard_ranks(world)) + across / bandwidth(s, world)
}

#[cfg(test)]
mod tests {
    use super::super::step::{scaling, StepTime};
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
            let p = s.parameters.count() as f64;
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

    /// Stage 1 all-reduces the full gradients (as stage 0) and all-gathers the bf16 weights;
    /// stage 2 reduce-scatters once per step (on the last micro-batch) and all-gathers.
    #[test]
    fn stages_1_and_2_send_their_reductions_once_per_step() {
        let (s, l) = test_setting(
            &["model.vocab_size=128256", "training.grad_accum_nums=4"],
            8,
        );
        let p = s.parameters.count() as f64;
        let f = 7.0 / 8.0;
        let stage_1 = 2.0 * f * 4.0 * p + f * 2.0 * p;
        let stage_2 = f * 4.0 * p + f * 2.0 * p;
        for (stage, expected) in [
            (ZeroStage::Optimizer, stage_1),
            (ZeroStage::Gradients, stage_2),
        ] {
            let sent = bytes_per_step(&s, &l, stage, 8);
            assert!((sent - expected).abs() < 1e-6 * expected, "{stage}");
        }
    }

    /// Hybrid sharding: 64 ranks in groups of 8 shard inside the group (ring of 8) and
    /// all-reduce the gradient slice across the 8 groups; per-rank memory is that of 8 ranks.
    #[test]
    fn hybrid_sharding_moves_the_slices_across_groups() {
        let (mut s, l) = test_setting(&["model.vocab_size=128256"], 64);
        let p = s.parameters.count() as f64;
        let whole = bytes_per_step(&s, &l, ZeroStage::Gradients, 64);
        s.shard_degree = 8;
        let (inside, across) = traffic(&s, &l, ZeroStage::Gradients, 64);
        let f = 7.0 / 8.0;
        assert!((inside - (f * 4.0 * p + f * 2.0 * p)).abs() < 1e-6 * inside);
        assert!((across - 2.0 * f * 4.0 * p / 8.0).abs() < 1e-6 * across);
        let mut l2 = l;
        l2.zero_stage = ZeroStage::Gradients;
        // More bytes in all, but most of them over a node's links instead of the network.
        assert!(inside + across > whole);
        let hybrid_s = seconds_per_step(&s, &l2, 64);
        let mut flat = s.clone();
        flat.shard_degree = 0;
        assert!(
            hybrid_s < 0.5 * seconds_per_step(&flat, &l2, 64),
            "{hybrid_s}"
        );
        let (t, _) = test_setting(&["model.vocab_size=128256"], 8);
        let eight = super::super::memory::estimate(&t, &l2).total();
        let hybrid = super::super::memory::estimate(&s, &l2).total();
        assert!((hybrid - eight).abs() < 1e-6 * eight, "{hybrid} vs {eight}");
    }

    /// T = 8 on 64 GPUs: the zero stage sends the rank's TP share among the 8 data-parallel
    /// ranks, one per node, over the network; the TP group's collectives run in the node and
    /// stay whole in the step, beside 1/8 of the FLOPs.
    #[test]
    fn the_data_parallel_ranks_send_their_tp_share_and_the_tp_group_adds_its_own() {
        let (s, l) = test_setting(&["model.vocab_size=128256", "system.tensor_parallel=8"], 64);
        assert_eq!((s.data_ranks(64), s.shard_ranks(64)), (8, 8));
        let share = super::super::tensor::share(&s).parameters;
        let f = 7.0 / 8.0;
        let sent = bytes_per_step(&s, &l, ZeroStage::Gradients, 64);
        assert!((sent - (f * 4.0 * share + f * 2.0 * share)).abs() < 1e-6 * sent);
        assert_eq!(data_parallel_bandwidth(&s, 8), s.inter_bw);
        let time = StepTime::of(&s, &l, 64);
        let (one, _) = test_setting(&["model.vocab_size=128256"], 64);
        let whole = super::super::compute_seconds(&one, &l);
        assert!((time.compute_seconds - whole / 8.0).abs() < 1e-9 * whole);
        assert_eq!(
            time.tensor_parallel_seconds,
            super::super::tensor::bytes_per_step(&s, &l) / s.intra_bw
        );
        assert_eq!(
            time.total(),
            time.compute_seconds + time.data_parallel_seconds + time.tensor_parallel_seconds
        );
        let sc = scaling(&s, &l, 64);
        assert_eq!(sc.efficiency, time.compute_seconds / time.total());
        assert!(sc.efficiency_overlapped < 1.0, "the TP time stays exposed");
        // On one node the 8 GPUs are one data-parallel rank: no zero-stage traffic.
        assert_eq!(bytes_per_step(&s, &l, ZeroStage::Parameters, 8), 0.0);
    }
}
