//! Hugging Face Llama directories: `config.json` → `LlamaShape`, and `model.safetensors` (or a
//! sharded `model.safetensors.index.json`) → the VarStore, optionally keeping only the first N
//! layers. Names are already HF's, so loading is a checked copy by name.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use anyhow::{bail, ensure, Context, Result};
use serde_json::Value;
use tch::nn::VarStore;
use tch::Kind;

use super::shape::{AttentionBackend, LlamaShape};
use crate::config::ModelConfig;
use crate::tensor_io::SafeFile;

/// Shape from `<dir>/config.json`. `m.num_layers` below the checkpoint's keeps the first layers.
pub fn shape_from_dir(dir: &Path, m: &ModelConfig) -> Result<LlamaShape> {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).with_context(|| {
        format!(
            "model.model_path: cannot read {}; point it at a Hugging Face Llama directory",
            path.display()
        )
    })?;
    let c: Value =
        serde_json::from_str(&text).with_context(|| format!("{}: invalid JSON", path.display()))?;
    let model_type = c["model_type"].as_str().unwrap_or("");
    ensure!(
        model_type == "llama",
        "{}: model_type is {:?}; lockstep trains Llama-architecture models (model_type \"llama\")",
        path.display(),
        c["model_type"]
    );
    let uint = |key: &str| -> Result<usize> {
        c[key]
            .as_u64()
            .map(|v| v as usize)
            .with_context(|| format!("{}: missing integer {key}", path.display()))
    };
    let hidden_size = uint("hidden_size")?;
    let num_heads = uint("num_attention_heads")?;
    let file_layers = uint("num_hidden_layers")?;
    ensure!(
        m.num_layers <= file_layers,
        "model.num_layers = {} but {} has only {file_layers} layers; use at most {file_layers}",
        m.num_layers,
        path.display()
    );
    if let Some(hd) = c["head_dim"].as_u64() {
        ensure!(
            hd as usize == hidden_size / num_heads,
            "{}: head_dim {hd} != hidden_size / num_attention_heads; such checkpoints are not supported",
            path.display()
        );
    }
    // transformers v4 writes rope_theta at the top level; v5 nests it in rope_parameters.
    let rope = &c["rope_parameters"];
    let rope_theta = c["rope_theta"]
        .as_f64()
        .or_else(|| rope["rope_theta"].as_f64())
        .unwrap_or(10000.0);
    let rope_type = rope["rope_type"]
        .as_str()
        .or_else(|| c["rope_scaling"]["rope_type"].as_str());
    if let Some(t) = rope_type.filter(|t| *t != "default") {
        bail!(
            "{}: rope_type \"{t}\" (RoPE scaling) is not supported yet; only default RoPE",
            path.display()
        );
    }
    Ok(LlamaShape {
        vocab_size: uint("vocab_size")?,
        hidden_size,
        num_layers: m.num_layers,
        num_heads,
        num_kv_heads: c["num_key_value_heads"]
            .as_u64()
            .map_or(num_heads, |v| v as usize),
        intermediate_size: uint("intermediate_size")?,
        max_position_embeddings: uint("max_position_embeddings")?,
        rope_theta,
        rms_norm_eps: c["rms_norm_eps"].as_f64().unwrap_or(1e-6),
        tie_word_embeddings: c["tie_word_embeddings"].as_bool().unwrap_or(false),
        init_std: c["initializer_range"].as_f64().unwrap_or(m.init_std),
        attention: AttentionBackend::from_config(&m.attention_backend),
    })
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
        "model.model_path: {} has neither model.safetensors nor model.safetensors.index.json",
        dir.display()
    );
    Ok(vec![single])
}

/// Copies every variable of `vs` from the directory's weights (converted to the variable's dtype).
pub fn load_weights(dir: &Path, vs: &VarStore) -> Result<()> {
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
    let vars = vs.variables();
    let mut missing: Vec<String> = Vec::new();
    tch::no_grad(|| -> Result<()> {
        for (name, var) in &vars {
            let Some(&i) = owner.get(name) else {
                missing.push(name.clone());
                continue;
            };
            let src = files[i].tensor(name)?;
            ensure!(
                src.size() == var.size(),
                "{}: tensor {name} has shape {:?}, the model expects {:?}; config.json and the weights disagree",
                files[i].path().display(),
                src.size(),
                var.size()
            );
            var.shallow_clone()
                .copy_(&src.to_kind(Kind::Float).to_device(var.device()));
        }
        Ok(())
    })?;
    // A tied checkpoint has no lm_head; an untied model may still start from it by copying.
    if missing == ["lm_head.weight"] {
        let i = owner["model.embed_tokens.weight"];
        let src = files[i].tensor("model.embed_tokens.weight")?;
        tch::no_grad(|| {
            vars["lm_head.weight"]
                .shallow_clone()
                .copy_(&src.to_kind(Kind::Float))
        });
        missing.clear();
    }
    ensure!(
        missing.is_empty(),
        "model.model_path {}: weights are missing tensors the model needs: {}",
        dir.display(),
        missing.join(", ")
    );
    Ok(())
}

/// A transformers `config.json` for `shape` (v4's top-level rope_theta and v5's rope_parameters
/// both written, so either version loads it as LlamaForCausalLM).
pub fn config_json(shape: &LlamaShape, dtype: &str) -> Value {
    serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
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
        "rope_parameters": {"rope_type": "default", "rope_theta": shape.rope_theta},
        "tie_word_embeddings": shape.tie_word_embeddings,
        "vocab_size": shape.vocab_size,
        "initializer_range": shape.init_std,
        "attention_bias": false,
        "mlp_bias": false,
        "torch_dtype": dtype,
    })
}
