//! One rank's step: its FLOPs, the seconds they take, and what the collectives add
//! ([`StepTime`]), at one world size or several ([`Scaling`]).

use serde::Serialize;

use super::setting::{Layout, Setting};
use super::{comm, context, expert, muon, tensor};
use crate::model::ActivationCheckpointing;

/// The FLOPs of one token of training: the model's (forward + backward, as MFU counts them)
/// and those the activation checkpointing adds by recomputing forward work in backward.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Flops {
    pub model: f64,
    pub recomputed: f64,
}

pub fn flops_per_token(s: &Setting, l: &Layout) -> Flops {
    let sh = &s.shape;
    // A pipeline rank without the LM head (`Holds`) does none of its 6·V·d per token.
    let head = match s.holds.head {
        true => 0.0,
        false => 6.0 * (sh.vocab_size * sh.hidden_size) as f64,
    };
    let model = sh.flops_per_token(s.context) - head;
    // Attention's scores and values span the query heads' width (hidden_size unless head_dim
    // is set apart, as Qwen3's is).
    let d = sh.query_width() as f64;
    let layers = sh.num_layers as f64;
    let attn_proj = sh.attention_matrix_params() as f64;
    let mlp = sh.mlp_matrix_params() as f64;
    // A forward is a third of the 6-per-weight count; causal attention's forward likewise.
    let recomputed = match l.activation_checkpointing {
        ActivationCheckpointing::None => 0.0,
        ActivationCheckpointing::Full => {
            layers * (2.0 * (attn_proj + mlp) + 2.0 * s.context as f64 * d)
        }
        ActivationCheckpointing::Selective => layers * 2.0 * mlp,
    };
    Flops { model, recomputed }
}

/// Seconds of computation of one step on one rank at the assumed utilisation: the tokens of
/// its CP × TP group's step, 1/T of every matmul of each, and 1/C of them (its own tokens'
/// matmuls, and 1/C of each sequence's causal attention: the zigzag chunks share it evenly).
pub fn compute_seconds(s: &Setting, l: &Layout) -> f64 {
    let f = flops_per_token(s, l);
    let split = (s.tensor_parallel * s.context_parallel) as f64;
    l.tokens_per_step(s.context) as f64 * (f.model + f.recomputed) / (split * s.peak_flops * s.mfu)
}

/// One rank's step among `world` ranks, by what takes the time.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct StepTime {
    /// The rank's FLOPs at the assumed utilisation (`compute_seconds`).
    pub compute_seconds: f64,
    /// The zero stage's collectives among the data-parallel ranks (`comm.rs`): after backward
    /// as the step runs today; they could hide behind it (`efficiency_overlapped`).
    pub data_parallel_seconds: f64,
    /// The TP group's collectives (`tensor.rs`), on the critical path.
    pub tensor_parallel_seconds: f64,
    /// The CP group's K/V all-gathers and dK/dV reduce-scatters (`context.rs`), on the
    /// critical path.
    pub context_parallel_seconds: f64,
    /// The expert-parallel group's all-to-alls of the tokens (`expert.rs`), on the critical
    /// path.
    pub expert_parallel_seconds: f64,
    /// Muon's Newton–Schulz iterations and their exchanges (`muon.rs`), after the reductions:
    /// on the critical path; 0 with AdamW.
    pub muon_seconds: f64,
    /// With pipeline stages (`pipeline.rs`): the time a rank of average work waits in the
    /// schedule's bubble (and for stages with more work than it), and the point-to-point
    /// sends of activations and their gradients on the critical path. 0 without.
    pub pipeline_bubble_seconds: f64,
    pub pipeline_p2p_seconds: f64,
}

impl StepTime {
    /// The step of layout `l` on one of `world` ranks.
    pub fn of(s: &Setting, l: &Layout, world: usize) -> StepTime {
        debug_assert_eq!(
            s.pipeline_parallel, 1,
            "a pipeline's step is pipeline::run's"
        );
        StepTime {
            compute_seconds: compute_seconds(s, l),
            data_parallel_seconds: comm::seconds_per_step(s, l, world),
            tensor_parallel_seconds: tensor::seconds_per_step(s, l),
            context_parallel_seconds: context::seconds_per_step(s, l),
            expert_parallel_seconds: expert::seconds_per_step(s, l),
            muon_seconds: muon::cost(s, l.zero_stage, world).map_or(0.0, |m| m.seconds),
            pipeline_bubble_seconds: 0.0,
            pipeline_p2p_seconds: 0.0,
        }
    }

    /// Seconds per step: computation plus every collective, none overlapped.
    pub fn total(&self) -> f64 {
        self.compute_seconds + self.data_parallel_seconds + self.exposed_seconds()
    }

    /// The TP, CP and EP groups' collectives, Muon's step and the pipeline's bubble and
    /// sends: on the critical path.
    fn exposed_seconds(&self) -> f64 {
        self.tensor_parallel_seconds
            + self.context_parallel_seconds
            + self.expert_parallel_seconds
            + self.muon_seconds
            + self.pipeline_bubble_seconds
            + self.pipeline_p2p_seconds
    }

    /// Scaling efficiency: the computation's share of the step.
    pub fn efficiency(&self) -> f64 {
        self.compute_seconds / self.total()
    }

    /// The same with the data-parallel collectives hidden behind the computation (the TP and
    /// CP groups' stay on the critical path).
    pub fn efficiency_overlapped(&self) -> f64 {
        self.compute_seconds
            / (self.compute_seconds.max(self.data_parallel_seconds) + self.exposed_seconds())
    }
}

/// Weak scaling (same batch per data-parallel rank, same CP and TP groups) at one world size.
#[derive(Debug, Clone, Serialize)]
pub struct Scaling {
    /// Ranks in all (T × the data-parallel ranks).
    pub ranks: usize,
    /// Data-parallel bytes sent per rank and step, and their seconds.
    pub bytes_per_rank: f64,
    pub comm_seconds: f64,
    /// The TP group's collectives per step (0 at T = 1).
    pub tensor_parallel_seconds: f64,
    /// The CP group's collectives per step (0 at C = 1).
    pub context_parallel_seconds: f64,
    /// The EP group's all-to-alls per step (0 at E = 1).
    pub expert_parallel_seconds: f64,
    /// compute / (compute + communication): the step as it runs today.
    pub efficiency: f64,
    /// compute / (max(compute, data-parallel communication) + TP communication): with the
    /// reductions hidden behind backward.
    pub efficiency_overlapped: f64,
}

pub fn scaling(s: &Setting, l: &Layout, world: usize) -> Scaling {
    let time = StepTime::of(s, l, world);
    Scaling {
        ranks: world,
        bytes_per_rank: comm::bytes_per_step(s, l, l.zero_stage, world),
        comm_seconds: time.data_parallel_seconds,
        tensor_parallel_seconds: time.tensor_parallel_seconds,
        context_parallel_seconds: time.context_parallel_seconds,
        expert_parallel_seconds: time.expert_parallel_seconds,
        efficiency: time.efficiency(),
        efficiency_overlapped: time.efficiency_overlapped(),
    }
}
