//! The sharded layout: ZeRO stages 1, 2 and 3 (`system.zero_stage`) over the flat parameter
//! space of [`FlatLayout`] (rank r owns the contiguous slice `[r·S, (r+1)·S)`), whose groups are
//! the update rules (`muon::Rule`): Muon's matrices first (with `training.optimizer = muon`),
//! then AdamW's decayed parameters, then the rest.
//!
//! Buffers of this rank (S = the slice it owns; fp32, on the parameters' device):
//! - `exp_avg`, `exp_avg_sq` [A]: AdamW's moments of the slice's AdamW part (A elements: the
//!   whole slice without Muon), always.
//! - `momentum` [M]: Muon's momentum buffer of the slice's Muon part (M = S − A elements).
//! - `master` [S]: fp32 master weights of the slice, when the working parameters (what the
//!   forward reads) are not fp32 (`training.dtype = bf16`), and always at stage 3, where it is
//!   the only persistent copy of the parameters. At stages 1 and 2 with fp32 parameters the
//!   update runs on views of the parameters themselves, which are their own masters.
//! - `grad` [S]: the slice's averaged gradient, at stages 2 and 3 (the reduce-scatters add into
//!   it; zeroed after every update), or at stage 1 when the parameters are not fp32 (an fp32
//!   copy). Stage 1 with fp32 parameters reads views of the all-reduced full gradients instead.
//! - The working parameters [P each], in the model: full at stages 1 and 2; at stage 3 empty
//!   (0 elements) except while a pass uses their unit, when they hold the unit's all-gathered
//!   values ([`Sharded::gather_job`], [`Sharded::materialize`]).
//!
//! A step:
//! - stage 1: the full gradients are all-reduced as in replicated training; the global norm is
//!   computed from them locally (no collective).
//! - stages 2 and 3: the gradients are reduce-scattered unit by unit straight into `grad`
//!   (`reduce.rs`); the norm is the root of the sum of the slices' squares, summed in fp64
//!   across ranks in rank order (the same value as stage 0's, see `kernel::sum_of_squares`).
//!
//! Then Muon updates the slice's pieces of its matrices: the momentum and the Nesterov update
//! on the pieces, Newton–Schulz on each matrix made whole on its owner (`orthogonal.rs`: only
//! the matrices that straddle two slices, or that share out the work, move). Fused AdamW
//! updates the rest of the slice, one
//! tensor per parameter piece in it (decayed pieces in one call, the others in a second). At
//! stages 1 and 2 the updated slices are all-gathered,
//! bucket by bucket in the working dtype, into every rank's parameters; at stage 3 the next
//! pass gathers them unit by unit.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::mpsc;

use anyhow::{Context, Result};
use tch::{Device, Kind, Tensor};

use super::kernel::{clip_to, drop_grads, fused_adamw, sum_of_squares, AdamWParams, FusedGroup};
use super::muon::{self, MuonParams, Rule};
use super::orthogonal::{Orthogonalizer, Setup};
use super::state::{EXP_AVG, EXP_AVG_SQ, MOMENTUM};
use super::{MomentPiece, RankState, StateBytes, StateSource};
use crate::config::ZeroStage;
use crate::dist::flat_layout::{intersect, FlatLayout, Piece, Span};
use crate::dist::overlap::Job;
use crate::dist::{on_group, ProcessGroup, SharedGroup};
use crate::model::GradUnit;

/// The ranks a sharded optimizer shards across: this rank's shard group (hybrid sharding), or
/// the whole group; `rank` and `world` are in that group.
pub struct ShardRanks {
    pub group: Option<SharedGroup>,
    pub rank: usize,
    pub world: usize,
}

impl ShardRanks {
    /// The ranks of `shard` where given, else those of the caller's group: `(rank, world)`.
    pub fn of(shard: Option<SharedGroup>, (rank, world): (usize, usize)) -> Result<ShardRanks> {
        let Some(g) = shard else {
            return Ok(ShardRanks {
                rank,
                world,
                group: None,
            });
        };
        let (rank, world) = {
            let group = g.lock().map_err(|_| anyhow::anyhow!("poisoned subgroup"))?;
            (group.rank(), group.world_size())
        };
        Ok(ShardRanks {
            rank,
            world,
            group: Some(g),
        })
    }
}

/// A buffer over part of this rank's slice: flat elements `start..start + len`.
struct Region {
    start: usize,
    t: Tensor,
}

impl Region {
    /// Zeros over the flat range `range`.
    fn zeros(range: Range<usize>, device: Device) -> Region {
        Region {
            start: range.start,
            t: Tensor::zeros([range.len() as i64], (Kind::Float, device)),
        }
    }

    /// The elements at the flat range `flat` (inside the region).
    fn at(&self, flat: &Range<usize>) -> Tensor {
        self.t
            .narrow(0, (flat.start - self.start) as i64, flat.len() as i64)
    }

    fn bytes(&self) -> u64 {
        (self.t.numel() * self.t.kind().elt_size_in_bytes()) as u64
    }
}

/// Muon's part of a sharded optimizer: who orthogonalizes which of its matrices (its
/// matrices are the flat layout's first parameters, in flat order).
struct ShardedMuon {
    hp: MuonParams,
    orthogonal: Orthogonalizer,
}

impl ShardedMuon {
    /// Muon's matrices of `layout` (the first group: parameters of `shapes`), each held by the
    /// ranks whose slices it meets, in flat order.
    fn of(setup: Setup, layout: &FlatLayout, shapes: &[Vec<i64>]) -> ShardedMuon {
        let end = layout.group_range(Rule::Muon.group()).end;
        let matrices = layout.params[..layout.params.partition_point(|p| p.start < end)]
            .iter()
            .map(|p| setup.matrix(p.index, &shapes[p.index], |_| layout.holders(p)))
            .collect();
        ShardedMuon {
            hp: setup.hp,
            orthogonal: setup.build(matrices),
        }
    }
}

pub struct Sharded {
    pub adamw: AdamWParams,
    /// Completed optimizer steps.
    pub step: u64,
    pub stage: ZeroStage,
    pub layout: FlatLayout,
    pub rank: usize,
    /// The working parameters, in the caller's (Hugging Face) order.
    params: Vec<(String, Tensor)>,
    /// Their full shapes (at stage 3 the tensors hold no elements between uses).
    shapes: Vec<Vec<i64>>,
    /// The working dtype (what the forward reads).
    working: Kind,
    device: Device,
    /// The parameter pieces of this rank's slice, in flat order.
    pieces: Vec<Piece>,
    /// One step-count scalar per piece (the fused kernel reads one per tensor).
    step_counts: Vec<Tensor>,
    master: Option<Tensor>,
    exp_avg: Region,
    exp_avg_sq: Region,
    momentum: Region,
    grad: Option<Tensor>,
    muon: Option<ShardedMuon>,
    /// Elements per bucket of the parameter all-gathers.
    bucket: usize,
    /// Stages 2 and 3: each unit in backward order, its parameters (the caller's indices) and
    /// its span: what the reduce-scatters move and (stage 3) the gathers.
    units: Vec<(GradUnit, Vec<usize>, Span)>,
    /// Hybrid sharding: the shard group its collectives run on (else the caller's group).
    shard: Option<SharedGroup>,
}

/// The parameters a sharded optimizer holds: by name, their full shapes (this rank's parts'
/// with tensor parallelism), units and update rules, in one order.
pub struct Members<'a> {
    pub named: Vec<(String, Tensor)>,
    pub shapes: Vec<Vec<i64>>,
    pub units: &'a [GradUnit],
    pub rules: &'a [Rule],
}

impl Sharded {
    /// Shards `members` (parameters of full shapes `shapes`) over `world` ranks. Whole parameters (fp32,
    /// identical on every rank, e.g. after the initial broadcast) give the master slices their
    /// values; at stage 3 the parameters may instead be empty placeholders whose values come
    /// one at a time through [`Sharded::set_initial`]. With a `working` dtype other than
    /// fp32 the parameters are converted in place; at stage 3 they are emptied (their slices
    /// live on in `master`).
    pub fn new(
        members: Members,
        (adamw, muon): (AdamWParams, Option<Setup>),
        stage: ZeroStage,
        ranks: ShardRanks,
        bucket_mb: f64,
        working: Kind,
    ) -> Sharded {
        let ShardRanks {
            group: shard,
            rank,
            world,
        } = ranks;
        let Members {
            named: params,
            shapes,
            units: param_units,
            rules,
        } = members;
        let numel = |s: &[i64]| s.iter().product::<i64>() as usize;
        let layout = FlatLayout::new(
            params
                .iter()
                .zip(&shapes)
                .zip(rules)
                .map(|(((n, _), s), r)| (n.as_str(), numel(s), r.group())),
            world,
        );
        let whole = params
            .iter()
            .zip(&shapes)
            .all(|((_, p), s)| p.numel() == numel(s));
        assert!(
            whole || stage.shards_parameters(),
            "internal: stages 1 and 2 start from whole parameters"
        );
        let device = params.first().map_or(Device::Cpu, |(_, p)| p.device());
        let fp32 = working == Kind::Float;
        let zeros = || Tensor::zeros([layout.shard as i64], (Kind::Float, device));
        let owned = layout.owned(rank);
        let pieces = layout.pieces(owned.clone());
        // The slice's Muon part (the space's first group), then its AdamW part.
        let muon_end = layout.group_range(Rule::Muon.group()).end;
        let split = muon_end.clamp(owned.start, owned.end);
        let muon = muon.map(|setup| ShardedMuon::of(setup, &layout, &shapes));
        let units = if stage.shards_gradients() {
            let position = layout.positions();
            GradUnit::group_in_backward_order(param_units)
                .into_iter()
                .map(|(unit, members)| {
                    let at: Vec<usize> = members.iter().map(|&i| position[i]).collect();
                    let span = layout.span(&at);
                    (unit, members, span)
                })
                .collect()
        } else {
            Vec::new()
        };
        let s = Sharded {
            adamw,
            step: 0,
            stage,
            bucket: (crate::dist::buckets::cap_bytes(bucket_mb) / 4).max(1),
            step_counts: pieces
                .iter()
                .map(|_| Tensor::zeros([], (Kind::Float, device)))
                .collect(),
            pieces,
            master: (!fp32 || stage.shards_parameters()).then(zeros),
            exp_avg: Region::zeros(split..owned.end, device),
            exp_avg_sq: Region::zeros(split..owned.end, device),
            momentum: Region::zeros(owned.start..split, device),
            grad: (stage.shards_gradients() || !fp32).then(zeros),
            muon,
            layout,
            rank,
            shapes,
            params,
            working,
            device,
            units,
            shard,
        };
        if let (Some(master), true) = (&s.master, whole) {
            tch::no_grad(|| {
                for piece in &s.pieces {
                    s.slice_of(master, &piece.flat).copy_(&s.param_piece(piece));
                }
            });
        }
        if stage.shards_parameters() {
            for i in 0..s.params.len() {
                s.release_param(i);
            }
        } else if !fp32 {
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

    /// The working parameter's elements of `piece` (a view; stages 1 and 2, and stage 3
    /// before the parameters are first emptied).
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

    /// Stages 2 and 3: each unit in backward order with its parameters and span (`reduce.rs`).
    pub fn unit_spans(&self) -> &[(GradUnit, Vec<usize>, Span)] {
        &self.units
    }

    /// Hybrid sharding: the shard group the sharded collectives run on.
    pub fn shard_group(&self) -> Option<SharedGroup> {
        self.shard.clone()
    }

    /// The fp32 gradient slice the reduce-scatters of stages 2 and 3 add into (`reduce.rs`).
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

    /// The global gradient norm's sum of squares: from the full gradients at stage 1, else
    /// from the slices (one fp64 all-gather of each rank's sum of squares).
    pub fn grad_sum_of_squares(&self, pg: &mut dyn ProcessGroup) -> Result<f64> {
        let sum = match (self.stage.shards_gradients(), &self.grad) {
            (true, Some(slice)) => {
                let mine = sum_of_squares(std::slice::from_ref(slice));
                on_group(self.shard.as_ref(), pg, |g| g.all_gather_f64(mine))?
                    .into_iter()
                    .sum()
            }
            _ => sum_of_squares(&self.gradients()),
        };
        Ok(sum)
    }

    /// The gradients of the parameters whose name passes `wanted`, where the update will read
    /// them: views of the gradient slice's pieces at stages 2 and 3, the whole gradients at
    /// stage 1.
    pub fn gradient_pieces(&self, wanted: impl Fn(&str) -> bool) -> Vec<Tensor> {
        match (self.stage.shards_gradients(), &self.grad) {
            (true, Some(slice)) => self
                .pieces
                .iter()
                .filter(|piece| wanted(&self.layout.params[piece.param].name))
                .map(|piece| self.slice_of(slice, &piece.flat))
                .collect(),
            _ => self
                .params
                .iter()
                .filter(|(name, _)| wanted(name))
                .map(|(_, p)| p.grad())
                .filter(Tensor::defined)
                .collect(),
        }
    }

    /// The sums of squares of the gradients of the parameters that pass `split` and of the
    /// others, over the data-parallel ranks (a collective of the shard group at stages 2 and
    /// 3; at stage 1 every rank holds the whole averaged gradients).
    pub fn grad_sums(
        &self,
        pg: &mut dyn ProcessGroup,
        split: impl Fn(&str) -> bool,
    ) -> Result<(f64, f64)> {
        let of = |want: bool| sum_of_squares(&self.gradient_pieces(|n| split(n) == want));
        let (parts, whole) = (of(true), of(false));
        if !self.stage.shards_gradients() {
            return Ok((parts, whole));
        }
        on_group(self.shard.as_ref(), pg, |g| {
            let parts: f64 = g.all_gather_f64(parts)?.into_iter().sum();
            let whole: f64 = g.all_gather_f64(whole)?.into_iter().sum();
            Ok((parts, whole))
        })
    }

    /// Scales the gradients that the update will read so their global norm is at most `max`.
    pub fn clip(&self, norm: f64, max: f64) {
        match (self.stage.shards_gradients(), &self.grad) {
            (true, Some(slice)) => clip_to(std::slice::from_ref(slice), norm, max),
            _ => clip_to(&self.gradients(), norm, max),
        }
    }

    /// `debug.inject_nan_param`: a NaN in the first element of `name`'s gradient, wherever that
    /// gradient lives now (the full one at stage 1, its owner's slice at stages 2 and 3).
    pub fn poison_gradient(&self, name: &str) {
        let Some(p) = self.layout.params.iter().find(|p| p.name == name) else {
            return;
        };
        match (self.stage.shards_gradients(), &self.grad) {
            (true, Some(slice)) if self.owned().contains(&p.start) => {
                let _ = self
                    .slice_of(slice, &(p.start..p.start + 1))
                    .fill_(f64::NAN);
            }
            (true, _) => {}
            _ => {
                let g = self.params[p.index].1.grad();
                if g.defined() {
                    let _ = g.view(-1).get(0).fill_(f64::NAN);
                }
            }
        }
    }

    /// The piece's gradient where the update reads it: the slice's (stages 2 and 3, and stage
    /// 1's fp32 copy), else the parameter's own (None: it has none).
    fn update_grad(&self, piece: &Piece) -> Option<Tensor> {
        match &self.grad {
            Some(slice) => Some(self.slice_of(slice, &piece.flat)),
            None => self.grad_piece(piece),
        }
    }

    /// The piece's values the update writes: the master slice's, or the parameter's own.
    fn update_param(&self, piece: &Piece) -> Tensor {
        match &self.master {
            Some(m) => self.slice_of(m, &piece.flat),
            None => self.param_piece(piece),
        }
    }

    /// Muon's update of the slice's pieces of its matrices: the momentum and the Nesterov
    /// update of each piece, the matrices orthogonalized by their owners (a collective of the
    /// shard group), each piece's result applied.
    fn muon_step(&self, lr: f64, pg: &mut dyn ProcessGroup) -> Result<()> {
        let Some(m) = &self.muon else {
            return Ok(());
        };
        let count = m.orthogonal.matrices().len();
        // The Muon parameters are the flat layout's first, so a piece's parameter position is
        // its matrix's index.
        let pieces: Vec<&Piece> = self.pieces.iter().filter(|p| p.param < count).collect();
        let mut updates: Vec<Option<Tensor>> = (0..count).map(|_| None).collect();
        for piece in &pieces {
            let grad = self.update_grad(piece);
            let buffer = self.momentum.at(&piece.flat);
            updates[piece.param] = Some(muon::nesterov(&buffer, grad.as_ref(), m.hp.momentum));
        }
        let results = m.orthogonal.run(pg, &updates)?;
        for (piece, o) in pieces.iter().zip(results) {
            let whole = m.orthogonal.matrices()[piece.param].whole;
            let adjusted = m.hp.adjusted_lr(lr, whole);
            muon::apply(&self.update_param(piece), &o, lr, adjusted, &m.hp)?;
        }
        Ok(())
    }

    /// One update of this rank's slice (Muon's pieces, then AdamW's); at stages 1 and 2 then
    /// the all-gather of every rank's updated slice into the working parameters.
    pub fn step(&mut self, lr: f64, pg: &mut dyn ProcessGroup) -> Result<()> {
        self.step += 1;
        if let (ZeroStage::Optimizer, Some(slice)) = (self.stage, &self.grad) {
            // Stage 1 with non-fp32 parameters: the update reads an fp32 copy.
            tch::no_grad(|| {
                let _ = slice.shallow_clone().zero_();
                for piece in &self.pieces {
                    if let Some(g) = self.grad_piece(piece) {
                        self.slice_of(slice, &piece.flat).copy_(&g);
                    }
                }
            });
        }
        self.muon_step(lr, pg)?;
        for rule in [Rule::Decay, Rule::Plain] {
            let mut group: [Vec<Tensor>; 4] = Default::default();
            let mut steps = Vec::new();
            for (piece, count) in self.pieces.iter().zip(&self.step_counts) {
                if self.layout.params[piece.param].group != rule.group() {
                    continue;
                }
                let Some(grad) = self.update_grad(piece) else {
                    continue; // no gradient, no update (as replicated AdamW)
                };
                let _ = count.shallow_clone().fill_(self.step as f64);
                group[0].push(self.update_param(piece));
                group[1].push(grad);
                group[2].push(self.exp_avg.at(&piece.flat));
                group[3].push(self.exp_avg_sq.at(&piece.flat));
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
            fused_adamw(&tensors, lr, &self.adamw, rule == Rule::Decay)?;
        }
        if self.stage.shards_parameters() {
            return Ok(());
        }
        let own = |piece: &Piece| self.update_param(piece);
        self.gather(pg, self.working, own, |piece, src| {
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
        for bucket in self.layout.buckets(self.bucket) {
            let flat = Tensor::zeros([bucket.len() as i64], (kind, self.device));
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
            let splits = self.layout.splits(&bucket);
            on_group(self.shard.as_ref(), pg, |g| {
                g.all_gather_tensor(&flat, &splits)
            })?;
            for piece in self.layout.pieces(bucket.clone()) {
                place(&piece, &at(&piece.flat));
            }
        }
        Ok(())
    }

    /// Drops the parameters' gradients and zeroes the gradient slice the next step's
    /// reduce-scatters add into.
    pub fn zero_grad(&mut self) {
        drop_grads(self.params.iter().map(|(_, p)| p));
        if let (true, Some(slice)) = (self.stage.shards_gradients(), &self.grad) {
            let _ = slice.shallow_clone().zero_();
        }
    }

    /// Full fp32 tensors of the parameters at the flat positions `wanted` (in that order),
    /// filled by a collective gather of `slice` (a [S] buffer); only those are allocated.
    fn gather_full(
        &self,
        pg: &mut dyn ProcessGroup,
        slice: &Tensor,
        wanted: &[usize],
    ) -> Result<Vec<Tensor>> {
        let mut out: HashMap<usize, Tensor> = wanted
            .iter()
            .map(|&at| {
                let shape = &self.shapes[self.layout.params[at].index];
                let t = Tensor::zeros(shape.as_slice(), (Kind::Float, self.device));
                (at, t)
            })
            .collect();
        let own = |piece: &Piece| self.slice_of(slice, &piece.flat);
        self.gather(pg, Kind::Float, own, |piece, src| {
            if let Some(dst) = out.get_mut(&piece.param) {
                let (start, len) = (piece.local.start as i64, piece.local.len() as i64);
                tch::no_grad(|| dst.view(-1).narrow(0, start, len).copy_(src));
            }
        })?;
        Ok(wanted
            .iter()
            .map(|at| out.remove(at).expect("allocated above"))
            .collect())
    }

    /// Every parameter's full values from `slice`, in the caller's order.
    fn gather_all(&self, pg: &mut dyn ProcessGroup, slice: &Tensor) -> Result<Vec<Tensor>> {
        let in_caller_order = self.layout.positions();
        self.gather_full(pg, slice, &in_caller_order)
    }

    /// Every parameter's full averaged gradient, in the caller's order (for the NaN/Inf report
    /// and dump). A collective at stages 2 and 3, where the gradients only exist as slices.
    pub fn full_gradients(&self, pg: &mut dyn ProcessGroup) -> Result<Vec<Tensor>> {
        match (self.stage.shards_gradients(), &self.grad) {
            (true, Some(slice)) => self.gather_all(pg, slice),
            _ => Ok(self.params.iter().map(|(_, p)| p.grad()).collect()),
        }
    }

    /// Every parameter's full values, in the caller's order (for the NaN/Inf report and dump).
    /// A collective at stage 3, where the parameters only exist as slices (fp32 masters).
    pub fn full_parameters(&self, pg: &mut dyn ProcessGroup) -> Result<Vec<Tensor>> {
        match (self.stage.shards_parameters(), &self.master) {
            (true, Some(master)) => self.gather_all(pg, master),
            _ => Ok(self.params.iter().map(|(_, p)| p.detach()).collect()),
        }
    }

    /// What this rank writes into a checkpoint: the full fp32 values of the parameters whose
    /// first element it owns (from the working parameters when they are fp32 and whole; else
    /// gathered from the masters, a collective every rank must call), and its moments, one
    /// piece per parameter it owns part of.
    pub fn state(&self, pg: &mut dyn ProcessGroup) -> Result<RankState> {
        let mine: Vec<usize> = (0..self.layout.params.len())
            .filter(|&i| self.layout.writer(&self.layout.params[i]) == self.rank)
            .collect();
        let weights = match self.master.as_ref() {
            // Without masters the working parameters are fp32 and are the masters.
            None => mine
                .iter()
                .map(|&i| {
                    let p = &self.layout.params[i];
                    (p.name.clone(), self.params[p.index].1.detach())
                })
                .collect(),
            Some(master) => {
                let full = self.gather_full(pg, master, &mine)?;
                mine.iter()
                    .map(|&i| self.layout.params[i].name.clone())
                    .zip(full)
                    .collect()
            }
        };
        let moments = self
            .pieces
            .iter()
            .map(|piece| MomentPiece {
                name: self.layout.params[piece.param].name.clone(),
                range: piece.local.clone(),
                moments: self.moments(piece),
            })
            .collect();
        Ok(RankState { weights, moments })
    }

    /// A piece's moments by their checkpoint keys (views of this rank's buffers).
    fn moments(&self, piece: &Piece) -> Vec<(&'static str, Tensor)> {
        match self.layout.params[piece.param].group == Rule::Muon.group() {
            true => vec![(MOMENTUM, self.momentum.at(&piece.flat))],
            false => vec![
                (EXP_AVG, self.exp_avg.at(&piece.flat)),
                (EXP_AVG_SQ, self.exp_avg_sq.at(&piece.flat)),
            ],
        }
    }

    /// Restores this rank's part from a checkpoint: the working parameters (whole at stages 1
    /// and 2; at stage 3 they stay empty), the master slice where one is kept, and unless
    /// `weights_only` (`training.reset_optimizer`) the moments of the pieces it owns and the
    /// step count.
    pub fn load(
        &mut self,
        src: &dyn StateSource,
        adam_step: u64,
        weights_only: bool,
    ) -> Result<()> {
        if !self.stage.shards_parameters() {
            for (i, (name, p)) in self.params.iter().enumerate() {
                let w = src.weight(name, &self.shapes[i])?;
                tch::no_grad(|| p.shallow_clone().copy_(&w.to_device(self.device)));
            }
        }
        for piece in &self.pieces {
            let flat = &self.layout.params[piece.param];
            for (key, t) in self.moments(piece).into_iter().filter(|_| !weights_only) {
                let m = src.moment(&flat.name, key, &piece.local)?;
                tch::no_grad(|| t.shallow_clone().copy_(&m.to_device(self.device)));
            }
            if let Some(master) = &self.master {
                let local = src
                    .weight_range(&flat.name, &self.shapes[flat.index], &piece.local)
                    .with_context(|| format!("checkpoint weights: {}", flat.name))?;
                tch::no_grad(|| {
                    self.slice_of(master, &piece.flat)
                        .copy_(&local.to_kind(Kind::Float).to_device(self.device))
                });
            }
        }
        self.step = if weights_only { 0 } else { adam_step };
        Ok(())
    }

    /// Stage 3 built from placeholders: parameter `name`'s initial (or loaded) full value, of
    /// which this rank keeps the pieces it owns in its master slice.
    pub fn set_initial(&self, name: &str, full: &Tensor) -> Result<()> {
        let Some(at) = self.layout.params.iter().position(|p| p.name == name) else {
            anyhow::bail!("internal: no parameter {name} to initialise");
        };
        let master = self.master.as_ref().expect("stage 3 keeps masters");
        anyhow::ensure!(
            full.size() == self.shapes[self.layout.params[at].index],
            "{name}: value of shape {:?}, the model expects {:?}",
            full.size(),
            self.shapes[self.layout.params[at].index]
        );
        let flat = full.reshape(-1);
        tch::no_grad(|| {
            for piece in self.pieces.iter().filter(|p| p.param == at) {
                self.slice_of(master, &piece.flat).copy_(
                    &flat
                        .narrow(0, piece.local.start as i64, piece.local.len() as i64)
                        .to_kind(Kind::Float)
                        .to_device(self.device),
                );
            }
        });
        Ok(())
    }

    /// This rank's bytes by kind. At stage 3 `params` counts the units gathered right now (none
    /// between steps) and `master` the slice, the parameters' one persistent copy.
    pub fn state_bytes(&self) -> StateBytes {
        let bytes = |t: &Tensor| (t.numel() * t.kind().elt_size_in_bytes()) as u64;
        let params: u64 = self.params.iter().map(|(_, p)| bytes(p)).sum();
        let slice = |t: &Option<Tensor>| t.as_ref().map_or(0, bytes);
        // Stage 1 keeps the full gradients (in the parameters' dtype) until the update.
        let full_grads = if self.stage == ZeroStage::Optimizer {
            params
        } else {
            0
        };
        StateBytes {
            params,
            master: slice(&self.master),
            moments: [&self.exp_avg, &self.exp_avg_sq, &self.momentum]
                .iter()
                .map(|r| r.bytes())
                .sum(),
            grads: slice(&self.grad) + full_grads,
        }
    }

    /// Stage 3: the position of `unit` among the units whose parameters are gathered.
    pub fn unit_index(&self, unit: GradUnit) -> Option<usize> {
        self.units.iter().position(|(u, _, _)| *u == unit)
    }

    /// Stage 3: the all-gather of unit `u`'s parameters in the working dtype, as a job for the
    /// communication queue, and where its buffer (the unit's span, every rank's pieces) arrives.
    /// `into`: a buffer of this unit's whose storage was freed ([`crate::sys::storage::free`]
    /// after the unit's forward), gathered into again so that the autograd graph's views of it
    /// see the values; else a new one.
    pub fn gather_job(
        &self,
        u: usize,
        into: Option<Tensor>,
    ) -> Result<(Job, mpsc::Receiver<Tensor>)> {
        let span = &self.units[u].2;
        let buffer = match into {
            Some(b) => {
                crate::sys::storage::alloc(&b)?;
                b
            }
            None => Tensor::empty([span.len() as i64], (self.working, self.device)),
        };
        let master = self.master.as_ref().expect("stage 3 keeps masters");
        tch::no_grad(|| {
            for (piece, at) in span.owned_by(&self.layout, self.rank) {
                buffer
                    .narrow(0, piece.buf.start as i64, piece.buf.len() as i64)
                    .copy_(&master.narrow(0, at as i64, piece.buf.len() as i64));
            }
        });
        let (splits, shard) = (span.splits.clone(), self.shard.clone());
        let (tx, rx) = mpsc::channel();
        let job: Job = Box::new(move |pg| {
            on_group(shard.as_ref(), pg, |g| {
                g.all_gather_tensor(&buffer, &splits)
            })?;
            let _ = tx.send(buffer);
            Ok(())
        });
        Ok((job, rx))
    }

    /// Stage 3: unit `u`'s parameters take their full values from a gathered buffer, as views
    /// of it (each parameter lies whole in the buffer: [`Span::placements`]), so the unit's
    /// parameters cost the buffer and no copy of it.
    pub fn materialize(&self, u: usize, buffer: &Tensor) {
        let span = &self.units[u].2;
        tch::no_grad(|| {
            for (param, start) in span.placements() {
                let i = self.layout.params[param].index;
                let full = buffer
                    .narrow(0, start as i64, self.layout.params[param].numel as i64)
                    .view(self.shapes[i].as_slice());
                self.params[i].1.shallow_clone().set_data(&full);
            }
        });
    }

    /// Stage 3: unit `u`'s parameters let go of their values (reads fail loudly until the next
    /// gather: a 0-element tensor has no shape to misread).
    pub fn release(&self, u: usize) {
        for &i in &self.units[u].1 {
            self.release_param(i);
        }
    }

    fn release_param(&self, i: usize) {
        let empty = Tensor::empty([0], (self.working, self.device));
        tch::no_grad(|| self.params[i].1.shallow_clone().set_data(&empty));
    }
}
