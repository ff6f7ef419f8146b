//! Memory at the edges of a run: before the model is built, the plan's estimate is compared
//! with what the device has (`system.memory_check`); and when an allocation fails anyway, the
//! error names the phase, the memory in use and the plan's advice.
//!
//! On a CPU rank the estimate includes `checkpoint.async`'s staging copy (host memory like the
//! rest, `plan/memory.rs`). On a GPU the staging buffers are pinned host memory: those of the
//! node's writing ranks are compared with MemAvailable separately, and a shortfall is a
//! warning, not a refusal, since saves then fall back to synchronous ones at run time.
//!
//! A config that cannot fit is refused with exit code 2, like any other config error: it is
//! found before anything is allocated or written, and the fix is a change of config keys
//! (the message names them), not of the machine's state. An allocation that fails later is a
//! runtime failure, exit code 1.

use std::sync::Mutex;

use anyhow::Result;
use tch::Device;

use super::place::Rank;
use crate::config::{Config, ConfigError, MemoryCheck};
use crate::model::LlamaShape;
use crate::plan::{self, advice, budget, gb, report, Layout, Setting, Target};
use crate::sys::oom::OutOfMemory;
use crate::telemetry::memory::{peak_rss_bytes, rss_bytes};

/// The plan this process started with, for the out-of-memory report.
static PLAN: Mutex<Option<(Setting, Layout, Device)>> = Mutex::new(None);

/// Host memory a save keeps free beside its staging copy (as `Checkpointer` does when it
/// decides whether a save can be staged).
const STAGING_HEADROOM: f64 = 1e9;

/// The memory one rank may use: `system.memory_budget_gb`, else the CPU's available memory
/// shared by the `local` ranks of this node (its place: torchrun's LOCAL_WORLD_SIZE, Slurm's
/// tasks on this node, `lockstep run`'s workers), else the GPU's free memory. None when it
/// cannot be read.
fn rank_budget(cfg: &Config, device: Device, local: usize) -> Option<(f64, String)> {
    let set = cfg.system.memory_budget_gb;
    if set > 0.0 {
        return Some((set * 1e9, "system.memory_budget_gb".into()));
    }
    match device {
        Device::Cuda(i) => budget::gpu_memory(i).map(|(free, total)| {
            (
                free,
                format!("free on cuda:{i} (NVML; {} in all)", gb(total)),
            )
        }),
        _ => {
            let local = local.max(1);
            budget::mem_available().map(|avail| {
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

/// `system.memory_check` before the model is allocated: the plan's per-rank peak against the
/// rank's budget. Refuses (a `ConfigError`, exit code 2) a config that does not fit, with the
/// cheapest change that does; `warn` prints the same and goes on.
pub fn check(cfg: &Config, shape: &LlamaShape, rank: &Rank) -> Result<()> {
    if cfg.system.memory_check == MemoryCheck::Off {
        return Ok(());
    }
    let tag = &rank.tag;
    let local = rank.place.local_world;
    let Some(budget) = rank_budget(cfg, rank.device, local) else {
        if rank.lead() {
            println!("{tag} Memory check skipped: this device's free memory cannot be read (set system.memory_budget_gb)");
        }
        return Ok(());
    };
    let device = if rank.device.is_cuda() {
        plan::Device::Cuda
    } else {
        plan::Device::Cpu
    };
    let setting = start_setting(
        cfg,
        shape,
        device,
        rank.place.world,
        budget,
        tch::get_num_threads().max(1) as usize,
    );
    let layout = Layout::from_config(cfg);
    let r = report::build(&setting, &layout);
    *PLAN.lock().unwrap_or_else(|p| p.into_inner()) = Some((setting, layout, rank.device));
    let host_staging = match rank
        .lead()
        .then(|| host_staging(&r, local, budget::mem_available()?))
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
        if rank.lead() {
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
        return Ok(());
    }
    let breakdown: Vec<String> = memory
        .parts()
        .iter()
        .filter(|(_, b)| *b > 0.0)
        .map(|(part, b)| match part {
            plan::memory::Part::Staging => format!("checkpoint.async staging {}", gb(*b)),
            part => format!("{} {}", part.name(), gb(*b)),
        })
        .collect();
    let during = if memory.peak_during == plan::memory::PeakPhase::CheckpointSave {
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
        return Ok(());
    }
    Err(ConfigError(message).into())
}

/// The plan's setting for a check at start-up: `world` ranks on `device` with `budget` bytes
/// each, at the plan's assumed 40% utilisation and default storage bandwidth.
fn start_setting(
    cfg: &Config,
    shape: &LlamaShape,
    device: plan::Device,
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
            storage_bw: plan::checkpoint::DEFAULT_STORAGE_GBPS * 1e9,
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
    let Some(avail) = budget::mem_available() else {
        return Ok(());
    };
    let need = |k: usize| {
        let setting = start_setting(
            cfg,
            shape,
            plan::Device::Cpu,
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
    Some(if need + STAGING_HEADROOM < avail {
        HostStaging::Fits(format!("{what}, MemAvailable {}", gb(avail)))
    } else {
        HostStaging::Short(format!(
            "{what}, but MemAvailable is {} (and a save keeps {} free): saves will be written synchronously, stalling training for the whole write (estimated {:.1} s per save at {:.1} GB/s per node). Set checkpoint.async=false to plan for that, or free host memory.",
            gb(avail),
            gb(STAGING_HEADROOM),
            c.stall_sync_seconds,
            c.storage_bandwidth / 1e9
        ))
    })
}

/// An error as the run reports it: an allocation failure becomes the phase it happened in, the
/// memory in use and the plan's advice; anything else is returned unchanged.
pub fn explain(e: anyhow::Error) -> anyhow::Error {
    let Some(oom) = e.downcast_ref::<OutOfMemory>() else {
        return e;
    };
    let plan = PLAN.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let rss = oom.resident_bytes.unwrap_or_else(rss_bytes);
    let mut text = format!(
        "out of memory in the {} phase: {}\nMemory in use: RSS {} when it failed (peak {})",
        oom.phase,
        oom.message,
        gb(rss as f64),
        gb(peak_rss_bytes() as f64)
    );
    if let Some((_, _, Device::Cuda(i))) = &plan {
        if let Some((free, total)) = budget::gpu_memory(*i) {
            text.push_str(&format!(
                "; cuda:{i} {} used of {}",
                gb(total - free),
                gb(total)
            ));
        }
    }
    match &plan {
        Some((setting, layout, _)) => {
            let estimated = plan::estimate(setting, layout).total_bytes;
            // The estimate was too low for this machine: aim for a quarter below it.
            let advice = advice::cheapest_within(setting, layout, 0.75 * estimated)
                .filter(|c| !c.sets.is_empty());
            text.push_str(&format!(
                "\nThe plan estimated {} per rank ({} available, {}).",
                gb(estimated),
                gb(setting.budget),
                setting.budget_source
            ));
            match advice {
                Some(c) => text.push_str(&format!(
                    " Cheapest change to a quarter less memory: {} (estimated {}, step time {:+.0}%).",
                    c.sets
                        .iter()
                        .map(|s| format!("--set {s}"))
                        .collect::<Vec<_>>()
                        .join(" "),
                    gb(c.total_bytes),
                    c.slowdown * 100.0
                )),
                None => text.push_str(
                    " No layout change saves a quarter of it: use more ranks, a shorter context or a smaller model.",
                ),
            }
        }
        None => text.push_str("\n(no memory plan: system.memory_check = off)"),
    }
    text.push_str("\nThe last complete checkpoint is untouched; continue from it with --resume auto after the change.");
    anyhow::anyhow!(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(sets: &[&str], world: usize, device: plan::Device) -> report::Report {
        let mut all = vec!["model.num_layers=8", "model.vocab_size=128256"];
        all.extend(sets);
        let (mut s, l) = plan::test_setting(&all, world);
        s.device = device;
        report::build(&s, &l)
    }

    #[test]
    fn a_gpu_node_checks_its_pinned_staging_copies_against_mem_available() {
        let r = report(&[], 8, plan::Device::Cuda);
        let per_rank = r.checkpoint.staging_bytes_per_rank;
        assert!(per_rank > 0.0);
        // 8 ranks on this node, all writing: their 8 copies and the 1 GB a save keeps free.
        let node = 8.0 * per_rank;
        match host_staging(&r, 8, node + STAGING_HEADROOM + 1e9) {
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
            host_staging(&r, 4, node / 2.0 + STAGING_HEADROOM + 1e9),
            Some(HostStaging::Fits(_))
        ));
        // Nothing pinned: a CPU rank counts its copy in its own estimate, and without
        // checkpoint.async there is none.
        let cpu = report(&[], 8, plan::Device::Cpu);
        assert!(host_staging(&cpu, 8, 0.0).is_none());
        let sync = report(&["checkpoint.async=false"], 8, plan::Device::Cuda);
        assert!(host_staging(&sync, 8, 0.0).is_none());
    }
}
