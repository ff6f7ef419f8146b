//! Weights & Biases through its official client: a sidecar process (`wandb_sidecar.py`,
//! embedded) runs the `wandb` SDK in the project's Python and is fed JSON lines over a pipe by
//! the tracker's thread. Why a sidecar: W&B's wire protocol is internal and changes between
//! versions, and its SDK is Python; the pipe keeps the SDK's threads, prints and failures out of
//! the training process, and a sidecar that dies is simply started again.
//!
//! The run id is kept in `<run dir>/wandb.json`: a resume (`--resume`, a `--max-restarts`
//! restart) continues the same W&B run; a fresh start in the same directory begins a new one.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use serde_json::{json, Value};

use super::tracker::{Record, RunStatus, Sink, SinkError};
use crate::config::{WandbConfig, WANDB_MODES};

/// The sidecar's program (run with `python -c`).
const SIDECAR: &str = include_str!("wandb_sidecar.py");

/// How long `wandb.init` may take (online, it talks to the server; its own limit is 90 s).
const START_WAIT: Duration = Duration::from_secs(150);
/// How long the end of a run waits for the sidecar to finish uploading.
const FINISH_WAIT: Duration = Duration::from_secs(50);

/// Everything the sidecar needs, resolved from the config once.
#[derive(Debug, Clone)]
pub struct WandbOptions {
    /// The interpreter that runs the sidecar.
    pub python: PathBuf,
    /// The sidecar's `init` message: id, project, entity, name, group, tags, mode, dir, config.
    pub init: Value,
    /// `<dir>/wandb`: W&B's files, the sidecar's log and its step record.
    pub files: PathBuf,
}

impl WandbOptions {
    /// The options for a run in `run_dir` (None when W&B is off: no project, or mode
    /// disabled). `resume`: continue the W&B run named in `<run_dir>/wandb.json` (a fresh start
    /// makes a new id there). `config` becomes the W&B run's config.
    pub fn new(
        w: &WandbConfig,
        run_dir: &Path,
        resume: bool,
        config: Value,
    ) -> Result<Option<WandbOptions>> {
        let Some(project) = &w.project else {
            return Ok(None);
        };
        let mode = match &w.mode {
            Some(m) => m.clone(),
            None => match std::env::var("WANDB_MODE") {
                Ok(m) if WANDB_MODES.contains(&m.as_str()) => m,
                // W&B's older names for offline.
                Ok(m) if m == "dryrun" => "offline".into(),
                Ok(m) if !m.is_empty() && m != "run" => anyhow::bail!(
                    "WANDB_MODE = {m:?} is not a W&B mode; use one of {} (or set \
                     logging.wandb.mode)",
                    WANDB_MODES.join(", ")
                ),
                _ => "online".into(),
            },
        };
        if mode == "disabled" {
            return Ok(None);
        }
        let run_dir = std::path::absolute(run_dir)?;
        // logging.wandb.dir, else WANDB_DIR (as W&B itself reads it), else the run directory.
        let env_dir = std::env::var("WANDB_DIR").ok().filter(|d| !d.is_empty());
        let dir = match w.dir.as_ref().or(env_dir.as_ref()) {
            Some(d) => std::path::absolute(d)?,
            None => run_dir.clone(),
        };
        let files = dir.join("wandb");
        std::fs::create_dir_all(&files).with_context(|| {
            format!(
                "{}: cannot create; is logging.wandb.dir writable?",
                files.display()
            )
        })?;
        let id = run_id(&run_dir, resume)?;
        let name = w.name.clone().unwrap_or_else(|| super::run_name(&run_dir));
        let init = json!({
            "id": id, "project": project, "entity": w.entity, "name": name, "group": w.group,
            "tags": w.tags, "mode": mode, "dir": dir, "config": config,
        });
        Ok(Some(WandbOptions {
            python: python(w.python.as_deref()),
            init,
            files,
        }))
    }

    /// The W&B run id.
    pub fn id(&self) -> &str {
        self.init["id"].as_str().unwrap_or_default()
    }
}

/// The interpreter for the sidecar: `logging.wandb.python`, else [`default_python`]. A
/// configured value with a `/`, or naming a file in the working directory, is a path (made
/// absolute, as every path setting is taken from the working directory); a bare name is
/// looked up on PATH.
fn python(configured: Option<&str>) -> PathBuf {
    if let Some(p) = configured {
        let path = Path::new(p);
        if p.contains('/') || path.is_file() {
            return std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
        }
        return PathBuf::from(p);
    }
    default_python()
}

/// The sidecar's interpreter when `logging.wandb.python` is unset: the Python of the
/// environment the pip-installed lockstep runs from (its launcher sets `LOCKSTEP_PYTHON`),
/// else the venv lockstep was built against (when it is still there), else `python3` on PATH.
pub fn default_python() -> PathBuf {
    let launcher = std::env::var_os("LOCKSTEP_PYTHON").map(PathBuf::from);
    if let Some(p) = launcher.filter(|p| p.is_file()) {
        return p;
    }
    let venv = Path::new(env!("LOCKSTEP_VENV_PYTHON"));
    if !venv.as_os_str().is_empty() && venv.exists() {
        return venv.to_path_buf();
    }
    PathBuf::from("python3")
}

/// The W&B run id of the run in `run_dir`, kept in `<run_dir>/wandb.json`: the recorded one on a
/// resume, a new one (from the directory and the time) on a fresh start or when none is kept.
fn run_id(run_dir: &Path, resume: bool) -> Result<String> {
    let path = run_dir.join("wandb.json");
    if resume {
        let kept = std::fs::read_to_string(&path)
            .ok()
            .and_then(|t| serde_json::from_str::<Value>(&t).ok())
            .and_then(|v| v["id"].as_str().map(str::to_string));
        if let Some(id) = kept {
            return Ok(id);
        }
    }
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let hash = blake3::hash(format!("{}\0{nanos}", run_dir.display()).as_bytes());
    let id = hash.to_hex()[..16].to_string();
    crate::sys::durable::write_atomic(&path, json!({ "id": id }).to_string().as_bytes())
        .with_context(|| format!("{}: cannot write the W&B run id", path.display()))?;
    Ok(id)
}

/// The error a sidecar report line carries (`{"error": ..., "lasting": ...}`), if any.
fn reported_error(report: &Value) -> Option<SinkError> {
    Some(SinkError {
        message: report["error"].as_str()?.to_string(),
        lasting: report["lasting"].as_bool().unwrap_or(false),
    })
}

/// A running sidecar: its stdin, and its report lines as they come.
struct Sidecar {
    child: Child,
    stdin: Option<ChildStdin>,
    reports: Receiver<Value>,
    /// The length of sidecar.log when it started (what it printed follows).
    logged: u64,
    /// It reported `started` (it is a Python that runs the sidecar, with wandb).
    started: bool,
}

/// The W&B client of a [`super::tracker::Tracker`].
pub struct WandbSink {
    opts: WandbOptions,
    sidecar: Option<Sidecar>,
    /// The last error the sidecar reported while logging (named when it dies).
    last_error: Option<String>,
}

impl WandbSink {
    pub fn new(opts: WandbOptions) -> WandbSink {
        WandbSink {
            opts,
            sidecar: None,
            last_error: None,
        }
    }

    fn log_path(&self) -> PathBuf {
        self.opts.files.join("sidecar.log")
    }

    /// W&B's temporary files (it makes `tmp*wandb-*` directories at every start): under the
    /// run's W&B directory rather than /tmp, and removed once its sidecar has exited.
    fn tmp_dir(&self) -> PathBuf {
        self.opts.files.join("tmp")
    }

    fn spawn(&self) -> Result<Sidecar, SinkError> {
        let log_path = self.log_path();
        let tmp = self.tmp_dir();
        let _ = std::fs::create_dir_all(&tmp);
        let logged = std::fs::metadata(&log_path).map_or(0, |m| m.len());
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .map_err(|e| {
                SinkError::lasting(format!("cannot write {} ({e})", log_path.display()))
            })?;
        let python = &self.opts.python;
        let mut child = Command::new(python)
            .args(["-u", "-c", SIDECAR])
            .env("TMPDIR", &tmp)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(log)
            // Its own process group: a Ctrl-C or a launcher's kill of the trainer's group does
            // not cut it off mid-upload; it ends when its input does.
            .process_group(0)
            .spawn()
            .map_err(|e| {
                SinkError::lasting(format!(
                    "cannot run the W&B sidecar with {} ({e}); set logging.wandb.python to a \
                     Python that has the wandb package",
                    python.display()
                ))
            })?;
        let out = child.stdout.take().expect("stdout is piped");
        let (tx, reports) = channel();
        std::thread::Builder::new()
            .name("wandb-reports".into())
            .spawn(move || {
                for line in BufReader::new(out).lines().map_while(Result::ok) {
                    if let Ok(v) = serde_json::from_str::<Value>(&line) {
                        if tx.send(v).is_err() {
                            break;
                        }
                    }
                }
            })
            .map_err(|e| SinkError::passing(format!("cannot start a thread ({e})")))?;
        let stdin = child.stdin.take();
        Ok(Sidecar {
            child,
            stdin,
            reports,
            logged,
            started: false,
        })
    }

    /// What this sidecar wrote to its log (from `from` on), its last lines, for a message.
    fn printed(&self, from: u64) -> String {
        let text = std::fs::read(self.log_path()).unwrap_or_default();
        let text = String::from_utf8_lossy(&text[(from as usize).min(text.len())..]).into_owned();
        let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
        match lines.as_slice() {
            [] => "printed nothing".to_string(),
            all => format!(
                "printed: {}",
                all[all.len().saturating_sub(3)..].join(" | ")
            ),
        }
    }

    /// Writes one message line; a broken pipe means the sidecar is gone.
    fn write(&mut self, msg: &Value) -> Result<(), SinkError> {
        let sidecar = self
            .sidecar
            .as_mut()
            .ok_or_else(|| SinkError::passing("the W&B sidecar is not running"))?;
        let sent = sidecar.stdin.as_mut().map(|stdin| {
            let mut line = msg.to_string();
            line.push('\n');
            stdin
                .write_all(line.as_bytes())
                .and_then(|()| stdin.flush())
        });
        match sent {
            Some(Ok(())) => Ok(()),
            _ => Err(self.gone()),
        }
    }

    /// What to say about a sidecar that stopped taking input.
    fn gone(&mut self) -> SinkError {
        let log = self.log_path();
        let Some(mut s) = self.sidecar.take() else {
            return SinkError::passing("the W&B sidecar is not running");
        };
        drop(s.stdin.take());
        let deadline = Instant::now() + Duration::from_secs(2);
        let status = loop {
            match s.child.try_wait() {
                Ok(Some(st)) => break Some(st),
                _ if Instant::now() > deadline => break None,
                _ => std::thread::sleep(Duration::from_millis(20)),
            }
        };
        if status.is_some() {
            let _ = std::fs::remove_dir_all(self.tmp_dir());
        }
        if let Some(e) = s.reports.try_iter().find_map(|r| reported_error(&r)) {
            return e;
        }
        let how = status.map_or_else(
            || "stopped responding".into(),
            |st| format!("exited ({st})"),
        );
        if !s.started && status.is_some() {
            // Gone before it ever reported: not a Python that runs the sidecar (`/bin/false`,
            // a text file); trying again cannot help.
            return SinkError::lasting(format!(
                "{} {how} before the sidecar started and {}; it is not a Python that runs the \
                 sidecar: set logging.wandb.python to a Python with the wandb package (log: {})",
                self.opts.python.display(),
                self.printed(s.logged),
                log.display()
            ));
        }
        let why = self
            .last_error
            .take()
            .map_or_else(String::new, |e| format!(" after: {e}"));
        SinkError::passing(format!("the W&B sidecar {how}{why}; see {}", log.display()))
    }
}

impl Sink for WandbSink {
    fn start(&mut self) -> Result<(String, Option<u64>), SinkError> {
        if let Some(mut old) = self.sidecar.take() {
            drop(old.stdin.take());
            let _ = old.child.kill();
            let _ = old.child.wait();
        }
        self.sidecar = Some(self.spawn()?);
        self.write(&json!({ "init": self.opts.init }))?;
        let s = self.sidecar.as_mut().expect("just started");
        match s.reports.recv_timeout(START_WAIT) {
            Ok(r) if r.get("started").is_some() => {
                s.started = true;
                let started = &r["started"];
                let line = started["line"].as_str().unwrap_or_default().to_string();
                Ok((line, started["last_step"].as_u64()))
            }
            Ok(r) => Err(reported_error(&r).unwrap_or_else(|| {
                SinkError::passing("the W&B sidecar answered without starting")
            })),
            Err(RecvTimeoutError::Disconnected) => Err(self.gone()),
            Err(RecvTimeoutError::Timeout) => Err(SinkError::passing(format!(
                "wandb.init did not finish within {} s (see {})",
                START_WAIT.as_secs(),
                self.log_path().display()
            ))),
        }
    }

    fn send(&mut self, records: &[Record]) -> Result<(), SinkError> {
        if let Some(s) = &self.sidecar {
            for e in s.reports.try_iter().filter_map(|r| reported_error(&r)) {
                self.last_error = Some(e.message);
            }
        }
        for r in records {
            let values: serde_json::Map<String, Value> = r
                .values
                .iter()
                .map(|(k, v)| (k.clone(), json!(v)))
                .collect();
            self.write(&json!({ "log": { "step": r.step, "values": values } }))?;
        }
        Ok(())
    }

    fn finish(&mut self, status: RunStatus) -> Result<(), SinkError> {
        self.write(&json!({ "finish": status.mlflow() }))?;
        let Some(mut s) = self.sidecar.take() else {
            return Ok(());
        };
        drop(s.stdin.take());
        let deadline = Instant::now() + FINISH_WAIT;
        loop {
            match s.child.try_wait() {
                Ok(Some(_)) => {
                    let _ = std::fs::remove_dir_all(self.tmp_dir());
                    return Ok(());
                }
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(50))
                }
                _ => {
                    // Left running in its own process group: it finishes the upload alone.
                    return Err(SinkError::passing(format!(
                        "still uploading after {} s; it goes on in the background (W&B's copy \
                         is in {}; if it is cut off, `wandb sync` uploads it)",
                        FINISH_WAIT.as_secs(),
                        self.opts.files.display()
                    )));
                }
            }
        }
    }
}
