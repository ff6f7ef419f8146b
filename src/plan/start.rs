//! The start check: before the model is built, the plan's per-rank estimate against what the
//! rank has (`system.memory_check`), and the launcher's check of its CPU worker count. What a
//! rank has is decided once, by [`rank_budget`], for `train`'s check and for `lockstep plan`
//! on the same machine alike.
//!
//! On a CPU rank the estimate includes `checkpoint.async`'s staging copy (host memory like the
//! rest, `memory.rs`). On a GPU the staging buffers are pinned host memory: those of the
//! node's writing ranks are compared with MemAvailable separately, and a shortfall is a
//! warning, not a refusal, since saves then fall back to synchronous ones at run time.
//!
//! A config that cannot fit is refused with exit code 2, like any other config error: it is
//! found before anything is allocated or written, and the fix is a change of config keys
//! (the message names them), not of the machine's state.

use anyhow::Result;

use super::device::Device;
use super::memory::{self, gb};
use super::setting::{Layout, Setting, Target};
use super::{checkpoint, report};
use crate::config::{Config, ConfigError, MemoryCheck};
use crate::model::LlamaShape;
use crate::sys::machine;

/// The memory one rank may use, and where the figure comes from: `system.memory_budget_gb`
/// where set; on a GPU its free memory (NVML, the device behind CUDA index `cuda_index`);
/// on a CPU the host's MemAvailable shared by the `local` ranks of this node (torchrun's
/// LOCAL_WORLD_SIZE, Slurm's tasks on this node, `lockstep run`'s workers, `lockstep plan
/// --gpus`). None when it cannot be read. The one rule `train` checks against at start and
/// `lockstep plan` plans with.
pub fn rank_budget(
    cfg: &Config,
    device: Device,
    cuda_index: usize,
    local: usize,
) -> Option<(f64, String)> {
    let set = cfg.system.memory_budget_gb;
    if set > 0.0 {
        return Some((set * 1e9, "system.memory_budget_gb".into()));
    }
    match device {
        Device::Cuda => machine::gpu_memory(cuda_index).map(|(free, total)| {
            (
                free,
                format!("free on cuda:{cuda_index} (NVML; {} in all)", gb(total)),
            )
        }),
        Device::Cpu => {
            let local = local.max(1);
            machine::mem_available().map(|avail| {
                let shared = if local > 1 {
                    format!(" / {local} ranks on this node")
                } else {
                    String::new()
                };
                (
                    avail / local as f64,
                    format!("MemAvailable {}{shared}", gb(avail)),
                )
            })
        }
    }
}

/// Where a rank that checks at start sits.
pub struct Starting<'a> {
    /// The rank's log prefix (`[GPU0]`).
    pub tag: &'a str,
    /// Rank 0: the one that prints.
    pub lead: bool,
    pub device: Device,
    /// The CUDA index the rank sees (0 on a CPU).
    pub cuda_index: usize,
    /// Ranks on this node, sharing its host memory.
    pub local: usize,
    /// Ranks in all.
    pub world: usize,
    /// The rank's compute threads (a CPU's peak FLOP/s).
    pub cpu_threads: usize,
}

/// `system.memory_check` before the model is allocated: the plan's per-rank peak against the
/// rank's budget. Refuses (a `ConfigError`, exit code 2) a config that does not fit, with the
/// cheapest change that does; `warn` prints the same and goes on.
pub fn check(cfg: &Config, shape: &LlamaShape, at: &Starting) -> Result<Option<(Setting, Layout)>> {
    if cfg.system.memory_check == MemoryCheck::Off {
        return Ok(None);
    }
    let tag = at.tag;
    let Some(budget) = rank_budget(cfg, at.device, at.cuda_index, at.local) else {
        if at.lead {
            println!("{tag} Memory check skipped: this device's free memory cannot be read (set system.memory_budget_gb)");
        }
        return Ok(None);
    };
    let setting = start_setting(cfg, shape, at.device, at.world, budget, at.cpu_threads);
    let layout = Layout::from_config(cfg);
    let r = report::build(&setting, &layout);
    let planned = Some((setting, layout));
    let host_staging = match at
        .lead
        .then(|| host_staging(&r, at.local, machine::mem_available()?))
        .flatten()
    {
        Some(HostStaging::Fits(note)) => format!("; {note}"),
        Some(HostStaging::Short(warning)) => {
            eprintln!("{tag} WARNING: {warning}");
            String::new()
        }
        None => String::new(),
    };
    let memory = &r.configured.memory;
    if r.fits {
        if at.lead {
            let staging = if memory.staging > 0.0 {
                format!(
                    ", checkpoint.async's staging copy of {} included",
                    gb(memory.staging)
                )
            } else {
                String::new()
            };
            println!(
                "{tag} Memory plan: {} per rank estimated{staging}, {} available ({}){host_staging}",
                gb(r.configured.total_bytes),
                gb(r.budget_bytes),
                r.budget_source
            );
        }
        return Ok(planned);
    }
    let breakdown: Vec<String> = memory
        .parts()
        .iter()
        .filter(|(_, b)| *b > 0.0)
        .map(|(part, b)| match part {
            memory::Part::Staging => format!("checkpoint.async staging {}", gb(*b)),
            part => format!("{} {}", part.name(), gb(*b)),
        })
        .collect();
    let during = if memory.peak_during == memory::PeakPhase::CheckpointSave {
        " during a checkpoint save"
    } else {
        ""
    };
    let message = format!(
        "this config needs an estimated {} per rank{during} ({}), but {} is available ({}). {} `lockstep plan` with the same flags shows the breakdown; system.memory_check=warn starts anyway.",
        gb(r.configured.total_bytes),
        breakdown.join(", "),
        gb(r.budget_bytes),
        r.budget_source,
        report::advice_text(&r)
    );
    if cfg.system.memory_check == MemoryCheck::Warn {
        eprintln!("{tag} WARNING: {message}");
        return Ok(planned);
    }
    Err(ConfigError(message).into())
}

/// The plan's setting for a check at start-up: `world` ranks on `device` with `budget` bytes
/// each, at the plan's assumed 40% utilisation and default storage bandwidth.
fn start_setting(
    cfg: &Config,
    shape: &LlamaShape,
    device: Device,
    world: usize,
    budget: (f64, String),
    cpu_threads: usize,
) -> Setting {
    Setting::new(
        cfg,
        shape.clone(),
        Target {
            device,
            world,
            budget,
            mfu: 0.4,
            cpu_threads,
            storage_bw: checkpoint::DEFAULT_STORAGE_GBPS * 1e9,
        },
    )
}

/// The launcher's check before it starts `nproc` CPU workers on this node (`world` in all):
/// they share the host's MemAvailable, so a worker count whose share is too small is refused
/// here, once, with the largest count that fits, instead of by every worker with advice meant
/// for GPUs ("use more ranks" only adds copies on one host). Skipped where
/// `system.memory_check` is off, `system.memory_budget_gb` is set (the workers check that), or
/// the memory cannot be read.
pub fn check_cpu_workers(
    cfg: &Config,
    shape: &LlamaShape,
    nproc: usize,
    nnodes: usize,
) -> Result<()> {
    if cfg.system.memory_check == MemoryCheck::Off || cfg.system.memory_budget_gb > 0.0 {
        return Ok(());
    }
    let Some(avail) = machine::mem_available() else {
        return Ok(());
    };
    let need = |k: usize| {
        let setting = start_setting(
            cfg,
            shape,
            Device::Cpu,
            k * nnodes,
            (avail / k as f64, "MemAvailable".into()),
            1,
        );
        let r = report::build(&setting, &Layout::from_config(cfg));
        (r.fits, r.configured.total_bytes)
    };
    let (fits, per_worker) = need(nproc);
    if fits {
        return Ok(());
    }
    let most = (1..nproc).rev().find(|&k| need(k).0);
    let fix = match most {
        Some(k) => format!("use --nproc {k} or fewer (the most whose share fits)"),
        None => "even one worker does not fit: use a smaller model or shorter context (`lockstep plan` shows the breakdown)".into(),
    };
    let message = format!(
        "--nproc {nproc}: {nproc} CPU workers on this node share MemAvailable {}, {} each, but \
         each needs an estimated {}; more workers on one host only add copies. {fix}; \
         system.memory_check=warn starts anyway.",
        gb(avail),
        gb(avail / nproc as f64),
        gb(per_worker)
    );
    if cfg.system.memory_check == MemoryCheck::Warn {
        eprintln!("[launcher] WARNING: {message}");
        return Ok(());
    }
    Err(ConfigError(message).into())
}

/// What the host-memory check of `checkpoint.async`'s staging buffers on a GPU found.
enum HostStaging {
    /// They fit: a note for the memory plan's line.
    Fits(String),
    /// They do not: a warning (saves will be synchronous).
    Short(String),
}

/// On a GPU, `checkpoint.async`'s pinned host staging buffers of this node's writing ranks
/// (of its `local` ranks) against the host's MemAvailable `avail`. None where nothing is
/// staged in pinned memory (CPU ranks count their copy in their estimate;
/// `checkpoint.async=false`). Where the buffers and the headroom a save keeps free do not fit, saves fall back to
/// synchronous ones at run time (`Checkpointer`): a warning, not a refusal, that says how long
/// they would stall.
fn host_staging(r: &report::Report, local: usize, avail: f64) -> Option<HostStaging> {
    let c = &r.checkpoint;
    if c.staging_in_rank_memory || c.staging_bytes_per_rank == 0.0 {
        return None;
    }
    let writers = local.min(c.writing_ranks);
    let need = c.staging_bytes_per_rank * writers as f64;
    let what = format!(
        "checkpoint.async stages {} in pinned host memory on this node ({writers} writing rank{} × {})",
        gb(need),
        if writers == 1 { "" } else { "s" },
        gb(c.staging_bytes_per_rank)
    );
    Some(if need + checkpoint::STAGING_HEADROOM < avail {
        HostStaging::Fits(format!("{what}, MemAvailable {}", gb(avail)))
    } else {
        HostStaging::Short(format!(
            "{what}, but MemAvailable is {} (and a save keeps {} free): saves will be written synchronously, stalling training for the whole write (estimated {:.1} s per save at {:.1} GB/s per node). Set checkpoint.async=false to plan for that, or free host memory.",
            gb(avail),
            gb(checkpoint::STAGING_HEADROOM),
            c.stall_sync_seconds,
            c.storage_bandwidth / 1e9
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(sets: &[&str], world: usize, device: Device) -> report::Report {
        let mut all = vec!["model.num_layers=8", "model.vocab_size=128256"];
        all.extend(sets);
        let (mut s, l) = super::super::test_setting(&all, world);
        s.device = device;
        report::build(&s, &l)
    }

    #[test]
    fn a_gpu_node_checks_its_pinned_staging_copies_against_mem_available() {
        let r = report(&[], 8, Device::Cuda);
        let per_rank = r.checkpoint.staging_bytes_per_rank;
        assert!(per_rank > 0.0);
        // 8 ranks on this node, all writing: their 8 copies and the 1 GB a save keeps free.
        let node = 8.0 * per_rank;
        match host_staging(&r, 8, node + checkpoint::STAGING_HEADROOM + 1e9) {
            Some(HostStaging::Fits(note)) => {
                assert!(note.contains("(8 writing ranks × "), "{note}")
            }
            _ => panic!("room for the copies"),
        }
        match host_staging(&r, 8, node) {
            Some(HostStaging::Short(w)) => {
                for part in [
                    "checkpoint.async stages ",
                    "saves will be written synchronously",
                    "Set checkpoint.async=false",
                ] {
                    assert!(w.contains(part), "expected `{part}` in {w}");
                }
            }
            _ => panic!("no room for the copies"),
        }
        // Four ranks on this node hold half as much.
        assert!(matches!(
            host_staging(&r, 4, node / 2.0 + checkpoint::STAGING_HEADROOM + 1e9),
            Some(HostStaging::Fits(_))
        ));
        // Nothing pinned: a CPU rank counts its copy in its own estimate, and without
        // checkpoint.async there is none.
        let cpu = report(&[], 8, Device::Cpu);
        assert!(host_staging(&cpu, 8, 0.0).is_none());
        let sync = report(&["checkpoint.async=false"], 8, Device::Cuda);
        assert!(host_staging(&sync, 8, 0.0).is_none());
    }
}
