//! Checkpoints: one directory per step. One rank (`system.zero_stage = 0` on one process):
//!
//! ```text
//! step_N/
//!   model.safetensors      parameters under Hugging Face names (fp32 master weights)
//!   config.json            transformers config, so the directory is also an HF model
//!   optimizer.safetensors  the optimizer's moments: <param>.exp_avg, <param>.exp_avg_sq
//!                          (AdamW), <param>.momentum_buffer (Muon's matrices)
//!   trainer.json           step, sampler state, optimizer step, model shape, resolved config
//! ```
//!
//! With more than one rank every rank writes its own part, at every zero stage, so write
//! bandwidth grows with the ranks:
//!
//! ```text
//!   model-0000i-of-0000K.safetensors   the parameters writer i-1 writes (fp32): sharded, those
//!                                      whose first element its slice holds; replicated, a
//!                                      contiguous 1/N of the parameters in HF order
//!   model.safetensors.index.json       so the directory stays one Hugging Face model
//!   optimizer-0000r-of-0000N.safetensors  rank r's moments: 1-D pieces of the parameters
//!                                      (flattened), each with its element range "start:end"
//!                                      in the file's metadata under the parameter's name; a
//!                                      parameter's further pieces in the same file are
//!                                      `<param>.exp_avg@k` (`.momentum_buffer@k`, ...) with
//!                                      their range under `<param>@k`
//! ```
//!
//! (With tensor parallelism, `system.tensor_parallel`, the files are the same: the optimizer
//! hands over whole weights and pieces of the whole parameters — a column-split weight's rows
//! interleave the ranks' parts, so its pieces come several to a file.)
//!
//! (With hybrid sharding, `system.shard_degree`, the first shard group writes them; the other
//! groups hold the same state.) What each rank writes comes from the optimizer
//! (`Optimizer::state`, `Optimizer::writers`), and loading hands the optimizer a [`Checkpoint`]
//! to read from (`Optimizer::load`): this module names files and keeps them safe, and never
//! looks inside the optimizer. Loading reads the byte ranges a rank needs from memory maps, so
//! a checkpoint of N ranks at stage s resumes on M ranks at stage t (`MomentFiles`).
//!
//! One protocol for every layout (`writer::SaveJob`): rank 0 opens `step_N.tmp/`
//! (`sys::durable::AtomicDir`); every rank writes and fsyncs its files and reports to rank 0
//! through the rendezvous store; only when every rank reports success does rank 0 write the
//! index, config.json and trainer.json (last, so it doubles as the completeness marker for
//! directories copied by other tools) and rename the directory. A directory named `step_N` is
//! always complete. Old checkpoints are renamed to `step_N.deleted.tmp` before they are
//! deleted, and a replaced one to `step_N.replaced.tmp`, so a crash at any moment leaves only
//! complete `step_N` directories and `*.tmp` leftovers, which resume ignores and the next save
//! removes (tests/crash_safety.rs kills runs to check this).
//!
//! With `checkpoint.async` (the default) a save copies what the rank writes into host buffers
//! kept between saves and returns; a writer thread runs the same protocol from the copies. One
//! save is in flight at a time: the next save, the end of training, a guard event and a
//! rollback first wait for it on every rank ([`Checkpointer::settle`]); a failure of the
//! writer is noticed at the next step (`Checkpointer::poll`, agreed in the step's all-reduce)
//! and fails the run with the writer's error.

mod writer;

use std::collections::HashMap;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use serde_json::Value;
use tch::{Kind, Tensor};

use super::optim::{Optimizer, RankState, StateSource, Writers, MOMENT_KEYS};
use crate::config::CheckpointConfig;
use crate::dist::flat_layout::intersect;
use crate::dist::store::Store;
use crate::dist::ProcessGroup;
use crate::model::{hf, LlamaShape};
use crate::run::checkpoints::{self, numbered_name, TrainerState, INDEX};
use crate::tensor_io::SafeFile;
pub use writer::Keep;
use writer::{Commit, FileJob, GiveUp, Reports, SaveJob, Staging};

/// Where and when a run saves: `checkpoint.dir` (default `<run dir>/checkpoints`), every
/// `checkpoint.interval` steps and at the end, keeping `checkpoint.keep_last` and every
/// `checkpoint.keep_every`-th; in the background with `checkpoint.async`.
pub struct Checkpointer {
    root: PathBuf,
    interval: usize,
    keep: Keep,
    background: bool,
    tag: String,
    rank: usize,
    world: usize,
    /// The checkpointer's own connection to the rendezvous store and its key namespace; None
    /// for a single process.
    store: Option<(Arc<Store>, String)>,
    /// Saves started so far (the same count on every rank).
    seq: u64,
    staging: Staging,
    in_flight: Option<InFlight>,
    /// What the last finished background save gave, not yet agreed on by [`Self::settle`].
    finished: Option<Result<()>>,
    /// The latest checkpoint this run committed (rank 0).
    last: Option<PathBuf>,
    /// The fall-back to synchronous saves has been announced.
    said_sync: bool,
    /// Ends the writer's waits for other ranks when the run stops with an error.
    give_up: Arc<GiveUp>,
    /// `debug.save_report_delay_ms`.
    report_delay: Duration,
}

/// A save being written by the writer thread.
struct InFlight {
    name: String,
    started: Instant,
    handle: JoinHandle<Result<Option<PathBuf>>>,
}

impl Checkpointer {
    /// Every rank creates it, from the group it trains with (whose store carries the
    /// writers' reports).
    pub fn new(
        root: PathBuf,
        cfg: &CheckpointConfig,
        tag: &str,
        pg: &dyn ProcessGroup,
    ) -> Result<Checkpointer> {
        let store = match pg.side_store() {
            Some((shared, ns)) if pg.world_size() > 1 => {
                let own = Store::client(shared.host(), shared.port(), shared.timeout())
                    .context("the checkpoint writer's connection to the rendezvous store")?;
                Some((Arc::new(own), format!("{ns}ckpt/")))
            }
            None if pg.world_size() > 1 => {
                bail!("internal: a process group of several ranks without a store")
            }
            _ => None,
        };
        Ok(Checkpointer {
            root,
            interval: cfg.interval,
            keep: Keep {
                last: cfg.keep_last,
                every: cfg.keep_every,
            },
            background: cfg.background,
            tag: tag.to_string(),
            rank: pg.rank(),
            world: pg.world_size(),
            store,
            seq: 0,
            staging: Staging::default(),
            in_flight: None,
            finished: None,
            last: None,
            said_sync: false,
            give_up: Arc::default(),
            report_delay: Duration::ZERO,
        })
    }

    /// `debug.save_report_delay_ms`: every save's reports (rank 0: its commit) wait `ms`.
    pub fn delay_reports(mut self, ms: usize) -> Checkpointer {
        self.report_delay = Duration::from_millis(ms as u64);
        self
    }

    /// Waits until this rank's part of the save in flight, if any, is written and reported
    /// (`debug.fault = exit_after_save`); its outcome is kept for `poll`/`settle`. Returns
    /// whether a save was in flight.
    pub fn wait_written(&mut self) -> bool {
        let in_flight = self.in_flight.is_some();
        self.harvest();
        in_flight
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Every `interval` steps (0 = never) and after the last step.
    pub fn due(&self, step: usize, last: bool) -> bool {
        last || (self.interval > 0 && step.is_multiple_of(self.interval))
    }

    /// The latest complete `step_N`, if any.
    pub fn latest(&self) -> Option<PathBuf> {
        checkpoints::latest(&self.root)
    }

    /// The latest checkpoint this run has committed (rank 0; None on the others).
    pub fn last_saved(&self) -> Option<&Path> {
        self.last.as_deref()
    }

    /// The step of [`Checkpointer::last_saved`].
    pub fn last_saved_step(&self) -> Option<usize> {
        self.last.as_deref().and_then(checkpoints::step_of)
    }

    /// Saves `step_N` (every rank calls it) and prunes old ones. Returns whether training
    /// paused for the whole write (a synchronous save) rather than only for a copy.
    pub fn save(
        &mut self,
        opt: &Optimizer,
        state: &TrainerState,
        pg: &mut dyn ProcessGroup,
    ) -> Result<bool> {
        let started = Instant::now();
        let name = format!("step_{}", state.step);
        let waited = self.settle(pg)?;
        if waited > 0.5 && self.rank == 0 {
            // A regular save that waits means saves take longer than the interval.
            let advice = if self.interval > 0 && state.step.is_multiple_of(self.interval) {
                " (saves take longer than checkpoint.interval steps; raise it or use faster \
                 storage)"
            } else {
                ""
            };
            println!(
                "{} Checkpoint {name}: waited {waited:.1} s for the previous save to finish \
                 writing{advice}",
                self.tag
            );
        }
        let job = self.job(&name, opt, state, self.keep, pg)?;
        if self.background && self.stage_fits(&job, &name, pg)? {
            let files = self.staging.copy(job.files);
            let job = SaveJob { files, ..job };
            self.in_flight = Some(InFlight {
                name: name.clone(),
                started: Instant::now(),
                handle: std::thread::Builder::new()
                    .name("checkpoint-writer".into())
                    .spawn(move || {
                        crate::sys::lower_thread_priority();
                        job.run()
                    })
                    .context("cannot start the checkpoint writer thread")?,
            });
            if self.rank == 0 {
                println!(
                    "{} Checkpoint {name}: staged in {:.2} s; writing in the background",
                    self.tag,
                    started.elapsed().as_secs_f64()
                );
            }
            return Ok(false);
        }
        let dir = self.run_here(job, pg)?;
        if let Some(dir) = dir {
            println!(
                "{} Checkpoint saved: {} ({:.2} s)",
                self.tag,
                dir.display(),
                started.elapsed().as_secs_f64()
            );
        }
        Ok(true)
    }

    /// A named checkpoint that pruning never deletes (the guard's `nan_step_N` evidence),
    /// written synchronously. Every rank calls it, like `save`. Returns the directory on
    /// rank 0.
    pub fn save_named(
        &mut self,
        name: &str,
        opt: &Optimizer,
        state: &TrainerState,
        pg: &mut dyn ProcessGroup,
    ) -> Result<Option<PathBuf>> {
        self.settle(pg)?;
        let keep = Keep {
            last: usize::MAX,
            every: 0,
        };
        let job = self.job(name, opt, state, keep, pg)?;
        self.run_here(job, pg)
    }

    /// Whether a background save has failed on this rank (noticed without waiting); the
    /// step's all-reduce shares it, so every rank stops at the same step
    /// ([`Self::failure`]). A save that finished well is announced here.
    pub fn poll(&mut self) -> bool {
        if self
            .in_flight
            .as_ref()
            .is_some_and(|f| f.handle.is_finished())
        {
            self.harvest();
        }
        matches!(self.finished, Some(Err(_)))
    }

    /// The error to stop with once some rank's background save failed: this rank's own, or
    /// (waiting for this rank's writer, which ends once the failed rank has reported) the
    /// one that says another rank's log has the cause.
    pub fn failure(&mut self) -> anyhow::Error {
        self.harvest();
        match self.finished.take() {
            Some(Err(e)) => e,
            _ => anyhow::anyhow!(
                "another rank's background checkpoint write failed (its log says why); \
                 earlier checkpoints are intact; fix the cause, then continue with --resume auto"
            ),
        }
    }

    /// Waits until the save in flight, if any, is written and committed on every rank (a
    /// collective: every rank calls it at the same point), then fails if it failed anywhere.
    /// Returns the seconds this rank waited.
    pub fn settle(&mut self, pg: &mut dyn ProcessGroup) -> Result<f64> {
        let t = Instant::now();
        self.harvest();
        let waited = t.elapsed().as_secs_f64();
        let mine = self.finished.take().unwrap_or(Ok(()));
        if self.world > 1 || mine.is_err() {
            agree(pg, mine)?;
        }
        Ok(waited)
    }

    /// Joins a save in flight (waiting for it) and keeps its outcome for `poll`/`settle`.
    fn harvest(&mut self) {
        let Some(f) = self.in_flight.take() else {
            return;
        };
        let outcome = f
            .handle
            .join()
            .unwrap_or_else(|_| Err(anyhow::anyhow!("the checkpoint writer thread panicked")))
            .with_context(|| format!("background save of checkpoint {}", f.name));
        self.finished = Some(match outcome {
            Ok(dir) => {
                if let Some(dir) = dir {
                    println!(
                        "{} Checkpoint saved: {} (written in the background in {:.2} s)",
                        self.tag,
                        dir.display(),
                        f.started.elapsed().as_secs_f64()
                    );
                    self.last = Some(dir);
                }
                Ok(())
            }
            Err(e) => Err(e),
        });
    }

    /// This rank's part of saving `root/<name>`: the optimizer's state (a collective where
    /// fp32 masters are gathered), as files, and on rank 0 the files that complete it.
    fn job(
        &mut self,
        name: &str,
        opt: &Optimizer,
        state: &TrainerState,
        keep: Keep,
        pg: &mut dyn ProcessGroup,
    ) -> Result<SaveJob> {
        let mine = opt.state(pg)?;
        let files = Files {
            writers: opt.writers(),
        };
        let commit = (self.rank == 0)
            .then(|| -> Result<Commit> {
                Ok(Commit {
                    lead: files.lead(&state.model_shape)?,
                    state: state.clone(),
                    keep,
                })
            })
            .transpose()?;
        self.seq += 1;
        let reports = self.store.as_ref().map(|(store, ns)| {
            Reports::new(
                store.clone(),
                format!("{ns}{}/", self.seq),
                self.rank,
                self.world,
                self.give_up.clone(),
            )
        });
        Ok(SaveJob {
            root: self.root.clone(),
            dest: self.root.join(name),
            files: files.rank_files(&mine),
            commit,
            reports,
            report_delay: self.report_delay,
        })
    }

    /// A save on the training thread, agreed on by every rank. Returns the directory on
    /// rank 0.
    fn run_here(&mut self, job: SaveJob, pg: &mut dyn ProcessGroup) -> Result<Option<PathBuf>> {
        let done = job.run();
        let outcome = done
            .as_ref()
            .map(drop)
            .map_err(|e| anyhow::anyhow!("{e:#}"));
        agree(pg, outcome)?;
        let dir = done?;
        if dir.is_some() {
            self.last.clone_from(&dir);
        }
        Ok(dir)
    }

    /// Whether this save can be staged in host memory: the buffers exist from an earlier
    /// save, or the host has room for them. Every rank decides the same (a save is staged on
    /// all ranks or none); a refusal is said once.
    fn stage_fits(&mut self, job: &SaveJob, name: &str, pg: &mut dyn ProcessGroup) -> Result<bool> {
        let need = self.staging.new_bytes(&job.files) as f64;
        let avail = crate::sys::machine::mem_available().unwrap_or(f64::INFINITY);
        let fits_here = need == 0.0 || need + crate::plan::checkpoint::STAGING_HEADROOM < avail;
        let fits = pg.all_reduce_max_f64(if fits_here { 0.0 } else { 1.0 })? == 0.0;
        if !fits && !self.said_sync {
            self.said_sync = true;
            let why = if fits_here {
                "another rank's host has no room for its copy".to_string()
            } else {
                format!(
                    "its copy in host memory needs {:.2} GB and the host has {:.2} GB available",
                    need / 1e9,
                    avail / 1e9
                )
            };
            println!(
                "{} Checkpoint {name}: saving synchronously (checkpoint.async): {why}",
                self.tag
            );
        }
        Ok(fits)
    }
}

/// A run that ends with an error (a failed step, an out-of-memory, a lost rank) while a save
/// is written in the background lets the save finish, or fail cleanly, before the process
/// exits: this rank's files are completed, and rank 0 commits if every rank reports within a
/// grace period, else removes `step_N.tmp`. A rank that died without reporting (its beat
/// stopped, `writer::Reports`) ends the wait within seconds. (Without the wait the writer
/// would still run while the process tears libtorch down.)
impl Drop for Checkpointer {
    fn drop(&mut self) {
        if let Some(f) = self.in_flight.take() {
            self.give_up.after(Duration::from_secs(30));
            if let Ok(Ok(Some(dir))) = f.handle.join() {
                println!(
                    "{} Checkpoint saved: {} (written in the background in {:.2} s)",
                    self.tag,
                    dir.display(),
                    f.started.elapsed().as_secs_f64()
                );
            }
        }
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

/// The file names of a checkpoint, from the optimizer's [`Writers`]: one rank, one model and
/// one optimizer file; several, model shards numbered over the ranks that write at least one
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
        numbered_name("model", i + 1, writers.len())
    }

    fn optimizer_file(&self, rank: usize) -> String {
        if !self.writers.sharded {
            return "optimizer.safetensors".into();
        }
        numbered_name("optimizer", rank + 1, self.writers.world)
    }

    /// This rank's model file (if it writes any parameter) and its optimizer file, if it
    /// writes at all.
    fn rank_files(&self, mine: &RankState) -> Vec<FileJob> {
        let Some(rank) = self.writers.this else {
            return Vec::new();
        };
        let mut files = Vec::with_capacity(2);
        if !mine.weights.is_empty() {
            files.push(FileJob {
                name: self.model_file(rank),
                tensors: mine
                    .weights
                    .iter()
                    .map(|(n, t)| (n.clone(), t.shallow_clone()))
                    .collect(),
                meta: Some(format_metadata()),
            });
        }
        let mut tensors = Vec::with_capacity(2 * mine.moments.len());
        let mut meta = HashMap::new();
        // Pieces of one parameter so far: the first is `<param>`, the next `<param>@1`, ...
        let mut seen: HashMap<&str, usize> = HashMap::new();
        for piece in &mine.moments {
            let k = seen.entry(piece.name.as_str()).or_insert(0);
            let (key, suffix) = match *k {
                0 => (piece.name.clone(), String::new()),
                k => (format!("{}@{k}", piece.name), format!("@{k}")),
            };
            *k += 1;
            for (moment, t) in &piece.moments {
                tensors.push((
                    format!("{}.{moment}{suffix}", piece.name),
                    t.shallow_clone(),
                ));
            }
            meta.insert(key, format!("{}:{}", piece.range.start, piece.range.end));
        }
        let meta = self.writers.sharded.then(|| {
            meta.insert("lockstep.zero_stage".into(), self.writers.stage.to_string());
            meta.insert("lockstep.world_size".into(), self.writers.world.to_string());
            meta
        });
        files.push(FileJob {
            name: self.optimizer_file(rank),
            tensors,
            meta,
        });
        files
    }

    /// Rank 0's files besides trainer.json, written once every rank's are durable: the index
    /// (several writers) and config.json.
    fn lead(&self, shape: &LlamaShape) -> Result<Vec<(&'static str, Vec<u8>)>> {
        let mut files = Vec::with_capacity(3);
        if self.writers.sharded {
            let mut map = serde_json::Map::new();
            let mut total = 0u64;
            for (name, writer, numel) in &self.writers.params {
                map.insert(name.clone(), Value::from(self.model_file(*writer)));
                total += 4 * *numel as u64;
            }
            let index =
                serde_json::json!({ "metadata": { "total_size": total }, "weight_map": map });
            files.push((INDEX, serde_json::to_vec_pretty(&index)?));
        }
        let config = hf::config_json(shape, "float32");
        files.push(("config.json", serde_json::to_vec_pretty(&config)?));
        Ok(files)
    }
}

fn format_metadata() -> HashMap<String, String> {
    // transformers checks this key to accept the file as PyTorch weights.
    [("format".to_string(), "pt".to_string())]
        .into_iter()
        .collect()
}

/// Restores the optimizer's parameters, masters and moments from `dir` (any stage, any
/// world size) after checking that the checkpoint's model shape is the one being trained;
/// with `weights_only` (`training.reset_optimizer`) its parameters and masters alone.
pub fn load(
    dir: &Path,
    shape: &LlamaShape,
    opt: &mut Optimizer,
    weights_only: bool,
) -> Result<TrainerState> {
    let state = checkpoints::read_state(dir)?;
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
    opt.load(&ckpt, state.adam_step, weights_only)?;
    Ok(state)
}

/// A checkpoint's tensors, as the optimizer reads them back.
struct Checkpoint {
    dir: PathBuf,
    weights: hf::Weights,
    moments: MomentFiles,
}

impl Checkpoint {
    /// Fails unless the checkpoint holds `name` with `shape`; then its elements `range`
    /// (flattened), or all of it with its shape, checked to be fp32.
    fn fp32(&self, name: &str, shape: &[i64], range: Option<&Range<usize>>) -> Result<Tensor> {
        ensure!(
            self.weights.contains(name),
            "{}: missing tensor {name}",
            self.dir.display()
        );
        let stored = self.weights.shape(name)?;
        ensure!(
            stored == shape,
            "{}: tensor {name} is {stored:?}, expected {shape:?}",
            self.dir.display(),
        );
        let src = match range {
            Some(r) => self.weights.elements(name, r)?,
            None => self.weights.tensor(name)?,
        };
        ensure!(
            src.kind() == Kind::Float,
            "{}: tensor {name} is {:?}, expected Float",
            self.dir.display(),
            src.kind()
        );
        let what = format_args!("{}: {name}", self.dir.display());
        crate::tensor_io::ensure_finite(&src, what, RESUME_ELSEWHERE)?;
        Ok(src)
    }
}

/// What to do about a checkpoint whose weights or moments are not finite.
const RESUME_ELSEWHERE: &str = "the checkpoint is damaged; resume from an earlier one with \
     --resume DIR, or move this one aside and use --resume auto";

impl StateSource for Checkpoint {
    fn weight(&self, name: &str, shape: &[i64]) -> Result<Tensor> {
        self.fp32(name, shape, None)
    }

    fn weight_range(&self, name: &str, shape: &[i64], range: &Range<usize>) -> Result<Tensor> {
        self.fp32(name, shape, Some(range))
    }

    fn moment(&self, name: &str, key: &str, range: &Range<usize>) -> Result<Tensor> {
        self.moments.read(name, key, range)
    }
}

/// The optimizer's moments of a checkpoint, whichever layout wrote them:
/// `optimizer.safetensors` (replicated: whole tensors) or
/// `optimizer-0000r-of-0000N.safetensors` (sharded: one piece per parameter and rank, its
/// element range in the metadata), each piece holding its parameter's moments under their
/// keys (`MOMENT_KEYS`: AdamW's exp_avg and exp_avg_sq, Muon's momentum_buffer). Any range of
/// any parameter is read from the pieces that cover it.
pub struct MomentFiles {
    dir: PathBuf,
    files: Vec<SafeFile>,
    /// Parameter → its pieces, sorted by range start.
    pieces: HashMap<String, Vec<StoredPiece>>,
}

/// One piece of a parameter's moments in an optimizer file.
struct StoredPiece {
    /// The elements of the parameter (flattened) it covers.
    range: Range<usize>,
    /// Which of the checkpoint's optimizer files holds it.
    file: usize,
    /// `@k` for a parameter's further pieces in one file, else "".
    suffix: String,
    /// Its moments' keys (`MOMENT_KEYS`).
    keys: Vec<&'static str>,
}

impl MomentFiles {
    /// The optimizer files of the checkpoint's layout (every one of them).
    pub fn open(dir: &Path) -> Result<MomentFiles> {
        let paths: Vec<PathBuf> = checkpoints::Layout::of(dir)?
            .optimizer
            .iter()
            .map(|name| dir.join(name))
            .collect();
        let mut files = Vec::new();
        let mut pieces: HashMap<String, Vec<_>> = Default::default();
        for (i, path) in paths.iter().enumerate() {
            let f = SafeFile::open(path)?;
            let meta = f.metadata()?;
            // (parameter, suffix) → the piece, each moment checked against its range.
            let mut found: HashMap<(String, String), StoredPiece> = HashMap::new();
            for tensor in f.names() {
                let (stem, suffix) = match tensor.rsplit_once('@') {
                    Some((stem, k)) if k.parse::<usize>().is_ok() => (stem, format!("@{k}")),
                    _ => (tensor.as_str(), String::new()),
                };
                let Some((param, key)) = MOMENT_KEYS.iter().find_map(|&k| {
                    let param = stem.strip_suffix(k)?.strip_suffix('.')?;
                    Some((param, k))
                }) else {
                    continue;
                };
                let numel = f.shape(&tensor)?.iter().product::<i64>() as usize;
                let range = match meta.get(&format!("{param}{suffix}")) {
                    Some(r) => parse_range(r).with_context(|| {
                        format!("{}: bad piece range {r:?} for {param}", path.display())
                    })?,
                    None => 0..numel,
                };
                ensure!(
                    range.len() == numel,
                    "{}: piece {tensor} holds {numel} elements, its range {range:?} says {}",
                    path.display(),
                    range.len()
                );
                found
                    .entry((param.to_string(), suffix.clone()))
                    .or_insert_with(|| StoredPiece {
                        range,
                        file: i,
                        suffix,
                        keys: Vec::new(),
                    })
                    .keys
                    .push(key);
            }
            for ((param, _), piece) in found {
                pieces.entry(param).or_default().push(piece);
            }
            files.push(f);
        }
        for list in pieces.values_mut() {
            list.sort_by_key(|p| p.range.start);
        }
        Ok(MomentFiles {
            dir: dir.to_path_buf(),
            files,
            pieces,
        })
    }

    /// The moments the checkpoint holds for `param` (their keys, in `MOMENT_KEYS` order).
    pub fn keys(&self, param: &str) -> Vec<&'static str> {
        let held = |k: &&str| {
            self.pieces
                .get(param)
                .is_some_and(|l| l.iter().any(|p| p.keys.contains(k)))
        };
        MOMENT_KEYS.into_iter().filter(held).collect()
    }

    /// Moment `key` of elements `range` of `param` (flattened), as a 1-D fp32 CPU tensor; an
    /// error names what is missing when the pieces do not cover the range.
    pub fn read(&self, param: &str, key: &str, range: &Range<usize>) -> Result<Tensor> {
        let missing = || {
            let held = self.keys(param);
            let written_by = if held.is_empty() || held.contains(&key) {
                String::new()
            } else {
                format!(
                    " (it holds {}: another optimizer wrote it; see training.reset_optimizer)",
                    held.join(", ")
                )
            };
            anyhow::anyhow!(
                "{}: the optimizer files hold no {key} for elements {range:?} of {param}{written_by}; \
                 the checkpoint is incomplete (was every rank's optimizer-*-of-*.safetensors copied?)",
                self.dir.display()
            )
        };
        let list = self.pieces.get(param).ok_or_else(missing)?;
        let t = Tensor::zeros([range.len() as i64], (Kind::Float, tch::Device::Cpu));
        let mut covered = 0;
        for piece in list {
            let both = intersect(&piece.range, range);
            if both.is_empty() || !piece.keys.contains(&key) {
                continue;
            }
            // Only the bytes of the elements asked for are read from the map.
            let within = both.start - piece.range.start..both.end - piece.range.start;
            let tensor = format!("{param}.{key}{}", piece.suffix);
            let part = self.files[piece.file].elements(&tensor, &within)?;
            ensure!(part.kind() == Kind::Float, "{tensor}: moments must be fp32");
            let path = self.files[piece.file].path();
            let what = format_args!("{}: {tensor}", path.display());
            crate::tensor_io::ensure_finite(&part, what, RESUME_ELSEWHERE)?;
            t.narrow(0, (both.start - range.start) as i64, both.len() as i64)
                .copy_(&part);
            covered += both.len();
        }
        ensure!(covered == range.len(), missing());
        Ok(t)
    }

    /// Every moment the checkpoint holds for elements `range` of `param`, by key.
    pub fn read_all(
        &self,
        param: &str,
        range: &Range<usize>,
    ) -> Result<Vec<(&'static str, Tensor)>> {
        let keys = self.keys(param);
        ensure!(
            !keys.is_empty(),
            "{}: no moments of {param}",
            self.dir.display()
        );
        keys.into_iter()
            .map(|k| Ok((k, self.read(param, k, range)?)))
            .collect()
    }
}

fn parse_range(s: &str) -> Option<Range<usize>> {
    let (a, b) = s.split_once(':')?;
    let (a, b) = (a.parse().ok()?, b.parse().ok()?);
    (a <= b).then_some(a..b)
}
