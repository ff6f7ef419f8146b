//! What downstream evaluation (`training.eval_tasks`) costs each time it runs: the forward
//! FLOPs of its rows (2 per weight of the decoder layers' matmuls and token, and causal
//! attention's 2·L·seq·d per token: a third of training's count), each row padded to its
//! batch's longest as `data::tasks::Requests` pads it, and the LM head's 2·vocab·hidden for the
//! continuation tokens only (`Llama::row_log_likelihoods` computes no other logits), at the
//! assumed utilisation of the device's peak.
//! Batch b runs on data rank b mod D (a CP × TP group splits its batch's work as it splits a
//! step's); the busiest rank sets the time.

use serde::Serialize;

use super::setting::Setting;
use crate::data::tasks::{self, Requests};

#[derive(Debug, Clone, Serialize)]
pub struct Downstream {
    pub tasks: usize,
    pub items: usize,
    /// One per choice of every item, and their tokens with the padding.
    pub rows: usize,
    pub padded_tokens: usize,
    /// The forward FLOPs of every row, over all ranks.
    pub flops: f64,
    /// One evaluation's seconds (the busiest rank's).
    pub seconds: f64,
    pub items_per_second: f64,
    /// `seconds` over the estimated step time.
    pub steps: f64,
    /// `training.eval_interval`, and the share of the time it adds to training's at it (None:
    /// only at the end).
    pub interval: usize,
    pub share: Option<f64>,
}

/// The cost of evaluating `requests` (of `tasks` tasks holding `items` items) once, with
/// training's step of `step_seconds` and evaluations every `interval` steps.
pub fn estimate(
    s: &Setting,
    requests: &Requests,
    (tasks, items): (usize, usize),
    step_seconds: f64,
    interval: usize,
) -> Downstream {
    let split = s.tensor_parallel * s.context_parallel;
    let data_ranks = (s.world / split).max(1);
    let sequence = if s.sequence_parallel {
        s.tensor_parallel
    } else {
        1
    };
    let align = tasks::row_align(sequence, s.context_parallel);
    let head = 2.0 * (s.shape.vocab_size * s.shape.hidden_size) as f64;
    let mut per_rank = vec![0.0f64; data_ranks];
    let (mut flops, mut padded) = (0.0, 0);
    for b in 0..requests.num_batches() {
        let (rows, seq) = requests.batch_shape(b, align);
        // A forward of the decoder: a third of training's FLOPs per token at this length,
        // without the head's; the head for the continuation tokens.
        let body = s.shape.flops_per_token(seq) / 3.0 - head;
        let f = (rows * seq) as f64 * body + requests.batch_scored(b) as f64 * head;
        per_rank[b % data_ranks] += f;
        flops += f;
        padded += rows * seq;
    }
    let busiest = per_rank.iter().copied().fold(0.0, f64::max);
    let seconds = busiest / (split as f64 * s.peak_flops * s.mfu);
    let share = (interval > 0).then(|| seconds / (seconds + interval as f64 * step_seconds));
    Downstream {
        tasks,
        items,
        rows: requests.list.len(),
        padded_tokens: padded,
        flops,
        seconds,
        items_per_second: items as f64 / seconds.max(1e-12),
        steps: seconds / step_seconds.max(1e-12),
        interval,
        share,
    }
}
