//! Validation: the mean loss over a fixed set of windows of each source's held-out split, every
//! `training.eval_interval` steps and at the end. A mixture's validation loss is the
//! weight-averaged loss of its sources; each source's own is reported beside it.

use anyhow::Result;
use tch::Device;

use super::loader::{batch, Packing, SourceTokens};
use super::optim::Optimizer;
use crate::config::Config;
use crate::data::mixture::source_seed;
use crate::data::sampler::Sampler;
use crate::dist::{Mesh, ProcessGroup};
use crate::model::Llama;

/// Whether an evaluation runs after `step`: every `training.eval_interval` = `interval` steps
/// (0 = never) and after the last step.
pub fn eval_due(interval: usize, step: usize, last: bool) -> bool {
    last || (interval > 0 && step.is_multiple_of(interval))
}

/// Whether every data rank must run the same number of forward passes: where a pass is a
/// collective of the data ranks — zero stage 3 gathers the parameters, expert parallelism
/// sends tokens to other ranks' experts.
pub fn passes_meet(model: &Llama, opt: &Optimizer) -> bool {
    opt.stage().shards_parameters() || model.expert_parallel()
}

pub struct Validator {
    /// The sources with a validation split, each with its index in the source list (which
    /// seeds its window order, as in training).
    sources: Vec<(usize, SourceTokens)>,
    /// `training.eval_interval` (0 = only at the end).
    interval: usize,
    /// `training.eval_batches` × `training.batch_size` windows per validation and source.
    batches: usize,
    batch_size: usize,
    context_length: usize,
    packing: Packing,
    seed: u64,
    device: Device,
}

/// One validation's result.
#[derive(Debug, Clone, PartialEq)]
pub struct Validation {
    /// The mean loss (a mixture: its sources' losses averaged by weight).
    pub loss: f64,
    /// Each evaluated source's mean loss, by name, in source order.
    pub by_source: Vec<(String, f64)>,
    /// Seconds it took (not counted in training's tokens/s).
    pub seconds: f64,
}

impl Validator {
    /// `val[s]` is source s's held-out split, if it has one. None without any.
    pub fn new(
        val: Vec<Option<SourceTokens>>,
        cfg: &Config,
        device: Device,
    ) -> Result<Option<Validator>> {
        let packing = Packing::from_config(cfg);
        let t = &cfg.training;
        let mut sources = Vec::new();
        for (i, v) in val.into_iter().enumerate() {
            if let Some(v) = v {
                packing.check(&v.tokens, &format!("the validation split of {}", v.name))?;
                // The split does not depend on the context (a context change finds the same
                // prepared data), so it is checked against the windows here.
                let n = v.tokens.num_tokens();
                anyhow::ensure!(
                    t.eval_batches == 0 || n > t.context_length as u64,
                    "the validation split of {} holds {n} tokens, fewer than one window of \
                     training.context_length + 1 = {}; raise data.val_fraction (now {}), lower \
                     training.context_length, or set training.eval_batches=0 to train without \
                     validation",
                    v.name,
                    t.context_length + 1,
                    cfg.data.val_fraction
                );
                sources.push((i, v));
            }
        }
        if sources.is_empty() {
            return Ok(None);
        }
        Ok(Some(Validator {
            sources,
            interval: t.eval_interval,
            batches: t.eval_batches,
            batch_size: t.batch_size,
            context_length: t.context_length,
            packing,
            seed: cfg.system.seed,
            device,
        }))
    }

    /// Every `interval` steps and after the last step.
    pub fn due(&self, step: usize, last: bool) -> bool {
        eval_due(self.interval, step, last)
    }

    /// Mean loss over the first `eval_batches` × batch_size windows of each source's validation
    /// file, in a fixed order; each rank evaluates its share (window i → rank i mod world) and
    /// the sums meet in one all-reduce. None when there is nothing to evaluate.
    ///
    /// Where the parameters are sharded (zero stage 3) every pass gathers them unit by unit, a
    /// collective (and with expert parallelism sends tokens around): every rank then runs the
    /// same number of passes, the most any rank needs
    /// (`ceil(ceil(n / world) / batch_size)`), and a rank whose windows ran out evaluates the
    /// first window again without counting it.
    ///
    /// The windows are dealt to the data ranks (`mesh`): a tensor- or context-parallel group
    /// evaluates the same ones together, and only its first rank's sums count.
    pub fn run(
        &self,
        model: &Llama,
        opt: &Optimizer,
        pg: &mut dyn ProcessGroup,
        mesh: &Mesh,
    ) -> Result<Option<Validation>> {
        let started = std::time::Instant::now();
        let (ctx, bs) = (self.context_length, self.batch_size);
        let (rank, world) = (mesh.data_rank() as u64, mesh.data() as u64);
        if self.batches == 0 {
            return Ok(None);
        }
        let mut buf = Vec::new();
        // Per source: (windows evaluated over all ranks, this rank's loss sum).
        let mut counts = Vec::with_capacity(self.sources.len());
        let mut sums = Vec::with_capacity(self.sources.len());
        for (i, source) in &self.sources {
            let tokens = &source.tokens;
            if tokens.num_tokens() < ctx as u64 + 1 {
                counts.push(0);
                sums.push(0.0f32);
                continue;
            }
            let sampler = Sampler::new(tokens.num_tokens(), ctx, source_seed(self.seed, *i))?;
            let n = (self.batches * bs).min(sampler.num_windows() as usize) as u64;
            let mine: Vec<u64> = (0..n).filter(|i| i % world == rank).collect();
            let passes = if passes_meet(model, opt) {
                (n.div_ceil(world) as usize).div_ceil(bs)
            } else {
                mine.len().div_ceil(bs)
            };
            let mut total = 0.0;
            let order = model.unit_order(false);
            tch::no_grad(|| -> Result<()> {
                for p in 0..passes {
                    let idx = mine.chunks(bs).nth(p).unwrap_or(&[]);
                    // Out of windows: window 0 again, only for the pass's collectives.
                    let rows: &[u64] = if idx.is_empty() { &[0] } else { idx };
                    let rows = rows.iter().map(|&i| (tokens, sampler.window_start(i)));
                    let b = batch(rows, ctx, self.packing, &mut buf, self.device);
                    let (x, y, docs) = (&b.inputs, &b.targets, b.documents.as_ref());
                    let loss = opt.pass(pg, false, &order, false, |units| {
                        model.loss_units(x, y, docs, units)
                    })?;
                    if !idx.is_empty() {
                        total += loss.double_value(&[]) * idx.len() as f64;
                    }
                }
                Ok(())
            })?;
            counts.push(n);
            sums.push(if mesh.leads_its_samples() {
                total as f32
            } else {
                0.0
            });
        }
        if counts.iter().all(|&n| n == 0) {
            return Ok(None);
        }
        pg.all_reduce_sum_f32(&mut sums)?;
        let mut by_source = Vec::new();
        let (mut weighted, mut weights) = (0.0, 0.0);
        for (((_, source), n), sum) in self.sources.iter().zip(counts).zip(sums) {
            if n == 0 {
                continue;
            }
            let mean = sum as f64 / n as f64;
            by_source.push((source.name.clone(), mean));
            weighted += source.weight * mean;
            weights += source.weight;
        }
        let loss = match by_source.as_slice() {
            // Exactly the source's mean (w·x/w may round).
            [(_, only)] => *only,
            _ => weighted / weights,
        };
        Ok(Some(Validation {
            loss,
            by_source,
            seconds: started.elapsed().as_secs_f64(),
        }))
    }
}
