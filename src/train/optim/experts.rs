//! Expert parallelism's side of the optimizer: a rank's experts (`system.expert_parallel` =
//! E) are a second `Optimizer` (`Experts` in mod.rs) beside the one of every other parameter, over the ranks that
//! hold the same experts (one per expert-parallel group: the "holders"), so that its ZeRO
//! stage shards their state over those ranks and its reducer averages their gradients there.
//! With hybrid sharding (E dividing the shard degree S) it is sharded among the S/E holders of
//! this rank's shard group and replicated across the groups, as the other parameters are.
//!
//! What the two share:
//! - the gradient: an expert's gradient on a rank sums over the tokens of its whole
//!   expert-parallel group (model/expert_parallel.rs), so after the mean over the holders it
//!   is divided by E: as every other gradient, the mean over all replicas' losses;
//! - the global norm: the other parameters' squares (equal on every rank) plus each expert
//!   group member's experts' squares, gathered over the group and summed in rank order, so
//!   every element counts once and every rank agrees bitwise;
//! - checkpoints: the writers of every expert on every position of the group (each
//!   position's layout is this one's with its experts renumbered), over the replicas'
//!   numbering, so the files are the same Hugging Face tensors as without expert parallelism.

use std::collections::HashSet;

use anyhow::Result;
use tch::{Kind, Tensor};

use super::state::{RankState, StateBytes, Writers};
use crate::dist::{on_group, ProcessGroup, SharedGroup, SingleProcess};

/// Where this rank's experts sit in the expert-parallel group, and the group's ranks.
pub struct ExpertPlace {
    /// The expert-parallel group (its ranks hold different experts) and the holders (None:
    /// this rank alone holds its experts).
    group: SharedGroup,
    holders: Option<SharedGroup>,
    /// E, and this rank's position in the group.
    pub(super) size: usize,
    rank: usize,
    /// Experts per MoE layer each position holds.
    per: usize,
    names: HashSet<String>,
}

impl ExpertPlace {
    /// This rank's experts `params` (`per` of them per MoE layer at position `rank` of an
    /// expert-parallel group of `size`).
    pub fn new(
        params: &[(String, Tensor)],
        (group, holders): (SharedGroup, Option<SharedGroup>),
        (rank, size, per): (usize, usize, usize),
    ) -> ExpertPlace {
        ExpertPlace {
            group,
            holders,
            size,
            rank,
            per,
            names: params.iter().map(|(n, _)| n.clone()).collect(),
        }
    }

    /// The ranks the experts' optimizer works across: the holders, or this rank alone.
    pub fn over(&self) -> SharedGroup {
        self.holders.clone().unwrap_or_else(|| {
            std::sync::Arc::new(std::sync::Mutex::new(
                Box::new(SingleProcess) as Box<dyn ProcessGroup>
            ))
        })
    }

    pub(super) fn holds(&self, name: &str) -> bool {
        self.names.contains(name)
    }

    /// The groups whose traffic the optimizer counts.
    pub(super) fn groups(&self) -> Vec<&SharedGroup> {
        std::iter::once(&self.group).chain(&self.holders).collect()
    }

    /// After the mean over the holders: `grads` (what the experts' update reads) divided by E
    /// (the module docs).
    pub(super) fn divide(&self, grads: Vec<Tensor>) {
        let e = self.size as f64;
        tch::no_grad(|| {
            for g in grads {
                let _ = g.shallow_clone().g_div_scalar_(e);
            }
        });
    }

    /// Every position's `mine` (its experts' squares) summed in rank order.
    pub(super) fn sum_over_group(&self, mine: f64) -> Result<f64> {
        let mut unused = SingleProcess;
        let all = on_group(Some(&self.group), &mut unused, |g| g.all_gather_f64(mine))?;
        Ok(all.into_iter().sum())
    }

    /// The writers of the other parameters (`dense`) with every position's experts beside
    /// them, from this rank's experts' writers `own`: expert j of position p is this rank's
    /// expert j − (rank − p)·per, and holder h of position p is replica h·E + p.
    pub(super) fn writers(&self, dense: Writers, own: Writers) -> Writers {
        let mut params = dense.params;
        for p in 0..self.size {
            for (name, writer, numel) in &own.params {
                params.push((self.renumbered(name, p), writer * self.size + p, *numel));
            }
        }
        Writers { params, ..dense }
    }

    /// The other positions' counterparts of `values`: this rank's experts `params` (name and
    /// a tensor of the expert's whole shape) with one whole value each (their full values or
    /// gradients, undefined where there is none), for each position p ≠ this one in order the
    /// same list as p holds it, renamed to p's numbering, in fp32: which values are defined,
    /// then each defined one, broadcast from p over the group. A collective of the
    /// expert-parallel group, for the NaN/Inf report, which must name an expert whatever rank
    /// holds it.
    pub(super) fn other_positions(
        &self,
        params: &[(String, Tensor)],
        values: &[Tensor],
    ) -> Result<Vec<(String, Tensor)>> {
        let mut unused = SingleProcess;
        let mut out = Vec::new();
        for p in 0..self.size {
            let here = p == self.rank;
            let mut defined: Vec<f32> = values
                .iter()
                .map(|t| f32::from(u8::from(t.defined())))
                .collect();
            on_group(Some(&self.group), &mut unused, |g| {
                g.broadcast_f32(&mut defined, p)
            })?;
            // A position's experts have this rank's shapes: a layer's experts are alike.
            for (((name, param), value), flag) in params.iter().zip(values).zip(defined) {
                let buf = match (flag == 0.0, here) {
                    (true, _) => Tensor::new(),
                    (false, true) => value.detach().to_kind(Kind::Float).contiguous(),
                    (false, false) => param.zeros_like().to_kind(Kind::Float),
                };
                if buf.defined() {
                    on_group(Some(&self.group), &mut unused, |g| {
                        g.broadcast_tensor(&buf, p)
                    })?;
                }
                if !here {
                    out.push((self.renumbered(name, p), buf));
                }
            }
        }
        Ok(out)
    }

    /// `name` (one of this rank's experts) as the same matrix of the same expert of position
    /// `p`'s.
    fn renumbered(&self, name: &str, p: usize) -> String {
        let (head, tail) = name
            .split_once(".experts.")
            .expect("an expert's name has .experts.");
        let (j, rest) = tail.split_once('.').expect("experts.<j>.<matrix>");
        let j: usize = j.parse().expect("an expert's number");
        let there = j + p * self.per - self.rank * self.per;
        format!("{head}.experts.{there}.{rest}")
    }
}

/// What this rank writes: the other parameters' state and its experts'.
pub(super) fn joined(dense: RankState, experts: RankState) -> RankState {
    let mut out = dense;
    out.weights.extend(experts.weights);
    out.moments.extend(experts.moments);
    out
}

/// Both optimizers' bytes.
pub(super) fn added(a: StateBytes, b: StateBytes) -> StateBytes {
    StateBytes {
        params: a.params + b.params,
        master: a.master + b.master,
        moments: a.moments + b.moments,
        grads: a.grads + b.grads,
    }
}

/// `values` of the dense optimizer's and the experts' parameters put back in `params`' order
/// (`is_expert` says which list each comes from).
pub(super) fn merged(
    params: &[(String, Tensor)],
    is_expert: impl Fn(&str) -> bool,
    dense: Vec<Tensor>,
    experts: Vec<Tensor>,
) -> Vec<Tensor> {
    let (mut dense, mut experts) = (dense.into_iter(), experts.into_iter());
    params
        .iter()
        .map(|(n, _)| {
            let next = if is_expert(n) {
                experts.next()
            } else {
                dense.next()
            };
            next.unwrap_or_else(|| Tensor::empty([0], (Kind::Float, tch::Device::Cpu)))
        })
        .collect()
}
