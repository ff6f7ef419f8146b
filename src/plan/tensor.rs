//! Tensor parallelism (`system.tensor_parallel` = T): what one rank of a TP group holds of the
//! model, and what the group sends per step.
//!
//! The mesh is D × T ranks, TP innermost: ranks r with the same r / T form one TP group (inside
//! a node when T divides the GPUs per node). The layer split is Megatron's and torchtitan's:
//! q, k, v, gate and up are column-parallel (1/T of their output rows on each rank), o and down
//! row-parallel (1/T of their input columns), so the heads and KV heads are split by T; the
//! embedding and the LM head are vocabulary-parallel (the vocabulary padded up to a multiple of
//! T, V_pad/T rows each, with a vocabulary-parallel cross-entropy); the RMSNorm weights are
//! whole on every rank. Every rank does 1/T of every matmul (attention scores split by heads).
//!
//! Traffic per layer and token, each rank (ring collectives, bytes of the compute dtype c):
//! with sequence parallelism (`system.sequence_parallel`) the normed input is all-gathered
//! before attention and before the MLP and the outputs of o and down reduce-scattered, and
//! backward runs the transposes (reduce-scatter of the gathered input's gradient, all-gather of
//! the output's gradient): 8 collectives of (T−1)/T·d·c. Without it one all-reduce
//! (2·(T−1)/T·d·c) after each row-parallel matmul forward and one of each block's input
//! gradient backward: the same 8·(T−1)/T·d·c. Recomputation repeats the forward's
//! collectives: full checkpointing all 4 (+50%), selective the MLP's 2 (+25%). Once per token
//! besides, in fp32 (the residual stream's dtype): the embedding's partial sums reduce-scattered
//! (all-reduced without SP) and their gradient all-gathered back (none without SP), the final
//! normed hidden state all-gathered for the LM head (replicated without SP) and its gradient
//! reduce-scattered (all-reduced): 2·(T−1)/T·d·4 each; the cross-entropy's all-gather of
//! per-token maxima (4·(T−1) B) and all-reduce of the sum of exponentials and the target logit
//! (2·(T−1)/T·8 B). The norms' weight gradients are reduced over the group once per step (a few
//! vectors: not counted). Only the bandwidth term is counted, as for the data-parallel
//! collectives. These collectives are on the critical path: this first version counts them
//! whole in the step time, never overlapped with computation. With context parallelism (C) a
//! rank's tokens are s/C of each sequence: its TP group sends for those.

use serde::Serialize;

use super::setting::{Layout, Setting};
use crate::model::ActivationCheckpointing;

/// Where a group's collectives run (a TP group's, a CP group's).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Link {
    /// The group is inside a node: NVLink.
    IntraNode,
    /// The group spans nodes: the network.
    InterNode,
}

impl Link {
    /// The link of a group whose ranks lie among `span` consecutive ones: a node's links when
    /// `span` divides the GPUs per node.
    pub fn spanning(s: &Setting, span: usize) -> Link {
        if span <= s.node_size && s.node_size.is_multiple_of(span) {
            Link::IntraNode
        } else {
            Link::InterNode
        }
    }

    /// Bytes/s per rank of a collective on this link.
    pub fn bandwidth(self, s: &Setting) -> f64 {
        match self {
            Link::IntraNode => s.intra_bw,
            Link::InterNode => s.inter_bw,
        }
    }

    /// The link in the report's words.
    pub fn describe(self) -> &'static str {
        match self {
            Link::IntraNode => "a node's links",
            Link::InterNode => "the network (the group spans nodes)",
        }
    }
}

/// The vocabulary as the TP group splits it: rounded up to a multiple of T.
pub fn padded_vocab(s: &Setting) -> usize {
    crate::model::split::padded(s.shape.vocab_size, s.tensor_parallel)
}

/// One rank's share of the model, in elements: each layer's matrices over T (attention and
/// MLP), the norms whole, the embedding and an untied LM head V_pad/T rows each.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Share {
    /// Matrix elements of one decoder layer's attention (q, k, v, o) on this rank.
    pub attention: f64,
    /// Matrix elements of one decoder layer's MLP (gate, up, down; of a MoE layer every
    /// expert and the router) on this rank: the largest layer's.
    pub mlp: f64,
    /// Rows of the embedding (and of an untied LM head) on this rank.
    pub vocab: f64,
    /// Every parameter of the rank's TP share: what the zero stages' sharded state divides
    /// among the shard group (with expert parallelism the rank holds fewer, [`Share::held`]).
    pub parameters: f64,
    /// Of `parameters`, the experts' matrices (every MoE layer's, all of its experts), and
    /// those of the largest MLP's layer (part of `mlp`).
    pub experts: f64,
    pub mlp_experts: f64,
}

impl Share {
    /// Parameters a rank holds when `ep` ranks split the experts (`system.expert_parallel`):
    /// the dense ones and 1/E of the experts.
    pub fn held(&self, ep: usize) -> f64 {
        self.parameters - self.experts * (1.0 - 1.0 / ep.max(1) as f64)
    }

    /// Matrix elements of the largest layer's MLP that a rank holds at `ep` (its router and
    /// 1/E of its experts).
    pub fn held_mlp(&self, ep: usize) -> f64 {
        self.mlp - self.mlp_experts * (1.0 - 1.0 / ep.max(1) as f64)
    }
}

/// The share of one rank of a TP group (the whole model at T = 1).
pub fn share(s: &Setting) -> Share {
    let sh = &s.shape;
    let t = s.tensor_parallel as f64;
    let attention = sh.attention_matrix_params() as f64 / t;
    let mlp = sh.largest_mlp_params() as f64 / t;
    let vocab = padded_vocab(s) as f64 / t;
    let parameters = s.parameters.local_count(s.tensor_parallel) as f64;
    let experts = s
        .parameters
        .iter()
        .filter(|p| p.expert.is_some())
        .map(|p| {
            p.split
                .local_shape(&p.shape, s.tensor_parallel)
                .iter()
                .product::<i64>() as f64
        })
        .sum();
    // The largest MLP is a MoE layer's unless the dense one is larger.
    let sparse = (0..sh.num_layers).find(|&i| sh.is_sparse(i));
    let mlp_experts = match (&sh.moe, sparse) {
        (Some(m), Some(i)) if sh.layer_mlp_params(i, false) == sh.largest_mlp_params() => {
            (3 * sh.hidden_size * m.expert_size * m.num_experts) as f64 / t
        }
        _ => 0.0,
    };
    Share {
        attention,
        mlp,
        vocab,
        parameters,
        experts,
        mlp_experts,
    }
}

/// The ring's share of a collective among the T ranks of a group: (T−1)/T.
fn ring(s: &Setting) -> f64 {
    let t = s.tensor_parallel as f64;
    (t - 1.0) / t
}

/// Bytes one rank sends per decoder layer and token, forward and backward, without
/// recomputation: 8·(T−1)/T·d·c, with or without sequence parallelism.
pub fn bytes_per_layer_token(s: &Setting) -> f64 {
    8.0 * ring(s) * s.shape.hidden_size as f64 * s.compute_bytes()
}

/// The forward collectives (of a layer's 8) that activation checkpointing runs again in
/// backward: all 4 with full, the MLP's 2 with selective.
fn recomputed_collectives(l: &Layout) -> f64 {
    match l.activation_checkpointing {
        ActivationCheckpointing::None => 0.0,
        ActivationCheckpointing::Selective => 2.0,
        ActivationCheckpointing::Full => 4.0,
    }
}

/// Bytes one rank sends per token outside the decoder layers: the embedding's and the LM
/// head's fp32 hidden states (forward and backward) and the cross-entropy's per-token scalars.
fn bytes_per_token_outside_layers(s: &Setting) -> f64 {
    let t = s.tensor_parallel as f64;
    let hidden = 2.0 * 2.0 * ring(s) * s.shape.hidden_size as f64 * 4.0;
    let cross_entropy = 4.0 * (t - 1.0) + 2.0 * ring(s) * 8.0;
    hidden + cross_entropy
}

/// Bytes one rank sends to its TP group per step (0 at T = 1): for its tokens, s/C of each
/// sequence its data-parallel rank trains.
pub fn bytes_per_step(s: &Setting, l: &Layout) -> f64 {
    if s.tensor_parallel <= 1 {
        return 0.0;
    }
    let layers = s.shape.num_layers as f64;
    let per_layer = bytes_per_layer_token(s) * (8.0 + recomputed_collectives(l)) / 8.0;
    let tokens = l.tokens_per_step(s.tokens_per_sequence()) as f64;
    tokens * (layers * per_layer + bytes_per_token_outside_layers(s))
}

/// Where the group's collectives run: a node's links when T divides the GPUs per node.
pub fn link(s: &Setting) -> Link {
    Link::spanning(s, s.tensor_parallel)
}

/// Bytes/s per rank of the group's collectives.
pub fn bandwidth(s: &Setting) -> f64 {
    link(s).bandwidth(s)
}

/// Seconds per step of the group's collectives, all exposed.
pub fn seconds_per_step(s: &Setting, l: &Layout) -> f64 {
    bytes_per_step(s, l) / bandwidth(s)
}

#[cfg(test)]
mod tests {
    use super::super::test_setting;
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-9 * b.abs().max(1.0)
    }

    /// Llama-3.1-8B with 8 layers on 8 GPUs, at `tp`, plus `extra`.
    fn at(tp: usize, extra: &[&str]) -> (Setting, Layout) {
        let tp = format!("system.tensor_parallel={tp}");
        let mut sets = vec!["model.num_layers=8", "model.vocab_size=128256", &tp];
        sets.extend(extra);
        test_setting(&sets, 8)
    }

    #[test]
    fn one_rank_holds_the_matrices_over_t_and_the_norms_whole() {
        let (one, _) = at(1, &[]);
        let (eight, _) = at(8, &[]);
        let (a, b) = (share(&one), share(&eight));
        assert_eq!(a.parameters, one.parameters.count() as f64);
        assert_eq!(padded_vocab(&one), 128_256);
        assert_eq!(b.attention * 8.0, a.attention);
        assert_eq!(b.mlp * 8.0, a.mlp);
        assert_eq!(b.vocab * 8.0, a.vocab, "128,256 is a multiple of 8");
        let norms = (8.0 * 2.0 + 1.0) * 4096.0;
        assert!(close(b.parameters, (a.parameters - norms) / 8.0 + norms));
        // A vocabulary that T does not divide is padded up to a multiple of T.
        let (odd, _) = at(8, &["model.vocab_size=50257"]);
        assert_eq!(padded_vocab(&odd), 50_264);
        assert_eq!(share(&odd).vocab, 6283.0);
    }

    #[test]
    fn a_layer_sends_8_ring_shares_of_a_hidden_state_per_token_plus_what_recomputation_repeats() {
        for t in [2usize, 4, 8] {
            for sp in [true, false] {
                let sp = format!("system.sequence_parallel={sp}");
                let (s, l) = at(t, &[&sp, "training.activation_checkpointing=none"]);
                let f = (t as f64 - 1.0) / t as f64;
                let per_layer = 8.0 * f * 4096.0 * 2.0;
                assert!(close(bytes_per_layer_token(&s), per_layer), "T {t}");
                let outside = 4.0 * f * 4096.0 * 4.0 + 4.0 * (t as f64 - 1.0) + 16.0 * f;
                let tokens = l.tokens_per_step(s.context) as f64;
                let none = bytes_per_step(&s, &l);
                assert!(close(none, tokens * (8.0 * per_layer + outside)));
                for (mode, extra) in [
                    (ActivationCheckpointing::Selective, 0.25),
                    (ActivationCheckpointing::Full, 0.5),
                ] {
                    let l = Layout {
                        activation_checkpointing: mode,
                        ..l
                    };
                    let more = bytes_per_step(&s, &l) - none;
                    assert!(close(more, extra * tokens * 8.0 * per_layer), "{mode}");
                }
            }
        }
        let (s, l) = at(1, &[]);
        assert_eq!(bytes_per_step(&s, &l), 0.0);
        assert_eq!(seconds_per_step(&s, &l), 0.0);
    }

    #[test]
    fn a_group_inside_a_node_runs_on_its_links() {
        let (mut s, _) = at(8, &[]);
        assert_eq!(link(&s), Link::IntraNode);
        assert_eq!(bandwidth(&s), s.intra_bw);
        s.tensor_parallel = 16;
        assert_eq!(link(&s), Link::InterNode);
        assert_eq!(bandwidth(&s), s.inter_bw);
    }
}
