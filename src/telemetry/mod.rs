//! What a run reports: the console step line, the JSONL metrics file, and the numbers behind
//! them (throughput, ETA, MFU).

pub mod memory;
pub mod mfu;
pub mod tensorboard;

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use anyhow::{Context, Result};
use serde_json::Value;

/// `[CPU0]` / `[GPU3]`: which rank and device a line comes from. Under `lockstep run` the
/// launcher passes the tag (`LOCKSTEP_TAG`), which names the physical GPU, not the rank.
pub fn rank_tag(cuda: bool, rank: usize) -> String {
    std::env::var("LOCKSTEP_TAG")
        .unwrap_or_else(|_| format!("[{}{rank}]", if cuda { "GPU" } else { "CPU" }))
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
        Ok(())
    }
}

/// Appends one JSON object per line; flushed per record so a crash loses at most one line.
pub struct Metrics {
    out: BufWriter<File>,
}

impl Metrics {
    pub fn open(path: &Path) -> Result<Metrics> {
        let file = File::options()
            .create(true)
            .append(true)
            .open(path)
            .with_context(|| {
                format!(
                    "{}: cannot open the metrics file; is logging.dir writable?",
                    path.display()
                )
            })?;
        Ok(Metrics {
            out: BufWriter::new(file),
        })
    }

    pub fn record(&mut self, record: &Value) -> Result<()> {
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
    }

    #[test]
    fn sci_pads_the_exponent() {
        assert_eq!(sci(1e-7), "1.00e-07");
        assert_eq!(sci(3e-3), "3.00e-03");
        assert_eq!(sci(0.0), "0.00e+00");
        assert_eq!(sci(12345.0), "1.23e+04");
    }
}
