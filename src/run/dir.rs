//! The run directory (`logging.dir/<run_name>`) and the checkpoint directory, and the locks
//! that give each to one process.
//!
//! Two trainings writing into one run directory interleave their metrics and TensorBoard points
//! and race on checkpoint names; two runs of different names sharing one `checkpoint.dir` write
//! into the same `step_N.tmp` and leave a checkpoint of mixed files. Rank 0 therefore takes an
//! exclusive `flock` on `<run dir>/run.lock` and on `<checkpoint.dir>/checkpoints.lock` before
//! anything else; the kernel drops them when the process ends, however it ends, so a crashed
//! run never leaves a stale lock. The files hold the holder's pid, host, start time and run
//! directory, which is what a refused second run prints.

use std::fs::{self, File};
use std::io::{Read, Seek, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

pub const LOCK_FILE: &str = "run.lock";
/// The checkpoint directory's lock file (beside the `step_N` directories).
pub const CHECKPOINTS_LOCK_FILE: &str = "checkpoints.lock";

/// The file in a run directory that records where its checkpoints are: `checkpoint.dir` made
/// absolute when the run started, so that `eval`/`generate`/`export` naming the run directory
/// from anywhere find this run's checkpoints, not those of a relative `checkpoint.dir` under
/// their own working directory.
pub const CHECKPOINT_DIR_FILE: &str = "checkpoint_dir.txt";

/// Records `checkpoints` (made absolute) in the run directory `run_dir`
/// ([`CHECKPOINT_DIR_FILE`]).
pub fn record_checkpoint_dir(run_dir: &Path, checkpoints: &Path) -> Result<()> {
    let path = run_dir.join(CHECKPOINT_DIR_FILE);
    let abs = std::path::absolute(checkpoints)
        .with_context(|| format!("checkpoint.dir {}: cannot resolve", checkpoints.display()))?;
    // Renamed into place: a link at the name is replaced, never written through.
    crate::sys::durable::write_atomic(&path, format!("{}\n", abs.display()).as_bytes())
        .with_context(|| format!("{}: cannot write; is logging.dir writable?", path.display()))
}

/// The checkpoint directory the run in `run_dir` recorded when it started, if it did.
pub fn recorded_checkpoint_dir(run_dir: &Path) -> Option<PathBuf> {
    let text = fs::read_to_string(run_dir.join(CHECKPOINT_DIR_FILE)).ok()?;
    let line = text.lines().next()?.trim();
    (!line.is_empty()).then(|| PathBuf::from(line))
}

/// Which directory a claim is on: the file it locks and how a refusal reads.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Kind {
    Run,
    Checkpoints,
}

impl Kind {
    fn lock_file(self) -> &'static str {
        match self {
            Kind::Run => LOCK_FILE,
            Kind::Checkpoints => CHECKPOINTS_LOCK_FILE,
        }
    }

    /// The refusal, for `path` held by `holder`.
    fn in_use(self, path: &Path, holder: &str) -> String {
        match self {
            Kind::Run => format!(
                "{} is in use by another training process ({holder}); its metrics and \
                 checkpoints would mix with this run's. Wait for it to finish or stop it, or give \
                 this run its own directory with --set logging.run_name=NAME",
                path.display()
            ),
            Kind::Checkpoints => format!(
                "checkpoint.dir {} is in use by another training process ({holder}); two runs \
                 saving into one checkpoint directory would mix their checkpoints. Give this run \
                 its own checkpoint.dir (unset, each run saves under its own run directory), or \
                 wait for the other run to finish",
                path.display()
            ),
        }
    }
}

/// Rank 0's claim on its run directory (or checkpoint directory); held until the process
/// ends.
pub struct RunDir {
    path: PathBuf,
    kind: Kind,
    /// Holds the flock; closing it (when the process ends) releases the directory.
    _lock: File,
    /// The directories this claim created, innermost first (the run directory, then
    /// `logging.dir` and its parents where they did not exist either).
    created: Vec<PathBuf>,
    /// The start was accepted: the directory stays, whatever happens next.
    accepted: bool,
}

impl RunDir {
    /// Creates `path` if needed and locks it for this process; fails at once, naming the
    /// holder, when another process holds it.
    pub fn claim(path: &Path) -> Result<RunDir> {
        RunDir::claim_as(path, Kind::Run, path)
    }

    /// [`RunDir::claim`] for the checkpoint directory of the run in `run_dir` (recorded for a
    /// refused second run to name).
    pub fn claim_checkpoints(path: &Path, run_dir: &Path) -> Result<RunDir> {
        RunDir::claim_as(path, Kind::Checkpoints, run_dir)
    }

    fn claim_as(path: &Path, kind: Kind, run_dir: &Path) -> Result<RunDir> {
        let created: Vec<PathBuf> = path
            .ancestors()
            .take_while(|a| !a.as_os_str().is_empty() && !a.exists())
            .map(Path::to_path_buf)
            .collect();
        match kind {
            Kind::Run => fs::create_dir_all(path).with_context(|| {
                format!(
                    "logging.dir: cannot create run directory {}; choose a writable logging.dir",
                    path.display()
                )
            })?,
            Kind::Checkpoints => super::checkpoints::create_root(path)?,
        }
        refuse_links_outside(path, kind)?;
        let lock_path = path.join(kind.lock_file());
        let mut lock = File::options()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            // A link planted at the lock's name is refused, never written through.
            .custom_flags(libc::O_NOFOLLOW)
            .open(&lock_path)
            .with_context(|| match kind {
                Kind::Run => format!(
                    "logging.dir: cannot create {}; choose a writable logging.dir",
                    lock_path.display()
                ),
                Kind::Checkpoints => format!(
                    "checkpoint.dir {}: cannot create {}; choose a writable checkpoint.dir",
                    path.display(),
                    lock_path.display()
                ),
            })?;
        if !try_lock(&lock)? {
            let mut holder = String::new();
            let _ = lock.read_to_string(&mut holder);
            bail!("{}", kind.in_use(path, &describe_holder(&holder)));
        }
        let started = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let host = crate::sys::hostname();
        lock.set_len(0)?;
        lock.rewind()?;
        writeln!(
            lock,
            "pid {}\nhost {host}\nstarted {started}\nrun {}",
            std::process::id(),
            run_dir.display()
        )?;
        Ok(RunDir {
            path: path.to_path_buf(),
            kind,
            _lock: lock,
            created,
            accepted: false,
        })
    }

    /// Fails like [`RunDir::claim`] when another process holds the run directory `path` (or
    /// the checkpoint directory `checkpoints`), without claiming it (the launcher's check
    /// before it starts workers).
    pub fn check_free(path: &Path, checkpoints: &Path) -> Result<()> {
        for (dir, kind) in [(path, Kind::Run), (checkpoints, Kind::Checkpoints)] {
            let Ok(mut file) = File::open(dir.join(kind.lock_file())) else {
                continue;
            };
            if try_lock(&file)? {
                continue; // released when `file` closes
            }
            let mut holder = String::new();
            let _ = file.read_to_string(&mut holder);
            bail!("{}", kind.in_use(dir, &describe_holder(&holder)));
        }
        Ok(())
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The start was accepted: keep the directory even if the run fails later.
    pub fn accept(&mut self) {
        self.accepted = true;
    }
}

impl Drop for RunDir {
    /// A start that was refused (bad data, incompatible checkpoint) leaves no directory it
    /// created behind (the run directory, nor an empty `runs/` above it); the lock itself goes
    /// with the process.
    fn drop(&mut self) {
        if !self.created.is_empty() && !self.accepted {
            let _ = fs::remove_file(self.path.join(self.kind.lock_file()));
            for dir in &self.created {
                if fs::remove_dir(dir).is_err() {
                    break; // not empty: something else lives there now
                }
            }
        }
    }
}

/// Refuses a directory (a run's, or a checkpoint directory) holding a symbolic link that points
/// outside it: lockstep writes its files (config.json, run.lock, metrics.jsonl, step_N/…) by
/// name inside the directory, and a planted link would make it overwrite its target. Links
/// inside the directory are left alone, as is the directory itself being a link (a run kept on
/// another disk).
fn refuse_links_outside(dir: &Path, kind: Kind) -> Result<()> {
    let Ok(entries) = fs::read_dir(dir) else {
        return Ok(()); // a directory that cannot be listed fails at its first write, named
    };
    let root =
        fs::canonicalize(dir).with_context(|| format!("{}: cannot resolve", dir.display()))?;
    for entry in entries.flatten() {
        let path = entry.path();
        if !entry.file_type().is_ok_and(|t| t.is_symlink()) {
            continue;
        }
        let target = fs::read_link(&path).unwrap_or_default();
        // Where the link leads: resolved when it exists, else its own text taken from the
        // directory (a dangling link would be created at its target by a write).
        let lands = fs::canonicalize(&path).unwrap_or_else(|_| root.join(&target));
        if lands.starts_with(&root) && lands != root {
            continue;
        }
        let (what, fix) = match kind {
            Kind::Run => ("run directory", "logging.run_name"),
            Kind::Checkpoints => ("checkpoint directory", "checkpoint.dir"),
        };
        bail!(
            "{} is a symbolic link to {}, outside the {what} {}; lockstep writes the files of a \
             run inside its directory and never through a link. Remove the link (or move the \
             file it points at into the directory), or choose another {fix}",
            path.display(),
            target.display(),
            dir.display()
        );
    }
    Ok(())
}

/// flock(LOCK_EX | LOCK_NB): Ok(false) when another open file description holds it.
fn try_lock(file: &File) -> Result<bool> {
    match crate::sys::flock(file, libc::LOCK_EX | libc::LOCK_NB) {
        Ok(()) => Ok(true),
        Err(e) if e.raw_os_error() == Some(libc::EWOULDBLOCK) => Ok(false),
        Err(e) => Err(e).context("cannot lock the run directory"),
    }
}

/// "pid 1234 on host gpu01, started 12 s ago" from the lock file's contents.
fn describe_holder(contents: &str) -> String {
    let field = |name: &str| {
        contents
            .lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
            .map(str::trim)
    };
    let Some(pid) = field("pid") else {
        return "its pid is not recorded yet".into();
    };
    let mut s = format!("pid {pid}");
    if let Some(host) = field("host") {
        s.push_str(&format!(" on host {host}"));
    }
    if let Some(started) = field("started").and_then(|v| v.parse::<u64>().ok()) {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        s.push_str(&format!(
            ", started {} ago",
            crate::telemetry::hms(now.saturating_sub(started) as f64)
        ));
    }
    if let Some(run) = field("run") {
        s.push_str(&format!(", run {run}"));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_claim_is_refused_with_the_holder_and_the_way_out() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("runs/tiny");
        let mut first = RunDir::claim(&dir).unwrap();
        first.accept();
        // flock conflicts between open file descriptions, so a second claim in this process
        // behaves like one from another process.
        let err = RunDir::claim(&dir)
            .err()
            .expect("second claim refused")
            .to_string();
        let pid = std::process::id();
        assert!(err.contains(&format!("pid {pid} on host")), "{err}");
        assert!(err.contains("--set logging.run_name=NAME"), "{err}");
        let ckpts = tmp.path().join("shared-ckpts");
        assert!(RunDir::check_free(&dir, &ckpts).is_err());
        drop(first);
        assert!(
            RunDir::check_free(&dir, &ckpts).is_ok(),
            "released with the holder"
        );
        // The checkpoint directory: a second run of another name is refused, naming the run.
        let mut held = RunDir::claim_checkpoints(&ckpts, &tmp.path().join("runs/a")).unwrap();
        held.accept();
        let err = RunDir::claim_checkpoints(&ckpts, &dir)
            .err()
            .unwrap()
            .to_string();
        assert!(
            err.contains("checkpoint.dir") && err.contains("runs/a"),
            "{err}"
        );
        assert!(RunDir::check_free(&dir, &ckpts).is_err());
        let again = RunDir::claim(&dir).unwrap();
        assert_eq!(again.path(), dir);
    }

    #[test]
    fn a_refused_start_removes_the_directory_it_created_only() {
        let tmp = tempfile::tempdir().unwrap();
        let new_dir = tmp.path().join("fresh");
        drop(RunDir::claim(&new_dir).unwrap());
        assert!(!new_dir.exists(), "created and not accepted: removed");
        // logging.dir created for the run goes too (no empty runs/ left behind)...
        let runs = tmp.path().join("runs");
        drop(RunDir::claim(&runs.join("tiny")).unwrap());
        assert!(!runs.exists(), "an empty runs/ was left behind");
        // ...but not one that holds something else by then.
        fs::create_dir_all(runs.join("other")).unwrap();
        drop(RunDir::claim(&runs.join("tiny")).unwrap());
        assert!(runs.join("other").is_dir() && !runs.join("tiny").exists());

        let old = tmp.path().join("old");
        fs::create_dir(&old).unwrap();
        fs::write(old.join("metrics.jsonl"), "{}\n").unwrap();
        drop(RunDir::claim(&old).unwrap());
        assert!(
            old.join("metrics.jsonl").exists(),
            "an existing run is kept"
        );
    }
}
