//! What a configuration needs before it runs: per-rank memory, FLOPs, step time,
//! communication and scaling — behind `lockstep plan` and `train`'s start check.
//!
//! Design note. The estimate is a closed-form model of this code base, not a generic rule of
//! thumb: every term counts a buffer lockstep allocates (see `memory.rs` for the activation
//! accounting, op by op), so the same function answers "does it fit" for `train` and prints the
//! breakdown for `plan`, and a change in the model code has one place to be reflected in. It
//! is checked against the measured peak RSS of CPU runs (tests/plan_memory.rs, within 15%;
//! figures in BENCHMARKS.md). The zero-stage terms follow the design's "Sharded data
//! parallelism" (`../shared/DESIGN.md`, beside the repository): stage 0 holds fp32 weights, gradients and two moments (16 B/param); stage 1
//! shards the moments and, with bf16 compute, keeps bf16 working weights plus an fp32 master
//! shard; stage 2 also shards the gradients; stage 3 also shards the parameters, so that a rank
//! keeps 16 B/param over N ranks (fp32 master, moment and gradient slices) plus the units it
//! has all-gathered for use (`system.prefetch_units` ahead of the one in use; a unit's buffer is
//! freed after each use, also under a forward's autograd graph, except where the prefetch
//! issues a layer's backward gather during its forward), and at every micro-batch sends two all-gathers of the parameters in the compute
//! dtype (before the forward and again before the backward) and one fp32 reduce-scatter of the
//! gradients. A gradient has its parameter's dtype: fp32 at stages 0, 2 and 3 (fp32 weights, or
//! the fp32 slice the reduce-scatter fills), the compute dtype at stage 1 (bf16 working weights).
//! Step time is FLOPs over an assumed utilisation of the device's peak, and communication is
//! the ring algorithm's bandwidth term over stated link speeds: both are stated in the output
//! as assumptions, because they are. A checkpoint save (`checkpoint.rs`) writes 12 B/param
//! shared by the writing ranks; with `checkpoint.async` each keeps a host staging copy of its
//! share, counted in a CPU rank's memory (`memory.rs`), and the stall per save is the copy
//! rather than the write at an assumed storage bandwidth (`lockstep plan --storage-gbps`).
//!
//! Tensor parallelism (`system.tensor_parallel` = T, `tensor.rs`) makes the world a mesh of
//! D × T ranks, TP innermost. A rank holds its TP share of the parameters (the matrices and the
//! vocabulary over T, the norms whole), and everything above acts on that share along the data-
//! parallel dimension: zero stages, `system.shard_degree` and `system.reduce_dtype` shard and
//! send it among the D ranks with the same TP position. Every rank does 1/T of every matmul; the
//! activations inside the attention and MLP blocks are divided by T, those kept between them
//! (residual stream, norms, layer inputs) by T only with sequence parallelism (`memory.rs`,
//! which also lists the few [tokens, hidden] tensors a TP rank keeps whole).
//! The TP group's collectives are counted whole in the step time; the data-parallel ones as
//! before (`StepTime`).
//!
//! Context parallelism (`system.context_parallel` = C, `context.rs`) makes the mesh D × C × T
//! (tensor innermost, then context, then data). The C ranks of a CP group read the same
//! samples and split every sequence: each holds s/C of its tokens, for which it keeps every
//! activation the model keeps per token, and does 1/C of the sequence's FLOPs (attention's
//! included: the zigzag chunks give every rank the same share of the causal mask's work). A
//! rank's attention briefly holds the whole sequence's keys and values and, in backward, their
//! fp32 gradients (`memory.rs`'s "cp buffers"), and the group all-gathers K/V and
//! reduce-scatters dK/dV every layer (`context.rs`). Only the D data-parallel ranks bring
//! their own samples (tokens per step), while the D·C ranks with the same TP position hold the
//! same parameters: the zero stages, `system.shard_degree` and the gradient reductions act on
//! those ([`Setting::replica_ranks`]).
//!
//! Expert parallelism (`system.expert_parallel` = E, `expert.rs`) splits every MoE layer's
//! experts among E consecutive replicas: a rank holds the dense parameters and 1/E of the
//! experts (its weights and unsharded gradients), while the sharded state per rank is what it
//! was (the experts' 1/E sharded among their R/E holders). The experts' gradients are reduced
//! among the holders only (`comm.rs`), and the group's all-to-alls of the tokens (4 per MoE
//! layer and micro-batch, 6 with recomputation) are counted whole in the step time. `plan`
//! proposes an E for a mixture of experts (`advice::expert_parallel`): inside a node first.
//!
//! Downstream evaluation (`training.eval_tasks`, `downstream.rs`) costs the forward FLOPs of its
//! tasks' rows each time it runs, shared by the data ranks: said beside the step time.

pub mod advice;
pub mod budget;
pub mod checkpoint;
pub mod comm;
pub mod context;
mod device;
pub mod downstream;
mod estimate;
pub mod expert;
pub mod memory;
pub mod muon;
pub mod pipeline;
pub mod report;
mod setting;
pub mod start;
mod step;
pub mod tensor;

use crate::config::Config;
use crate::model::LlamaShape;

pub use advice::Change;
pub use device::{bf16_compute, Device};
pub use estimate::{estimate, Estimate};
pub use memory::{gb, Memory};
pub use setting::{Holds, Layout, Setting, Target};
pub use step::{compute_seconds, flops_per_token, Flops, StepTime};

/// The model's shape without preparing data: from `model.model_path`'s config.json, else from
/// the config keys and the tokenizer's vocabulary (loaded only when `model.vocab_size` is null).
pub fn shape(cfg: &Config) -> anyhow::Result<LlamaShape> {
    use anyhow::Context;
    shape_with(cfg, || match cfg.model.vocab_size {
        Some(v) => Ok(v),
        None => {
            let spec = &cfg.data.tokenizer;
            Ok(
                crate::data::tokenizer::Tokenizer::load(&crate::data::hub::resolve_tokenizer(
                    spec,
                )?)
                .with_context(|| format!("data.tokenizer = {spec}"))?
                .vocab_size(),
            )
        }
    })
}

/// The model's shape, resolved one way for `plan` and `train`: a `model.model_path` model's
/// config.json, else the config's keys with `model.vocab_size` or the tokenizer's vocabulary
/// (`tokenizer_vocab`, asked only then).
pub fn shape_with(
    cfg: &Config,
    tokenizer_vocab: impl FnOnce() -> anyhow::Result<usize>,
) -> anyhow::Result<LlamaShape> {
    match &cfg.model.model_path {
        Some(dir) => {
            crate::model::hf::shape_from_dir(&crate::data::hub::resolve_model(dir)?, &cfg.model)
        }
        None => LlamaShape::from_config(&cfg.model, tokenizer_vocab()?),
    }
}

/// A setting and layout for unit tests: the production preset with `sets`, planned for `world`
/// CUDA ranks of 80 GB. `sets` must give `model.vocab_size` (no tokenizer is loaded).
#[cfg(test)]
pub(crate) fn test_setting(sets: &[&str], world: usize) -> (Setting, Layout) {
    test_preset_setting(None, sets, world)
}

/// [`test_setting`] from `preset` (None: the production preset).
#[cfg(test)]
pub(crate) fn test_preset_setting(
    preset: Option<&str>,
    sets: &[&str],
    world: usize,
) -> (Setting, Layout) {
    let cfg = crate::config::resolve(&crate::config::Sources {
        preset: preset.map(str::to_string),
        sets: sets.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    })
    .expect("a valid config")
    .config;
    let setting = Setting::new(
        &cfg,
        shape(&cfg).expect("a shape"),
        Target {
            device: Device::Cuda,
            world,
            budget: (80e9, "test".into()),
            mfu: 0.4,
            cpu_threads: 1,
            storage_bw: checkpoint::DEFAULT_STORAGE_GBPS * 1e9,
        },
    );
    (setting, Layout::from_config(&cfg))
}
