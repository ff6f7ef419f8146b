//! The experiment trackers a run has: their options built from the config and the
//! environment (W&B in `wandb.rs`, MLflow in `mlflow.rs`), each started behind a
//! [`Tracker`] (`tracker.rs`: the bounded queue and thread that never slow training).

use std::path::Path;

use serde_json::Value;

use super::mlflow::{MlflowOptions, MlflowSink};
use super::tracker::Tracker;
use super::wandb::{WandbOptions, WandbSink};
use crate::config::Resolved;

/// The trackers the config turns on (`logging.wandb`, `logging.mlflow` and their variables),
/// started, each on its own thread. `about` (what the run is) goes into each tracker's run
/// config beside the resolved config. A tracker that cannot be
/// set up is reported and left out: it never stops training.
pub fn start(
    resolved: &Resolved,
    tag: &str,
    run_dir: &Path,
    about: Value,
    resume: bool,
) -> Vec<Tracker> {
    let cfg = &resolved.config;
    let mut out = Vec::new();
    let mut config = resolved.to_json();
    config["lockstep"] = about.clone();
    match WandbOptions::new(&cfg.logging.wandb, run_dir, resume, config) {
        Ok(Some(opts)) => {
            let catch_up = format!(
                "upload them later with `lockstep wandb-sync {}`",
                run_dir.display()
            );
            let sink = Box::new(WandbSink::new(opts));
            out.push(Tracker::start("W&B", tag, &catch_up, sink))
        }
        Ok(None) => {}
        Err(e) => eprintln!("{} Warning: W&B is off for this run: {e:#}", tag),
    }
    match MlflowOptions::new(resolved, run_dir, resume, &about) {
        Ok(Some(opts)) => out.push(Tracker::start(
            "MLflow",
            tag,
            "",
            Box::new(MlflowSink::new(opts)),
        )),
        Ok(None) => {}
        Err(e) => eprintln!("{} Warning: MLflow is off for this run: {e}", tag),
    }
    out
}
