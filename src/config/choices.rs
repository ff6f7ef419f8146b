//! The typed values of every config key that picks one of a fixed set of strings. Each enum is
//! the only definition of its names: `schema::KEYS` takes its `NAMES` for validation, typo
//! messages and docs/CONFIG.md, serde reads and writes it, and code matches on the variants, so
//! a value can never be misspelt past resolution or silently fall into a default arm.

use serde::{Deserialize, Serialize};

macro_rules! choice {
    (
        $(#[$meta:meta])*
        $name:ident {
            $( $(#[$vmeta:meta])* $variant:ident = $text:literal $(| $alias:literal)* ),+ $(,)?
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
        pub enum $name {
            $( $(#[$vmeta])* #[serde(rename = $text $(, alias = $alias)*)] $variant, )+
        }

        impl $name {
            /// Every accepted spelling, canonical names first within each variant.
            pub const NAMES: &'static [&'static str] = &[$($text, $($alias,)*)+];

            /// The canonical name (what the resolved config shows).
            pub fn name(self) -> &'static str {
                match self {
                    $( $name::$variant => $text, )+
                }
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.name())
            }
        }
    };
}

choice! {
    /// `system.device`: where a rank computes.
    DeviceChoice {
        /// CUDA when libtorch's CUDA backend loads and a device is visible, else CPU.
        Auto = "auto",
        Cpu = "cpu",
        Cuda = "cuda",
    }
}

choice! {
    /// `training.dtype`: the compute precision (master weights and moments stay fp32).
    DtypeChoice {
        /// bf16 on CUDA, fp32 on CPU.
        Auto = "auto",
        Fp32 = "fp32",
        Bf16 = "bf16",
    }
}

impl DtypeChoice {
    /// Whether the matmuls run in bf16 on a rank whose device is CUDA (`on_cuda`) or the CPU:
    /// the one place `auto` is decided, for `train` and for `plan`.
    pub fn is_bf16(self, on_cuda: bool) -> bool {
        match self {
            DtypeChoice::Bf16 => true,
            DtypeChoice::Fp32 => false,
            DtypeChoice::Auto => on_cuda,
        }
    }
}

choice! {
    /// `system.dist_backend`: the collectives of a multi-rank run.
    DistBackendChoice {
        /// NCCL on CUDA ranks, the TCP ring on CPU ranks.
        Auto = "auto",
        Nccl = "nccl",
        Ring = "ring",
    }
}

choice! {
    /// `training.nan_policy` / `training.spike_policy`: what the guard does about a bad step.
    GuardPolicy {
        /// Stop with exit code 3.
        Abort = "abort",
        /// Drop this step's update and go on with the next batch.
        Skip = "skip",
        /// Reload the latest complete checkpoint, scale the LR down, go on with the next batch.
        Rollback = "rollback",
    }
}

choice! {
    /// `model.architecture`: the model family (src/model/registry.rs).
    Architecture {
        /// `model.model_path`'s `model_type` (config.json), else llama.
        Auto = "auto",
        /// Llama 2/3: RMSNorm, GQA attention with RoPE, SwiGLU.
        Llama = "llama",
        /// Qwen3 dense: Llama's layers with an RMSNorm of each query and key head (q_norm,
        /// k_norm) before RoPE, and a head size apart from hidden / heads.
        Qwen3 = "qwen3",
        /// Qwen3-MoE: Qwen3's attention, mixture-of-experts MLPs (model.num_experts).
        Qwen3Moe = "qwen3_moe",
        /// Mixtral: Llama's attention, mixture-of-experts MLPs (model.num_experts).
        Mixtral = "mixtral",
    }
}

choice! {
    /// `training.optimizer`: what updates the parameters (src/train/optim/).
    OptimizerChoice {
        /// AdamW on every parameter (torch.optim.AdamW).
        AdamW = "adamw",
        /// Muon (torch.optim.Muon) on the decoder layers' matrices, AdamW on the rest.
        Muon = "muon",
    }
}

choice! {
    /// `training.muon_adjust_lr`: the factor Muon's learning rate is scaled by for an A x B
    /// matrix (torch.optim.Muon's `adjust_lr_fn`).
    MuonAdjust {
        /// 0.2 sqrt(max(A, B)) (Moonshot's): the update's RMS matches AdamW's, so AdamW's
        /// learning rate and weight decay carry over.
        MatchRmsAdamw = "match_rms_adamw",
        /// sqrt(max(1, A / B)) (Keller Jordan's).
        Original = "original",
    }
}

choice! {
    /// `system.pipeline_schedule`: the order in which a pipeline rank runs the forward and
    /// backward passes of its stages' micro-batches (`dist/pipeline/schedule.rs`).
    PipelineSchedule {
        /// One stage per rank; after P − 1 − r warm-up forwards, rank r alternates one
        /// forward and one backward (PipeDream-flush / Megatron's 1F1B).
        OneFOneB = "1f1b",
        /// `system.virtual_stages` = V stages per rank, stage v·P + r on rank r (Megatron's
        /// interleaved 1F1B): the bubble shrinks V times for V times the point-to-point
        /// messages.
        Interleaved = "interleaved",
        /// Two stages per rank in a V (stages r and 2P − 1 − r on rank r) with backward split
        /// into input and weight gradients, the weight gradients filling the bubble (ZB-V).
        Zbv = "zbv",
    }
}

impl PipelineSchedule {
    /// Stages each pipeline rank holds: 1 with `1f1b`, `virtual_stages` with `interleaved`, 2
    /// with `zbv`.
    pub fn stages_per_rank(self, virtual_stages: usize) -> usize {
        match self {
            PipelineSchedule::OneFOneB => 1,
            PipelineSchedule::Interleaved => virtual_stages.max(1),
            PipelineSchedule::Zbv => 2,
        }
    }
}

choice! {
    /// `model.attention_backend`. The aliases are transformers' `attn_implementation` names.
    AttentionBackend {
        /// libtorch's scaled_dot_product_attention (flash / memory-efficient / cuDNN kernels).
        Sdpa = "sdpa" | "flash_attention_2",
        /// Explicit softmax(QK^T/sqrt(d))V, for debugging.
        Math = "math" | "eager",
    }
}

choice! {
    /// `training.activation_checkpointing`: which activations a decoder layer keeps for its
    /// backward and which it recomputes there (src/model/backward.rs).
    ActivationCheckpointing {
        /// Keep everything autograd saves; nothing is recomputed.
        None = "none",
        /// Keep only each decoder layer's input; recompute the whole layer in backward.
        Full = "full",
        /// Keep the attention half of each layer (its autograd tensors and the residual after
        /// it); recompute the MLP half (post-attention RMSNorm, gate/up, SiLU, down).
        Selective = "selective",
    }
}

choice! {
    /// `system.memory_check`: what `train` does when `lockstep plan`'s estimate of a rank's
    /// peak memory exceeds what the device has.
    MemoryCheck {
        /// Refuse to start (exit code 2) with the plan's advice.
        Refuse = "refuse",
        /// Print the estimate and the advice, then start anyway.
        Warn = "warn",
        /// Do not estimate.
        Off = "off",
    }
}

choice! {
    /// `debug.inject_oom`: the phase in which a real allocation failure is provoked (an
    /// allocation of a petabyte), to test the out-of-memory report.
    OomPhase {
        None = "none",
        ModelBuild = "model_build",
        Forward = "forward",
        Backward = "backward",
        Optimizer = "optimizer",
        Checkpoint = "checkpoint",
    }
}

choice! {
    /// `debug.fault`: a deliberate failure of one rank, for the launcher and timeout tests.
    FaultChoice {
        None = "none",
        /// Exit with `debug.fault_exit_code`.
        Exit = "exit",
        /// SIGSTOP itself: a hung rank.
        Stop = "stop",
        /// Sleep `debug.fault_delay_ms` per step from then on: a straggler.
        Slow = "slow",
        /// Exit with `debug.fault_exit_code` once this rank's part of the checkpoint being
        /// written in the background is written and reported to rank 0.
        ExitAfterSave = "exit_after_save",
    }
}

choice! {
    /// `system.reduce_dtype`: the dtype gradients travel in between ranks (they are
    /// accumulated and averaged into fp32 either way).
    ReduceDtype {
        Fp32 = "fp32",
        /// Half the bytes of fp32 on NCCL, at bf16's 8-bit mantissa per value sent.
        Bf16 = "bf16",
    }
}

/// `system.zero_stage`: what data parallelism shards across the ranks of a shard group (a
/// number in the config, as DeepSpeed and Megatron users write it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "u64", into = "u64")]
pub enum ZeroStage {
    /// 0: every rank holds all parameters, gradients and optimizer state.
    Replicated = 0,
    /// 1: fp32 master weights and AdamW moments sharded.
    Optimizer = 1,
    /// 2: gradients reduce-scattered into their owner's slice too.
    Gradients = 2,
    /// 3: the working parameters sharded too, gathered a unit at a time.
    Parameters = 3,
}

impl ZeroStage {
    pub const ALL: [ZeroStage; 4] = [
        ZeroStage::Replicated,
        ZeroStage::Optimizer,
        ZeroStage::Gradients,
        ZeroStage::Parameters,
    ];
    /// The accepted values, for the schema.
    pub const NUMBERS: &'static [u64] = &[0, 1, 2, 3];

    pub fn number(self) -> usize {
        self as usize
    }

    /// Master weights and moments exist only for this rank's slice.
    pub fn shards_optimizer(self) -> bool {
        self >= ZeroStage::Optimizer
    }

    /// Gradients are reduce-scattered into this rank's slice as backward finishes them.
    pub fn shards_gradients(self) -> bool {
        self >= ZeroStage::Gradients
    }

    /// Working parameters exist only as this rank's slice between uses.
    pub fn shards_parameters(self) -> bool {
        self == ZeroStage::Parameters
    }
}

impl TryFrom<u64> for ZeroStage {
    type Error = String;
    fn try_from(n: u64) -> Result<Self, String> {
        ZeroStage::ALL
            .into_iter()
            .find(|s| s.number() as u64 == n)
            .ok_or_else(|| format!("system.zero_stage = {n}: must be 0, 1, 2 or 3"))
    }
}

impl From<ZeroStage> for u64 {
    fn from(s: ZeroStage) -> u64 {
        s.number() as u64
    }
}

impl std::fmt::Display for ZeroStage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.number())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_name_and_alias_parses_and_prints_canonically() {
        for name in AttentionBackend::NAMES {
            let v: AttentionBackend = serde_json::from_value(serde_json::json!(name)).unwrap();
            assert_eq!(serde_json::to_value(v).unwrap(), v.name());
        }
        let eager: AttentionBackend = serde_json::from_str("\"eager\"").unwrap();
        assert_eq!(eager, AttentionBackend::Math);
        assert_eq!(GuardPolicy::NAMES, ["abort", "skip", "rollback"]);
        assert!(serde_json::from_str::<GuardPolicy>("\"ignore\"").is_err());
    }

    #[test]
    fn zero_stages_are_numbers_in_json() {
        for s in ZeroStage::ALL {
            let v = serde_json::to_value(s).unwrap();
            assert_eq!(v, serde_json::json!(s.number()));
            assert_eq!(serde_json::from_value::<ZeroStage>(v).unwrap(), s);
        }
        assert!(serde_json::from_str::<ZeroStage>("4").is_err());
        assert!(
            ZeroStage::Parameters.shards_gradients() && !ZeroStage::Optimizer.shards_gradients()
        );
    }
}
