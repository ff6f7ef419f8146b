//! Expert parallelism's side of the optimizer: a rank's experts (`system.expert_parallel` =
//! E) are a second [`Optimizer`] beside the one of every other parameter, over the ranks that
//! hold the same experts (one per expert-parallel group: the "holders"), so that its ZeRO
//! stage shards their state over those ranks and its reducer averages their gradients there.
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

use super::{Optimizer, RankState, StateBytes, Writers};
use crate::dist::{on_group, ProcessGroup, SharedGroup, SingleProcess};

/// The optimizer of this rank's experts, and where they sit in the expert-parallel group.
pub struct Experts {
    pub(super) opt: Optimizer,
    /// The expert-parallel group (its ranks hold different experts) and the holders (None:
    /// this rank alone holds its experts).
    group: SharedGroup,
    holders: Option<SharedGroup>,
    /// E, and this rank's position in the group.
    size: usize,
    rank: usize,
    /// Experts per MoE layer each position holds.
    per: usize,
    names: HashSet<String>,
}

impl Experts {
    /// The optimizer of `params` (this rank's experts, `per` of them per MoE layer at
    /// position `rank` of an expert-parallel group of `size`), built by `build` over the
    /// holders (a group of one where `holders` is None).
    pub fn new(
        params: &[(String, Tensor)],
        (group, holders): (SharedGroup, Option<SharedGroup>),
        (rank, size, per): (usize, usize, usize),
        build: impl FnOnce(SharedGroup) -> Result<Optimizer>,
    ) -> Result<Experts> {
        let over = holders.clone().unwrap_or_else(|| {
            std::sync::Arc::new(std::sync::Mutex::new(
                Box::new(SingleProcess) as Box<dyn ProcessGroup>
            ))
        });
        Ok(Experts {
            opt: build(over)?,
            group,
            holders,
            size,
            rank,
            per,
            names: params.iter().map(|(n, _)| n.clone()).collect(),
        })
    }

    pub(super) fn holds(&self, name: &str) -> bool {
        self.names.contains(name)
    }

    /// The groups whose traffic the optimizer counts.
    pub(super) fn groups(&self) -> Vec<&SharedGroup> {
        std::iter::once(&self.group).chain(&self.holders).collect()
    }

    /// After the mean over the holders: divided by E (the module docs).
    pub(super) fn finish_reduction(&self) -> Result<()> {
        self.opt.finish_reduction()?;
        let e = self.size as f64;
        tch::no_grad(|| {
            for g in self.opt.update_gradients() {
                let _ = g.shallow_clone().g_div_scalar_(e);
            }
        });
        Ok(())
    }

    /// The squares of every expert's gradient in the group, summed in rank order.
    pub(super) fn sum_of_squares(&self, pg: &mut dyn ProcessGroup) -> Result<f64> {
        let mine = self.opt.grad_sum_of_squares(pg)?;
        let mut unused = SingleProcess;
        let all = on_group(Some(&self.group), &mut unused, |g| g.all_gather_f64(mine))?;
        Ok(all.into_iter().sum())
    }

    /// This rank's writers with every position's experts beside its own: expert j of
    /// position p is this rank's expert j − (rank − p)·per, and holder h of position p is
    /// replica h·E + p.
    pub(super) fn writers(&self, dense: Writers) -> Writers {
        let own = self.opt.writers();
        let mut params = dense.params;
        for p in 0..self.size {
            for (name, writer, numel) in &own.params {
                params.push((self.renumbered(name, p), writer * self.size + p, *numel));
            }
        }
        Writers { params, ..dense }
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

    /// What this rank writes of its experts.
    pub(super) fn state(&self, pg: &mut dyn ProcessGroup, dense: RankState) -> Result<RankState> {
        let mine = self.opt.state(pg)?;
        let mut out = dense;
        out.weights.extend(mine.weights);
        out.moments.extend(mine.moments);
        Ok(out)
    }

    pub(super) fn state_bytes(&self, dense: StateBytes) -> StateBytes {
        let e = self.opt.state_bytes();
        StateBytes {
            params: dense.params + e.params,
            master: dense.master + e.master,
            moments: dense.moments + e.moments,
            grads: dense.grads + e.grads,
        }
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
