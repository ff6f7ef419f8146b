//! How one save is carried out. A [`SaveJob`] is one rank's part of one checkpoint: its files
//! and, on rank 0, what completes the directory. It runs the same way on the training thread
//! (a synchronous save, from the live tensors) and on the writer thread (`checkpoint.async`,
//! from the host copies in [`Staging`]), so both write the same bytes. Ranks tell rank 0
//! through the rendezvous store, under keys of their own ([`Reports`]), that their files are
//! durable or why not: the commit needs no collective of the training group.
//!
//! Keys of save number `seq` (the same on every rank: saves are collective):
//!
//! ```text
//!   <ns>ckpt/<seq>/start   rank 0: "ok" once step_N.tmp/ exists, else "error:<why>"
//!   <ns>ckpt/<seq>/rank<r>  rank r ≥ 1: "ok:<its files' sizes and BLAKE3, JSON>" once its
//!                           files are fsynced, else "error:<why>"
//!   <ns>ckpt/<seq>/beat<r>  rank r: a counter moved every 0.5 s while its part is outstanding
//! ```
//!
//! The beats matter only once the run is ending with an error ([`GiveUp`]): a rank that was
//! killed (SIGKILL, the OOM killer, its node lost) never reports, and its stopped beat lets the
//! others abandon the save within seconds instead of holding the exit for the whole grace.
//!
//! The same reports are left in the staging directory (`run::checkpoints::reported`), so a
//! save every rank finished is committed by the next start when rank 0 was killed before its
//! commit.
//!
//! Each rank hashes a file right after writing it, while its pages are still cached (on the
//! writer thread for a background save), and rank 0 records every file's checksum in
//! trainer.json (`integrity`).

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use tch::{Device, Tensor};

use crate::dist::store::Store;
use crate::run::checkpoints::{self, reported, FileSum, FileSums, TrainerState};
use crate::sys::durable::{sync_and_release, AtomicDir};
use crate::tensor_io;

/// Which complete `step_N` checkpoints survive a save: the last `last`, and those whose step
/// is a multiple of `every` (0 = none).
#[derive(Debug, Clone, Copy)]
pub struct Keep {
    pub last: usize,
    pub every: usize,
}

/// One safetensors file of a checkpoint.
pub(super) struct FileJob {
    /// File name inside the checkpoint directory.
    pub name: String,
    pub tensors: Vec<(String, Tensor)>,
    pub meta: Option<HashMap<String, String>>,
}

impl FileJob {
    /// Writes, hashes (while the pages are cached) and fsyncs the file.
    fn write(&self, dir: &Path) -> Result<(String, FileSum)> {
        let path = dir.join(&self.name);
        tensor_io::save(&path, &self.tensors, self.meta.clone())?;
        let sum = FileSum::of_file(&path)?;
        sync_and_release(&path)?;
        Ok((self.name.clone(), sum))
    }
}

/// Rank 0's files that complete a checkpoint once every rank's are durable: `lead` (the index,
/// config.json), then trainer.json from `state` with every file's checksum (last: it marks
/// the directory complete); and which old checkpoints to keep afterwards.
pub(super) struct Commit {
    pub lead: Vec<(&'static str, Vec<u8>)>,
    pub state: TrainerState,
    pub keep: Keep,
}

/// One rank's part of saving `dest` under `root`.
pub(super) struct SaveJob {
    pub root: PathBuf,
    pub dest: PathBuf,
    pub files: Vec<FileJob>,
    /// Rank 0 only.
    pub commit: Option<Commit>,
    /// None for a single process.
    pub reports: Option<Reports>,
    /// `debug.save_report_delay_ms`: a wait between writing this rank's files and reporting
    /// them (rank 0: between the last report and the commit).
    pub report_delay: Duration,
}

impl SaveJob {
    /// Rank 0 opens `<dest>.tmp/`; every rank writes and fsyncs its files there; rank 0,
    /// once every rank has reported success, writes its own files and renames the directory
    /// into place (returning it). Any failure leaves no `dest` and the earlier checkpoints
    /// as they were.
    pub fn run(mut self) -> Result<Option<PathBuf>> {
        let rank = self.reports.as_ref().map_or(0, |r| r.rank);
        let world = self.reports.as_ref().map_or(1, |r| r.world);
        let staging = match &self.commit {
            Some(c) => {
                let begun = begin_save(&self.root, &self.dest).and_then(|dir| {
                    reported::write_intent(dir.path(), world, &c.state, &c.lead)?;
                    Ok(dir)
                });
                if let Some(r) = &self.reports {
                    r.set("start", begun.as_ref().map(|_| String::new()))?;
                }
                Some(begun?)
            }
            None => {
                let r = self.reports.as_ref().expect("ranks beyond 0 report");
                r.wait("start", 0).map_err(|e| {
                    e.context(format!(
                        "rank 0 could not start checkpoint {}",
                        self.dest.display()
                    ))
                })?;
                None
            }
        };
        let dir = AtomicDir::staging_of(&self.dest);
        let written = self
            .files
            .iter()
            .map(|f| f.write(&dir))
            .collect::<Result<FileSums>>()
            .and_then(|sums| {
                if rank > 0 {
                    std::thread::sleep(self.report_delay);
                }
                reported::write_report(&dir, rank, &sums)?;
                Ok(sums)
            });
        let (Some(staging), Some(commit)) = (staging, self.commit) else {
            let mut r = self.reports.expect("ranks beyond 0 report");
            let report = written
                .as_ref()
                .map(|sums| serde_json::to_string(sums).expect("checksums serialize"));
            // The last beat before the report, so rank 0 can delete the key after reading it.
            r.beat = None;
            r.set(&format!("rank{}", r.rank), report)?;
            return written.map(|_| None);
        };
        // The other ranks' reports are awaited even when this rank's own write failed: they
        // may still be writing into the staging directory, which must not be removed under
        // them (their files would outlive it as a stray `step_N.tmp`).
        let others = match &mut self.reports {
            Some(r) => r.wait_ranks(),
            None => Ok(FileSums::new()),
        };
        let sums = match (written, others) {
            (Ok(mut mine), Ok(others)) => {
                mine.extend(others);
                mine
            }
            (Err(e), _) | (_, Err(e)) => return Err(abandon(staging, e)),
        };
        std::thread::sleep(self.report_delay);
        finish_save(staging, commit, sums, world, &self.root).map(Some)
    }
}

/// How often a rank moves its beat while its part of a save is outstanding.
const BEAT: Duration = Duration::from_millis(500);
/// A rank whose beat has stopped for this long is taken as dead: it will never report. Once the
/// run is ending with an error, so is one that never beat.
const BEAT_LOST: Duration = Duration::from_secs(3);

/// A rank's channel to rank 0 for one save: keys under `prefix` in the rendezvous store,
/// through a connection of the checkpointer's own.
pub(super) struct Reports {
    store: Arc<Store>,
    prefix: String,
    rank: usize,
    world: usize,
    /// Set when the run ends with an error while this save is in flight: waits for other
    /// ranks give up then (a rank that failed may never report).
    give_up: Arc<GiveUp>,
    /// This rank's `beat<r>`, from the moment the save is decided until its report (rank 0:
    /// until every report is in).
    beat: Option<Beat>,
}

/// A thread that moves a counter under `key` every [`BEAT`] (on a thread of its own: a write
/// can block in fsync for long); stopped and joined on drop.
struct Beat {
    stop: Option<mpsc::Sender<()>>,
    handle: Option<JoinHandle<()>>,
}

impl Beat {
    /// None when no thread can be started: the rank then only loses its early abandon.
    fn start(store: Arc<Store>, key: String) -> Option<Beat> {
        let (stop, stopped) = mpsc::channel::<()>();
        let handle = std::thread::Builder::new()
            .name("checkpoint-beat".into())
            .spawn(move || {
                for n in 1u64.. {
                    // A store that is gone is noticed by the waits: stop beating then.
                    if store.set(&key, n.to_string().as_bytes()).is_err()
                        || !matches!(stopped.recv_timeout(BEAT), Err(RecvTimeoutError::Timeout))
                    {
                        return;
                    }
                }
            })
            .ok()?;
        Some(Beat {
            stop: Some(stop),
            handle: Some(handle),
        })
    }
}

impl Drop for Beat {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

/// A deadline for a writer's waits on other ranks, set from the training thread.
#[derive(Default)]
pub(super) struct GiveUp(std::sync::Mutex<Option<Instant>>);

impl GiveUp {
    pub fn after(&self, grace: Duration) {
        if let Ok(mut d) = self.0.lock() {
            *d = Some(Instant::now() + grace);
        }
    }

    fn passed(&self) -> bool {
        self.0
            .lock()
            .map(|d| d.is_some_and(|d| Instant::now() > d))
            .unwrap_or(true)
    }

    /// Whether the run is ending with an error (the deadline is set).
    fn armed(&self) -> bool {
        self.0.lock().map(|d| d.is_some()).unwrap_or(true)
    }
}

impl Reports {
    /// Rank `rank`'s channel for save keys under `prefix`; its beat starts now.
    pub fn new(
        store: Arc<Store>,
        prefix: String,
        rank: usize,
        world: usize,
        give_up: Arc<GiveUp>,
    ) -> Reports {
        let beat = Beat::start(store.clone(), format!("{prefix}beat{rank}"));
        Reports {
            store,
            prefix,
            rank,
            world,
            give_up,
            beat,
        }
    }

    /// Longest wait for another rank's report: writes of a large checkpoint to slow storage
    /// take minutes; a rank that died is noticed by the launcher long before this.
    const PATIENCE: Duration = Duration::from_secs(3600);

    /// Reports `what`: done (with what to tell rank 0), or failed.
    fn set(&self, what: &str, outcome: std::result::Result<String, &anyhow::Error>) -> Result<()> {
        let value = match outcome {
            Ok(told) if told.is_empty() => "ok".to_string(),
            Ok(told) => format!("ok:{told}"),
            Err(e) => format!("error:{e:#}"),
        };
        self.store
            .set(&format!("{}{what}", self.prefix), value.as_bytes())
    }

    /// Waits for `what` to be reported by rank `from` and returns what it told (empty for
    /// none), or its error. A `from` whose beat stopped ends the wait within [`BEAT_LOST`]: a
    /// rank killed after the step's collectives, while its part was written, leaves its peers
    /// in no collective that would notice (the two-host test's hang in a full run here: rank 0
    /// waited for the report at the next save, for [`Self::PATIENCE`]). One that never beat
    /// ends it only once the run is ending with an error: a rank not yet at the save fails a
    /// collective first.
    fn wait(&self, what: &str, from: usize) -> Result<String> {
        let key = format!("{}{what}", self.prefix);
        let beat_key = format!("{}beat{from}", self.prefix);
        let started = Instant::now();
        // `from`'s beat as last read, and since when it has not moved; tracked once armed.
        let mut beat: Option<(Option<Vec<u8>>, Instant)> = None;
        let mut next_look = started;
        while !self.store.check(&[&key])? {
            if self.give_up.passed() {
                bail!("abandoned: the run stopped with an error before rank reports came in");
            }
            let now = Instant::now();
            if now >= next_look {
                next_look = now + BEAT / 2;
                let current = match self.store.check(&[&beat_key])? {
                    true => Some(self.store.get(&beat_key)?),
                    false => None,
                };
                match &mut beat {
                    Some((seen, since)) if *seen == current => {
                        let lost = seen.is_some() || self.give_up.armed();
                        if lost && now.duration_since(*since) > BEAT_LOST {
                            bail!(
                                "abandoned: rank {from} ended before it reported (no sign of it \
                                 for {} s: killed, or out of memory)",
                                BEAT_LOST.as_secs()
                            );
                        }
                    }
                    _ => beat = Some((current, now)),
                }
            }
            if started.elapsed() > Self::PATIENCE {
                bail!(
                    "no report {key:?} after {} s; is every rank still running?",
                    Self::PATIENCE.as_secs()
                );
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        let value = self.store.get(&key)?;
        let value = String::from_utf8_lossy(&value);
        match value.strip_prefix("error:") {
            Some(why) => bail!("{why}"),
            None => Ok(value.strip_prefix("ok:").unwrap_or("").to_string()),
        }
    }

    /// Rank 0: every other rank's report, with the checksums of the files it wrote; an error
    /// names each rank that failed.
    fn wait_ranks(&mut self) -> Result<FileSums> {
        let mut failed = Vec::new();
        let mut sums = FileSums::new();
        for r in 1..self.world {
            let told = self.wait(&format!("rank{r}"), r).and_then(|told| {
                serde_json::from_str::<FileSums>(&told)
                    .with_context(|| format!("internal: rank {r}'s checksums {told:?}"))
            });
            match told {
                Ok(theirs) => sums.extend(theirs),
                Err(e) => failed.push(format!("rank {r}: {e:#}")),
            }
        }
        // Every rank has read `start` before reporting: nothing of this save is read again.
        self.beat = None;
        let keys = (1..self.world)
            .map(|r| format!("rank{r}"))
            .chain((0..self.world).map(|r| format!("beat{r}")));
        for what in std::iter::once("start".to_string()).chain(keys) {
            let _ = self.store.delete(&format!("{}{what}", self.prefix));
        }
        if !failed.is_empty() {
            bail!(
                "another rank could not write its part of the checkpoint ({})",
                failed.join("; ")
            );
        }
        Ok(sums)
    }
}

/// Host copies of what a rank writes, kept between saves (the shapes do not change), so an
/// asynchronous save allocates once and then only copies. Pinned when the tensors live on a
/// GPU, so the device-to-host copy runs at full speed.
#[derive(Default)]
pub(super) struct Staging {
    /// "<file>/<tensor>" → its host copy.
    buffers: HashMap<String, Tensor>,
}

impl Staging {
    /// Bytes that staging `files` would allocate anew (0 once the buffers exist).
    pub fn new_bytes(&self, files: &[FileJob]) -> u64 {
        files
            .iter()
            .flat_map(|f| {
                f.tensors
                    .iter()
                    .map(move |(n, t)| (format!("{}/{n}", f.name), t))
            })
            .filter(|(key, t)| !self.buffers.get(key).is_some_and(|b| same_layout(b, t)))
            .map(|(_, t)| (t.numel() * t.kind().elt_size_in_bytes()) as u64)
            .sum()
    }

    /// `files` with every tensor replaced by its host copy, made now.
    pub fn copy(&mut self, files: Vec<FileJob>) -> Vec<FileJob> {
        files
            .into_iter()
            .map(|f| {
                let tensors = f
                    .tensors
                    .iter()
                    .map(|(n, t)| {
                        let key = format!("{}/{n}", f.name);
                        let buf = self
                            .buffers
                            .entry(key)
                            .and_modify(|b| {
                                if !same_layout(b, t) {
                                    *b = host_buffer(t);
                                }
                            })
                            .or_insert_with(|| host_buffer(t));
                        tch::no_grad(|| buf.copy_(t));
                        (n.clone(), buf.shallow_clone())
                    })
                    .collect();
                FileJob { tensors, ..f }
            })
            .collect()
    }
}

fn same_layout(buf: &Tensor, t: &Tensor) -> bool {
    buf.size() == t.size() && buf.kind() == t.kind()
}

fn host_buffer(t: &Tensor) -> Tensor {
    let buf = Tensor::empty(t.size(), (t.kind(), Device::Cpu));
    match t.device() {
        Device::Cuda(i) => buf.pin_memory(Device::Cuda(i)),
        _ => buf,
    }
}

/// Rank 0: creates `root` and the staging directory of `dest`, after removing what
/// interrupted saves left.
fn begin_save(root: &Path, dest: &Path) -> Result<AtomicDir> {
    checkpoints::create_root(root)?;
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

/// Rank 0, once every rank's files are durable (`sums`: what each wrote): its own files, then
/// trainer.json listing every file with its checksum, the rename into place, then pruning.
fn finish_save(
    staging: AtomicDir,
    commit: Commit,
    sums: FileSums,
    world: usize,
    root: &Path,
) -> Result<PathBuf> {
    let lead = commit.lead.iter().map(|(n, b)| (*n, b.as_slice()));
    let written = reported::complete(staging.path(), world, &commit.state, lead, sums);
    if let Err(e) = written {
        return Err(abandon(staging, e));
    }
    let dir = staging.commit()?;
    prune(root, commit.keep)?;
    Ok(dir)
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

/// Deletes the checkpoints `keep` does not keep, but none a reader holds (`eval`, `generate`
/// or `export` reading it: `checkpoints::hold`); a later save deletes those once they are free.
fn prune(root: &Path, keep: Keep) -> Result<()> {
    let all = checkpoints::list(root);
    let excess = all.len().saturating_sub(keep.last);
    let kept_forever = |step: usize| keep.every > 0 && step.is_multiple_of(keep.every);
    for (_, path) in all
        .into_iter()
        .take(excess)
        .filter(|(s, _)| !kept_forever(*s))
    {
        checkpoints::remove(&path)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: Duration = Duration::from_secs(20);

    /// Rank 0's and rank 1's channels for one save, on a store of their own; `give_up` armed
    /// with a 60 s grace, as a run that ends with an error arms it, when `armed`.
    fn pair_armed(armed: bool) -> (Store, Reports, Arc<Store>, Arc<GiveUp>) {
        let server = Store::server("127.0.0.1", 0, 2, T).unwrap();
        let give_up = Arc::new(GiveUp::default());
        if armed {
            give_up.after(Duration::from_secs(60));
        }
        let port = server.port();
        let client = || Arc::new(Store::client("127.0.0.1", port, T).unwrap());
        let zero = Reports::new(client(), "ckpt/1/".into(), 0, 2, give_up.clone());
        (server, zero, client(), give_up)
    }

    fn pair() -> (Store, Reports, Arc<Store>, Arc<GiveUp>) {
        pair_armed(true)
    }

    /// A rank that beat, then died, ends the wait whether or not the run is ending with an
    /// error (not armed: the two-host test's hang, rank 1 killed after the step's collectives
    /// while its part of step_2 was outstanding; rank 0 waited at step 4's save); one that
    /// never beat, once it is.
    #[test]
    fn a_rank_that_died_before_reporting_ends_the_wait_within_seconds() {
        for (beat_first, armed) in [(true, true), (true, false), (false, true)] {
            let (_server, mut zero, store, give_up) = pair_armed(armed);
            if beat_first {
                // Rank 1 beats for a while, then dies: its beat stops, no report comes.
                let one = Reports::new(store, "ckpt/1/".into(), 1, 2, give_up);
                std::thread::sleep(Duration::from_millis(1200));
                drop(one);
            }
            let t = Instant::now();
            let err = zero.wait_ranks().unwrap_err();
            let took = t.elapsed();
            assert!(
                format!("{err:#}").contains("rank 1 ended before it reported"),
                "{err:#}"
            );
            // Not the 60 s grace: BEAT_LOST (3 s) after the last beat.
            assert!(took < Duration::from_secs(10), "took {took:?}");
        }
    }

    #[test]
    fn a_live_rank_that_beats_is_waited_for_past_beat_lost() {
        let (_server, mut zero, store, give_up) = pair();
        let writer = std::thread::spawn(move || {
            let mut one = Reports::new(store, "ckpt/1/".into(), 1, 2, give_up);
            // A slow write: longer than BEAT_LOST, beating all along.
            std::thread::sleep(BEAT_LOST + Duration::from_secs(2));
            one.beat = None;
            let sums = FileSums::from([(
                "optimizer-00002-of-00002.safetensors".to_string(),
                FileSum::of_bytes(b"x"),
            )]);
            one.set("rank1", Ok(serde_json::to_string(&sums).unwrap()))
                .unwrap();
        });
        let sums = zero.wait_ranks().unwrap();
        writer.join().unwrap();
        assert_eq!(sums.len(), 1);
        // Every key of the save is gone once rank 0 has read the reports.
        for key in ["start", "rank1", "beat0", "beat1"] {
            assert!(
                !zero.store.check(&[&format!("ckpt/1/{key}")]).unwrap(),
                "{key} left in the store"
            );
        }
    }

    fn complete(root: &Path, step: usize) {
        let dir = root.join(format!("step_{step}"));
        fs::create_dir_all(&dir).unwrap();
        fs::write(dir.join("trainer.json"), "{}").unwrap();
    }

    #[test]
    fn prune_keeps_the_last_ones_and_the_multiples_of_keep_every() -> Result<()> {
        let root = tempfile::tempdir()?;
        for step in 1..=12 {
            complete(root.path(), step);
        }
        fs::create_dir_all(root.path().join("nan_step_5"))?;
        prune(root.path(), Keep { last: 2, every: 4 })?;
        let steps: Vec<usize> = checkpoints::list(root.path())
            .into_iter()
            .map(|(s, _)| s)
            .collect();
        assert_eq!(steps, [4, 8, 11, 12]);
        assert!(root.path().join("nan_step_5").is_dir());
        prune(root.path(), Keep { last: 1, every: 0 })?;
        let steps: Vec<usize> = checkpoints::list(root.path())
            .into_iter()
            .map(|(s, _)| s)
            .collect();
        assert_eq!(steps, [12]);
        Ok(())
    }

    fn steps(root: &Path) -> Vec<usize> {
        checkpoints::list(root)
            .into_iter()
            .map(|(s, _)| s)
            .collect()
    }

    /// Item 9 of issue 45: a checkpoint a reader holds (`generate --model RUN_DIR` of a live
    /// run with keep_last=1) outlives rotation until the reader lets go; one rotated away
    /// before the reader got to it is reported gone, not read half-deleted.
    #[test]
    fn prune_leaves_a_held_checkpoint_until_its_reader_lets_go() -> Result<()> {
        let root = tempfile::tempdir()?;
        for step in 1..=3 {
            complete(root.path(), step);
        }
        let held = checkpoints::hold(&root.path().join("step_2"))?.expect("step_2 is there");
        prune(root.path(), Keep { last: 1, every: 0 })?;
        assert_eq!(steps(root.path()), [2, 3], "the held step_2 was deleted");
        // A damaged checkpoint set aside by --resume auto is never rotated away either.
        fs::create_dir_all(root.path().join("step_1.damaged"))?;
        drop(held);
        complete(root.path(), 4);
        prune(root.path(), Keep { last: 1, every: 0 })?;
        assert_eq!(steps(root.path()), [4]);
        assert!(root.path().join("step_1.damaged").is_dir());
        assert!(checkpoints::hold(&root.path().join("step_2"))?.is_none());
        Ok(())
    }
}
