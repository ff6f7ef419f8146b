//! One training process: where it sits among the ranks (torchrun's or `lockstep run`'s
//! variables), its device (resolved once here), its process group, then the trainer.

use std::time::Duration;

use anyhow::Result;

use super::device;
use super::place::Rank;
use super::trainer::{Summary, Trainer};
use crate::config::Resolved;
use crate::dist::{self, Backend, DistEnv, Place, SingleProcess};
use crate::run::RunOptions;

/// Trains this process's rank: a single process, or one rank of a job when torchrun's or
/// `lockstep run`'s variables (RANK, WORLD_SIZE, ...) are set.
pub fn train_rank(resolved: &Resolved, opts: &RunOptions) -> Result<Summary> {
    let cfg = &resolved.config;
    // Variables that cannot describe a job are a usage error (exit 2), found before anything.
    let env = DistEnv::from_env().map_err(|e| crate::config::ConfigError(format!("{e:#}")))?;
    let Some(env) = env else {
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
