//! The model families lockstep trains, each named once: its Hugging Face `model_type` and
//! class, and what its layers add to Llama's (the parameter table, params.rs, and the
//! attention half, llama.rs, read [`Family`]). `model.architecture` picks one; `auto` takes
//! `model.model_path`'s `model_type`.
//!
//! Adding a family (docs/models.md): a variant here with its names, its rows in the
//! parameter table (`Parameters::of`), what its layers compute differently (a `Layer` field
//! and its use in `Llama::half`), and its config.json keys (hf.rs). A mixture-of-experts
//! family names where its expert tensors live ([`MoeNames`]); the layer itself is shared
//! (moe.rs).

use serde::{Deserialize, Serialize};

use crate::config::Architecture;

/// A model family.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Family {
    /// Llama 2/3 (transformers' `LlamaForCausalLM`).
    #[default]
    Llama,
    /// Qwen3 dense (`Qwen3ForCausalLM`): Llama's layers with an RMSNorm over each query and
    /// key head (`self_attn.q_norm`, `self_attn.k_norm`, [head_dim]) before RoPE.
    Qwen3,
    /// Qwen3-MoE (`Qwen3MoeForCausalLM`): Qwen3's attention; the MLP of its sparse layers a
    /// mixture of experts (`mlp.gate`, `mlp.experts.E.{gate,up,down}_proj`), the others dense.
    Qwen3Moe,
    /// Mixtral (`MixtralForCausalLM`): Llama's attention; every MLP a mixture of experts
    /// (`block_sparse_moe.gate`, `block_sparse_moe.experts.E.{w1,w3,w2}`).
    Mixtral,
}

/// Where a family's mixture-of-experts block keeps its tensors, under `model.layers.{i}.`:
/// `{block}.gate.weight` (the router, [experts, hidden]) and
/// `{block}.experts.{e}.{gate|up|down}.weight`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MoeNames {
    pub block: &'static str,
    /// The expert's SwiGLU matrices: gate (silu), up, down.
    pub gate: &'static str,
    pub up: &'static str,
    pub down: &'static str,
}

impl Family {
    /// Every family, in the order error messages list them.
    pub const ALL: [Family; 4] = [
        Family::Llama,
        Family::Qwen3,
        Family::Qwen3Moe,
        Family::Mixtral,
    ];

    /// Its `model_type` in config.json, and its `model.architecture` value.
    pub fn name(self) -> &'static str {
        match self {
            Family::Llama => "llama",
            Family::Qwen3 => "qwen3",
            Family::Qwen3Moe => "qwen3_moe",
            Family::Mixtral => "mixtral",
        }
    }

    /// The transformers class that loads its directories (config.json `architectures`).
    pub fn hf_class(self) -> &'static str {
        match self {
            Family::Llama => "LlamaForCausalLM",
            Family::Qwen3 => "Qwen3ForCausalLM",
            Family::Qwen3Moe => "Qwen3MoeForCausalLM",
            Family::Mixtral => "MixtralForCausalLM",
        }
    }

    /// Whether each query and key head is RMS-normed before RoPE.
    pub fn qk_norm(self) -> bool {
        matches!(self, Family::Qwen3 | Family::Qwen3Moe)
    }

    /// Where its mixture-of-experts tensors live; None for a dense family.
    pub fn moe_names(self) -> Option<MoeNames> {
        match self {
            Family::Llama | Family::Qwen3 => None,
            Family::Qwen3Moe => Some(MoeNames {
                block: "mlp",
                gate: "gate_proj",
                up: "up_proj",
                down: "down_proj",
            }),
            Family::Mixtral => Some(MoeNames {
                block: "block_sparse_moe",
                gate: "w1",
                up: "w3",
                down: "w2",
            }),
        }
    }

    /// Whether its MLPs are (or may be) mixtures of experts.
    pub fn is_moe(self) -> bool {
        self.moe_names().is_some()
    }

    /// The family of a config.json `model_type`, or an error naming the ones lockstep trains.
    pub fn of_model_type(model_type: &str) -> anyhow::Result<Family> {
        Family::ALL
            .into_iter()
            .find(|f| f.name() == model_type)
            .ok_or_else(|| {
                let names: Vec<&str> = Family::ALL.iter().map(|f| f.name()).collect();
                anyhow::anyhow!(
                    "model_type \"{model_type}\" is not a family lockstep trains; it trains {}",
                    names.join(", ")
                )
            })
    }

    /// The family `model.architecture` names (None for `auto`).
    pub fn of_choice(a: Architecture) -> Option<Family> {
        match a {
            Architecture::Auto => None,
            Architecture::Llama => Some(Family::Llama),
            Architecture::Qwen3 => Some(Family::Qwen3),
            Architecture::Qwen3Moe => Some(Family::Qwen3Moe),
            Architecture::Mixtral => Some(Family::Mixtral),
        }
    }
}
