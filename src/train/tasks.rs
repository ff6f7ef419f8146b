//! Downstream evaluation: the multiple-choice tasks of `training.eval_tasks` (`data::tasks`),
//! scored every `training.eval_interval` steps and at the end, after validation, on the
//! data-parallel ranks together; and the scoring loop `lockstep eval --task` runs on one.
//!
//! The rows of every task's choices are sorted and cut into batches of
//! `training.eval_tasks_batch_size` rows once ([`Requests`]); batch b goes to data rank
//! b mod D, and each rank's log-likelihoods meet in one all-reduce of a vector with a slot per
//! request (zero where another rank computed it). A batch is the same on every layout, so any
//! number of data ranks gives one rank's numbers, bit for bit.

use std::time::Instant;

use anyhow::Result;
use tch::{Device, Tensor};

use super::eval::eval_due;
use super::optim::Optimizer;
use super::place::Rank;
use crate::config::Config;
use crate::data::tasks::{self, ItemScore, Requests, Task, TaskScores};
use crate::dist::{Mesh, ProcessGroup};
use crate::model::Llama;

/// Which batches a rank computes: batch b where b mod `ranks` = `rank`; with `lockstep`, every
/// rank runs as many passes as the busiest (a pass gathers sharded parameters: a collective),
/// the extra ones over the last batch again (the shortest: rows are sorted longest first, and
/// it may hold fewer), not counted.
#[derive(Debug, Clone, Copy)]
pub struct Deal {
    pub rank: usize,
    pub ranks: usize,
    pub lockstep: bool,
}

impl Deal {
    /// One rank evaluates everything.
    pub const ALONE: Deal = Deal {
        rank: 0,
        ranks: 1,
        lockstep: false,
    };
}

/// Each request's log-likelihood (index r of `requests.list`) for the batches `deal` gives
/// this rank, 0 for the others. `forward(inputs, targets)` ([rows, seq] int64 on `device`) is
/// `Llama::row_log_likelihoods` of one batch; rows are padded to a multiple of `align` tokens.
pub fn score_requests(
    requests: &Requests,
    deal: Deal,
    align: usize,
    device: Device,
    forward: &mut dyn FnMut(&Tensor, &Tensor) -> Result<Tensor>,
) -> Result<Vec<f32>> {
    let batches = requests.num_batches();
    let mine: Vec<usize> = (deal.rank..batches).step_by(deal.ranks).collect();
    let passes = match deal.lockstep {
        true => batches.div_ceil(deal.ranks),
        false => mine.len(),
    };
    let mut lls = vec![0f32; requests.list.len()];
    for pass in 0..passes {
        let (b, counted) = mine.get(pass).map_or((batches - 1, false), |&b| (b, true));
        let batch = requests.batch(b, align);
        let dims = [batch.rows as i64, batch.seq as i64];
        let x = Tensor::from_slice(&batch.inputs)
            .view(dims)
            .to_device(device);
        let y = Tensor::from_slice(&batch.targets)
            .view(dims)
            .to_device(device);
        let ll = forward(&x, &y)?;
        if counted {
            let ll = Vec::<f32>::try_from(&ll.to_device(Device::Cpu))?;
            for (&r, v) in batch.requests.iter().zip(ll) {
                lls[r] = v;
            }
        }
    }
    Ok(lls)
}

/// One evaluation's result.
#[derive(Debug, Clone)]
pub struct TaskResults {
    /// Each task's metrics, in `training.eval_tasks` order.
    pub scores: Vec<TaskScores>,
    /// Each task's items' results.
    pub items: Vec<Vec<ItemScore>>,
    /// Seconds it took (not counted in training's tokens/s).
    pub seconds: f64,
}

/// `tasks::score`'s pairs as [`TaskResults`].
pub fn results(tasks: &[Task], requests: &Requests, lls: &[f32], started: Instant) -> TaskResults {
    let (scores, items) = tasks::score(tasks, requests, lls).into_iter().unzip();
    TaskResults {
        scores,
        items,
        seconds: started.elapsed().as_secs_f64(),
    }
}

/// The tasks a run evaluates while it trains.
pub struct TaskEval {
    tasks: Vec<Task>,
    requests: Requests,
    /// `training.eval_interval` (0 = only at the end).
    interval: usize,
    /// What a row's length is a multiple of (`tasks::row_align`: T with sequence parallelism,
    /// C·lcm(2, T) with context parallelism).
    align: usize,
    device: Device,
}

impl TaskEval {
    /// The tasks of `training.eval_tasks`, read and encoded with `data.tokenizer` for rows of
    /// at most `training.context_length` tokens (the lead rank says what they are); None
    /// without any. A bad task file is a config error naming the file, the line and the field.
    pub fn new(cfg: &Config, rank: &Rank) -> Result<Option<TaskEval>> {
        let Some((tasks, requests)) = tasks::of_config(cfg)? else {
            return Ok(None);
        };
        let eval = TaskEval {
            tasks,
            requests,
            interval: cfg.training.eval_interval,
            align: tasks::row_align(
                rank.mesh.tensor,
                cfg.system.sequence_parallel,
                rank.mesh.context,
            ),
            device: rank.device,
        };
        if rank.lead() {
            println!("{} {}", rank.tag, eval.describe());
        }
        Ok(Some(eval))
    }

    /// Every `interval` steps and after the last step, as validation (`last`: the run's last
    /// step; a stop by signal saves its checkpoint without waiting for the tasks).
    pub fn due(&self, step: usize, last: bool) -> bool {
        eval_due(self.interval, step, last)
    }

    /// Every task's metrics, the same on every rank (and as one rank would compute them).
    pub fn run(
        &self,
        model: &Llama,
        opt: &Optimizer,
        pg: &mut dyn ProcessGroup,
        mesh: &Mesh,
    ) -> Result<TaskResults> {
        let started = Instant::now();
        let deal = Deal {
            rank: mesh.data_rank(),
            ranks: mesh.data(),
            lockstep: super::eval::passes_meet(model, opt),
        };
        let order = model.unit_order(false);
        let mut lls = score_requests(
            &self.requests,
            deal,
            self.align,
            self.device,
            &mut |x, y| {
                opt.pass(&mut *pg, false, &order, false, |units| {
                    model.row_log_likelihoods(x, y, units)
                })
            },
        )?;
        // A tensor- or context-parallel group computed its batches together: one counts.
        if !mesh.leads_its_samples() {
            lls.fill(0.0);
        }
        pg.all_reduce_sum_f32(&mut lls)?;
        Ok(results(&self.tasks, &self.requests, &lls, started))
    }

    /// Items evaluated per pass over the tasks, and how many of them lose tokens to the
    /// context length.
    fn describe(&self) -> String {
        let items: usize = self.tasks.iter().map(|t| t.items.len()).sum();
        let names: Vec<String> = self
            .tasks
            .iter()
            .map(|t| format!("{} ({} items)", t.name, t.items.len()))
            .collect();
        let cut = match self.requests.truncated_items() {
            0 => String::new(),
            n => format!(
                "; {n} item(s) longer than training.context_length = {} lose tokens from the left",
                self.requests.context
            ),
        };
        format!(
            "Downstream eval: {} | {items} items, {} rows in {} batches per evaluation{cut}",
            names.join(", "),
            self.requests.list.len(),
            self.requests.num_batches()
        )
    }
}
