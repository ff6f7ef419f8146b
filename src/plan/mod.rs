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

pub mod advice;
pub mod budget;
pub mod checkpoint;
pub mod comm;
pub mod context;
pub mod memory;
pub mod report;
pub mod start;
pub mod tensor;

use serde::Serialize;

use crate::config::{Config, ZeroStage};
use crate::model::{ActivationCheckpointing, LlamaShape};

pub use advice::Change;
pub use memory::Memory;

/// What the plan is for: where it runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Device {
    Cpu,
    Cuda,
}

/// The fixed facts of a run: model, context, precision, device and ranks.
#[derive(Debug, Clone)]
pub struct Setting {
    pub shape: LlamaShape,
    pub context: usize,
    /// bf16 matmuls (master weights and moments stay fp32).
    pub bf16: bool,
    pub device: Device,
    /// Ranks in all (GPUs, or CPU processes): the data-parallel ranks × `context_parallel` ×
    /// `tensor_parallel`.
    pub world: usize,
    /// `system.tensor_parallel`: ranks that split every layer between them (T, innermost in the
    /// mesh).
    pub tensor_parallel: usize,
    /// `system.context_parallel`: ranks that split every sequence between them (C, between the
    /// data-parallel and the tensor-parallel dimension).
    pub context_parallel: usize,
    /// `system.sequence_parallel`: with T > 1, the activations between the layers' matmuls are
    /// split along the tokens among the TP group (`splits_sequence`).
    pub sequence_parallel: bool,
    /// `system.bucket_mb` in bytes.
    pub bucket_bytes: f64,
    /// `system.prefetch_units`: at zero stage 3, units whose all-gather runs ahead of the one
    /// in use.
    pub prefetch_units: usize,
    /// `system.shard_degree`: data-parallel ranks that shard one copy of the state (0 = all of
    /// them).
    pub shard_degree: usize,
    /// Bytes per gradient value sent between ranks (`system.reduce_dtype`).
    pub reduce_bytes: f64,
    /// Memory one rank may use (bytes), and where that figure came from.
    pub budget: f64,
    pub budget_source: String,
    /// Dense peak FLOP/s of one device for the compute dtype, and where the figure came from.
    pub peak_flops: f64,
    pub peak_source: String,
    /// Assumed fraction of the peak that the executed FLOPs reach.
    pub mfu: f64,
    /// Collective bandwidth (bytes/s per rank) within a node and across nodes, and ranks per
    /// node.
    pub intra_bw: f64,
    pub inter_bw: f64,
    pub node_size: usize,
    /// `checkpoint.async`: saves are staged in host memory and written in the background.
    pub ckpt_async: bool,
    /// `checkpoint.interval`: steps between saves (0 = only at the end).
    pub ckpt_interval: usize,
    /// `training.max_steps`: the run's last step, after which it saves in any case.
    pub max_steps: usize,
    /// Bytes/s one node writes to the checkpoint storage, shared by its ranks.
    pub storage_bw: f64,
}

/// What the plan is asked about beyond the config: the device, the ranks and the memory each
/// may use.
#[derive(Debug, Clone)]
pub struct Target {
    pub device: Device,
    /// Ranks in all, of every TP group.
    pub world: usize,
    /// Memory one rank may use (bytes), and where the figure comes from.
    pub budget: (f64, String),
    /// Assumed utilisation of the peak FLOP/s.
    pub mfu: f64,
    /// CPU threads per rank (CPU throughput only).
    pub cpu_threads: usize,
    /// Bytes/s one node writes durably to the checkpoint storage (`--storage-gbps`).
    pub storage_bw: f64,
}

impl Setting {
    /// Whether sequence parallelism is in effect: configured, with a TP group to split over.
    pub fn splits_sequence(&self) -> bool {
        self.sequence_parallel && self.tensor_parallel > 1
    }

    /// Data-parallel ranks among `world` ranks (D): one per CP × TP group, each with its own
    /// samples.
    pub fn data_ranks(&self, world: usize) -> usize {
        self.mesh(world).data().max(1)
    }

    /// Ranks among `world` that hold the same parameters (one per TP group: D × C): what the
    /// zero stages shard and the gradient reductions run over.
    pub fn replica_ranks(&self, world: usize) -> usize {
        self.mesh(world).replicas().max(1)
    }

    /// Replica ranks that shard one copy of the state among `world` ranks: all of them, or
    /// the hybrid-sharding group size (`system.shard_degree`).
    pub fn shard_ranks(&self, world: usize) -> usize {
        self.mesh(world).shard().max(1)
    }

    /// This setting's mesh on `world` ranks (the arithmetic `train` and `check_world` use).
    fn mesh(&self, world: usize) -> crate::config::MeshShape {
        crate::config::MeshShape {
            world,
            tensor: self.tensor_parallel,
            context: self.context_parallel,
            shard_degree: self.shard_degree,
        }
    }

    /// Tokens of each sequence on one rank: the context over C.
    pub fn tokens_per_sequence(&self) -> usize {
        self.context / self.context_parallel
    }

    pub fn new(cfg: &Config, shape: LlamaShape, t: Target) -> Setting {
        let bf16 = bf16_compute(cfg, t.device);
        let prefetch_units = crate::config::prefetch_units(cfg, shape.num_layers);
        let (peak_flops, peak_source) = budget::peak_flops(t.device, bf16, t.cpu_threads);
        let (intra_bw, inter_bw, node_size) = budget::links(t.device, t.world);
        let tensor_parallel = cfg.system.tensor_parallel.max(1);
        let context_parallel = cfg.system.context_parallel.max(1);
        Setting {
            shape,
            context: cfg.training.context_length,
            bf16,
            device: t.device,
            world: t.world.max(1),
            tensor_parallel,
            context_parallel,
            sequence_parallel: cfg.system.sequence_parallel,
            bucket_bytes: crate::dist::buckets::cap_bytes(cfg.system.bucket_mb) as f64,
            prefetch_units,
            shard_degree: cfg.system.shard_degree,
            reduce_bytes: match cfg.system.reduce_dtype {
                crate::config::ReduceDtype::Fp32 => 4.0,
                crate::config::ReduceDtype::Bf16 => 2.0,
            },
            budget: t.budget.0,
            budget_source: t.budget.1,
            peak_flops,
            peak_source,
            mfu: t.mfu,
            intra_bw,
            inter_bw,
            node_size,
            ckpt_async: cfg.checkpoint.background,
            ckpt_interval: cfg.checkpoint.interval,
            max_steps: cfg.training.max_steps,
            storage_bw: t.storage_bw,
        }
    }

    /// Whether the run saves before its last step (`checkpoint.interval` below
    /// `training.max_steps`): then what a save leaves allocated is there at later steps too.
    pub fn saves_between_steps(&self) -> bool {
        self.ckpt_interval > 0 && self.ckpt_interval < self.max_steps
    }

    pub fn compute_bytes(&self) -> f64 {
        if self.bf16 {
            2.0
        } else {
            4.0
        }
    }
}

/// The knobs that trade memory for time: what the advice may change.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Layout {
    /// A number in JSON, as in the config.
    pub zero_stage: ZeroStage,
    pub activation_checkpointing: ActivationCheckpointing,
    pub loss_chunk_tokens: usize,
    /// Sequences per micro-batch and micro-batches per step, of each data-parallel rank (a CP
    /// × TP group trains its micro-batch together).
    pub batch: usize,
    pub grad_accum: usize,
}

impl Layout {
    pub fn from_config(cfg: &Config) -> Layout {
        let t = &cfg.training;
        Layout {
            zero_stage: cfg.system.zero_stage,
            activation_checkpointing: t.activation_checkpointing,
            loss_chunk_tokens: t.loss_chunk_tokens,
            batch: t.batch_size,
            grad_accum: t.grad_accum_nums,
        }
    }

    /// Tokens one data-parallel rank (the ranks of its CP × TP group together) trains per step.
    pub fn tokens_per_step(&self, context: usize) -> usize {
        self.batch * self.grad_accum * context
    }
}

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

/// Whether bf16 matmuls run (`training.dtype`; auto = bf16 on CUDA).
pub fn bf16_compute(cfg: &Config, device: Device) -> bool {
    cfg.training.dtype.is_bf16(device == Device::Cuda)
}

/// The FLOPs of one token of training: the model's (forward + backward, as MFU counts them)
/// and those the activation checkpointing adds by recomputing forward work in backward.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Flops {
    pub model: f64,
    pub recomputed: f64,
}

pub fn flops_per_token(s: &Setting, l: &Layout) -> Flops {
    let sh = &s.shape;
    let model = sh.flops_per_token(s.context);
    let d = sh.hidden_size as f64;
    let layers = sh.num_layers as f64;
    let attn_proj = sh.attention_matrix_params() as f64;
    let mlp = sh.mlp_matrix_params() as f64;
    // A forward is a third of the 6-per-weight count; causal attention's forward likewise.
    let recomputed = match l.activation_checkpointing {
        ActivationCheckpointing::None => 0.0,
        ActivationCheckpointing::Full => {
            layers * (2.0 * (attn_proj + mlp) + 2.0 * s.context as f64 * d)
        }
        ActivationCheckpointing::Selective => layers * 2.0 * mlp,
    };
    Flops { model, recomputed }
}

/// Seconds of computation of one step on one rank at the assumed utilisation: the tokens of
/// its CP × TP group's step, 1/T of every matmul of each, and 1/C of them (its own tokens'
/// matmuls, and 1/C of each sequence's causal attention: the zigzag chunks share it evenly).
pub fn compute_seconds(s: &Setting, l: &Layout) -> f64 {
    let f = flops_per_token(s, l);
    let split = (s.tensor_parallel * s.context_parallel) as f64;
    l.tokens_per_step(s.context) as f64 * (f.model + f.recomputed) / (split * s.peak_flops * s.mfu)
}

/// One rank's step among `world` ranks, by what takes the time.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct StepTime {
    /// The rank's FLOPs at the assumed utilisation (`compute_seconds`).
    pub compute_seconds: f64,
    /// The zero stage's collectives among the data-parallel ranks (`comm.rs`): after backward
    /// as the step runs today; they could hide behind it (`efficiency_overlapped`).
    pub data_parallel_seconds: f64,
    /// The TP group's collectives (`tensor.rs`), on the critical path.
    pub tensor_parallel_seconds: f64,
    /// The CP group's K/V all-gathers and dK/dV reduce-scatters (`context.rs`), on the
    /// critical path.
    pub context_parallel_seconds: f64,
}

impl StepTime {
    /// The step of layout `l` on one of `world` ranks.
    pub fn of(s: &Setting, l: &Layout, world: usize) -> StepTime {
        StepTime {
            compute_seconds: compute_seconds(s, l),
            data_parallel_seconds: comm::seconds_per_step(s, l, world),
            tensor_parallel_seconds: tensor::seconds_per_step(s, l),
            context_parallel_seconds: context::seconds_per_step(s, l),
        }
    }

    /// Seconds per step: computation plus every collective, none overlapped.
    pub fn total(&self) -> f64 {
        self.compute_seconds + self.data_parallel_seconds + self.exposed_seconds()
    }

    /// The TP and CP groups' collectives: on the critical path.
    fn exposed_seconds(&self) -> f64 {
        self.tensor_parallel_seconds + self.context_parallel_seconds
    }

    /// Scaling efficiency: the computation's share of the step.
    pub fn efficiency(&self) -> f64 {
        self.compute_seconds / self.total()
    }

    /// The same with the data-parallel collectives hidden behind the computation (the TP and
    /// CP groups' stay on the critical path).
    pub fn efficiency_overlapped(&self) -> f64 {
        self.compute_seconds
            / (self.compute_seconds.max(self.data_parallel_seconds) + self.exposed_seconds())
    }
}

/// One layout's estimate.
#[derive(Debug, Clone, Serialize)]
pub struct Estimate {
    pub layout: Layout,
    pub memory: Memory,
    pub total_bytes: f64,
    pub fits: bool,
    /// Seconds per step: computation plus communication that is not overlapped.
    pub step_seconds: f64,
    /// What the step's seconds are spent on.
    pub time: StepTime,
    /// Scaling efficiency among the setting's ranks: computation over the step.
    pub efficiency: f64,
}

pub fn estimate(s: &Setting, l: &Layout) -> Estimate {
    let memory = memory::estimate(s, l);
    let total = memory.total();
    let time = StepTime::of(s, l, s.world);
    Estimate {
        layout: *l,
        memory,
        total_bytes: total,
        fits: total <= s.budget,
        step_seconds: time.total(),
        time,
        efficiency: time.efficiency(),
    }
}

/// Bytes as GB with two decimals (the unit of the memory line and of `system.memory_budget_gb`).
pub fn gb(bytes: f64) -> String {
    format!("{:.2} GB", bytes / 1e9)
}

/// A setting and layout for unit tests: the production preset with `sets`, planned for `world`
/// CUDA ranks of 80 GB. `sets` must give `model.vocab_size` (no tokenizer is loaded).
#[cfg(test)]
pub(crate) fn test_setting(sets: &[&str], world: usize) -> (Setting, Layout) {
    let cfg = crate::config::resolve(&crate::config::Sources {
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
