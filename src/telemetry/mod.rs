//! What a run reports: the console step line, the JSONL metrics file, and the numbers behind
//! them (throughput, ETA, MFU).

pub mod mlflow;
pub mod record;
pub mod tensorboard;
pub mod tracker;
pub mod trackers;
pub mod wandb;

use std::fs::File;
use std::io::{BufWriter, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use anyhow::{Context, Result};
use serde_json::Value;

pub use record::MetricsRecord;

/// `[CPU0]` / `[GPU3]`: which rank and device a line comes from. Under `lockstep run` the
/// launcher passes the tag (`LOCKSTEP_TAG`), which names the physical GPU, not the rank.
pub fn rank_tag(cuda: bool, rank: usize) -> String {
    std::env::var("LOCKSTEP_TAG")
        .unwrap_or_else(|_| format!("[{}{rank}]", if cuda { "GPU" } else { "CPU" }))
}

static PROCESS_TAG: std::sync::OnceLock<String> = std::sync::OnceLock::new();

/// This process is a rank of a job of several, tagged `tag` (for [`error_tag`]).
pub fn set_process_tag(tag: &str) {
    let _ = PROCESS_TAG.set(tag.to_string());
}

/// The tag for a line this process prints outside the trainer's own (its final error), when it
/// is a rank of a job of several: the rank's tag once it is known, before that `LOCKSTEP_TAG`
/// (`lockstep run`'s workers), else `[rank R]` (torchrun's RANK, srun's SLURM_PROCID), so that
/// tasks printing the same error can be told apart; None for a single process.
pub fn error_tag() -> Option<String> {
    if let Some(t) = PROCESS_TAG.get() {
        return Some(t.clone());
    }
    if let Ok(t) = std::env::var("LOCKSTEP_TAG") {
        return Some(t);
    }
    let var = |k: &str| {
        std::env::var(k)
            .ok()
            .and_then(|v| v.trim().parse::<usize>().ok())
    };
    [("RANK", "WORLD_SIZE"), ("SLURM_PROCID", "SLURM_NTASKS")]
        .into_iter()
        .find_map(|(rank, world)| match (var(rank), var(world)) {
            (Some(r), Some(w)) if w > 1 => Some(format!("[rank {r}]")),
            _ => None,
        })
}

/// `2.95e-04`: C-style exponent (two digits, explicit sign), which Rust's `{:e}` does not do.
pub fn sci(x: f64) -> String {
    let s = format!("{x:.2e}");
    match s.split_once('e') {
        Some((mant, exp)) => {
            let (sign, digits) = exp.strip_prefix('-').map_or(("+", exp), |d| ("-", d));
            format!("{mant}e{sign}{digits:0>2}")
        }
        None => s,
    }
}

/// `h:mm:ss`.
pub fn hms(seconds: f64) -> String {
    let s = seconds.max(0.0).round() as u64;
    format!("{}:{:02}:{:02}", s / 3600, (s / 60) % 60, s % 60)
}

pub struct StepLine<'a> {
    pub tag: &'a str,
    pub step: usize,
    pub max_steps: usize,
    pub loss: f64,
    pub lr: f64,
    pub grad_norm: f64,
    pub tokens_per_s: f64,
    pub eta_s: f64,
    pub mfu: Option<f64>,
    /// A mixture of experts' load-balancing loss (unweighted).
    pub aux_loss: Option<f64>,
}

impl std::fmt::Display for StepLine<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} Step [{}/{}] | Loss: {:.4} | LR: {} | Grad Norm: {:.4} | Tok/s: {:.0} | ETA: {}",
            self.tag,
            self.step,
            self.max_steps,
            self.loss,
            sci(self.lr),
            self.grad_norm,
            self.tokens_per_s,
            hms(self.eta_s)
        )?;
        if let Some(mfu) = self.mfu {
            write!(f, " | MFU: {:.1}%", mfu * 100.0)?;
        }
        if let Some(aux) = self.aux_loss {
            write!(f, " | Aux: {aux:.4}")?;
        }
        Ok(())
    }
}

/// A run's name as the trackers show it by default: its directory's name.
pub fn run_name(run_dir: &Path) -> String {
    run_dir
        .file_name()
        .map_or_else(|| "lockstep".into(), |n| n.to_string_lossy().into_owned())
}

/// A config as flat `key = value` text pairs (`training.learning_rate` = `0.0003`; lists and
/// null as JSON): MLflow's params.
pub fn flat_params(config: &Value) -> Vec<(String, String)> {
    fn walk(prefix: &str, v: &Value, out: &mut Vec<(String, String)>) {
        match v {
            Value::Object(obj) => {
                for (k, inner) in obj {
                    let key = if prefix.is_empty() {
                        k.clone()
                    } else {
                        format!("{prefix}.{k}")
                    };
                    walk(&key, inner, out);
                }
            }
            Value::String(s) => out.push((prefix.to_string(), s.clone())),
            other => out.push((prefix.to_string(), other.to_string())),
        }
    }
    let mut out = Vec::new();
    walk("", config, &mut out);
    out
}

/// Appends one JSON object per line; flushed per record so a crash loses at most one line.
/// `metrics.jsonl`: one JSON object per logged step, each with its `step`.
pub struct Metrics {
    path: std::path::PathBuf,
    out: BufWriter<File>,
}

/// What [`Metrics::open`] did to records an earlier process left.
#[derive(Debug, PartialEq)]
pub enum Earlier {
    /// No earlier records (or an empty file).
    None,
    /// A resumed run: `dropped` records after the resumed step were removed (a killed run's
    /// steps, trained again now).
    Truncated { dropped: usize },
    /// A fresh start over an earlier record, kept under this name beside it.
    MovedTo(std::path::PathBuf),
}

impl Metrics {
    /// Opens `path` for appending. Resumed at step `resumed_at` > 0, the records after that
    /// step are removed first (and a torn last line), so the file reads as one run; a fresh
    /// start (0) over an existing record moves that one to `metrics.previous-<secs>.jsonl`.
    pub fn open(path: &Path, resumed_at: usize) -> Result<(Metrics, Earlier)> {
        let fail = || {
            format!(
                "{}: cannot open the metrics file; is logging.dir writable?",
                path.display()
            )
        };
        let earlier = match std::fs::read_to_string(path) {
            Ok(text) if !text.trim().is_empty() => {
                if resumed_at > 0 {
                    let mut kept = String::new();
                    let mut dropped = 0;
                    for line in text.lines() {
                        let step = serde_json::from_str::<Value>(line)
                            .ok()
                            .and_then(|v| v.get("step").and_then(Value::as_u64));
                        match step {
                            Some(s) if s as usize <= resumed_at => {
                                kept.push_str(line);
                                kept.push('\n');
                            }
                            _ => dropped += 1,
                        }
                    }
                    if dropped > 0 {
                        crate::sys::durable::write_atomic(path, kept.as_bytes())
                            .with_context(fail)?;
                    }
                    Earlier::Truncated { dropped }
                } else {
                    let secs = std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)
                        .map_or(0, |d| d.as_secs());
                    let old = path.with_file_name(format!("metrics.previous-{secs}.jsonl"));
                    std::fs::rename(path, &old).with_context(fail)?;
                    Earlier::MovedTo(old)
                }
            }
            _ => Earlier::None,
        };
        // O_NOFOLLOW: a link planted at metrics.jsonl is refused, never appended through.
        let file = File::options()
            .create(true)
            .append(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(path)
            .with_context(fail)?;
        Ok((
            Metrics {
                path: path.to_path_buf(),
                out: BufWriter::new(file),
            },
            earlier,
        ))
    }

    /// Back to `step` (a rollback): the records after it are removed, as on a resume, so the
    /// steps trained again replace them. Returns how many were removed.
    pub fn rewind(&mut self, step: usize) -> Result<usize> {
        self.out.flush()?;
        let (reopened, earlier) = Metrics::open(&self.path, step.max(1))?;
        *self = reopened;
        Ok(match earlier {
            Earlier::Truncated { dropped } => dropped,
            _ => 0,
        })
    }

    pub fn record(&mut self, record: &MetricsRecord) -> Result<()> {
        serde_json::to_writer(&mut self.out, record)?;
        self.out.write_all(b"\n")?;
        self.out.flush()?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_resume_rewinds_the_metrics_and_a_fresh_start_keeps_the_old_ones_aside() {
        let at = |step: u64| MetricsRecord {
            step,
            ..MetricsRecord::default()
        };
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("metrics.jsonl");
        let steps = |p: &Path| -> Vec<u64> {
            std::fs::read_to_string(p)
                .unwrap()
                .lines()
                .map(|l| {
                    serde_json::from_str::<Value>(l).unwrap()["step"]
                        .as_u64()
                        .unwrap()
                })
                .collect()
        };
        let write = |range: std::ops::RangeInclusive<u64>, torn: bool| {
            let mut text: String = range.map(|s| format!("{{\"step\": {s}}}\n")).collect();
            if torn {
                text.push_str("{\"step\": 3");
            }
            std::fs::write(&path, text).unwrap();
        };
        // Killed at step 29 after a checkpoint at 25, with a torn last line: resumed at 25.
        write(1..=29, true);
        let (mut m, earlier) = Metrics::open(&path, 25).unwrap();
        assert_eq!(earlier, Earlier::Truncated { dropped: 5 });
        m.record(&at(26)).unwrap();
        assert_eq!(steps(&path), (1..=26).collect::<Vec<_>>());
        // A fresh start in the same directory: a new record; the old one kept aside.
        let (mut m, earlier) = Metrics::open(&path, 0).unwrap();
        let Earlier::MovedTo(old) = earlier else {
            panic!("{earlier:?}")
        };
        assert!(old
            .file_name()
            .unwrap()
            .to_str()
            .unwrap()
            .starts_with("metrics.previous-"));
        assert_eq!(steps(&old), (1..=26).collect::<Vec<_>>());
        m.record(&at(1)).unwrap();
        assert_eq!(steps(&path), vec![1]);
        // A rollback to step 24 removes 25 and 26.
        m.record(&at(2)).unwrap();
        let (mut m, _) = Metrics::open(&path, 2).unwrap();
        assert_eq!(m.rewind(1).unwrap(), 1);
        assert_eq!(steps(&path), vec![1]);
        // Nothing earlier: nothing done.
        let other = dir.path().join("none.jsonl");
        assert_eq!(Metrics::open(&other, 7).unwrap().1, Earlier::None);
    }

    #[test]
    fn step_line_has_the_documented_format() {
        let line = StepLine {
            tag: "[CPU0]",
            step: 120,
            max_steps: 10000,
            loss: 3.21412,
            lr: 2.95e-4,
            grad_norm: 0.81234,
            tokens_per_s: 5123.4,
            eta_s: 330.0,
            mfu: None,
            aux_loss: None,
        };
        assert_eq!(
            line.to_string(),
            "[CPU0] Step [120/10000] | Loss: 3.2141 | LR: 2.95e-04 | Grad Norm: 0.8123 | Tok/s: 5123 | ETA: 0:05:30"
        );
        let gpu = StepLine {
            tag: "[GPU0]",
            mfu: Some(0.412),
            eta_s: 19812.0,
            ..line
        };
        assert!(gpu.to_string().ends_with("| ETA: 5:30:12 | MFU: 41.2%"));
        let moe = StepLine {
            aux_loss: Some(2.00381),
            ..gpu
        };
        assert!(moe.to_string().ends_with("| MFU: 41.2% | Aux: 2.0038"));
    }

    #[test]
    fn sci_pads_the_exponent() {
        assert_eq!(sci(1e-7), "1.00e-07");
        assert_eq!(sci(3e-3), "3.00e-03");
        assert_eq!(sci(0.0), "0.00e+00");
        assert_eq!(sci(12345.0), "1.23e+04");
    }
}
