//! Context parallelism (`system.context_parallel` = C): what a CP group sends per step, and the
//! whole-sequence buffers a rank's attention holds for a moment (`model/context_parallel.rs`).
//!
//! The mesh is D × C × T, tensor innermost: the C ranks of a CP group share their data-parallel
//! and TP positions, so they are every T-th rank of C·T consecutive ones (inside a node when
//! C·T divides the GPUs per node). Each sequence of s tokens is cut into 2C chunks of
//! m = s/2C; rank i holds chunks i and 2C−1−i (2m = s/C tokens), and everything but attention
//! runs on those alone (`memory.rs` counts a rank's activations for s/C tokens per sequence).
//!
//! Traffic per layer and micro-batch, each rank (ring collectives; kv = kv_heads/T·head_dim,
//! c = bytes of the compute dtype): the forward all-gathers K and V of the group,
//! (C−1)/C · 2·kv·c bytes per token of the sequence; the backward all-gathers them again (they
//! are not kept) and reduce-scatters dK and dV in fp32, (C−1)/C · 2·kv·4 bytes per token;
//! full recomputation (`activation_checkpointing = full`) runs the forward's all-gather once
//! more (selective recomputes the MLP only). The group waits for each of them: counted whole
//! in the step time, like the TP group's.
//!
//! Memory: a layer's graph keeps only the rank's own tokens (q, k, v, the output and its
//! log-sum-exp: what a rank without CP keeps per token), but its backward holds, per
//! micro-batch of b sequences, the gathered K/V of the whole sequence [2, b, kv_heads/T, s,
//! head_dim] in the compute dtype, dK/dV of the whole sequence in an fp32 buffer of that shape,
//! the two chunks' fp32 dQ, and then the larger of two moments' buffers: at a block (one query
//! chunk against one key chunk, m keys; on CUDA the kernel takes K and V repeated to the query
//! heads with GQA, and gives dK and dV in that repeated shape, summed over the repeats) that
//! block's K/V and gradients; or at the reduce-scatter one more fp32 copy of the dK/dV buffer
//! (the collective's send copy; the buffer is already in the ranks' order). Below the
//! backward's, the forward's peak (the gathered K/V and one block's repeated K/V) is not
//! counted. The whole-sequence buffers scale with s, not with s/C: they are the floor C cannot
//! lower (T can: they hold the rank's KV heads only).

use serde::Serialize;

use super::setting::{Layout, Setting};
use super::tensor::Link;
use crate::model::ActivationCheckpointing;

/// Fp32 copies of the whole sequence's dK/dV buffer that exist at the reduce-scatter besides
/// the buffer itself (`attend_backward`, which accumulates it in the ranks' order): the
/// collective's send copy (`TpComm::reduce_scatter` copies its input).
pub const SCATTER_COPIES: f64 = 1.0;

/// The ring's share of a collective among the C ranks of a group: (C−1)/C.
fn ring(s: &Setting) -> f64 {
    let c = s.context_parallel as f64;
    (c - 1.0) / c
}

/// K's (or V's) width on one rank: its TP share of the KV heads × head_dim.
fn kv_width(s: &Setting) -> f64 {
    let sh = &s.shape;
    (sh.num_kv_heads * sh.head_dim()) as f64 / s.tensor_parallel as f64
}

/// All-gathers of K/V per layer and micro-batch: the forward's, the backward's, and with full
/// checkpointing the recomputed forward's.
pub fn gathers_per_layer(l: &Layout) -> f64 {
    match l.activation_checkpointing {
        ActivationCheckpointing::Full => 3.0,
        ActivationCheckpointing::None | ActivationCheckpointing::Selective => 2.0,
    }
}

/// Bytes one rank sends per decoder layer and token of the sequence (each micro-batch's
/// sequences whole): (C−1)/C · 2·kv · (c per all-gather + 4 for the fp32 reduce-scatter).
pub fn bytes_per_layer_token(s: &Setting, l: &Layout) -> f64 {
    ring(s) * 2.0 * kv_width(s) * (gathers_per_layer(l) * s.compute_bytes() + 4.0)
}

/// Bytes one rank sends to its CP group per step (0 at C = 1): every layer's, for the tokens
/// of the sequences its data-parallel rank trains per step.
pub fn bytes_per_step(s: &Setting, l: &Layout) -> f64 {
    if s.context_parallel <= 1 {
        return 0.0;
    }
    l.tokens_per_step(s.context) as f64 * s.shape.num_layers as f64 * bytes_per_layer_token(s, l)
}

/// Where the group's collectives run: a node's links when C·T divides the GPUs per node (the
/// group's C ranks lie among C·T consecutive ones).
pub fn link(s: &Setting) -> Link {
    Link::spanning(s, s.context_parallel * s.tensor_parallel)
}

/// Bytes/s per rank of the group's collectives.
pub fn bandwidth(s: &Setting) -> f64 {
    link(s).bandwidth(s)
}

/// Seconds per step of the group's collectives, all exposed.
pub fn seconds_per_step(s: &Setting, l: &Layout) -> f64 {
    bytes_per_step(s, l) / bandwidth(s)
}

/// The buffers of one layer's context-parallel attention backward (bytes, one micro-batch),
/// as the module's notes list them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Buffers {
    /// K and V of the whole sequence, gathered, in the compute dtype.
    pub gathered: f64,
    /// dK and dV of the whole sequence, fp32.
    pub gradients: f64,
    /// The two local chunks' fp32 dQ.
    pub queries: f64,
    /// At a block (one key chunk): K and V repeated to the query heads (with GQA, on CUDA),
    /// the kernel's dK and dV in that shape, and their sums over the repeats (compute dtype).
    pub block: f64,
    /// At the reduce-scatter: the fp32 copies of the dK/dV buffer ([`SCATTER_COPIES`]).
    pub scatter: f64,
}

impl Buffers {
    /// The backward's peak: what it holds throughout, plus the larger of its two moments.
    pub fn peak(&self) -> f64 {
        self.gathered + self.gradients + self.queries + self.block.max(self.scatter)
    }
}

/// The buffers of a layer's CP attention backward for layout `l` (all zero at C = 1).
pub fn buffers(s: &Setting, l: &Layout) -> Buffers {
    if s.context_parallel <= 1 {
        return Buffers::default();
    }
    let sh = &s.shape;
    let c = s.compute_bytes();
    let t = s.tensor_parallel as f64;
    let (b, seq) = (l.batch as f64, s.context as f64);
    let hd = sh.head_dim() as f64;
    let heads = sh.num_heads as f64 / t;
    let kv = kv_width(s);
    let chunk = seq / (2.0 * s.context_parallel as f64);
    // A block: one key chunk of m keys.
    let keys = chunk;
    let whole = 2.0 * b * kv * seq;
    let repeated = if sh.num_heads > sh.num_kv_heads {
        2.0
    } else {
        0.0
    };
    let gradients = 4.0 * whole;
    Buffers {
        gathered: c * whole,
        gradients,
        queries: 4.0 * b * heads * 2.0 * chunk * hd,
        block: c * b * keys * ((repeated + 2.0) * heads * hd + 2.0 * kv),
        scatter: SCATTER_COPIES * gradients,
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_setting;
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-9 * b.abs().max(1.0)
    }

    /// Llama-3.1-8B (32 layers, 8 KV heads of 128) at 131,072 tokens on 32 GPUs, with `extra`.
    fn llama_8b_128k(extra: &[&str]) -> (Setting, Layout) {
        let mut sets = vec![
            "model.num_layers=32",
            "model.vocab_size=128256",
            "training.context_length=131072",
            "training.batch_size=1",
        ];
        sets.extend(extra);
        test_setting(&sets, 32)
    }

    #[test]
    fn the_kv_traffic_is_what_the_gathers_and_the_scatter_send() {
        let (s, l) = llama_8b_128k(&[
            "system.context_parallel=4",
            "training.grad_accum_nums=2",
            "training.activation_checkpointing=none",
        ]);
        // By hand: 2 micro-batches × 32 layers × 131,072 tokens × 3/4 (the ring's share) ×
        // K and V of 8 heads × 128 × (2 bf16 all-gathers × 2 B + an fp32 reduce-scatter × 4 B).
        let hand = 2.0 * 32.0 * 131_072.0 * 0.75 * 2.0 * 1024.0 * (2.0 * 2.0 + 4.0);
        assert_eq!(hand, 103_079_215_104.0);
        assert!(close(bytes_per_step(&s, &l), hand));
        // Full recomputation gathers once more in the backward; selective does not.
        for (mode, gathers) in [
            (ActivationCheckpointing::Selective, 2.0),
            (ActivationCheckpointing::Full, 3.0),
        ] {
            let l = Layout {
                activation_checkpointing: mode,
                ..l
            };
            let expected = 2.0 * 32.0 * 131_072.0 * 0.75 * 2.0 * 1024.0 * (gathers * 2.0 + 4.0);
            assert!(close(bytes_per_step(&s, &l), expected), "{mode}");
        }
        // A TP rank sends its share of the KV heads: half of it at T = 2.
        let (tp, l2) = llama_8b_128k(&[
            "system.context_parallel=4",
            "system.tensor_parallel=2",
            "training.grad_accum_nums=2",
            "training.activation_checkpointing=none",
        ]);
        assert!(close(bytes_per_step(&tp, &l2), hand / 2.0));
        // Four ranks of a node (C·T = 4 divides 8) run on its links; 16 span two nodes.
        assert_eq!(link(&s), Link::IntraNode);
        assert!(close(seconds_per_step(&s, &l), hand / s.intra_bw));
        let (wide, _) = llama_8b_128k(&["system.context_parallel=16"]);
        assert_eq!(link(&wide), Link::InterNode);
        let (one, l1) = llama_8b_128k(&[]);
        assert_eq!(bytes_per_step(&one, &l1), 0.0);
        assert_eq!(buffers(&one, &l1).peak(), 0.0);
    }

    #[test]
    fn a_rank_computes_1_over_c_of_the_flops_and_waits_for_the_kv_exchange() {
        let (one, l) = llama_8b_128k(&[]);
        let (eight, l8) = llama_8b_128k(&["system.context_parallel=8"]);
        let whole = super::super::compute_seconds(&one, &l);
        let time = super::super::StepTime::of(&eight, &l8, 32);
        assert!(close(time.compute_seconds, whole / 8.0));
        assert!(close(
            time.context_parallel_seconds,
            bytes_per_step(&eight, &l8) / eight.intra_bw
        ));
        assert!(close(
            time.total(),
            time.compute_seconds + time.data_parallel_seconds + time.context_parallel_seconds
        ));
        // Four data-parallel ranks read their own samples; the 32 ranks hold the same
        // parameters, so the zero stages shard over all of them.
        assert_eq!(eight.data_ranks(32), 4);
        assert_eq!((eight.replica_ranks(32), eight.shard_ranks(32)), (32, 32));
        assert_eq!(eight.tokens_per_sequence(), 16_384);
    }

    #[test]
    fn the_backward_holds_the_whole_sequences_kv_and_its_fp32_gradients() {
        let (s, l) = llama_8b_128k(&["system.context_parallel=8"]);
        let b = buffers(&s, &l);
        let whole = 2.0 * 1024.0 * 131_072.0;
        assert!(close(b.gathered, 2.0 * whole), "bf16");
        assert!(close(b.gradients, 4.0 * whole));
        assert!(close(b.scatter, 4.0 * whole));
        // A block: 32 query heads of 128 over one chunk of 8192 keys: K, V and their gradients
        // repeated (GQA), and the gradients summed back to 8 heads.
        let keys = 8192.0;
        assert!(close(b.block, 2.0 * keys * (4.0 * 4096.0 + 2.0 * 1024.0)));
        assert!(close(b.queries, 4.0 * 4096.0 * 16_384.0));
        // Here the reduce-scatter's send copy is the larger moment.
        assert!(b.scatter > b.block);
        assert!(close(
            b.peak(),
            b.gathered + b.gradients + b.queries + b.scatter
        ));
        // The floor C cannot lower: at C = 2 the whole-sequence buffers are the same, a chunk
        // (and so a block) 4× as long.
        let (two, l2) = llama_8b_128k(&["system.context_parallel=2"]);
        let b2 = buffers(&two, &l2);
        assert_eq!((b2.gathered, b2.gradients), (b.gathered, b.gradients));
        assert!(close(b2.block, 4.0 * b.block));
    }
}
