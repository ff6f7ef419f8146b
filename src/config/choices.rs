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
}
