//! `lockstep wandb-sync RUN_DIR`: a run's metrics.jsonl into its W&B run afterwards — for
//! clusters whose nodes have no internet, or a run whose tracker fell behind. The same
//! sidecar, names and run id as during training; steps the W&B server already has are not
//! sent again.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use serde_json::Value;

use crate::config::{ConfigError, WandbConfig};
use crate::telemetry::tracker::{Record, RunStatus, Sink};
use crate::telemetry::wandb::{WandbOptions, WandbSink};
use crate::telemetry::MetricsRecord;

#[derive(Args, Debug, Clone)]
pub struct WandbSyncArgs {
    /// The run directory (logging.dir/<run name>) holding config.json and metrics.jsonl.
    #[arg(value_name = "RUN_DIR")]
    pub run_dir: PathBuf,
    /// W&B project; default: logging.wandb.project of the run's config.json.
    #[arg(long, value_name = "NAME")]
    pub project: Option<String>,
    /// W&B entity; default: logging.wandb.entity of the run's config.json.
    #[arg(long, value_name = "NAME")]
    pub entity: Option<String>,
    /// online (default) or offline (a local copy for `wandb sync`).
    #[arg(long, value_name = "MODE", value_parser = ["online", "offline"])]
    pub mode: Option<String>,
}

/// Records sent per message batch.
const CHUNK: usize = 256;

pub fn run(args: &WandbSyncArgs) -> Result<()> {
    let dir = &args.run_dir;
    let read = |name: &str| -> Result<String> {
        let path = dir.join(name);
        std::fs::read_to_string(&path).map_err(|e| {
            ConfigError(format!(
                "{}: cannot read ({e}); RUN_DIR must be a run directory that lockstep trained \
                 in (logging.dir/<run name>, e.g. runs/tiny)",
                path.display()
            ))
            .into()
        })
    };
    let mut config: Value = serde_json::from_str(&read("config.json")?)
        .with_context(|| format!("{}: invalid JSON", dir.join("config.json").display()))?;
    let mut w: WandbConfig =
        serde_json::from_value(config["logging"]["wandb"].clone()).unwrap_or_default();
    w.project = args.project.clone().or(w.project);
    w.entity = args.entity.clone().or(w.entity);
    w.mode = Some(args.mode.clone().unwrap_or_else(|| "online".into()));
    if w.project.is_none() {
        return Err(ConfigError(format!(
            "{} has no logging.wandb.project; pass --project NAME",
            dir.join("config.json").display()
        ))
        .into());
    }
    let records = metrics_records(&dir.join("metrics.jsonl"))?;
    config["lockstep"] = serde_json::json!({
        "version": env!("CARGO_PKG_VERSION"),
        "run_dir": std::path::absolute(dir)?,
        "uploaded_by": "lockstep wandb-sync",
    });
    // A project is set and the mode is online or offline, so W&B is on.
    let mut opts = WandbOptions::new(&w, dir, true, config)?
        .ok_or_else(|| anyhow::anyhow!("internal: W&B options for {} are off", dir.display()))?;
    opts.init["local_steps"] = Value::Bool(false);
    // This command's way to a local copy (training's is logging.wandb.mode).
    opts.init["offline_fix"] = Value::from("pass --mode offline for a local copy");
    let id = opts.id().to_string();
    let mut sink = WandbSink::new(opts);
    let fail = |e: crate::telemetry::tracker::SinkError| anyhow::anyhow!("W&B: {}", e.message);
    let (line, last) = sink.start().map_err(fail)?;
    println!("W&B: {line}");
    let todo: Vec<Record> = records
        .into_iter()
        .filter(|r| last.is_none_or(|l| r.step > l))
        .collect();
    for chunk in todo.chunks(CHUNK) {
        sink.send(chunk).map_err(fail)?;
    }
    sink.finish(RunStatus::Finished).map_err(fail)?;
    let skipped = last.map_or(String::new(), |l| {
        format!(" (W&B already had the steps up to {l})")
    });
    println!(
        "W&B: sent {} steps of {} to run {id}{skipped}",
        todo.len(),
        dir.join("metrics.jsonl").display()
    );
    Ok(())
}

/// The step records of a metrics.jsonl: every line that is a JSON object with a step. Lines
/// that are not (a torn or edited line, bytes that are not UTF-8) are skipped and counted with
/// their numbers; a file without any record is refused rather than uploaded as an empty run.
fn metrics_records(path: &std::path::Path) -> Result<Vec<Record>> {
    let bytes = std::fs::read(path).map_err(|e| {
        ConfigError(format!(
            "{}: cannot read ({e}); RUN_DIR must be a run directory that lockstep trained in \
             (logging.dir/<run name>, e.g. runs/tiny)",
            path.display()
        ))
    })?;
    let mut records = Vec::new();
    let mut bad = Vec::new();
    for (i, line) in bytes.split(|&b| b == b'\n').enumerate() {
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        let record = std::str::from_utf8(line)
            .ok()
            .and_then(|l| serde_json::from_str::<MetricsRecord>(l).ok())
            .map(|r| Record {
                step: r.step,
                values: r.series(),
            });
        match record {
            Some(r) => records.push(r),
            None => bad.push(i + 1),
        }
    }
    if !bad.is_empty() {
        let shown: Vec<String> = bad.iter().take(10).map(usize::to_string).collect();
        eprintln!(
            "Warning: {}: skipped {} line(s) that are not step records (line {}{}); the other \
             {} are uploaded",
            path.display(),
            bad.len(),
            shown.join(", "),
            if bad.len() > 10 { ", …" } else { "" },
            records.len()
        );
    }
    anyhow::ensure!(
        !records.is_empty(),
        "{}: holds no step records{}; nothing to upload (a run writes one per logged step)",
        path.display(),
        if bad.is_empty() {
            ""
        } else {
            " (see the warning above)"
        }
    );
    Ok(records)
}
