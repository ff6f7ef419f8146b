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
//!
//! With tensor parallelism (T ranks, `plan/tensor.rs`; the pass is `model/backward.rs`)
//! every parameter term counts the rank's share (the matrices and vocabulary rows over T, the
//! norms whole) before the zero stage divides it. Of the activations, what lives inside the
//! attention and MLP blocks is divided by T: q/k/v, the attention output and its log-sum-exp,
//! the o_proj input, gate/up/SiLU and their product (heads and FFN columns are split). What is
//! kept between the blocks — the layer input, the residual after attention, each norm's fp32
//! normalised input and its output, cast once to the compute dtype before the gather (so no
//! per-consumer casts) — is divided by T with sequence parallelism and whole on every rank
//! without it. Each block's graph also keeps two [tokens, d] tensors in the compute dtype whole
//! on every rank: the row-parallel matmul's partial output (the root its backward starts from)
//! and, with sequence parallelism, the all-gathered input its matmuls read (without it that is
//! the norm's output itself). The embedding's partial sums ([tokens, d], fp32) are kept until
//! its backward. A layer's backward also holds the output gradient in the compute dtype (with
//! sequence parallelism gathered from fp32 first) and the gathered input's gradient, [tokens,
//! d] each. The LM head's hidden states and their gradient are every token's on every rank (the
//! vocabulary-parallel head needs them all); a chunk's logits are [C, V_pad/T].
//!
//! With context parallelism (C ranks, `plan/context.rs`; the attention is
//! `model/context_parallel.rs`) a rank holds s/C tokens of each sequence, and every
//! per-token term above counts those: the layers' kept and recomputed tensors, the gradients in
//! flight, the LM head's hidden states and logits. A layer's backward adds its attention's
//! whole-sequence buffers ("cp buffers": the gathered K/V, their fp32 gradients, dQ, and what a
//! block of one key chunk or the reduce-scatter adds, `context::buffers`), in the same phase as the
//! layer's recomputed tensors. The model state is the replica's: the zero stages shard it over
//! the D × C ranks with the same TP position.
//!
//! With expert parallelism (E ranks, `plan/expert.rs`) a rank holds the dense parameters and
//! 1/E of the experts: the weights, the stage-0 moments and the gradients of stages 0 and 1
//! count those (and the largest layer's MLP, for the gradients in flight, its router and 1/E of
//! its experts), while the sharded state (moments, fp32 masters and the gradient slice at stages
//! 1 to 3) is the same per rank as without EP: the experts' 1/E is sharded among their R/E
//! holders. At stage 3 a gathered decoder layer is its dense parameters and those experts. A
//! MoE layer's graph keeps, per token, three more [k, d] rows in the compute dtype with EP
//! (what arrived, the experts' outputs, what came back), with even routing.
//!
//! Zero stage 3 (`train/optim/sharded.rs`) keeps no working parameters between uses: a rank
//! holds the fp32 master slice [P/N] (the parameters' one persistent copy, with any compute
//! dtype), the moments and the fp32 gradient slice [P/N] each. A unit (a decoder layer, the
//! embedding, the final norm, the LM head) is all-gathered in the compute dtype into a buffer
//! of the unit's size before each use; its parameters are views of that buffer (no copy), and
//! the buffer's storage is freed after the use, also where the autograd graph of a layer's
//! forward still refers to it (checkpointing none or selective): the gather before the layer's
//! backward fills the same storage again (`train/optim/mod.rs`, the pass's `Events`). The
//! gathers of the next `system.prefetch_units` units are in flight meanwhile. Its "gathered
//! units" term counts, at the peak: the buffer of the unit in use (at an LM-head chunk the final
//! norm's and the head unit's), the buffers in flight (the next units in backward order: decoder
//! layers, then the embedding), and the prefetch exception: when the gather of a layer's
//! backward is issued while its forward is in use (prefetch reaching 2·(L − i) − 1 units ahead
//! for layer i, so the last ⌊(prefetch − 1)/2⌋ layers), that gather fills a buffer of its own and
//! the forward's buffer is left to the graph (checkpointing none or selective) until the layer's
//! backward, whole. With full checkpointing no graph refers to a freed buffer.
//!
//! A checkpoint save (`plan/checkpoint.rs`) runs between steps, when a rank holds its model state
//! (weights, master weights, moments, the fp32 gradient slice at stages 2 and 3 and at stage 1 with
//! bf16 compute), the runtime and the buckets, plus where the fp32 masters are sharded the full
//! fp32 parameters it writes (4·P/W, gathered for the save) and, with `checkpoint.async` on a CPU
//! rank, the staging copy of what it writes (12·P/W, in the same host memory; on CUDA it is pinned
//! host memory and not counted here). The staging buffers are allocated at the first save and kept:
//! when `checkpoint.interval` is above 0 and below `training.max_steps` they are also alive at
//! every later step's peak; otherwise the only save is after the last step. The estimate is the
//! larger of the step's peak and the save's.

use serde::Serialize;

use super::device::Device;
use super::setting::{Layout, Setting};
use crate::config::ZeroStage;
use crate::model::ActivationCheckpointing;

/// Bytes per rank, by what holds them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Memory {
    /// The parameters the forward reads (fp32 at stage 0, where they are also the master copy;
    /// in the compute dtype at stages 1 and 2; none kept at stage 3, see `gathered_units`).
    pub weights: f64,
    /// fp32 master weights: this rank's shard at stages 1 and 2 with bf16 compute, and at
    /// stage 3 with any compute dtype (there the parameters' only persistent copy).
    pub master_weights: f64,
    /// AdamW's two fp32 moments (this rank's shard at stages 1 to 3); with Muon one fp32
    /// momentum buffer per element of the decoder layers' matrices (`plan/muon.rs`).
    pub moments: f64,
    /// Gradients alive at the peak (they are dropped after each update and build up during
    /// backward; at stages 2 and 3 this rank's fp32 slice, one unit's and their send buffer; at
    /// stage 1 with bf16 compute the fp32 slice the update reads besides).
    pub gradients: f64,
    /// Stage 3: parameters all-gathered for use, in the compute dtype: the buffer of the unit
    /// in use (its parameters are views of it), the gathers in flight ahead of it, and with
    /// checkpointing none or selective the forward buffers of the layers whose backward's gather
    /// the prefetch issues during their forward (their graphs hold them until their backward).
    /// Zero at stages 0 to 2.
    pub gathered_units: f64,
    /// What the decoder layers keep for backward (per the checkpointing mode), the layer being
    /// recomputed, and the gradients flowing between layers.
    pub activations: f64,
    /// With context parallelism, at a decoder layer's backward: its attention's buffers of the
    /// whole sequence (`context::buffers`). Zero at C = 1 and at the LM head.
    pub context_parallel: f64,
    /// The LM head + cross-entropy: the final hidden states and their gradient, one chunk's
    /// logits and their gradients.
    pub logits: f64,
    /// Runtime (libtorch; the CUDA context on a GPU), with bf16 the LM head weight's bf16 copy
    /// and a chunk's bf16 weight gradient, communication buckets, and on CPU the blocks glibc's
    /// allocator keeps after a layer's backward.
    pub workspace: f64,
    /// `checkpoint.async`'s staging copy of what this rank writes, on CPU ranks (host memory,
    /// like the rest): kept from the first save, so also during the later steps when the run
    /// saves before its last step. 0 on CUDA ranks (pinned host memory, not the GPU's; see
    /// `plan/checkpoint.rs`).
    pub staging: f64,
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
    /// A checkpoint save between steps: the model state, the fp32 masters gathered for the
    /// save and the staging copy, above what a step needs.
    CheckpointSave,
}

impl Memory {
    /// Bytes in all.
    pub fn total(&self) -> f64 {
        self.weights
            + self.master_weights
            + self.moments
            + self.gradients
            + self.gathered_units
            + self.activations
            + self.context_parallel
            + self.logits
            + self.workspace
            + self.staging
    }

    /// (part, bytes) in the order of the report.
    pub fn parts(&self) -> [(Part, f64); 10] {
        [
            (Part::Weights, self.weights),
            (Part::MasterWeights, self.master_weights),
            (Part::Moments, self.moments),
            (Part::Gradients, self.gradients),
            (Part::GatheredUnits, self.gathered_units),
            (Part::Activations, self.activations),
            (Part::ContextParallel, self.context_parallel),
            (Part::Logits, self.logits),
            (Part::Workspace, self.workspace),
            (Part::Staging, self.staging),
        ]
    }
}

/// One row of [`Memory`]: what its bytes hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    Weights,
    MasterWeights,
    Moments,
    Gradients,
    GatheredUnits,
    Activations,
    ContextParallel,
    Logits,
    Workspace,
    Staging,
}

impl Part {
    /// The row's name in `lockstep plan`'s table.
    pub fn name(self) -> &'static str {
        match self {
            Part::Weights => "weights",
            Part::MasterWeights => "master weights",
            Part::Moments => "moments",
            Part::Gradients => "gradients",
            Part::GatheredUnits => "gathered units",
            Part::Activations => "activations",
            Part::ContextParallel => "cp buffers",
            Part::Logits => "logits",
            Part::Workspace => "workspace",
            Part::Staging => "staging",
        }
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

/// The model's numbers the estimate needs, as one rank of its TP group holds them.
struct Dims {
    /// Parameters the rank holds: its TP share, with expert parallelism only 1/E of the
    /// experts.
    params: f64,
    /// Parameters the zero stages' sharded state divides among the shard group of N ranks (the
    /// rank's TP share, its own slice being `sharded`/N): with expert parallelism the experts'
    /// 1/E is divided among their N/E holders, the same share per rank.
    sharded: f64,
    layers: f64,
    /// Layers × micro-batches of decoder activations kept at the peak: `layers` without a
    /// pipeline, the schedule's in-flight micro-batches of the rank's stages with one
    /// (`Holds::kept_layers`).
    kept_layers: f64,
    /// Whether the rank holds the LM head (and its loss) and the embedding: every rank
    /// without a pipeline, the last and the first stage's with one.
    head: bool,
    embedding: bool,
    /// The hidden size (whole on every rank).
    d: f64,
    /// The rank's FFN columns, query width (its heads × head_dim), KV width and heads.
    f: f64,
    q: f64,
    kv: f64,
    heads: f64,
    /// The rank's vocabulary rows (V_pad/T).
    vocab: f64,
    /// Matrix parameters of one layer on this rank (attention, MLP; of a MoE layer its router
    /// and the experts the rank holds).
    attn_params: f64,
    mlp_params: f64,
    /// What the activations kept between blocks are divided by: T with sequence parallelism,
    /// else 1.
    seq: f64,
    /// Bytes per token a MoE layer's graph keeps beyond its experts' [tokens·k, F]
    /// intermediates: the gathered tokens [tokens·k, d] (compute dtype), the weighted
    /// outputs (fp32), the router's logits and probabilities [tokens, E]; with expert
    /// parallelism also the rows received, the experts' outputs and the rows returned
    /// ([tokens·k, d] each in the compute dtype on average: `model/expert_parallel.rs`'s
    /// `Dispatch`); 0 for a dense model.
    moe: f64,
}

impl Dims {
    fn of(s: &Setting) -> Dims {
        let sh = &s.shape;
        let t = s.tensor_parallel as f64;
        let (d, hd) = (sh.hidden_size as f64, sh.head_dim() as f64);
        let share = super::tensor::share(s);
        let ep = s.expert_parallel;
        Dims {
            params: share.held(ep),
            sharded: share.parameters,
            layers: sh.num_layers as f64,
            kept_layers: s.holds.kept_layers.unwrap_or(sh.num_layers as f64),
            head: s.holds.head,
            embedding: s.holds.embedding,
            d,
            f: sh.mlp_activation_width() as f64 / t,
            q: sh.num_heads as f64 * hd / t,
            kv: sh.num_kv_heads as f64 * hd / t,
            heads: sh.num_heads as f64 / t,
            vocab: share.vocab,
            attn_params: share.attention,
            mlp_params: share.held_mlp(ep),
            seq: if s.splits_sequence() { t } else { 1.0 },
            moe: sh.moe.as_ref().map_or(0.0, |m| {
                let k = m.top_k as f64;
                let exchanged = if ep > 1 { 3.0 } else { 0.0 };
                (s.compute_bytes() * (1.0 + exchanged) + 4.0) * k * d + 8.0 * m.num_experts as f64
            }),
        }
    }
}

/// The estimate of one layout: the larger of a step's peak and a checkpoint save's.
pub fn estimate(s: &Setting, l: &Layout) -> Memory {
    debug_assert_eq!(
        s.pipeline_parallel, 1,
        "a pipeline's memory is pipeline::run's"
    );
    let step = during_step(s, l);
    let save = at_save(s, l, &step);
    if save.total() > step.total() {
        save
    } else {
        step
    }
}

/// The runtime's resident bytes on the rank's device.
fn runtime(s: &Setting) -> f64 {
    match s.device {
        Device::Cpu => CPU_RUNTIME_BYTES,
        Device::Cuda => CUDA_RUNTIME_BYTES,
    }
}

/// The two gradient buckets of stages 0 to 2 with several data-parallel ranks (stage 3 has no
/// bucketed collective: its gathers and reduce-scatters go a unit at a time).
fn buckets(s: &Setting, l: &Layout) -> f64 {
    if s.replica_ranks(s.world) > 1 && !l.zero_stage.shards_parameters() {
        2.0 * s.bucket_bytes
    } else {
        0.0
    }
}

/// `checkpoint.async`'s staging copy in the rank's memory: on CPU ranks, 0 on CUDA ranks.
pub fn staging_in_rank_memory(s: &Setting) -> f64 {
    match s.device {
        Device::Cpu => super::checkpoint::staging_per_rank(s),
        Device::Cuda => 0.0,
    }
}

/// A rank's memory while it saves a checkpoint, between two steps.
pub fn during_save(s: &Setting, l: &Layout) -> Memory {
    at_save(s, l, &during_step(s, l))
}

/// The save's memory, from the state the step's estimate counts.
fn at_save(s: &Setting, l: &Layout, step: &Memory) -> Memory {
    let sharded = super::tensor::share(s).parameters;
    let world = s.shard_ranks(s.world).max(1) as f64;
    let stage = l.zero_stage;
    let gradients = if keeps_grad_slice(s, stage) {
        4.0 * sharded / world
    } else {
        0.0
    };
    let gathered_masters = if super::checkpoint::gathers_masters(s, stage) {
        4.0 * s.parameters.count() as f64 / super::checkpoint::writing_ranks(s) as f64
    } else {
        0.0
    };
    Memory {
        weights: step.weights,
        master_weights: step.master_weights,
        moments: step.moments,
        gradients,
        gathered_units: 0.0,
        activations: 0.0,
        context_parallel: 0.0,
        logits: 0.0,
        workspace: runtime(s) + buckets(s, l) + gathered_masters,
        staging: staging_in_rank_memory(s),
        peak_during: PeakPhase::CheckpointSave,
    }
}

/// A rank's peak memory during a step: a micro-batch's backward, with the staging buffers of
/// `checkpoint.async` on a CPU rank that saves before the last step. The peak is at the LM
/// head or in a layer's backward, whichever phase's own buffers are larger.
pub fn during_step(s: &Setting, l: &Layout) -> Memory {
    let m = Dims::of(s);
    let state = StepState::of(s, l, &m);
    let p = Phases::of(s, l, &m);
    // The kept activations (and at stage 3 the buffers their graphs hold) live through both
    // the head and the layers' backward; the peak is the larger of the two phases' own buffers.
    let head_peak = m.head
        && p.head_logits + p.head_temp + p.gathered.head >= p.layer + p.context + p.gathered.layer;
    let activations = p.kept + if head_peak { 0.0 } else { p.layer };
    let gathered_units = p.gathered.held
        + if head_peak {
            p.gathered.head
        } else {
            p.gathered.layer
        };
    let gradients = state.grad_slice
        + if head_peak && !l.zero_stage.shards_gradients() {
            state.head_gradient + state.carried
        } else {
            state.all_gradients
        };
    // glibc serves allocations below its mmap threshold (raised dynamically up to 32 MiB)
    // from its arenas and keeps the freed blocks there: while a layer's [tokens, FFN] tensors
    // are that small, the churn of its backward leaves about as much again in holes
    // (calibrated on the runs of tests/plan_memory.rs). Larger tensors are mapped and
    // unmapped whole, and GPU memory has its own caching allocator.
    let allocator_slack = match s.device {
        Device::Cpu if p.tokens * 4.0 * m.f < GLIBC_MMAP_MAX => p.layer,
        _ => 0.0,
    };
    let head_temp = if head_peak { p.head_temp } else { 0.0 };
    Memory {
        weights: state.weights,
        master_weights: state.master_weights,
        moments: state.moments,
        gradients,
        gathered_units,
        activations,
        context_parallel: if head_peak { 0.0 } else { p.context },
        logits: if head_peak { p.head_logits } else { 0.0 },
        workspace: runtime(s) + buckets(s, l) + allocator_slack + head_temp,
        staging: if s.saves_between_steps() {
            staging_in_rank_memory(s)
        } else {
            0.0
        },
        peak_during: if head_peak {
            PeakPhase::LmHead
        } else {
            PeakPhase::DecoderBackward
        },
    }
}

/// Whether the sharded optimizer keeps an fp32 gradient slice [P/N] between steps: at stages 2
/// and 3 the reduce-scatters add into it; at stage 1 with bf16 compute the update reads the
/// bf16 gradients' fp32 copy there (`train/optim/sharded.rs`).
fn keeps_grad_slice(s: &Setting, stage: ZeroStage) -> bool {
    stage.shards_gradients() || (stage == ZeroStage::Optimizer && s.compute_bytes() < 4.0)
}

/// A rank's training state during a step's backward, by zero stage.
struct StepState {
    weights: f64,
    master_weights: f64,
    moments: f64,
    /// The gradients held once backward has been through every layer.
    all_gradients: f64,
    /// The LM head's gradient: all that exists at the head (stages 0 and 1).
    head_gradient: f64,
    /// Earlier micro-batches' gradients that outlive their backward (accumulation).
    carried: f64,
    /// Stage 1 with bf16 compute: the fp32 gradient slice [P/N] the update reads, kept
    /// between steps (`train/optim/sharded.rs`; stages 2 and 3 count theirs in
    /// `all_gradients`). Missing it put the plan 20% under an H200's measured peak.
    grad_slice: f64,
}

impl StepState {
    fn of(s: &Setting, l: &Layout, m: &Dims) -> StepState {
        let c = s.compute_bytes();
        let bf16 = c < 4.0;
        // Sharded state is divided among the shard group (all ranks, or system.shard_degree).
        let world = s.shard_ranks(s.world).max(1) as f64;
        let stage = l.zero_stage;
        let gathering = stage.shards_parameters();
        // Per element of the model state: this rank's slice where the stage shards it, else
        // what the rank holds.
        let shard = |bytes: f64| {
            if stage.shards_optimizer() {
                bytes * m.sharded / world
            } else {
                bytes * m.params
            }
        };

        let weights = match stage {
            ZeroStage::Replicated => 4.0 * m.params,
            ZeroStage::Optimizer | ZeroStage::Gradients => c * m.params,
            ZeroStage::Parameters => 0.0,
        };
        // With fp32 compute at stages 1 and 2 the working parameters are their own masters.
        let master_weights = if gathering || (stage.shards_optimizer() && bf16) {
            4.0 * m.sharded / world
        } else {
            0.0
        };
        // AdamW's two fp32 moments per element; with Muon one momentum buffer per element of
        // the decoder layers' matrices (`plan/muon.rs`: the busiest rank's).
        let moments = match super::muon::cost(s, stage, s.world) {
            Some(muon) => muon.moments,
            None => shard(8.0),
        };
        // Gradients are dropped after every update (set to none), so during a step's backward they
        // build up unit by unit: at the LM head only the head's own exists (none when it is the
        // tied embedding, whose gradient comes last). Stages 0 and 1 then keep every full gradient
        // until the update; stages 2 and 3 reduce-scatter each unit as backward leaves it and drop
        // it, so they hold the fp32 slice, one unit's gradients and their send buffer
        // (train/optim/reduce.rs).
        // A gradient has its parameter's dtype: fp32 at stage 0 (fp32 weights, cast per op), the
        // compute dtype at stage 1 (its working weights are bf16 with bf16 compute).
        let grad_bytes = if stage == ZeroStage::Optimizer {
            c
        } else {
            4.0
        };
        let head_gradient = if s.shape.tie_word_embeddings || !m.head {
            0.0
        } else {
            grad_bytes * m.vocab * m.d
        };
        let vocab_unit = if m.head || m.embedding {
            m.vocab * m.d
        } else {
            0.0
        };
        let largest_unit = (m.attn_params + m.mlp_params).max(vocab_unit);
        // Gradient accumulation (train/optim/reduce.rs): with several micro-batches a step's
        // earlier ones outlive their backward: in the full fp32 gradients at stages 0 and 1 (and 2
        // with fp32 parameters), which add each micro-batch in place, or in fp32 sums of bf16
        // gradients (stages 1 and 2, whose bf16 gradients leave a unit at a time); stage 3
        // reduce-scatters every micro-batch into its slice.
        let carried = match stage {
            _ if l.grad_accum <= 1 => 0.0,
            ZeroStage::Parameters => 0.0,
            _ => 4.0 * m.params,
        };
        let all_gradients = if stage.shards_gradients() {
            4.0 * m.sharded / world + 2.0 * 4.0 * largest_unit + carried
        } else if grad_bytes < 4.0 {
            // bf16 gradients beside the fp32 sums of the earlier micro-batches.
            grad_bytes * m.params + carried
        } else {
            // The sums are these gradients.
            grad_bytes * m.params
        };
        let grad_slice = if stage == ZeroStage::Optimizer && keeps_grad_slice(s, stage) {
            4.0 * m.sharded / world
        } else {
            0.0
        };
        StepState {
            weights,
            master_weights,
            moments,
            all_gradients,
            head_gradient,
            carried,
            grad_slice,
        }
    }
}

/// The activation side of a step's peak: what lives through the whole backward, and what each
/// of its two candidate peaks (the LM head, one layer's backward) adds.
struct Phases {
    /// Tokens of the micro-batch on this rank.
    tokens: f64,
    /// Kept from the forward until each layer's backward (all layers), the embedding's output
    /// and the bf16 weight casts autograd keeps included.
    kept: f64,
    /// What one layer's backward adds (recomputed tensors, tensors in flight, casts).
    layer: f64,
    /// What one layer's context-parallel attention backward adds (0 at C = 1).
    context: f64,
    /// The final hidden states and their gradient, and the loss chunks' logits.
    head_logits: f64,
    /// The head weight's bf16 copy and a chunk's bf16 weight gradient (bf16 compute).
    head_temp: f64,
    /// Stage 3's gathered units at each phase.
    gathered: Gathered,
}

impl Phases {
    fn of(s: &Setting, l: &Layout, m: &Dims) -> Phases {
        let c = s.compute_bytes();
        let bf16 = c < 4.0;
        let stage = l.zero_stage;
        // Per token of the micro-batch on this rank (s/C of each sequence).
        let n = (l.batch * s.tokens_per_sequence()) as f64;
        let LayerBytes {
            input,
            attention,
            mlp,
            in_flight,
            embedded,
        } = layer_bytes(s, m);
        let whole_layer = input + attention + mlp;
        // Kept from the forward until the layer's backward (all layers), and what one layer adds
        // while its backward runs (recomputed tensors; the layer input is already kept).
        let (kept, working) = match l.activation_checkpointing {
            ActivationCheckpointing::None => (m.kept_layers * whole_layer, 0.0),
            ActivationCheckpointing::Full => (m.kept_layers * input, whole_layer - input),
            ActivationCheckpointing::Selective => (m.kept_layers * (input + attention), mlp),
        };
        // bf16 casts of the fp32 weights that autograd keeps until the layer's backward (at
        // stages 1 to 3 the working weights are bf16 already): kept for every layer whose graph
        // is kept, for the recomputed part of one layer otherwise.
        let (casts_kept, casts_working) = if bf16 && stage == ZeroStage::Replicated {
            let (a, f) = (2.0 * m.attn_params, 2.0 * m.mlp_params);
            match l.activation_checkpointing {
                ActivationCheckpointing::None => (m.kept_layers * (a + f), 0.0),
                ActivationCheckpointing::Full => (0.0, a + f),
                ActivationCheckpointing::Selective => (m.kept_layers * a, f),
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
        let head_logits = match m.head {
            true => n * 2.0 * 4.0 * m.d + chunk * m.vocab * if bf16 { 6.0 } else { 4.0 },
            false => 0.0,
        };
        // With bf16: the head weight's bf16 copy (stage 0) and a chunk's bf16 weight gradient
        // before it is added into the fp32 one (fp32 adds it in place). The embedding's dense
        // gradient comes after the head and the layers have freed theirs: not part of the peak.
        let head_temp = match (bf16, stage) {
            _ if !m.head => 0.0,
            (false, _) => 0.0,
            (true, ZeroStage::Replicated) => 4.0 * m.vocab * m.d,
            (true, _) => 2.0 * m.vocab * m.d,
        };
        let gathered = if stage.shards_parameters() {
            gathered_at_stage_3(s, l, m)
        } else {
            Gathered::default()
        };
        Phases {
            tokens: n,
            kept: n * (kept + embedded) + casts_kept,
            layer: layer_phase,
            context: super::context::buffers(s, l).peak(),
            head_logits,
            head_temp,
            gathered,
        }
    }
}

/// One decoder layer's activation bytes per token of the micro-batch on one rank (see the
/// module's notes), by where they live.
#[derive(Debug, Clone, Copy, PartialEq)]
struct LayerBytes {
    /// The layer's input, kept in every checkpointing mode.
    input: f64,
    /// What the attention half keeps for its backward, the residual after it included.
    attention: f64,
    /// What the MLP half keeps for its backward.
    mlp: f64,
    /// Gradients in flight while the layer's backward runs.
    in_flight: f64,
    /// Kept outside the layers through the whole pass: a TP rank's embedding partial sums.
    embedded: f64,
}

fn layer_bytes(s: &Setting, m: &Dims) -> LayerBytes {
    let c = s.compute_bytes();
    let bf16 = c < 4.0;
    let split = s.tensor_parallel > 1;
    let sequence = s.splits_sequence();
    // Between the blocks (divided by T with sequence parallelism): a norm's normalised fp32
    // input and the normed output its `consumers` read: one bf16 cast each (fp32: the output
    // once), or on a TP rank one cast in the compute dtype that they share.
    let norm = |consumers: f64| {
        let read = if split {
            c * m.d
        } else if bf16 {
            consumers * 2.0 * m.d
        } else {
            4.0 * m.d
        };
        (4.0 * m.d + read) / m.seq
    };
    // On a TP rank, what each block's graph keeps whole: the partial output and, with sequence
    // parallelism, the gathered input.
    let whole_per_block = match (split, sequence) {
        (false, _) => 0.0,
        (true, false) => c * m.d,
        (true, true) => 2.0 * c * m.d,
    };
    // Gradients in flight inside a layer's backward: the residual stream's (in, out) and the
    // largest intermediate's, [tokens, F] in fp32 and the compute dtype; on a TP rank also the
    // block's output gradient in the compute dtype (gathered in fp32 first with sequence
    // parallelism) and its gathered input's gradient.
    let split_gradients = match (split, sequence) {
        (false, _) => 0.0,
        (true, false) => 2.0 * c * m.d,
        (true, true) => 2.0 * c * m.d + 4.0 * m.d,
    };
    LayerBytes {
        input: 4.0 * m.d / m.seq,
        attention: norm(3.0)
            + c * (m.q + 2.0 * m.kv)
            + c * m.q
            + 4.0 * m.heads
            + c * m.q
            + 4.0 * m.d / m.seq
            + whole_per_block,
        mlp: norm(2.0) + 4.0 * c * m.f + m.moe + whole_per_block,
        in_flight: 2.0 * 4.0 * m.d / m.seq + (4.0 + c) * m.f + split_gradients,
        embedded: if split && m.embedding { 4.0 * m.d } else { 0.0 },
    }
}

/// Stage 3's gathered parameters (bytes) at each of the two moments the peak can be, and those
/// the saved autograd graphs hold through both.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Gathered {
    /// At an LM-head chunk: the final norm's and the head unit's buffers, the gathers in flight
    /// for the next units (the last decoder layers).
    head: f64,
    /// At the last decoder layer's backward: its buffer, the gathers in flight for the layers
    /// below it (then the embedding).
    layer: f64,
    /// With checkpointing none or selective: the forward buffers of the layers whose backward's
    /// gather was issued while their forward ran ([`held_layers`]), alive until that layer's
    /// backward. Every other layer's is freed after its forward.
    held: f64,
}

/// The units in elements: a decoder layer is its matrices and its two norms; the head unit (the
/// LM head, or the embedding when tied) and the embedding are [vocab, d]; the final norm [d].
/// A pass uses them in the order of `Llama::unit_order`: the embedding, the layers, the final
/// norm and the head unit, then in backward the layers from the last and the embedding, each
/// gather issued `system.prefetch_units` units before its use.
fn gathered_at_stage_3(s: &Setting, l: &Layout, m: &Dims) -> Gathered {
    let c = s.compute_bytes();
    let layer = m.attn_params + m.mlp_params + 2.0 * m.d;
    let embedding = if m.embedding { m.vocab * m.d } else { 0.0 };
    let head = if m.head { m.vocab * m.d } else { 0.0 };
    let final_norm = if m.head { m.d } else { 0.0 };
    // The gathers in flight while a unit is in use, with `layers` decoder layers and then the
    // embedding still to come in the backward.
    let ahead = |layers: f64| {
        let p = s.prefetch_units as f64;
        p.min(layers) * layer + if p > layers { embedding } else { 0.0 }
    };
    let held = match l.activation_checkpointing {
        ActivationCheckpointing::None | ActivationCheckpointing::Selective => {
            held_layers(s.prefetch_units, s.shape.num_layers) as f64 * layer
        }
        ActivationCheckpointing::Full => 0.0,
    };
    Gathered {
        head: c * (head + final_norm + ahead(m.layers)),
        layer: c * (layer + ahead((m.layers - 1.0).max(0.0))),
        held: c * held,
    }
}

/// Bytes as GB with two decimals (the unit of the memory line and of `system.memory_budget_gb`).
pub fn gb(bytes: f64) -> String {
    format!("{:.2} GB", bytes / 1e9)
}

/// The decoder layers whose forward buffer stage 3 cannot free: layer i is used at positions
/// 1 + i and 2·L + 2 − i of the pass, so its backward's gather is issued during its forward
/// when `prefetch` ≥ 2·(L − i) − 1, and that gather gets a buffer of its own
/// (`Events::after`): the last ⌊(prefetch − 1)/2⌋ layers.
pub fn held_layers(prefetch: usize, layers: usize) -> usize {
    (prefetch.saturating_sub(1) / 2).min(layers)
}

#[cfg(test)]
mod tests;
