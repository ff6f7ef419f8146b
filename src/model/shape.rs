//! The model's shape, resolved from the config (or from a Hugging Face config.json when
//! `model.model_path` is set) and the tokenizer's vocabulary.

use serde::{Deserialize, Serialize};

use super::registry::Family;
pub use crate::config::AttentionBackend;
use crate::config::ModelConfig;

impl MoeShape {
    /// The experts of `model.num_experts` (None where it is 0: a dense model).
    fn from_config(m: &ModelConfig) -> Option<MoeShape> {
        (m.num_experts > 0).then(|| MoeShape {
            num_experts: m.num_experts,
            top_k: m.num_experts_per_tok,
            expert_size: m.moe_intermediate_size.unwrap_or(m.intermediate_size),
            sparse_step: m.decoder_sparse_step,
            dense_layers: Vec::new(),
            norm_topk_prob: m.norm_topk_prob,
            aux_loss_coef: m.router_aux_loss_coef,
        })
    }
}

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

/// A mixture-of-experts MLP (Qwen3-MoE, Mixtral): a router picks `top_k` of `num_experts`
/// SwiGLU experts for every token (moe.rs).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MoeShape {
    /// Experts per MoE layer (`num_experts`; Mixtral's `num_local_experts`).
    pub num_experts: usize,
    /// Experts each token goes to (`num_experts_per_tok`).
    pub top_k: usize,
    /// One expert's SwiGLU width (Qwen3-MoE's `moe_intermediate_size`; Mixtral's
    /// `intermediate_size`).
    pub expert_size: usize,
    /// Layer i is a MoE layer where (i + 1) is a multiple of this (`decoder_sparse_step`) and
    /// i is not in `dense_layers`; the others have a dense MLP of `intermediate_size`.
    pub sparse_step: usize,
    /// `mlp_only_layers`: layers with a dense MLP whatever the step.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub dense_layers: Vec<usize>,
    /// The k routing weights renormalised to sum to 1 (`norm_topk_prob`; always for Mixtral).
    pub norm_topk_prob: bool,
    /// Weight of the load-balancing loss in the training objective (`router_aux_loss_coef`).
    pub aux_loss_coef: f64,
}

impl MoeShape {
    /// Whether decoder layer `i` is a mixture of experts.
    pub fn is_sparse(&self, i: usize) -> bool {
        (i + 1).is_multiple_of(self.sparse_step) && !self.dense_layers.contains(&i)
    }
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
    /// The mixture-of-experts MLPs of a MoE family; None for a dense one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moe: Option<MoeShape>,
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
            moe: MoeShape::from_config(m),
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

    /// Weights of one dense MLP (gate, up, down).
    pub fn mlp_matrix_params(&self) -> usize {
        3 * self.hidden_size * self.intermediate_size
    }

    /// Whether decoder layer `i`'s MLP is a mixture of experts.
    pub fn is_sparse(&self, i: usize) -> bool {
        self.moe.as_ref().is_some_and(|m| m.is_sparse(i))
    }

    /// The MLP widths tensor parallelism splits: the dense MLP's, and one expert's where the
    /// model has experts.
    pub fn mlp_widths(&self) -> Vec<usize> {
        let mut w = vec![self.intermediate_size];
        w.extend(self.moe.as_ref().map(|m| m.expert_size));
        w
    }

    /// Matrix weights of decoder layer `i`'s MLP that one token is multiplied by: the dense
    /// MLP's, or a MoE layer's router and its k experts (`active`) or all of its experts.
    pub fn layer_mlp_params(&self, i: usize, active: bool) -> usize {
        match self.moe.as_ref().filter(|m| m.is_sparse(i)) {
            Some(m) => {
                let experts = if active { m.top_k } else { m.num_experts };
                self.hidden_size * (m.num_experts + 3 * m.expert_size * experts)
            }
            None => self.mlp_matrix_params(),
        }
    }

    /// The largest MLP of a decoder layer in matrix weights (all of a MoE layer's experts and
    /// its router): what a zero stage 3 gather of a layer holds beside its attention.
    pub fn largest_mlp_params(&self) -> usize {
        (0..self.num_layers)
            .map(|i| self.layer_mlp_params(i, false))
            .max()
            .unwrap_or(0)
    }

    /// The widest MLP activation per token of a layer: the dense MLP's width, or a MoE
    /// layer's k experts' together (each token's k copies).
    pub fn mlp_activation_width(&self) -> usize {
        (0..self.num_layers)
            .map(|i| match self.moe.as_ref().filter(|m| m.is_sparse(i)) {
                Some(m) => m.top_k * m.expert_size,
                None => self.intermediate_size,
            })
            .max()
            .unwrap_or(self.intermediate_size)
    }

    /// Parameters of the experts a token does not use: per MoE layer, E − k experts' SwiGLU
    /// matrices (the whole model's count minus this is the active count).
    pub fn inactive_expert_params(&self) -> usize {
        let Some(m) = &self.moe else { return 0 };
        let per_expert = 3 * self.hidden_size * m.expert_size;
        (0..self.num_layers).filter(|&i| m.is_sparse(i)).count()
            * (m.num_experts - m.top_k)
            * per_expert
    }

    /// Matrix weights of the decoder layers (norms are negligible and not matmuls): all of
    /// them, or with `active` those one token is multiplied by (its k experts of each MoE
    /// layer; the same for a dense model).
    pub fn decoder_matrix_params(&self, active: bool) -> usize {
        (0..self.num_layers)
            .map(|i| self.attention_matrix_params() + self.layer_mlp_params(i, active))
            .sum()
    }

    /// Training FLOPs per token: 6 per matmul weight a token is multiplied by (forward +
    /// backward; the embedding lookup is no matmul, the LM head is; a MoE layer's k experts
    /// and its router, not the others) plus causal attention scores and values, 6·L·seq·d
    /// (PaLM's 12·L·seq·d halved by the causal mask).
    pub fn flops_per_token(&self, seq: usize) -> f64 {
        let d = self.hidden_size;
        let matmul = self.decoder_matrix_params(true) + self.vocab_size * d;
        6.0 * matmul as f64 + 6.0 * (self.num_layers * seq * self.query_width()) as f64
    }
}
