//! `lockstep plan`: what a configuration needs per rank — memory by buffer for every zero stage
//! and activation checkpointing mode, FLOPs, step time, communication (data-parallel and, with
//! `system.tensor_parallel` and `system.context_parallel`, inside the TP and CP groups),
//! scaling — and whether it fits, with the tensor or context parallelism to switch to where
//! data parallelism alone falls short, before anything is prepared or allocated; and what a
//! checkpoint save writes, stages in host memory and stalls at a stated storage bandwidth. The estimate is `crate::plan`'s, the
//! same one `train` checks at start.

use anyhow::Result;
use clap::{Args, ValueEnum};

use crate::config::{usage, DeviceChoice, Resolved};
use crate::plan::{self, report, start, Layout, Setting, Target};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum PlanDevice {
    Cpu,
    Cuda,
}

#[derive(Args, Debug, Clone)]
pub struct PlanArgs {
    /// Ranks in all (GPUs, or CPU processes with --device cpu): the data-parallel ranks ×
    /// system.context_parallel × system.tensor_parallel.
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub gpus: usize,
    /// Memory per rank in GB. Default: what `train` checks against on this machine —
    /// system.memory_budget_gb where set, else the visible GPU's free memory (80 GB assumed
    /// without one), or with --device cpu this machine's MemAvailable shared by the ranks.
    #[arg(long, value_name = "GB")]
    pub gpu_memory_gb: Option<f64>,
    /// The device to plan for (default: what `train` would use). `cpu` estimates the peak
    /// RSS of a CPU run, libtorch's runtime included.
    #[arg(long, value_enum)]
    pub device: Option<PlanDevice>,
    /// Assumed fraction of the device's peak FLOP/s reached (step time and tokens/s).
    #[arg(long, default_value_t = 0.4)]
    pub mfu: f64,
    /// GB/s one node writes to the checkpoint storage, durably (fsync included), shared by the
    /// node's ranks: the stall of a synchronous save and the background writer's time.
    #[arg(long, value_name = "GB/S", default_value_t = plan::checkpoint::DEFAULT_STORAGE_GBPS)]
    pub storage_gbps: f64,
    /// Print one JSON object: every rank layout with its breakdown in bytes, total_bytes and
    /// fits; FLOPs, step time, communication, scaling, the advice and the checkpoint's cost.
    #[arg(long)]
    pub json: bool,
}

pub fn run(resolved: &Resolved, args: &PlanArgs) -> Result<()> {
    let cfg = &resolved.config;
    usage(args.gpus >= 1, || {
        "--gpus 0: plan for at least one rank".into()
    })?;
    usage(args.mfu > 0.0 && args.mfu <= 1.0, || {
        format!("--mfu {}: a fraction in (0, 1]", args.mfu)
    })?;
    usage(
        args.storage_gbps > 0.0 && args.storage_gbps.is_finite(),
        || {
            format!(
                "--storage-gbps {}: a bandwidth above 0 GB/s",
                args.storage_gbps
            )
        },
    )?;
    let device = match args.device {
        Some(PlanDevice::Cpu) => plan::Device::Cpu,
        Some(PlanDevice::Cuda) => plan::Device::Cuda,
        None => match cfg.system.device {
            DeviceChoice::Cpu => plan::Device::Cpu,
            DeviceChoice::Cuda => plan::Device::Cuda,
            DeviceChoice::Auto if crate::sys::cuda::cuda_available() => plan::Device::Cuda,
            DeviceChoice::Auto => plan::Device::Cpu,
        },
    };
    let world = args.gpus;
    // The same rules `train` and `lockstep run` check at start-up.
    crate::config::check_ranks(
        cfg,
        world,
        device == plan::Device::Cuda,
        "lockstep plan plans CPU ranks (--device cpu, system.device = cpu, or no GPU visible)",
    )?;
    // What `train` would check against on this machine (`start::rank_budget`: the ranks
    // planned for all on this node), unless --gpu-memory-gb says otherwise.
    let budget = match args.gpu_memory_gb {
        Some(g) => (g * 1e9, "--gpu-memory-gb".to_string()),
        None => start::rank_budget(cfg, device, 0, world).unwrap_or_else(|| match device {
            plan::Device::Cuda => (80e9, "80 GB assumed: no GPU visible".to_string()),
            plan::Device::Cpu => (0.0, "MemAvailable unreadable".to_string()),
        }),
    };
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let cpu_threads = match cfg.system.num_threads {
        0 => (cores / world).max(1),
        n => n,
    };
    let shape = plan::shape(cfg)?;
    // A model read from model.model_path is checked against system.tensor_parallel here.
    crate::config::check_tensor_parallel(
        cfg.system.tensor_parallel,
        (shape.num_heads, shape.num_kv_heads, &shape.mlp_widths()),
        "the model (model.model_path's config.json)",
    )?;
    crate::config::check_pipeline_layers(
        cfg,
        shape.num_layers,
        "the model (model.model_path's config.json)",
    )?;
    let setting = Setting::new(
        cfg,
        shape,
        Target {
            device,
            world,
            budget,
            mfu: args.mfu,
            cpu_threads,
            storage_bw: args.storage_gbps * 1e9,
        },
    );
    let layout = Layout::from_config(cfg);
    let mut r = report::build(&setting, &layout);
    r.downstream = downstream(cfg, &setting, r.step_seconds)?;
    let mut notes = crate::config::world_notes(
        cfg,
        world,
        device == plan::Device::Cuda,
        setting.shape.num_layers,
    );
    notes.extend(plan::pipeline::micro_batch_note(&setting, &layout));
    if args.json {
        println!("{}", serde_json::to_string_pretty(&r)?);
    } else {
        print!("{}", report::text(&r, &setting));
    }
    for note in notes {
        eprintln!("Warning: {note}");
    }
    Ok(())
}

/// What `training.eval_tasks` costs each time it runs (None without tasks): the task files read
/// and encoded as training reads them.
fn downstream(
    cfg: &crate::config::Config,
    setting: &Setting,
    step_seconds: f64,
) -> Result<Option<plan::downstream::Downstream>> {
    let Some((tasks, requests)) = crate::data::tasks::of_config(cfg)? else {
        return Ok(None);
    };
    let items = tasks.iter().map(|t| t.items.len()).sum();
    Ok(Some(plan::downstream::estimate(
        setting,
        cfg.system.zero_stage,
        &requests,
        (tasks.len(), items),
        step_seconds,
        cfg.training.eval_interval,
    )))
}
