//! Launching this node's workers: the plan's checks and its rendezvous first ([`preflight`]),
//! then attempts (spawn, supervise, agree with the other nodes) until the job succeeds, fails
//! with no restart left, or is interrupted ([`launch_in`]).

use std::path::Path;
use std::time::Duration;

use anyhow::{bail, Context, Result};

use super::gpus::{self, detect_gpus, GpuInfo};
use super::plan::{Devices, LaunchPlan};
use super::rendezvous::{AttemptPeers, Decision, FailureReport, NodeReport, Rendezvous};
use super::sinks::Sinks;
use super::supervise::{self, RankFailure};
use super::{output, signals, spawn};

/// What happened to a launch, for callers that want more than the exit code.
#[derive(Debug, Clone)]
pub struct Outcome {
    /// The code the launcher should exit with: 0, the failing worker's code (128 + signal for
    /// a signal) once no restart is left; after SIGINT/SIGTERM 0 when every worker saved and
    /// exited 0, else 130/143.
    pub exit_code: i32,
    /// The port exported as `MASTER_PORT` (the picked one when the plan said 0).
    pub master_port: u16,
    /// The worker of this node that failed on its own in the last attempt, if one did.
    pub failure: Option<RankFailure>,
    /// SIGINT/SIGTERM that made the launcher stop the workers, if any.
    pub interrupted_by: Option<i32>,
    /// Process ids the workers had, over all attempts; all are reaped when `launch` returns.
    pub pids: Vec<u32>,
    /// Restarts made.
    pub restarts: usize,
}

/// The arguments of a restart given what it resumes from (`None`: the latest complete
/// checkpoint, `--resume auto`).
pub type RestartArgs<'a> = &'a dyn Fn(Option<&Path>) -> Result<Vec<String>>;

/// What the workers run.
pub struct Job<'a> {
    pub program: &'a Path,
    /// Arguments of the first attempt.
    pub args: Vec<String>,
    /// Arguments of a restart given what it resumes from (`None`: the latest complete
    /// checkpoint, `--resume auto`); without it restarts reuse `args`.
    pub restart_args: Option<RestartArgs<'a>>,
}

/// Starts the workers of `plan` running `program args...`, supervises them and returns the
/// code the launcher should exit with. Worker lines go to stdout, launcher messages to stderr.
pub fn launch(plan: &LaunchPlan, program: &Path, args: &[String]) -> Result<i32> {
    Ok(launch_with(plan, program, args, &Sinks::stdio())?.exit_code)
}

/// [`launch`] with injectable sinks and the full [`Outcome`].
pub fn launch_with(
    plan: &LaunchPlan,
    program: &Path,
    args: &[String],
    sinks: &Sinks,
) -> Result<Outcome> {
    let job = Job {
        program,
        args: args.to_vec(),
        restart_args: None,
    };
    launch_in(preflight(plan)?, plan, &job, sinks)
}

/// Checks `plan` and opens its rendezvous (node 0 binds the port, a free one for 0; the other
/// nodes connect) before the caller does expensive work such as tokenizing.
pub fn preflight(plan: &LaunchPlan) -> Result<Rendezvous> {
    validate(plan)?;
    Rendezvous::open(plan)
}

/// Runs `job` on this node's workers through `rdzv` (from [`preflight`]) until it succeeds,
/// fails with no restart left, or is interrupted.
///
/// SIGINT/SIGTERM/SIGUSR1 handlers are installed for the duration of the call (process-wide)
/// and the previous ones restored before it returns. Every worker is reaped, and each worker's
/// process group is swept with SIGKILL once the worker has exited, so nothing it started
/// survives. Must be called from a thread that lives until it returns: the workers'
/// parent-death signal is tied to the thread that spawned them.
pub fn launch_in(rdzv: Rendezvous, plan: &LaunchPlan, job: &Job, sinks: &Sinks) -> Result<Outcome> {
    if let Devices::Gpus(ids) = &plan.devices {
        check_gpu_ids(ids, &detect_gpus())?;
        warn_inherited_cuda_visible(sinks);
    }
    std::fs::create_dir_all(&plan.log_dir)
        .with_context(|| format!("creating log directory {}", plan.log_dir.display()))?;
    let master_port = rdzv.port();
    // Handlers go in before the first fork so a Ctrl-C during start-up is forwarded too.
    let signals = signals::Watch::install()?;
    let mut pids = Vec::new();
    let mut args = job.args.clone();
    let mut prev_before_first_step = false;
    let mut attempt = 0;
    loop {
        let mut peers = AttemptPeers::new(&rdzv, attempt);
        let sup = match signals.take() {
            // A signal between two attempts: start nothing, and stop the other nodes too.
            Some((_, sig)) if attempt > 0 => {
                rdzv.request_stop(attempt);
                supervise::Supervision {
                    failure: None,
                    interrupted_by: Some(sig),
                    clean: false,
                }
            }
            _ => {
                let mut workers =
                    spawn::spawn_all(plan, master_port, attempt, job.program, &args, sinks)?;
                pids.extend(workers.iter().map(|w| w.pid()));
                let sup =
                    supervise::supervise(&mut workers, plan.grace, sinks, &signals, &mut peers);
                // Drain what the workers printed last; bounded because a process that escaped
                // its group could hold a pipe open forever.
                for w in &workers {
                    w.output.wait_closed(Duration::from_secs(2));
                }
                sup
            }
        };
        let report = NodeReport {
            node: plan.node.node_rank,
            failure: sup
                .failure
                .as_ref()
                .map(|f| FailureReport::of(f, plan.node.node_rank)),
            interrupted_by: sup.interrupted_by,
            clean: sup.clean,
        };
        match rdzv.agree(attempt, &report, &plan.restart, prev_before_first_step)? {
            Decision::Finish { exit_code, message } => {
                if let Some(m) = message {
                    output::write_line(&sinks.diag, &format!("lockstep run: {m}"));
                }
                return Ok(Outcome {
                    exit_code,
                    master_port,
                    failure: sup.failure,
                    interrupted_by: sup.interrupted_by,
                    pids,
                    restarts: attempt,
                });
            }
            Decision::Restart {
                resume,
                message,
                before_first_step,
            } => {
                output::write_line(&sinks.diag, &format!("lockstep run: {message}"));
                prev_before_first_step = before_first_step;
                args = match job.restart_args {
                    Some(f) => f(resume.as_deref())?,
                    None => job.args.clone(),
                };
                attempt += 1;
            }
        }
    }
}

/// Rejects plans that cannot work before anything is started: usage errors (exit 2).
fn validate(plan: &LaunchPlan) -> Result<()> {
    let usage = |msg: String| -> Result<()> { Err(crate::config::ConfigError(msg).into()) };
    if plan.node.nnodes == 0 {
        return usage("--nnodes must be at least 1".into());
    }
    if plan.node.node_rank >= plan.node.nnodes {
        return usage(format!(
            "--node-rank {} is out of range for --nnodes {} (expected 0..={})",
            plan.node.node_rank,
            plan.node.nnodes,
            plan.node.nnodes - 1
        ));
    }
    match &plan.devices {
        Devices::Cpu(0) => {
            return usage("--nproc 0: must be at least 1 (workers on this node)".into())
        }
        Devices::Gpus(ids) if ids.is_empty() => {
            return usage("--gpus needs at least one GPU index (e.g. --gpus 0,1)".into())
        }
        Devices::Gpus(ids) => gpus::check_unique(ids)?,
        Devices::Cpu(_) => {}
    }
    if plan.node.master_port == 0 && plan.node.nnodes > 1 {
        return usage(format!(
            "--master-port 0 (pick a free port) only works with one node; with --nnodes {} \
             every node must be given the same explicit --master-port",
            plan.node.nnodes
        ));
    }
    if plan.node.master_addr.trim().is_empty() {
        return usage("--master-addr must not be empty".into());
    }
    Ok(())
}

/// With NVML available, a GPU id past the last device is caught here instead of as a
/// confusing "no CUDA device" inside every worker. Without NVML nothing can be checked.
fn check_gpu_ids(ids: &[usize], found: &[GpuInfo]) -> Result<()> {
    if found.is_empty() {
        return Ok(());
    }
    if let Some(bad) = ids.iter().find(|&&id| !found.iter().any(|g| g.index == id)) {
        bail!(
            "--gpus: GPU {bad} does not exist; this machine has {} GPU(s): {}",
            found.len(),
            found
                .iter()
                .map(|g| g.index.to_string())
                .collect::<Vec<_>>()
                .join(",")
        );
    }
    Ok(())
}

/// `--gpus` ids are physical indices, so an inherited `CUDA_VISIBLE_DEVICES` is replaced;
/// say so, because under a scheduler that set it this may not be what the user meant.
fn warn_inherited_cuda_visible(sinks: &Sinks) {
    if let Ok(v) = std::env::var("CUDA_VISIBLE_DEVICES") {
        if !v.trim().is_empty() {
            output::write_line(
                &sinks.diag,
                &format!(
                    "lockstep run: note: replacing CUDA_VISIBLE_DEVICES={v} from the environment; \
                     --gpus ids are physical indices as nvidia-smi lists them"
                ),
            );
        }
    }
}
