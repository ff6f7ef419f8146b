//! Where a gradient is averaged across ranks: as soon as backward has finished it.
//!
//! The model's backward reports each unit (the LM head, the final norm, decoder layers from the
//! last down, the embedding) the moment its gradients are final ([`GradUnit`]); each report
//! submits the reductions that just became possible to a [`CommQueue`], which runs them on a
//! communication thread while the lower layers' backward goes on (`system.overlap_comm`), or
//! after backward, in the same order (bitwise the same).
//!
//! Buffers travel in `system.reduce_dtype`: fp32, or bf16 (each gradient and each average
//! rounded to bf16; the ring adds in fp32, NCCL in its own way; the accumulation into the
//! gradients and slices stays fp32).
//!
//! - Replicated gradients (zero stages 0 and 1) are all-reduced in flat buckets of
//!   `system.bucket_mb` (`dist::buckets`), packed in backward order: a bucket goes once the unit
//!   of its last parameter is final. Only on a step's last micro-batch: the earlier ones
//!   accumulate into the full gradients.
//! - Gradient accumulation with non-fp32 working parameters (bf16 at stages 1 and 2): each
//!   non-final micro-batch's gradients join an fp32 sum as backward finishes their unit, and
//!   are dropped; the last micro-batch's reduction sends the fp32 sums. Added in bf16 instead,
//!   every micro-batch would round away the low bits of the sum ([`GradReducer::accum`]).
//! - Sharded gradients (stages 2 and 3) are reduce-scattered a unit at a time: the unit's
//!   gradients are copied into one buffer laid out rank by rank (its [`Span`]), the full
//!   gradients are dropped at once, and each rank adds its part, averaged, into its fp32
//!   gradient slice (zeroed after every update). Stage 2 does this on the last micro-batch (the
//!   full gradients accumulate until then); stage 3 on every micro-batch, so no full gradient
//!   outlives its unit.

use std::sync::Mutex;

use tch::{Kind, Tensor};

use super::kernel::drop_grads;
use super::sharded::Sharded;
use crate::dist::buckets::{cap_bytes, flatten, pack, unflatten};
use crate::dist::flat_layout::{FlatLayout, Span};
use crate::dist::overlap::CommQueue;
use crate::dist::{on_group, SharedGroup};
use crate::model::GradUnit;

/// How a run averages its gradients.
pub struct GradReducer {
    /// Units in backward order, with their parameters (indices into `params`).
    units: Vec<(GradUnit, Vec<usize>)>,
    /// `system.reduce_dtype`: the dtype of the buffers sent (fp32 or bf16).
    kind: Kind,
    /// The parameters (shallow clones), in the caller's order.
    params: Vec<Tensor>,
    plan: Plan,
    /// The fp32 sums [param's shape] of the earlier micro-batches' gradients of non-fp32
    /// parameters, indexed like `params` (made at the first accumulation, kept and zeroed once
    /// consumed, so a step allocates nothing).
    accum: Mutex<Vec<Option<Tensor>>>,
}

enum Plan {
    /// World of one: nothing to average.
    Nothing,
    /// All-reduce in buckets: (parameter indices in backward order, index of the unit after
    /// which the bucket is complete), on the data-parallel group (None: the caller's group).
    AllReduce(Vec<(Vec<usize>, usize)>, Option<SharedGroup>),
    /// Reduce-scatter a unit at a time into `slice` (this rank's fp32 gradient slice [S]).
    ReduceScatter {
        /// Each unit's span, aligned with `units`.
        spans: Vec<Span>,
        /// The layout position → the caller's index.
        index_of: Vec<usize>,
        rank: usize,
        layout: FlatLayout,
        slice: Tensor,
        /// Hybrid sharding: the shard group the reduce-scatters run on.
        shard: Option<SharedGroup>,
    },
}

impl GradReducer {
    /// All-reduce of replicated gradients of `named` (whose units are `of`, one per
    /// parameter) over `world` data-parallel ranks (their `group`, or the caller's when None)
    /// in buckets of `bucket_mb`, sent as `kind`.
    pub fn all_reduce(
        named: &[(String, Tensor)],
        of: &[GradUnit],
        (world, group): (usize, Option<SharedGroup>),
        bucket_mb: f64,
        kind: Kind,
    ) -> GradReducer {
        let units = GradUnit::group_in_backward_order(of);
        let params: Vec<Tensor> = named.iter().map(|(_, p)| p.shallow_clone()).collect();
        if world == 1 {
            return GradReducer {
                units,
                kind,
                params,
                plan: Plan::Nothing,
                accum: Mutex::default(),
            };
        }
        // Every parameter in backward order, with the position of its unit.
        let order: Vec<(usize, usize)> = units
            .iter()
            .enumerate()
            .flat_map(|(u, (_, members))| members.iter().map(move |&i| (i, u)))
            .collect();
        let sizes: Vec<usize> = order
            .iter()
            .map(|&(i, _)| params[i].numel() * params[i].kind().elt_size_in_bytes())
            .collect();
        let buckets = pack(&sizes, cap_bytes(bucket_mb), |_, _| true)
            .into_iter()
            .map(|g| {
                let members = order[g.clone()].iter().map(|&(i, _)| i).collect();
                (members, order[g.end - 1].1)
            })
            .collect();
        GradReducer {
            units,
            kind,
            params,
            plan: Plan::AllReduce(buckets, group),
            accum: Mutex::default(),
        }
    }

    /// Reduce-scatter of sharded gradients into the gradient slice of `sharded` (stages 2 and
    /// 3), unit by unit along the spans it computed, among the ranks of its shard group
    /// (hybrid sharding) or of the caller's group.
    pub fn reduce_scatter(
        named: &[(String, Tensor)],
        sharded: &Sharded,
        kind: Kind,
    ) -> GradReducer {
        let params = named.iter().map(|(_, p)| p.shallow_clone()).collect();
        let units = sharded.unit_spans();
        let layout = sharded.layout.clone();
        let index_of = layout.params.iter().map(|p| p.index).collect();
        GradReducer {
            units: units.iter().map(|(u, m, _)| (*u, m.clone())).collect(),
            kind,
            params,
            plan: Plan::ReduceScatter {
                spans: units.iter().map(|(_, _, s)| s.clone()).collect(),
                index_of,
                rank: sharded.rank,
                layout,
                slice: sharded
                    .grad_slice()
                    .expect("stages 2 and 3 keep a gradient slice"),
                shard: sharded.shard_group(),
            },
            accum: Mutex::default(),
        }
    }

    /// A micro-batch before the step's last has finished `unit`: the gradients of its non-fp32
    /// parameters join their fp32 sums and are dropped (the next micro-batch's backward makes
    /// them anew). fp32 gradients accumulate in place, exactly as they are.
    pub fn unit_accumulate(&self, unit: GradUnit) {
        let Some(u) = self.units.iter().position(|(x, _)| *x == unit) else {
            return;
        };
        let members: Vec<usize> = self.units[u]
            .1
            .iter()
            .copied()
            .filter(|&i| self.params[i].kind() != Kind::Float && self.params[i].grad().defined())
            .collect();
        if members.is_empty() {
            return;
        }
        let mut accum = self.accum.lock().unwrap_or_else(|e| e.into_inner());
        if accum.is_empty() {
            accum.resize_with(self.params.len(), || None);
        }
        tch::no_grad(|| {
            for &i in &members {
                let g = self.params[i].grad().to_kind(Kind::Float);
                match &mut accum[i] {
                    Some(sum) => *sum += g,
                    slot => *slot = Some(g),
                }
            }
        });
        drop_grads(members.iter().map(|&i| &self.params[i]));
    }

    /// The step's gradient of parameter `i` in fp32, its own `g` plus the sum of the earlier
    /// micro-batches' (zeroed for the next step), when there is such a sum.
    fn with_earlier(&self, i: usize, g: &Tensor) -> Option<Tensor> {
        let accum = self.accum.lock().unwrap_or_else(|e| e.into_inner());
        let sum = accum.get(i)?.as_ref()?;
        Some(tch::no_grad(|| {
            let total = sum + g.to_kind(Kind::Float);
            let _ = sum.shallow_clone().zero_();
            total
        }))
    }

    /// Backward has finished `unit`: submit what became ready.
    pub fn unit_final(&self, unit: GradUnit, queue: &mut CommQueue<'_>) {
        let Some(u) = self.units.iter().position(|(x, _)| *x == unit) else {
            return;
        };
        match &self.plan {
            // Nothing to average; the earlier micro-batches' sums join the gradients (one cast
            // to the parameter's dtype).
            Plan::Nothing => tch::no_grad(|| {
                for &i in &self.units[u].1 {
                    let g = self.params[i].grad();
                    if let Some(total) = g.defined().then(|| self.with_earlier(i, &g)).flatten() {
                        g.shallow_clone().copy_(&total);
                    }
                }
            }),
            Plan::AllReduce(buckets, group) => {
                for (members, _) in buckets.iter().filter(|(_, ready)| *ready == u) {
                    self.submit_all_reduce(members, group.clone(), queue);
                }
            }
            Plan::ReduceScatter { .. } => self.submit_unit_scatter(u, queue),
        }
    }

    /// One bucket: its gradients (with the earlier micro-batches' fp32 sums) packed flat,
    /// averaged, and copied back.
    fn submit_all_reduce(
        &self,
        members: &[usize],
        group: Option<SharedGroup>,
        queue: &mut CommQueue<'_>,
    ) {
        let (grads, totals): (Vec<Tensor>, Vec<Tensor>) = members
            .iter()
            .map(|&i| (i, self.params[i].grad()))
            .filter(|(_, g)| g.defined())
            .map(|(i, g)| {
                let total = self
                    .with_earlier(i, &g)
                    .unwrap_or_else(|| g.shallow_clone());
                (g, total)
            })
            .unzip();
        if grads.is_empty() {
            return;
        }
        let flat = flatten(&totals).to_kind(self.kind);
        queue.submit(Box::new(move |pg| {
            on_group(group.as_ref(), pg, |g| g.all_reduce_avg_tensor(&flat))?;
            unflatten(&flat, &grads);
            Ok(())
        }));
    }

    /// Unit `u`'s gradients in its span's buffer, reduce-scattered and added into every rank's
    /// slice; the full gradients are dropped as soon as they are copied.
    fn submit_unit_scatter(&self, u: usize, queue: &mut CommQueue<'_>) {
        let Plan::ReduceScatter {
            spans,
            index_of,
            rank,
            layout,
            slice,
            shard,
        } = &self.plan
        else {
            return;
        };
        let span = &spans[u];
        let buffer = Tensor::zeros([span.len() as i64], (self.kind, slice.device()));
        tch::no_grad(|| {
            for piece in &span.pieces {
                let i = index_of[piece.param];
                let g = self.params[i].grad();
                if !g.defined() {
                    continue;
                }
                let g = self.with_earlier(i, &g).unwrap_or(g);
                let src = g
                    .view(-1)
                    .narrow(0, piece.local.start as i64, piece.local.len() as i64);
                buffer
                    .narrow(0, piece.buf.start as i64, piece.buf.len() as i64)
                    .copy_(&src);
            }
        });
        drop_grads(self.units[u].1.iter().map(|&i| &self.params[i]));
        let mine: Vec<(i64, i64, i64)> = span
            .owned_by(layout, *rank)
            .map(|(p, at)| (p.buf.start as i64, at as i64, p.buf.len() as i64))
            .collect();
        let (slice, splits) = (slice.shallow_clone(), span.splits.clone());
        let shard = shard.clone();
        queue.submit(Box::new(move |pg| {
            on_group(shard.as_ref(), pg, |g| {
                g.reduce_scatter_avg_tensor(&buffer, &splits)
            })?;
            tch::no_grad(|| {
                for (buf, at, len) in mine {
                    let mut dst = slice.narrow(0, at, len);
                    dst += buffer.narrow(0, buf, len);
                }
            });
            Ok(())
        }));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Finding 24: stages 1 and 2 with bf16 working parameters added micro-batch gradients up
    /// in bf16. 1 + 3 × 2^-8 summed in bf16 stays 1 (each 2^-8 is half of bf16's spacing at
    /// 1.0 and rounds away); summed in fp32 it is exact: stage 2's fp32 gradient slice holds
    /// it, stage 1's bf16 gradient its one final cast (1 + 2^-6, the even neighbour).
    #[test]
    fn micro_batch_gradients_of_bf16_parameters_accumulate_in_fp32() -> anyhow::Result<()> {
        use super::super::{AdamWParams, Optimizer};
        use crate::config::ZeroStage;
        use crate::dist::SingleProcess;
        use crate::model::params::table_of;
        let hp = AdamWParams {
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.0,
        };
        for (stage, want) in [
            (ZeroStage::Gradients, 1.0 + 3.0 / 256.0),
            (ZeroStage::Optimizer, 1.0 + 1.0 / 64.0),
        ] {
            let w = Tensor::zeros([4], (Kind::Float, tch::Device::Cpu)).set_requires_grad(true);
            let params = vec![("model.norm.weight".to_string(), w.shallow_clone())];
            let mut pg = SingleProcess;
            let table = table_of(&[("model.norm.weight", &w, GradUnit::FinalNorm)]);
            let opt = Optimizer::new(&params, &table, hp.into(), stage, &pg, 25.0, Kind::BFloat16)?;
            assert_eq!(w.kind(), Kind::BFloat16, "bf16 working parameters");
            for (micro, c) in [1.0, 1.0 / 256.0, 1.0 / 256.0, 1.0 / 256.0]
                .into_iter()
                .enumerate()
            {
                let last = micro == 3;
                opt.pass(&mut pg, false, &[GradUnit::FinalNorm], last, |units| {
                    (w.to_kind(Kind::Float) * c).sum(Kind::Float).backward();
                    units.grads_final(GradUnit::FinalNorm)
                })?;
            }
            let g = &opt.full_gradients(&params, &mut pg)?[0];
            let got: Vec<f64> = Vec::try_from(g.to_kind(Kind::Double))?;
            assert_eq!(got, vec![want; 4], "{stage:?}");
        }
        Ok(())
    }

    #[test]
    fn units_come_in_the_order_backward_finishes_them() {
        // embed_tokens, layers.0.mlp.up_proj, layers.1.mlp.up_proj, layers.0.input_layernorm,
        // norm, lm_head.
        let units = GradUnit::group_in_backward_order(&[
            GradUnit::Embedding,
            GradUnit::Layer(0),
            GradUnit::Layer(1),
            GradUnit::Layer(0),
            GradUnit::FinalNorm,
            GradUnit::LmHead,
        ]);
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
        let units = [
            GradUnit::Embedding,
            GradUnit::Layer(0),
            GradUnit::Layer(1),
            GradUnit::FinalNorm,
        ];
        let r = GradReducer::all_reduce(&named, &units, (2, None), 1.0, Kind::Float);
        let Plan::AllReduce(b, _) = &r.plan else {
            panic!()
        };
        assert_eq!(b, &[(vec![3, 2], 1), (vec![1], 2), (vec![0], 3)]);
    }
}
