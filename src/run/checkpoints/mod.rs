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

use crate::config::{OptimizerChoice, ZeroStage};
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
    /// `training.optimizer` the checkpoint's moments belong to (adamw in checkpoints from
    /// before Muon).
    #[serde(default = "adamw")]
    pub optimizer: OptimizerChoice,
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

fn adamw() -> OptimizerChoice {
    OptimizerChoice::AdamW
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

/// The suffix `--resume auto` gives a damaged checkpoint it skips (`step_N.damaged`), so the
/// run's next save of step N does not overwrite the evidence. Such a directory is no
/// checkpoint: [`list`] skips it, rotation never deletes it, [`strays`] names it.
pub const DAMAGED: &str = "damaged";

/// Directories under `root` named like checkpoints (`step_*`) that are not complete ones, each
/// with why, for the messages that say what is ignored: leftovers of an interrupted save or
/// deletion (`*.tmp`, which the next save removes), a `step_N` without trainer.json (which a
/// save writes last), a name that is not `step_<number>`, a damaged checkpoint set aside by
/// `--resume auto` (`step_N.damaged`, [`DAMAGED`]).
pub fn strays(root: &Path) -> Vec<(PathBuf, String)> {
    let Ok(entries) = fs::read_dir(root) else {
        return Vec::new();
    };
    let mut found: Vec<(PathBuf, String)> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_dir())
        .filter_map(|p| {
            let name = p.file_name()?.to_str()?.to_string();
            name.strip_prefix("step_")?;
            let why = if p.extension().is_some_and(|e| e == "tmp") {
                "a save was interrupted".to_string()
            } else if name.contains(&format!(".{DAMAGED}")) {
                "a damaged checkpoint that --resume auto set aside; delete it once you have \
                 looked at it"
                    .to_string()
            } else if step_of(&p).is_none() {
                format!(
                    "{name} is not a checkpoint name (step_<number>); move it out of \
                     checkpoint.dir"
                )
            } else if !p.join("trainer.json").is_file() {
                format!(
                    "{name} has no trainer.json, which a save writes last: its files are not a \
                     complete checkpoint (a partial copy?); complete it or move it out of \
                     checkpoint.dir"
                )
            } else {
                return None;
            };
            Some((p, why))
        })
        .collect();
    found.sort();
    found
}

/// Renames the damaged checkpoint `dir` (`step_N`) to `step_N.damaged` (`step_N.damaged.2`, …
/// when that exists), out of the way of the next save of step N; returns the new path.
pub fn set_damaged_aside(dir: &Path) -> Result<PathBuf> {
    let base = dir.as_os_str().to_os_string();
    let target = (1..)
        .map(|k| {
            let mut p = base.clone();
            p.push(format!(".{DAMAGED}"));
            if k > 1 {
                p.push(format!(".{k}"));
            }
            PathBuf::from(p)
        })
        .find(|p| !p.exists())
        .expect("some name is free");
    fs::rename(dir, &target).with_context(|| {
        format!(
            "{}: cannot rename the damaged checkpoint to {} (the next save of its step would \
             overwrite it); move it aside yourself, then --resume auto again",
            dir.display(),
            target.display()
        )
    })?;
    Ok(target)
}

/// A reader's shared hold on a checkpoint (`eval`, `generate`, `export`): a `flock(LOCK_SH)` on
/// its trainer.json, which rotation (`checkpoint.keep_last`, [`remove`]) respects: a held
/// checkpoint is kept until a later save finds it free. Released when dropped.
pub struct Hold {
    _lock: fs::File,
}

/// Holds the checkpoint `dir` for reading; None when it is gone (rotated away since it was
/// listed), so the caller picks another.
pub fn hold(dir: &Path) -> Result<Option<Hold>> {
    let path = dir.join("trainer.json");
    let file = match fs::File::open(&path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e).with_context(|| format!("{}: cannot read", path.display())),
    };
    crate::sys::flock(&file, libc::LOCK_SH)
        .with_context(|| format!("{}: cannot lock", path.display()))?;
    // Rotation renames a checkpoint before deleting it, holding LOCK_EX: once this lock is
    // granted, the checkpoint is still in place or already gone, never going.
    use std::os::unix::fs::MetadataExt;
    let (held, now) = (file.metadata()?, fs::metadata(&path));
    Ok(now
        .is_ok_and(|m| (m.dev(), m.ino()) == (held.dev(), held.ino()))
        .then_some(Hold { _lock: file }))
}

/// Deletes the checkpoint `dir` unless a reader holds it ([`hold`]): Ok(false) then, and it
/// stays. Renamed first, so a crash mid-delete leaves a `*.tmp` leftover (ignored, and removed
/// by the next save), never a `step_N` with some of its files gone.
pub fn remove(dir: &Path) -> Result<bool> {
    let fail = || format!("{}: cannot delete an old checkpoint", dir.display());
    let lock = fs::File::open(dir.join("trainer.json")).with_context(fail)?;
    match crate::sys::flock(&lock, libc::LOCK_EX | libc::LOCK_NB) {
        Err(e) if e.raw_os_error() == Some(libc::EWOULDBLOCK) => return Ok(false),
        r => r.with_context(fail)?,
    }
    let mut doomed = dir.as_os_str().to_os_string();
    doomed.push(".deleted.tmp");
    fs::rename(dir, &doomed)
        .and_then(|()| fs::remove_dir_all(&doomed))
        .with_context(fail)?;
    Ok(true)
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

/// A warning when the checkpoint `dir` was loaded without checksums: its trainer.json has no
/// `"files"` list (written by an older lockstep, or edited), so only its layout and the
/// safetensors headers were checked. None when the list is there.
pub fn unverified(dir: &Path) -> Option<String> {
    matches!(integrity::recorded(dir), Ok(None)).then(|| {
        format!(
            "{} has no checksums (no \"{}\" list: written by an older lockstep, or edited), so \
             it was loaded unverified: only its files' presence and safetensors headers were \
             checked",
            dir.join("trainer.json").display(),
            integrity::FILES_KEY
        )
    })
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
