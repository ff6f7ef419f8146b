//! Starting the workers.

use std::fs::OpenOptions;
use std::io::Write;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;

use anyhow::{Context, Result};

use super::output::RankOutput;
use super::plan::{Devices, LaunchPlan, LogRanks};
use super::sinks::Sinks;
use crate::dist::forensics::TRACE_ENV;

/// One running (or exited) worker.
pub(super) struct Worker {
    /// Global rank.
    pub(super) rank: usize,
    /// Physical GPU id, `None` for a CPU worker.
    pub(super) gpu: Option<usize>,
    pub(super) child: Child,
    pub(super) output: Arc<RankOutput>,
    pub(super) log_path: PathBuf,
    /// The worker's trace file (phase, step, recent collectives; see `dist::forensics`).
    pub(super) trace: PathBuf,
}

impl Worker {
    pub(super) fn pid(&self) -> u32 {
        self.child.id()
    }

    /// "GPU 3" / "CPU", as in failure reports.
    pub(super) fn device(&self) -> String {
        match self.gpu {
            Some(g) => format!("GPU {g}"),
            None => "CPU".to_string(),
        }
    }
}

/// The environment of one worker of attempt `attempt` (0, then 1 for the first restart...), in
/// a fixed order (handy for tests).
///
/// The store is the launcher's (node 0's), as under torchrun's elastic agent, so it outlives
/// worker restarts: the workers join it as clients (`TORCHELASTIC_USE_AGENT_STORE`) and
/// namespace their keys by the attempt (`TORCHELASTIC_RESTART_COUNT`).
pub(super) fn worker_env(
    plan: &LaunchPlan,
    master_port: u16,
    attempt: usize,
    local_rank: usize,
) -> Vec<(&'static str, String)> {
    let local_world = plan.devices.local_world();
    let mut env = vec![
        ("RANK", global_rank(plan, local_rank).to_string()),
        ("WORLD_SIZE", (plan.node.nnodes * local_world).to_string()),
        ("LOCAL_RANK", local_rank.to_string()),
        ("LOCAL_WORLD_SIZE", local_world.to_string()),
        ("GROUP_RANK", plan.node.node_rank.to_string()),
        ("MASTER_ADDR", plan.node.master_addr.clone()),
        ("MASTER_PORT", master_port.to_string()),
        ("LOCKSTEP_LAUNCHER", "1".to_string()),
        ("LOCKSTEP_TAG", tag(plan, local_rank)),
        ("TORCHELASTIC_USE_AGENT_STORE", "True".to_string()),
        ("TORCHELASTIC_RESTART_COUNT", attempt.to_string()),
        (
            TRACE_ENV,
            trace_path(plan, global_rank(plan, local_rank))
                .display()
                .to_string(),
        ),
    ];
    match &plan.devices {
        Devices::Gpus(ids) => {
            env.push(("CUDA_VISIBLE_DEVICES", ids[local_rank].to_string()));
            // CUDA's default order is "fastest first"; --gpus ids are nvidia-smi/NVML (PCI bus)
            // indices, so make CUDA count the same way unless the user chose otherwise.
            if std::env::var_os("CUDA_DEVICE_ORDER").is_none() {
                env.push(("CUDA_DEVICE_ORDER", "PCI_BUS_ID".to_string()));
            }
        }
        // Empty, not unset: a CPU worker must not pick up a GPU through an inherited value.
        Devices::Cpu(_) => env.push(("CUDA_VISIBLE_DEVICES", String::new())),
    }
    env
}

/// Where rank `rank` keeps its trace file: beside its log, absolute because the worker reads
/// it from the environment.
pub(super) fn trace_path(plan: &LaunchPlan, rank: usize) -> PathBuf {
    let dir = std::path::absolute(&plan.log_dir).unwrap_or_else(|_| plan.log_dir.clone());
    dir.join(format!("rank_{rank}.trace"))
}

/// Ranks are numbered node by node: node `r` holds `r * local_world ..`.
pub(super) fn global_rank(plan: &LaunchPlan, local_rank: usize) -> usize {
    plan.node.node_rank * plan.devices.local_world() + local_rank
}

/// `[GPU<physical id>]` or `[CPU<global rank>]`.
pub(super) fn tag(plan: &LaunchPlan, local_rank: usize) -> String {
    match &plan.devices {
        Devices::Gpus(ids) => format!("[GPU{}]", ids[local_rank]),
        Devices::Cpu(_) => format!("[CPU{}]", global_rank(plan, local_rank)),
    }
}

/// Starts every local worker of attempt `attempt`. If one cannot be started, the ones
/// already running are killed and reaped before the error is returned.
pub(super) fn spawn_all(
    plan: &LaunchPlan,
    master_port: u16,
    attempt: usize,
    program: &Path,
    args: &[String],
    sinks: &Sinks,
) -> Result<Vec<Worker>> {
    let mut workers: Vec<Worker> = Vec::new();
    for local_rank in 0..plan.devices.local_world() {
        match spawn_one(plan, master_port, attempt, local_rank, program, args, sinks) {
            Ok(w) => workers.push(w),
            Err(e) => {
                for w in &mut workers {
                    kill_group(w.pid(), libc::SIGKILL);
                    let _ = w.child.wait();
                }
                return Err(e);
            }
        }
    }
    Ok(workers)
}

fn spawn_one(
    plan: &LaunchPlan,
    master_port: u16,
    attempt: usize,
    local_rank: usize,
    program: &Path,
    args: &[String],
    sinks: &Sinks,
) -> Result<Worker> {
    let env = worker_env(plan, master_port, attempt, local_rank);
    let rank = global_rank(plan, local_rank);
    let log_path = plan.log_dir.join(format!("rank_{rank}.log"));
    let mut log = OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log_path)
        .with_context(|| format!("opening {}", log_path.display()))?;
    if attempt > 0 {
        // Every attempt appends to the same log; mark where this one starts.
        let _ = writeln!(
            log,
            "{} lockstep run: restart {attempt}: the worker starts again",
            tag(plan, local_rank)
        );
    }
    // A trace left by the previous attempt must not be read as this one's.
    let trace = trace_path(plan, rank);
    let _ = std::fs::remove_file(&trace);

    // One pipe for stdout and stderr, like `2>&1`: a single reader sees the lines in the order
    // the worker wrote them, so an error stays after the lines that led to it.
    let (pipe, writer) = std::io::pipe().context("creating a pipe for a worker's output")?;
    let mut cmd = Command::new(program);
    cmd.args(args)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .stdout(writer.try_clone().context("duplicating a pipe")?)
        .stderr(writer)
        // Own process group: a terminal Ctrl-C reaches only the launcher, which decides what
        // the workers get, and killpg() reaches everything a worker started.
        .process_group(0);
    let launcher = std::process::id() as libc::pid_t;
    // SAFETY: runs in the forked child before exec; it calls only prctl, getppid and _exit,
    // which are async-signal-safe, and touches no memory but the copied `launcher` value.
    unsafe {
        cmd.pre_exec(move || {
            // Die with the launcher even if it is SIGKILLed and cannot clean up.
            if libc::prctl(
                libc::PR_SET_PDEATHSIG,
                libc::SIGKILL as libc::c_ulong,
                0,
                0,
                0,
            ) != 0
            {
                return Err(std::io::Error::last_os_error());
            }
            // The launcher may have died between fork and prctl; then the death signal will
            // never come, so leave now instead of running as an orphan.
            if libc::getppid() != launcher {
                libc::_exit(1);
            }
            Ok(())
        });
    }
    let spawned = cmd.spawn();
    // The command holds our copies of the pipe's write end; without dropping them the reader
    // would never see end-of-file.
    drop(cmd);
    let child = spawned.with_context(|| format!("starting rank {rank}: {}", program.display()))?;

    let show_all = plan.log_ranks == LogRanks::All || (plan.node.node_rank == 0 && local_rank == 0);
    let output = Arc::new(RankOutput::new(
        tag(plan, local_rank),
        show_all,
        Arc::clone(&sinks.console),
        log,
    ));
    let mut worker = Worker {
        rank,
        gpu: match &plan.devices {
            Devices::Gpus(ids) => Some(ids[local_rank]),
            Devices::Cpu(_) => None,
        },
        child,
        output,
        log_path,
        trace,
    };
    // The thread is detached: it ends at end-of-file, which `RankOutput::wait_closed` awaits.
    if let Err(e) = worker.output.follow(pipe) {
        kill_group(worker.pid(), libc::SIGKILL);
        let _ = worker.child.wait();
        return Err(e).context("starting an output thread");
    }
    Ok(worker)
}

/// Sends `sig` to the process group led by `pid`. Callers only pass workers that are not yet
/// reaped, so the id cannot have been reused by an unrelated group.
pub(super) fn kill_group(pid: u32, sig: libc::c_int) {
    // SAFETY: plain syscall; a group that no longer exists gives ESRCH, which is fine.
    unsafe {
        libc::killpg(pid as libc::pid_t, sig);
    }
}
