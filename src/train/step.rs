//! One optimizer step, the function the trainer, the benchmark and the transformers parity test
//! all call: micro-batches → forward/backward (gradients accumulate) → gradient sync across ranks
//! → global gradient norm → guard decision → clip → AdamW (replicated or sharded: `Optimizer`).
//!
//! When the guard stops the step, nothing is updated and the gradients are left as they are, so
//! the caller can report and dump them; the caller then drops them (`Optimizer::zero_grad`).

use std::time::Instant;

use anyhow::Result;
use tch::Tensor;

use super::guard::{Event, Guard};
use super::loader::Batch;
use super::optim::Optimizer;
use super::preempt;
use crate::dist::ProcessGroup;
use crate::model::Llama;
use crate::sys::phase::{self, Phase};

/// The settings a step runs with; fixed for a run.
#[derive(Debug, Clone, Copy)]
pub struct StepConfig {
    /// Micro-batches per step (`training.grad_accum_nums`): each micro-batch's loss is scaled by
    /// 1/grad_accum before backward, so the accumulated gradient is the step's mean.
    pub grad_accum: usize,
    /// `training.max_grad_norm` (0 = no clipping).
    pub max_grad_norm: f64,
    /// Reduce each bucket while backward goes on (`system.overlap_comm`), rather than after.
    pub overlap: bool,
}

impl StepConfig {
    pub fn from_config(cfg: &crate::config::Config) -> StepConfig {
        StepConfig {
            grad_accum: cfg.training.grad_accum_nums,
            max_grad_norm: cfg.training.max_grad_norm,
            overlap: cfg.system.overlap_comm,
        }
    }
}

/// `debug.inject_nan_at_step`: where this step's NaN goes, if anywhere.
#[derive(Debug, Clone, PartialEq, Default)]
pub enum NanInjection {
    #[default]
    None,
    /// Multiply every micro-batch's loss by NaN (the forward pass "diverged").
    Loss,
    /// Put a NaN into this parameter's gradient after the all-reduce, so all ranks agree.
    Gradient(String),
}

/// Seconds spent in each phase of a step (summed over its micro-batches).
#[derive(Debug, Clone, Copy, Default)]
pub struct StepTiming {
    /// Assembling batches (the `batches` iterator).
    pub data_s: f64,
    /// Forward and backward.
    pub compute_s: f64,
    /// Gradient reduction (its exposed part: what an overlapped reduction did not hide behind
    /// backward) and the global norm (on NCCL the host waits for the all-reduce at the norm's
    /// read, so it belongs here).
    pub comm_s: f64,
    /// Clip, AdamW, zeroing the gradients.
    pub optimizer_s: f64,
    /// Bytes this rank sent to other ranks during the step, where the backend counts them.
    pub sent_bytes: Option<u64>,
}

impl StepTiming {
    pub fn add(&mut self, other: &StepTiming) {
        self.data_s += other.data_s;
        self.compute_s += other.compute_s;
        self.comm_s += other.comm_s;
        self.optimizer_s += other.optimizer_s;
        self.sent_bytes = match (self.sent_bytes, other.sent_bytes) {
            (Some(a), Some(b)) => Some(a + b),
            (a, b) => a.or(b),
        };
    }
}

/// This step's learning rate and debug injection: what changes from one step to the next.
#[derive(Debug, Clone, Default)]
pub struct StepPlan {
    pub lr: f64,
    pub inject: NanInjection,
    /// This rank's background checkpoint write failed (`Checkpointer::poll`).
    pub save_failed: bool,
}

/// What one step did.
#[derive(Debug, Clone)]
pub struct StepOutcome {
    /// Mean loss over all ranks' micro-batches.
    pub loss: f64,
    /// Global gradient L2 norm before clipping.
    pub grad_norm: f64,
    /// Set when the guard stopped the update (parameters and moments untouched).
    pub event: Option<Event>,
    /// SIGTERM/SIGINT arrived on some rank: every rank learns it here, at the same step.
    pub stop_requested: bool,
    /// Some rank's background checkpoint write failed: every rank stops at this step.
    pub save_failed: bool,
    pub timing: StepTiming,
}

/// One step. `batches` yields this rank's micro-batches (inputs and targets, each
/// [batch, context] int64 on the model's device, and their packed documents if any); there
/// should be `cfg.grad_accum` of them.
pub fn train_step(
    model: &Llama,
    opt: &mut Optimizer,
    pg: &mut dyn ProcessGroup,
    guard: &mut Guard,
    cfg: &StepConfig,
    plan: &StepPlan,
    batches: impl Iterator<Item = Batch>,
) -> Result<StepOutcome> {
    let mut timing = StepTiming::default();
    let sent_before = opt.bytes_sent(pg);

    let passes = forward_backward(model, opt, pg, batches, cfg, &plan.inject)?;
    timing.data_s = passes.data_s;
    timing.compute_s = passes.compute_s;

    let t = Instant::now();
    phase::enter(Phase::Reduce);
    opt.finish_reduction()?;
    let (loss, stop_requested, save_failed) = agree(pg, passes.local_loss, plan.save_failed)?;
    if let NanInjection::Gradient(name) = &plan.inject {
        opt.poison_gradient(name);
    }
    let grad_norm = opt.grad_norm(pg)?;
    timing.comm_s = passes.reduce_wait_s + t.elapsed().as_secs_f64();

    let mut outcome = StepOutcome {
        loss,
        grad_norm,
        event: guard.judge(loss, grad_norm),
        stop_requested,
        save_failed,
        timing,
    };
    if outcome.event.is_some() {
        return Ok(outcome);
    }
    guard.accept(loss);

    let t = Instant::now();
    phase::enter(Phase::Optimizer);
    opt.clip(grad_norm, cfg.max_grad_norm);
    opt.step(plan.lr, pg)?;
    opt.zero_grad();
    outcome.timing.optimizer_s = t.elapsed().as_secs_f64();
    outcome.timing.sent_bytes = sent_before.zip(opt.bytes_sent(pg)).map(|(a, b)| b - a);
    Ok(outcome)
}

/// What the forward and backward passes of a step return.
struct Passes {
    /// This rank's mean loss over its micro-batches.
    local_loss: f64,
    /// Seconds assembling batches.
    data_s: f64,
    /// Seconds in forward and backward (an overlapped reduction runs during them).
    compute_s: f64,
    /// Seconds after backward until the reduction was done: the reduction's exposed time (all
    /// of it when it is deferred; what backward did not hide when it overlaps).
    reduce_wait_s: f64,
}

/// Forward and backward over the micro-batches, each a pass of the optimizer
/// ([`Optimizer::pass`]): at zero stage 3 it gathers each unit's parameters as the model
/// reaches it; on the last micro-batch (at stage 3 on every one) each unit's gradients are
/// reduced across ranks (`train::optim::reduce`) as backward finishes them. The model's
/// `forward_backward` does each micro-batch with the run's activation checkpointing and
/// LM-head chunking.
fn forward_backward(
    model: &Llama,
    opt: &Optimizer,
    pg: &mut dyn ProcessGroup,
    mut batches: impl Iterator<Item = Batch>,
    cfg: &StepConfig,
    inject: &NanInjection,
) -> Result<Passes> {
    let start = Instant::now();
    let mut backward_done = start;
    let mut data_s = 0.0;
    let mut loss_sum: Option<Tensor> = None;
    // Each micro-batch's loss is scaled by 1/grad_accum so the accumulated gradient is the
    // step's mean; a NaN scale is the injected divergence (it reaches loss and gradients).
    let scale = if *inject == NanInjection::Loss {
        f64::NAN
    } else {
        1.0 / cfg.grad_accum as f64
    };
    let mut accumulate = |loss: Tensor| {
        let loss = if *inject == NanInjection::Loss {
            &loss * f64::NAN
        } else {
            loss
        };
        let sum = loss_sum.get_or_insert_with(|| loss.zeros_like());
        *sum += loss;
        sum.shallow_clone()
    };
    let order = model.unit_order(true);
    let every_micro_batch = opt.stage().shards_parameters();
    let mut local_loss = None;
    for micro in 0..cfg.grad_accum {
        let t = Instant::now();
        phase::enter(Phase::Data);
        let Some(batch) = batches.next() else {
            anyhow::bail!(
                "internal: {micro} micro-batches for a step of training.grad_accum_nums = {}",
                cfg.grad_accum
            );
        };
        data_s += t.elapsed().as_secs_f64();
        let last = micro + 1 == cfg.grad_accum;
        // The model marks its forward and backward phases itself (they interleave by layer).
        let (x, y, docs) = (&batch.inputs, &batch.targets, batch.documents.as_ref());
        let reduce = last || every_micro_batch;
        let sum = opt.pass(pg, cfg.overlap, &order, reduce, |units| {
            let sum = accumulate(model.forward_backward(x, y, docs, scale, units)?);
            if !last {
                return Ok(sum);
            }
            // Read before collectives that were deferred run: on CUDA, a read after an NCCL
            // collective would wait for it, and a stalled peer would hang this rank here
            // instead of failing the host-side agreement in `agree` with the peer named.
            let mean = sum.double_value(&[]) / cfg.grad_accum as f64;
            local_loss = Some(mean);
            // From here this rank waits for the reduction (and through it for its peers): not
            // its own work, for the timing line and the straggler check.
            backward_done = Instant::now();
            phase::enter(Phase::Reduce);
            Ok(sum)
        })?;
        drop(sum);
    }
    anyhow::ensure!(
        batches.next().is_none(),
        "internal: more micro-batches than training.grad_accum_nums = {}",
        cfg.grad_accum
    );
    Ok(Passes {
        local_loss: local_loss.expect("grad_accum >= 1"),
        data_s,
        compute_s: (backward_done - start).as_secs_f64() - data_s,
        reduce_wait_s: backward_done.elapsed().as_secs_f64(),
    })
}

/// Sums the losses, stop requests and failed background saves across ranks (after the
/// gradients), so that every rank sees the same global loss and takes the same branch
/// afterwards. Returns (global mean loss, stop requested anywhere, a save failed anywhere).
fn agree(
    pg: &mut dyn ProcessGroup,
    local_loss: f64,
    save_failed: bool,
) -> Result<(f64, bool, bool)> {
    let flag = |b: bool| f32::from(u8::from(b));
    let mut shared = [
        local_loss as f32,
        flag(preempt::requested()),
        flag(save_failed),
    ];
    pg.all_reduce_sum_f32(&mut shared)?;
    Ok((
        shared[0] as f64 / pg.world_size() as f64,
        shared[1] > 0.0,
        shared[2] > 0.0,
    ))
}
