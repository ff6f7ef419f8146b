//! The cheapest change that fits: every combination of the knobs that trade memory for time
//! (a smaller micro-batch with more accumulation, LM-head chunks, activation checkpointing,
//! a higher zero stage) is estimated, and of those that fit the one with the shortest
//! estimated step wins. Each knob only moves towards less memory; tokens per step stay the
//! same. The step-time model counts recomputed FLOPs and communication; a smaller micro-batch
//! has the same FLOPs but smaller matmuls, charged as 3% per halving (an assumption, stated in
//! the output).
//!
//! Beside it, tensor parallelism on GPUs ([`tensor_parallel`]): when the data-parallel layouts
//! do not fit, or the best of them spends more than a fifth of its step communicating, the
//! smallest T of 2, 4, 8 (dividing the heads, the KV heads, the FFN width and the GPUs per
//! node, so a TP group stays in a node) that fits at [`EFFICIENCY_TARGET`] or better, else the
//! most efficient one that fits. The world's tokens per step stay the same: with T times fewer
//! data-parallel ranks each trains T times as many tokens per step. At the new T every layout
//! of the knobs above is a candidate, the lower zero stages and lighter checkpointing included:
//! the TP share is what makes them fit.
//!
//! And context parallelism on GPUs ([`context_parallel`]): when one sequence does not fit a
//! rank of the current mesh at any zero stage, checkpointing mode, micro-batch or LM-head
//! chunking, the smallest C above the configured one (a multiple of it that divides the ranks
//! over T, with 2C dividing the context) at which a layout fits at the configured T; where no
//! C is enough alone, the smallest TP degree the TP advice could propose and the smallest C
//! with it. It is proposed beside the TP advice, not instead of it: a TP group can make a
//! long sequence fit too (it divides the activations inside the blocks, and with sequence
//! parallelism those between them), and the two say what each needs and costs. Both keep the
//! world's tokens per step (the D data-parallel ranks left each train C·T/(C₀·T₀) times as
//! many sequences), so their steps compare.
use serde::Serialize;

use super::device::Device;
use super::estimate::{estimate, Estimate};
use super::setting::{Layout, Setting};
use super::tensor::Link;
use crate::config::{PipelineSchedule, ZeroStage};
use crate::model::ActivationCheckpointing;

/// A layout to switch to, and what it would cost.
#[derive(Debug, Clone, Serialize)]
pub struct Change {
    pub layout: Layout,
    /// The `--set` overrides that turn the current layout into this one.
    pub sets: Vec<String>,
    pub total_bytes: f64,
    /// Estimated step time relative to the current layout's, minus one.
    pub slowdown: f64,
    /// The layout's estimated step and scaling efficiency (`StepTime`).
    pub step_seconds: f64,
    pub efficiency: f64,
}

impl Change {
    /// The change as command-line flags: `--set a=1 --set b=2`.
    pub fn flags(&self) -> String {
        self.sets
            .iter()
            .map(|s| format!("--set {s}"))
            .collect::<Vec<_>>()
            .join(" ")
    }

    /// The change from `current` to the layout of estimate `e`, `slowdown` against `base`
    /// seconds per step.
    fn to(current: &Layout, e: &Estimate, cost: f64, base: f64) -> Change {
        Change {
            layout: e.layout,
            sets: sets(current, &e.layout),
            total_bytes: e.total_bytes,
            slowdown: cost / base - 1.0,
            step_seconds: e.step_seconds,
            efficiency: e.efficiency,
        }
    }
}

/// A change of `system.tensor_parallel` with the layout that goes with it.
#[derive(Debug, Clone, Serialize)]
pub struct TensorParallelChange {
    /// The new T, and the data-parallel ranks it leaves.
    pub tensor_parallel: usize,
    pub data_parallel_ranks: usize,
    /// `system.tensor_parallel=T` and the layout's `--set`s; `slowdown` is against the current
    /// layout's step (the same tokens in all).
    pub change: Change,
}

/// A change of `system.context_parallel` (and where needed `system.tensor_parallel`) with the
/// layout that goes with it.
#[derive(Debug, Clone, Serialize)]
pub struct ContextParallelChange {
    /// The new C and T, and the data-parallel ranks they leave.
    pub context_parallel: usize,
    pub tensor_parallel: usize,
    pub data_parallel_ranks: usize,
    /// `system.context_parallel=C`, `system.tensor_parallel=T` where it changes, and the
    /// layout's `--set`s; `slowdown` is against the current layout's step (the same tokens in
    /// all).
    pub change: Change,
}

/// Charged per halving of the micro-batch.
const SMALLER_GEMM_PENALTY: f64 = 0.03;

/// The scaling efficiency below which tensor parallelism is proposed, and that it aims for.
pub const EFFICIENCY_TARGET: f64 = 0.8;

/// A change of `system.expert_parallel` with the layout that goes with it.
#[derive(Debug, Clone, Serialize)]
pub struct ExpertParallelChange {
    /// The new E, the experts of each MoE layer a rank then holds, and where the group's
    /// all-to-alls run.
    pub expert_parallel: usize,
    pub experts_per_rank: usize,
    pub link: Link,
    /// Bytes one rank sends to its group per step at the new E, and their seconds.
    pub all_to_all_bytes_per_step: f64,
    pub all_to_all_seconds: f64,
    /// `system.expert_parallel=E` and the layout's `--set`s; `slowdown` is against the current
    /// layout's step (the same tokens: E is carved out of the data-parallel ranks).
    pub change: Change,
}

/// A step at least this much shorter makes expert parallelism worth proposing when the model
/// fits without it.
pub const EXPERT_PARALLEL_GAIN: f64 = 0.05;

/// The tensor-parallel degrees proposed.
const TENSOR_PARALLEL_DEGREES: [usize; 3] = [2, 4, 8];

fn strength(m: ActivationCheckpointing) -> u8 {
    match m {
        ActivationCheckpointing::None => 0,
        ActivationCheckpointing::Selective => 1,
        ActivationCheckpointing::Full => 2,
    }
}

/// Every layout that keeps the tokens per step and uses no more memory-hungry setting than
/// `current` on any knob, and that the config checks accept: sequence parallelism splits the
/// micro-batch's tokens evenly, hybrid sharding needs a sharding stage.
fn candidates(s: &Setting, current: &Layout) -> Vec<Layout> {
    let chunk_rank = |c: usize| if c == 0 { usize::MAX } else { c };
    let mut chunks = vec![current.loss_chunk_tokens];
    for c in [1024, 256] {
        if c < chunk_rank(current.loss_chunk_tokens) {
            chunks.push(c);
        }
    }
    let modes: Vec<ActivationCheckpointing> = [
        ActivationCheckpointing::None,
        ActivationCheckpointing::Selective,
        ActivationCheckpointing::Full,
    ]
    .into_iter()
    .filter(|m| strength(*m) >= strength(current.activation_checkpointing))
    .collect();
    // Sharding only saves memory across ranks: alone, a rank keeps the stage it has.
    let replicas = s.replica_ranks(s.world);
    let stages: Vec<ZeroStage> = if replicas > 1 {
        ZeroStage::ALL
            .into_iter()
            .filter(|z| *z >= current.zero_stage)
            .collect()
    } else {
        vec![current.zero_stage]
    };
    let batches: Vec<usize> = (1..=current.batch)
        .filter(|b| current.batch.is_multiple_of(*b))
        .filter(|b| {
            !s.splits_sequence() || (b * s.tokens_per_sequence()).is_multiple_of(s.tensor_parallel)
        })
        .collect();
    let hybrid = s.shard_ranks(s.world) < replicas;
    let mut out = Vec::new();
    for &loss_chunk_tokens in &chunks {
        for &activation_checkpointing in &modes {
            for &zero_stage in stages.iter().filter(|z| !hybrid || z.shards_optimizer()) {
                for &batch in &batches {
                    out.push(Layout {
                        zero_stage,
                        activation_checkpointing,
                        loss_chunk_tokens,
                        batch,
                        grad_accum: current.grad_accum * current.batch / batch,
                    });
                }
            }
        }
    }
    out
}

fn sets(current: &Layout, to: &Layout) -> Vec<String> {
    let mut v = Vec::new();
    if to.batch != current.batch || to.grad_accum != current.grad_accum {
        v.push(format!("training.batch_size={}", to.batch));
        v.push(format!("training.grad_accum_nums={}", to.grad_accum));
    }
    if to.loss_chunk_tokens != current.loss_chunk_tokens {
        v.push(format!(
            "training.loss_chunk_tokens={}",
            to.loss_chunk_tokens
        ));
    }
    if to.activation_checkpointing != current.activation_checkpointing {
        v.push(format!(
            "training.activation_checkpointing={}",
            to.activation_checkpointing
        ));
    }
    if to.zero_stage != current.zero_stage {
        v.push(format!("system.zero_stage={}", to.zero_stage));
    }
    v
}

/// The cheapest layout whose estimate is at most `limit` bytes (None when none is); the
/// current layout itself when it already is.
pub fn cheapest_within(s: &Setting, current: &Layout, limit: f64) -> Option<Change> {
    let base = estimate(s, current).step_seconds;
    cheapest(s, current, current, limit).map(|(e, cost)| Change::to(current, &e, cost, base))
}

/// Of `candidates(s, from)`, the layout whose estimate is at most `limit` bytes with the
/// shortest step, charged for micro-batches smaller than `from`'s; of equal ones, the one with
/// fewer `--set`s from `current`, then the one with less memory. Its estimate and charged
/// step.
fn cheapest(s: &Setting, from: &Layout, current: &Layout, limit: f64) -> Option<(Estimate, f64)> {
    let mut best: Option<(f64, usize, Estimate)> = None;
    for l in candidates(s, from) {
        let e = estimate(s, &l);
        if e.total_bytes > limit {
            continue;
        }
        let halvings = (from.batch as f64 / l.batch as f64).log2();
        let cost = e.step_seconds * (1.0 + SMALLER_GEMM_PENALTY * halvings);
        let n = sets(current, &l).len();
        let better = match &best {
            None => true,
            Some((c, k, b)) => {
                cost < c * (1.0 - 1e-9)
                    || (cost <= c * (1.0 + 1e-9)
                        && (n < *k || (n == *k && e.total_bytes < b.total_bytes)))
            }
        };
        if better {
            best = Some((cost, n, e));
        }
    }
    best.map(|(cost, _, e)| (e, cost))
}

/// Tensor parallelism to propose on GPUs (None elsewhere, or when the data-parallel layouts
/// already fit at [`EFFICIENCY_TARGET`], or when no T helps): of 2, 4, 8, the multiples of the
/// configured T above it that divide the heads, the KV heads, the FFN width (as
/// `config::check_tensor_parallel` requires), the GPUs per node and the ranks over C, the
/// smallest whose cheapest fitting layout reaches the target; else the most efficient fitting
/// one, if the data-parallel layouts do not fit or are less efficient.
pub fn tensor_parallel(s: &Setting, current: &Layout) -> Option<TensorParallelChange> {
    if s.device != Device::Cuda {
        return None;
    }
    let now = estimate(s, current);
    let data_only = if now.fits {
        Some(now.efficiency)
    } else {
        cheapest_within(s, current, s.budget).map(|c| c.efficiency)
    };
    if data_only.is_some_and(|e| e >= EFFICIENCY_TARGET) {
        return None;
    }
    let options: Vec<TensorParallelChange> = tensor_degrees(s, s.context_parallel)
        .into_iter()
        .filter(|&t| t > s.tensor_parallel)
        .filter_map(|t| at_degree(s, current, t, now.step_seconds))
        .collect();
    if let Some(first) = options
        .iter()
        .find(|o| o.change.efficiency >= EFFICIENCY_TARGET)
    {
        return Some(first.clone());
    }
    options
        .into_iter()
        .max_by(|a, b| a.change.efficiency.total_cmp(&b.change.efficiency))
        .filter(|best| data_only.is_none_or(|e| best.change.efficiency > e))
}

/// The TP degrees a mesh with CP groups of `c` may use: the configured T and those of 2, 4, 8
/// that are multiples of it and divide the heads, the KV heads, the FFN width (as
/// `config::check_tensor_parallel` requires), the GPUs per node and the ranks over `c`; with
/// sequence parallelism also a rank's tokens of a sequence (s/c, as the config checks
/// require); with expert parallelism leaving replicas E divides.
fn tensor_degrees(s: &Setting, c: usize) -> Vec<usize> {
    let sh = &s.shape;
    std::iter::once(s.tensor_parallel)
        .chain(TENSOR_PARALLEL_DEGREES.into_iter().filter(|&t| {
            t > s.tensor_parallel
                && t.is_multiple_of(s.tensor_parallel)
                && crate::config::tensor_parallel_splits(
                    t,
                    (sh.num_heads, sh.num_kv_heads, &sh.mlp_widths()),
                )
                && s.node_size.is_multiple_of(t)
                && (s.world / (s.pipeline_parallel * c)).is_multiple_of(t)
                && (!s.sequence_parallel || (s.context / c).is_multiple_of(t))
                && (s.world / (s.pipeline_parallel * t)).is_multiple_of(s.expert_parallel)
        }))
        .collect()
}

/// The cheapest fitting layout at T = `t` that trains the world's tokens per step: each of the
/// fewer data-parallel ranks k = t / T times as many sequences (in micro-batches of up to k
/// times the current one, the rest as accumulation), at any zero stage and checkpointing mode.
/// `base` is the current layout's step time. None when nothing fits, or hybrid sharding's
/// groups do not divide the replica ranks left.
fn at_degree(s: &Setting, current: &Layout, t: usize, base: f64) -> Option<TensorParallelChange> {
    let (mesh, e) = at_mesh(s, current, s.context_parallel, t)?;
    let mut change = Change::to(current, &e, e.step_seconds, base);
    change.sets.insert(0, format!("system.tensor_parallel={t}"));
    Some(TensorParallelChange {
        tensor_parallel: t,
        data_parallel_ranks: mesh.data_ranks(mesh.world),
        change,
    })
}

/// The mesh of CP groups of `c` and TP groups of `t` (multiples of the configured C and T),
/// and its cheapest layout within the budget that trains the world's tokens per step: each of
/// the fewer data-parallel ranks k = c·t / (C·T) times as many sequences (in micro-batches of
/// up to k times the current one, the rest as accumulation), at any zero stage and
/// checkpointing mode. None when nothing fits, or hybrid sharding's groups do not divide the
/// replica ranks left.
fn at_mesh(s: &Setting, current: &Layout, c: usize, t: usize) -> Option<(Setting, Estimate)> {
    let k = (c * t) / (s.context_parallel * s.tensor_parallel);
    let mesh = Setting {
        tensor_parallel: t,
        context_parallel: c,
        ..s.clone()
    };
    let replicas = mesh.replica_ranks(mesh.world);
    if mesh.shard_degree > 0 && !replicas.is_multiple_of(mesh.shard_degree) {
        return None;
    }
    let from = Layout {
        zero_stage: ZeroStage::Replicated,
        activation_checkpointing: ActivationCheckpointing::None,
        batch: current.batch * k,
        ..*current
    };
    let (e, _) = cheapest(&mesh, &from, current, s.budget)?;
    Some((mesh, e))
}

/// Context parallelism to propose on GPUs (None elsewhere, when a layout of the current mesh
/// fits, or when no C helps; see the module's notes): the smallest C above the configured one
/// — a multiple of it that divides the ranks over T, with 2C dividing the context — at which
/// a layout fits at the configured T; else the smallest TP degree the TP advice may use with
/// the smallest C that fits with it.
pub fn context_parallel(s: &Setting, current: &Layout) -> Option<ContextParallelChange> {
    if s.device != Device::Cuda {
        return None;
    }
    let now = estimate(s, current);
    if now.fits || cheapest_within(s, current, s.budget).is_some() {
        return None;
    }
    let ranks = s.replica_ranks(s.world);
    let degrees: Vec<usize> = (s.context_parallel + 1..=ranks)
        .filter(|&c| {
            c.is_multiple_of(s.context_parallel)
                && ranks.is_multiple_of(c)
                && s.context.is_multiple_of(2 * c)
        })
        .collect();
    let (mesh, e) = tensor_degrees(s, 1).into_iter().find_map(|t| {
        degrees
            .iter()
            .filter(|&&c| tensor_degrees(s, c).contains(&t))
            .find_map(|&c| at_mesh(s, current, c, t))
    })?;
    let mut change = Change::to(current, &e, e.step_seconds, now.step_seconds);
    if mesh.tensor_parallel != s.tensor_parallel {
        change.sets.insert(
            0,
            format!("system.tensor_parallel={}", mesh.tensor_parallel),
        );
    }
    change.sets.insert(
        0,
        format!("system.context_parallel={}", mesh.context_parallel),
    );
    Some(ContextParallelChange {
        context_parallel: mesh.context_parallel,
        tensor_parallel: mesh.tensor_parallel,
        data_parallel_ranks: mesh.data_ranks(mesh.world),
        change,
    })
}

/// Expert parallelism to propose for a mixture of experts on GPUs (None elsewhere, for a dense
/// model, or when no E helps), at the configured tensor and context parallelism.
/// Of the degrees `expert::degrees` lists (dividing the experts per layer, the replicas and
/// any hybrid shard degree, inside a node first): when no layout fits at the configured E, the first
/// at which one does; when one fits, the E whose cheapest fitting layout has the shortest
/// step, if that is [`EXPERT_PARALLEL_GAIN`] shorter than the configured E's cheapest. The
/// tokens per step stay the same (E is carved out of the data-parallel ranks).
pub fn expert_parallel(s: &Setting, current: &Layout) -> Option<ExpertParallelChange> {
    if s.device != Device::Cuda || s.shape.moe.is_none() {
        return None;
    }
    let now = estimate(s, current);
    let best_now = cheapest_within(s, current, s.budget).map(|c| c.step_seconds);
    let mut options = super::expert::degrees(s)
        .into_iter()
        .filter(|&e| e != s.expert_parallel)
        .filter_map(|e| at_expert_degree(s, current, e, now.step_seconds));
    match best_now {
        None => options.next(),
        Some(best) => options
            .min_by(|a, b| a.change.step_seconds.total_cmp(&b.change.step_seconds))
            .filter(|o| o.change.step_seconds < (1.0 - EXPERT_PARALLEL_GAIN) * best),
    }
}

/// The cheapest fitting layout at E = `e` (any zero stage, checkpointing mode and
/// micro-batch of the current one's tokens), `base` the current layout's step time.
fn at_expert_degree(
    s: &Setting,
    current: &Layout,
    e: usize,
    base: f64,
) -> Option<ExpertParallelChange> {
    let mesh = Setting {
        expert_parallel: e,
        ..s.clone()
    };
    let from = Layout {
        zero_stage: ZeroStage::Replicated,
        activation_checkpointing: ActivationCheckpointing::None,
        ..*current
    };
    let (est, cost) = cheapest(&mesh, &from, current, s.budget)?;
    let mut change = Change::to(current, &est, cost, base);
    change.sets.insert(0, format!("system.expert_parallel={e}"));
    let experts = s.shape.moe.as_ref().map_or(0, |m| m.num_experts);
    Some(ExpertParallelChange {
        expert_parallel: e,
        experts_per_rank: experts / e,
        link: super::expert::link(&mesh),
        all_to_all_bytes_per_step: super::expert::bytes_per_step(&mesh, &est.layout),
        all_to_all_seconds: super::expert::seconds_per_step(&mesh, &est.layout),
        change,
    })
}

/// A pipeline layout (`system.pipeline_parallel`, its schedule and virtual stages) with the
/// cheapest layout of the other knobs that fits with it.
#[derive(Debug, Clone, Serialize)]
pub struct PipelineOption {
    pub pipeline_parallel: usize,
    pub schedule: PipelineSchedule,
    pub virtual_stages: usize,
    /// The data-parallel ranks left, and the idle share of the busiest-idle rank.
    pub data_parallel_ranks: usize,
    pub bubble: f64,
    /// The pipeline's `--set`s and the layout's; `slowdown` is against the current layout's
    /// step (the same tokens in all).
    pub change: Change,
}

/// The schedules the pipeline advice tries: 1F1B, interleaved with 2 and 4 stages per rank,
/// ZB-V.
const PIPELINE_SCHEDULES: [(PipelineSchedule, usize); 4] = [
    (PipelineSchedule::OneFOneB, 1),
    (PipelineSchedule::Interleaved, 2),
    (PipelineSchedule::Interleaved, 4),
    (PipelineSchedule::Zbv, 1),
];

/// Every pipeline layout on GPUs that fits (None elsewhere): each P dividing the ranks over
/// C·T (powers of two, up to the layers) with each schedule the config checks accept, at the
/// world's tokens per step (each of the P/P₀ times fewer data-parallel ranks trains P/P₀ times
/// as many micro-batches), each with its cheapest fitting layout of the other knobs; in the
/// order of P, then the schedules' order.
pub fn pipeline_options(s: &Setting, current: &Layout) -> Vec<PipelineOption> {
    if s.device != Device::Cuda {
        return Vec::new();
    }
    let base = estimate(s, current).step_seconds;
    // P × D: the ranks over C·T.
    let ranks = s.world / (s.context_parallel * s.tensor_parallel);
    let layers = s.shape.num_layers;
    let mut out = Vec::new();
    for p in (0..)
        .map(|k| 1usize << k)
        .take_while(|&p| p <= ranks.min(layers))
    {
        let data = ranks / p;
        if !ranks.is_multiple_of(p)
            || !(data * s.context_parallel).is_multiple_of(s.expert_parallel)
        {
            continue;
        }
        let tokens = current.grad_accum * p;
        if !tokens.is_multiple_of(s.pipeline_parallel) {
            continue;
        }
        let micro = tokens / s.pipeline_parallel;
        for (schedule, v) in PIPELINE_SCHEDULES {
            let per_rank = if schedule == PipelineSchedule::Zbv {
                2
            } else {
                v
            };
            let valid = match schedule {
                _ if p == 1 => schedule == PipelineSchedule::OneFOneB,
                PipelineSchedule::Interleaved => micro.is_multiple_of(p),
                _ => true,
            };
            if !valid || p * per_rank > layers {
                continue;
            }
            let mesh = Setting {
                pipeline_parallel: p,
                pipeline_schedule: schedule,
                virtual_stages: v,
                ..s.clone()
            };
            let replicas = mesh.replica_ranks(mesh.world);
            if mesh.shard_degree > 0 && !replicas.is_multiple_of(mesh.shard_degree) {
                continue;
            }
            let from = Layout {
                zero_stage: ZeroStage::Replicated,
                activation_checkpointing: ActivationCheckpointing::None,
                grad_accum: micro,
                ..*current
            };
            let Some((e, cost)) = cheapest(&mesh, &from, current, s.budget) else {
                continue;
            };
            let mut change = Change::to(current, &e, cost, base);
            let mut keys = vec![format!("system.pipeline_parallel={p}")];
            if p > 1 {
                keys.push(format!("system.pipeline_schedule={schedule}"));
                keys.push(format!("system.virtual_stages={v}"));
            }
            change.sets.splice(0..0, keys);
            out.push(PipelineOption {
                pipeline_parallel: p,
                schedule,
                virtual_stages: v,
                data_parallel_ranks: data,
                bubble: e.pipeline.as_ref().map_or(0.0, |pp| pp.bubble),
                change,
            });
        }
    }
    out
}

/// The pipeline layout to propose (see [`pipeline_options`]; None when there is none): when the
/// configured layout does not fit, or its step is below [`EFFICIENCY_TARGET`], the most
/// efficient option, if it beats the configured mesh's best fitting layout.
pub fn pipeline(
    s: &Setting,
    current: &Layout,
    options: &[PipelineOption],
) -> Option<PipelineOption> {
    let now = estimate(s, current);
    if now.fits && now.efficiency >= EFFICIENCY_TARGET {
        return None;
    }
    let here = if now.fits {
        Some(now.efficiency)
    } else {
        cheapest_within(s, current, s.budget).map(|c| c.efficiency)
    };
    options
        .iter()
        .filter(|o| {
            (o.pipeline_parallel, o.schedule, o.virtual_stages)
                != (s.pipeline_parallel, s.pipeline_schedule, s.virtual_stages)
        })
        .max_by(|a, b| a.change.efficiency.total_cmp(&b.change.efficiency))
        .filter(|best| here.is_none_or(|e| best.change.efficiency > e))
        .cloned()
}

/// The layout with the least memory of all candidates (what "even the most frugal layout
/// needs" says when nothing fits).
pub fn smallest(s: &Setting, current: &Layout) -> Change {
    let base = estimate(s, current).step_seconds;
    candidates(s, current)
        .into_iter()
        .map(|l| {
            let e = estimate(s, &l);
            Change::to(current, &e, e.step_seconds, base)
        })
        .min_by(|a, b| a.total_bytes.total_cmp(&b.total_bytes))
        .expect("the current layout is a candidate")
}

#[cfg(test)]
mod tests {
    use super::super::test_setting;
    use super::*;

    #[test]
    fn stages_go_up_to_3_across_ranks_and_stay_alone() {
        let stages = |world: usize, stage: usize| {
            let (s, l) = test_setting(
                &[
                    "model.vocab_size=128256",
                    &format!("system.zero_stage={stage}"),
                ],
                world,
            );
            let mut v: Vec<usize> = candidates(&s, &l)
                .iter()
                .map(|c| c.zero_stage.number())
                .collect();
            v.sort();
            v.dedup();
            v
        };
        assert_eq!(stages(8, 0), [0, 1, 2, 3]);
        assert_eq!(stages(8, 2), [2, 3]);
        assert_eq!(stages(1, 0), [0]);
        assert_eq!(stages(1, 3), [3]);
        // A TP group of 8 on 8 GPUs is one data-parallel rank: nothing to shard over.
        let (s, l) = test_setting(&["model.vocab_size=128256", "system.tensor_parallel=8"], 8);
        assert!(candidates(&s, &l)
            .iter()
            .all(|c| c.zero_stage == l.zero_stage));
    }

    /// Llama-3.1-70B's shape at context 8192, full checkpointing, on `world` GPUs of 80 GB.
    fn llama_70b(world: usize) -> (Setting, Layout) {
        test_setting(
            &[
                "model.num_layers=80",
                "model.hidden_size=8192",
                "model.num_attention_heads=64",
                "model.num_key_value_heads=8",
                "model.intermediate_size=28672",
                "model.vocab_size=128256",
                "training.activation_checkpointing=full",
            ],
            world,
        )
    }

    #[test]
    fn tensor_parallelism_is_proposed_where_data_parallelism_falls_short_on_gpus() {
        // 70B on 64 GPUs: stage 3 fits at under half its step computing.
        let (s, l) = llama_70b(64);
        let data_only = cheapest_within(&s, &l, s.budget).expect("stage 3 fits");
        assert!(data_only.efficiency < EFFICIENCY_TARGET, "{data_only:?}");
        let tp = tensor_parallel(&s, &l).expect("a TP degree helps");
        assert_eq!(tp.tensor_parallel, 8);
        assert_eq!(tp.data_parallel_ranks, 8);
        assert_eq!(tp.change.sets[0], "system.tensor_parallel=8");
        assert!(tp.change.efficiency > data_only.efficiency);
        // The same tokens per step over all ranks, in the memory it says.
        let to = tp.change.layout;
        assert_eq!(8 * to.batch * to.grad_accum, 64 * l.batch * l.grad_accum);
        let mesh = Setting {
            tensor_parallel: 8,
            ..s.clone()
        };
        let e = estimate(&mesh, &to);
        assert!(e.fits);
        assert_eq!(e.total_bytes, tp.change.total_bytes);
        assert_eq!(e.efficiency, tp.change.efficiency);
        // Not on CPU ranks, and not where data parallelism fits at the target (8B at stage 1
        // with full checkpointing on 8 GPUs).
        let cpu = Setting {
            device: Device::Cpu,
            ..s.clone()
        };
        assert!(tensor_parallel(&cpu, &l).is_none());
        let (s, l) = test_setting(
            &[
                "model.num_layers=32",
                "model.vocab_size=128256",
                "system.zero_stage=1",
                "training.activation_checkpointing=full",
            ],
            8,
        );
        let e = estimate(&s, &l);
        assert!(e.fits && e.efficiency >= EFFICIENCY_TARGET, "{e:?}");
        assert!(tensor_parallel(&s, &l).is_none());
    }

    /// Llama-3.1-8B (32 layers) at 131,072 tokens, one sequence per GPU, on `world` GPUs of
    /// 80 GB.
    fn llama_8b_128k(world: usize) -> (Setting, Layout) {
        test_setting(
            &[
                "model.num_layers=32",
                "model.vocab_size=128256",
                "training.context_length=131072",
                "training.batch_size=1",
                "training.grad_accum_nums=1",
            ],
            world,
        )
    }

    #[test]
    fn context_parallelism_is_proposed_where_one_sequence_fits_no_rank() {
        for (world, c) in [(8, 4), (16, 2), (32, 2)] {
            let (s, l) = llama_8b_128k(world);
            assert!(!estimate(&s, &l).fits);
            assert!(cheapest_within(&s, &l, s.budget).is_none(), "{world} GPUs");
            let cp = context_parallel(&s, &l).expect("a C fits");
            assert_eq!(
                (
                    cp.context_parallel,
                    cp.tensor_parallel,
                    cp.data_parallel_ranks
                ),
                (c, 1, world / c),
                "{world} GPUs"
            );
            assert_eq!(cp.change.sets[0], format!("system.context_parallel={c}"));
            assert!(!cp
                .change
                .sets
                .iter()
                .any(|s| s.starts_with("system.tensor")));
            // Applied, it fits in what it says, and the world trains the same tokens per step.
            let mesh = Setting {
                context_parallel: c,
                ..s.clone()
            };
            let to = cp.change.layout;
            let e = estimate(&mesh, &to);
            assert!(e.fits);
            assert_eq!(e.total_bytes, cp.change.total_bytes);
            assert_eq!(e.step_seconds, cp.change.step_seconds);
            assert_eq!(
                world / c * to.batch * to.grad_accum,
                world * l.batch * l.grad_accum
            );
            // The smallest: a smaller C fits no layout.
            for smaller in (2..c).filter(|d| c.is_multiple_of(*d)) {
                assert!(at_mesh(&s, &l, smaller, 1).is_none(), "C = {smaller}");
            }
        }
        // Not where one sequence fits a rank (8B at 8192 tokens on 8 GPUs), nor on CPU ranks.
        let (s, l) = test_setting(
            &[
                "model.num_layers=32",
                "model.vocab_size=128256",
                "training.context_length=8192",
            ],
            8,
        );
        assert!(cheapest_within(&s, &l, s.budget).is_some());
        assert!(context_parallel(&s, &l).is_none());
        let (s, l) = llama_8b_128k(32);
        let cpu = Setting {
            device: Device::Cpu,
            ..s
        };
        assert!(context_parallel(&cpu, &l).is_none());
    }
}
