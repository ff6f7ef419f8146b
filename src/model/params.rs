//! The parameter table: every parameter a model holds, with its Hugging Face name, whole shape,
//! initialisation, tensor-parallel split and gradient unit, in creation order (the order of a
//! fresh initialisation's random draws, and Hugging Face's). An architecture emits it once
//! (`Parameters::of`); the model is built from it (`Llama::new`), and the tensor-parallel
//! split, the optimizer's handling of split parameters, the units zero stage 3 gathers and
//! gradients are reduced by, the Hugging Face reader and `lockstep plan` read it. A name it does
//! not hold is an error, never a guess.

use std::collections::HashMap;

use anyhow::Result;
use tch::nn::Init;

use super::shape::LlamaShape;
use super::split::Split;
use super::units::GradUnit;

/// One parameter of the table.
#[derive(Debug, Clone)]
pub struct Parameter {
    /// The Hugging Face name: `model.layers.3.self_attn.q_proj.weight`.
    pub name: String,
    /// The whole shape (a tensor-parallel rank holds `split.local_shape` of it).
    pub shape: Vec<i64>,
    /// A fresh model's values.
    pub init: Init,
    pub split: Split,
    /// The unit whose gradients become final with it.
    pub unit: GradUnit,
    /// An expert's matrix: which expert of its MoE layer (expert parallelism keeps a rank's
    /// own experts only); None for every other parameter.
    pub expert: Option<usize>,
}

impl Parameter {
    /// Elements of the whole parameter.
    pub fn numel(&self) -> usize {
        self.shape.iter().product::<i64>() as usize
    }

    /// A 2-D weight inside a decoder layer (attention and MLP projections, a mixture's router,
    /// each expert's matrices): what Muon updates with `training.optimizer = muon`.
    pub fn is_layer_matrix(&self) -> bool {
        self.shape.len() == 2 && matches!(self.unit, GradUnit::Layer(_))
    }
}

/// A model's parameters in creation order, by name.
#[derive(Debug, Clone)]
pub struct Parameters {
    list: Vec<Parameter>,
    index: HashMap<String, usize>,
}

impl Parameters {
    /// A table of `list` (names unique).
    pub fn new(list: Vec<Parameter>) -> Parameters {
        let index: HashMap<String, usize> = list
            .iter()
            .enumerate()
            .map(|(i, p)| (p.name.clone(), i))
            .collect();
        assert_eq!(index.len(), list.len(), "internal: a parameter named twice");
        Parameters { list, index }
    }

    /// The table of `shape`'s family. Llama's: the embedding, per decoder layer its two
    /// RMSNorm weights and seven matrices (q, k, v and gate, up column-parallel; o and down
    /// row-parallel), the final norm, and the LM head unless tied. Qwen3 adds per layer the
    /// RMSNorm weights of a query and a key head ([head_dim], whole on every rank, each rank's
    /// gradient its heads' part: `Split::Shared`). A mixture-of-experts layer (Qwen3-MoE,
    /// Mixtral; `MoeShape::is_sparse`) has, in place of the dense MLP, its router
    /// `{block}.gate.weight` [experts, hidden] (whole on every rank of a TP group, each rank's
    /// gradient its part of the experts' widths: `Split::Shared`) and per expert its SwiGLU
    /// matrices, split by width like the dense MLP's (`{block}.experts.{e}.{gate,up,down}`,
    /// the names of `Family::moe_names`). Matrices are normal(0, init_std), norms ones.
    pub fn of(shape: &LlamaShape) -> Parameters {
        let s = shape;
        let (d, hd) = (s.hidden_size as i64, s.head_dim() as i64);
        let (q, kv) = (s.num_heads as i64 * hd, s.num_kv_heads as i64 * hd);
        let f = s.intermediate_size as i64;
        let mut t = Table::new(s.init_std);
        let vocab = s.vocab_size as i64;
        t.matrix(
            "model.embed_tokens.weight",
            [vocab, d],
            Split::Vocab,
            GradUnit::Embedding,
        );
        for i in 0..s.num_layers {
            let p = format!("model.layers.{i}");
            let unit = GradUnit::Layer(i);
            t.norm(&format!("{p}.input_layernorm.weight"), d, unit);
            for (name, dims, split) in [
                ("self_attn.q_proj", [q, d], Split::Rows),
                ("self_attn.k_proj", [kv, d], Split::Rows),
                ("self_attn.v_proj", [kv, d], Split::Rows),
                ("self_attn.o_proj", [d, q], Split::Columns),
            ] {
                t.matrix(&format!("{p}.{name}.weight"), dims, split, unit);
            }
            if s.family.qk_norm() {
                for name in ["q_norm", "k_norm"] {
                    let name = format!("{p}.self_attn.{name}.weight");
                    t.push(&name, vec![hd], Init::Const(1.0), Split::Shared, unit);
                }
            }
            t.norm(&format!("{p}.post_attention_layernorm.weight"), d, unit);
            match (s.family.moe_names(), &s.moe) {
                (Some(n), Some(moe)) if moe.is_sparse(i) => {
                    let (b, fe) = (format!("{p}.{}", n.block), moe.expert_size as i64);
                    let experts = moe.num_experts as i64;
                    t.matrix(
                        &format!("{b}.gate.weight"),
                        [experts, d],
                        Split::Shared,
                        unit,
                    );
                    for e in 0..moe.num_experts {
                        for (name, dims, split) in [
                            (n.gate, [fe, d], Split::Rows),
                            (n.up, [fe, d], Split::Rows),
                            (n.down, [d, fe], Split::Columns),
                        ] {
                            let name = format!("{b}.experts.{e}.{name}.weight");
                            t.matrix(&name, dims, split, unit);
                            t.list.last_mut().expect("just pushed").expert = Some(e);
                        }
                    }
                }
                _ => {
                    for (name, dims, split) in [
                        ("mlp.gate_proj", [f, d], Split::Rows),
                        ("mlp.up_proj", [f, d], Split::Rows),
                        ("mlp.down_proj", [d, f], Split::Columns),
                    ] {
                        t.matrix(&format!("{p}.{name}.weight"), dims, split, unit);
                    }
                }
            }
        }
        t.norm("model.norm.weight", d, GradUnit::FinalNorm);
        if !s.tie_word_embeddings {
            t.matrix("lm_head.weight", [vocab, d], Split::Vocab, GradUnit::LmHead);
        }
        Parameters::new(t.list)
    }

    /// Every parameter, in creation order.
    pub fn iter(&self) -> impl Iterator<Item = &Parameter> {
        self.list.iter()
    }

    pub fn len(&self) -> usize {
        self.list.len()
    }

    pub fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    /// The parameter named `name`.
    pub fn get(&self, name: &str) -> Result<&Parameter> {
        match self.index.get(name) {
            Some(&i) => Ok(&self.list[i]),
            None => anyhow::bail!(
                "internal: {name} is not a parameter of this model (its table holds {} \
                 parameters, {} … {})",
                self.list.len(),
                self.list.first().map_or("", |p| p.name.as_str()),
                self.list.last().map_or("", |p| p.name.as_str()),
            ),
        }
    }

    /// Whether `name` is an expert's matrix (expert parallelism splits those among ranks).
    pub fn is_expert(&self, name: &str) -> bool {
        self.index
            .get(name)
            .is_some_and(|&i| self.list[i].expert.is_some())
    }

    pub fn contains(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    pub fn split(&self, name: &str) -> Result<Split> {
        Ok(self.get(name)?.split)
    }

    pub fn unit(&self, name: &str) -> Result<GradUnit> {
        Ok(self.get(name)?.unit)
    }

    /// Every parameter's name and whole shape, in creation order: what a Hugging Face
    /// directory of this model holds.
    pub fn shapes(&self) -> Vec<(String, Vec<i64>)> {
        self.list
            .iter()
            .map(|p| (p.name.clone(), p.shape.clone()))
            .collect()
    }

    /// Elements of the whole model (the LM head counted once when tied).
    pub fn count(&self) -> usize {
        self.list.iter().map(Parameter::numel).sum()
    }

    /// Elements one rank of a tensor-parallel group of `size` holds.
    pub fn local_count(&self, size: usize) -> usize {
        self.list
            .iter()
            .map(|p| p.split.local_shape(&p.shape, size).iter().product::<i64>() as usize)
            .sum()
    }
}

/// A table of whole parameters `(name, value, unit)` (tests of what reads a table).
#[cfg(test)]
pub(crate) fn table_of(entries: &[(&str, &tch::Tensor, GradUnit)]) -> Parameters {
    Parameters::new(
        entries
            .iter()
            .map(|(name, value, unit)| Parameter {
                name: name.to_string(),
                shape: value.size(),
                init: Init::Const(0.0),
                split: Split::Replicated,
                unit: *unit,
                expert: None,
            })
            .collect(),
    )
}

/// The table of an architecture as it is written down.
struct Table {
    list: Vec<Parameter>,
    std: f64,
}

impl Table {
    fn new(std: f64) -> Table {
        Table {
            list: Vec::new(),
            std,
        }
    }

    /// A matrix, normal(0, init_std).
    fn matrix(&mut self, name: &str, dims: [i64; 2], split: Split, unit: GradUnit) {
        let init = Init::Randn {
            mean: 0.0,
            stdev: self.std,
        };
        self.push(name, dims.to_vec(), init, split, unit);
    }

    /// A norm's weight [dim], ones, whole on every rank.
    fn norm(&mut self, name: &str, dim: i64, unit: GradUnit) {
        self.push(name, vec![dim], Init::Const(1.0), Split::Replicated, unit);
    }

    fn push(&mut self, name: &str, shape: Vec<i64>, init: Init, split: Split, unit: GradUnit) {
        self.list.push(Parameter {
            name: name.to_string(),
            shape,
            init,
            split,
            unit,
            expert: None,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn llama31_8b() -> LlamaShape {
        LlamaShape {
            family: crate::model::registry::Family::Llama,
            head_size: None,
            vocab_size: 128256,
            hidden_size: 4096,
            num_layers: 32,
            num_heads: 32,
            num_kv_heads: 8,
            intermediate_size: 14336,
            max_position_embeddings: 131072,
            rope_theta: 500000.0,
            rope_scaling: None,
            rms_norm_eps: 1e-5,
            tie_word_embeddings: false,
            init_std: 0.02,
            attention: crate::config::AttentionBackend::Sdpa,
            moe: None,
        }
    }

    #[test]
    fn llama_3_1_8b_has_its_8_03b_parameters_in_hf_order() {
        let t = Parameters::of(&llama31_8b());
        assert_eq!(t.count(), 8_030_261_248);
        assert_eq!(t.len(), 1 + 32 * 9 + 2);
        let names: Vec<&str> = t.iter().map(|p| p.name.as_str()).take(4).collect();
        assert_eq!(
            names,
            [
                "model.embed_tokens.weight",
                "model.layers.0.input_layernorm.weight",
                "model.layers.0.self_attn.q_proj.weight",
                "model.layers.0.self_attn.k_proj.weight"
            ]
        );
        assert_eq!(t.iter().last().unwrap().name, "lm_head.weight");
        // TP 8: every matrix and the vocabulary cut in 8, the norms whole.
        let norms = 32 * 2 * 4096 + 4096;
        assert_eq!(t.local_count(8), (t.count() - norms) / 8 + norms);
    }

    /// Qwen3-8B (Hugging Face's config.json): the model card's 8.19B parameters, 6.95B of them
    /// outside the embedding and the untied LM head; each layer's q_norm and k_norm [128]
    /// whole on every rank of a TP group.
    #[test]
    fn qwen3_8b_has_its_8_19b_parameters_and_head_norms() {
        let s = LlamaShape {
            family: crate::model::registry::Family::Qwen3,
            head_size: Some(128),
            vocab_size: 151936,
            hidden_size: 4096,
            num_layers: 36,
            num_heads: 32,
            num_kv_heads: 8,
            intermediate_size: 12288,
            rope_theta: 1e6,
            ..llama31_8b()
        };
        let t = Parameters::of(&s);
        assert_eq!(t.count(), 8_190_735_360);
        assert_eq!(t.count() - 2 * 151936 * 4096, 6_946_075_648);
        let q = t.get("model.layers.35.self_attn.q_norm.weight").unwrap();
        assert_eq!((q.shape.clone(), q.split), (vec![128], Split::Shared));
        assert_eq!(
            t.unit("model.layers.35.self_attn.k_norm.weight").unwrap(),
            GradUnit::Layer(35)
        );
        assert!(!Parameters::of(&llama31_8b()).contains("model.layers.0.self_attn.q_norm.weight"));
    }

    #[test]
    fn flops_per_token_is_six_per_matrix_weight_plus_attention() {
        let s = llama31_8b();
        // The embedding is a lookup; the (untied) LM head is a matmul; norms are no matmuls.
        let norms = 32 * 2 * 4096 + 4096;
        let matmul = Parameters::of(&s).count() - s.vocab_size * s.hidden_size - norms;
        let expected = 6.0 * matmul as f64 + 6.0 * 32.0 * 8192.0 * 4096.0;
        assert!((s.flops_per_token(8192) - expected).abs() / expected < 1e-12);
    }

    #[test]
    fn every_parameter_has_its_split_and_unit_and_no_other_name_does() {
        let t = Parameters::of(&llama31_8b());
        for (name, split, unit) in [
            (
                "model.layers.3.self_attn.q_proj.weight",
                Split::Rows,
                GradUnit::Layer(3),
            ),
            (
                "model.layers.3.self_attn.k_proj.weight",
                Split::Rows,
                GradUnit::Layer(3),
            ),
            (
                "model.layers.3.self_attn.v_proj.weight",
                Split::Rows,
                GradUnit::Layer(3),
            ),
            (
                "model.layers.3.self_attn.o_proj.weight",
                Split::Columns,
                GradUnit::Layer(3),
            ),
            (
                "model.layers.3.mlp.gate_proj.weight",
                Split::Rows,
                GradUnit::Layer(3),
            ),
            (
                "model.layers.3.mlp.up_proj.weight",
                Split::Rows,
                GradUnit::Layer(3),
            ),
            (
                "model.layers.12.mlp.down_proj.weight",
                Split::Columns,
                GradUnit::Layer(12),
            ),
            (
                "model.layers.3.input_layernorm.weight",
                Split::Replicated,
                GradUnit::Layer(3),
            ),
            ("model.norm.weight", Split::Replicated, GradUnit::FinalNorm),
            (
                "model.embed_tokens.weight",
                Split::Vocab,
                GradUnit::Embedding,
            ),
            ("lm_head.weight", Split::Vocab, GradUnit::LmHead),
        ] {
            assert_eq!(t.split(name).unwrap(), split, "{name}");
            assert_eq!(t.unit(name).unwrap(), unit, "{name}");
        }
        for stranger in [
            "model.layers.3.self_attn.q_norm.weight",
            "model.layers.32.mlp.up_proj.weight",
            "model.other",
        ] {
            let e = t.split(stranger).unwrap_err().to_string();
            assert!(e.contains(stranger), "{e}");
        }
        let mut tied = llama31_8b();
        tied.tie_word_embeddings = true;
        assert!(!Parameters::of(&tied).contains("lm_head.weight"));
    }
}
