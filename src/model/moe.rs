//! The MLP half of a decoder layer: a dense SwiGLU, or a mixture of experts (Qwen3-MoE,
//! Mixtral) — a router picks k of E SwiGLU experts for every token, each token's output is
//! the routing-weighted sum of its experts' outputs, and every token reaches its k experts
//! (dropless: no capacity, no token dropped).
//!
//! ## The grouped computation (one matmul per expert, no per-token loop)
//! For n tokens [n, hidden] and k choices each:
//! - router: logits [n, E] = h · Wr^T (compute dtype); probs [n, E] = softmax (fp32); the
//!   top k of probs [n, k] (renormalised to sum 1 with `norm_topk_prob`) and their experts
//!   [n, k] int64 — transformers' `Qwen3MoeTopKRouter` / `MixtralTopKRouter`.
//! - the n·k (token, expert) slots sorted by expert (a stable sort, so each expert's tokens
//!   keep their order); the tokens gathered in that order [n·k, hidden]; expert e's are
//!   rows `start_e .. start_e + count_e`, one contiguous block, multiplied by its matrices at
//!   once ([count_e, hidden] → [count_e, width] → [count_e, hidden]); an expert without tokens
//!   costs nothing.
//! - the outputs [n·k, hidden] scaled by their weights and summed back into their tokens
//!   (`index_add`, fp32) [n, hidden], then cast to the compute dtype.
//!
//! transformers' eager loop instead finds each expert's tokens with a mask over all n·k
//! slots (E scans) and adds each expert's output on its own; the result is the same
//! (BENCHMARKS.md compares the two on one shape).
//!
//! ## Under tensor parallelism
//! Every expert is split by its width like the dense MLP (gate and up by rows, down by
//! columns), so the MoE half is the dense half's f/g pair unchanged: each rank routes the
//! same (gathered) tokens with the whole router, computes its part of every expert and its
//! partial output, which the group sums. The router's gradient on a rank is its part of the
//! experts' (`Split::Shared`: summed over the group). The load-balancing and z-loss terms
//! are the same on every rank, so each rank back-propagates 1/T of them (backward.rs,
//! `router_loss`). Replicating the experts over the group instead would spare two
//! collectives per MoE layer but all-reduce every expert's gradient over the group and hold
//! T× their memory (BENCHMARKS.md §20 has the figures for Qwen3-30B-A3B). With expert
//! parallelism as well each rank holds its width part of its position's experts only, and the
//! all-to-all runs among the ranks of its tensor index (expert_parallel.rs): still the same
//! f/g pair around the half.
//!
//! ## The auxiliary losses (what the training objective adds to the cross-entropy)
//! - load balancing (Switch Transformer's, transformers' `load_balancing_loss_func`): over
//!   all MoE layers of a micro-batch together, N = layers × tokens rows,
//!   `aux = E · Σ_e (count_e / N) · (Σ probs_e / N)`, count_e the slots routed to expert e.
//!   The counts carry no gradient, so the gradient w.r.t. each probability of expert e is
//!   `E · count_e / N²` — a constant per expert, known once the forward has routed every
//!   layer. Each layer's backward adds it ([`RouterLoss::term`]).
//! - router z-loss (ST-MoE): the mean of logsumexp(logits)² over a layer's tokens, summed
//!   over the MoE layers.
//!
//! Both are weighted (`model.router_aux_loss_coef`, `model.router_z_loss_coef`) and logged
//! with the per-expert token counts ([`RouterLog`]).

use std::sync::Mutex;

use anyhow::Result;
use tch::{Kind, Tensor};

use super::expert_parallel::ExpertParallel;
use super::shape::MoeShape;
pub(super) use super::swiglu::{Linear, SwiGlu};

/// A decoder layer's MLP.
pub(super) enum Mlp {
    Dense(SwiGlu),
    /// The router [experts, hidden] (whole on every rank) and the experts.
    Experts {
        router: Tensor,
        experts: Vec<SwiGlu>,
    },
}

impl Mlp {
    /// Whether this is a mixture of experts.
    pub(super) fn is_moe(&self) -> bool {
        matches!(self, Mlp::Experts { .. })
    }
}

/// How a MoE layer routed its n tokens.
pub(super) struct Routing {
    /// [n, E] the router's logits (compute dtype), with the graph when computed with one.
    pub(super) logits: Tensor,
    /// [n, E] fp32 softmax of the logits, with the graph when computed with one.
    pub(super) probs: Tensor,
    /// [n, k] int64: each token's experts, in descending order of probability.
    pub(super) choices: Tensor,
    /// Slots (token, choice) each expert got: [E], summing to n·k.
    pub(super) counts: Vec<i64>,
}

impl Routing {
    /// Tokens routed.
    pub(super) fn tokens(&self) -> i64 {
        self.probs.size()[0]
    }

    /// What the auxiliary losses and the log need of it, without the graph.
    pub(super) fn summary(&self) -> RouteSummary {
        tch::no_grad(|| RouteSummary {
            counts: self.counts.clone(),
            probs: self.probs.sum_dim_intlist(0, false, Kind::Double),
            lse_squared: lse_squared(&self.logits).sum(Kind::Double),
            tokens: self.tokens(),
        })
    }
}

/// A MoE layer's routing in sums (no graph): the slots per expert [E], the probabilities'
/// sum per expert [E] (fp64), the sum of logsumexp(logits)² over its tokens (fp64), and the
/// tokens.
pub(super) struct RouteSummary {
    counts: Vec<i64>,
    probs: Tensor,
    lse_squared: Tensor,
    tokens: i64,
}

impl Mlp {
    /// The MLP of the normed tokens `h` ([.., hidden]) with the model's matmuls, whose dtype
    /// is `compute`: its (partial) output in `h`'s shape, and for a mixture of experts (of
    /// shape `moe`) how it routed them. With expert parallelism (`ep`) the layer holds this
    /// rank's experts only, and the tokens travel to theirs (expert_parallel.rs).
    pub(super) fn forward(
        &self,
        h: &Tensor,
        moe: Option<&MoeShape>,
        ep: Option<&ExpertParallel>,
        linear: Linear,
        compute: Kind,
    ) -> Result<(Tensor, Option<Routing>)> {
        match self {
            Mlp::Dense(m) => Ok((m.forward(h, linear), None)),
            Mlp::Experts { router, experts } => {
                let moe = moe.expect("a MoE layer has a MoeShape");
                let d = *h.size().last().expect("tokens of hidden features");
                let flat = h.reshape([-1, d]);
                let (routing, weights) = route(&flat, router, moe, linear);
                let (order, token) = slots(&routing);
                let out = match ep {
                    None => grouped(&flat, &token, &routing.counts, experts, linear),
                    Some(ep) => {
                        ep.experts(&flat, &token, &routing.counts, experts, linear, compute)?
                    }
                };
                let y = combine(&flat, &out, &weights, &order, &token).to_kind(compute);
                Ok((y.view(h.size().as_slice()), Some(routing)))
            }
        }
    }
}

/// The router on tokens `h` [n, hidden]: its routing and each token's k weights [n, k]
/// (fp32).
fn route(h: &Tensor, router: &Tensor, moe: &MoeShape, linear: Linear) -> (Routing, Tensor) {
    let logits = linear(h, router);
    let probs = logits.softmax(-1, Kind::Float);
    let (top, choices) = probs.topk(moe.top_k as i64, -1, true, true);
    let weights = if moe.norm_topk_prob {
        &top / top.sum_dim_intlist(-1, true, Kind::Float)
    } else {
        top
    };
    let counts = tch::no_grad(|| {
        choices
            .view([-1])
            .bincount::<Tensor>(None, moe.num_experts as i64)
            .to_device(tch::Device::Cpu)
    });
    let counts = Vec::<i64>::try_from(&counts).expect("int64 counts");
    let routing = Routing {
        logits,
        probs,
        choices,
        counts,
    };
    (routing, weights)
}

/// The n·k (token, choice) slots of `routing` sorted by expert (a stable sort: each expert's
/// tokens keep their order): the slot indices [n·k] (slot s is token s / k's choice s % k)
/// and their tokens [n·k].
fn slots(routing: &Routing) -> (Tensor, Tensor) {
    let k = routing.choices.size()[1];
    let order = routing.choices.view([-1]).argsort_stable(true, 0, false);
    let token = order.floor_divide_scalar(k);
    (order, token)
}

/// One rank's experts on the slots sorted by expert: tokens `h` [n, hidden] gathered in
/// that order ([n·k, hidden]; `token` [n·k]), expert e's `counts[e]` rows one contiguous
/// block multiplied by its matrices at once (the module docs' grouped computation); the
/// outputs [n·k, hidden] in the same order (compute dtype).
fn grouped(
    h: &Tensor,
    token: &Tensor,
    counts: &[i64],
    experts: &[SwiGlu],
    linear: Linear,
) -> Tensor {
    let gathered = h.index_select(0, token);
    let mut outputs = Vec::with_capacity(experts.len());
    let mut start = 0;
    // An expert without tokens runs on an empty block: it costs nothing, and its gradient
    // is then a defined zero, so every rank's gradients have the same layout for the
    // data-parallel reduction.
    for (expert, &count) in experts.iter().zip(counts) {
        outputs.push(expert.forward(&gathered.narrow(0, start, count), linear));
        start += count;
    }
    Tensor::cat(&outputs, 0)
}

/// The experts' outputs `out` [n·k, hidden] (slots sorted by expert: `order` their slot
/// indices, `token` their tokens) scaled by their routing `weights` [n, k] and summed into
/// their tokens: Σ_k weight · expert(h), [n, hidden] fp32.
fn combine(h: &Tensor, out: &Tensor, weights: &Tensor, order: &Tensor, token: &Tensor) -> Tensor {
    let (n, d) = (h.size()[0], h.size()[1]);
    let w = weights.view([-1]).index_select(0, order).unsqueeze(1);
    Tensor::zeros([n, d], (Kind::Float, h.device())).index_add(
        0,
        token,
        &(out.to_kind(Kind::Float) * w),
    )
}

/// The auxiliary losses of one micro-batch's routing, from every MoE layer's counts and
/// probabilities (all of this rank's tokens; with context parallelism the group's).
pub(super) struct RouterLoss {
    /// The load-balancing gradient w.r.t. each probability of expert e, [E] fp32:
    /// `coef · E · count_e / N²` (times the pass's scale).
    aux_grad: Tensor,
    /// What a layer's z-loss term is weighted by: `coef / tokens per layer` (times the
    /// pass's scale).
    z_weight: f64,
    /// The unweighted losses, for the log.
    pub(super) aux: f64,
    pub(super) z: f64,
}

impl RouterLoss {
    /// The losses of `layers`' routings (this rank's). `global` sums what a context-parallel
    /// group holds apart (the identity otherwise); `scale` is what this rank's gradients of
    /// them are multiplied by (the loss scale, the CP share, 1/T on a TP rank).
    pub(super) fn new(
        layers: &[(usize, RouteSummary)],
        moe: &MoeShape,
        z_coef: f64,
        scale: f64,
        global: impl Fn(&Tensor) -> Result<Tensor>,
    ) -> Result<RouterLoss> {
        let e = moe.num_experts as i64;
        let device = layers[0].1.probs.device();
        // [E + 2] fp64: the counts, then the tokens and the z sum, reduced in one call.
        let (counts, probs) = tch::no_grad(|| {
            let mut counts = vec![0f64; e as usize + 2];
            let mut probs = Tensor::zeros([e], (Kind::Double, device));
            let mut z = 0.0;
            for (_, r) in layers {
                counts
                    .iter_mut()
                    .zip(&r.counts)
                    .for_each(|(a, b)| *a += *b as f64);
                counts[e as usize] += r.tokens as f64;
                z += r.lse_squared.double_value(&[]);
                probs += &r.probs;
            }
            counts[e as usize + 1] = z;
            (Tensor::from_slice(&counts).to_device(device), probs)
        });
        let (all, probs) = (global(&counts)?, global(&probs)?);
        let (n, z) = (all.double_value(&[e]), all.double_value(&[e + 1]));
        let counts = all.narrow(0, 0, e);
        let aux = e as f64 * (&counts * &probs).sum(Kind::Double).double_value(&[]) / (n * n);
        let aux_grad =
            (counts * (moe.aux_loss_coef * e as f64 * scale / (n * n))).to_kind(Kind::Float);
        let per_layer = n / layers.len() as f64;
        Ok(RouterLoss {
            aux_grad,
            z_weight: z_coef * scale / per_layer,
            aux,
            z: if z_coef > 0.0 { z / per_layer } else { 0.0 },
        })
    }

    /// A layer's part of the weighted losses as a scalar whose gradient through `routing`'s
    /// graph is theirs: back-propagate it with a gradient of 1 beside the layer's output.
    pub(super) fn term(&self, routing: &Routing) -> Tensor {
        let aux = (&routing.probs * &self.aux_grad).sum(Kind::Float);
        if self.z_weight == 0.0 {
            return aux;
        }
        aux + lse_squared(&routing.logits).sum(Kind::Float) * self.z_weight
    }
}

/// logsumexp(logits)² per token [n] (fp32).
fn lse_squared(logits: &Tensor) -> Tensor {
    logits
        .to_kind(Kind::Float)
        .logsumexp(&[-1i64][..], false)
        .square()
}

/// The router's figures over the micro-batches since the last read, for the log: the mean
/// auxiliary losses and each MoE layer's per-expert token counts.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RouterLog {
    /// Micro-batches summed.
    pub micro_batches: usize,
    /// Sums of each micro-batch's unweighted load-balancing loss and z-loss.
    pub aux_sum: f64,
    pub z_sum: f64,
    /// Per MoE layer (decoder layer index), the slots each expert got: [E] each.
    pub counts: Vec<(usize, Vec<i64>)>,
}

impl RouterLog {
    /// The mean load-balancing loss per micro-batch.
    pub fn aux(&self) -> f64 {
        self.aux_sum / self.micro_batches.max(1) as f64
    }

    /// The mean z-loss per micro-batch.
    pub fn z(&self) -> f64 {
        self.z_sum / self.micro_batches.max(1) as f64
    }

    /// Per MoE layer, the busiest expert's share of the slots over the mean's (1 = even
    /// load, E = every token to one expert), and which expert that is.
    pub fn imbalance(&self) -> Vec<(usize, f64, usize)> {
        busiest(&self.counts)
    }

    /// Per MoE layer, the slots each position of an expert-parallel group of `ep` ranks got:
    /// position p holds experts [p·N/ep, (p+1)·N/ep) of the layer's N, so its load is their
    /// counts' sum: [ep] each (`ep` divides N, as `system.expert_parallel` must).
    pub fn rank_load(&self, ep: usize) -> Vec<(usize, Vec<i64>)> {
        self.counts
            .iter()
            .map(|(layer, c)| {
                let per = (c.len() / ep.max(1)).max(1);
                (*layer, c.chunks(per).map(|e| e.iter().sum()).collect())
            })
            .collect()
    }

    /// [`RouterLog::imbalance`] of the expert-parallel positions' loads ([`RouterLog::rank_load`]):
    /// the busiest rank's slots over the mean (1 = even, `ep` = every token to one rank's
    /// experts), and its position. That rank's expert computation sets the pace of its group.
    pub fn rank_imbalance(&self, ep: usize) -> Vec<(usize, f64, usize)> {
        busiest(&self.rank_load(ep))
    }

    /// Adds one micro-batch's figures.
    pub(super) fn add(&mut self, loss: &RouterLoss, layers: &[(usize, RouteSummary)]) {
        self.micro_batches += 1;
        self.aux_sum += loss.aux;
        self.z_sum += loss.z;
        for (layer, r) in layers {
            match self.counts.iter_mut().find(|(l, _)| l == layer) {
                Some((_, c)) => c.iter_mut().zip(&r.counts).for_each(|(a, b)| *a += b),
                None => self.counts.push((*layer, r.counts.clone())),
            }
        }
    }
}

/// Per layer of `loads` ([n] each), the largest load over the mean (0 where nothing was
/// routed) and its index (the last of equal ones).
fn busiest(loads: &[(usize, Vec<i64>)]) -> Vec<(usize, f64, usize)> {
    loads
        .iter()
        .map(|(layer, c)| {
            let total: i64 = c.iter().sum();
            let (at, max) = c
                .iter()
                .enumerate()
                .max_by_key(|(_, v)| **v)
                .map_or((0, 0), |(i, v)| (i, *v));
            let mean = total as f64 / c.len().max(1) as f64;
            (*layer, if mean > 0.0 { max as f64 / mean } else { 0.0 }, at)
        })
        .collect()
}

/// A model's router log, filled by its training passes and drained by the trainer.
#[derive(Default)]
pub(super) struct RouterLogCell(Mutex<RouterLog>);

impl RouterLogCell {
    pub(super) fn with<T>(&self, f: impl FnOnce(&mut RouterLog) -> T) -> T {
        f(&mut self.0.lock().unwrap_or_else(|e| e.into_inner()))
    }
}
