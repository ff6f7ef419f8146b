//! The model's shape, resolved from the config (or from a Hugging Face config.json when
//! `model.model_path` is set) and the tokenizer's vocabulary.

use serde::{Deserialize, Serialize};

use super::registry::Family;
pub use crate::config::AttentionBackend;
use crate::config::ModelConfig;

/// `head_dim` as a shape keeps it: None where it is hidden / heads (so that a shape compares
/// equal however it was written).
pub fn head_size(head_dim: Option<usize>, hidden: usize, heads: usize) -> Option<usize> {
    head_dim.filter(|&hd| heads == 0 || hd != hidden / heads)
}

/// Llama 3.1's RoPE frequency scaling (`rope_type: "llama3"` in config.json): long wavelengths
/// are divided by `factor`, short ones kept, and those in between interpolated.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Llama3RopeScaling {
    pub factor: f64,
    pub low_freq_factor: f64,
    pub high_freq_factor: f64,
    pub original_max_position_embeddings: usize,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LlamaShape {
    /// The model family (absent in checkpoints written before there were others: Llama).
    #[serde(default)]
    pub family: Family,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    /// The width of one attention head where it is not hidden_size / num_heads (`head_dim`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub head_size: Option<usize>,
    pub intermediate_size: usize,
    pub max_position_embeddings: usize,
    pub rope_theta: f64,
    /// None = plain RoPE. Absent in checkpoints written before it existed.
    #[serde(default)]
    pub rope_scaling: Option<Llama3RopeScaling>,
    pub rms_norm_eps: f64,
    pub tie_word_embeddings: bool,
    pub init_std: f64,
    pub attention: AttentionBackend,
}

impl LlamaShape {
    /// Shape from the config keys; `tokenizer_vocab` fills a null `model.vocab_size`.
    pub fn from_config(m: &ModelConfig, tokenizer_vocab: usize) -> anyhow::Result<LlamaShape> {
        let vocab_size = m.vocab_size.unwrap_or(tokenizer_vocab);
        anyhow::ensure!(
            vocab_size >= tokenizer_vocab,
            "model.vocab_size = {vocab_size} is smaller than the tokenizer's vocabulary ({tokenizer_vocab} ids); \
             set it to at least {tokenizer_vocab} or null"
        );
        Ok(LlamaShape {
            family: Family::of_choice(m.architecture).unwrap_or_default(),
            head_size: head_size(m.head_dim, m.hidden_size, m.num_attention_heads),
            vocab_size,
            hidden_size: m.hidden_size,
            num_layers: m.num_layers,
            num_heads: m.num_attention_heads,
            num_kv_heads: m.num_key_value_heads,
            intermediate_size: m.intermediate_size,
            max_position_embeddings: m.max_position_embeddings,
            rope_theta: m.rope_theta,
            rope_scaling: None,
            rms_norm_eps: m.rms_norm_eps,
            tie_word_embeddings: m.tie_word_embeddings,
            init_std: m.init_std,
            attention: m.attention_backend,
        })
    }

    /// The width of one attention head.
    pub fn head_dim(&self) -> usize {
        self.head_size.unwrap_or(self.hidden_size / self.num_heads)
    }

    /// The width of all query heads together (the attention output's; hidden_size unless
    /// `head_dim` is set apart).
    pub fn query_width(&self) -> usize {
        self.num_heads * self.head_dim()
    }

    /// Weights of one decoder layer's attention projections (q, k, v, o).
    pub fn attention_matrix_params(&self) -> usize {
        self.hidden_size * self.head_dim() * (2 * self.num_heads + 2 * self.num_kv_heads)
    }

    /// Weights of one decoder layer's MLP (gate, up, down).
    pub fn mlp_matrix_params(&self) -> usize {
        3 * self.hidden_size * self.intermediate_size
    }

    /// Weights of one decoder layer's matrices (the norms are negligible and not matmuls).
    fn layer_matrix_params(&self) -> usize {
        self.attention_matrix_params() + self.mlp_matrix_params()
    }

    /// Training FLOPs per token: 6 per matmul weight (forward + backward; the embedding lookup is
    /// no matmul, the LM head is) plus causal attention scores and values, 6·L·seq·d (PaLM's
    /// 12·L·seq·d halved by the causal mask).
    pub fn flops_per_token(&self, seq: usize) -> f64 {
        let d = self.hidden_size;
        let matmul = self.num_layers * self.layer_matrix_params() + self.vocab_size * d;
        6.0 * matmul as f64 + 6.0 * (self.num_layers * seq * self.query_width()) as f64
    }
}
