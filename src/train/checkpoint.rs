//! Checkpoints: one directory per step,
//!
//! ```text
//! step_N/
//!   model.safetensors      parameters under Hugging Face names (fp32 master weights)
//!   config.json            transformers config, so the directory is also an HF model
//!   optimizer.safetensors  AdamW moments: <param>.exp_avg, <param>.exp_avg_sq
//!   trainer.json           step, sampler state, optimizer step, model shape, resolved config
//! ```
//!
//! Written into `step_N.tmp/`, every file fsynced, then renamed and the parent fsynced: a
//! directory named `step_N` is always complete. `trainer.json` is written last, so it doubles as
//! the completeness marker for directories copied by other tools. Old checkpoints are renamed to
//! `step_N.deleted.tmp` before they are deleted, and a replaced one to `step_N.replaced.tmp`, so a
//! crash at any moment leaves only complete `step_N` directories and `*.tmp` leftovers, which
//! resume ignores and the next save removes (tests/crash_safety.rs kills a run 100 times to
//! check this).

use std::fs::{self, File};
use std::path::{Path, PathBuf};

use anyhow::{bail, ensure, Context, Result};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tch::{Kind, Tensor};

use super::optim::AdamW;
use crate::model::{hf, LlamaShape};
use crate::tensor_io::{self, SafeFile};

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
    pub config: Value,
    pub versions: Value,
}

fn one() -> f64 {
    1.0
}

pub fn versions() -> Value {
    serde_json::json!({ "lockstep": env!("CARGO_PKG_VERSION"), "libtorch": "2.11.0" })
}

fn step_of(path: &Path) -> Option<usize> {
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

pub fn latest(root: &Path) -> Option<PathBuf> {
    list(root).pop().map(|(_, p)| p)
}

fn fsync_dir(dir: &Path) -> Result<()> {
    File::open(dir)
        .and_then(|f| f.sync_all())
        .with_context(|| format!("{}: cannot fsync directory", dir.display()))
}

fn write_synced(path: &Path, bytes: &[u8]) -> Result<()> {
    fs::write(path, bytes).with_context(|| format!("{}: cannot write", path.display()))?;
    File::open(path)
        .and_then(|f| f.sync_all())
        .with_context(|| format!("{}: cannot fsync", path.display()))
}

/// Saves a complete checkpoint as `root/<name>` and deletes complete ones beyond `keep_last`
/// (only `step_N` ones; named ones such as `nan_step_N` are kept).
pub fn save(
    root: &Path,
    name: &str,
    params: &[(String, Tensor)],
    opt: &AdamW,
    state: &TrainerState,
    keep_last: usize,
) -> Result<PathBuf> {
    fs::create_dir_all(root).with_context(|| {
        format!(
            "checkpoint.dir {}: cannot create the directory; choose a writable checkpoint.dir",
            root.display()
        )
    })?;
    let final_dir = root.join(name);
    let tmp = root.join(format!("{name}.tmp"));
    remove_stale(root, name)?;
    fs::create_dir(&tmp).with_context(|| {
        format!(
            "checkpoint.dir {}: cannot create {}; choose a writable checkpoint.dir",
            root.display(),
            tmp.display()
        )
    })?;
    let written = write_contents(&tmp, params, opt, state);
    if let Err(e) = written {
        // Leave the previous checkpoints untouched and no half-written directory behind.
        let _ = fs::remove_dir_all(&tmp);
        return Err(e.context(format!(
            "saving checkpoint {} failed; earlier checkpoints are intact (fix the cause below, \
             e.g. free space in checkpoint.dir, then continue with --resume auto)",
            final_dir.display()
        )));
    }
    fsync_dir(&tmp)?;
    // An existing directory of that name is moved aside in one rename (rename cannot replace a
    // non-empty directory), never deleted file by file under its final name.
    let replaced = root.join(format!("{name}.replaced.tmp"));
    if final_dir.exists() {
        fs::rename(&final_dir, &replaced)
            .with_context(|| format!("{}: cannot replace", final_dir.display()))?;
    }
    fs::rename(&tmp, &final_dir)
        .with_context(|| format!("{}: cannot rename into place", tmp.display()))?;
    fsync_dir(root)?;
    if replaced.exists() {
        fs::remove_dir_all(&replaced)
            .with_context(|| format!("{}: cannot delete", replaced.display()))?;
    }
    prune(root, keep_last)?;
    Ok(final_dir)
}

/// Fails, with the fix, when `root` cannot hold checkpoints: creates it and a probe directory
/// in it (removed again), with the errors `save` would give. Called before the first step, it
/// reports an unwritable checkpoint.dir at start-up instead of at the first save.
pub fn check_writable(root: &Path) -> Result<()> {
    fs::create_dir_all(root).with_context(|| {
        format!(
            "checkpoint.dir {}: cannot create the directory; choose a writable checkpoint.dir",
            root.display()
        )
    })?;
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

/// Deletes what interrupted saves and deletions left (`step_*.tmp`, `<name>.tmp`): only one
/// process (rank 0) writes a checkpoint directory, so none of them is in use.
fn remove_stale(root: &Path, name: &str) -> Result<()> {
    for entry in fs::read_dir(root)
        .with_context(|| format!("checkpoint.dir {}: cannot list", root.display()))?
    {
        let path = entry?.path();
        let Some(file) = path.file_name().and_then(|n| n.to_str()) else {
            continue;
        };
        let stale = file.ends_with(".tmp")
            && (file.starts_with("step_") || file.starts_with(&format!("{name}.")));
        if stale && path.is_dir() {
            fs::remove_dir_all(&path).with_context(|| {
                format!("{}: cannot remove a stale partial save", path.display())
            })?;
        }
    }
    Ok(())
}

fn write_contents(
    dir: &Path,
    params: &[(String, Tensor)],
    opt: &AdamW,
    state: &TrainerState,
) -> Result<()> {
    let model_path = dir.join("model.safetensors");
    tensor_io::save(&model_path, params, Some(format_metadata()))?;
    File::open(&model_path)?.sync_all()?;
    let config = hf::config_json(&state.model_shape, "float32");
    write_synced(
        &dir.join("config.json"),
        serde_json::to_string_pretty(&config)?.as_bytes(),
    )?;

    let mut moments = Vec::with_capacity(2 * opt.params.len());
    for p in &opt.params {
        moments.push((format!("{}.exp_avg", p.name), p.exp_avg.shallow_clone()));
        moments.push((
            format!("{}.exp_avg_sq", p.name),
            p.exp_avg_sq.shallow_clone(),
        ));
    }
    let opt_path = dir.join("optimizer.safetensors");
    tensor_io::save(&opt_path, &moments, None)?;
    File::open(&opt_path)?.sync_all()?;
    write_synced(
        &dir.join("trainer.json"),
        serde_json::to_string_pretty(state)?.as_bytes(),
    )
}

fn format_metadata() -> std::collections::HashMap<String, String> {
    // transformers checks this key to accept the file as PyTorch weights.
    [("format".to_string(), "pt".to_string())]
        .into_iter()
        .collect()
}

fn prune(root: &Path, keep_last: usize) -> Result<()> {
    let all = list(root);
    let excess = all.len().saturating_sub(keep_last);
    for (_, path) in all.into_iter().take(excess) {
        // Renamed first, so a crash mid-delete leaves a `*.tmp` leftover (ignored, and removed
        // by the next save), never a `step_N` with some of its files gone.
        let mut doomed = path.clone().into_os_string();
        doomed.push(".deleted.tmp");
        fs::rename(&path, &doomed)
            .and_then(|()| fs::remove_dir_all(&doomed))
            .with_context(|| format!("{}: cannot delete an old checkpoint", path.display()))?;
    }
    Ok(())
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

/// Restores parameters and moments from `dir` after checking that the checkpoint's model shape
/// is the one being trained.
pub fn load(
    dir: &Path,
    shape: &LlamaShape,
    params: &[(String, Tensor)],
    opt: &mut AdamW,
) -> Result<TrainerState> {
    let state = read_state(dir)?;
    if &state.model_shape != shape {
        let saved = serde_json::to_value(&state.model_shape)?;
        let now = serde_json::to_value(shape)?;
        let diffs: Vec<String> = now
            .as_object()
            .into_iter()
            .flatten()
            .filter(|(k, v)| saved.get(k.as_str()) != Some(v))
            .map(|(k, v)| {
                format!(
                    "{k}: checkpoint {} vs config {v}",
                    saved.get(k.as_str()).unwrap_or(&Value::Null)
                )
            })
            .collect();
        bail!(
            "{}: the checkpoint is of another model shape ({}); resume with the config it was trained with",
            dir.display(),
            diffs.join(", ")
        );
    }
    let model = SafeFile::open(&dir.join("model.safetensors"))?;
    let moments = SafeFile::open(&dir.join("optimizer.safetensors"))?;
    tch::no_grad(|| -> Result<()> {
        for (name, var) in params {
            copy_checked(&model, name, var)?;
        }
        for p in &mut opt.params {
            copy_checked(&moments, &format!("{}.exp_avg", p.name), &p.exp_avg)?;
            copy_checked(&moments, &format!("{}.exp_avg_sq", p.name), &p.exp_avg_sq)?;
        }
        Ok(())
    })?;
    opt.step = state.adam_step;
    Ok(state)
}

fn copy_checked(file: &SafeFile, name: &str, dst: &Tensor) -> Result<()> {
    ensure!(
        file.contains(name),
        "{}: missing tensor {name}",
        file.path().display()
    );
    let src = file.tensor(name)?;
    ensure!(
        src.size() == dst.size() && src.kind() == Kind::Float,
        "{}: tensor {name} is {:?} {:?}, expected {:?} Float",
        file.path().display(),
        src.kind(),
        src.size(),
        dst.size()
    );
    dst.shallow_clone().copy_(&src.to_device(dst.device()));
    Ok(())
}
