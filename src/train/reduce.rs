//! Where a gradient is averaged across ranks: as soon as backward has finished it.
//!
//! The model's backward reports each unit (the LM head, the final norm, decoder layers from the
//! last down, the embedding) the moment its gradients are final ([`GradUnit`]); on the step's
//! last micro-batch every report submits the reductions that just became possible to a
//! [`CommQueue`], which runs them on a communication thread while the lower layers' backward
//! goes on (`system.overlap_comm`), or after backward, in the same order (bitwise the same).
//!
//! - Replicated gradients (zero stages 0 and 1) are all-reduced in flat buckets of
//!   `system.bucket_mb`, packed in backward order: a bucket goes once the unit of its last
//!   parameter is final.
//! - Sharded gradients (stage 2) are reduce-scattered a unit at a time: the unit's gradients are
//!   copied into one buffer laid out rank by rank (each rank's pieces of the unit's parameters,
//!   as the flat layout assigns them), the full gradients are dropped at once, and each rank
//!   receives its part averaged into its gradient slice. No full gradient outlives its unit.

use std::ops::Range;

use tch::{Kind, Tensor};

use super::optim::drop_grads;
use crate::dist::overlap::CommQueue;
use crate::dist::zero::{intersect, FlatLayout};
use crate::model::GradUnit;

/// The units of a model in the order backward finishes them, each with its parameters (indices
/// into the caller's list).
fn units_in_backward_order(names: &[&str]) -> Vec<(GradUnit, Vec<usize>)> {
    let rank_of = |u: GradUnit| match u {
        GradUnit::LmHead => (0, 0),
        GradUnit::FinalNorm => (1, 0),
        GradUnit::Layer(i) => (2, usize::MAX - i),
        GradUnit::Embedding => (3, 0),
    };
    let mut units: Vec<(GradUnit, Vec<usize>)> = Vec::new();
    for (i, name) in names.iter().enumerate() {
        // A parameter no unit claims is final only at the very end.
        let unit = GradUnit::of_parameter(name).unwrap_or(GradUnit::Embedding);
        match units.iter_mut().find(|(u, _)| *u == unit) {
            Some((_, list)) => list.push(i),
            None => units.push((unit, vec![i])),
        }
    }
    units.sort_by_key(|(u, _)| rank_of(*u));
    units
}

/// How a run averages its gradients.
pub struct GradReducer {
    /// Units in backward order, with their parameters (indices into `params`).
    units: Vec<(GradUnit, Vec<usize>)>,
    /// The parameters (shallow clones), in the caller's order.
    params: Vec<Tensor>,
    plan: Plan,
}

enum Plan {
    /// World of one: nothing to average.
    Nothing,
    /// All-reduce in buckets: (parameter indices in backward order, index of the unit after
    /// which the bucket is complete).
    AllReduce(Vec<(Vec<usize>, usize)>),
    /// Reduce-scatter a unit at a time into `slice` (this rank's fp32 gradient slice).
    ReduceScatter {
        layout: FlatLayout,
        /// Caller's index → position in the layout.
        flat_of: Vec<usize>,
        rank: usize,
        slice: Tensor,
    },
}

impl GradReducer {
    /// All-reduce of replicated gradients over `world` ranks in buckets of `bucket_mb`.
    pub fn all_reduce(named: &[(String, Tensor)], world: usize, bucket_mb: f64) -> GradReducer {
        let (units, params) = split(named);
        if world == 1 {
            return GradReducer {
                units,
                params,
                plan: Plan::Nothing,
            };
        }
        let cap = ((bucket_mb * 1024.0 * 1024.0) as usize).max(1);
        let mut buckets: Vec<(Vec<usize>, usize)> = Vec::new();
        let mut bytes = 0;
        for (u, (_, members)) in units.iter().enumerate() {
            for &i in members {
                let size = params[i].numel() * params[i].kind().elt_size_in_bytes();
                match buckets.last_mut() {
                    Some((b, ready)) if bytes + size <= cap => {
                        b.push(i);
                        *ready = u;
                        bytes += size;
                    }
                    _ => {
                        buckets.push((vec![i], u));
                        bytes = size;
                    }
                }
            }
        }
        GradReducer {
            units,
            params,
            plan: Plan::AllReduce(buckets),
        }
    }

    /// Reduce-scatter of sharded gradients into `slice`, this rank's part of `layout`.
    pub fn reduce_scatter(
        named: &[(String, Tensor)],
        layout: FlatLayout,
        rank: usize,
        slice: Tensor,
    ) -> GradReducer {
        let (units, params) = split(named);
        let mut flat_of = vec![0; named.len()];
        for (at, p) in layout.params.iter().enumerate() {
            flat_of[p.index] = at;
        }
        GradReducer {
            units,
            params,
            plan: Plan::ReduceScatter {
                layout,
                flat_of,
                rank,
                slice,
            },
        }
    }

    /// Backward has finished `unit` on the step's last micro-batch: submit what became ready.
    pub fn unit_final(&self, unit: GradUnit, queue: &mut CommQueue) {
        let Some(u) = self.units.iter().position(|(x, _)| *x == unit) else {
            return;
        };
        match &self.plan {
            Plan::Nothing => {}
            Plan::AllReduce(buckets) => {
                for (members, _) in buckets.iter().filter(|(_, ready)| *ready == u) {
                    self.submit_all_reduce(members, queue);
                }
            }
            Plan::ReduceScatter { .. } => self.submit_unit_scatter(&self.units[u].1, queue),
        }
    }

    /// One bucket: its gradients packed flat, averaged, and copied back.
    fn submit_all_reduce(&self, members: &[usize], queue: &mut CommQueue) {
        let grads: Vec<Tensor> = members
            .iter()
            .map(|&i| self.params[i].grad())
            .filter(Tensor::defined)
            .collect();
        if grads.is_empty() {
            return;
        }
        let views: Vec<Tensor> = grads.iter().map(|g| g.detach().reshape(-1)).collect();
        let flat = Tensor::cat(&views, 0);
        queue.submit(Box::new(move |pg| {
            pg.all_reduce_avg_tensor(&flat)?;
            let mut at = 0;
            tch::no_grad(|| {
                for g in &grads {
                    let n = g.numel() as i64;
                    g.shallow_clone()
                        .copy_(&flat.narrow(0, at, n).view(g.size().as_slice()));
                    at += n;
                }
            });
            Ok(())
        }));
    }

    /// One unit's gradients in a buffer laid out rank by rank, reduce-scattered into every
    /// rank's slice; the full gradients are dropped as soon as they are copied.
    fn submit_unit_scatter(&self, members: &[usize], queue: &mut CommQueue) {
        let Plan::ReduceScatter {
            layout,
            flat_of,
            rank,
            slice,
        } = &self.plan
        else {
            return;
        };
        let device = slice.device();
        // (buffer range, flat range) of every piece, rank by rank.
        let mut pieces: Vec<(usize, Range<usize>, Range<usize>)> = Vec::new();
        let mut splits = vec![0; layout.world];
        let mut at = 0;
        for (r, split) in splits.iter_mut().enumerate() {
            for &i in members {
                let p = &layout.params[flat_of[i]];
                let own = intersect(&p.range(), &layout.owned(r));
                if own.is_empty() {
                    continue;
                }
                pieces.push((i, at..at + own.len(), own.clone()));
                at += own.len();
                *split += own.len();
            }
        }
        let buffer = Tensor::zeros([at as i64], (Kind::Float, device));
        tch::no_grad(|| {
            for (i, buf, flat) in &pieces {
                let g = self.params[*i].grad();
                if !g.defined() {
                    continue;
                }
                let start = flat.start - layout.params[flat_of[*i]].start;
                let src = g.view(-1).narrow(0, start as i64, flat.len() as i64);
                buffer
                    .narrow(0, buf.start as i64, buf.len() as i64)
                    .copy_(&src);
            }
        });
        drop_grads(members.iter().map(|&i| &self.params[i]));
        let owned = layout.owned(*rank);
        let mine: Vec<(Range<usize>, usize)> = pieces
            .into_iter()
            .filter(|(_, _, flat)| owned.contains(&flat.start))
            .map(|(_, buf, flat)| (buf, flat.start - owned.start))
            .collect();
        let slice = slice.shallow_clone();
        queue.submit(Box::new(move |pg| {
            pg.reduce_scatter_avg_tensor(&buffer, &splits)?;
            tch::no_grad(|| {
                for (buf, at) in &mine {
                    slice
                        .narrow(0, *at as i64, buf.len() as i64)
                        .copy_(&buffer.narrow(0, buf.start as i64, buf.len() as i64));
                }
            });
            Ok(())
        }));
    }
}

fn split(named: &[(String, Tensor)]) -> (Vec<(GradUnit, Vec<usize>)>, Vec<Tensor>) {
    let names: Vec<&str> = named.iter().map(|(n, _)| n.as_str()).collect();
    let params = named.iter().map(|(_, p)| p.shallow_clone()).collect();
    (units_in_backward_order(&names), params)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units_come_in_the_order_backward_finishes_them() {
        let names = [
            "model.embed_tokens.weight",
            "model.layers.0.mlp.up_proj.weight",
            "model.layers.1.mlp.up_proj.weight",
            "model.layers.0.input_layernorm.weight",
            "model.norm.weight",
            "lm_head.weight",
        ];
        let units = units_in_backward_order(&names);
        let order: Vec<(GradUnit, Vec<usize>)> = vec![
            (GradUnit::LmHead, vec![5]),
            (GradUnit::FinalNorm, vec![4]),
            (GradUnit::Layer(1), vec![2]),
            (GradUnit::Layer(0), vec![1, 3]),
            (GradUnit::Embedding, vec![0]),
        ];
        assert_eq!(units, order);
    }

    #[test]
    fn buckets_close_at_the_cap_and_go_with_their_last_unit() {
        let opts = (Kind::Float, tch::Device::Cpu);
        let named: Vec<(String, Tensor)> = [
            ("model.embed_tokens.weight", 100_000),
            ("model.layers.0.mlp.up_proj.weight", 200_000),
            ("model.layers.1.mlp.up_proj.weight", 200_000),
            ("model.norm.weight", 10),
        ]
        .iter()
        .map(|(n, k)| (n.to_string(), Tensor::zeros([*k as i64], opts)))
        .collect();
        // 1 MB = 262,144 fp32 elements: norm + layer 1 fit, layer 0 starts a new bucket.
        let r = GradReducer::all_reduce(&named, 2, 1.0);
        let Plan::AllReduce(b) = &r.plan else {
            panic!()
        };
        assert_eq!(b, &[(vec![3, 2], 1), (vec![1], 2), (vec![0], 3)]);
    }
}
