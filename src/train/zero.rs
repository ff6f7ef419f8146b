//! Sharded AdamW: ZeRO stages 1 and 2 (`system.zero_stage`) over the flat parameter space of
//! [`crate::dist::zero::FlatLayout`].
//!
//! Buffers of this rank (`S` = the slice it owns, all fp32, on the parameters' device):
//! - `exp_avg`, `exp_avg_sq` [S]: AdamW's moments of the slice, always.
//! - `master` [S]: fp32 master weights of the slice, only when the working parameters (what
//!   the forward reads) are not fp32 (`training.dtype = bf16`: 2 bytes per parameter on every
//!   rank plus 16/N of state). With fp32 parameters the update runs on views of the parameters
//!   themselves, which are their own masters.
//! - `grad` [S]: the slice's averaged gradient, at stage 2 (the reduce-scatter's target), or at
//!   stage 1 when the parameters are not fp32 (an fp32 copy). Stage 1 with fp32 parameters reads
//!   views of the all-reduced full gradients instead.
//!
//! A step:
//! - stage 1: the full gradients are all-reduced as in replicated training; the global norm is
//!   computed from them locally (no collective, and the same bits as stage 0).
//! - stage 2: the gradients are reduce-scattered bucket by bucket straight into `grad` and the
//!   full gradients dropped; the norm is the root of the all-reduced sum of the slices' squares
//!   (one scalar collective).
//!
//! Then fused AdamW updates the slice, one tensor per parameter piece in it (decayed pieces in
//! one call, the others in a second), and the updated slices are all-gathered, bucket by bucket
//! in the working dtype, into every rank's parameters.

use std::collections::HashMap;
use std::ops::Range;

use anyhow::{Context, Result};
use tch::{Kind, Tensor};

use super::optim::{clip_to, drop_grads, fused_adamw, grad_norm, AdamWParams, FusedGroup};
use crate::dist::zero::{intersect, FlatLayout, Piece};
use crate::dist::ProcessGroup;

/// Bytes of this rank's training state, by kind (the memory line's breakdown).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StateBytes {
    /// Working parameters (what the forward reads).
    pub params: u64,
    /// fp32 master weights kept apart from the parameters (sharded stages only).
    pub master: u64,
    /// AdamW's two moments.
    pub moments: u64,
    /// Gradients kept between the reduction and the update.
    pub grads: u64,
}

pub struct ShardedAdamW {
    pub hp: AdamWParams,
    /// Completed optimizer steps.
    pub step: u64,
    /// 1 or 2.
    pub stage: usize,
    pub layout: FlatLayout,
    pub rank: usize,
    /// The working parameters, in the caller's (Hugging Face) order.
    params: Vec<(String, Tensor)>,
    /// The parameter pieces of this rank's slice, in flat order.
    pieces: Vec<Piece>,
    /// One step-count scalar per piece (the fused kernel reads one per tensor).
    step_counts: Vec<Tensor>,
    master: Option<Tensor>,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    grad: Option<Tensor>,
    /// Elements per bucket of the gradient reduce-scatter and the parameter all-gather.
    bucket: usize,
}

impl ShardedAdamW {
    /// Shards `params` (fp32) over `world` ranks. The parameters must be identical on every rank
    /// (e.g. after the initial broadcast). With a `working` dtype other than fp32 the slice's
    /// fp32 values become its master and the parameters are converted in place to `working`.
    pub fn new(
        params: Vec<(String, Tensor)>,
        hp: AdamWParams,
        stage: usize,
        (rank, world): (usize, usize),
        bucket_mb: f64,
        working: Kind,
    ) -> ShardedAdamW {
        let layout = FlatLayout::new(
            params
                .iter()
                .map(|(n, p)| (n.as_str(), p.numel(), p.dim() >= 2)),
            world,
        );
        let device = params.first().map_or(tch::Device::Cpu, |(_, p)| p.device());
        let fp32 = working == Kind::Float;
        let zeros = || Tensor::zeros([layout.shard as i64], (Kind::Float, device));
        let pieces = layout.pieces(layout.owned(rank));
        let s = ShardedAdamW {
            hp,
            step: 0,
            stage,
            bucket: ((bucket_mb * 1024.0 * 1024.0 / 4.0) as usize).max(1),
            step_counts: pieces
                .iter()
                .map(|_| Tensor::zeros([], (Kind::Float, device)))
                .collect(),
            pieces,
            master: (!fp32).then(zeros),
            exp_avg: zeros(),
            exp_avg_sq: zeros(),
            grad: (stage == 2 || !fp32).then(zeros),
            layout,
            rank,
            params,
        };
        s.master_from_params();
        if !fp32 {
            for (_, p) in &s.params {
                // In place: the model and the VarStore hold the same tensors.
                let mut p = p.shallow_clone();
                tch::no_grad(|| p.set_data(&p.to_kind(working)));
            }
        }
        s
    }

    fn owned(&self) -> Range<usize> {
        self.layout.owned(self.rank)
    }

    /// `t` (a [S] slice buffer) at the flat range `flat`, which lies inside the owned slice.
    fn slice_of(&self, t: &Tensor, flat: &Range<usize>) -> Tensor {
        let at = flat.start - self.owned().start;
        t.narrow(0, at as i64, flat.len() as i64)
    }

    fn param(&self, flat_index: usize) -> &Tensor {
        &self.params[self.layout.params[flat_index].index].1
    }

    /// The working parameter's elements of `piece` (a view).
    fn param_piece(&self, piece: &Piece) -> Tensor {
        self.param(piece.param).view(-1).narrow(
            0,
            piece.local.start as i64,
            piece.local.len() as i64,
        )
    }

    /// The parameter's own gradient at `piece` (a view), if it has one.
    fn grad_piece(&self, piece: &Piece) -> Option<Tensor> {
        let g = self.param(piece.param).grad();
        g.defined().then(|| {
            g.view(-1)
                .narrow(0, piece.local.start as i64, piece.local.len() as i64)
        })
    }

    /// master ← the owned pieces of the working parameters.
    fn master_from_params(&self) {
        let Some(master) = &self.master else { return };
        tch::no_grad(|| {
            for piece in &self.pieces {
                self.slice_of(master, &piece.flat)
                    .copy_(&self.param_piece(piece));
            }
        });
    }

    /// The fp32 gradient slice a stage-2 reduce-scatter fills (see `train::reduce`).
    pub fn grad_slice(&self) -> Option<Tensor> {
        self.grad.as_ref().map(Tensor::shallow_clone)
    }

    /// The parameters' own gradients (defined ones), as after backward.
    pub fn gradients(&self) -> Vec<Tensor> {
        self.params
            .iter()
            .map(|(_, p)| p.grad())
            .filter(Tensor::defined)
            .collect()
    }

    /// The global gradient norm as a 0-dim fp32 tensor.
    pub fn grad_norm(&self, pg: &mut dyn ProcessGroup) -> Result<Tensor> {
        if self.stage == 1 {
            return Ok(grad_norm(&self.gradients()));
        }
        let shard = self.grad.as_ref().expect("stage 2 keeps a gradient slice");
        // Squares summed in chunks (libtorch's cascade sum, accurate to ~1e-7 where its fp32
        // norm kernel on CPU is off by up to ~1e-4 on millions of elements) without a
        // temporary the size of the slice.
        const CHUNK: i64 = 1 << 24;
        let n = shard.numel() as i64;
        let local: f64 = tch::no_grad(|| {
            (0..n)
                .step_by(CHUNK as usize)
                .map(|at| {
                    let part = shard.narrow(0, at, CHUNK.min(n - at));
                    part.square().sum(Kind::Float).double_value(&[])
                })
                .sum()
        });
        let mut total = [local as f32];
        pg.all_reduce_sum_f32(&mut total)?;
        Ok(Tensor::from(total[0].sqrt()).to_device(shard.device()))
    }

    /// Scales the gradients that the update will read so their global norm is at most `max`.
    pub fn clip(&self, norm: &Tensor, max: f64) {
        match (self.stage, &self.grad) {
            (2, Some(shard)) => clip_to(std::slice::from_ref(shard), norm, max),
            _ => clip_to(&self.gradients(), norm, max),
        }
    }

    /// `debug.inject_nan_param`: a NaN in the first element of `name`'s gradient, wherever that
    /// gradient lives now (the full one at stage 1, its owner's slice at stage 2).
    pub fn poison_gradient(&self, name: &str) {
        let Some(p) = self.layout.params.iter().find(|p| p.name == name) else {
            return;
        };
        match (self.stage, &self.grad) {
            (2, Some(shard)) if self.owned().contains(&p.start) => {
                let _ = self
                    .slice_of(shard, &(p.start..p.start + 1))
                    .fill_(f64::NAN);
            }
            (2, _) => {}
            _ => {
                let g = self.params[p.index].1.grad();
                if g.defined() {
                    let _ = g.view(-1).get(0).fill_(f64::NAN);
                }
            }
        }
    }

    /// One AdamW update of this rank's slice, then the all-gather of every rank's updated
    /// slice into the working parameters.
    pub fn step(&mut self, lr: f64, pg: &mut dyn ProcessGroup) -> Result<()> {
        self.step += 1;
        if let (1, Some(shard)) = (self.stage, &self.grad) {
            // Stage 1 with non-fp32 parameters: the update reads an fp32 copy.
            tch::no_grad(|| {
                let _ = shard.shallow_clone().zero_();
                for piece in &self.pieces {
                    if let Some(g) = self.grad_piece(piece) {
                        self.slice_of(shard, &piece.flat).copy_(&g);
                    }
                }
            });
        }
        for decay in [true, false] {
            let mut group: [Vec<Tensor>; 4] = Default::default();
            let mut steps = Vec::new();
            for (piece, count) in self.pieces.iter().zip(&self.step_counts) {
                if self.layout.params[piece.param].decay != decay {
                    continue;
                }
                let grad = match &self.grad {
                    Some(shard) => self.slice_of(shard, &piece.flat),
                    None => match self.grad_piece(piece) {
                        Some(g) => g,
                        None => continue, // no gradient, no update (as replicated AdamW)
                    },
                };
                let param = match &self.master {
                    Some(m) => self.slice_of(m, &piece.flat),
                    None => self.param_piece(piece),
                };
                let _ = count.shallow_clone().fill_(self.step as f64);
                group[0].push(param);
                group[1].push(grad);
                group[2].push(self.slice_of(&self.exp_avg, &piece.flat));
                group[3].push(self.slice_of(&self.exp_avg_sq, &piece.flat));
                steps.push(count);
            }
            if steps.is_empty() {
                continue;
            }
            let [p, g, m, v] = &group;
            let tensors = FusedGroup {
                params: p.iter().collect(),
                grads: g.iter().collect(),
                exp_avgs: m.iter().collect(),
                exp_avg_sqs: v.iter().collect(),
                steps,
            };
            fused_adamw(&tensors, lr, &self.hp, decay)?;
        }
        self.gather_params(pg)
    }

    /// Every rank's updated slice, all-gathered bucket by bucket in the parameters' dtype and
    /// copied into the working parameters.
    fn gather_params(&self, pg: &mut dyn ProcessGroup) -> Result<()> {
        let kind = self.params.first().map_or(Kind::Float, |(_, p)| p.kind());
        let own = |piece: &Piece| match &self.master {
            Some(m) => self.slice_of(m, &piece.flat),
            None => self.param_piece(piece),
        };
        self.gather(pg, kind, own, |piece, src| {
            tch::no_grad(|| self.param_piece(piece).copy_(src));
        })
    }

    /// An all-gather over the flat space in buckets of `kind`: `own(piece)` gives this rank's
    /// values of a piece of its slice, `place(piece, values)` receives every piece.
    fn gather(
        &self,
        pg: &mut dyn ProcessGroup,
        kind: Kind,
        own: impl Fn(&Piece) -> Tensor,
        mut place: impl FnMut(&Piece, &Tensor),
    ) -> Result<()> {
        let owned = self.owned();
        let device = self.exp_avg.device();
        for bucket in self.layout.buckets(self.bucket) {
            let flat = Tensor::zeros([bucket.len() as i64], (kind, device));
            let at =
                |r: &Range<usize>| flat.narrow(0, (r.start - bucket.start) as i64, r.len() as i64);
            let mine = intersect(&bucket, &owned);
            if !mine.is_empty() {
                tch::no_grad(|| {
                    for piece in self.layout.pieces(mine) {
                        at(&piece.flat).copy_(&own(&piece));
                    }
                });
            }
            pg.all_gather_tensor(&flat, &self.layout.splits(&bucket))?;
            for piece in self.layout.pieces(bucket.clone()) {
                place(&piece, &at(&piece.flat));
            }
        }
        Ok(())
    }

    /// Drops the parameters' gradients (`grad`, the slice buffer, is overwritten every step).
    pub fn zero_grad(&mut self) {
        drop_grads(self.params.iter().map(|(_, p)| p));
    }

    /// Every parameter's full averaged gradient, in the caller's order (for the NaN/Inf report
    /// and dump). A collective at stage 2, where the gradients only exist as slices.
    pub fn full_gradients(&self, pg: &mut dyn ProcessGroup) -> Result<Vec<Tensor>> {
        let (2, Some(shard)) = (self.stage, &self.grad) else {
            return Ok(self.params.iter().map(|(_, p)| p.grad()).collect());
        };
        let full: Vec<Tensor> = self
            .params
            .iter()
            .map(|(_, p)| Tensor::zeros(p.size(), (Kind::Float, p.device())))
            .collect();
        let own = |piece: &Piece| self.slice_of(shard, &piece.flat);
        self.gather(pg, Kind::Float, own, |piece, src| {
            let mut dst = full[self.layout.params[piece.param].index].view(-1).narrow(
                0,
                piece.local.start as i64,
                piece.local.len() as i64,
            );
            tch::no_grad(|| dst.copy_(src));
        })?;
        Ok(full)
    }

    /// The full fp32 values of the parameters this rank writes into a checkpoint's model files
    /// (those whose first element it owns), in flat order. From the working parameters when
    /// they are fp32 (they equal the masters bit for bit); otherwise the masters are
    /// all-gathered, which every rank must then call together.
    pub fn checkpoint_weights(&self, pg: &mut dyn ProcessGroup) -> Result<Vec<(String, Tensor)>> {
        let mine: Vec<usize> = (0..self.layout.params.len())
            .filter(|&i| self.layout.writer(&self.layout.params[i]) == self.rank)
            .collect();
        // Without masters the working parameters are fp32 and are the masters.
        let Some(master) = self.master.as_ref() else {
            return Ok(mine
                .iter()
                .map(|&i| {
                    let p = &self.layout.params[i];
                    (p.name.clone(), self.params[p.index].1.detach())
                })
                .collect());
        };
        let mut out: HashMap<usize, Tensor> = mine
            .iter()
            .map(|&i| {
                let p = &self.params[self.layout.params[i].index].1;
                (i, Tensor::zeros(p.size(), (Kind::Float, p.device())))
            })
            .collect();
        let own = |piece: &Piece| self.slice_of(master, &piece.flat);
        self.gather(pg, Kind::Float, own, |piece, src| {
            if let Some(dst) = out.get_mut(&piece.param) {
                let mut d =
                    dst.view(-1)
                        .narrow(0, piece.local.start as i64, piece.local.len() as i64);
                tch::no_grad(|| d.copy_(src));
            }
        })?;
        Ok(mine
            .iter()
            .map(|i| (self.layout.params[*i].name.clone(), out.remove(i).unwrap()))
            .collect())
    }

    /// This rank's moments, one piece per parameter it owns part of: tensors `<name>.exp_avg`
    /// and `<name>.exp_avg_sq` (1-D) and the piece's element range within the parameter,
    /// `"<start>:<end>"`, under `<name>` in the metadata.
    pub fn moment_pieces(&self) -> (Vec<(String, Tensor)>, HashMap<String, String>) {
        let mut tensors = Vec::new();
        let mut ranges = HashMap::new();
        for piece in &self.pieces {
            let name = &self.layout.params[piece.param].name;
            tensors.push((
                format!("{name}.exp_avg"),
                self.slice_of(&self.exp_avg, &piece.flat),
            ));
            tensors.push((
                format!("{name}.exp_avg_sq"),
                self.slice_of(&self.exp_avg_sq, &piece.flat),
            ));
            ranges.insert(
                name.clone(),
                format!("{}:{}", piece.local.start, piece.local.end),
            );
        }
        (tensors, ranges)
    }

    /// Restores the slice from a checkpoint: the moments from whatever pieces the checkpoint's
    /// optimizer files hold, and a master slice (where one is kept) from its fp32 weights. The
    /// caller has loaded the working parameters from the same weights.
    pub fn load(
        &mut self,
        weights: &crate::model::hf::Weights,
        moments: &super::checkpoint::MomentFiles,
        adam_step: u64,
    ) -> Result<()> {
        let dev = self.exp_avg.device();
        for piece in &self.pieces {
            let name = &self.layout.params[piece.param].name;
            let (m, v) = moments.read(name, &piece.local)?;
            tch::no_grad(|| {
                self.slice_of(&self.exp_avg, &piece.flat)
                    .copy_(&m.to_device(dev));
                self.slice_of(&self.exp_avg_sq, &piece.flat)
                    .copy_(&v.to_device(dev));
            });
            if let Some(master) = &self.master {
                let full = weights
                    .tensor(name)
                    .with_context(|| format!("checkpoint weights: {name}"))?;
                let local =
                    full.view(-1)
                        .narrow(0, piece.local.start as i64, piece.local.len() as i64);
                tch::no_grad(|| {
                    self.slice_of(master, &piece.flat)
                        .copy_(&local.to_kind(Kind::Float).to_device(dev))
                });
            }
        }
        self.step = adam_step;
        Ok(())
    }

    /// This rank's bytes by kind.
    pub fn state_bytes(&self) -> StateBytes {
        let bytes = |t: &Tensor| (t.numel() * t.kind().elt_size_in_bytes()) as u64;
        let params: u64 = self.params.iter().map(|(_, p)| bytes(p)).sum();
        let slice = |t: &Option<Tensor>| t.as_ref().map_or(0, bytes);
        // Stage 1 keeps the full gradients (in the parameters' dtype) until the update.
        let full_grads = if self.stage == 1 { params } else { 0 };
        StateBytes {
            params,
            master: slice(&self.master),
            moments: bytes(&self.exp_avg) + bytes(&self.exp_avg_sq),
            grads: slice(&self.grad) + full_grads,
        }
    }
}
