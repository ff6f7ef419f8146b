//! Expert parallelism (`system.expert_parallel` = E): what a rank of an expert-parallel group
//! holds of a mixture of experts, and what the group's all-to-alls send per step
//! (`model/expert_parallel.rs`).
//!
//! The group is E consecutive replicas (data × context ranks, one per TP group), so its ranks
//! lie among E·T consecutive ones: inside a node when E·T divides the GPUs per node. Rank p
//! holds experts [p·N/E, (p+1)·N/E) of every MoE layer's N; attention, the routers and the
//! dense layers stay whole on every rank. So a rank holds the dense parameters and 1/E of the
//! experts (`tensor::Share::held`): its weights and, at stages 0 and 1, its gradients are
//! those; the sharded state (moments, fp32 masters, the gradient slice at stages 2 and 3) is
//! the same per rank as without EP, because the experts' 1/E is sharded among their R/E
//! holders. At stage 3 a gathered decoder layer holds the rank's 1/E of its experts (gathered
//! among their holders) beside its dense parameters (among the replicas). The FLOPs are the
//! same too (a rank's experts multiply the rows the group routes to them: n·k on average,
//! with even routing), and the experts' gradients are reduced among the holders only
//! (`comm::traffic`).
//!
//! Traffic per MoE layer and micro-batch, each rank (bytes of the compute dtype c, hidden d, k
//! experts per token): the forward sends its n·k token copies to their experts' ranks and
//! receives the outputs back, the backward sends the outputs' gradients and receives the
//! inputs' gradients: 4 all-to-alls of n·k·d·c, (E−1)/E of which leave the rank with even
//! routing (a uniform router sends 1/E of its rows to itself). Recomputation (full or
//! selective checkpointing: both recompute the MoE half) runs the forward's two again. The
//! counts' all-to-all (N int64 per layer) is not counted. An all-to-all is assumed to move
//! bytes at the link's per-rank collective bandwidth, and the group waits for each: counted
//! whole in the step time, like the TP group's.
//!
//! Not modelled: imbalance. The busiest rank receives more than n·k rows when the router
//! favours its experts, and the group waits for it; the aux loss is the remedy, and `train`
//! logs the busiest rank's share (`RouterLog::rank_imbalance`, on the experts' line).

use super::setting::{Layout, Setting};
use super::tensor::Link;
use crate::model::ActivationCheckpointing;

/// The share of a rank's rows that leaves it with even routing: (E−1)/E.
fn leaving(s: &Setting) -> f64 {
    let e = s.expert_parallel as f64;
    (e - 1.0) / e
}

/// All-to-alls of the token rows per MoE layer and micro-batch: 2 forward, 2 backward, and
/// the forward's 2 again when checkpointing recomputes the MoE half.
pub fn exchanges_per_layer(l: &Layout) -> f64 {
    match l.activation_checkpointing {
        ActivationCheckpointing::None => 4.0,
        ActivationCheckpointing::Full | ActivationCheckpointing::Selective => 6.0,
    }
}

/// Bytes one rank sends per MoE layer and token of its own: (E−1)/E · k · d · c per exchange.
pub fn bytes_per_layer_token(s: &Setting, l: &Layout) -> f64 {
    let Some(m) = &s.shape.moe else { return 0.0 };
    leaving(s) * (m.top_k * s.shape.hidden_size) as f64 * s.compute_bytes() * exchanges_per_layer(l)
}

/// MoE layers of the model.
pub fn moe_layers(s: &Setting) -> usize {
    (0..s.shape.num_layers)
        .filter(|&i| s.shape.is_sparse(i))
        .count()
}

/// Bytes one rank sends to its expert-parallel group per step (0 at E = 1): every MoE layer's,
/// for the tokens it trains (s/C of each sequence of its data-parallel rank's).
pub fn bytes_per_step(s: &Setting, l: &Layout) -> f64 {
    if s.expert_parallel <= 1 {
        return 0.0;
    }
    let tokens = l.tokens_per_step(s.tokens_per_sequence()) as f64;
    tokens * moe_layers(s) as f64 * bytes_per_layer_token(s, l)
}

/// Where the group's all-to-alls run: a node's links when E·T divides the GPUs per node.
pub fn link(s: &Setting) -> Link {
    Link::spanning(s, s.expert_parallel * s.tensor_parallel)
}

/// Bytes/s per rank of the group's all-to-alls.
pub fn bandwidth(s: &Setting) -> f64 {
    link(s).bandwidth(s)
}

/// Seconds per step of the group's all-to-alls, all exposed.
pub fn seconds_per_step(s: &Setting, l: &Layout) -> f64 {
    bytes_per_step(s, l) / bandwidth(s)
}

/// The expert-parallel degrees a mixture of experts may use on the setting's mesh: those
/// dividing the experts per layer and the replicas (and with hybrid sharding the shard degree:
/// a group lies inside a shard group), inside a node (E·T dividing the GPUs per node) first,
/// each list ascending. Empty for a dense model.
pub fn degrees(s: &Setting) -> Vec<usize> {
    let Some(m) = &s.shape.moe else {
        return Vec::new();
    };
    let (replicas, shard) = (s.replica_ranks(s.world), s.shard_ranks(s.world));
    let all: Vec<usize> = (2..=replicas.min(m.num_experts))
        .filter(|&e| {
            m.num_experts.is_multiple_of(e) && replicas.is_multiple_of(e) && shard.is_multiple_of(e)
        })
        .collect();
    let inside = |e: &usize| {
        link(&Setting {
            expert_parallel: *e,
            ..s.clone()
        }) == Link::IntraNode
    };
    let (mut near, far): (Vec<usize>, Vec<usize>) = all.into_iter().partition(inside);
    near.extend(far);
    near
}

#[cfg(test)]
mod tests {
    use super::super::test_setting;
    use super::*;
    use crate::config::ZeroStage;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-9 * b.abs().max(1.0)
    }

    /// The qwen3-30b-a3b preset (48 layers, 128 experts of 768, top 8, d 2048, context 8192)
    /// on `world` GPUs.
    fn qwen3_30b(world: usize, extra: &[&str]) -> (Setting, Layout) {
        super::super::test_preset_setting(Some("qwen3-30b-a3b"), extra, world)
    }

    /// A rank holds 1/E of the experts; the sharded state per rank is what it was.
    #[test]
    fn a_rank_holds_its_experts_and_the_same_sharded_state() {
        let (one, l) = qwen3_30b(8, &[]);
        let (eight, _) = qwen3_30b(8, &["system.expert_parallel=8"]);
        let share = super::super::tensor::share(&eight);
        let experts = 48.0 * 128.0 * 3.0 * 2048.0 * 768.0;
        assert!(close(share.experts, experts));
        assert!(close(share.held(8), share.parameters - experts * 7.0 / 8.0));
        assert!(close(
            share.held_mlp(8),
            2048.0 * 128.0 + experts / 48.0 / 8.0
        ));
        for stage in [
            ZeroStage::Replicated,
            ZeroStage::Optimizer,
            ZeroStage::Gradients,
        ] {
            let l = Layout {
                zero_stage: stage,
                ..l
            };
            let (a, b) = (
                super::super::memory::estimate(&one, &l),
                super::super::memory::estimate(&eight, &l),
            );
            let held = 7.0 / 8.0 * experts;
            let weights = if stage == ZeroStage::Replicated {
                4.0
            } else {
                2.0
            };
            assert!(close(a.weights - b.weights, weights * held), "{stage}");
            assert_eq!(a.master_weights, b.master_weights, "{stage}");
            if stage == ZeroStage::Replicated {
                assert!(close(a.moments - b.moments, 8.0 * held));
            } else {
                assert_eq!(a.moments, b.moments, "{stage}");
            }
        }
    }

    /// 4 exchanges of (E−1)/E · k · d · c per MoE layer and token, 6 with recomputation, on a
    /// node's links while E·T divides the GPUs per node.
    #[test]
    fn the_group_sends_its_tokens_k_times_each_way_and_back() {
        for mode in ["none", "selective", "full"] {
            let ac = format!("training.activation_checkpointing={mode}");
            let (s, l) = qwen3_30b(16, &["system.expert_parallel=4", &ac]);
            let exchanges = if mode == "none" { 4.0 } else { 6.0 };
            let per = 0.75 * 8.0 * 2048.0 * 2.0 * exchanges;
            assert!(close(bytes_per_layer_token(&s, &l), per), "{mode}");
            let tokens = l.tokens_per_step(8192) as f64;
            assert!(close(bytes_per_step(&s, &l), tokens * 48.0 * per));
            assert_eq!(link(&s), Link::IntraNode);
            assert!(close(
                seconds_per_step(&s, &l),
                bytes_per_step(&s, &l) / s.intra_bw
            ));
        }
        let (s, l) = qwen3_30b(16, &["system.expert_parallel=16"]);
        assert_eq!(link(&s), Link::InterNode);
        assert!(close(
            seconds_per_step(&s, &l),
            bytes_per_step(&s, &l) / s.inter_bw
        ));
        let (s, l) = qwen3_30b(16, &[]);
        assert_eq!(bytes_per_step(&s, &l), 0.0);
        // Inside a node first, then across.
        assert_eq!(degrees(&s), vec![2, 4, 8, 16]);
        let (s, _) = qwen3_30b(64, &[]);
        assert_eq!(degrees(&s), vec![2, 4, 8, 16, 32, 64]);
        let (s, _) = test_setting(&["model.vocab_size=128256"], 8);
        assert!(degrees(&s).is_empty(), "a dense model");
    }

    /// With hybrid sharding an expert-parallel group lies inside a shard group: E divides the
    /// shard degree, and a rank's slice of the state is what it is without EP (the experts'
    /// 1/E among their S/E holders there).
    #[test]
    fn with_hybrid_sharding_a_group_stays_inside_a_shard_group() {
        let hybrid = ["system.zero_stage=2", "system.shard_degree=4"];
        let (s, l) = qwen3_30b(16, &hybrid);
        assert_eq!(degrees(&s), vec![2, 4]);
        let mut with_ep = hybrid.to_vec();
        with_ep.push("system.expert_parallel=4");
        let (e, _) = qwen3_30b(16, &with_ep);
        let (a, b) = (
            super::super::memory::during_step(&s, &l),
            super::super::memory::during_step(&e, &l),
        );
        assert!(close(a.moments, b.moments) && close(a.master_weights, b.master_weights));
        // The dense 1.5B and a quarter of the 29B experts: 29% of the weights.
        assert!(
            b.weights < 0.3 * a.weights,
            "{} vs {}",
            b.weights,
            a.weights
        );
        // The experts' gradient slices go among the 4 / 4 = 1 holder of a shard group, and
        // across the 4 groups: less than the dense-and-experts traffic without EP.
        let sent =
            |s: &Setting| super::super::comm::bytes_per_step(s, &l, ZeroStage::Gradients, 16);
        assert!(sent(&e) < sent(&s));
    }

    /// The experts' gradients go among their holders only: at stage 0 on 8 ranks with E 8 no
    /// rank shares an expert, so only the dense parameters are all-reduced.
    #[test]
    fn the_experts_reduce_among_their_holders() {
        let (s, l) = qwen3_30b(8, &["system.expert_parallel=8", "system.zero_stage=0"]);
        let share = super::super::tensor::share(&s);
        let dense = share.parameters - share.experts;
        let sent = super::super::comm::bytes_per_step(&s, &l, ZeroStage::Replicated, 8);
        assert!(close(sent, 2.0 * 7.0 / 8.0 * 4.0 * dense));
        let (s, _) = qwen3_30b(8, &["system.expert_parallel=2", "system.zero_stage=0"]);
        let sent = super::super::comm::bytes_per_step(&s, &l, ZeroStage::Replicated, 8);
        let experts = 2.0 * 3.0 / 4.0 * 4.0 * share.experts / 2.0;
        assert!(close(sent, 2.0 * 7.0 / 8.0 * 4.0 * dense + experts));
    }

    /// Stage 3 under EP: per micro-batch the dense units are gathered twice (the final norm
    /// and the head once) and reduce-scattered among the 16 replicas, a rank's experts gathered
    /// twice and reduce-scattered among their 16 / 4 = 4 holders; a rank's gathered layer holds
    /// its router and 32 of the 128 experts. Its slices are the same as without EP.
    #[test]
    fn at_stage_3_a_rank_gathers_its_experts_among_their_holders() {
        let stage_3 = ["system.zero_stage=3", "training.grad_accum_nums=2"];
        let (s, l) = qwen3_30b(16, &stage_3);
        let mut with_ep = stage_3.to_vec();
        with_ep.push("system.expert_parallel=4");
        let (e, _) = qwen3_30b(16, &with_ep);
        let share = super::super::tensor::share(&e);
        let (v, d) = (151_936.0, 2048.0);
        let dense = share.parameters - share.experts;
        let held = share.experts / 4.0;
        let ring = |n: f64| (n - 1.0) / n;
        let gathered_dense = 2.0 * dense - d - v * d;
        let want = 2.0
            * (ring(16.0) * (2.0 * gathered_dense + 4.0 * dense)
                + ring(4.0) * (2.0 * 2.0 * held + 4.0 * held));
        let sent = super::super::comm::bytes_per_step(&e, &l, ZeroStage::Parameters, 16);
        assert!(close(sent, want), "{sent} against {want}");
        let without = super::super::comm::bytes_per_step(&s, &l, ZeroStage::Parameters, 16);
        assert!(sent < 0.5 * without, "{sent} against {without}");
        let (a, b) = (
            super::super::memory::during_step(&s, &l),
            super::super::memory::during_step(&e, &l),
        );
        assert_eq!((a.weights, b.weights), (0.0, 0.0));
        assert!(close(a.moments, b.moments) && close(a.master_weights, b.master_weights));
        // The gathered layers (the one in use, the prefetched one) lack the other positions'
        // experts: 3/4 of a layer's, in bf16.
        let layers = (a.gathered_units - b.gathered_units) / (2.0 * 0.75 * share.experts / 48.0);
        assert!(close(layers, layers.round()) && layers >= 1.0, "{layers}");
    }
}
