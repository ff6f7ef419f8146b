//! `lockstep export --hf OUT`: a checkpoint as a directory transformers loads with
//! `AutoModelForCausalLM.from_pretrained(OUT)`:
//!
//! ```text
//! OUT/
//!   config.json              LlamaForCausalLM config; torch_dtype = the exported dtype
//!   generation_config.json   bos/eos ids of the tokenizer (where it has them)
//!   model.safetensors        or model-0000i-of-0000N.safetensors + model.safetensors.index.json
//!   tokenizer.json           data.tokenizer's tokenizer.json, or for a built-in tiktoken
//!                            encoding an equivalent one generated from its ranks
//!   tokenizer_config.json    tokenizer class, bos/eos spellings (+ special_tokens_map.json)
//!   lockstep.json            source checkpoint, step, tokenizer name, context length
//! ```
//!
//! Written into `OUT.tmp/`, fsynced, then renamed: a directory named OUT is always complete.

use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{bail, ensure, Context, Result};
use clap::Args;
use serde_json::{json, Value};
use tch::Kind;

use super::PROVENANCE_FILE;
use crate::config::{usage, Resolved};
use crate::data::tokenizer::Tokenizer;
use crate::model::{hf, AttentionBackend};
use crate::run::{self, checkpoints};
use crate::sys::durable::{write_synced, AtomicDir};

#[derive(Args, Debug, Clone)]
pub struct ExportArgs {
    /// Output directory (a Hugging Face model directory).
    #[arg(long = "hf", value_name = "OUT")]
    pub out: PathBuf,
    /// `latest` = the run's latest complete checkpoint; a checkpoint (step_N) directory; or a
    /// run directory (or its checkpoints/), which stands for its newest complete checkpoint.
    #[arg(long, value_name = "DIR|latest", default_value = "latest")]
    pub checkpoint: String,
    /// Dtype of the exported weights (fp32 = the checkpoint's master weights, bit for bit;
    /// bf16 or fp16 halve the files).
    #[arg(long, value_name = "fp32|bf16|fp16", default_value = "fp32",
          value_parser = ["fp32", "bf16", "fp16"])]
    pub dtype: String,
    /// Largest safetensors file in MB (10^6 bytes); bigger models are sharded with an index.
    #[arg(long, value_name = "MB", default_value_t = 5000)]
    pub max_shard_mb: u64,
    /// Replace OUT if it exists and is not empty.
    #[arg(long)]
    pub force: bool,
}

/// What `export` wrote.
#[derive(Debug, Clone)]
pub struct Exported {
    pub source: PathBuf,
    pub out: PathBuf,
    pub step: Option<u64>,
    pub files: Vec<String>,
    pub weight_bytes: u64,
    pub shards: usize,
    pub tokenizer: Option<String>,
}

fn dtype(name: &str) -> (Kind, &'static str) {
    match name {
        "bf16" => (Kind::BFloat16, "bfloat16"),
        "fp16" => (Kind::Half, "float16"),
        _ => (Kind::Float, "float32"),
    }
}

/// The checkpoint `--checkpoint` names, verified, and held while exported (`checkpoints::hold`).
fn source_checkpoint(
    resolved: &Resolved,
    which: &str,
) -> Result<(PathBuf, Option<checkpoints::Hold>)> {
    if which != "latest" {
        let (dir, hold) = super::newest_checkpoint(Path::new(which), "--checkpoint")?;
        ensure!(
            dir.is_dir(),
            "--checkpoint {}: no such directory; pass a checkpoint's step_N directory, a run \
             directory (its newest checkpoint) or `latest`",
            dir.display()
        );
        ensure!(
            dir.join("config.json").is_file(),
            "--checkpoint {}: no config.json, so it is not a checkpoint; pass a step_N directory \
             under the run's checkpoints/",
            dir.display()
        );
        return Ok((dir, hold));
    }
    let root = run::checkpoint_dir(resolved);
    match checkpoints::latest(&root) {
        Some(_) => super::newest_checkpoint(&root, "--checkpoint latest"),
        None => {
            let note = super::incomplete_note(&root);
            bail!(
                "no complete checkpoint to export in {}{note}; train the run first, pass the same \
                 --preset/--config/--set flags as the training run so that its checkpoints are \
                 found, or pass --checkpoint DIR",
                root.display()
            )
        }
    }
}

/// Refuses an OUT that holds anything, unless `force`.
fn check_out(out: &Path, force: bool) -> Result<()> {
    if !out.exists() {
        return Ok(());
    }
    ensure!(
        out.is_dir(),
        "--hf {}: exists and is not a directory; choose another output path",
        out.display()
    );
    let empty = fs::read_dir(out)
        .with_context(|| format!("--hf {}: cannot list", out.display()))?
        .next()
        .is_none();
    ensure!(
        empty || force,
        "--hf {}: already exists and is not empty; pass --force to replace it, or choose another \
         output path",
        out.display()
    );
    Ok(())
}

/// Special-token facts of the tokenizer: (eos id, eos spelling, bos id, bos spelling).
struct Specials {
    eos: (u32, String),
    bos: Option<(u32, String)>,
}

fn specials(tok: &Tokenizer, spec: &str) -> Specials {
    let eos_text = tok.decode(&[tok.eos_id()]).unwrap_or_default();
    if !Path::new(spec).is_file() {
        // A tiktoken encoding has no BOS of its own. As in GPT-2's files, <|endoftext|> is
        // both: lockstep's training stream puts it between documents, so it is what every
        // document but the first followed. It is named, never added (add_bos_token: false).
        return Specials {
            eos: (tok.eos_id(), eos_text.clone()),
            bos: Some((tok.eos_id(), eos_text)),
        };
    }
    let bos = tok.bos();
    if let Ok(inner) = tokenizers::Tokenizer::from_file(spec) {
        if let Some(s) = inner.id_to_token(tok.eos_id()) {
            return Specials {
                eos: (tok.eos_id(), s),
                bos,
            };
        }
    }
    Specials {
        eos: (tok.eos_id(), eos_text),
        bos,
    }
}

fn write_json(path: &Path, v: &Value) -> Result<()> {
    write_synced(path, (serde_json::to_string_pretty(v)? + "\n").as_bytes())
}

pub fn export(resolved: &Resolved, args: &ExportArgs) -> Result<Exported> {
    // Components drop a trailing slash, so `OUT/` gets the sibling `OUT.tmp`, not `OUT/.tmp`.
    let out: PathBuf = args.out.components().collect();
    usage(out.file_name().is_some(), || {
        format!(
            "--hf {}: name a new output directory, e.g. --hf exports/my-model",
            out.display()
        )
    })?;
    usage(args.max_shard_mb > 0, || {
        "--max-shard-mb 0: must be at least 1".into()
    })?;
    check_out(&out, args.force)?;
    // Its model files verified (`newest_checkpoint`).
    let (source, _hold) = source_checkpoint(resolved, &args.checkpoint)?;
    let shape = hf::dir_shape(&source, AttentionBackend::Sdpa)?;
    let weights = hf::Weights::open(&source)?;
    weights.check(&shape, &source)?;

    let trainer: Option<Value> = fs::read_to_string(source.join("trainer.json"))
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok());
    let trained_cfg = trainer.as_ref().map(|t| &t["config"]);
    let step = trainer.as_ref().and_then(|t| t["step"].as_u64());
    // The tokenizer the checkpoint was trained with, else the one the flags resolve to.
    let mut tok_spec = trained_cfg
        .and_then(|c| c["data"]["tokenizer"].as_str())
        .unwrap_or(&resolved.config.data.tokenizer)
        .to_string();
    let context_length = trained_cfg
        .and_then(|c| c["training"]["context_length"].as_u64())
        .unwrap_or(resolved.config.training.context_length as u64);
    // A directory or Hub id stands for its tokenizer.json (in the Hub cache since training).
    let loaded = crate::data::hub::resolve_tokenizer(&tok_spec)
        .and_then(|file| Ok((Tokenizer::load(&file)?, file)));
    let tok = match loaded {
        Ok((t, file)) => {
            tok_spec = file;
            Some(t)
        }
        Err(e) => {
            eprintln!(
                "[export] warning: tokenizer `{tok_spec}` cannot be loaded ({e:#}); the export \
                 gets no tokenizer files and no bos/eos ids"
            );
            None
        }
    };

    if let Some(parent) = out.parent().filter(|p| !p.as_os_str().is_empty()) {
        fs::create_dir_all(parent).with_context(|| {
            format!("--hf {}: cannot create the parent directory", out.display())
        })?;
    }
    let staging = AtomicDir::begin(&out).with_context(|| {
        format!(
            "--hf {}: cannot start the export; choose a writable output path",
            out.display()
        )
    })?;
    let from = Provenance {
        source: &source,
        step,
        context_length,
    };
    let written = write_contents(
        staging.path(),
        &shape,
        &weights,
        args,
        tok.as_ref().map(|t| (t, tok_spec.as_str())),
        &from,
    );
    let (files, weight_bytes, shards) = match written {
        Ok(w) => w,
        Err(e) => {
            staging.abandon();
            return Err(e.context(format!(
                "exporting {} to {} failed; nothing was written there",
                source.display(),
                out.display()
            )));
        }
    };
    // An existing OUT (empty, or replaced under --force) is moved aside in one rename first.
    staging.commit()?;
    Ok(Exported {
        source,
        out,
        step,
        files,
        weight_bytes,
        shards,
        tokenizer: tok.map(|_| tok_spec),
    })
}

/// Where an export comes from, for lockstep.json.
struct Provenance<'a> {
    source: &'a Path,
    step: Option<u64>,
    context_length: u64,
}

fn write_contents(
    dir: &Path,
    shape: &crate::model::LlamaShape,
    weights: &hf::Weights,
    args: &ExportArgs,
    tok: Option<(&Tokenizer, &str)>,
    from: &Provenance,
) -> Result<(Vec<String>, u64, usize)> {
    let Provenance {
        source,
        step,
        context_length,
    } = *from;
    let (kind, dtype_name) = dtype(&args.dtype);
    let tensors = crate::model::Parameters::of(shape).shapes();
    let written = hf::write_weights(dir, &tensors, kind, args.max_shard_mb * 1_000_000, |name| {
        let t = weights.tensor(name)?;
        let what = format_args!("{}: {name}", source.display());
        crate::tensor_io::ensure_finite(&t, what, "these weights are damaged (or were saved after training diverged); export another checkpoint")?;
        Ok(t)
    })?;
    let shards = written
        .files
        .iter()
        .filter(|f| f.ends_with(".safetensors"))
        .count();
    let mut files = written.files;

    let specials = tok.map(|(t, spec)| specials(t, spec));
    let eos = specials.as_ref().map(|s| s.eos.0);
    let bos = specials.as_ref().and_then(|s| s.bos.as_ref().map(|b| b.0));
    let mut config = hf::config_json(shape, dtype_name);
    config["bos_token_id"] = json!(bos);
    config["eos_token_id"] = json!(eos);
    write_json(&dir.join("config.json"), &config)?;
    files.push("config.json".into());

    let mut generation = serde_json::Map::new();
    if let Some(b) = bos {
        generation.insert("bos_token_id".into(), json!(b));
    }
    if let Some(e) = eos {
        generation.insert("eos_token_id".into(), json!(e));
        generation.insert("pad_token_id".into(), json!(e));
    }
    write_json(
        &dir.join("generation_config.json"),
        &Value::Object(generation),
    )?;
    files.push("generation_config.json".into());

    // lockstep.json keeps a built-in encoding's name, so that lockstep's own eval and generate
    // use tiktoken itself (and match .tok files by its hash); a tokenizer.json is named as such.
    let mut tokenizer_entry = tok.map(|(_, spec)| spec.to_string());
    if let (Some((t, spec)), Some(sp)) = (tok, &specials) {
        files.extend(write_tokenizer_files(dir, t, spec, sp, shape)?);
        if Path::new(spec).is_file() {
            tokenizer_entry = Some("tokenizer.json".into());
        }
    }
    write_json(
        &dir.join(PROVENANCE_FILE),
        &json!({
            "format": 1,
            "exported_from": source.canonicalize().unwrap_or_else(|_| source.to_path_buf()),
            "step": step,
            "dtype": dtype_name,
            "tokenizer": tokenizer_entry,
            "context_length": context_length,
            "lockstep_version": env!("CARGO_PKG_VERSION"),
        }),
    )?;
    files.push(PROVENANCE_FILE.into());
    Ok((files, written.total_size, shards))
}

/// tokenizer.json (a copy of the one trained with, or generated for a tiktoken encoding),
/// tokenizer_config.json and special_tokens_map.json, so that `AutoTokenizer` loads the
/// export. Returns the names written.
fn write_tokenizer_files(
    dir: &Path,
    tok: &Tokenizer,
    spec: &str,
    sp: &Specials,
    shape: &crate::model::LlamaShape,
) -> Result<Vec<String>> {
    let dst = dir.join("tokenizer.json");
    let json = tok
        .hf_tokenizer_json()
        .with_context(|| format!("the tokenizer {spec} for {}", dst.display()))?;
    write_synced(&dst, &json)?;

    let mut config = json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": sp.eos.1,
        "model_max_length": shape.max_position_embeddings,
        "clean_up_tokenization_spaces": false,
    });
    let mut special_map = json!({"eos_token": sp.eos.1});
    if let Some((_, b)) = &sp.bos {
        config["bos_token"] = json!(b);
        special_map["bos_token"] = json!(b);
    }
    if !Path::new(spec).is_file() {
        // Encoding a prompt adds neither, as lockstep's own encoding does not. Said explicitly
        // for converters that would otherwise guess (llama.cpp's records these two flags).
        config["add_bos_token"] = json!(false);
        config["add_eos_token"] = json!(false);
    }
    write_json(&dir.join("tokenizer_config.json"), &config)?;
    write_json(&dir.join("special_tokens_map.json"), &special_map)?;
    Ok(vec![
        "tokenizer.json".into(),
        "tokenizer_config.json".into(),
        "special_tokens_map.json".into(),
    ])
}

/// `lockstep export`: export and say what was written.
pub fn run(resolved: &Resolved, args: &ExportArgs) -> Result<()> {
    let e = export(resolved, args)?;
    let step = e.step.map_or(String::new(), |s| format!(" (step {s})"));
    println!(
        "[export] {}{step} -> {}: {:.1} MB of {} weights in {} file{}{}",
        e.source.display(),
        e.out.display(),
        e.weight_bytes as f64 / 1e6,
        args.dtype,
        e.shards,
        if e.shards == 1 {
            ""
        } else {
            "s (sharded, with model.safetensors.index.json)"
        },
        e.tokenizer
            .as_deref()
            .map_or(String::new(), |t| format!(", tokenizer {t}"))
    );
    println!(
        "[export] load with transformers: AutoModelForCausalLM.from_pretrained(\"{}\")",
        e.out.display()
    );
    Ok(())
}
