//! The whole plan of a configuration, as `lockstep plan` prints it (text or JSON).

use std::fmt::Write;

use serde::Serialize;

use super::advice::{
    self, Change, ContextParallelChange, ExpertParallelChange, PipelineOption, TensorParallelChange,
};
use super::checkpoint::{self, Checkpoint};
use super::comm;
use super::context;
use super::estimate::{estimate, Estimate};
use super::expert;
use super::memory::{self, gb, Part, PeakPhase};
use super::pipeline;
use super::setting::{Layout, Setting};
use super::step::{flops_per_token, scaling, Flops, Scaling};
use super::tensor::{self, Link};
use crate::config::ZeroStage;
use crate::model::ActivationCheckpointing;

/// World sizes of the scaling table.
pub const SCALING_RANKS: [usize; 3] = [8, 64, 512];

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub model: ModelSummary,
    pub device: super::Device,
    pub compute_dtype: &'static str,
    /// Ranks in all: `pipeline_parallel` × `data_parallel_ranks` × `context_parallel` ×
    /// `tensor_parallel`.
    pub ranks: usize,
    /// `system.pipeline_parallel` (P; the configured layout's pipeline is
    /// `configured.pipeline`).
    pub pipeline_parallel: usize,
    /// The mesh: ranks per TP group (`system.tensor_parallel`), per CP group
    /// (`system.context_parallel`), data-parallel ranks (each with its own samples), and whether
    /// sequence parallelism is in effect.
    pub tensor_parallel: usize,
    pub context_parallel: usize,
    pub data_parallel_ranks: usize,
    /// Ranks that hold the same parameters (data × context): what the zero stages shard and
    /// the gradient reductions run over.
    pub replica_ranks: usize,
    pub sequence_parallel: bool,
    /// The vocabulary as the TP group splits it (rounded up to a multiple of T).
    pub padded_vocab_size: usize,
    pub context_length: usize,
    /// Memory one rank may use, and where the figure comes from.
    pub budget_bytes: f64,
    pub budget_source: String,
    /// The configured layout.
    pub configured: Estimate,
    /// One object per rank layout: every zero stage × activation checkpointing mode at the
    /// configured micro-batch and LM-head chunking.
    pub layouts: Vec<Estimate>,
    pub flops_per_token: Flops,
    pub peak_flops: f64,
    pub peak_source: String,
    pub mfu: f64,
    pub step_seconds: f64,
    /// Tokens per second of one rank (its CP × TP group's over C·T), and of all ranks.
    pub tokens_per_second: f64,
    pub tokens_per_second_total: f64,
    /// Bytes one rank sends per step at each zero stage (index = stage) among the replica
    /// ranks.
    pub comm_bytes_per_step: [f64; 4],
    /// Bytes one rank sends to its TP group per step (0 at T = 1), the link that carries them
    /// and its bandwidth (bytes/s per rank).
    pub tensor_parallel_bytes_per_step: f64,
    pub tensor_parallel_link: Link,
    pub tensor_parallel_bandwidth: f64,
    /// Bytes one rank sends to its CP group per step (0 at C = 1): K/V all-gathered and dK/dV
    /// reduce-scattered (`context.rs`), the link that carries them and its bandwidth.
    pub context_parallel_bytes_per_step: f64,
    pub context_parallel_link: Link,
    pub context_parallel_bandwidth: f64,
    /// `system.expert_parallel` (E), and the bytes one rank sends to its expert-parallel group
    /// per step (0 at E = 1): the tokens' all-to-alls (`expert.rs`), the link that carries them
    /// and its bandwidth.
    pub expert_parallel: usize,
    pub expert_parallel_bytes_per_step: f64,
    pub expert_parallel_link: Link,
    pub expert_parallel_bandwidth: f64,
    /// `system.prefetch_units`: at zero stage 3, unit gathers issued ahead of the unit in use.
    pub prefetch_units: usize,
    /// Replica ranks that shard one copy of the state (all of them, or
    /// `system.shard_degree`).
    pub shard_ranks: usize,
    /// The dtype gradients travel in (`system.reduce_dtype`).
    pub reduce_dtype: &'static str,
    pub intra_node_bandwidth: f64,
    pub inter_node_bandwidth: f64,
    pub node_size: usize,
    pub scaling: Vec<Scaling>,
    pub fits: bool,
    /// When the configured layout does not fit: the cheapest one that does (None: nothing does).
    pub advice: Option<Change>,
    /// When nothing fits: the most frugal layout and what it needs.
    pub smallest: Option<Change>,
    /// On GPUs, when no data-parallel layout fits at `advice::EFFICIENCY_TARGET`: the tensor
    /// parallelism that does best (`advice::tensor_parallel`).
    pub tensor_parallel_advice: Option<TensorParallelChange>,
    /// On GPUs, when one sequence fits no layout of the current mesh: the smallest context
    /// parallelism that fits (`advice::context_parallel`), beside the TP advice.
    pub context_parallel_advice: Option<ContextParallelChange>,
    /// On GPUs, for a mixture of experts: the expert parallelism that fits when nothing does,
    /// or that shortens the step (`advice::expert_parallel`).
    pub expert_parallel_advice: Option<ExpertParallelChange>,
    /// When the configured layout does not fit with `checkpoint.async`'s staging copy in the
    /// rank's memory (CPU) and fits without it: what it needs with `checkpoint.async=false`.
    pub fits_without_staging: Option<f64>,
    /// What a checkpoint save writes, stages and stalls (`plan/checkpoint.rs`).
    pub checkpoint: Checkpoint,
    /// What downstream evaluation costs each time it runs (`plan/downstream.rs`; None without
    /// `training.eval_tasks`).
    pub downstream: Option<super::downstream::Downstream>,
    /// `training.optimizer = muon`: what Muon costs the busiest rank at the configured layout
    /// (`plan/muon.rs`); None with AdamW.
    pub muon: Option<super::muon::MuonCost>,
    /// On GPUs with a pipeline configured or more ranks than a node: every pipeline layout
    /// that fits (`advice::pipeline_options`), and the one proposed (`advice::pipeline`).
    pub pipeline_options: Vec<PipelineOption>,
    pub pipeline_advice: Option<PipelineOption>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ModelSummary {
    /// The family (`model.architecture`, resolved).
    pub architecture: &'static str,
    pub parameters: usize,
    pub layers: usize,
    pub hidden_size: usize,
    pub heads: usize,
    pub head_dim: usize,
    pub kv_heads: usize,
    pub intermediate_size: usize,
    pub vocab_size: usize,
    pub tied_embeddings: bool,
    /// A mixture of experts: the parameters one token uses (its k experts per MoE layer).
    pub active_parameters: usize,
    /// Experts per MoE layer, k, one expert's width, and the MoE layers (None: dense).
    pub experts: Option<ExpertsSummary>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ExpertsSummary {
    pub experts: usize,
    pub top_k: usize,
    pub expert_size: usize,
    pub moe_layers: usize,
}

pub fn build(s: &Setting, l: &Layout) -> Report {
    let configured = estimate(s, l);
    let mut layouts = Vec::new();
    for zero_stage in ZeroStage::ALL {
        for activation_checkpointing in [
            ActivationCheckpointing::None,
            ActivationCheckpointing::Selective,
            ActivationCheckpointing::Full,
        ] {
            layouts.push(estimate(
                s,
                &Layout {
                    zero_stage,
                    activation_checkpointing,
                    ..*l
                },
            ));
        }
    }
    let fits = configured.fits;
    let advice = (!fits)
        .then(|| advice::cheapest_within(s, l, s.budget))
        .flatten();
    let smallest = (!fits && advice.is_none()).then(|| advice::smallest(s, l));
    let tensor_parallel_advice = advice::tensor_parallel(s, l);
    let context_parallel_advice = advice::context_parallel(s, l);
    let expert_parallel_advice = advice::expert_parallel(s, l);
    let (pipeline_options, pipeline_advice) = pipeline_advice(s, l);
    let fits_without_staging = (!fits && configured.memory.staging > 0.0)
        .then(|| {
            let sync = Setting {
                ckpt_async: false,
                ..s.clone()
            };
            estimate(&sync, l).total_bytes
        })
        .filter(|total| *total <= s.budget);
    let tokens = l.tokens_per_step(s.context) as f64;
    let sh = &s.shape;
    Report {
        model: ModelSummary {
            architecture: sh.family.name(),
            parameters: s.parameters.count(),
            head_dim: sh.head_dim(),
            layers: sh.num_layers,
            hidden_size: sh.hidden_size,
            heads: sh.num_heads,
            kv_heads: sh.num_kv_heads,
            intermediate_size: sh.intermediate_size,
            vocab_size: sh.vocab_size,
            tied_embeddings: sh.tie_word_embeddings,
            active_parameters: s.parameters.count() - sh.inactive_expert_params(),
            experts: sh.moe.as_ref().map(|m| ExpertsSummary {
                experts: m.num_experts,
                top_k: m.top_k,
                expert_size: m.expert_size,
                moe_layers: (0..sh.num_layers).filter(|&i| m.is_sparse(i)).count(),
            }),
        },
        device: s.device,
        compute_dtype: if s.bf16 { "bf16" } else { "fp32" },
        ranks: s.world,
        pipeline_parallel: s.pipeline_parallel,
        tensor_parallel: s.tensor_parallel,
        context_parallel: s.context_parallel,
        data_parallel_ranks: s.data_ranks(s.world),
        replica_ranks: s.replica_ranks(s.world),
        sequence_parallel: s.splits_sequence(),
        padded_vocab_size: tensor::padded_vocab(s),
        context_length: s.context,
        budget_bytes: s.budget,
        budget_source: s.budget_source.clone(),
        flops_per_token: flops_per_token(s, l),
        peak_flops: s.peak_flops,
        peak_source: s.peak_source.clone(),
        mfu: s.mfu,
        step_seconds: configured.step_seconds,
        tokens_per_second: tokens
            / ((s.pipeline_parallel * s.tensor_parallel * s.context_parallel) as f64
                * configured.step_seconds),
        tokens_per_second_total: tokens * s.data_ranks(s.world) as f64 / configured.step_seconds,
        comm_bytes_per_step: ZeroStage::ALL.map(|zero_stage| data_parallel_bytes(s, l, zero_stage)),
        tensor_parallel_bytes_per_step: tensor::bytes_per_step(s, l),
        tensor_parallel_link: tensor::link(s),
        tensor_parallel_bandwidth: tensor::bandwidth(s),
        context_parallel_bytes_per_step: context::bytes_per_step(s, l),
        context_parallel_link: context::link(s),
        context_parallel_bandwidth: context::bandwidth(s),
        expert_parallel: s.expert_parallel,
        expert_parallel_bytes_per_step: expert::bytes_per_step(s, l),
        expert_parallel_link: expert::link(s),
        expert_parallel_bandwidth: expert::bandwidth(s),
        prefetch_units: s.prefetch_units,
        shard_ranks: s.shard_ranks(s.world),
        reduce_dtype: if s.reduce_bytes < 4.0 { "bf16" } else { "fp32" },
        intra_node_bandwidth: s.intra_bw,
        inter_node_bandwidth: s.inter_bw,
        node_size: s.node_size,
        scaling: scaling_rows(s, l),
        checkpoint: checkpoint::build(s, l, configured.step_seconds),
        downstream: None,
        fits_without_staging,
        configured,
        layouts,
        fits,
        advice,
        smallest,
        tensor_parallel_advice,
        context_parallel_advice,
        expert_parallel_advice,
        muon: super::muon::cost(s, l.zero_stage, s.world),
        pipeline_options,
        pipeline_advice,
    }
}

fn what(part: Part, s: &Setting, l: &Layout, peak: PeakPhase) -> String {
    let chunk = match l.loss_chunk_tokens {
        0 => "one chunk of the micro-batch".to_string(),
        c => format!(
            "chunks of {} tokens",
            c.min(l.batch * s.tokens_per_sequence())
        ),
    };
    let dtype = if s.bf16 { "bf16" } else { "fp32" };
    let stage = l.zero_stage;
    let t = s.tensor_parallel;
    match part {
        Part::Weights if stage == ZeroStage::Replicated => {
            format!("fp32 parameters (also the master copy){}", experts_held(s))
        }
        Part::Weights if stage.shards_parameters() => {
            "none kept between uses: gathered a unit at a time".into()
        }
        Part::Weights if t > 1 => format!(
            "{dtype} working parameters of this rank's TP share (1/{t} of the matrices, the norms whole)"
        ),
        Part::Weights => format!("{dtype} working parameters{}", experts_held(s)),
        Part::MasterWeights if stage.shards_parameters() => {
            "fp32 shard of this rank, the parameters' only persistent copy".into()
        }
        Part::MasterWeights if stage.shards_optimizer() && s.bf16 => {
            "fp32 shard of this rank".into()
        }
        Part::MasterWeights => "none separate".into(),
        Part::Moments if s.muon.is_some() && stage.shards_optimizer() => {
            "Muon's momentum (matrices), AdamW m and v (the rest), fp32, the busiest rank's shard"
                .into()
        }
        Part::Moments if s.muon.is_some() => {
            "Muon's momentum (matrices), AdamW m and v (the rest), fp32".into()
        }
        Part::Moments if stage.shards_optimizer() => {
            "AdamW m and v, fp32, this rank's shard".into()
        }
        Part::Moments => "AdamW m and v, fp32".into(),
        Part::Gradients if peak == PeakPhase::CheckpointSave => {
            if stage.shards_gradients() {
                "fp32 shard, kept between steps".into()
            } else {
                "none: dropped after each update".into()
            }
        }
        Part::Gradients if stage.shards_gradients() => {
            "fp32 shard + the largest unit's gradients and their send buffer".into()
        }
        Part::Gradients if stage == ZeroStage::Optimizer => {
            format!("{dtype}, as the working parameters")
        }
        Part::Gradients => "fp32".into(),
        Part::Activations | Part::Logits | Part::GatheredUnits | Part::ContextParallel
            if peak == PeakPhase::CheckpointSave =>
        {
            "none: freed between steps".into()
        }
        Part::GatheredUnits => gathered_text(s, l, peak, dtype),
        Part::Activations => activations_text(s, l),
        Part::ContextParallel => context_text(s, l, peak, dtype),
        Part::Logits => format!(
            "{chunk} × vocab {}: fp32{}, hidden states and their gradient",
            if t > 1 {
                format!("{}/{t}", tensor::padded_vocab(s))
            } else {
                s.shape.vocab_size.to_string()
            },
            if s.bf16 { " + bf16" } else { "" }
        ),
        Part::Workspace => workspace_text(s, stage, peak),
        Part::Staging => {
            let writers = checkpoint::writing_ranks(s);
            let kept = if peak == PeakPhase::CheckpointSave {
                "kept from the first save"
            } else {
                "kept from the first save through every later step"
            };
            format!(
                "checkpoint.async: host copy of what this rank writes (12 B/param over {writers} writing rank{}), {kept}",
                if writers == 1 { "" } else { "s" }
            )
        }
    }
}

/// With expert parallelism, which experts a rank's weights hold (empty at E = 1).
fn experts_held(s: &Setting) -> String {
    match &s.shape.moe {
        Some(m) if s.expert_parallel > 1 => format!(
            ": the dense ones and {} of the {} experts of each MoE layer (expert parallel {})",
            m.num_experts / s.expert_parallel,
            m.num_experts,
            s.expert_parallel
        ),
        _ => String::new(),
    }
}

/// The gathered units' line of the breakdown (stage 3).
fn gathered_text(s: &Setting, l: &Layout, peak: PeakPhase, dtype: &str) -> String {
    let in_use = match peak {
        PeakPhase::LmHead => "final norm + LM head",
        // A save's gathered units are none, said above.
        PeakPhase::DecoderBackward | PeakPhase::CheckpointSave => "layer",
    };
    let held = memory::held_layers(s.prefetch_units, s.shape.num_layers);
    let saved = match l.activation_checkpointing {
        ActivationCheckpointing::Full => String::new(),
        _ if held == 0 => String::new(),
        _ => format!(
            ", the last {held} layers' forward buffers held by their graphs (prefetch reached their backward)"
        ),
    };
    format!(
        "{dtype}: {} unit buffers (the one in use + {} prefetched), the {in_use} in use{saved}",
        1 + s.prefetch_units,
        s.prefetch_units
    )
}

/// The context-parallel buffers' line of the breakdown.
fn context_text(s: &Setting, l: &Layout, peak: PeakPhase, dtype: &str) -> String {
    if peak == PeakPhase::LmHead {
        return "below the peak: an LM-head chunk needs more than a layer's backward".into();
    }
    let b = context::buffers(s, l);
    let t = s.tensor_parallel;
    let heads = if t > 1 {
        format!("kv_heads/{t}")
    } else {
        "kv_heads".into()
    };
    format!(
        "a layer's attention backward: K/V of the whole sequence gathered ({dtype} [2, {}, {heads}, {}, hd], {}) and their fp32 gradients ({}), dQ ({}), then {}",
        l.batch,
        s.context,
        gb(b.gathered),
        gb(b.gradients),
        gb(b.queries),
        if b.block >= b.scatter {
            format!(
                "a block's K/V (one key chunk) repeated to the query heads and their gradients ({})",
                gb(b.block)
            )
        } else {
            format!(
                "the fp32 send copy the reduce-scatter makes ({})",
                gb(b.scatter)
            )
        }
    )
}

/// The activations' line of the breakdown.
fn activations_text(s: &Setting, l: &Layout) -> String {
    let t = s.tensor_parallel;
    let c = s.context_parallel;
    format!(
        "{}, {} × {} tokens{}{}",
        match l.activation_checkpointing {
            ActivationCheckpointing::None => "no checkpointing: every saved tensor",
            ActivationCheckpointing::Full => "full: layer inputs + one layer recomputed",
            ActivationCheckpointing::Selective =>
                "selective: attention halves + one MLP recomputed",
        },
        match s.holds.kept_layers {
            None => format!("{} layers", s.shape.num_layers),
            Some(k) => format!(
                "{k:.0} layer-micro-batches (the schedule's in flight on the rank's {} layers)",
                s.shape.num_layers
            ),
        },
        l.batch * s.tokens_per_sequence(),
        if c > 1 {
            format!(" (1/{c} of each sequence: context parallel)")
        } else {
            String::new()
        },
        match (t, s.splits_sequence()) {
            (1, _) => String::new(),
            (_, true) => format!(", 1/{t} per rank (sequence parallel between the blocks)"),
            (_, false) => format!(
                ", 1/{t} per rank inside the blocks, whole between them (no sequence parallelism)"
            ),
        }
    )
}

/// The workspace's line of the breakdown.
fn workspace_text(s: &Setting, stage: ZeroStage, peak: PeakPhase) -> String {
    let mut w = match s.device {
        super::Device::Cpu if peak == PeakPhase::CheckpointSave => "libtorch runtime".to_string(),
        super::Device::Cpu => "libtorch runtime, allocator slack".to_string(),
        super::Device::Cuda => "CUDA context".to_string(),
    };
    if peak == PeakPhase::CheckpointSave && checkpoint::gathers_masters(s, stage) {
        w.push_str(", the full fp32 parameters this rank writes, gathered for the save");
    }
    if s.bf16 && peak == PeakPhase::LmHead {
        w.push_str(if stage == ZeroStage::Replicated {
            ", bf16 LM-head weight and gradient"
        } else {
            ", a chunk's bf16 LM-head gradient"
        });
    }
    if s.world > 1 && !stage.shards_parameters() {
        w.push_str(", two gradient buckets");
    }
    w
}

/// Seconds with three significant-ish digits.
fn secs(x: f64) -> String {
    if x < 1.0 {
        format!("{x:.3} s")
    } else if x < 100.0 {
        format!("{x:.1} s")
    } else {
        format!("{x:.0} s")
    }
}

/// The plan's checkpoint lines: what a save writes, stages and stalls.
fn checkpoint_text(o: &mut String, r: &Report, s: &Setting) {
    let c = &r.checkpoint;
    let plural = |n: usize| if n == 1 { "" } else { "s" };
    let _ = writeln!(
        o,
        "Checkpoint: {} per save ({}): {} from each of {} writing rank{}{}; storage {:.1} GB/s per node (--storage-gbps)",
        gb(c.bytes_per_save),
        match r.muon {
            None => "fp32 weights and AdamW moments, 12 B/param".to_string(),
            Some(_) => format!(
                "fp32 weights, AdamW's two moments and Muon's momentum buffer: {:.1} B/param",
                c.bytes_per_save / r.model.parameters as f64
            ),
        },
        gb(c.bytes_per_rank),
        c.writing_ranks,
        plural(c.writing_ranks),
        if c.writing_ranks > 1 {
            format!(
                ", {} from the node with the most ({})",
                gb(c.bytes_per_node),
                c.writing_ranks_per_node
            )
        } else {
            String::new()
        },
        c.storage_bandwidth / 1e9
    );
    let held = r.configured.memory.staging > 0.0;
    let staged = match (c.background, c.staging_in_rank_memory) {
        (false, _) => " (checkpoint.async = false: saves write from the training state)".to_string(),
        (true, true) if held => {
            " of host memory, kept from the first save (checkpoint.async): in the per-rank peak above"
                .to_string()
        }
        (true, true) => format!(
            " of host memory (checkpoint.async): one save, after the last step (checkpoint.interval = {}, training.max_steps = {}), below a step's peak",
            c.interval, s.max_steps
        ),
        (true, false) => format!(
            " of pinned host memory, kept from the first save (checkpoint.async): {} per node of {} writing rank{}, besides the GPU's memory",
            gb(c.staging_bytes_per_node),
            c.writing_ranks_per_node,
            plural(c.writing_ranks_per_node)
        ),
    };
    let _ = writeln!(
        o,
        "  staging {} per rank{staged}",
        gb(c.staging_bytes_per_rank)
    );
    let gather = if c.gather_seconds > 0.0 {
        format!(
            "; both include {} to gather the fp32 master weights",
            secs(c.gather_seconds)
        )
    } else {
        String::new()
    };
    let waits = c.stall_async_seconds - c.gather_seconds - c.copy_seconds;
    let writer = if waits > 0.0 {
        format!(
            "; its writer needs {}, {} more than the training between saves: the next save waits",
            secs(c.write_seconds),
            secs(waits)
        )
    } else {
        format!("; written in the background in {}", secs(c.write_seconds))
    };
    let _ = writeln!(
        o,
        "  stall per save: synchronous {} (the node's {} at {:.1} GB/s), asynchronous {} ({} copied at {:.0} GB/s, estimated{writer}){gather}; configured: {}",
        secs(c.stall_sync_seconds),
        gb(c.bytes_per_node),
        c.storage_bandwidth / 1e9,
        secs(c.stall_async_seconds),
        gb(c.bytes_per_rank),
        c.copy_bandwidth / 1e9,
        if c.background {
            "asynchronous"
        } else {
            "synchronous"
        }
    );
    match (c.seconds_between_saves, c.time_lost_sync, c.time_lost_async) {
        (Some(between), Some(sync), Some(async_)) => {
            let _ = writeln!(
                o,
                "  time lost to saves every {} steps ({} of training at the estimated step time): synchronous {:.2}%, asynchronous {:.2}%",
                c.interval,
                secs(between),
                sync * 100.0,
                async_ * 100.0
            );
        }
        _ => {
            let _ = writeln!(
                o,
                "  time lost to saves: none during training, one save after the last step (checkpoint.interval = {}, training.max_steps = {})",
                c.interval, s.max_steps
            );
        }
    }
}

/// The plan as text.
/// Every pipeline layout that fits and the one proposed (`advice::pipeline_options`): on GPUs
/// with a pipeline configured or more ranks than a node; none otherwise.
fn pipeline_advice(s: &Setting, l: &Layout) -> (Vec<PipelineOption>, Option<PipelineOption>) {
    let options = if s.pipeline_parallel > 1 || s.world > s.node_size {
        advice::pipeline_options(s, l)
    } else {
        Vec::new()
    };
    let proposed = advice::pipeline(s, l, &options);
    (options, proposed)
}

/// The scaling table's rows: the world sizes of [`SCALING_RANKS`] the mesh divides.
fn scaling_rows(s: &Setting, l: &Layout) -> Vec<Scaling> {
    SCALING_RANKS
        .iter()
        .filter(|&&n| {
            let stage = n / s.pipeline_parallel;
            n.is_multiple_of(s.pipeline_parallel)
                && stage.is_multiple_of(s.tensor_parallel * s.context_parallel)
                && (stage / s.tensor_parallel).is_multiple_of(s.expert_parallel)
        })
        .map(|&n| match s.pipeline_parallel {
            1 => scaling(s, l, n),
            _ => pipeline::scaling(s, l, n),
        })
        .collect()
}

/// Data-parallel bytes one rank sends per step at `zero_stage` (the busiest pipeline rank's).
fn data_parallel_bytes(s: &Setting, l: &Layout, zero_stage: ZeroStage) -> f64 {
    match s.pipeline_parallel {
        1 => comm::bytes_per_step(s, l, zero_stage, s.world),
        _ => pipeline::run(s, &Layout { zero_stage, ..*l }, s.world).data_parallel_bytes,
    }
}

pub fn text(r: &Report, s: &Setting) -> String {
    let mut o = String::new();
    model_text(&mut o, r, s);
    memory_text(&mut o, r, s);
    layouts_text(&mut o, r, s);
    compute_text(&mut o, r, s);
    checkpoint_text(&mut o, r, s);
    downstream_text(&mut o, r);
    pipeline_options_text(&mut o, r);
    let _ = writeln!(o);
    if r.fits {
        let _ = writeln!(
            o,
            "Fits: {} of {} per rank.{}",
            gb(r.configured.total_bytes),
            gb(r.budget_bytes),
            [
                tensor_parallel_text(r),
                expert_parallel_text(r),
                pipeline_advice_text(r)
            ]
            .into_iter()
            .flatten()
            .map(|t| format!(" {t}"))
            .collect::<String>()
        );
    } else {
        let _ = writeln!(
            o,
            "Does not fit: {} needed, {} available. {}",
            gb(r.configured.total_bytes),
            gb(r.budget_bytes),
            advice_text(r)
        );
    }
    o
}

/// The downstream evaluation line: its rows, FLOPs and time, against the step time.
fn downstream_text(o: &mut String, r: &Report) {
    let Some(d) = &r.downstream else {
        return;
    };
    let every = match d.share {
        Some(share) => format!(
            "; every {} steps it adds {:.1}% to training's time",
            d.interval,
            100.0 * share
        ),
        None => "; once, at the end (training.eval_interval = 0)".to_string(),
    };
    let _ = writeln!(
        o,
        "Downstream eval: {} task{}, {} items ({} rows, {} tokens padded): {:.3} PFLOP, {} per \
         evaluation at {:.0}% of peak ({:.0} items/s over {} data rank{}) = {:.1} steps{every}",
        d.tasks,
        if d.tasks == 1 { "" } else { "s" },
        d.items,
        d.rows,
        d.padded_tokens,
        d.flops / 1e15,
        secs(d.seconds),
        100.0 * r.mfu,
        d.items_per_second,
        r.data_parallel_ranks,
        if r.data_parallel_ranks == 1 { "" } else { "s" },
        d.steps
    );
}

/// The tensor parallelism to switch to, with what it needs and gains against the data-parallel
/// layout that fits (None when there is none to propose).
fn tensor_parallel_text(r: &Report) -> Option<String> {
    let tp = r.tensor_parallel_advice.as_ref()?;
    let c = &tp.change;
    let now = match (r.fits, &r.advice) {
        (true, _) => format!(
            "against {:.0}% as configured",
            r.configured.efficiency * 100.0
        ),
        (false, Some(a)) => format!("against {:.0}% with the change above", a.efficiency * 100.0),
        (false, None) => "where no layout of the current mesh fits".to_string(),
    };
    Some(format!(
        "With tensor parallelism in a node: {} (mesh {} tensor-parallel × {} data-parallel, the same tokens per step; needs {}, step {} ({:+.0}%), scaling efficiency {:.0}% {now}).",
        c.flags(),
        tp.tensor_parallel,
        tp.data_parallel_ranks,
        gb(c.total_bytes),
        secs(c.step_seconds),
        c.slowdown * 100.0,
        c.efficiency * 100.0
    ))
}

/// The model and the layout it runs in.
fn model_text(o: &mut String, r: &Report, _s: &Setting) {
    let l = &r.configured.layout;
    let m = &r.model;
    let _ =
        writeln!(
        o,
        "Model: {} {:.3} B parameters{} | {} layers, d {}, {} heads of {} / {} kv heads, FFN {}, vocab {}{}{}",
        m.architecture,
        m.parameters as f64 / 1e9,
        m.experts.as_ref().map_or(String::new(), |e| format!(
            " ({:.3} B active: {} of {} experts of width {} in {} MoE layers)",
            m.active_parameters as f64 / 1e9,
            e.top_k,
            e.experts,
            e.expert_size,
            e.moe_layers
        )),
        m.layers,
        m.hidden_size,
        m.heads,
        m.head_dim,
        m.kv_heads,
        m.intermediate_size,
        m.vocab_size,
        if r.padded_vocab_size > m.vocab_size {
            format!(" (padded to {} for tensor parallelism)", r.padded_vocab_size)
        } else {
            String::new()
        },
        if m.tied_embeddings { ", tied" } else { "" }
    );
    let device = match (r.device, r.ranks) {
        (super::Device::Cpu, 1) => "CPU process",
        (super::Device::Cpu, _) => "CPU processe",
        (super::Device::Cuda, _) => "GPU",
    };
    let sequence = if r.sequence_parallel { "on" } else { "off" };
    let p = r.pipeline_parallel;
    let mesh = match (r.context_parallel, r.tensor_parallel) {
        _ if p > 1 => format!(
            " = mesh {p} pipeline × {} data-parallel × {} context-parallel × {} tensor-parallel{}",
            r.data_parallel_ranks,
            r.context_parallel,
            r.tensor_parallel,
            if r.tensor_parallel > 1 {
                format!(", sequence parallel {sequence}")
            } else {
                String::new()
            }
        ),
        (1, 1) => String::new(),
        (1, t) => format!(
            " = mesh {t} tensor-parallel × {} data-parallel, sequence parallel {sequence}",
            r.data_parallel_ranks,
        ),
        (c, t) => format!(
            " = mesh {} data-parallel × {c} context-parallel × {t} tensor-parallel{}",
            r.data_parallel_ranks,
            if t > 1 {
                format!(", sequence parallel {sequence}")
            } else {
                String::new()
            }
        ),
    };
    let _ = writeln!(
        o,
        "Layout: {} {device}{}{mesh} | {} compute | micro-batch {} × {} tokens × {} accumulation{} | zero stage {}{} | activation checkpointing {} | loss chunks {}",
        r.ranks,
        if r.ranks == 1 { "" } else { "s" },
        r.compute_dtype,
        l.batch,
        r.context_length,
        l.grad_accum,
        if r.tensor_parallel > 1 || r.context_parallel > 1 {
            " per data-parallel rank"
        } else {
            ""
        },
        l.zero_stage,
        [
            if l.zero_stage.shards_parameters() {
                format!(
                    " (1 + {} prefetched = {} unit gathers in flight)",
                    r.prefetch_units,
                    1 + r.prefetch_units
                )
            } else {
                String::new()
            },
            if r.shard_ranks < r.replica_ranks {
                format!(
                    ", hybrid: sharded in groups of {}, replicated across {}",
                    r.shard_ranks,
                    r.replica_ranks / r.shard_ranks
                )
            } else {
                String::new()
            },
            match (r.expert_parallel, &r.model.experts) {
                (ep, Some(m)) if ep > 1 => format!(
                    " | expert parallel {ep} (groups of {ep} replicas, each rank {} of every MoE layer's {} experts)",
                    m.experts / ep,
                    m.experts
                ),
                _ => String::new(),
            },
        ]
        .concat(),
        l.activation_checkpointing,
        match l.loss_chunk_tokens {
            0 => "off".to_string(),
            c => format!("{c} tokens"),
        }
    );
}

/// The configured layout's per-rank peak, row by row, against the budget.
fn memory_text(o: &mut String, r: &Report, s: &Setting) {
    let l = &r.configured.layout;
    // With pipeline stages the breakdown is the rank with the most, described as its setting.
    let peak_rank = r
        .configured
        .pipeline
        .as_ref()
        .map(|p| pipeline::peak_rank(s, l, p));
    let (whose, s) = match &peak_rank {
        Some((rank, one)) => (
            format!(" of pipeline rank {rank}, the one with the most"),
            one,
        ),
        None => (String::new(), s),
    };
    let _ = writeln!(
        o,
        "\nPer-rank peak memory{whose} ({}):",
        match r.configured.memory.peak_during {
            PeakPhase::LmHead => "during a micro-batch's backward, at an LM-head chunk".to_string(),
            PeakPhase::DecoderBackward => {
                "during a micro-batch's backward, at a decoder layer's backward".to_string()
            }
            PeakPhase::CheckpointSave => format!(
                "during a checkpoint save, between steps; a step's own peak is {}",
                gb(memory::during_step(s, l).total())
            ),
        }
    );
    let peak = r.configured.memory.peak_during;
    for (part, bytes) in r.configured.memory.parts() {
        if (part == Part::GatheredUnits && !l.zero_stage.shards_parameters())
            || (part == Part::ContextParallel && r.context_parallel == 1)
            || (part == Part::Staging && bytes == 0.0)
        {
            continue;
        }
        let name = part.name();
        let note = if part == Part::Logits && bytes == 0.0 && peak != PeakPhase::CheckpointSave {
            "below the peak: a decoder layer's backward needs more".to_string()
        } else {
            what(part, s, l, peak)
        };
        let _ = writeln!(o, "  {name:<15} {:>10}   {note}", gb(bytes));
    }
    let verdict = if r.fits { "fits" } else { "DOES NOT FIT" };
    let _ = writeln!(
        o,
        "  {:<15} {:>10}   of {} ({}): {verdict}",
        "total",
        gb(r.configured.total_bytes),
        gb(r.budget_bytes),
        r.budget_source
    );
}

/// Every zero stage × checkpointing mode: GB per rank and whether it fits.
fn layouts_text(o: &mut String, r: &Report, _s: &Setting) {
    let _ = writeln!(o, "\nEvery layout (GB per rank; * = fits):");
    let _ = writeln!(
        o,
        "  zero stage {:>12}{:>12}{:>12}",
        "none", "selective", "full"
    );
    for stage in ZeroStage::ALL {
        if !r.layouts.iter().any(|e| e.layout.zero_stage == stage) {
            continue;
        }
        let _ = write!(o, "  {:<10} ", stage.number());
        for e in r.layouts.iter().filter(|e| e.layout.zero_stage == stage) {
            let _ = write!(
                o,
                "{:>11.2}{}",
                e.total_bytes / 1e9,
                if e.fits { "*" } else { " " }
            );
        }
        let _ = writeln!(o);
    }
}

/// FLOPs and step time, communication per step, and scaling.
fn compute_text(o: &mut String, r: &Report, _s: &Setting) {
    step_text(o, r);
    pipeline_text(o, r);
    communication_text(o, r);
    muon_text(o, r);
    scaling_text(o, r);
}

/// The compute line: FLOPs per token, how a step's time splits, tokens/s.
fn step_text(o: &mut String, r: &Report) {
    let l = &r.configured.layout;
    let f = &r.flops_per_token;
    let t = r.tensor_parallel;
    let cp = r.context_parallel;
    let time = &r.configured.time;
    let split = match (cp, t) {
        (1, 1) => String::new(),
        (1, t) => format!(", 1/{t} of it on each rank of a tensor-parallel group"),
        (c, 1) => format!(
            ", 1/{c} of it on each rank of a context-parallel group (its s/{c} tokens of each sequence, and 1/{c} of its causal attention)"
        ),
        (c, t) => format!(
            ", 1/{} of it on each rank of a context-parallel × tensor-parallel group ({c} × {t})",
            c * t
        ),
    };
    let groups: Vec<String> = [
        ("tensor-parallel", t > 1, time.tensor_parallel_seconds),
        ("context-parallel", cp > 1, time.context_parallel_seconds),
        (
            "expert-parallel",
            r.expert_parallel > 1,
            time.expert_parallel_seconds,
        ),
        ("Muon", r.muon.is_some(), time.muon_seconds),
        (
            "pipeline bubble",
            r.pipeline_parallel > 1,
            time.pipeline_bubble_seconds,
        ),
        (
            "point-to-point",
            r.pipeline_parallel > 1,
            time.pipeline_p2p_seconds,
        ),
    ]
    .into_iter()
    .filter(|(_, on, _)| *on)
    .map(|(name, _, secs)| format!(" + {name} {secs:.3} s"))
    .collect();
    let parts = if groups.is_empty() {
        String::new()
    } else {
        format!(
            " (compute {:.3} s{} + data-parallel {:.3} s)",
            time.compute_seconds,
            groups.concat(),
            time.data_parallel_seconds
        )
    };
    let _ = writeln!(
        o,
        "\nCompute: {:.2} GFLOP per token ({:.2} model{}){}; at {:.0}% of {:.1} TFLOP/s ({}): step {:.3} s{}, {:.0} tokens/s per rank, {:.0} in all",
        (f.model + f.recomputed) / 1e9,
        f.model / 1e9,
        if f.recomputed > 0.0 {
            format!(" + {:.2} recomputed by {} checkpointing", f.recomputed / 1e9, l.activation_checkpointing)
        } else {
            String::new()
        },
        split,
        r.mfu * 100.0,
        r.peak_flops / 1e12,
        r.peak_source,
        r.step_seconds,
        parts,
        r.tokens_per_second,
        r.tokens_per_second_total
    );
}

/// The pipeline's line: its stages, each rank's memory, the bubble and the sends.
fn pipeline_text(o: &mut String, r: &Report) {
    let Some(p) = &r.configured.pipeline else {
        return;
    };
    let per_rank = match p.stages_per_rank {
        1 => String::new(),
        v => format!(", {v} stages per rank"),
    };
    let layers: Vec<String> = p.stage_layers.iter().map(|n| n.to_string()).collect();
    let memory: Vec<String> = (0..p.ranks)
        .map(|i| format!("{:.2} ({})", p.rank_bytes[i] / 1e9, p.rank_in_flight[i]))
        .collect();
    let time = &r.configured.time;
    let _ = writeln!(
        o,
        "Pipeline: {} ranks, {}{per_rank}, {} micro-batches per step; decoder layers per stage: {}; \
         GB per rank (micro-batch-stages of activations at its peak): {}; an average rank idles \
         {:.1}% of the pipeline's time ({:.3} s: the bubble, and stages with more work); {} per activation between stages, {} sent per step by the \
         busiest rank over {} at {:.0} GB/s ({:.3} s on the critical path)",
        p.ranks,
        p.schedule,
        p.micro_batches,
        layers.join(" "),
        memory.join(", "),
        p.bubble * 100.0,
        time.pipeline_bubble_seconds,
        mb(p.message_bytes),
        gb(p.bytes_per_step),
        p.link.describe(),
        p.bandwidth / 1e9,
        time.pipeline_p2p_seconds
    );
}

/// Every pipeline layout that fits, one line each.
fn pipeline_options_text(o: &mut String, r: &Report) {
    if r.pipeline_options.is_empty() {
        return;
    }
    let _ = writeln!(
        o,
        "Pipeline layouts that fit (the same tokens per step; each with its cheapest layout of the other knobs):"
    );
    let _ = writeln!(
        o,
        "  {:>3} {:<12} {:>3} {:>5} {:>10} {:>10} {:>8} {:>11}   layout",
        "P", "schedule", "V", "data", "GB/rank", "step", "bubble", "efficiency"
    );
    for p in &r.pipeline_options {
        let c = &p.change;
        let l = &c.layout;
        let _ = writeln!(
            o,
            "  {:>3} {:<12} {:>3} {:>5} {:>10.2} {:>8.2} s {:>7.1}% {:>10.1}%   stage {}, {}, {} × {}",
            p.pipeline_parallel,
            p.schedule.name(),
            p.virtual_stages,
            p.data_parallel_ranks,
            c.total_bytes / 1e9,
            c.step_seconds,
            p.bubble * 100.0,
            c.efficiency * 100.0,
            l.zero_stage,
            l.activation_checkpointing,
            l.batch,
            l.grad_accum
        );
    }
}

/// The pipeline layout proposed, as one sentence.
fn pipeline_advice_text(r: &Report) -> Option<String> {
    let p = r.pipeline_advice.as_ref()?;
    Some(format!(
        "With pipeline parallelism: {} (mesh {} pipeline × {} data-parallel × {} context-parallel × {} tensor-parallel, the same tokens per step; needs {}, step {} ({:+.0}%), scaling efficiency {:.0}%).",
        p.change.flags(),
        p.pipeline_parallel,
        p.data_parallel_ranks,
        r.context_parallel,
        r.tensor_parallel,
        gb(p.change.total_bytes),
        secs(p.change.step_seconds),
        p.change.slowdown * 100.0,
        p.change.efficiency * 100.0
    ))
}

/// Bytes as MB with one decimal.
fn mb(bytes: f64) -> String {
    format!("{:.1} MB", bytes / 1e6)
}

/// The data-parallel traffic per zero stage, and the tensor- and context-parallel traffic.
fn communication_text(o: &mut String, r: &Report) {
    let l = &r.configured.layout;
    let t = r.tensor_parallel;
    let cp = r.context_parallel;
    let time = &r.configured.time;
    let _ = writeln!(
        o,
        "Communication per step per rank among {} {}rank{} (ring; {} gradients): stage 0 {}, stage 1 {}, stage 2 {}, stage 3 {}",
        r.replica_ranks,
        match (cp, t) {
            (1, 1) => "",
            (1, _) => "data-parallel ",
            _ => "data × context ",
        },
        if r.replica_ranks == 1 { "" } else { "s" },
        r.reduce_dtype,
        gb(r.comm_bytes_per_step[0]),
        gb(r.comm_bytes_per_step[1]),
        gb(r.comm_bytes_per_step[2]),
        gb(r.comm_bytes_per_step[3]),
    );
    if t > 1 {
        let _ = writeln!(
            o,
            "Tensor parallelism: {} per step per rank in each group of {t} (8 × {}/{t} × d × {} B per layer and token{}; the embedding, LM head and cross-entropy besides), over {} at {:.0} GB/s: {:.3} s, not overlapped",
            gb(r.tensor_parallel_bytes_per_step),
            t - 1,
            if r.compute_dtype == "bf16" { 2 } else { 4 },
            match l.activation_checkpointing {
                ActivationCheckpointing::None => "",
                ActivationCheckpointing::Selective => ", +25% for the MLP's recomputed forward",
                ActivationCheckpointing::Full => ", +50% for the recomputed forward",
            },
            r.tensor_parallel_link.describe(),
            r.tensor_parallel_bandwidth / 1e9,
            time.tensor_parallel_seconds
        );
    }
    if cp > 1 {
        let _ = writeln!(
            o,
            "Context parallelism: {} per step per rank in each group of {cp} (per layer and micro-batch, K and V all-gathered {} and dK/dV reduce-scattered in fp32 once: {}/{cp} × 2 × {} kv_heads × {} hd × ({} × {} B + 4 B) per token of the sequence), over {} at {:.0} GB/s: {:.3} s, not overlapped",
            gb(r.context_parallel_bytes_per_step),
            match l.activation_checkpointing {
                ActivationCheckpointing::Full => "3 times (forward, the recomputed forward, backward)",
                _ => "twice (forward, backward)",
            },
            cp - 1,
            if t > 1 {
                format!("{}/{t}", r.model.kv_heads)
            } else {
                r.model.kv_heads.to_string()
            },
            r.model.hidden_size / r.model.heads,
            context::gathers_per_layer(l),
            if r.compute_dtype == "bf16" { 2 } else { 4 },
            r.context_parallel_link.describe(),
            r.context_parallel_bandwidth / 1e9,
            time.context_parallel_seconds
        );
    }
    if let (Some(m), ep) = (&r.model.experts, r.expert_parallel) {
        if ep > 1 {
            let _ = writeln!(
                o,
                "Expert parallelism: {} per step per rank in each group of {ep} (per MoE layer and micro-batch, each token's {} copies sent to their experts' ranks and back, forward and backward{}: {} × {}/{ep} × {} × d × {} B per token, even routing assumed; the busiest rank's share sets the pace), over {} at {:.0} GB/s: {:.3} s, not overlapped; {}",
                gb(r.expert_parallel_bytes_per_step),
                m.top_k,
                match l.activation_checkpointing {
                    ActivationCheckpointing::None => "",
                    _ => ", and again in the recomputed forward",
                },
                expert::exchanges_per_layer(l),
                ep - 1,
                m.top_k,
                if r.compute_dtype == "bf16" { 2 } else { 4 },
                r.expert_parallel_link.describe(),
                r.expert_parallel_bandwidth / 1e9,
                time.expert_parallel_seconds,
                match r.replica_ranks / ep {
                    1 => "each expert has one holder: its gradients are not reduced".to_string(),
                    h => format!("the experts' gradients reduced among their {h} holders"),
                }
            );
        }
    }
}

/// Muon's line: its state, its Newton–Schulz work and its exchanges (`plan/muon.rs`).
fn muon_text(o: &mut String, r: &Report) {
    let Some(m) = &r.muon else {
        return;
    };
    let tensor = match r.tensor_parallel {
        1 => String::new(),
        t => format!(" + {} within each tensor group of {t}", gb(m.tensor_bytes)),
    };
    let _ = writeln!(
        o,
        "Muon: the decoder layers' matrices ({:.0}% of the parameters) keep one fp32 momentum buffer, the rest AdamW's two moments ({} on the busiest rank); Newton–Schulz {:.2} TFLOP per step in all, {:.2} TFLOP on the busiest rank (each matrix orthogonalized by one owner); its bf16 exchanges {}{tensor} per step per rank; {:.3} s per step after the reductions, not overlapped",
        100.0 * m.matrices / r.model.parameters as f64,
        gb(m.moments),
        m.total_flops / 1e12,
        m.flops / 1e12,
        gb(m.bytes),
        m.seconds
    );
}

/// The scaling table: communication time and efficiency from one node to many.
fn scaling_text(o: &mut String, r: &Report) {
    let l = &r.configured.layout;
    let t = r.tensor_parallel;
    let cp = r.context_parallel;
    let _ = writeln!(
        o,
        "Scaling at zero stage {} (same batch per {}rank{}; {:.0} GB/s within a node of {}, {:.0} GB/s across nodes):",
        l.zero_stage,
        if t > 1 || cp > 1 { "data-parallel " } else { "" },
        [
            if cp > 1 {
                format!(", context_parallel {cp}")
            } else {
                String::new()
            },
            if t > 1 {
                format!(", tensor_parallel {t}")
            } else {
                String::new()
            },
        ]
        .concat(),
        r.intra_node_bandwidth / 1e9,
        r.node_size,
        r.inter_node_bandwidth / 1e9
    );
    let tp_column = |x: String| if t > 1 { x } else { String::new() };
    let cp_column = |x: String| if cp > 1 { x } else { String::new() };
    let ep = r.expert_parallel;
    let ep_column = |x: String| if ep > 1 { x } else { String::new() };
    let _ = writeln!(
        o,
        "  {:>6} {:>14} {:>12}{}{}{} {:>22} {:>22}",
        "ranks",
        "sent per rank",
        "comm time",
        tp_column(format!(" {:>12}", "TP time")),
        cp_column(format!(" {:>12}", "CP time")),
        ep_column(format!(" {:>12}", "EP time")),
        "efficiency (today)",
        "(reductions overlapped)"
    );
    for sc in &r.scaling {
        let _ = writeln!(
            o,
            "  {:>6} {:>14} {:>10.3} s{}{}{} {:>21.1}% {:>21.1}%",
            sc.ranks,
            gb(sc.bytes_per_rank),
            sc.comm_seconds,
            tp_column(format!(" {:>10.3} s", sc.tensor_parallel_seconds)),
            cp_column(format!(" {:>10.3} s", sc.context_parallel_seconds)),
            ep_column(format!(" {:>10.3} s", sc.expert_parallel_seconds)),
            sc.efficiency * 100.0,
            sc.efficiency_overlapped * 100.0
        );
    }
}

/// When the configured layout does not fit: the cheapest change that does, or what even the
/// most frugal layout needs, and the tensor and context parallelism to switch to when there
/// are. Empty when it fits.
pub fn advice_text(r: &Report) -> String {
    if r.fits {
        return String::new();
    }
    let save = &r.checkpoint;
    let without_staging = |total: f64| {
        format!(
            "--set checkpoint.async=false, without the {} staging copy (needs {}; every save then stalls training for its whole write, an estimated {} instead of {})",
            gb(r.configured.memory.staging),
            gb(total),
            secs(save.stall_sync_seconds),
            secs(save.stall_async_seconds)
        )
    };
    let advice = match (&r.advice, &r.smallest, r.fits_without_staging) {
        (Some(c), _, alternative) => format!(
            "Cheapest change that fits: {} (needs {}, step time {:+.0}%).{}",
            c.flags(),
            gb(c.total_bytes),
            c.slowdown * 100.0,
            alternative
                .map(|t| format!(" Or {}.", without_staging(t)))
                .unwrap_or_default()
        ),
        (None, _, Some(t)) => format!("It fits with {}.", without_staging(t)),
        (None, Some(c), None) => format!(
            "No layout fits: even {} needs {}. Use more ranks (zero stages 1 to 3 shard the optimizer state, then the gradients, then the parameters across them), a shorter training.context_length, or a smaller model.{}",
            if c.sets.is_empty() {
                "the current layout".to_string()
            } else {
                c.flags()
            },
            gb(c.total_bytes),
            match r.configured.memory.staging {
                0.0 => String::new(),
                b => format!(
                    " --set checkpoint.async=false drops the {} staging copy.",
                    gb(b)
                ),
            }
        ),
        (None, None, None) => String::new(),
    };
    [
        Some(advice),
        tensor_parallel_text(r),
        context_parallel_text(r),
        expert_parallel_text(r),
        pipeline_advice_text(r),
    ]
    .into_iter()
    .flatten()
    .filter(|t| !t.is_empty())
    .collect::<Vec<_>>()
    .join(" ")
}

/// The context parallelism to switch to, with what it needs and costs (None when there is
/// none to propose).
fn context_parallel_text(r: &Report) -> Option<String> {
    let cp = r.context_parallel_advice.as_ref()?;
    let c = &cp.change;
    Some(format!(
        "With context parallelism (each sequence split among {} ranks): {} (mesh {} data-parallel × {} context-parallel × {} tensor-parallel, the same tokens per step; needs {}, step {} ({:+.0}%), scaling efficiency {:.0}%).",
        cp.context_parallel,
        c.flags(),
        cp.data_parallel_ranks,
        cp.context_parallel,
        cp.tensor_parallel,
        gb(c.total_bytes),
        secs(c.step_seconds),
        c.slowdown * 100.0,
        c.efficiency * 100.0
    ))
}

/// The expert parallelism to switch to, with what it needs and costs (None when there is none
/// to propose).
fn expert_parallel_text(r: &Report) -> Option<String> {
    let ep = r.expert_parallel_advice.as_ref()?;
    let c = &ep.change;
    Some(format!(
        "With expert parallelism (each rank {} of every MoE layer's experts, tokens sent to them by all-to-all): {} (needs {}, step {} ({:+.0}%) with {} of all-to-all over {}, scaling efficiency {:.0}%; the same tokens per step).",
        ep.experts_per_rank,
        c.flags(),
        gb(c.total_bytes),
        secs(c.step_seconds),
        c.slowdown * 100.0,
        secs(ep.all_to_all_seconds),
        ep.link.describe(),
        c.efficiency * 100.0
    ))
}
