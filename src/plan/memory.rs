//! Per-rank peak memory: what each buffer of a training step costs, from the model's shape and
//! the layout. The peak is during the backward of a micro-batch: parameters and moments exist
//! and the kept activations are alive, plus either a chunk of the LM head (with the head's
//! gradient only: gradients are dropped after each update) or a decoder layer's backward (its
//! recomputed tensors, and every gradient counted), whichever needs more; the two never
//! overlap.
//!
//! Activation bytes are counted from what autograd saves for each op of `model/llama.rs` (per
//! token: d = hidden, F = FFN width, kv = kv_heads·head_dim, H = heads; c = bytes of the
//! compute dtype). A decoder layer keeps
//! - attention half: the input RMSNorm's output and its normalised input (fp32) and, with bf16
//!   compute, the three bf16 casts of the normed input that q/k/v read (fp32: the normed input
//!   once), q/k after RoPE and v (c·(d + 2kv)), the attention output (c·d) and its log-sum-exp
//!   (4·H), the o_proj input (c·d, a contiguous copy), the residual after attention (4·d);
//! - MLP half: the post-attention RMSNorm likewise (two casts), gate, SiLU(gate), up and their
//!   product (4·c·F);
//! - the layer's input (4·d), and with bf16 at stage 0 the bf16 copies of its fp32 weights the
//!   matmuls saved.
//!
//! The LM head keeps the final-normed hidden states and their gradient (2 × 4·d per token) and,
//! per chunk of C tokens, one fp32 [C, V] buffer (the logits, then their gradient in place),
//! plus their bf16 form with bf16 compute.

use serde::Serialize;

use super::{Device, Layout, Setting};
use crate::model::ActivationCheckpointing;

/// Bytes per rank, by what holds them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Memory {
    /// The parameters the forward reads (fp32 at stage 0, where they are also the master copy;
    /// in the compute dtype at stages 1 and 2).
    pub weights: f64,
    /// fp32 master weights: this rank's shard at stages 1 and 2 with bf16 compute.
    pub master_weights: f64,
    /// AdamW's two fp32 moments (this rank's shard at stages 1 and 2).
    pub moments: f64,
    /// fp32 gradients alive at the peak (they are dropped after each update and build up during
    /// backward; at stage 2 this rank's slice on top).
    pub gradients: f64,
    /// What the decoder layers keep for backward (per the checkpointing mode), the layer being
    /// recomputed, and the gradients flowing between layers.
    pub activations: f64,
    /// The LM head + cross-entropy: the final hidden states and their gradient, one chunk's
    /// logits and their gradients.
    pub logits: f64,
    /// Runtime (libtorch; the CUDA context on a GPU), with bf16 the LM head weight's bf16 copy
    /// and a chunk's bf16 weight gradient, communication buckets, and on CPU the blocks glibc's
    /// allocator keeps after a layer's backward.
    pub workspace: f64,
    /// When the peak is reached: the transient buffers of the other phase are not in it.
    pub peak_during: PeakPhase,
}

/// The two moments a micro-batch's backward can peak at, with every kept activation alive.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PeakPhase {
    /// A chunk of the LM head + cross-entropy (logits counted, no layer's backward).
    #[default]
    LmHead,
    /// The last layer's backward (its recomputation and gradients counted, no logits).
    DecoderBackward,
}

impl Memory {
    /// Bytes in all.
    pub fn total(&self) -> f64 {
        self.weights
            + self.master_weights
            + self.moments
            + self.gradients
            + self.activations
            + self.logits
            + self.workspace
    }

    /// (name, bytes) in the order of the report.
    pub fn parts(&self) -> [(&'static str, f64); 7] {
        [
            ("weights", self.weights),
            ("master weights", self.master_weights),
            ("moments", self.moments),
            ("gradients", self.gradients),
            ("activations", self.activations),
            ("logits", self.logits),
            ("workspace", self.workspace),
        ]
    }
}

/// Resident memory of a CPU training process beyond the buffers counted here: libtorch's code
/// and operator tables, the tokenizer, the mapped token file, glibc's arenas. Calibrated on the
/// 2-core VM: measured peak RSS minus the counted buffers was 0.22–0.30 GB over the runs of
/// tests/plan_memory.rs (BENCHMARKS.md section 6).
pub const CPU_RUNTIME_BYTES: f64 = 0.25e9;
/// glibc's largest dynamic mmap threshold (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit).
const GLIBC_MMAP_MAX: f64 = 32.0 * 1024.0 * 1024.0;

/// A CUDA context with cuBLAS and cuDNN workspaces, as NVML counts it.
pub const CUDA_RUNTIME_BYTES: f64 = 0.6e9;

/// The model's numbers the estimate needs.
struct Dims {
    params: f64,
    layers: f64,
    d: f64,
    f: f64,
    kv: f64,
    heads: f64,
    vocab: f64,
    /// Matrix parameters of one layer (attention, MLP).
    attn_params: f64,
    mlp_params: f64,
}

impl Dims {
    fn of(s: &Setting) -> Dims {
        let sh = &s.shape;
        let (d, hd) = (sh.hidden_size as f64, sh.head_dim() as f64);
        let (h, kvh, f) = (
            sh.num_heads as f64,
            sh.num_kv_heads as f64,
            sh.intermediate_size as f64,
        );
        Dims {
            params: sh.num_parameters() as f64,
            layers: sh.num_layers as f64,
            d,
            f,
            kv: kvh * hd,
            heads: h,
            vocab: sh.vocab_size as f64,
            attn_params: sh.attention_matrix_params() as f64,
            mlp_params: sh.mlp_matrix_params() as f64,
        }
    }
}

/// The estimate of one layout.
pub fn estimate(s: &Setting, l: &Layout) -> Memory {
    let m = Dims::of(s);
    let c = s.compute_bytes();
    let bf16 = c < 4.0;
    let world = s.world.max(1) as f64;
    let stage = l.zero_stage;
    let shard = |bytes: f64| if stage >= 1 { bytes / world } else { bytes };

    let weights = if stage == 0 { 4.0 } else { c } * m.params;
    let master_weights = if stage >= 1 && bf16 {
        4.0 * m.params / world
    } else {
        0.0
    };
    let moments = shard(8.0 * m.params);
    let bucket = s.bucket_bytes;
    // Gradients are dropped after every update (set to none), so during a step's backward they
    // build up unit by unit: at the LM head only the head's own exists (none when it is the
    // tied embedding, whose gradient comes last). Stages 0 and 1 then keep every full gradient
    // until the update; stage 2 reduce-scatters each unit as backward leaves it and drops it,
    // so it holds its fp32 slice, one unit's gradients and their send buffer (train/reduce.rs).
    let head_gradient = if s.shape.tie_word_embeddings {
        0.0
    } else {
        4.0 * m.vocab * m.d
    };
    let largest_unit = (m.attn_params + m.mlp_params).max(m.vocab * m.d);
    let all_gradients = if stage >= 2 {
        4.0 * m.params / world + 2.0 * 4.0 * largest_unit
    } else {
        4.0 * m.params
    };

    // Per token of the micro-batch.
    let n = (l.batch * s.context) as f64;
    let norm = |consumers: f64| {
        4.0 * m.d
            + if bf16 {
                consumers * 2.0 * m.d
            } else {
                4.0 * m.d
            }
    };
    let attention =
        norm(3.0) + c * (m.d + 2.0 * m.kv) + c * m.d + 4.0 * m.heads + c * m.d + 4.0 * m.d;
    let mlp = norm(2.0) + 4.0 * c * m.f;
    let input = 4.0 * m.d;
    let whole_layer = input + attention + mlp;
    // Gradients in flight inside a layer's backward: the residual stream's (in, out) and the
    // largest intermediate's, [tokens, F] in fp32 and the compute dtype.
    let in_flight = 2.0 * 4.0 * m.d + (4.0 + c) * m.f;
    // Kept from the forward until the layer's backward (all layers), and what one layer adds
    // while its backward runs (recomputed tensors; the layer input is already kept).
    let (kept, working) = match l.activation_checkpointing {
        ActivationCheckpointing::None => (m.layers * whole_layer, 0.0),
        ActivationCheckpointing::Full => (m.layers * input, whole_layer - input),
        ActivationCheckpointing::Selective => (m.layers * (input + attention), mlp),
    };
    // bf16 casts of the fp32 weights that autograd keeps until the layer's backward (at
    // stages 1 and 2 the working weights are bf16 already): kept for every layer whose graph
    // is kept, for the recomputed part of one layer otherwise.
    let (casts_kept, casts_working) = if bf16 && stage == 0 {
        let (a, f) = (2.0 * m.attn_params, 2.0 * m.mlp_params);
        match l.activation_checkpointing {
            ActivationCheckpointing::None => (m.layers * (a + f), 0.0),
            ActivationCheckpointing::Full => (0.0, a + f),
            ActivationCheckpointing::Selective => (m.layers * a, f),
        }
    } else {
        (0.0, 0.0)
    };
    let layer_phase = n * (working + in_flight) + casts_working;

    let chunk = match l.loss_chunk_tokens {
        0 => n,
        c => (c as f64).min(n),
    };
    // The final hidden states and their gradient, and one fp32 buffer per chunk (the logits,
    // then their gradient in place), with bf16 also the chunk's bf16 logits and gradient.
    let head_logits = n * 2.0 * 4.0 * m.d + chunk * m.vocab * if bf16 { 6.0 } else { 4.0 };
    // With bf16: the head weight's bf16 copy (stage 0) and a chunk's bf16 weight gradient
    // before it is added into the fp32 one (fp32 adds it in place). The embedding's dense
    // gradient comes after the head and the layers have freed theirs: not part of the peak.
    let head_temp = match (bf16, stage) {
        (false, _) => 0.0,
        (true, 0) => 4.0 * m.vocab * m.d,
        (true, _) => 2.0 * m.vocab * m.d,
    };
    // The kept activations live through both the head and the layers' backward; the peak is
    // the larger of the two phases' own buffers.
    let head_peak = head_logits + head_temp >= layer_phase;
    let activations = n * kept + casts_kept + if head_peak { 0.0 } else { layer_phase };
    let gradients = if head_peak && stage < 2 {
        head_gradient
    } else {
        all_gradients
    };
    let logits = if head_peak { head_logits } else { 0.0 };
    let runtime = match s.device {
        Device::Cpu => CPU_RUNTIME_BYTES,
        Device::Cuda => CUDA_RUNTIME_BYTES,
    };
    let buckets = if s.world > 1 { 2.0 * bucket } else { 0.0 };
    // glibc serves allocations below its mmap threshold (raised dynamically up to 32 MiB)
    // from its arenas and keeps the freed blocks there: while a layer's [tokens, FFN] tensors
    // are that small, the churn of its backward leaves about as much again in holes
    // (calibrated on the runs of tests/plan_memory.rs). Larger tensors are mapped and
    // unmapped whole, and GPU memory has its own caching allocator.
    let allocator_slack = match s.device {
        Device::Cpu if n * 4.0 * m.f < GLIBC_MMAP_MAX => layer_phase,
        _ => 0.0,
    };
    let workspace = runtime + buckets + allocator_slack + if head_peak { head_temp } else { 0.0 };

    Memory {
        weights,
        master_weights,
        moments,
        gradients,
        activations,
        logits,
        workspace,
        peak_during: if head_peak {
            PeakPhase::LmHead
        } else {
            PeakPhase::DecoderBackward
        },
    }
}
