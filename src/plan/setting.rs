//! What a plan is about: the run's fixed facts ([`Setting`], from the config and the
//! [`Target`]) and the knobs that trade memory for time ([`Layout`]).

use serde::Serialize;

use super::budget;
use super::device::{bf16_compute, Device};
use crate::config::{Config, PipelineSchedule, ZeroStage};
use crate::model::{ActivationCheckpointing, LlamaShape, Parameters};

/// The fixed facts of a run: model, context, precision, device and ranks.
#[derive(Debug, Clone)]
pub struct Setting {
    pub shape: LlamaShape,
    /// The model's parameter table (of `shape`): what it counts and how TP splits it.
    pub parameters: std::sync::Arc<Parameters>,
    pub context: usize,
    /// bf16 matmuls (master weights and moments stay fp32).
    pub bf16: bool,
    pub device: Device,
    /// Ranks in all (GPUs, or CPU processes): `pipeline_parallel` × the data-parallel ranks ×
    /// `context_parallel` × `tensor_parallel`.
    pub world: usize,
    /// `system.tensor_parallel`: ranks that split every layer between them (T, innermost in the
    /// mesh).
    pub tensor_parallel: usize,
    /// `system.context_parallel`: ranks that split every sequence between them (C, between the
    /// data-parallel and the tensor-parallel dimension).
    pub context_parallel: usize,
    /// `system.expert_parallel`: replicas that split every MoE layer's experts between them (E,
    /// carved out of the data × context ranks; `expert.rs`).
    pub expert_parallel: usize,
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
    /// `training.optimizer = muon`: its Newton–Schulz steps (`plan/muon.rs`); None with AdamW.
    pub muon: Option<usize>,
    /// `system.pipeline_parallel` (P, the outermost dimension of the mesh), its schedule and
    /// `system.virtual_stages` (`plan/pipeline.rs`).
    pub pipeline_parallel: usize,
    pub pipeline_schedule: PipelineSchedule,
    pub virtual_stages: usize,
    /// What each rank holds of the model: all of it, or one pipeline rank's stages.
    pub holds: Holds,
}

/// What a rank holds of the model beyond its decoder layers (`shape.num_layers` of them), and
/// the activations it keeps at its peak. The whole model for a setting without pipeline
/// stages; one pipeline rank's share in the settings `plan/pipeline.rs` makes of its ranks.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Holds {
    /// The embedding (the first stage's).
    pub embedding: bool,
    /// The final norm, the LM head and the loss (the last stage's).
    pub head: bool,
    /// Decoder-layer activations kept at the peak, in layers × micro-batches: one micro-batch
    /// of every layer without a pipeline (None), the schedule's in-flight micro-batches of the
    /// rank's stages with one.
    pub kept_layers: Option<f64>,
}

impl Holds {
    pub const ALL: Holds = Holds {
        embedding: true,
        head: true,
        kept_layers: None,
    };
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
            pipeline: self.pipeline_parallel,
            tensor: self.tensor_parallel,
            context: self.context_parallel,
            shard_degree: self.shard_degree,
        }
    }

    /// The pipeline of layout `l`: P ranks, the schedule, a step's micro-batches.
    pub fn pipeline(&self, l: &Layout) -> crate::dist::pipeline::Pipeline {
        crate::dist::pipeline::Pipeline::new(
            self.pipeline_parallel,
            self.pipeline_schedule,
            self.virtual_stages,
            l.grad_accum,
        )
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
            parameters: std::sync::Arc::new(Parameters::of(&shape)),
            shape,
            context: cfg.training.context_length,
            bf16,
            device: t.device,
            world: t.world.max(1),
            tensor_parallel,
            context_parallel,
            expert_parallel: cfg.system.expert_parallel.max(1),
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
            muon: (cfg.training.optimizer == crate::config::OptimizerChoice::Muon)
                .then_some(cfg.training.muon_ns_steps),
            pipeline_parallel: cfg.system.pipeline_parallel.max(1),
            pipeline_schedule: cfg.system.pipeline_schedule,
            virtual_stages: cfg.system.virtual_stages.max(1),
            holds: Holds::ALL,
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
