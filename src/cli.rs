//! The command line: argument types and dispatch. `main.rs` only maps errors to exit codes.

use std::path::PathBuf;

use anyhow::Result;
use clap::{Args, Parser, Subcommand};

use crate::config::{self, schema, Resolved, Sources};
use crate::train::{self, Resume, RunOptions, Topology};
use crate::{commands, dist, launch};

#[derive(Parser, Debug)]
#[command(
    name = "lockstep",
    version,
    about = "LLaMA pretraining on libtorch: prepare data, train, launch ranks, export, evaluate, generate"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Tokenize the corpus once into a memory-mapped token file in the cache.
    Prepare(ConfigArgs),
    /// Train one rank (a single process, or one rank under torchrun/Slurm variables).
    Train {
        #[command(flatten)]
        config: ConfigArgs,
        /// `auto` = the latest complete checkpoint (fresh start if none), or a checkpoint directory.
        #[arg(long, value_name = "auto|DIR")]
        resume: Option<Resume>,
        /// Save a checkpoint and exit 0 after step N (the LR schedule still spans max_steps).
        #[arg(long, value_name = "N")]
        stop_at_step: Option<usize>,
    },
    /// Launch one `train` worker per GPU (or N CPU workers) and supervise them: prefixed logs,
    /// per-rank log files, teardown of all workers when one fails.
    Run {
        #[command(flatten)]
        launch: LaunchArgs,
        #[command(flatten)]
        config: ConfigArgs,
        /// Passed to every worker: `auto` or a checkpoint directory.
        #[arg(long, value_name = "auto|DIR")]
        resume: Option<String>,
        /// Passed to every worker.
        #[arg(long, value_name = "N")]
        stop_at_step: Option<usize>,
    },
    /// Write a checkpoint as a Hugging Face directory (config.json, generation_config.json,
    /// safetensors, sharded above --max-shard-mb; tokenizer files when data.tokenizer is a
    /// tokenizer.json). The config flags locate the run, as for `train`.
    Export {
        #[command(flatten)]
        export: commands::export::ExportArgs,
        #[command(flatten)]
        config: ConfigArgs,
    },
    /// Mean loss and perplexity of a model directory on a text or token file, over consecutive
    /// non-overlapping windows from the start.
    Eval(commands::eval::EvalArgs),
    /// Continue a prompt with a model directory: KV-cached, greedy or temperature + top-p.
    Generate(commands::generate::GenerateArgs),
    /// Print the resolved config, the table of keys, or the docs/CONFIG.md markdown.
    Config {
        #[command(flatten)]
        config: ConfigArgs,
        /// List every key with type, default and meaning.
        #[arg(long)]
        keys: bool,
        /// Print docs/CONFIG.md.
        #[arg(long, conflicts_with = "keys")]
        markdown: bool,
    },
}

#[derive(Args, Debug, Clone, Default)]
pub struct ConfigArgs {
    /// Preset to start from: production (default), debug, tiny.
    #[arg(long, value_name = "NAME")]
    pub preset: Option<String>,
    /// Same as --preset debug.
    #[arg(long, conflicts_with = "preset")]
    pub debug: bool,
    /// JSON file deep-merged over the preset.
    #[arg(long, value_name = "FILE.json")]
    pub config: Option<PathBuf>,
    /// Override one key, e.g. --set training.learning_rate=3e-4 (repeatable).
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    pub sets: Vec<String>,
    /// Optimizer steps (overrides training.max_steps).
    #[arg(long, value_name = "N")]
    pub max_steps: Option<usize>,
}

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
    #[arg(long, default_value_t = 1)]
    pub nnodes: usize,
    #[arg(long, default_value_t = 0)]
    pub node_rank: usize,
    #[arg(long, default_value = "127.0.0.1")]
    pub master_addr: String,
    /// Rendezvous port; 0 picks a free one (single node only).
    #[arg(long, default_value_t = 0)]
    pub master_port: u16,
    /// `all` shows every rank's lines; by default rank 0's lines and other ranks' warnings/errors.
    #[arg(long, value_name = "rank0|all", default_value = "rank0")]
    pub log_ranks: String,
    /// Seconds between SIGTERM and SIGKILL when tearing workers down.
    #[arg(long, default_value_t = 10)]
    pub grace_s: u64,
}

impl ConfigArgs {
    /// The same config flags, for a worker's command line.
    pub fn to_args(&self) -> Vec<String> {
        let mut a = Vec::new();
        if self.debug {
            a.push("--debug".to_string());
        }
        if let Some(p) = &self.preset {
            a.extend(["--preset".to_string(), p.clone()]);
        }
        if let Some(c) = &self.config {
            a.extend(["--config".to_string(), c.display().to_string()]);
        }
        for s in &self.sets {
            a.extend(["--set".to_string(), s.clone()]);
        }
        if let Some(n) = self.max_steps {
            a.extend(["--max-steps".to_string(), n.to_string()]);
        }
        a
    }

    pub fn resolve(&self) -> Result<Resolved, config::ConfigError> {
        config::resolve(&Sources {
            preset: if self.debug {
                Some("debug".into())
            } else {
                self.preset.clone()
            },
            config_file: self.config.clone(),
            sets: self.sets.clone(),
            max_steps: self.max_steps,
        })
    }
}

pub fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Prepare(args) => {
            let resolved = args.resolve()?;
            train::setup::prepare_data(&resolved.config, "[CPU0]")?;
            Ok(())
        }
        Command::Train {
            config,
            resume,
            stop_at_step,
        } => {
            let resolved = config.resolve()?;
            let opts = RunOptions {
                resume,
                stop_at_step,
            };
            train_rank(&resolved, &opts)?;
            Ok(())
        }
        Command::Run {
            launch,
            config,
            resume,
            stop_at_step,
        } => {
            let code = run_launcher(&launch, &config, resume, stop_at_step)?;
            std::process::exit(code);
        }
        Command::Export { export, config } => {
            let resolved = config.resolve()?;
            commands::export::run(&resolved, &export)
        }
        Command::Eval(args) => commands::eval::run(&args),
        Command::Generate(args) => commands::generate::run(&args),
        Command::Config {
            config,
            keys,
            markdown,
        } => {
            if markdown {
                print!("{}", schema::markdown_table());
            } else if keys {
                for k in schema::KEYS {
                    println!(
                        "{:<34} {:<28} default {:<22} {}",
                        k.key,
                        k.kind.describe(),
                        k.default,
                        k.doc
                    );
                }
            } else {
                println!(
                    "{}",
                    serde_json::to_string_pretty(&config.resolve()?.to_json())?
                );
            }
            Ok(())
        }
    }
}

/// `lockstep run`: resolve the config and prepare the data once here, then start the workers.
fn run_launcher(
    la: &LaunchArgs,
    config: &ConfigArgs,
    resume: Option<String>,
    stop_at: Option<usize>,
) -> Result<i32> {
    let resolved = config.resolve()?;
    let devices = choose_devices(la)?;
    let run_id = format!(
        "{}-{}",
        train::setup::run_dir(&resolved)
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or("run"),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs())
    );
    let plan = launch::preflight(&launch::LaunchPlan {
        devices,
        nnodes: la.nnodes,
        node_rank: la.node_rank,
        master_addr: la.master_addr.clone(),
        master_port: la.master_port,
        log_dir: PathBuf::from("logs").join(run_id),
        grace: std::time::Duration::from_secs(la.grace_s),
        log_all_ranks: la.log_ranks == "all",
    })?;
    if matches!(plan.devices, launch::Devices::Cpu(_))
        && resolved.config.system.dist_backend == "nccl"
    {
        return Err(config::ConfigError(
            "system.dist_backend = nccl needs GPU workers, but lockstep run starts CPU workers \
             (--cpu, or no GPU found); use system.dist_backend=auto or ring, or pick GPUs with --gpus"
                .to_owned(),
        )
        .into());
    }
    // Tokenize before any worker starts, so no rank waits on it under a collective timeout.
    train::setup::prepare_data(&resolved.config, "[launcher]")?;
    // Likewise a Hub model missing from the cache is downloaded once, here, not by the ranks.
    if let Some(model) = &resolved.config.model.model_path {
        crate::data::hub::resolve_model(model)?;
    }
    if let launch::Devices::Cpu(n) = plan.devices {
        // N CPU workers share the cores; libtorch would otherwise give each all of them.
        if std::env::var_os("OMP_NUM_THREADS").is_none() {
            let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
            std::env::set_var("OMP_NUM_THREADS", (cores / n).max(1).to_string());
        }
    }
    let mut args = vec!["train".to_string()];
    args.extend(config.to_args());
    if let Some(r) = resume {
        args.extend(["--resume".to_string(), r]);
    }
    if let Some(s) = stop_at {
        args.extend(["--stop-at-step".to_string(), s.to_string()]);
    }
    let exe = std::env::current_exe()?;
    eprintln!(
        "[launcher] {} workers, rendezvous on port {}, logs in {}",
        plan.devices.local_world(),
        plan.master_port,
        plan.log_dir.display()
    );
    launch::launch(&plan, &exe, &args)
}

fn choose_devices(la: &LaunchArgs) -> Result<launch::Devices> {
    use launch::Devices;
    if la.cpu {
        return Ok(Devices::Cpu(la.nproc.unwrap_or(1)));
    }
    match la.gpus.as_deref() {
        Some("auto-free") => {
            let found = launch::detect_gpus();
            anyhow::ensure!(
                !found.is_empty(),
                "--gpus auto-free: no GPU found through NVML; use --cpu"
            );
            Ok(Devices::Gpus(launch::pick_free_gpus(
                &found,
                la.nproc.unwrap_or(1),
            )))
        }
        Some(list) => Ok(Devices::Gpus(launch::parse_gpu_list(list)?)),
        None => {
            let found = launch::detect_gpus();
            if found.is_empty() {
                Ok(Devices::Cpu(la.nproc.unwrap_or(1)))
            } else {
                let n = la.nproc.unwrap_or(found.len()).min(found.len());
                Ok(Devices::Gpus(
                    found.iter().take(n).map(|g| g.index).collect(),
                ))
            }
        }
    }
}

/// `lockstep train`: a single process, or one rank when torchrun/`lockstep run` variables are set.
fn train_rank(resolved: &Resolved, opts: &RunOptions) -> Result<()> {
    let timeout = std::time::Duration::from_secs(resolved.config.system.collective_timeout_s);
    match dist::DistEnv::from_env()? {
        None => {
            train::train(resolved, opts, Topology::SINGLE, &mut dist::SingleProcess)?;
        }
        Some(env) => {
            let topo = Topology {
                rank: env.rank,
                world: env.world_size,
                local_rank: env.local_rank,
            };
            let device = train::setup::resolve_device(&resolved.config, topo)?;
            let backend = train::setup::dist_backend(&resolved.config, device)?;
            let mut pg = dist::init(&env, timeout, backend)?;
            if let (dist::Backend::Nccl { .. }, 0, 2..) = (backend, env.rank, env.world_size) {
                println!(
                    "{} Collectives: NCCL {} (c10d ProcessGroupNCCL) for gradients and parameters, TCP ring for scalars",
                    crate::telemetry::rank_tag(true, 0),
                    dist::nccl::version()?
                );
            }
            train::train(resolved, opts, topo, pg.as_mut())?;
        }
    }
    Ok(())
}
