//! The resolved, typed config. Field names are the keys of `schema::KEYS` (a test checks the two
//! agree), so `grep -rn "training.batch_size\|batch_size:"` finds both the doc and the field.

use serde::{Deserialize, Serialize};

use super::choices::{
    ActivationCheckpointing, Architecture, AttentionBackend, DeviceChoice, DistBackendChoice,
    DtypeChoice, FaultChoice, GuardPolicy, MemoryCheck, MuonAdjust, OomPhase, OptimizerChoice,
    PipelineSchedule, ReduceDtype, ZeroStage,
};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    pub model: ModelConfig,
    pub data: DataConfig,
    pub training: TrainingConfig,
    pub system: SystemConfig,
    pub logging: LoggingConfig,
    pub checkpoint: CheckpointConfig,
    pub debug: DebugConfig,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    pub architecture: Architecture,
    pub model_path: Option<String>,
    pub num_layers: usize,
    pub hidden_size: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: Option<usize>,
    pub intermediate_size: usize,
    pub num_experts: usize,
    pub num_experts_per_tok: usize,
    pub moe_intermediate_size: Option<usize>,
    pub decoder_sparse_step: usize,
    pub norm_topk_prob: bool,
    pub router_aux_loss_coef: f64,
    pub router_z_loss_coef: f64,
    pub vocab_size: Option<usize>,
    pub max_position_embeddings: usize,
    pub rope_theta: f64,
    pub rms_norm_eps: f64,
    pub tie_word_embeddings: bool,
    pub attention_backend: AttentionBackend,
    pub init_std: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DataConfig {
    pub path: String,
    pub tokenizer: String,
    pub text_field: String,
    pub val_fraction: f64,
    pub num_samples: Option<u64>,
    pub sources: Vec<SourceConfig>,
    pub document_masking: bool,
    pub reset_position_ids: bool,
    pub cache_dir: String,
    pub allow_new_data_on_resume: bool,
}

/// One entry of `data.sources` (its fields are `schema::SOURCE_FIELDS`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SourceConfig {
    pub path: String,
    pub weight: f64,
    /// None = `data.text_field`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text_field: Option<String>,
    /// None = derived from the path (`data::mixture::source_name`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainingConfig {
    pub batch_size: usize,
    pub learning_rate: f64,
    pub min_lr: f64,
    pub warmup_steps: usize,
    pub max_steps: usize,
    pub context_length: usize,
    pub grad_accum_nums: usize,
    pub num_workers: usize,
    pub dtype: DtypeChoice,
    pub optimizer: OptimizerChoice,
    pub weight_decay: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub adam_eps: f64,
    pub muon_momentum: f64,
    pub muon_ns_steps: usize,
    pub muon_adjust_lr: MuonAdjust,
    pub reset_optimizer: bool,
    pub max_grad_norm: f64,
    pub eval_interval: usize,
    pub eval_batches: usize,
    /// Multiple-choice task files (or directories of them), `data::tasks`.
    pub eval_tasks: Vec<String>,
    pub eval_tasks_limit: usize,
    pub eval_tasks_batch_size: usize,
    pub nan_check: bool,
    pub nan_policy: GuardPolicy,
    pub max_nan_skips: usize,
    pub rollback_lr_factor: f64,
    pub spike_zscore: f64,
    pub spike_window: usize,
    pub spike_policy: GuardPolicy,
    pub activation_checkpointing: ActivationCheckpointing,
    pub loss_chunk_tokens: usize,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SystemConfig {
    pub device: DeviceChoice,
    pub device_id: usize,
    pub seed: u64,
    pub num_threads: usize,
    pub max_memory_gb: f64,
    pub collective_timeout_s: u64,
    pub bucket_mb: f64,
    pub zero_stage: ZeroStage,
    pub shard_degree: usize,
    pub tensor_parallel: usize,
    pub sequence_parallel: bool,
    pub context_parallel: usize,
    pub expert_parallel: usize,
    pub pipeline_parallel: usize,
    pub pipeline_schedule: PipelineSchedule,
    pub virtual_stages: usize,
    pub reduce_dtype: ReduceDtype,
    pub prefetch_units: usize,
    pub overlap_comm: bool,
    pub memory_check: MemoryCheck,
    pub memory_budget_gb: f64,
    pub dist_backend: DistBackendChoice,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoggingConfig {
    pub interval: usize,
    pub dir: String,
    pub verbose: bool,
    pub memory_interval: usize,
    pub tensorboard: bool,
    pub run_name: Option<String>,
    pub straggler_pct: f64,
    pub wandb: WandbConfig,
    pub mlflow: MlflowConfig,
}

/// The values `logging.wandb.mode` (and WANDB_MODE) take.
pub const WANDB_MODES: &[&str] = &["online", "offline", "disabled"];

/// `logging.wandb.*`: Weights & Biases (on when `project` is set).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WandbConfig {
    pub project: Option<String>,
    pub entity: Option<String>,
    pub name: Option<String>,
    pub group: Option<String>,
    pub tags: Vec<String>,
    /// online | offline | disabled; None = WANDB_MODE, else online.
    pub mode: Option<String>,
    pub dir: Option<String>,
    pub python: Option<String>,
}

/// `logging.mlflow.*`: MLflow (on when `tracking_uri` or MLFLOW_TRACKING_URI is set).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MlflowConfig {
    pub tracking_uri: Option<String>,
    pub experiment: Option<String>,
    pub run_name: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CheckpointConfig {
    pub interval: usize,
    pub keep_last: usize,
    pub keep_every: usize,
    /// `checkpoint.async`: written by a background thread from a host copy.
    #[serde(rename = "async")]
    pub background: bool,
    pub dir: Option<String>,
}

/// Testing aids only; see the `debug.*` keys in docs/CONFIG.md.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DebugConfig {
    pub fault: FaultChoice,
    pub fault_rank: usize,
    pub fault_step: usize,
    pub fault_exit_code: usize,
    pub fault_delay_ms: usize,
    pub save_report_delay_ms: usize,
    pub inject_nan_at_step: usize,
    pub inject_nan_param: Option<String>,
    pub inject_oom: OomPhase,
    pub inject_oom_step: usize,
    pub muon_all_gather: bool,
}
