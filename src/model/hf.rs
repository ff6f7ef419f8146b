//! Hugging Face directories of the families lockstep trains (Llama, Qwen3, Qwen3-MoE, Mixtral): `config.json` →
//! `LlamaShape`, and `model.safetensors` (or a
//! sharded `model.safetensors.index.json`) → the VarStore, optionally keeping only the first N
//! layers. Names are already HF's, so loading is a checked copy by name.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use anyhow::{bail, ensure, Context, Result};
use serde_json::Value;
use tch::nn::VarStore;
use tch::{Kind, Tensor};

use super::registry::Family;
use super::shape::{head_size, AttentionBackend, Llama3RopeScaling, LlamaShape, MoeShape};
use crate::config::{ConfigError, ModelConfig};
use crate::tensor_io::SafeFile;

/// Shape from `<dir>/config.json`. `m.num_layers` below the checkpoint's keeps the first layers.
pub fn shape_from_dir(dir: &Path, m: &ModelConfig) -> Result<LlamaShape> {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).with_context(|| {
        format!(
            "model.model_path: cannot read {}; point it at a Hugging Face Llama, Qwen3, Qwen3-MoE or Mixtral directory",
            path.display()
        )
    })?;
    let c: Value =
        serde_json::from_str(&text).with_context(|| format!("{}: invalid JSON", path.display()))?;
    let family = family_of(&c, &path, m)?;
    let uint = |key: &str| -> Result<usize> {
        c[key]
            .as_u64()
            .map(|v| v as usize)
            .with_context(|| format!("{}: missing integer {key}", path.display()))
    };
    // Llama variants lockstep's decoder does not compute: refuse them rather than silently
    // drop their bias tensors or use the wrong activation.
    for key in ["attention_bias", "mlp_bias"] {
        ensure!(
            !c[key].as_bool().unwrap_or(false),
            "{}: {key} is true; lockstep's Llama has no bias terms, so this checkpoint is not supported",
            path.display()
        );
    }
    if let Some(act) = c["hidden_act"].as_str().filter(|a| *a != "silu") {
        bail!(
            "{}: hidden_act is \"{act}\"; lockstep's Llama uses silu (SwiGLU), so this checkpoint is not supported",
            path.display()
        );
    }
    let hidden_size = uint("hidden_size")?;
    let num_heads = uint("num_attention_heads")?;
    let file_layers = uint("num_hidden_layers")?;
    ensure!(
        m.num_layers <= file_layers,
        "model.num_layers = {} but {} has only {file_layers} layers; use at most {file_layers}",
        m.num_layers,
        path.display()
    );
    let head_dim = c["head_dim"].as_u64().map(|v| v as usize);
    ensure!(
        head_dim.is_none_or(|hd| hd > 0 && hd.is_multiple_of(2)),
        "{}: head_dim {} is not even; RoPE needs an even head dimension",
        path.display(),
        c["head_dim"]
    );
    let (rope_theta, rope_scaling) = rope_of(&c, &path)?;
    let intermediate_size = uint("intermediate_size")?;
    let moe = moe_of(&c, &path, family, intermediate_size)?;
    Ok(LlamaShape {
        moe,
        family,
        head_size: head_size(head_dim, hidden_size, num_heads),
        vocab_size: uint("vocab_size")?,
        hidden_size,
        num_layers: m.num_layers,
        num_heads,
        num_kv_heads: c["num_key_value_heads"]
            .as_u64()
            .map_or(num_heads, |v| v as usize),
        intermediate_size,
        max_position_embeddings: uint("max_position_embeddings")?,
        rope_theta,
        rope_scaling,
        rms_norm_eps: c["rms_norm_eps"].as_f64().unwrap_or(1e-6),
        tie_word_embeddings: c["tie_word_embeddings"].as_bool().unwrap_or(false),
        init_std: c["initializer_range"].as_f64().unwrap_or(m.init_std),
        attention: m.attention_backend,
    })
}

/// The family of a config.json `c` (at `path`), checked against `model.architecture`: both are
/// bad inputs of the config (exit 2), a directory of a family lockstep does not train and a
/// `model.architecture` naming another family than the directory's. Attention lockstep's
/// decoder does not compute is refused rather than silently widened to the whole context.
fn family_of(c: &Value, path: &Path, m: &ModelConfig) -> Result<Family> {
    let model_type = c["model_type"].as_str().unwrap_or("");
    let family = Family::of_model_type(model_type)
        .map_err(|e| ConfigError(format!("{}: {e}", path.display())))?;
    if let Some(want) = Family::of_choice(m.architecture).filter(|&w| w != family) {
        return Err(ConfigError(format!(
            "model.architecture = \"{}\" but {} is a {} model (model_type \"{model_type}\"); set \
             model.architecture = \"{}\" or \"auto\"",
            want.name(),
            path.display(),
            family.hf_class(),
            family.name()
        ))
        .into());
    }
    let sliding = c["use_sliding_window"].as_bool().unwrap_or(false)
        || c["layer_types"]
            .as_array()
            .is_some_and(|t| t.iter().any(|l| l.as_str() != Some("full_attention")));
    ensure!(
        !sliding,
        "{}: sliding-window attention (use_sliding_window / layer_types) is not supported; \
         lockstep attends over the whole context",
        path.display()
    );
    Ok(family)
}

/// The mixture-of-experts MLPs of a config.json `c` (at `path`) of `family`: None for a
/// dense family (or a Qwen3-MoE without experts). A k above the experts is a bad input of the
/// config (exit 2); Mixtral's training-time jitter of the router's input is refused rather
/// than left out.
fn moe_of(
    c: &Value,
    path: &Path,
    family: Family,
    intermediate_size: usize,
) -> Result<Option<MoeShape>> {
    if !family.is_moe() {
        return Ok(None);
    }
    let key = |k: &str| c[k].as_u64().map(|v| v as usize);
    let num_experts = key("num_experts").or(key("num_local_experts")).unwrap_or(0);
    if num_experts == 0 {
        return Ok(None);
    }
    let top_k = key("num_experts_per_tok")
        .with_context(|| format!("{}: missing integer num_experts_per_tok", path.display()))?;
    if top_k == 0 || top_k > num_experts {
        return Err(ConfigError(format!(
            "{}: num_experts_per_tok = {top_k} with {num_experts} experts; each token goes to \
             1..={num_experts} of them",
            path.display()
        ))
        .into());
    }
    let jitter = c["router_jitter_noise"].as_f64().unwrap_or(0.0);
    ensure!(
        jitter == 0.0,
        "{}: router_jitter_noise = {jitter}; lockstep's router reads the tokens as they are, so \
         this checkpoint's training noise is not supported (set it to 0.0)",
        path.display()
    );
    let aux_loss_coef = c["router_aux_loss_coef"].as_f64().unwrap_or(0.001);
    let shape = if family == Family::Mixtral {
        ensure!(
            c["sliding_window"].is_null(),
            "{}: sliding_window = {}; sliding-window attention is not supported, lockstep \
             attends over the whole context",
            path.display(),
            c["sliding_window"]
        );
        MoeShape {
            num_experts,
            top_k,
            expert_size: intermediate_size,
            sparse_step: 1,
            dense_layers: Vec::new(),
            norm_topk_prob: true,
            aux_loss_coef,
        }
    } else {
        let sparse_step = key("decoder_sparse_step").unwrap_or(1);
        ensure!(
            sparse_step >= 1,
            "{}: decoder_sparse_step = 0; every (step)th layer is a mixture of experts, so it is \
             at least 1",
            path.display()
        );
        MoeShape {
            num_experts,
            top_k,
            expert_size: key("moe_intermediate_size").with_context(|| {
                format!("{}: missing integer moe_intermediate_size", path.display())
            })?,
            sparse_step,
            dense_layers: c["mlp_only_layers"]
                .as_array()
                .map(|a| {
                    a.iter()
                        .filter_map(|v| v.as_u64().map(|v| v as usize))
                        .collect()
                })
                .unwrap_or_default(),
            norm_topk_prob: c["norm_topk_prob"].as_bool().unwrap_or(false),
            aux_loss_coef,
        }
    };
    Ok(Some(shape))
}

/// RoPE's base and its Llama 3.1 scaling from a config.json `c` (at `path`).
fn rope_of(c: &Value, path: &Path) -> Result<(f64, Option<Llama3RopeScaling>)> {
    // transformers v4 writes rope_theta at the top level; v5 nests it in rope_parameters.
    let rope = &c["rope_parameters"];
    let rope_theta = c["rope_theta"]
        .as_f64()
        .or_else(|| rope["rope_theta"].as_f64())
        .unwrap_or(10000.0);
    // The scaling parameters sit in rope_parameters (v5) or rope_scaling (v4).
    let scaling = if rope["rope_type"].is_string() {
        rope
    } else {
        &c["rope_scaling"]
    };
    let rope_scaling = match scaling["rope_type"]
        .as_str()
        .or_else(|| scaling["type"].as_str())
    {
        None | Some("default") => None,
        Some("llama3") => {
            let num = |k: &str| {
                scaling[k]
                    .as_f64()
                    .with_context(|| format!("{}: llama3 RoPE scaling lacks {k}", path.display()))
            };
            Some(Llama3RopeScaling {
                factor: num("factor")?,
                low_freq_factor: num("low_freq_factor")?,
                high_freq_factor: num("high_freq_factor")?,
                original_max_position_embeddings: num("original_max_position_embeddings")? as usize,
            })
        }
        Some(t) => bail!(
            "{}: rope_type \"{t}\" is not supported; lockstep implements default and llama3 RoPE",
            path.display()
        ),
    };
    Ok((rope_theta, rope_scaling))
}

/// The safetensors files of a directory: the shards named by the index, or model.safetensors.
fn weight_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let index = dir.join("model.safetensors.index.json");
    if index.exists() {
        let v: Value = serde_json::from_str(&std::fs::read_to_string(&index)?)
            .with_context(|| format!("{}: invalid JSON", index.display()))?;
        let map = v["weight_map"]
            .as_object()
            .with_context(|| format!("{}: no weight_map", index.display()))?;
        let files: BTreeSet<&str> = map.values().filter_map(Value::as_str).collect();
        return Ok(files.into_iter().map(|f| dir.join(f)).collect());
    }
    let single = dir.join("model.safetensors");
    ensure!(
        single.exists(),
        "{} has neither model.safetensors nor model.safetensors.index.json; it is not a \
         Hugging Face model directory (or its index is missing)",
        dir.display()
    );
    Ok(vec![single])
}

/// Copies every variable of `vs` from the directory's weights (converted to the variable's dtype).
pub fn load_weights(dir: &Path, vs: &VarStore) -> Result<()> {
    let vars = vs.variables();
    let wanted: Vec<(String, Vec<i64>)> = vars.iter().map(|(n, v)| (n.clone(), v.size())).collect();
    read_weights(dir, &wanted, |name, src| {
        let var = &vars[name];
        tch::no_grad(|| {
            var.shallow_clone()
                .copy_(&src.to_kind(Kind::Float).to_device(var.device()))
        });
        Ok(())
    })
}

/// Reads the directory's weights of `wanted` (name, shape), one tensor at a time in the order
/// given, checking each shape, and hands each to `f` (as stored; on the CPU). A tied checkpoint
/// has no lm_head: an untied model then starts from the embedding.
pub fn read_weights(
    dir: &Path,
    wanted: &[(String, Vec<i64>)],
    mut f: impl FnMut(&str, Tensor) -> Result<()>,
) -> Result<()> {
    let files = weight_files(dir)?
        .iter()
        .map(|p| SafeFile::open(p))
        .collect::<Result<Vec<_>>>()?;
    let mut owner: BTreeMap<String, usize> = BTreeMap::new();
    for (i, f) in files.iter().enumerate() {
        for name in f.names() {
            owner.insert(name, i);
        }
    }
    let source = |name: &str| match owner.get(name) {
        Some(&i) => Some((i, name.to_string())),
        None if name == "lm_head.weight" => owner
            .get("model.embed_tokens.weight")
            .map(|&i| (i, "model.embed_tokens.weight".to_string())),
        None => None,
    };
    let missing: Vec<&str> = wanted
        .iter()
        .filter(|(n, _)| source(n).is_none())
        .map(|(n, _)| n.as_str())
        .collect();
    ensure!(
        missing.is_empty(),
        "{}: the weights lack tensors the model needs: {}",
        dir.display(),
        missing.join(", ")
    );
    for (name, shape) in wanted {
        let (i, stored) = source(name).expect("checked above");
        let src = files[i].tensor(&stored)?;
        ensure!(
            &src.size() == shape,
            "{}: tensor {stored} has shape {:?}, the model expects {shape:?}; config.json and the weights disagree",
            files[i].path().display(),
            src.size(),
        );
        crate::tensor_io::ensure_finite(
            &src,
            format_args!("{}: {stored}", files[i].path().display()),
            "these weights are damaged (or were saved after training diverged); use other weights",
        )?;
        f(name, src)?;
    }
    Ok(())
}

/// A transformers `config.json` for `shape` (v4's top-level rope_theta and v5's rope_parameters
/// both written, so either version loads it as the family's class, `LlamaForCausalLM` or
/// `Qwen3ForCausalLM`).
pub fn config_json(shape: &LlamaShape, dtype: &str) -> Value {
    let mut c = serde_json::json!({
        "architectures": [shape.family.hf_class()],
        "model_type": shape.family.name(),
        "hidden_act": "silu",
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_attention_heads": shape.num_heads,
        "num_hidden_layers": shape.num_layers,
        "num_key_value_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim(),
        "max_position_embeddings": shape.max_position_embeddings,
        "rms_norm_eps": shape.rms_norm_eps,
        "rope_theta": shape.rope_theta,
        "rope_parameters": rope_parameters(shape),
        "rope_scaling": shape.rope_scaling.map(|_| rope_parameters(shape)),
        "tie_word_embeddings": shape.tie_word_embeddings,
        "vocab_size": shape.vocab_size,
        "initializer_range": shape.init_std,
        "attention_bias": false,
        "mlp_bias": false,
        "torch_dtype": dtype,
    });
    if shape.family.qk_norm() {
        c["use_sliding_window"] = Value::Bool(false);
    }
    if let Some(m) = &shape.moe {
        let extra = match shape.family {
            Family::Mixtral => serde_json::json!({
                "num_local_experts": m.num_experts,
                "router_jitter_noise": 0.0,
                "sliding_window": null,
            }),
            _ => serde_json::json!({
                "num_experts": m.num_experts,
                "moe_intermediate_size": m.expert_size,
                "decoder_sparse_step": m.sparse_step,
                "mlp_only_layers": m.dense_layers,
                "norm_topk_prob": m.norm_topk_prob,
            }),
        };
        let common = serde_json::json!({
            "num_experts_per_tok": m.top_k,
            "router_aux_loss_coef": m.aux_loss_coef,
            "output_router_logits": false,
        });
        for (k, v) in extra
            .as_object()
            .into_iter()
            .chain(common.as_object())
            .flatten()
        {
            c[k] = v.clone();
        }
    }
    c
}

/// The shape of a Hugging Face Llama directory at its full depth (every layer it has).
pub fn dir_shape(dir: &Path, attention_backend: AttentionBackend) -> Result<LlamaShape> {
    let path = dir.join("config.json");
    ensure!(
        dir.is_dir(),
        "{}: no such directory; pass a Hugging Face Llama directory (an export of `lockstep export \
         --hf` or a checkpoint's step_N directory)",
        dir.display()
    );
    ensure!(
        path.is_file(),
        "{}: no config.json, so this is not a Hugging Face model directory; pass an export of \
         `lockstep export --hf` or a checkpoint's step_N directory",
        dir.display()
    );
    let c: Value = serde_json::from_str(
        &std::fs::read_to_string(&path)
            .with_context(|| format!("{}: cannot read", path.display()))?,
    )
    .with_context(|| format!("{}: invalid JSON", path.display()))?;
    let layers = c["num_hidden_layers"]
        .as_u64()
        .with_context(|| format!("{}: missing integer num_hidden_layers", path.display()))?;
    let mut m = crate::config::resolve(&crate::config::Sources::default())?
        .config
        .model;
    m.num_layers = layers as usize;
    m.attention_backend = attention_backend;
    shape_from_dir(dir, &m)
}

/// A model loaded from a Hugging Face Llama directory for inference: every layer, weights
/// converted to fp32 masters, RoPE tables for `max_seq` positions.
pub fn load_model(
    dir: &Path,
    device: tch::Device,
    compute: Kind,
    max_seq: usize,
    attention_backend: AttentionBackend,
) -> Result<(VarStore, super::Llama)> {
    let shape = dir_shape(dir, attention_backend)?;
    let mut vs = VarStore::new(device);
    let model = super::Llama::new(&vs.root(), &shape, max_seq.max(1), compute);
    load_weights(dir, &vs)?;
    vs.freeze();
    Ok((vs, model))
}

/// The weights of a Hugging Face directory (single file or shards), read tensor by tensor from
/// memory maps.
pub struct Weights {
    files: Vec<SafeFile>,
    owner: BTreeMap<String, usize>,
}

impl Weights {
    pub fn open(dir: &Path) -> Result<Weights> {
        let files = weight_files(dir)?
            .iter()
            .map(|p| SafeFile::open(p))
            .collect::<Result<Vec<_>>>()?;
        let mut owner = BTreeMap::new();
        for (i, f) in files.iter().enumerate() {
            for name in f.names() {
                owner.insert(name, i);
            }
        }
        Ok(Weights { files, owner })
    }

    pub fn contains(&self, name: &str) -> bool {
        self.owner.contains_key(name)
    }

    /// Every tensor name, sorted.
    pub fn names(&self) -> Vec<String> {
        self.owner.keys().cloned().collect()
    }

    fn file(&self, name: &str) -> Result<&SafeFile> {
        let i = *self
            .owner
            .get(name)
            .with_context(|| format!("the weights have no tensor {name}"))?;
        Ok(&self.files[i])
    }

    pub fn shape(&self, name: &str) -> Result<Vec<i64>> {
        self.file(name)?.shape(name)
    }

    /// A CPU copy of `name` in its stored dtype.
    pub fn tensor(&self, name: &str) -> Result<Tensor> {
        self.file(name)?.tensor(name)
    }

    /// Elements `range` of `name` flattened (1-D, stored dtype), reading only those bytes.
    pub fn elements(&self, name: &str, range: &std::ops::Range<usize>) -> Result<Tensor> {
        self.file(name)?.elements(name, range)
    }

    /// Fails, naming what differs, unless the weights hold every tensor of `shape` with the
    /// right dimensions.
    pub fn check(&self, shape: &LlamaShape, what: &Path) -> Result<()> {
        for (name, dims) in super::Parameters::of(shape).shapes() {
            ensure!(
                self.contains(&name),
                "{}: the weights have no tensor {name}; config.json and the weights disagree",
                what.display()
            );
            let got = self.shape(&name)?;
            ensure!(
                got == dims,
                "{}: tensor {name} has shape {got:?}, config.json implies {dims:?}",
                what.display()
            );
        }
        Ok(())
    }
}

/// What `write_weights` wrote.
#[derive(Debug, Clone)]
pub struct WrittenWeights {
    /// File names in `dir`: `model.safetensors`, or the shards and then the index.
    pub files: Vec<String>,
    /// Bytes of tensor data (the index's `metadata.total_size`).
    pub total_size: u64,
}

/// Writes `tensors` (names and shapes, in order; `fetch` gives each one) to `dir` as
/// transformers does: `model.safetensors` when everything fits in `max_shard_bytes`, else
/// `model-0000i-of-0000N.safetensors` shards filled in order up to that size (a tensor larger
/// than the limit gets a shard of its own) plus `model.safetensors.index.json`. Every tensor is
/// converted to `kind`; every file is fsynced. One shard is in memory at a time.
pub fn write_weights(
    dir: &Path,
    tensors: &[(String, Vec<i64>)],
    kind: Kind,
    max_shard_bytes: u64,
    mut fetch: impl FnMut(&str) -> Result<Tensor>,
) -> Result<WrittenWeights> {
    let elt = kind.elt_size_in_bytes() as u64;
    let bytes = |dims: &[i64]| dims.iter().product::<i64>() as u64 * elt;
    let mut shards: Vec<Vec<usize>> = Vec::new();
    let mut current = 0u64;
    for (i, (_, dims)) in tensors.iter().enumerate() {
        let b = bytes(dims);
        match shards.last_mut() {
            Some(last) if current + b <= max_shard_bytes => {
                last.push(i);
                current += b;
            }
            _ => {
                shards.push(vec![i]);
                current = b;
            }
        }
    }
    let total_size: u64 = tensors.iter().map(|(_, d)| bytes(d)).sum();
    let n = shards.len();
    let names: Vec<String> = if n <= 1 {
        vec!["model.safetensors".to_string()]
    } else {
        (1..=n)
            .map(|i| format!("model-{i:05}-of-{n:05}.safetensors"))
            .collect()
    };
    let metadata: std::collections::HashMap<String, String> =
        [("format".to_string(), "pt".to_string())].into();
    let mut weight_map = serde_json::Map::new();
    for (file, members) in names.iter().zip(&shards) {
        let shard: Vec<(String, Tensor)> = members
            .iter()
            .map(|&i| {
                let (name, dims) = &tensors[i];
                let t = fetch(name)?.to_kind(kind).contiguous();
                ensure!(
                    &t.size() == dims,
                    "tensor {name} has shape {:?}, expected {dims:?}",
                    t.size()
                );
                weight_map.insert(name.clone(), Value::String(file.clone()));
                Ok((name.clone(), t))
            })
            .collect::<Result<_>>()?;
        let path = dir.join(file);
        crate::tensor_io::save(&path, &shard, Some(metadata.clone()))?;
        crate::sys::durable::sync_file(&path)?;
    }
    let mut files = names;
    if n > 1 {
        let index = serde_json::json!({
            "metadata": {"total_size": total_size},
            "weight_map": weight_map,
        });
        let path = dir.join("model.safetensors.index.json");
        crate::sys::durable::write_synced(&path, serde_json::to_string_pretty(&index)?.as_bytes())?;
        files.push("model.safetensors.index.json".to_string());
    }
    Ok(WrittenWeights { files, total_size })
}

/// End-of-sequence ids from `<dir>/generation_config.json` (an int or a list), else from
/// config.json; None when neither names one.
pub fn eos_token_ids(dir: &Path) -> Result<Option<Vec<i64>>> {
    for file in ["generation_config.json", "config.json"] {
        let path = dir.join(file);
        let Ok(text) = std::fs::read_to_string(&path) else {
            continue;
        };
        let v: Value = serde_json::from_str(&text)
            .with_context(|| format!("{}: invalid JSON", path.display()))?;
        match &v["eos_token_id"] {
            Value::Number(n) => return Ok(n.as_i64().map(|id| vec![id])),
            Value::Array(a) => return Ok(Some(a.iter().filter_map(Value::as_i64).collect())),
            _ => {}
        }
    }
    Ok(None)
}

/// transformers' `rope_parameters` (v5) for a shape; v4 reads `rope_scaling`, written alongside.
fn rope_parameters(shape: &LlamaShape) -> Value {
    match shape.rope_scaling {
        None => serde_json::json!({"rope_type": "default", "rope_theta": shape.rope_theta}),
        Some(s) => serde_json::json!({
            "rope_type": "llama3",
            "rope_theta": shape.rope_theta,
            "factor": s.factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position_embeddings,
        }),
    }
}
