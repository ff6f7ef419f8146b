//! Memory at the edges of a run: before the model is built, the plan's estimate is compared
//! with what the device has (`system.memory_check`); and when an allocation fails anyway, the
//! error names the phase, the memory in use and the plan's advice.
//!
//! A config that cannot fit is refused with exit code 2, like any other config error: it is
//! found before anything is allocated or written, and the fix is a change of config keys
//! (the message names them), not of the machine's state. An allocation that fails later is a
//! runtime failure, exit code 1.

use std::sync::Mutex;

use anyhow::Result;
use tch::Device;

use super::setup::Rank;
use crate::config::{Config, ConfigError, MemoryCheck};
use crate::model::LlamaShape;
use crate::plan::{self, advice, budget, gb, report, Layout, Setting, Target};
use crate::sys::oom::OutOfMemory;
use crate::telemetry::memory::{peak_rss_bytes, rss_bytes};

/// The plan this process started with, for the out-of-memory report.
static PLAN: Mutex<Option<(Setting, Layout, Device)>> = Mutex::new(None);

/// The memory one rank may use: `system.memory_budget_gb`, else the CPU's available memory
/// shared by the ranks of this node, else the GPU's free memory. None when it cannot be read.
fn rank_budget(cfg: &Config, device: Device) -> Option<(f64, String)> {
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
            let local: usize = std::env::var("LOCAL_WORLD_SIZE")
                .ok()
                .and_then(|v| v.parse().ok())
                .filter(|n| *n > 0)
                .unwrap_or(1);
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
    let Some(budget) = rank_budget(cfg, rank.device) else {
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
    let setting = Setting::new(
        cfg,
        shape.clone(),
        Target {
            device,
            world: rank.topo.world,
            budget,
            mfu: 0.4,
            cpu_threads: tch::get_num_threads().max(1) as usize,
        },
    );
    let layout = Layout::from_config(cfg);
    let r = report::build(&setting, &layout);
    *PLAN.lock().unwrap_or_else(|p| p.into_inner()) = Some((setting, layout, rank.device));
    if r.fits {
        if rank.lead() {
            println!(
                "{tag} Memory plan: {} per rank estimated, {} available ({})",
                gb(r.configured.total_bytes),
                gb(r.budget_bytes),
                r.budget_source
            );
        }
        return Ok(());
    }
    let breakdown: Vec<String> = r
        .configured
        .memory
        .parts()
        .iter()
        .filter(|(_, b)| *b > 0.0)
        .map(|(n, b)| format!("{n} {}", gb(*b)))
        .collect();
    let message = format!(
        "this config needs an estimated {} per rank ({}), but {} is available ({}). {} `lockstep plan` with the same flags shows the breakdown; system.memory_check=warn starts anyway.",
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
