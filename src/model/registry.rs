//! The model families lockstep trains, each named once: its Hugging Face `model_type` and
//! class, and what its layers add to Llama's (the parameter table, params.rs, and the
//! attention half, llama.rs, read [`Family`]). `model.architecture` picks one; `auto` takes
//! `model.model_path`'s `model_type`.
//!
//! Adding a family (docs/models.md): a variant here with its names, its rows in the
//! parameter table (`Parameters::of`), what its layers compute differently (a `Layer` field
//! and its use in `Llama::half`), and its config.json keys (hf.rs).

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
}

impl Family {
    /// Every family, in the order error messages list them.
    pub const ALL: [Family; 2] = [Family::Llama, Family::Qwen3];

    /// Its `model_type` in config.json, and its `model.architecture` value.
    pub fn name(self) -> &'static str {
        match self {
            Family::Llama => "llama",
            Family::Qwen3 => "qwen3",
        }
    }

    /// The transformers class that loads its directories (config.json `architectures`).
    pub fn hf_class(self) -> &'static str {
        match self {
            Family::Llama => "LlamaForCausalLM",
            Family::Qwen3 => "Qwen3ForCausalLM",
        }
    }

    /// Whether each query and key head is RMS-normed before RoPE.
    pub fn qk_norm(self) -> bool {
        self == Family::Qwen3
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
        }
    }
}
