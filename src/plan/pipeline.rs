//! Pipeline parallelism (`system.pipeline_parallel` = P) in the plan: each pipeline rank's
//! memory and the step of the whole pipeline, from the schedule that runs
//! (`dist::pipeline`: the same stages, placement and action lists as training).
//!
//! A pipeline rank is planned as a setting of its own ([`rank_setting`]): its stages' decoder
//! layers, the embedding if it holds the first stage, the final norm and the LM head (with
//! tied embeddings the embedding's copy) if it holds the last, the parameter table cut to
//! those, and the world of one stage (W/P ranks: the data, context and tensor dimensions, on
//! which the zero stages act as without a pipeline). Every term of `memory.rs`, `comm.rs`,
//! `tensor.rs`, `context.rs` and `muon.rs` then counts that rank's share. The activations it
//! keeps are what the schedule keeps in flight at the rank's peak: the timeline's largest sum,
//! over the (stage, micro-batch) pairs between a forward's start and its backward's end, of the
//! stage's layers (1F1B's first rank: P micro-batches of its layers; `Holds::kept_layers`).
//!
//! The step: each stage's work for the step (its FLOPs at the assumed utilisation and its TP,
//! CP and EP groups' collectives, from the stage's own setting) is cut into micro-batches and
//! each into a forward, an input gradient and a weight gradient of a third of the model FLOPs
//! each, the input gradient's with what activation checkpointing recomputes ([`durations`]);
//! a 1F1B backward is the two together. The schedule's action lists run on the timeline with
//! the activation's point-to-point time on every edge between ranks. The step is the timeline's length plus the data-parallel reductions and Muon's step of the
//! slowest rank (after its last backward, not overlapped). In [`StepTime`], `compute_seconds`
//! and the groups' collectives are an average rank's; what the timeline adds beyond that work
//! is `pipeline_bubble_seconds` (the schedule's idle time, and the wait for stages with more
//! work than the average) and `pipeline_p2p_seconds` (the length the sends add).
//!
//! The point-to-point message is one micro-batch's activation (or its gradient) at a stage
//! boundary: the residual stream, [b, s/C, d] in fp32 (its dtype with any compute dtype, so
//! that a pipeline computes what one rank does), divided by T with sequence parallelism (each
//! TP rank sends its part). A pipeline that spans nodes pays every send at the network's
//! bandwidth (a conservative simplification: boundaries inside a node are faster); only the
//! bandwidth term is counted, as for the collectives.

use serde::Serialize;

use super::memory::{self, Memory};
use super::setting::{Holds, Layout, Setting};
use super::step::{flops_per_token, Scaling, StepTime};
use super::tensor::Link;
use super::{comm, muon};
use crate::dist::pipeline::{schedule, timeline, Action, Costs, Durations, Op, Pipeline, Timeline};
use crate::model::{GradUnit, Parameters};

/// What the pipeline of one layout does, as the plan reports it.
#[derive(Debug, Clone, Serialize)]
pub struct PipelinePlan {
    /// P, the schedule's name, stages per rank and micro-batches per step.
    pub ranks: usize,
    pub schedule: &'static str,
    pub stages_per_rank: usize,
    pub micro_batches: usize,
    /// Decoder layers of each stage, in stage order.
    pub stage_layers: Vec<usize>,
    /// Each pipeline rank's peak memory (bytes) and the micro-batch-stages of activations it
    /// keeps at once at its peak.
    pub rank_bytes: Vec<f64>,
    pub rank_in_flight: Vec<usize>,
    /// Each rank's kept activations at its peak, in decoder layers × micro-batches
    /// (`Holds::kept_layers`).
    pub rank_kept_layers: Vec<f64>,
    /// The share of the pipeline's time (without the sends) a rank of average work waits:
    /// the schedule's bubble and the stages with more work than the average.
    pub bubble: f64,
    /// One activation (or its gradient) between stages, in bytes; the bytes the busiest rank
    /// sends per step; the link and its bandwidth.
    pub message_bytes: f64,
    pub bytes_per_step: f64,
    pub link: Link,
    pub bandwidth: f64,
}

/// What makes two stages cost alike: decoder layers, MoE layers among them, the embedding,
/// the LM head.
type StageKind = (usize, usize, bool, bool);

/// One layout's pipeline: the plan's figures, the step's time and the peak rank's memory.
pub struct Run {
    pub plan: PipelinePlan,
    pub time: StepTime,
    pub memory: Memory,
    /// The data-parallel bytes the busiest rank sends per step (`comm::bytes_per_step`).
    pub data_parallel_bytes: f64,
}

/// The setting of the pipeline rank that holds `stages` of `pipe`'s, among `world` ranks in
/// all: its share of the model on the ranks of one stage, keeping `kept_layers` layers ×
/// micro-batches of activations (None: one micro-batch of its layers).
pub fn rank_setting(
    s: &Setting,
    pipe: &Pipeline,
    stages: &[usize],
    world: usize,
    kept_layers: Option<f64>,
) -> Setting {
    let cut = pipe.layers(s.shape.num_layers);
    let last = pipe.stages() - 1;
    let embedding = stages.contains(&0);
    let head = stages.contains(&last);
    let in_layers = |i: usize| stages.iter().any(|&st| cut[st].contains(&i));
    let tied = s.shape.tie_word_embeddings;
    let held = s.parameters.iter().filter(|p| match p.unit {
        GradUnit::Layer(i) => in_layers(i),
        GradUnit::Embedding => embedding || (tied && head),
        GradUnit::FinalNorm | GradUnit::LmHead => head,
    });
    let mut shape = s.shape.clone();
    shape.num_layers = stages.iter().map(|&st| cut[st].len()).sum();
    Setting {
        parameters: std::sync::Arc::new(Parameters::new(held.cloned().collect())),
        shape,
        world: world / pipe.ranks,
        pipeline_parallel: 1,
        holds: Holds {
            embedding,
            head,
            kept_layers,
        },
        ..s.clone()
    }
}

/// The relative durations of a forward and of a backward's two halves: a third of a token's
/// model FLOPs each, and the input gradient's also what activation checkpointing recomputes.
pub fn durations(s: &Setting, l: &Layout) -> Durations {
    let f = flops_per_token(s, l);
    Durations::recomputing(f.recomputed / (f.model / 3.0))
}

/// The bytes of one micro-batch's activation at a stage boundary, as one rank sends it (the
/// residual stream: fp32).
fn message_bytes(s: &Setting, l: &Layout) -> f64 {
    let split = if s.splits_sequence() {
        s.tensor_parallel as f64
    } else {
        1.0
    };
    (l.batch * s.tokens_per_sequence() * s.shape.hidden_size) as f64 * 4.0 / split
}

/// The pipeline of layout `l` on `world` ranks.
pub fn run(s: &Setting, l: &Layout, world: usize) -> Run {
    let pipe = s.pipeline(l);
    let m = pipe.micro_batches as f64;
    let stage_world = world / pipe.ranks;
    // Each stage's work for the step: its FLOPs and its groups' collectives.
    // Stages alike (layers, MoE layers, the embedding, the head) cost alike: each kind once.
    let cut = pipe.layers(s.shape.num_layers);
    let last = pipe.stages() - 1;
    let mut kinds: Vec<(StageKind, (f64, StepTime))> = Vec::new();
    let stages: Vec<(f64, StepTime)> = (0..pipe.stages())
        .map(|st| {
            let sparse = cut[st].clone().filter(|&i| s.shape.is_sparse(i)).count();
            let kind = (cut[st].len(), sparse, st == 0, st == last);
            if let Some((_, cost)) = kinds.iter().find(|(k, _)| *k == kind) {
                return *cost;
            }
            let one = rank_setting(s, &pipe, &[st], world, None);
            let t = StepTime::of(&one, l, stage_world);
            let work = t.compute_seconds
                + t.tensor_parallel_seconds
                + t.context_parallel_seconds
                + t.expert_parallel_seconds;
            kinds.push((kind, (work, t)));
            (work, t)
        })
        .collect();
    let durations = durations(s, l);
    let link = Link::spanning(s, world);
    let bytes = message_bytes(s, l);
    // A micro-batch's share of a stage's work, split as the actions' durations are.
    let whole = durations.forward + durations.input + durations.weight;
    let seconds = |a: Action| stages[a.stage].0 / m * durations.of(a.op) / whole;
    let kept = |st: usize| cut[st].len() as f64;
    let lists = schedule::actions(&pipe).expect("a schedule the config checks accept");
    let time_with = |link_seconds: f64| -> Timeline {
        let costs = Costs {
            seconds: &seconds,
            link: link_seconds,
            kept: &kept,
        };
        timeline::run(&pipe, &lists, &costs).expect("the schedule's own action lists")
    };
    let sent = time_with(bytes / link.bandwidth(s));
    let idle = time_with(0.0);
    // The ranks: memory at their peaks, and the reductions after their last backward.
    let mut rank_bytes = Vec::new();
    let mut peak: Option<Memory> = None;
    let (mut data_parallel, mut muon_seconds, mut dp_bytes) = (0.0f64, 0.0f64, 0.0f64);
    let mut mean = StepTime::default();
    for r in 0..pipe.ranks {
        let mine = pipe.stages_of(r);
        let rank = rank_setting(s, &pipe, &mine, world, Some(sent.peak_kept[r]));
        let memory = memory::estimate(&rank, l);
        rank_bytes.push(memory.total());
        if peak.is_none_or(|p: Memory| memory.total() > p.total()) {
            peak = Some(memory);
        }
        data_parallel = data_parallel.max(comm::seconds_per_step(&rank, l, stage_world));
        dp_bytes = dp_bytes.max(comm::bytes_per_step(&rank, l, l.zero_stage, stage_world));
        muon_seconds = muon_seconds
            .max(muon::cost(&rank, l.zero_stage, stage_world).map_or(0.0, |c| c.seconds));
        for &st in &mine {
            let t = &stages[st].1;
            let share = 1.0 / pipe.ranks as f64;
            mean.compute_seconds += t.compute_seconds * share;
            mean.tensor_parallel_seconds += t.tensor_parallel_seconds * share;
            mean.context_parallel_seconds += t.context_parallel_seconds * share;
            mean.expert_parallel_seconds += t.expert_parallel_seconds * share;
        }
    }
    let work = mean.compute_seconds
        + mean.tensor_parallel_seconds
        + mean.context_parallel_seconds
        + mean.expert_parallel_seconds;
    let time = StepTime {
        data_parallel_seconds: data_parallel,
        muon_seconds,
        pipeline_bubble_seconds: (idle.makespan - work).max(0.0),
        pipeline_p2p_seconds: (sent.makespan - idle.makespan).max(0.0),
        ..mean
    };
    let sends = lists
        .iter()
        .map(|list| {
            list.iter()
                .filter(|a| sends_to_another_rank(&pipe, a))
                .count()
        })
        .max()
        .unwrap_or(0);
    Run {
        plan: PipelinePlan {
            ranks: pipe.ranks,
            schedule: pipe.schedule.name(),
            stages_per_rank: pipe.per_rank,
            micro_batches: pipe.micro_batches,
            stage_layers: cut.iter().map(|r| r.len()).collect(),
            rank_bytes,
            rank_in_flight: sent.peak_in_flight.clone(),
            rank_kept_layers: sent.peak_kept.clone(),
            bubble: time.pipeline_bubble_seconds / idle.makespan,
            message_bytes: bytes,
            bytes_per_step: sends as f64 * bytes,
            link,
            bandwidth: link.bandwidth(s),
        },
        time,
        memory: peak.expect("a pipeline has a rank"),
        data_parallel_bytes: dp_bytes,
    }
}

/// A pipeline with fewer micro-batches than stages trains, and most of it waits: the warning
/// `plan` prints (and `train` will), with the idle share of the schedule's least busy rank in
/// the textbook costs and what 2P micro-batches would bring it to. None otherwise.
pub fn micro_batch_note(s: &Setting, l: &Layout) -> Option<String> {
    let pipe = s.pipeline(l);
    let (p, m) = (pipe.ranks, pipe.micro_batches);
    if p == 1 || m >= p {
        return None;
    }
    let bubble = |pipe: &Pipeline| {
        let lists = schedule::actions(pipe).ok()?;
        let t = timeline::run(pipe, &lists, &Costs::units()).ok()?;
        Some(t.worst_bubble())
    };
    let more = Pipeline {
        micro_batches: 2 * p,
        ..pipe
    };
    Some(format!(
        "training.grad_accum_nums = {m} micro-batches for system.pipeline_parallel = {p} \
         stages: each rank idles {:.0}% of the step (the pipeline's bubble); {} or more \
         micro-batches bring it under {:.0}%",
        100.0 * bubble(&pipe)?,
        2 * p,
        100.0 * bubble(&more)? + 0.5
    ))
}

/// Weak scaling of a pipeline layout at `world` ranks (`step::scaling`'s figures).
pub fn scaling(s: &Setting, l: &Layout, world: usize) -> Scaling {
    let run = run(s, l, world);
    let t = run.time;
    Scaling {
        ranks: world,
        bytes_per_rank: run.data_parallel_bytes,
        comm_seconds: t.data_parallel_seconds,
        tensor_parallel_seconds: t.tensor_parallel_seconds,
        context_parallel_seconds: t.context_parallel_seconds,
        expert_parallel_seconds: t.expert_parallel_seconds,
        efficiency: t.efficiency(),
        efficiency_overlapped: t.efficiency_overlapped(),
    }
}

/// The pipeline rank whose memory `plan` reports (the one with the most) and its setting.
pub fn peak_rank(s: &Setting, l: &Layout, plan: &PipelinePlan) -> (usize, Setting) {
    let pipe = s.pipeline(l);
    let bytes = &plan.rank_bytes;
    // The first of the largest, as `run` picks the memory it reports.
    let r = (0..bytes.len()).fold(0, |best, r| if bytes[r] > bytes[best] { r } else { best });
    let kept = Some(plan.rank_kept_layers[r]);
    (r, rank_setting(s, &pipe, &pipe.stages_of(r), s.world, kept))
}

/// Whether action `a` ends by sending to another rank: a forward to the next stage, an input
/// gradient (or whole backward) to the previous one.
fn sends_to_another_rank(pipe: &Pipeline, a: &Action) -> bool {
    let to = match a.op {
        Op::Forward if a.stage + 1 < pipe.stages() => a.stage + 1,
        Op::Backward | Op::BackwardInput if a.stage > 0 => a.stage - 1,
        _ => return false,
    };
    pipe.rank_of(to) != pipe.rank_of(a.stage)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::estimate::{estimate, Estimate};
    use crate::plan::test_setting;

    /// Llama-3.1-8B's dimensions with 8 layers, bf16, on `world` ranks, plus `extra`.
    fn eight_layers(world: usize, extra: &[&str]) -> (Setting, Layout) {
        let mut sets = vec!["model.num_layers=8", "model.vocab_size=128256"];
        sets.extend(extra);
        test_setting(&sets, world)
    }

    /// Each pipeline rank holds its stages' layers, the first the embedding and the last the
    /// final norm and the LM head; tied embeddings put the embedding on both.
    #[test]
    fn a_rank_holds_its_stages_and_the_ends_their_extras() {
        let (s, l) = eight_layers(4, &["system.pipeline_parallel=4"]);
        let pipe = s.pipeline(&l);
        let ranks: Vec<Setting> = (0..4)
            .map(|r| rank_setting(&s, &pipe, &pipe.stages_of(r), 4, None))
            .collect();
        let held: usize = ranks.iter().map(|r| r.parameters.count()).sum();
        assert_eq!(held, s.parameters.count(), "every parameter on one rank");
        assert!(ranks[0].parameters.contains("model.embed_tokens.weight"));
        assert!(ranks[0]
            .parameters
            .contains("model.layers.1.mlp.up_proj.weight"));
        assert!(!ranks[0]
            .parameters
            .contains("model.layers.2.mlp.up_proj.weight"));
        assert!(ranks[3].parameters.contains("lm_head.weight"));
        assert!(ranks[3].parameters.contains("model.norm.weight"));
        assert!((ranks[0].holds.embedding, ranks[0].holds.head) == (true, false));
        assert!((ranks[3].holds.embedding, ranks[3].holds.head) == (false, true));
        assert_eq!((ranks[1].shape.num_layers, ranks[1].world), (2, 1));

        let (tied, l) = eight_layers(
            4,
            &[
                "system.pipeline_parallel=4",
                "model.tie_word_embeddings=true",
            ],
        );
        let pipe = tied.pipeline(&l);
        let last = rank_setting(&tied, &pipe, &[3], 4, None);
        assert!(last.parameters.contains("model.embed_tokens.weight"));
        // Interleaved: rank 1 of 2 holds stages 1 and 3 of four.
        let (v, l) = eight_layers(
            2,
            &[
                "system.pipeline_parallel=2",
                "system.pipeline_schedule=interleaved",
                "system.virtual_stages=2",
                "training.grad_accum_nums=2",
            ],
        );
        let pipe = v.pipeline(&l);
        let one = rank_setting(&v, &pipe, &pipe.stages_of(1), 2, None);
        assert!(one
            .parameters
            .contains("model.layers.2.self_attn.q_proj.weight"));
        assert!(one
            .parameters
            .contains("model.layers.7.self_attn.q_proj.weight"));
        assert!(!one
            .parameters
            .contains("model.layers.4.self_attn.q_proj.weight"));
        assert!(one.holds.head && !one.holds.embedding);
    }

    /// 1F1B's first rank keeps P micro-batches of its L/P layers: the layer inputs of one
    /// micro-batch through the whole model, as one rank without a pipeline keeps; the last
    /// rank keeps one micro-batch of its layers.
    #[test]
    fn one_f_one_b_s_first_rank_keeps_what_the_whole_model_keeps_per_micro_batch() {
        let full = "training.activation_checkpointing=full";
        let (one, l1) = eight_layers(1, &[full, "training.grad_accum_nums=8"]);
        let whole = memory::estimate(&one, &l1);
        let (s, l) = eight_layers(
            4,
            &[
                full,
                "training.grad_accum_nums=8",
                "system.pipeline_parallel=4",
            ],
        );
        let run = run(&s, &l, 4);
        assert_eq!(run.plan.rank_in_flight, [4, 3, 2, 1]);
        assert_eq!(run.plan.rank_kept_layers, [8.0, 6.0, 4.0, 2.0]);
        assert_eq!(run.plan.stage_layers, [2, 2, 2, 2]);
        let pipe = s.pipeline(&l);
        let first = rank_setting(&s, &pipe, &[0], 4, Some(8.0));
        let m = memory::estimate(&first, &l);
        // The same layer inputs and one layer recomputed; the LM head is the last rank's.
        assert!((m.activations - whole.activations).abs() < 1e-6 * whole.activations);
        assert_eq!(m.logits, 0.0);
        assert!(m.weights < whole.weights / 2.0);
    }

    /// The plan's bubble falls with the schedules as their definitions say: interleaved and
    /// ZB-V idle less than 1F1B at the same micro-batches, more micro-batches idle less.
    #[test]
    fn interleaving_and_zbv_shorten_the_step_and_more_micro_batches_too() {
        let step = |extra: &[&str]| {
            let mut sets = vec!["system.pipeline_parallel=4", "training.grad_accum_nums=8"];
            sets.extend(extra);
            let (s, l) = eight_layers(4, &sets);
            estimate(&s, &l)
        };
        let one = step(&[]);
        let inter = step(&[
            "system.pipeline_schedule=interleaved",
            "system.virtual_stages=2",
        ]);
        let zbv = step(&["system.pipeline_schedule=zbv"]);
        let more = step(&["training.grad_accum_nums=32"]);
        let bubble = |e: &Estimate| e.pipeline.as_ref().unwrap().bubble;
        assert!(bubble(&inter) < bubble(&one) && bubble(&zbv) < bubble(&one));
        assert!(bubble(&more) < bubble(&one));
        for e in [&one, &inter, &zbv] {
            assert!(e.time.pipeline_bubble_seconds > 0.0, "{:?}", e.time);
            assert!(e.time.pipeline_p2p_seconds > 0.0);
            assert!((e.step_seconds - e.time.total()).abs() < 1e-9);
        }
        assert!(inter.step_seconds < one.step_seconds && zbv.step_seconds < one.step_seconds);
    }

    /// Fewer micro-batches than stages trains, with the bubble said.
    #[test]
    fn fewer_micro_batches_than_stages_are_warned_of_with_the_bubble() {
        let (s, l) = eight_layers(
            4,
            &["system.pipeline_parallel=4", "training.grad_accum_nums=2"],
        );
        let note = micro_batch_note(&s, &l).unwrap();
        assert!(
            note.contains(
                "training.grad_accum_nums = 2 micro-batches for system.pipeline_parallel = 4 \
                 stages: each rank idles 60% of the step (the pipeline's bubble); 8 or more \
                 micro-batches bring it under 28%"
            ),
            "{note}"
        );
        let (s, l) = eight_layers(
            4,
            &["system.pipeline_parallel=4", "training.grad_accum_nums=4"],
        );
        assert!(micro_batch_note(&s, &l).is_none());
    }

    /// The goal, in the plan: Llama-3.1-405B on 512 × 80 GB with 8 pipeline × 8
    /// tensor-parallel ranks, interleaved, 32 micro-batches of one sequence per data rank,
    /// zero stage 2, full checkpointing: it fits and reaches 80% (BENCHMARKS.md section 23).
    #[test]
    fn llama_405b_fits_512_gpus_at_80_percent_with_8_stages_and_tp_8() {
        let (s, l) = test_setting(
            &[
                "model.num_layers=126",
                "model.hidden_size=16384",
                "model.num_attention_heads=128",
                "model.num_key_value_heads=8",
                "model.intermediate_size=53248",
                "model.vocab_size=128256",
                "training.context_length=8192",
                "training.batch_size=1",
                "training.dtype=bf16",
                "training.activation_checkpointing=full",
                "training.grad_accum_nums=32",
                "system.zero_stage=2",
                "system.tensor_parallel=8",
                "system.pipeline_parallel=8",
                "system.pipeline_schedule=interleaved",
                "system.virtual_stages=4",
            ],
            512,
        );
        let e = estimate(&s, &l);
        assert!(e.fits, "{}", e.total_bytes);
        assert!(e.efficiency >= 0.8, "{}", e.efficiency);
        let p = e.pipeline.unwrap();
        assert_eq!(p.stage_layers.len(), 32);
        assert_eq!(p.stage_layers.iter().sum::<usize>(), 126);
    }
}
