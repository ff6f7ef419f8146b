//! `lockstep run` from the command line's point of view: pick this node's devices, check what
//! can be checked before anything starts (port, run directory, the config against the
//! devices), prepare the data once, write the workers' spec, then launch and supervise.
//! Under `srun --ntasks-per-node=1` the node layout comes from Slurm's variables.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::Args;

use super::gpus::{detect_gpus, parse_gpu_list, pick_free_gpus};
use super::launcher::{launch_in, preflight, Job};
use super::plan::{Devices, LaunchPlan, LogRanks, RestartPolicy};
use super::sinks::Sinks;
use crate::config::{ConfigError, DeviceChoice, Resolved};
use crate::dist::{slurm, NodePlace};
use crate::run::{self, Resume, RunDir, RunOptions, WorkerSpec};

/// `lockstep run`'s own flags (the training flags are `train`'s).
#[derive(Args, Debug, Clone)]
pub struct LaunchArgs {
    /// Workers on this node: the first N visible GPUs, or N CPU workers when there is no GPU.
    #[arg(long, value_name = "N")]
    pub nproc: Option<usize>,
    /// CPU workers even when GPUs are present.
    #[arg(long, conflicts_with = "gpus")]
    pub cpu: bool,
    /// GPU indices (`0,1,3`), or `auto-free` for the least-used --nproc GPUs (default 1).
    #[arg(long, value_name = "LIST|auto-free")]
    pub gpus: Option<String>,
    /// Nodes taking part (default 1, or SLURM_NNODES under srun).
    #[arg(long, value_name = "N")]
    pub nnodes: Option<usize>,
    /// This node's index (default 0, or SLURM_NODEID under srun).
    #[arg(long, value_name = "R")]
    pub node_rank: Option<usize>,
    /// Address of node 0, whose launcher hosts the rendezvous store there and nowhere else
    /// (default 127.0.0.1, or MASTER_ADDR / the first host of SLURM_JOB_NODELIST under srun).
    #[arg(long, value_name = "HOST")]
    pub master_addr: Option<String>,
    /// Rendezvous port; 0 picks a free one (single node only). Default 0, or MASTER_PORT / a
    /// port derived from SLURM_JOB_ID under srun.
    #[arg(long, value_name = "PORT")]
    pub master_port: Option<u16>,
    /// Restart all workers from the latest complete checkpoint after a failure, up to N times
    /// (0 = stop at the first failure).
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub max_restarts: usize,
    /// `all` shows every rank's lines; by default rank 0's lines and other ranks' warnings/errors.
    #[arg(long, value_enum, default_value_t = LogRanks::Rank0)]
    pub log_ranks: LogRanks,
    /// Seconds between SIGTERM and SIGKILL when tearing workers down.
    #[arg(long, default_value_t = 10)]
    pub grace_s: u64,
}

/// This node's place: the flags, else srun's variables, else a single node on loopback; and the
/// GPUs Slurm allocated on this node (the default worker count).
fn node_place(la: &LaunchArgs) -> Result<(NodePlace, Option<usize>)> {
    // Slurm's variables are checked before anything starts: a mistake there is a usage error.
    let slurm = slurm::node_layout(&|k| std::env::var(k).ok())
        .map_err(|e| ConfigError(format!("{e:#}")))?;
    if let Some(s) = &slurm {
        eprintln!("[launcher] {}", s.note);
    }
    let from = slurm.as_ref().map(|s| &s.place);
    let place = NodePlace {
        nnodes: la.nnodes.or(from.map(|s| s.nnodes)).unwrap_or(1),
        node_rank: la.node_rank.or(from.map(|s| s.node_rank)).unwrap_or(0),
        master_addr: la
            .master_addr
            .clone()
            .or(from.map(|s| s.master_addr.clone()))
            .unwrap_or_else(|| crate::dist::SINGLE_RANK_ADDR.to_string()),
        master_port: la.master_port.or(from.map(|s| s.master_port)).unwrap_or(0),
    };
    Ok((place, slurm.and_then(|s| s.gpus_on_node)))
}

/// Runs the launcher; returns the code to exit with (the failing worker's, once no restart
/// is left).
pub fn run(la: &LaunchArgs, resolved: &Resolved, opts: &RunOptions) -> Result<i32> {
    // Credentials taken out of the config reach the workers through their environment (which
    // they inherit), never through the spec file.
    if let Some(c) = &resolved.secrets.mlflow {
        std::env::set_var("MLFLOW_TRACKING_USERNAME", &c.username);
        std::env::set_var("MLFLOW_TRACKING_PASSWORD", &c.password);
    }
    let (node, slurm_gpus) = node_place(la)?;
    let devices = choose_devices(la, slurm_gpus)?;
    let resolved = for_workers(resolved, &devices)?;
    let plan = launch_plan(la, opts, &resolved, devices, node);
    // The rules that need the number of ranks, before anything is prepared or started.
    crate::config::check_ranks(
        &resolved.config,
        plan.devices.local_world() * plan.node.nnodes,
        matches!(plan.devices, Devices::Gpus(_)),
        "lockstep run starts CPU workers (--cpu, or no GPU found)",
    )?;
    crate::config::check_trains(&resolved.config)?;
    let rendezvous = preflight(&plan)?;
    let master_port = rendezvous.port();
    if plan.node.node_rank == 0 {
        // Rank 0 takes the lock when it starts; a run already in this directory is reported
        // now, before any tokenizing or worker start.
        RunDir::check_free(&resolved.run_dir(), &run::checkpoint_dir(&resolved))?;
    }
    before_workers(&resolved, &plan)?;
    std::fs::create_dir_all(&plan.log_dir)
        .with_context(|| format!("creating log directory {}", plan.log_dir.display()))?;
    // Launchers of several nodes may share the log directory (a shared filesystem, the same
    // second): each writes its own spec.
    let node_suffix = match plan.node.nnodes {
        1 => String::new(),
        _ => format!("_node{}", plan.node.node_rank),
    };
    let spec = |name: &str, options: RunOptions| -> Result<Vec<String>> {
        let path = plan.log_dir.join(format!("{name}{node_suffix}.json"));
        WorkerSpec {
            preset: resolved.preset.clone(),
            config: resolved.config.clone(),
            options,
        }
        .write(&path)?;
        Ok(worker_args(&path))
    };
    let args = spec("worker_spec", opts.clone())?;
    // A restart resumes (from the latest checkpoint, or where the first attempt resumed from
    // when the run has none of its own yet), with the same data order.
    let restart_args = |from: Option<&Path>| {
        let resume = Some(from.map_or(Resume::Auto, |d| Resume::Dir(d.to_path_buf())));
        spec(
            "worker_spec_restart",
            RunOptions {
                resume,
                ..opts.clone()
            },
        )
    };
    let exe = std::env::current_exe()?;
    eprintln!(
        "[launcher] {} workers, rendezvous on {}:{}{}, logs in {}",
        plan.devices.local_world(),
        plan.node.master_addr,
        master_port,
        match la.max_restarts {
            0 => String::new(),
            n => format!(", up to {n} restarts"),
        },
        plan.log_dir.display()
    );
    let job = Job {
        program: &exe,
        args,
        restart_args: Some(&restart_args),
    };
    Ok(launch_in(rendezvous, &plan, &job, &Sinks::stdio())?.exit_code)
}

/// What this node's launcher starts, and how: its devices and place, the rendezvous timeout,
/// the restart policy, and the log directory (`logs/<run>-<unix time>`).
fn launch_plan(
    la: &LaunchArgs,
    opts: &RunOptions,
    resolved: &Resolved,
    devices: Devices,
    node: NodePlace,
) -> LaunchPlan {
    let run_dir = resolved.run_dir();
    let run_id = format!(
        "{}-{}",
        run_dir
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or("run"),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs())
    );
    LaunchPlan {
        devices,
        node,
        rendezvous_timeout: std::time::Duration::from_secs(
            resolved.config.system.collective_timeout_s.max(1),
        ),
        restart: RestartPolicy {
            max_restarts: la.max_restarts,
            checkpoints: Some(run::checkpoint_dir(resolved)),
            resume_fallback: match &opts.resume {
                Some(Resume::Dir(d)) => Some(d.clone()),
                _ => None,
            },
        },
        log_dir: PathBuf::from("logs").join(run_id),
        grace: std::time::Duration::from_secs(la.grace_s),
        log_ranks: la.log_ranks,
    }
}

/// What is done once per node before any worker starts, so no rank waits on it under a
/// collective timeout: the task files checked, the data tokenized, a Hub model missing from the
/// cache downloaded, and CPU workers checked against this host's memory and cores.
fn before_workers(resolved: &Resolved, plan: &LaunchPlan) -> Result<()> {
    // A bad task file is found here, once, before the data is prepared (every rank reads them
    // again to encode them).
    let t = &resolved.config.training;
    if !t.eval_tasks.is_empty() {
        crate::data::tasks::load_tasks(&t.eval_tasks, "training.eval_tasks", None)?;
    }
    run::data::prepare_data(&resolved.config, "[launcher]")?;
    // A Hub model missing from the cache is downloaded once, here, not by each rank.
    if let Some(model) = &resolved.config.model.model_path {
        crate::data::hub::resolve_model(model)?;
    }
    if let Devices::Cpu(n) = plan.devices {
        // Before any worker starts: N CPU workers share this host's memory.
        if let Ok(shape) = crate::plan::shape(&resolved.config) {
            crate::plan::start::check_cpu_workers(&resolved.config, &shape, n, plan.node.nnodes)?;
        }
        let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
        if n > cores {
            eprintln!(
                "[launcher] Warning: --nproc {n} CPU workers on {cores} cores: each gets a \
                 fraction of a core and every collective waits for the slowest; --nproc {cores} \
                 or fewer runs faster"
            );
        }
        // N CPU workers share the cores; libtorch would otherwise give each all of them.
        if std::env::var_os("OMP_NUM_THREADS").is_none() {
            std::env::set_var("OMP_NUM_THREADS", (cores / n).max(1).to_string());
        }
    }
    Ok(())
}

fn worker_args(spec: &Path) -> Vec<String> {
    vec![
        "train".to_string(),
        "--worker-spec".to_string(),
        spec.display().to_string(),
    ]
}

/// The config as the workers will run it: GPU workers must compute on their GPU
/// (`system.device` auto becomes cuda, so a worker that cannot reach it fails instead of
/// training on the CPU under a `[GPU3]` tag), and CPU workers must not be asked for CUDA or NCCL.
fn for_workers(resolved: &Resolved, devices: &Devices) -> Result<Resolved> {
    let mut out = resolved.clone();
    let device = &mut out.config.system.device;
    match (devices, *device) {
        (Devices::Gpus(_), DeviceChoice::Cpu) => {
            return Err(ConfigError(
                "system.device = cpu, but lockstep run gives each worker a GPU; use --cpu for CPU workers, or system.device=auto"
                    .into(),
            )
            .into())
        }
        (Devices::Gpus(_), _) => *device = DeviceChoice::Cuda,
        (Devices::Cpu(_), DeviceChoice::Cuda) => {
            return Err(ConfigError(
                "system.device = cuda, but lockstep run starts CPU workers (--cpu, or no GPU found); pick GPUs with --gpus, or use system.device=auto"
                    .into(),
            )
            .into())
        }
        // system.dist_backend against CPU workers: `config::check_ranks` (with the world).
        (Devices::Cpu(_), _) => *device = DeviceChoice::Cpu,
    }
    Ok(out)
}

/// This node's workers: `--cpu`, `--gpus LIST|auto-free`, else every visible GPU (or `--nproc`
/// of them, or the SLURM_GPUS_ON_NODE Slurm allocated), else `--nproc` CPU workers when there
/// is no GPU.
fn choose_devices(la: &LaunchArgs, slurm_gpus: Option<usize>) -> Result<Devices> {
    if la.cpu {
        return Ok(Devices::Cpu(la.nproc.unwrap_or(1)));
    }
    let Some(gpus) = la.gpus.as_deref() else {
        let found = detect_gpus();
        if found.is_empty() {
            return Ok(Devices::Cpu(la.nproc.unwrap_or(1)));
        }
        let n = la
            .nproc
            .or(slurm_gpus)
            .unwrap_or(found.len())
            .min(found.len());
        return Ok(Devices::Gpus(
            found.iter().take(n).map(|g| g.index).collect(),
        ));
    };
    let found = detect_gpus();
    if found.is_empty() {
        bail!(
            "--gpus {gpus}: no NVIDIA GPU found on this machine (NVML lists none: no driver, or none visible); \
             run CPU workers with --cpu --nproc N instead"
        );
    }
    if gpus == "auto-free" {
        return Ok(Devices::Gpus(pick_free_gpus(&found, la.nproc.unwrap_or(1))));
    }
    Ok(Devices::Gpus(parse_gpu_list(gpus)?))
}
