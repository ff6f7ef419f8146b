//! Checkpoints: one directory per step. Replicated training (`system.zero_stage = 0`):
//!
//! ```text
//! step_N/
//!   model.safetensors      parameters under Hugging Face names (fp32 master weights)
//!   config.json            transformers config, so the directory is also an HF model
//!   optimizer.safetensors  AdamW moments: <param>.exp_avg, <param>.exp_avg_sq
//!   trainer.json           step, sampler state, optimizer step, model shape, resolved config
//! ```
//!
//! With a sharded optimizer (`system.zero_stage` ≥ 1) every rank writes its own parts:
//!
//! ```text
//!   model-0000i-of-0000K.safetensors   the parameters whose first element rank i-1 owns (fp32),
//!   model.safetensors.index.json       so the directory stays one Hugging Face model
//!   optimizer-0000r-of-0000N.safetensors  rank r's moments: one 1-D piece per parameter, with
//!                                      its element range "start:end" under the parameter's
//!                                      name in the file's metadata
//! ```
//!
//! (With hybrid sharding, `system.shard_degree`, the first shard group writes them; the other
//! groups hold the same state.) What each rank writes comes from the optimizer
//! (`Optimizer::state`, `Optimizer::writers`),
//! and loading hands the optimizer a [`Checkpoint`] to read from (`Optimizer::load`): this
//! module names files and keeps them safe, and never looks inside the optimizer. Loading reads
//! whatever pieces there are, so a checkpoint of N ranks at stage s resumes on M ranks at
//! stage t (`MomentFiles`).
//!
//! One protocol for every layout (a collective): rank 0 opens `step_N.tmp/`
//! (`sys::durable::AtomicDir`); every rank writes and fsyncs its files; only when every rank
//! reports success does rank 0 write the index, config.json and trainer.json (last, so it
//! doubles as the completeness marker for directories copied by other tools) and rename the
//! directory. A directory named `step_N` is always complete. Old checkpoints are renamed to
//! `step_N.deleted.tmp` before they are deleted, and a replaced one to `step_N.replaced.tmp`, so
//! a crash at any moment leaves only complete `step_N` directories and `*.tmp` leftovers, which
//! resume ignores and the next save removes (tests/crash_safety.rs kills a run 100 times to
//! check this).

use std::collections::HashMap;
use std::fs;
use std::ops::Range;
use std::path::{Path, PathBuf};

use anyhow::{bail, ensure, Context, Result};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tch::{Kind, Tensor};

use super::optim::{Optimizer, RankState, StateSource, Writers};
use crate::config::{CheckpointConfig, ZeroStage};
use crate::dist::flat_layout::intersect;
use crate::dist::ProcessGroup;
use crate::model::{hf, LlamaShape};
use crate::sys::durable::{write_synced, AtomicDir};
use crate::tensor_io::{self, SafeFile};

pub const FORMAT_VERSION: u32 = 1;

/// Where and when a run saves: `checkpoint.dir` (default `<run dir>/checkpoints`), every
/// `checkpoint.interval` steps and at the end, keeping `checkpoint.keep_last`.
pub struct Checkpointer {
    root: PathBuf,
    interval: usize,
    keep_last: usize,
}

impl Checkpointer {
    pub fn new(root: PathBuf, cfg: &CheckpointConfig) -> Checkpointer {
        Checkpointer {
            root,
            interval: cfg.interval,
            keep_last: cfg.keep_last,
        }
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Every `interval` steps (0 = never) and after the last step.
    pub fn due(&self, step: usize, last: bool) -> bool {
        last || (self.interval > 0 && step.is_multiple_of(self.interval))
    }

    /// Saves `step_N` and prunes old ones; every rank calls it. Returns the directory on
    /// rank 0.
    pub fn save(
        &self,
        opt: &Optimizer,
        state: &TrainerState,
        pg: &mut dyn ProcessGroup,
    ) -> Result<Option<PathBuf>> {
        let name = format!("step_{}", state.step);
        save(&self.root, &name, opt, state, self.keep_last, pg)
    }

    /// A named checkpoint that pruning never deletes (the guard's `nan_step_N` evidence).
    /// Every rank calls it, like `save`.
    pub fn save_named(
        &self,
        name: &str,
        opt: &Optimizer,
        state: &TrainerState,
        pg: &mut dyn ProcessGroup,
    ) -> Result<Option<PathBuf>> {
        save(&self.root, name, opt, state, usize::MAX, pg)
    }

    /// The latest complete `step_N`, if any.
    pub fn latest(&self) -> Option<PathBuf> {
        latest(&self.root)
    }
}

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

/// Saves `root/<name>` and deletes complete checkpoints beyond `keep_last` (only `step_N`
/// ones; named ones such as `nan_step_N` are kept): the collective protocol of the module docs.
/// Returns the directory on rank 0.
fn save(
    root: &Path,
    name: &str,
    opt: &Optimizer,
    state: &TrainerState,
    keep_last: usize,
    pg: &mut dyn ProcessGroup,
) -> Result<Option<PathBuf>> {
    let dest = root.join(name);
    let staging = if pg.rank() == 0 {
        Some(begin_save(root, &dest))
    } else {
        None
    }
    .transpose();
    let staging = match staging {
        Ok(s) => {
            agree(pg, Ok(()))?;
            s
        }
        Err(e) => return Err(agree(pg, Err(e)).expect_err("a failure stays one")),
    };
    // Collective (the fp32 weights of a bf16 or stage-3 run are gathered): before anything
    // that can fail on one rank only.
    let mine = opt.state(pg)?;
    let files = Files {
        writers: opt.writers(),
    };
    let written = files.write_rank(&AtomicDir::staging_of(&dest), &mine);
    if let Err(e) = agree(pg, written) {
        return Err(match staging {
            Some(s) => abandon(s, e),
            None => e,
        });
    }
    let finished = match staging {
        Some(s) => finish_save(s, &files, state, root, keep_last).map(Some),
        None => Ok(None),
    };
    let ok = agree(
        pg,
        finished
            .as_ref()
            .map(drop)
            .map_err(|e| anyhow::anyhow!("{e:#}")),
    );
    match (finished, ok) {
        (Ok(dir), Ok(())) => Ok(dir),
        (Err(e), _) | (Ok(_), Err(e)) => Err(e),
    }
}

/// Rank 0: creates `root` and the staging directory of `dest`, after removing what
/// interrupted saves left.
fn begin_save(root: &Path, dest: &Path) -> Result<AtomicDir> {
    fs::create_dir_all(root).with_context(|| {
        format!(
            "checkpoint.dir {}: cannot create the directory; choose a writable checkpoint.dir",
            root.display()
        )
    })?;
    let name = dest.file_name().and_then(|n| n.to_str()).unwrap_or("");
    remove_stale(root, name)?;
    AtomicDir::begin(dest).with_context(|| {
        format!(
            "checkpoint.dir {}: cannot start {}; choose a writable checkpoint.dir",
            root.display(),
            dest.display()
        )
    })
}

/// A failed save: no half-written directory stays behind, and the error says the earlier
/// checkpoints are intact.
fn abandon(staging: AtomicDir, e: anyhow::Error) -> anyhow::Error {
    let dest = staging.dest().to_path_buf();
    staging.abandon();
    e.context(format!(
        "saving checkpoint {} failed; earlier checkpoints are intact (fix the cause below, \
         e.g. free space in checkpoint.dir, then continue with --resume auto)",
        dest.display()
    ))
}

/// Rank 0, once every rank's files are durable: the index, config.json and trainer.json, the
/// rename into place, then pruning.
fn finish_save(
    staging: AtomicDir,
    files: &Files,
    state: &TrainerState,
    root: &Path,
    keep_last: usize,
) -> Result<PathBuf> {
    if let Err(e) = files.write_lead(staging.path(), state) {
        return Err(abandon(staging, e));
    }
    let dir = staging.commit()?;
    prune(root, keep_last)?;
    Ok(dir)
}

/// Every rank learns whether every rank succeeded; a failure elsewhere is an error here too,
/// so all ranks leave the save together.
fn agree(pg: &mut dyn ProcessGroup, mine: Result<()>) -> Result<()> {
    let failed = pg.all_reduce_max_f64(if mine.is_err() { 1.0 } else { 0.0 })?;
    mine?;
    ensure!(
        failed == 0.0,
        "another rank could not write its part of the checkpoint (its log says why); earlier \
         checkpoints are intact"
    );
    Ok(())
}

/// The file names of a checkpoint, from the optimizer's [`Writers`]: replicated, one model and
/// one optimizer file; sharded, model shards numbered over the ranks that write at least one
/// parameter, and one optimizer file per rank.
struct Files {
    writers: Writers,
}

impl Files {
    /// Ranks that write model tensors, ascending.
    fn model_writers(&self) -> Vec<usize> {
        let mut w: Vec<usize> = self.writers.params.iter().map(|(_, w, _)| *w).collect();
        w.sort_unstable();
        w.dedup();
        w
    }

    fn model_file(&self, writer: usize) -> String {
        if !self.writers.sharded {
            return "model.safetensors".into();
        }
        let writers = self.model_writers();
        let i = writers.iter().position(|&w| w == writer).unwrap_or(0);
        format!("model-{:05}-of-{:05}.safetensors", i + 1, writers.len())
    }

    fn optimizer_file(&self, rank: usize) -> String {
        if !self.writers.sharded {
            return "optimizer.safetensors".into();
        }
        format!(
            "optimizer-{:05}-of-{:05}.safetensors",
            rank + 1,
            self.writers.world
        )
    }

    /// This rank's model file (if it writes any parameter) and its optimizer file, if it
    /// writes at all.
    fn write_rank(&self, dir: &Path, mine: &RankState) -> Result<()> {
        let Some(rank) = self.writers.this else {
            return Ok(());
        };
        if !mine.weights.is_empty() {
            let path = dir.join(self.model_file(rank));
            tensor_io::save(&path, &mine.weights, Some(format_metadata()))?;
            crate::sys::durable::sync_file(&path)?;
        }
        let mut tensors = Vec::with_capacity(2 * mine.moments.len());
        let mut meta = HashMap::new();
        for piece in &mine.moments {
            tensors.push((
                format!("{}.exp_avg", piece.name),
                piece.exp_avg.shallow_clone(),
            ));
            tensors.push((
                format!("{}.exp_avg_sq", piece.name),
                piece.exp_avg_sq.shallow_clone(),
            ));
            meta.insert(
                piece.name.clone(),
                format!("{}:{}", piece.range.start, piece.range.end),
            );
        }
        let meta = self.writers.sharded.then(|| {
            meta.insert("lockstep.zero_stage".into(), self.writers.stage.to_string());
            meta.insert("lockstep.world_size".into(), self.writers.world.to_string());
            meta
        });
        let path = dir.join(self.optimizer_file(rank));
        tensor_io::save(&path, &tensors, meta)?;
        crate::sys::durable::sync_file(&path)
    }

    /// Rank 0, once every rank's files are durable: the index (sharded), config.json and
    /// trainer.json (last).
    fn write_lead(&self, dir: &Path, state: &TrainerState) -> Result<()> {
        if self.writers.sharded {
            let mut map = serde_json::Map::new();
            let mut total = 0u64;
            for (name, writer, numel) in &self.writers.params {
                map.insert(name.clone(), Value::from(self.model_file(*writer)));
                total += 4 * *numel as u64;
            }
            let index =
                serde_json::json!({ "metadata": { "total_size": total }, "weight_map": map });
            write_synced(
                &dir.join("model.safetensors.index.json"),
                serde_json::to_string_pretty(&index)?.as_bytes(),
            )?;
        }
        let config = hf::config_json(&state.model_shape, "float32");
        write_synced(
            &dir.join("config.json"),
            serde_json::to_string_pretty(&config)?.as_bytes(),
        )?;
        write_synced(
            &dir.join("trainer.json"),
            serde_json::to_string_pretty(state)?.as_bytes(),
        )
    }
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

fn format_metadata() -> HashMap<String, String> {
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

/// Restores the optimizer's parameters, masters and moments from `dir` (any stage, any
/// world size) after checking that the checkpoint's model shape is the one being trained.
pub fn load(dir: &Path, shape: &LlamaShape, opt: &mut Optimizer) -> Result<TrainerState> {
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
    let ckpt = Checkpoint {
        dir: dir.to_path_buf(),
        weights: hf::Weights::open(dir)?,
        moments: MomentFiles::open(dir)?,
    };
    opt.load(&ckpt, state.adam_step)?;
    Ok(state)
}

/// A checkpoint's tensors, as the optimizer reads them back.
struct Checkpoint {
    dir: PathBuf,
    weights: hf::Weights,
    moments: MomentFiles,
}

impl StateSource for Checkpoint {
    fn weight(&self, name: &str, shape: &[i64]) -> Result<Tensor> {
        ensure!(
            self.weights.contains(name),
            "{}: missing tensor {name}",
            self.dir.display()
        );
        let src = self.weights.tensor(name)?;
        ensure!(
            src.size() == shape && src.kind() == Kind::Float,
            "{}: tensor {name} is {:?} {:?}, expected {shape:?} Float",
            self.dir.display(),
            src.kind(),
            src.size(),
        );
        Ok(src)
    }

    fn moments(&self, name: &str, range: &Range<usize>) -> Result<(Tensor, Tensor)> {
        self.moments.read(name, range)
    }
}

/// The AdamW moments of a checkpoint, whichever layout wrote them: `optimizer.safetensors`
/// (replicated: whole tensors) or `optimizer-0000r-of-0000N.safetensors` (sharded: one piece per
/// parameter and rank, its element range in the metadata). Any range of any parameter is read
/// from the pieces that cover it.
pub struct MomentFiles {
    dir: PathBuf,
    files: Vec<SafeFile>,
    /// Parameter → (element range, file index), sorted by range start.
    pieces: HashMap<String, Vec<(Range<usize>, usize)>>,
}

impl MomentFiles {
    pub fn open(dir: &Path) -> Result<MomentFiles> {
        let mut paths: Vec<PathBuf> = fs::read_dir(dir)
            .with_context(|| format!("{}: cannot list", dir.display()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| {
                p.file_name().and_then(|n| n.to_str()).is_some_and(|n| {
                    n == "optimizer.safetensors"
                        || (n.starts_with("optimizer-") && n.ends_with(".safetensors"))
                })
            })
            .collect();
        paths.sort();
        ensure!(
            !paths.is_empty(),
            "{}: no optimizer state (optimizer.safetensors or optimizer-*-of-*.safetensors); not a complete checkpoint",
            dir.display()
        );
        let mut files = Vec::new();
        let mut pieces: HashMap<String, Vec<_>> = Default::default();
        for (i, path) in paths.iter().enumerate() {
            let f = SafeFile::open(path)?;
            let meta = f.metadata()?;
            for tensor in f.names() {
                let Some(param) = tensor.strip_suffix(".exp_avg") else {
                    continue;
                };
                let numel = f.shape(&tensor)?.iter().product::<i64>() as usize;
                let range = match meta.get(param) {
                    Some(r) => parse_range(r).with_context(|| {
                        format!("{}: bad piece range {r:?} for {param}", path.display())
                    })?,
                    None => 0..numel,
                };
                ensure!(
                    range.len() == numel,
                    "{}: piece {param} holds {numel} elements, its range {range:?} says {}",
                    path.display(),
                    range.len()
                );
                pieces
                    .entry(param.to_string())
                    .or_default()
                    .push((range, i));
            }
            files.push(f);
        }
        for list in pieces.values_mut() {
            list.sort_by_key(|(r, _)| r.start);
        }
        Ok(MomentFiles {
            dir: dir.to_path_buf(),
            files,
            pieces,
        })
    }

    /// (exp_avg, exp_avg_sq) of elements `range` of `param` (flattened), as 1-D fp32 CPU
    /// tensors; an error names what is missing when the pieces do not cover the range.
    pub fn read(&self, param: &str, range: &Range<usize>) -> Result<(Tensor, Tensor)> {
        let missing = || {
            anyhow::anyhow!(
                "{}: the optimizer files hold no moments for elements {range:?} of {param}; \
                 the checkpoint is incomplete (was every rank's optimizer-*-of-*.safetensors copied?)",
                self.dir.display()
            )
        };
        let list = self.pieces.get(param).ok_or_else(missing)?;
        let out = |suffix: &str| -> Result<Tensor> {
            let t = Tensor::zeros([range.len() as i64], (Kind::Float, tch::Device::Cpu));
            let mut covered = 0;
            for (piece, file) in list {
                let both = intersect(piece, range);
                if both.is_empty() {
                    continue;
                }
                let src = self.files[*file].tensor(&format!("{param}{suffix}"))?;
                ensure!(
                    src.kind() == Kind::Float,
                    "{param}{suffix}: moments must be fp32"
                );
                let part =
                    src.view(-1)
                        .narrow(0, (both.start - piece.start) as i64, both.len() as i64);
                t.narrow(0, (both.start - range.start) as i64, both.len() as i64)
                    .copy_(&part);
                covered += both.len();
            }
            ensure!(covered == range.len(), missing());
            Ok(t)
        };
        Ok((out(".exp_avg")?, out(".exp_avg_sq")?))
    }
}

fn parse_range(s: &str) -> Option<Range<usize>> {
    let (a, b) = s.split_once(':')?;
    let (a, b) = (a.parse().ok()?, b.parse().ok()?);
    (a <= b).then_some(a..b)
}
