//! A run's checkpoints as things on disk: which `step_N` directories are complete, which a
//! crash left behind, whether one can be loaded ([`verify`], `integrity`), and `trainer.json`
//! ([`TrainerState`]), the file written last that marks a checkpoint complete. The launcher
//! (restarts), the commands (export, eval, generate) and the trainer read them here; how a
//! checkpoint is written and loaded is `train::checkpoint`.

mod integrity;
pub mod reported;

use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{ensure, Context, Result};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::config::ZeroStage;
use crate::model::LlamaShape;
pub use integrity::{numbered_name, FileSum, FileSums, Layout, Scope, Share, INDEX};

/// trainer.json's `format`: what this lockstep writes and reads.
pub const FORMAT_VERSION: u32 = 1;

/// Everything besides tensors that an exact resume needs.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct TrainerState {
    pub format: u32,
    /// Optimizer steps completed.
    pub step: usize,
    /// Samples consumed globally (all ranks); with `seed` this is the whole data-order state.
    pub samples_consumed: u64,
    pub seed: u64,
    pub adam_step: u64,
    pub loss: f64,
    pub world_size: usize,
    /// Product of the rollback LR factors applied so far.
    #[serde(default = "one")]
    pub lr_scale: f64,
    /// Steps skipped or rolled back by the guard so far.
    #[serde(default)]
    pub guard_events: usize,
    pub model_shape: LlamaShape,
    /// `system.zero_stage` the checkpoint was written with (0 in checkpoints from before it).
    #[serde(default = "replicated")]
    pub zero_stage: ZeroStage,
    pub config: Value,
    pub versions: Value,
    /// What the run trained on (`run_data::data_identity`); absent in older checkpoints.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data: Option<Value>,
}

fn one() -> f64 {
    1.0
}

fn replicated() -> ZeroStage {
    ZeroStage::Replicated
}

pub fn versions() -> Value {
    serde_json::json!({ "lockstep": env!("CARGO_PKG_VERSION"), "libtorch": "2.11.0" })
}

/// N of a `step_N` directory.
pub fn step_of(path: &Path) -> Option<usize> {
    path.file_name()?
        .to_str()?
        .strip_prefix("step_")?
        .parse()
        .ok()
}

/// Complete checkpoints under `root`, oldest first.
pub fn list(root: &Path) -> Vec<(usize, PathBuf)> {
    let Ok(entries) = fs::read_dir(root) else {
        return Vec::new();
    };
    let mut found: Vec<(usize, PathBuf)> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.join("trainer.json").is_file())
        .filter_map(|p| step_of(&p).map(|s| (s, p)))
        .collect();
    found.sort();
    found
}

/// Directories a crash left behind mid-save or mid-delete (`*.tmp`), which resume ignores.
pub fn incomplete(root: &Path) -> Vec<PathBuf> {
    let Ok(entries) = fs::read_dir(root) else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.is_dir()
                && (p.extension().is_some_and(|e| e == "tmp") || !p.join("trainer.json").exists())
        })
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("step_"))
        })
        .collect()
}

/// Checks, before any state is touched, that `dir` can be loaded: trainer.json parses and is
/// of this format, every file the checkpoint's layout needs and trainer.json lists is there
/// with the recorded size, every safetensors file is whole (its header's extent is the file's
/// length), and the files of `share` have the recorded BLAKE3 (`integrity`). The error names
/// the file.
pub fn verify(dir: &Path, share: Share) -> Result<()> {
    read_state(dir)?;
    integrity::verify_files(dir, share, Scope::All)
}

/// For the commands that read a model directory (`eval`, `generate`, `export`): when it is a
/// checkpoint (it has a trainer.json), [`verify`] of its model files alone, so a damaged one is
/// named rather than sampled from. Other directories pass.
pub fn verify_model(dir: &Path) -> Result<()> {
    if !dir.join("trainer.json").is_file() {
        return Ok(());
    }
    integrity::verify_files(dir, Share::ALL, Scope::Model)
}

pub fn latest(root: &Path) -> Option<PathBuf> {
    list(root).pop().map(|(_, p)| p)
}

/// trainer.json: the state, and every other file of the checkpoint with its size and BLAKE3
/// (`integrity`).
pub fn trainer_json(state: &TrainerState, files: &FileSums) -> Result<Vec<u8>> {
    let mut v = serde_json::to_value(state)?;
    if let Value::Object(map) = &mut v {
        map.insert(integrity::FILES_KEY.into(), serde_json::to_value(files)?);
    }
    Ok(serde_json::to_vec_pretty(&v)?)
}

/// Creates `root`, the checkpoint directory (and its parents), or says which setting to change.
pub fn create_root(root: &Path) -> Result<()> {
    fs::create_dir_all(root).with_context(|| {
        format!(
            "checkpoint.dir {}: cannot create the directory; choose a writable checkpoint.dir",
            root.display()
        )
    })
}

/// Fails, with the fix, when `root` cannot hold checkpoints: creates it and a probe directory
/// in it (removed again), with the errors `save` would give. Called before the first step, it
/// reports an unwritable checkpoint.dir at start-up instead of at the first save.
pub fn check_writable(root: &Path) -> Result<()> {
    create_root(root)?;
    let probe = root.join("step_write_test.tmp");
    fs::create_dir(&probe)
        .or_else(|e| match e.kind() {
            std::io::ErrorKind::AlreadyExists => Ok(()),
            _ => Err(e),
        })
        .and_then(|()| fs::remove_dir(&probe))
        .with_context(|| {
            format!(
                "checkpoint.dir {}: cannot create {}; choose a writable checkpoint.dir",
                root.display(),
                probe.display()
            )
        })
}

pub fn read_state(dir: &Path) -> Result<TrainerState> {
    let path = dir.join("trainer.json");
    let text = fs::read_to_string(&path).with_context(|| {
        format!(
            "{}: not a complete checkpoint (no readable trainer.json)",
            dir.display()
        )
    })?;
    let state: TrainerState = serde_json::from_str(&text)
        .with_context(|| format!("{}: unreadable trainer.json", path.display()))?;
    ensure!(
        state.format == FORMAT_VERSION,
        "{}: checkpoint format {} is not supported (this lockstep reads format {FORMAT_VERSION})",
        path.display(),
        state.format
    );
    Ok(state)
}
