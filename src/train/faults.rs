//! Every `debug.*` hook in one place: deliberate failures for the tests of the launcher, the
//! collective timeouts and the NaN guard. Off unless a `debug.*` key is set.

use anyhow::{bail, Result};

use super::place::Rank;
use super::step::NanInjection;
use crate::config::{Config, FaultChoice, OomPhase};
use crate::model::{LlamaShape, Parameters};
use crate::sys::oom;
use crate::sys::phase::Phase;

pub struct Faults {
    /// `debug.fault` and where it hits (rank, 1-based step) and how (exit code).
    fault: FaultChoice,
    fault_rank: usize,
    fault_step: usize,
    fault_exit_code: i32,
    fault_delay: std::time::Duration,
    /// `debug.inject_nan_at_step` (0 = off) and `debug.inject_nan_param` (None = the loss).
    nan_step: usize,
    nan_param: Option<String>,
    /// The injected NaN fires once, also when a rollback replays its step.
    nan_fired: bool,
    /// `debug.inject_oom` (a phase of a step) and `debug.inject_oom_step`.
    oom: Option<Phase>,
    oom_step: usize,
    device: tch::Device,
    rank: usize,
    tag: String,
}

impl Faults {
    /// Checks that `debug.inject_nan_param` names a parameter of the model of `shape` (any
    /// rank's: with expert parallelism another rank may hold it).
    pub fn new(cfg: &Config, rank: &Rank, shape: &LlamaShape) -> Result<Faults> {
        let d = &cfg.debug;
        if let Some(name) = &d.inject_nan_param {
            if !Parameters::of(shape).contains(name) {
                bail!("debug.inject_nan_param = {name:?} is not a parameter of this model (e.g. model.layers.0.mlp.up_proj.weight)");
            }
        }
        Ok(Faults {
            fault: d.fault,
            fault_rank: d.fault_rank,
            fault_step: d.fault_step,
            fault_exit_code: d.fault_exit_code as i32,
            fault_delay: std::time::Duration::from_millis(d.fault_delay_ms as u64),
            nan_step: d.inject_nan_at_step,
            nan_param: d.inject_nan_param.clone(),
            nan_fired: false,
            oom: step_phase(d.inject_oom),
            oom_step: d.inject_oom_step,
            device: rank.device,
            rank: rank.place.rank,
            tag: rank.tag.clone(),
        })
    }

    /// `debug.fault` at the start of step `step` (1-based): exit, stop this process (a hung
    /// rank) until someone sends SIGCONT or kills it, or sleep in this and every later step.
    /// `debug.inject_oom`: arm its phase.
    pub fn at_step_start(&self, step: usize) {
        if let Some(phase) = self.oom.filter(|_| step == self.oom_step) {
            oom::arm(phase, self.device);
        }
        if self.fault == FaultChoice::Slow
            && self.fault_rank == self.rank
            && step >= self.fault_step
        {
            std::thread::sleep(self.fault_delay);
            return;
        }
        if self.fault == FaultChoice::None
            || self.fault_rank != self.rank
            || self.fault_step != step
        {
            return;
        }
        eprintln!(
            "{} debug.fault = {} injected at step {step}",
            self.tag, self.fault
        );
        match self.fault {
            FaultChoice::Exit => std::process::exit(self.fault_exit_code),
            // SAFETY: raising a signal on ourselves has no memory-safety preconditions.
            FaultChoice::Stop => unsafe {
                libc::raise(libc::SIGSTOP);
            },
            // Fired by `exit_after_save`, when a save is in flight.
            FaultChoice::None | FaultChoice::Slow | FaultChoice::ExitAfterSave => {}
        }
    }

    /// Whether `debug.fault = exit_after_save` hits this rank at step `step`: the caller waits
    /// for this rank's part of the save in flight to be reported, then, if there was one,
    /// calls [`Self::exit_after_save`]. (A restart that resumes from that save has none in
    /// flight at the step: the fault fires once.)
    pub fn exits_after_save(&self, step: usize) -> bool {
        self.fault == FaultChoice::ExitAfterSave
            && self.fault_rank == self.rank
            && self.fault_step == step
    }

    pub fn exit_after_save(&self, step: usize) -> ! {
        eprintln!(
            "{} debug.fault = {} injected at step {step}",
            self.tag, self.fault
        );
        std::process::exit(self.fault_exit_code)
    }

    /// Where step `step`'s injected NaN goes (`debug.inject_nan_at_step`), once per run.
    pub fn nan_injection(&mut self, step: usize) -> NanInjection {
        if self.nan_step != step || std::mem::replace(&mut self.nan_fired, true) {
            return NanInjection::None;
        }
        match &self.nan_param {
            Some(name) => NanInjection::Gradient(name.clone()),
            None => NanInjection::Loss,
        }
    }
}

/// `debug.inject_oom = model_build`: the next allocation phase, building the model, fails.
pub fn arm_model_build_oom(cfg: &Config, device: tch::Device) {
    if cfg.debug.inject_oom == OomPhase::ModelBuild {
        oom::arm(Phase::ModelBuild, device);
    }
}

/// The phase of a step that `debug.inject_oom` names (None: off, or the model build).
fn step_phase(p: OomPhase) -> Option<Phase> {
    match p {
        OomPhase::None | OomPhase::ModelBuild => None,
        OomPhase::Forward => Some(Phase::Forward),
        OomPhase::Backward => Some(Phase::Backward),
        OomPhase::Optimizer => Some(Phase::Optimizer),
        OomPhase::Checkpoint => Some(Phase::Checkpoint),
    }
}
