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
//! and rank 0 renames the directory only after every rank has reported its files durable.
//! Loading reads whatever pieces there are, so a checkpoint of N ranks at stage s resumes on M
//! ranks at stage t (`MomentFiles`).
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

use super::optim::{Adam, AdamW, Optimizer, ShardedAdamW};
use crate::config::CheckpointConfig;
use crate::dist::ProcessGroup;
use crate::model::{hf, LlamaShape};
use crate::tensor_io::{self, SafeFile};

pub const FORMAT_VERSION: u32 = 1;

/// Where and when a run saves: `checkpoint.dir` (default `<run dir>/checkpoints`), every
/// `checkpoint.interval` steps and at the end, keeping `checkpoint.keep_last`.
pub struct Checkpointer {
    root: PathBuf,
    interval: usize,
    keep_last: usize,
    /// Rank 0 writes; every rank holds the same weights and moments.
    lead: bool,
}

impl Checkpointer {
    pub fn new(root: PathBuf, cfg: &CheckpointConfig, lead: bool) -> Checkpointer {
        Checkpointer {
            root,
            interval: cfg.interval,
            keep_last: cfg.keep_last,
            lead,
        }
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Every `interval` steps (0 = never) and after the last step.
    pub fn due(&self, step: usize, last: bool) -> bool {
        last || (self.interval > 0 && step.is_multiple_of(self.interval))
    }

    /// Saves `step_N` and prunes old ones. Replicated: rank 0 writes everything and the others
    /// wait, so that no rank runs ahead of a checkpoint that might fail. Sharded: every rank
    /// writes its parts. Returns the directory on rank 0.
    pub fn save(
        &self,
        params: &[(String, Tensor)],
        opt: &Optimizer,
        state: &TrainerState,
        pg: &mut dyn ProcessGroup,
    ) -> Result<Option<PathBuf>> {
        let name = format!("step_{}", state.step);
        self.save_as(&name, params, opt, state, self.keep_last, pg)
    }

    /// A named checkpoint that pruning never deletes (the guard's `nan_step_N` evidence).
    /// Every rank calls it, like `save`.
    pub fn save_named(
        &self,
        name: &str,
        params: &[(String, Tensor)],
        opt: &Optimizer,
        state: &TrainerState,
        pg: &mut dyn ProcessGroup,
    ) -> Result<Option<PathBuf>> {
        self.save_as(name, params, opt, state, usize::MAX, pg)
    }

    fn save_as(
        &self,
        name: &str,
        params: &[(String, Tensor)],
        opt: &Optimizer,
        state: &TrainerState,
        keep_last: usize,
        pg: &mut dyn ProcessGroup,
    ) -> Result<Option<PathBuf>> {
        match &opt.adam {
            Adam::Replicated(o) => {
                let saved = if self.lead {
                    Some(save(&self.root, name, params, o, state, keep_last)?)
                } else {
                    None
                };
                pg.barrier()?;
                Ok(saved)
            }
            Adam::Sharded(o) => save_sharded(&self.root, name, o, state, keep_last, pg),
        }
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
    #[serde(default)]
    pub zero_stage: usize,
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
    hf::sync_file(path)
}

/// Saves a complete checkpoint as `root/<name>` and deletes complete ones beyond `keep_last`
/// (only `step_N` ones; named ones such as `nan_step_N` are kept). One process writes it all.
pub fn save(
    root: &Path,
    name: &str,
    params: &[(String, Tensor)],
    opt: &AdamW,
    state: &TrainerState,
    keep_last: usize,
) -> Result<PathBuf> {
    let tmp = begin_save(root, name)?;
    let written = write_contents(&tmp, params, opt, state);
    if let Err(e) = written {
        return Err(abandon(&tmp, e, &root.join(name)));
    }
    finish_save(root, name, &tmp, keep_last)
}

/// Creates `root/<name>.tmp` for a save, after removing what interrupted saves left.
fn begin_save(root: &Path, name: &str) -> Result<PathBuf> {
    fs::create_dir_all(root).with_context(|| {
        format!(
            "checkpoint.dir {}: cannot create the directory; choose a writable checkpoint.dir",
            root.display()
        )
    })?;
    let tmp = root.join(format!("{name}.tmp"));
    remove_stale(root, name)?;
    fs::create_dir(&tmp).with_context(|| {
        format!(
            "checkpoint.dir {}: cannot create {}; choose a writable checkpoint.dir",
            root.display(),
            tmp.display()
        )
    })?;
    Ok(tmp)
}

/// A failed save: no half-written directory stays behind, and the error says the earlier
/// checkpoints are intact.
fn abandon(tmp: &Path, e: anyhow::Error, final_dir: &Path) -> anyhow::Error {
    let _ = fs::remove_dir_all(tmp);
    e.context(format!(
        "saving checkpoint {} failed; earlier checkpoints are intact (fix the cause below, \
         e.g. free space in checkpoint.dir, then continue with --resume auto)",
        final_dir.display()
    ))
}

/// Makes a fully written `tmp` the checkpoint `root/<name>`, then prunes.
fn finish_save(root: &Path, name: &str, tmp: &Path, keep_last: usize) -> Result<PathBuf> {
    let final_dir = root.join(name);
    fsync_dir(tmp)?;
    // An existing directory of that name is moved aside in one rename (rename cannot replace a
    // non-empty directory), never deleted file by file under its final name.
    let replaced = root.join(format!("{name}.replaced.tmp"));
    if final_dir.exists() {
        fs::rename(&final_dir, &replaced)
            .with_context(|| format!("{}: cannot replace", final_dir.display()))?;
    }
    fs::rename(tmp, &final_dir)
        .with_context(|| format!("{}: cannot rename into place", tmp.display()))?;
    fsync_dir(root)?;
    if replaced.exists() {
        fs::remove_dir_all(&replaced)
            .with_context(|| format!("{}: cannot delete", replaced.display()))?;
    }
    prune(root, keep_last)?;
    Ok(final_dir)
}

/// The sharded save, a collective: rank 0 opens `<name>.tmp`; every rank writes its model
/// shard and optimizer piece file and fsyncs them; only when every rank reports success does
/// rank 0 write the index, config.json and trainer.json (last) and rename the directory. A kill
/// or a failure anywhere leaves at most a `*.tmp` directory that resume ignores.
fn save_sharded(
    root: &Path,
    name: &str,
    opt: &ShardedAdamW,
    state: &TrainerState,
    keep_last: usize,
    pg: &mut dyn ProcessGroup,
) -> Result<Option<PathBuf>> {
    let lead = pg.rank() == 0;
    let tmp = root.join(format!("{name}.tmp"));
    let final_dir = root.join(name);
    agree(
        pg,
        if lead {
            begin_save(root, name).map(drop)
        } else {
            Ok(())
        },
    )?;
    // Collective (the fp32 weights of a bf16 run are gathered): before anything that can fail.
    let weights = opt.checkpoint_weights(pg)?;
    let parts = ShardFiles::new(opt);
    let written = parts.write_rank(&tmp, opt, &weights);
    if let Err(e) = agree(pg, written) {
        return Err(if lead {
            abandon(&tmp, e, &final_dir)
        } else {
            e
        });
    }
    let finished = if lead {
        parts
            .write_lead(&tmp, state)
            .and_then(|()| finish_save(root, name, &tmp, keep_last))
            .map(Some)
    } else {
        Ok(None)
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
        (Err(e), _) => Err(if lead {
            abandon(&tmp, e, &final_dir)
        } else {
            e
        }),
        (Ok(_), Err(e)) => Err(e),
    }
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

/// The file names of a sharded checkpoint, derived from the layout alone so that every rank
/// agrees without talking: model shards are numbered over the ranks that write at least one
/// parameter.
struct ShardFiles {
    /// (parameter, the rank that writes it, elements), in flat order.
    params: Vec<(String, usize, usize)>,
    /// Ranks that write model tensors, ascending.
    writers: Vec<usize>,
    rank: usize,
    world: usize,
}

impl ShardFiles {
    fn new(opt: &ShardedAdamW) -> ShardFiles {
        let params: Vec<(String, usize, usize)> = opt
            .layout
            .params
            .iter()
            .map(|p| (p.name.clone(), opt.layout.writer(p), p.numel))
            .collect();
        let mut writers: Vec<usize> = params.iter().map(|(_, w, _)| *w).collect();
        writers.sort_unstable();
        writers.dedup();
        ShardFiles {
            params,
            writers,
            rank: opt.rank,
            world: opt.layout.world,
        }
    }

    fn model_file(&self, writer: usize) -> String {
        let i = self.writers.iter().position(|&w| w == writer).unwrap_or(0);
        format!(
            "model-{:05}-of-{:05}.safetensors",
            i + 1,
            self.writers.len()
        )
    }

    fn optimizer_file(&self, rank: usize) -> String {
        format!("optimizer-{:05}-of-{:05}.safetensors", rank + 1, self.world)
    }

    /// This rank's model shard (if it writes any parameter) and its optimizer pieces.
    fn write_rank(
        &self,
        dir: &Path,
        opt: &ShardedAdamW,
        weights: &[(String, Tensor)],
    ) -> Result<()> {
        if !weights.is_empty() {
            let path = dir.join(self.model_file(self.rank));
            tensor_io::save(&path, weights, Some(format_metadata()))?;
            hf::sync_file(&path)?;
        }
        let (moments, mut meta) = opt.moment_pieces();
        meta.insert("lockstep.zero_stage".into(), opt.stage.to_string());
        meta.insert("lockstep.world_size".into(), self.world.to_string());
        let path = dir.join(self.optimizer_file(self.rank));
        tensor_io::save(&path, &moments, Some(meta))?;
        hf::sync_file(&path)
    }

    /// Rank 0, once every rank's files are durable: the index, config.json, trainer.json.
    fn write_lead(&self, dir: &Path, state: &TrainerState) -> Result<()> {
        let mut map = serde_json::Map::new();
        let mut total = 0u64;
        for (name, writer, numel) in &self.params {
            map.insert(name.clone(), Value::from(self.model_file(*writer)));
            total += 4 * *numel as u64;
        }
        let index = serde_json::json!({ "metadata": { "total_size": total }, "weight_map": map });
        write_synced(
            &dir.join("model.safetensors.index.json"),
            serde_json::to_string_pretty(&index)?.as_bytes(),
        )?;
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
    opt: &mut Optimizer,
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
    let weights = hf::Weights::open(dir)?;
    let moments = MomentFiles::open(dir)?;
    tch::no_grad(|| -> Result<()> {
        for (name, var) in params {
            copy_checked(&weights, dir, name, var)?;
        }
        Ok(())
    })?;
    match &mut opt.adam {
        Adam::Replicated(o) => {
            for p in &mut o.params {
                let (m, v) = moments.read(&p.name, &(0..p.param.numel()))?;
                tch::no_grad(|| {
                    let dev = p.exp_avg.device();
                    p.exp_avg.view(-1).copy_(&m.to_device(dev));
                    p.exp_avg_sq.view(-1).copy_(&v.to_device(dev));
                });
            }
            o.step = state.adam_step;
        }
        Adam::Sharded(o) => o.load(&weights, &moments, state.adam_step)?,
    }
    Ok(state)
}

/// The AdamW moments of a checkpoint, whichever layout wrote them: `optimizer.safetensors`
/// (replicated: whole tensors) or `optimizer-0000r-of-0000N.safetensors` (sharded: one piece per
/// parameter and rank, its element range in the metadata). Any range of any parameter is read
/// from the pieces that cover it.
pub struct MomentFiles {
    dir: PathBuf,
    files: Vec<SafeFile>,
    /// Parameter → (element range, file index), sorted by range start.
    pieces: std::collections::HashMap<String, Vec<(std::ops::Range<usize>, usize)>>,
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
        let mut pieces: std::collections::HashMap<String, Vec<_>> = Default::default();
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
    pub fn read(&self, param: &str, range: &std::ops::Range<usize>) -> Result<(Tensor, Tensor)> {
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
                let both = crate::dist::zero::intersect(piece, range);
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

fn parse_range(s: &str) -> Option<std::ops::Range<usize>> {
    let (a, b) = s.split_once(':')?;
    let (a, b) = (a.parse().ok()?, b.parse().ok()?);
    (a <= b).then_some(a..b)
}

/// Copies the checkpoint's fp32 `name` into `dst` (converting to its dtype), after checking it.
fn copy_checked(weights: &hf::Weights, dir: &Path, name: &str, dst: &Tensor) -> Result<()> {
    ensure!(
        weights.contains(name),
        "{}: missing tensor {name}",
        dir.display()
    );
    let src = weights.tensor(name)?;
    ensure!(
        src.size() == dst.size() && src.kind() == Kind::Float,
        "{}: tensor {name} is {:?} {:?}, expected {:?} Float",
        dir.display(),
        src.kind(),
        src.size(),
        dst.size()
    );
    dst.shallow_clone().copy_(&src.to_device(dst.device()));
    Ok(())
}
