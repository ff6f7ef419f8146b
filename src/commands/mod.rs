//! The Hugging Face interop and inference commands: `export` (checkpoint → transformers
//! directory), `eval` (loss and perplexity of a model directory on a file, scores on
//! multiple-choice tasks) and `generate`
//! (KV-cached sampling); `plan` (what a config needs per rank, before it runs); `wandb-sync`
//! (a run's metrics into W&B afterwards); `env` (what a bug report needs). Shared here: what a
//! model directory says about how it was trained, the device/dtype flags, and opening a model
//! for inference ([`Inference`], for eval and generate).

pub mod env;
pub mod eval;
pub mod export;
pub mod generate;
pub mod plan;
pub mod wandb_sync;

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::Args;
use serde_json::Value;
use tch::{Device, Kind};

use crate::config::ConfigError;
use crate::data::tokenizer::{Tokenizer, BUILTIN_NAMES};
use crate::model::{hf, AttentionBackend, Llama, LlamaShape};
use crate::run::checkpoints;
use crate::sys::cuda::{cuda_available, load_cuda_backend};

/// The flags `eval` and `generate` open a model with.
#[derive(Args, Debug, Clone)]
pub struct ModelFlags {
    /// A Hugging Face Llama directory: an export (`lockstep export --hf`), a checkpoint's
    /// step_N directory, or a run directory (or its checkpoints/), which stands for its newest
    /// complete checkpoint; or a Hub id.
    #[arg(long, value_name = "DIR")]
    pub model: PathBuf,
    /// Tokenizer (text to ids, ids to text); default: the built-in encoding the model was
    /// trained with, else DIR/tokenizer.json, else the tokenizer file it was trained with.
    #[arg(long, value_name = "NAME|PATH")]
    pub tokenizer: Option<String>,
    /// auto, cpu, cuda or cuda:N.
    #[arg(long, value_name = "DEVICE", default_value = "auto")]
    pub device: String,
    /// Dtype of the forward pass.
    #[arg(long, value_name = "fp32|bf16", default_value = "fp32")]
    pub dtype: String,
}

/// A model opened for inference (`eval`, `generate`): its directory (a checkpoint verified,
/// a Hub id resolved), shape, tokenizer, and the device and dtype it runs on; the weights are
/// read by [`Inference::load`] once the context is known.
pub struct Inference {
    pub dir: PathBuf,
    pub shape: LlamaShape,
    /// The tokenizer `--tokenizer` names or the directory records (None: ids only).
    pub tok: Option<Tokenizer>,
    pub device: Device,
    pub compute: Kind,
    /// The checkpoint held for reading while the model is open (`checkpoints::hold`).
    _hold: Option<checkpoints::Hold>,
}

impl Inference {
    pub fn open(flags: &ModelFlags) -> Result<Self> {
        let device = parse_device(&flags.device)?;
        let compute = parse_compute(&flags.dtype)?;
        let (dir, hold) = model_dir(&flags.model)?;
        let shape = hf::dir_shape(&dir, AttentionBackend::Sdpa)
            .with_context(|| format!("--model {}", flags.model.display()))?;
        let tok = find_tokenizer(&dir, flags.tokenizer.as_deref())?;
        Ok(Inference {
            dir,
            shape,
            tok,
            device,
            compute,
            _hold: hold,
        })
    }

    /// The model's weights on the device, for sequences of up to `context` tokens.
    pub fn load(&self, context: usize) -> Result<(tch::nn::VarStore, Llama)> {
        hf::load_model(
            &self.dir,
            self.device,
            self.compute,
            context,
            AttentionBackend::Sdpa,
        )
    }
}

/// Written by `export` next to the weights: where they came from and what a later `eval` or
/// `generate` needs that transformers' files do not say (a built-in tokenizer's name, the
/// training context length).
pub const PROVENANCE_FILE: &str = "lockstep.json";

/// What a model directory records about its training: `lockstep.json` (an export) or
/// `trainer.json` (a checkpoint).
#[derive(Debug, Clone, Default)]
pub struct TrainedWith {
    pub tokenizer: Option<String>,
    pub context_length: Option<usize>,
    /// The file it was read from.
    pub source: Option<PathBuf>,
}

impl TrainedWith {
    pub fn read(dir: &Path) -> Result<TrainedWith> {
        let read = |name: &str| -> Result<Option<(PathBuf, Value)>> {
            let path = dir.join(name);
            if !path.is_file() {
                return Ok(None);
            }
            let text = std::fs::read_to_string(&path)
                .with_context(|| format!("{}: cannot read", path.display()))?;
            let v = serde_json::from_str(&text)
                .with_context(|| format!("{}: invalid JSON", path.display()))?;
            Ok(Some((path, v)))
        };
        if let Some((path, v)) = read(PROVENANCE_FILE)? {
            return Ok(TrainedWith {
                tokenizer: v["tokenizer"].as_str().map(str::to_string),
                context_length: v["context_length"].as_u64().map(|n| n as usize),
                source: Some(path),
            });
        }
        if let Some((path, v)) = read("trainer.json")? {
            let c = &v["config"];
            return Ok(TrainedWith {
                tokenizer: c["data"]["tokenizer"].as_str().map(str::to_string),
                context_length: c["training"]["context_length"].as_u64().map(|n| n as usize),
                source: Some(path),
            });
        }
        Ok(TrainedWith::default())
    }
}

/// `--model`: an existing directory (a run directory or a checkpoint directory standing for
/// its newest complete checkpoint, [`newest_checkpoint`]), else a Hugging Face id
/// `owner/name[@revision]` resolved through the hub cache (downloaded when missing, unless
/// HF_HUB_OFFLINE is set). Anything else is returned unchanged, for the usual
/// missing-directory errors. A checkpoint's model files are checked against their recorded
/// checksums, and a checkpoint is held for reading while the hold lives.
pub fn model_dir(model: &Path) -> Result<(PathBuf, Option<checkpoints::Hold>)> {
    match model.to_str() {
        Some(id) if crate::data::hub::is_hub_model_id(id) => {
            let dir = crate::data::hub::resolve_model_as("--model", id)?;
            checkpoints::verify_model(&dir).with_context(|| format!("--model {id}"))?;
            Ok((dir, None))
        }
        _ => newest_checkpoint(model, "--model"),
    }
}

/// The model directory `dir` stands for, its model files checked against their recorded
/// checksums (once: [`checkpoints::verify_model`]), and held for reading
/// ([`checkpoints::hold`]: rotation by the run that is still training keeps it while held): a
/// run directory (`runs/<name>`, where lockstep wrote the resolved config.json) or a
/// checkpoint directory (one holding `step_N` directories) stands for its newest complete
/// checkpoint whose model files verify (said on stderr, with any damaged one skipped, and one
/// rotated away meanwhile replaced by the newest then); any other directory, a model directory
/// included, is itself. `flag` names the option in messages.
pub fn newest_checkpoint(dir: &Path, flag: &str) -> Result<(PathBuf, Option<checkpoints::Hold>)> {
    let is_model = [
        "trainer.json",
        "model.safetensors",
        "model.safetensors.index.json",
    ]
    .iter()
    .any(|f| dir.join(f).is_file());
    if is_model || !dir.is_dir() {
        let hold = match dir.join("trainer.json").is_file() {
            true => checkpoints::hold(dir)?,
            false => None,
        };
        checkpoints::verify_model(dir).with_context(|| format!("{flag} {}", dir.display()))?;
        warn_unverified(dir, flag);
        return Ok((dir.to_path_buf(), hold));
    }
    let root = match run_checkpoints(dir)? {
        Some(root) => root,
        None if !checkpoints::list(dir).is_empty() || !checkpoints::strays(dir).is_empty() => {
            dir.to_path_buf()
        }
        None => return Ok((dir.to_path_buf(), None)),
    };
    // Newest first; a checkpoint rotated away before it could be held starts the list over
    // (a live run keeps saving), without those already found damaged.
    let mut damaged: Vec<PathBuf> = Vec::new();
    'listing: loop {
        for (_, ckpt) in checkpoints::list(&root).into_iter().rev() {
            if damaged.contains(&ckpt) {
                continue;
            }
            let Some(hold) = checkpoints::hold(&ckpt)? else {
                continue 'listing;
            };
            match checkpoints::verify_model(&ckpt) {
                Ok(()) => {
                    eprintln!(
                        "{flag} {}: its newest complete checkpoint, {}",
                        dir.display(),
                        ckpt.display()
                    );
                    warn_unverified(&ckpt, flag);
                    return Ok((ckpt, Some(hold)));
                }
                Err(e) => eprintln!(
                    "{flag} {}: skipping damaged checkpoint {} ({e:#})",
                    dir.display(),
                    ckpt.display()
                ),
            }
            damaged.push(ckpt);
        }
        break;
    }
    bail!(
        "{flag} {}: no complete checkpoint in {}{}; train the run first (a checkpoint is saved \
         every checkpoint.interval steps and at the end), or pass a checkpoint's step_N \
         directory",
        dir.display(),
        root.display(),
        incomplete_note(&root)
    )
}

/// The warning of a checkpoint read without checksums ([`checkpoints::unverified`]), on stderr.
fn warn_unverified(dir: &Path, flag: &str) {
    if let Some(note) = checkpoints::unverified(dir) {
        eprintln!("{flag} {}: warning: {note}", dir.display());
    }
}

/// ` (not checkpoints: …/step_4.tmp: a save was interrupted)` when `root` holds directories
/// named like checkpoints that are not ([`checkpoints::strays`]), else empty: what a "no
/// complete checkpoint" message adds.
fn incomplete_note(root: &Path) -> String {
    match checkpoints::strays(root).as_slice() {
        [] => String::new(),
        strays => format!(
            " (not checkpoints: {})",
            strays
                .iter()
                .map(|(p, why)| format!("{}: {why}", p.display()))
                .collect::<Vec<_>>()
                .join("; ")
        ),
    }
}

/// The checkpoint directory of the run in `dir`, when `dir` is a run directory (its
/// config.json is a lockstep config): `<dir>/checkpoints` without `checkpoint.dir`, else the
/// directory the run recorded when it started (`run::dir::CHECKPOINT_DIR_FILE`), else an
/// absolute `checkpoint.dir`. A relative `checkpoint.dir` the run did not record (a run of an
/// older lockstep) is refused: it was relative to wherever the run was started, and resolving
/// it here could pick another run's checkpoints.
fn run_checkpoints(dir: &Path) -> Result<Option<PathBuf>> {
    let Some(cfg) = std::fs::read_to_string(dir.join("config.json"))
        .ok()
        .and_then(|text| serde_json::from_str::<Value>(&text).ok())
    else {
        return Ok(None);
    };
    let (Some(training), Some(ckpt)) = (cfg.get("training"), cfg.get("checkpoint")) else {
        return Ok(None);
    };
    if !training.is_object() {
        return Ok(None);
    }
    let Some(set) = ckpt.get("dir").and_then(Value::as_str).map(PathBuf::from) else {
        return Ok(Some(dir.join("checkpoints")));
    };
    if let Some(recorded) = crate::run::dir::recorded_checkpoint_dir(dir) {
        return Ok(Some(recorded));
    }
    if set.is_absolute() {
        return Ok(Some(set));
    }
    bail!(
        "{}: the run's checkpoint.dir `{}` is relative to the directory the run was started in, \
         which the run does not record ({} is missing: trained by an older lockstep); here it \
         would be {}, perhaps another run's checkpoints. Pass the checkpoint's step_N directory \
         instead (e.g. <where the run started>/{}/step_N)",
        dir.display(),
        set.display(),
        dir.join(crate::run::dir::CHECKPOINT_DIR_FILE).display(),
        std::path::absolute(&set).unwrap_or(set.clone()).display(),
        set.display()
    )
}

/// The tokenizer for a model directory: `--tokenizer`, else the built-in encoding its
/// `lockstep.json`/`trainer.json` names, else the directory's `tokenizer.json`, else the file
/// its `lockstep.json`/`trainer.json` names. None when nothing names one.
///
/// An export of a built-in encoding holds a tokenizer.json generated from it (for
/// transformers); tiktoken itself gives the same ids, faster, and its hash is the one that
/// `.tok` files prepared for the model carry.
pub fn find_tokenizer(dir: &Path, explicit: Option<&str>) -> Result<Option<Tokenizer>> {
    if let Some(spec) = explicit {
        let file = crate::data::hub::resolve_tokenizer_as("--tokenizer", spec)?;
        return Tokenizer::load(&file)
            .map(Some)
            .with_context(|| format!("--tokenizer {spec}"));
    }
    let trained = TrainedWith::read(dir)?;
    if let Some(name) = trained
        .tokenizer
        .as_deref()
        .filter(|t| BUILTIN_NAMES.contains(t))
    {
        return Tokenizer::load(name).map(Some);
    }
    let local = dir.join("tokenizer.json");
    if local.is_file() {
        return Tokenizer::load(&local.to_string_lossy()).map(Some);
    }
    match (trained.tokenizer, trained.source) {
        (Some(spec), Some(src)) => Tokenizer::load(&spec).map(Some).with_context(|| {
            format!(
                "{} names the tokenizer `{spec}`, which cannot be loaded; pass --tokenizer NAME|PATH",
                src.display()
            )
        }),
        _ => Ok(None),
    }
}

/// `--device`: auto (the first GPU when libtorch sees one), cpu, cuda or cuda:N.
pub fn parse_device(s: &str) -> Result<Device> {
    let want_cuda = |i: usize| -> Result<Device> {
        if let Err(e) = load_cuda_backend() {
            bail!("--device {s}: libtorch's CUDA backend does not load ({e}); point LD_LIBRARY_PATH at a CUDA build of torch 2.11's lib/, or use --device cpu");
        }
        if !tch::Cuda::is_available() {
            bail!("--device {s}: no CUDA device is visible to libtorch; use --device cpu");
        }
        Ok(Device::Cuda(i))
    };
    match s {
        "auto" => Ok(if cuda_available() {
            Device::Cuda(0)
        } else {
            Device::Cpu
        }),
        "cpu" => Ok(Device::Cpu),
        "cuda" => want_cuda(0),
        _ => match s.strip_prefix("cuda:").and_then(|i| i.parse().ok()) {
            Some(i) => want_cuda(i),
            None => Err(ConfigError(format!(
                "--device {s}: expected auto, cpu, cuda or cuda:N"
            )))?,
        },
    }
}

/// `--dtype` of the forward pass: fp32 or bf16 (weights stay fp32 masters, as in training).
pub fn parse_compute(s: &str) -> Result<Kind> {
    match s {
        "fp32" | "float32" => Ok(Kind::Float),
        "bf16" | "bfloat16" => Ok(Kind::BFloat16),
        _ => Err(ConfigError(format!("--dtype {s}: expected fp32 or bf16")))?,
    }
}
