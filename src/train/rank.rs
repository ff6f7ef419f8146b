//! One training process: where it sits among the ranks (torchrun's or `lockstep run`'s
//! variables), its device (resolved once here), its process group, then the trainer.

use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

use super::device;
use super::place::Rank;
use super::setup::RunOptions;
use super::trainer::{Summary, Trainer};
use crate::config::{Config, ConfigError, Resolved};
use crate::dist::{self, Backend, DistEnv, Place, SingleProcess};

/// What every worker of a `lockstep run` trains: the launcher resolves the config once and
/// writes this file; each worker reads it (`lockstep train --worker-spec FILE`), so no worker
/// re-resolves presets, files and flags on its own.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct WorkerSpec {
    pub preset: String,
    pub config: Config,
    pub options: RunOptions,
}

impl WorkerSpec {
    pub fn write(&self, path: &Path) -> Result<()> {
        std::fs::write(path, serde_json::to_vec_pretty(self)?)
            .with_context(|| format!("{}: cannot write the workers' spec", path.display()))
    }

    /// Reads and re-validates a spec (the file may have been edited by hand).
    pub fn read(path: &Path) -> Result<(Resolved, RunOptions)> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("--worker-spec {}: cannot read", path.display()))?;
        let spec: WorkerSpec = serde_json::from_str(&text).map_err(|e| {
            ConfigError(format!(
                "--worker-spec {}: not a worker spec written by `lockstep run` ({e})",
                path.display()
            ))
        })?;
        Ok((Resolved::new(spec.config, spec.preset)?, spec.options))
    }
}

/// Trains this process's rank: a single process, or one rank of a job when torchrun's or
/// `lockstep run`'s variables (RANK, WORLD_SIZE, ...) are set.
pub fn train_rank(resolved: &Resolved, opts: &RunOptions) -> Result<Summary> {
    let cfg = &resolved.config;
    let Some(env) = DistEnv::from_env()? else {
        let rank = Rank::new(cfg, Place::SINGLE)?;
        return run_trainer(resolved, opts, rank, &mut SingleProcess);
    };
    let rank = Rank::new(cfg, env.place)?;
    // Before the rendezvous, so a rank stuck in it can already be asked (SIGUSR1) and seen by
    // the launcher (its trace file).
    dist::forensics::install(env.place.rank, &rank.tag)?;
    if let (Some(note), true) = (&env.note, rank.lead()) {
        println!("{} {note}", rank.tag);
    }
    let backend = device::dist_backend(cfg, rank.device)?;
    let timeout = Duration::from_secs(cfg.system.collective_timeout_s);
    let mut pg = dist::init(&env, timeout, backend)?;
    if let (Backend::Nccl { .. }, true, 2..) = (backend, rank.lead(), env.place.world) {
        println!(
            "{} Collectives: NCCL {} (c10d ProcessGroupNCCL) for gradients and parameters, TCP ring for scalars",
            rank.tag,
            dist::nccl::version()?
        );
    }
    run_trainer(resolved, opts, rank, pg.as_mut())
}

/// Builds and runs the trainer. An allocation that fails anywhere in it (a libtorch error or a
/// tch panic) ends the run with an error naming the phase, the memory in use and the plan's
/// advice (`fit::explain`) instead of a panic.
fn run_trainer(
    resolved: &Resolved,
    opts: &RunOptions,
    rank: Rank,
    pg: &mut dyn dist::ProcessGroup,
) -> Result<Summary> {
    crate::sys::oom::catch(|| Trainer::new(resolved, opts, rank, pg)?.run())
        .map_err(super::fit::explain)
}
