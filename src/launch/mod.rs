//! `lockstep run`: starts one worker process per rank, supervises them, and restarts them all
//! from the latest checkpoint when one fails (`--max-restarts`).
//!
//! The launcher is deliberately small and torchrun-like:
//! - `run` is the command: devices (also from Slurm's variables), checks, data preparation, the
//!   workers' spec, launch;
//! - `launcher` checks the plan (`plan`: devices, node, restarts, logs), then runs the attempts
//!   (spawn, supervise, agree on a restart), writing to the `sinks`;
//! - `rendezvous`: node 0's launcher hosts the run's TCPStore (bound to the master address
//!   only), which outlives the workers; the launchers of all nodes agree on each restart there;
//! - `spawn` starts each worker with the rank environment, in its own process group and
//!   with a parent-death signal, so no worker outlives the launcher;
//! - `output` prefixes, filters and logs every line the workers print;
//! - `supervise` waits for the workers, tears the group down when one fails (here or on
//!   another node) and forwards SIGINT/SIGTERM (handlers from `signals`);
//! - `hang` turns the workers' trace files into the one-screen hang report (on a collective
//!   timeout, and on SIGUSR1);
//! - `gpus` finds GPUs through NVML loaded at run time and parses `--gpus` lists.
//!
//! Everything here is Linux-specific (process groups, `prctl`, `/proc`).

mod exit;
mod gpus;
mod hang;
mod launcher;
mod output;
mod plan;
mod rendezvous;
mod run;
mod signals;
mod sinks;
mod spawn;
mod supervise;
#[cfg(test)]
mod tests;

pub use exit::ExitKind;
pub use gpus::{detect_gpus, parse_gpu_list, pick_free_gpus, GpuInfo};
pub use launcher::{launch, launch_in, launch_with, preflight, Job, Outcome, RestartArgs};
pub use plan::{Devices, LaunchPlan, LogRanks, RestartPolicy};
pub use rendezvous::{decide, Decision, FailureReport, NodeReport, Rendezvous};
pub use run::{run, LaunchArgs};
pub use sinks::{SharedWriter, Sinks};
pub use supervise::RankFailure;
