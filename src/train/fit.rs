//! Memory at the edges of a run: the start check (`plan::start`, which decides the rank's
//! budget) run for this rank, and, when an allocation fails anyway, an error that names the
//! phase, the memory in use and the plan's advice. A config that cannot fit is a config error
//! (exit code 2); an allocation that fails later is a runtime failure, exit code 1.

use std::sync::Mutex;

use anyhow::Result;
use tch::Device;

use super::place::Rank;
use crate::config::Config;
use crate::model::LlamaShape;
use crate::plan::{self, advice, gb, start, Layout, Setting};
use crate::sys::machine::{self, peak_rss_bytes, rss_bytes};
use crate::sys::oom::OutOfMemory;

/// The plan this process started with, for the out-of-memory report.
static PLAN: Mutex<Option<(Setting, Layout, Device)>> = Mutex::new(None);

/// `system.memory_check` for this rank before the model is allocated (`plan::start::check`);
/// the plan it checked is kept for [`explain`].
pub fn check(cfg: &Config, shape: &LlamaShape, rank: &Rank) -> Result<()> {
    let (device, cuda_index) = match rank.device {
        Device::Cuda(i) => (plan::Device::Cuda, i),
        _ => (plan::Device::Cpu, 0),
    };
    let at = start::Starting {
        tag: &rank.tag,
        lead: rank.lead(),
        device,
        cuda_index,
        local: rank.place.local_world,
        world: rank.place.world,
        cpu_threads: tch::get_num_threads().max(1) as usize,
    };
    if let Some((setting, layout)) = start::check(cfg, shape, &at)? {
        *PLAN.lock().unwrap_or_else(|p| p.into_inner()) = Some((setting, layout, rank.device));
    }
    Ok(())
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
        if let Some((free, total)) = machine::gpu_memory(*i) {
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
                    c.flags(),
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
