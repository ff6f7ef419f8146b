//! What downstream evaluation (`training.eval_tasks`) costs each time it runs: the forward
//! FLOPs of its rows (2 per weight of the decoder layers' matmuls and token, and causal
//! attention's 2·L·seq·d per token: a third of training's count), each row padded to its
//! batch's longest as `data::tasks::Requests` pads it, and the LM head's 2·vocab·hidden for the
//! continuation tokens only (`Llama::row_log_likelihoods` computes no other logits), at the
//! assumed utilisation of the device's peak.
//! Batch b runs on data rank b mod D (a CP × TP group splits its batch's work as it splits a
//! step's); at ZeRO-3 a rank short of batches runs the last (shortest) batch again, since
//! every pass gathers the parameters with the others (`train::tasks::Deal`); the busiest rank
//! sets the time.

use serde::Serialize;

use super::setting::Setting;
use crate::config::ZeroStage;
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

/// The cost of evaluating `requests` (of `tasks` tasks holding `items` items) once at
/// `zero_stage`, with training's step of `step_seconds` and evaluations every `interval` steps.
pub fn estimate(
    s: &Setting,
    zero_stage: ZeroStage,
    requests: &Requests,
    (tasks, items): (usize, usize),
    step_seconds: f64,
    interval: usize,
) -> Downstream {
    let split = s.tensor_parallel * s.context_parallel;
    let data_ranks = (s.world / split).max(1);
    let align = tasks::row_align(s.tensor_parallel, s.sequence_parallel, s.context_parallel);
    let head = 2.0 * (s.shape.vocab_size * s.shape.hidden_size) as f64;
    let batches = requests.num_batches();
    let cost = |b: usize| {
        let (rows, seq) = requests.batch_shape(b, align);
        // A forward of the decoder: a third of training's FLOPs per token at this length,
        // without the head's; the head for the continuation tokens.
        let body = s.shape.flops_per_token(seq) / 3.0 - head;
        (
            (rows * seq) as f64 * body + requests.batch_scored(b) as f64 * head,
            rows * seq,
        )
    };
    let mut per_rank = vec![0.0f64; data_ranks];
    let (mut flops, mut padded) = (0.0, 0);
    for b in 0..batches {
        let (f, tokens) = cost(b);
        per_rank[b % data_ranks] += f;
        flops += f;
        padded += tokens;
    }
    if zero_stage.shards_parameters() && batches > 0 {
        let passes = batches.div_ceil(data_ranks);
        for (r, work) in per_rank.iter_mut().enumerate() {
            let mine = (r..batches).step_by(data_ranks).count();
            *work += (passes - mine) as f64 * cost(batches - 1).0;
        }
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

#[cfg(test)]
mod tests {
    use super::super::test_setting;
    use super::*;
    use crate::data::tasks::{Gold, Item, Task};
    use crate::data::tokenizer::Tokenizer;

    /// Tensor parallelism without sequence parallelism: rows keep their lengths.
    const TP: [&str; 2] = ["system.tensor_parallel=2", "system.sequence_parallel=false"];

    /// `n` four-choice items of growing length, in batches of `rows` rows.
    fn requests(n: usize, rows: usize) -> Requests {
        let items = (0..n)
            .map(|i| Item {
                line: i + 1,
                context: "word ".repeat(i + 1).trim_end().to_string(),
                choices: vec!["a".into(), "b c".into(), "d e f".into(), "g".into()],
                gold: Gold::One(0),
            })
            .collect();
        let task = Task {
            name: "t".into(),
            path: "t.jsonl".into(),
            items,
        };
        Requests::build(&[task], &Tokenizer::load("gpt2").unwrap(), 512, rows).unwrap()
    }

    /// The FLOPs of a pass do not depend on the layout; its time is the busiest data rank's,
    /// with a tensor-parallel group sharing its batches' work.
    #[test]
    fn the_busiest_data_rank_sets_the_time() {
        let r = requests(10, 8); // 40 rows: 5 batches
        assert_eq!(r.num_batches(), 5);
        let run = |sets: &[&str], world| {
            let (s, l) = test_setting(sets, world);
            estimate(&s, l.zero_stage, &r, (1, 10), 1.0, 0)
        };
        let one = run(&[], 1);
        let padded: usize = (0..5)
            .map(|b| {
                let (rows, seq) = r.batch_shape(b, 1);
                rows * seq
            })
            .sum();
        assert_eq!((one.rows, one.padded_tokens), (40, padded));
        assert!(padded > r.row_tokens());
        for (sets, world) in [
            (&["system.zero_stage=1"][..], 2),
            (&["system.zero_stage=3"], 2),
            (&["system.zero_stage=3"], 8),
            (&TP, 2),
        ] {
            let d = run(sets, world);
            assert_eq!(d.flops, one.flops, "{sets:?}");
            assert!(d.seconds < one.seconds, "{sets:?}");
        }
        // 2 data ranks: batches 0, 2, 4 on the first (the longest), 1, 3 on the second; at
        // ZeRO-3 the second runs the last batch again, still the lighter rank.
        let two = run(&["system.zero_stage=1"], 2);
        let three = run(&["system.zero_stage=3"], 2);
        assert!(two.seconds > one.seconds / 2.0);
        assert_eq!(two.seconds, three.seconds);
        // 8 data ranks, 5 batches: the busiest runs batch 0 alone.
        let eight = run(&["system.zero_stage=3"], 8);
        let tp = run(&TP, 2);
        assert!(eight.seconds < two.seconds);
        assert!((tp.seconds - one.seconds / 2.0).abs() <= 1e-12 * one.seconds);
        assert!((one.items_per_second - 10.0 / one.seconds).abs() < 1e-9);
    }
}
