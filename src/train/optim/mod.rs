//! The optimizer of a run: AdamW matching torch.optim.AdamW (decoupled decay `p *= 1 - lr·wd`,
//! bias-corrected moments), or with `training.optimizer = muon` Muon matching torch.optim.Muon
//! on the decoder layers' matrices and AdamW on the rest; global-norm clipping as
//! torch.nn.utils.clip_grad_norm_, and the warmup + cosine schedule, over one of two layouts:
//!
//! - `kernel`: the arithmetic every layout shares (fused AdamW, the norm, clipping, dropping
//!   gradients); depends on nothing else in `train`;
//! - `muon`: Muon's arithmetic and which parameters it takes (`Rule`);
//! - `orthogonal`: Muon's matrices made whole on one rank each for Newton–Schulz;
//! - `replicated`: stage 0, every rank holds everything;
//! - `sharded`: stages 1-3 over the flat layout (`dist::flat_layout`);
//! - `reduce`: where gradients are averaged across ranks as backward finishes them;
//! - `schedule`: the learning rate of each step.
//!
//! [`Optimizer`] is what the step and the checkpointer see: its state goes out through
//! [`Optimizer::state`] and comes back through [`Optimizer::load`], so nothing outside this
//! module reaches inside a layout. The state lives here rather than in libtorch's C++ optimizer
//! so the moments can be checkpointed by parameter name and restored bit for bit.

pub mod experts;
pub mod kernel;
pub mod muon;
pub mod orthogonal;
pub mod reduce;
pub mod replicated;
pub mod schedule;
pub mod sharded;
pub mod state;
pub mod tensor;

use std::collections::VecDeque;
use std::sync::mpsc;

use anyhow::{bail, Result};
use tch::{Kind, Tensor};

pub use experts::ExpertPlace;
pub use kernel::AdamWParams;
pub use muon::{MuonParams, Rule};
pub use schedule::Schedule;
pub use state::{
    Hybrid, MomentPiece, RankState, Sharding, StateBytes, StateSource, TensorGroups, Writers,
    MOMENT_KEYS,
};

use crate::config::ZeroStage;
use crate::dist::overlap::{with_queue, CommQueue};
use crate::dist::{on_group, ProcessGroup, SharedGroup};
use crate::model::{GradUnit, Parameters, UnitEvents};
use orthogonal::{Level, Setup};
use reduce::GradReducer;
use replicated::Replicated;
use sharded::{ShardRanks, Sharded};

/// Parameters by name.
type Named = Vec<(String, Tensor)>;

/// The optimizer's settings: AdamW's, and Muon's with `training.optimizer = muon`.
#[derive(Debug, Clone, Copy)]
pub struct Hyper {
    pub adamw: AdamWParams,
    pub muon: Option<MuonParams>,
}

impl Hyper {
    pub fn from_config(c: &crate::config::Config) -> Hyper {
        Hyper {
            adamw: AdamWParams::from_config(&c.training),
            muon: (c.training.optimizer == crate::config::OptimizerChoice::Muon)
                .then(|| MuonParams::from_config(c)),
        }
    }
}

/// AdamW alone.
impl From<AdamWParams> for Hyper {
    fn from(adamw: AdamWParams) -> Hyper {
        Hyper { adamw, muon: None }
    }
}

/// Expert parallelism: the optimizer of this rank's experts, over the ranks that hold the same
/// experts, and where they sit in the expert-parallel group (experts.rs).
pub struct Experts {
    opt: Optimizer,
    place: ExpertPlace,
}

impl Experts {
    /// The optimizer of the experts at `place`, built by `build` over their holders.
    pub fn new(
        place: ExpertPlace,
        build: impl FnOnce(SharedGroup) -> Result<Optimizer>,
    ) -> Result<Experts> {
        Ok(Experts {
            opt: build(place.over())?,
            place,
        })
    }
}

/// What the layouts need of each parameter, in the caller's order: its shape on this rank,
/// unit, update rule, and whole shape and split.
struct Described {
    shapes: Vec<Vec<i64>>,
    units: Vec<GradUnit>,
    rules: Vec<Rule>,
    whole: Vec<(Vec<i64>, crate::model::Split)>,
}

impl Described {
    /// `params` of `table` on a rank of a tensor group of `parts`, `muon` or AdamW alone.
    fn of(
        params: &[(String, Tensor)],
        table: &Parameters,
        parts: usize,
        muon: bool,
    ) -> Result<Self> {
        let mut d = Described {
            shapes: Vec::with_capacity(params.len()),
            units: Vec::with_capacity(params.len()),
            rules: Vec::with_capacity(params.len()),
            whole: Vec::with_capacity(params.len()),
        };
        for (name, _) in params {
            let p = table.get(name)?;
            d.shapes.push(p.split.local_shape(&p.shape, parts));
            d.units.push(p.unit);
            d.rules.push(Rule::of(p, muon));
            d.whole.push((p.shape.clone(), p.split));
        }
        Ok(d)
    }
}

/// One of the two layouts.
enum Layout {
    Replicated(Box<Replicated>),
    Sharded(Box<Sharded>),
}

/// AdamW (and Muon), replicated (`system.zero_stage = 0`) or sharded (1-3, [`Sharded`]), with the
/// [`GradReducer`] that averages its gradients across ranks during backward. The step
/// (src/train/step.rs) only calls these methods, so it reads the same for every stage.
pub struct Optimizer {
    layout: Layout,
    reducer: GradReducer,
    /// Stage 3: units whose gather is issued ahead of the one in use.
    prefetch: usize,
    /// This rank among the data-parallel ranks, and their number.
    rank: usize,
    world: usize,
    hybrid: Option<Hybrid>,
    tensor: Option<TensorGroups>,
    /// The dtype gradients travel in.
    reduce: Kind,
    /// Expert parallelism: the optimizer of this rank's experts (`experts.rs`).
    experts: Option<Box<Experts>>,
}

impl Optimizer {
    /// `stage` 0 → replicated; 1-3 → sharded over `pg`'s ranks, for the parameters `params`
    /// of the model whose table is `table` (their units and splits; the parameters hold their
    /// whole values). The parameters (fp32) must already be identical on every rank (the
    /// sharded masters are copied from them). `compute` is the matmul dtype: sharded with bf16
    /// compute, the working parameters become bf16 and the fp32 masters live only in the
    /// slices; replicated keeps fp32 parameters and casts.
    pub fn new(
        params: &[(String, Tensor)],
        table: &Parameters,
        hp: Hyper,
        stage: ZeroStage,
        pg: &dyn ProcessGroup,
        bucket_mb: f64,
        compute: Kind,
    ) -> Result<Optimizer> {
        let sharding = Sharding {
            stage,
            hybrid: None,
            reduce: Kind::Float,
            tensor: None,
        };
        Self::with_sharding(params, table, hp, sharding, pg, bucket_mb, compute)
    }

    /// [`Optimizer::new`] sharded as `sharding` says: the parameters are this rank's parts of
    /// the table's (with tensor parallelism), of the shapes the table gives them, and at stage
    /// 3 may be empty placeholders (`Llama::new_with`), given their values one at a time by
    /// [`Optimizer::set_initial`]. With `sharding.hybrid` the state is sharded inside this
    /// rank's shard group and replicated across the groups.
    pub fn with_sharding(
        params: &[(String, Tensor)],
        table: &Parameters,
        hp: Hyper,
        sharding: Sharding,
        pg: &dyn ProcessGroup,
        bucket_mb: f64,
        compute: Kind,
    ) -> Result<Optimizer> {
        Self::over(params, table, hp, (sharding, None), pg, bucket_mb, compute)
    }

    /// [`Optimizer::with_sharding`] over the data-parallel ranks `data` where given (expert
    /// parallelism's holders of the same experts), else the tensor groups' or `pg`'s.
    fn over(
        params: &[(String, Tensor)],
        table: &Parameters,
        hp: Hyper,
        (sharding, data): (Sharding, Option<SharedGroup>),
        pg: &dyn ProcessGroup,
        bucket_mb: f64,
        compute: Kind,
    ) -> Result<Optimizer> {
        let parts = match &sharding.tensor {
            Some(t) => t.place()?.1,
            None => 1,
        };
        let Described {
            shapes,
            units,
            rules,
            whole,
        } = Described::of(params, table, parts, hp.muon.is_some())?;
        let Sharding {
            stage,
            hybrid,
            reduce,
            tensor,
        } = sharding;
        let named: Vec<(String, Tensor)> = params
            .iter()
            .map(|(n, p)| (n.clone(), p.shallow_clone()))
            .collect();
        // The data-parallel ranks: the group given, or with tensor parallelism its data group.
        let data = tensor.as_ref().map(|t| t.data.clone()).or(data);
        let (rank, world) = match &data {
            Some(g) => {
                let g = g.lock().map_err(|_| anyhow::anyhow!("poisoned subgroup"))?;
                (g.rank(), g.world_size())
            }
            None => (pg.rank(), pg.world_size()),
        };
        let shard = hybrid.as_ref().map(|h| h.shard.clone()).or(data.clone());
        // Muon's settings and groups, where it has matrices here: level 1 is the layout's
        // (`orthogonal.rs`), level 2 the tensor group.
        let tensor_level = tensor.as_ref().map(TensorGroups::level).transpose()?;
        let device = params.first().map_or(tch::Device::Cpu, |(_, p)| p.device());
        let muon = |data: Level| {
            let hp = hp.muon.filter(|_| rules.contains(&Rule::Muon))?;
            Some(Setup {
                hp,
                device,
                whole: whole.clone(),
                data,
                tensor: tensor_level.clone(),
            })
        };
        let (layout, reducer) = match stage {
            ZeroStage::Replicated => {
                anyhow::ensure!(
                    hybrid.is_none(),
                    "system.shard_degree shards state at zero_stage >= 1; at zero_stage = 0 \
                     every rank holds everything (set system.zero_stage, or shard_degree = 0)"
                );
                let level = Level {
                    group: data.clone(),
                    rank,
                    size: world,
                };
                let muon = muon(level);
                (
                    Layout::Replicated(Box::new(Replicated::new(named, &rules, hp.adamw, muon))),
                    GradReducer::all_reduce(params, &units, (world, data), bucket_mb, reduce),
                )
            }
            _ => {
                let ranks = ShardRanks::of(shard, (rank, world))?;
                let level = Level {
                    group: ranks.group.clone(),
                    rank: ranks.rank,
                    size: ranks.world,
                };
                let members = sharded::Members {
                    named,
                    shapes,
                    units: &units,
                    rules: &rules,
                };
                let hp = (hp.adamw, muon(level));
                let sharded = Sharded::new(members, hp, stage, ranks, bucket_mb, compute);
                let reducer = if stage.shards_gradients() {
                    GradReducer::reduce_scatter(params, &sharded, reduce)
                } else {
                    GradReducer::all_reduce(params, &units, (world, data), bucket_mb, reduce)
                };
                (Layout::Sharded(Box::new(sharded)), reducer)
            }
        };
        Ok(Optimizer {
            layout,
            reducer,
            prefetch: 1,
            rank,
            world,
            hybrid,
            tensor,
            reduce,
            experts: None,
        })
    }

    /// Expert parallelism: `experts` (the optimizer of this rank's experts, over their holders)
    /// beside this one (of every other parameter).
    pub fn with_experts(mut self, experts: Experts) -> Optimizer {
        self.experts = Some(Box::new(experts));
        self
    }

    /// An optimizer of `params` as [`Optimizer::with_sharding`] over the ranks of `data`
    /// alone (expert parallelism's holders of the same experts), with `hybrid` sharding among
    /// them where given, and with tensor parallelism `tensor` (whose data group is `data`: the
    /// parts are made whole over its tensor group as the other parameters' are).
    pub fn over_group(
        params: &[(String, Tensor)],
        table: &Parameters,
        hp: Hyper,
        ((stage, reduce), hybrid, tensor): (
            (ZeroStage, Kind),
            Option<Hybrid>,
            Option<TensorGroups>,
        ),
        data: SharedGroup,
        pg: &dyn ProcessGroup,
        (bucket_mb, compute): (f64, Kind),
    ) -> Result<Optimizer> {
        let sharding = Sharding {
            stage,
            hybrid,
            reduce,
            tensor,
        };
        Self::over(
            params,
            table,
            hp,
            (sharding, Some(data)),
            pg,
            bucket_mb,
            compute,
        )
    }

    /// The optimizers of this run: this one, and with expert parallelism its experts'.
    fn parts(&self) -> impl Iterator<Item = &Optimizer> {
        std::iter::once(self).chain(self.experts.as_deref().map(|e| &e.opt))
    }

    /// Whether `name` is one of the experts' (expert parallelism).
    fn is_expert(&self, name: &str) -> bool {
        self.experts.as_ref().is_some_and(|e| e.place.holds(name))
    }

    /// The gradients the update reads: the parameters' own, or the gradient slice at stages
    /// 2 and 3.
    fn update_gradients(&self) -> Vec<Tensor> {
        match &self.layout {
            Layout::Replicated(o) => o.gradients(),
            Layout::Sharded(o) => match o.grad_slice() {
                Some(slice) if o.stage.shards_gradients() => vec![slice],
                _ => o.gradients(),
            },
        }
    }

    /// Payload bytes this rank has sent so far over `pg` and the subgroups the optimizer and
    /// the model use (hybrid sharding's, tensor parallelism's), where the backends count them.
    pub fn bytes_sent(&self, pg: &dyn ProcessGroup) -> Option<u64> {
        let mut groups: Vec<&SharedGroup> = Vec::new();
        if let Some(h) = &self.hybrid {
            groups.extend([&h.shard, &h.replica]);
        }
        if let Some(t) = &self.tensor {
            groups.extend([&t.data, &t.tensor]);
        }
        if let Some(e) = &self.experts {
            groups.extend(e.place.groups());
        }
        groups.into_iter().try_fold(pg.bytes_sent()?, |sum, g| {
            Some(sum + g.lock().ok()?.bytes_sent()?)
        })
    }

    /// `system.prefetch_units` (stage 3).
    pub fn with_prefetch(mut self, units: usize) -> Optimizer {
        self.prefetch = units;
        self
    }

    /// Stage 3 built from placeholders: parameter `name`'s initial value (this rank keeps its
    /// slice).
    pub fn set_initial(&self, name: &str, full: &Tensor) -> Result<()> {
        if let Some(e) = self.experts.as_ref().filter(|e| e.place.holds(name)) {
            return e.opt.set_initial(name, full);
        }
        match &self.layout {
            Layout::Sharded(o) if o.stage.shards_parameters() => o.set_initial(name, full),
            _ => bail!("internal: initial values one at a time are for zero stage 3"),
        }
    }

    pub fn stage(&self) -> ZeroStage {
        match &self.layout {
            Layout::Replicated(_) => ZeroStage::Replicated,
            Layout::Sharded(o) => o.stage,
        }
    }

    /// Completed optimizer steps.
    pub fn steps(&self) -> u64 {
        match &self.layout {
            Layout::Replicated(o) => o.step,
            Layout::Sharded(o) => o.step,
        }
    }

    /// Runs `work`, a pass over the model (`order`: the units in the order it uses them,
    /// `Llama::unit_order`), with the [`UnitEvents`] of this optimizer: at stage 3 each unit's
    /// parameters are all-gathered before its use and emptied after, the gathers of the next
    /// `system.prefetch_units` units running ahead; with `reduce`, each unit's gradients are
    /// averaged across ranks as soon as they are final. The collectives run on a communication
    /// thread (`overlap`) or in the same order on this one.
    pub fn pass<T>(
        &self,
        pg: &mut dyn ProcessGroup,
        overlap: bool,
        order: &[GradUnit],
        reduce: bool,
        work: impl FnOnce(&mut dyn UnitEvents) -> Result<T>,
    ) -> Result<T> {
        with_queue(pg, overlap, |queue| {
            let mut events = Events {
                opt: self,
                layouts: gatherers(self),
                queue,
                reduce,
                order,
                next: 0,
                issued: 0,
                pending: VecDeque::new(),
                live: Vec::new(),
                freed: Vec::new(),
            };
            work(&mut events)
        })
    }

    /// What the reductions during backward leave to the end of the step's passes: with hybrid
    /// sharding, the gradient slices (reduce-scattered inside each shard group) averaged across
    /// the replica group, so every rank ends with the world's mean; with sequence parallelism,
    /// the norm weights' gradients added across the tensor group (`add_partial_gradients`).
    pub fn finish_reduction(&self) -> Result<()> {
        self.average_replicas()?;
        self.add_partial_gradients()?;
        if let Some(e) = &self.experts {
            e.opt.finish_reduction()?;
            e.place.divide(e.opt.update_gradients());
        }
        Ok(())
    }

    fn average_replicas(&self) -> Result<()> {
        match (&self.layout, &self.hybrid) {
            (Layout::Sharded(o), Some(h)) if o.stage.shards_gradients() => {
                let slice = o
                    .grad_slice()
                    .expect("stages 2 and 3 keep a gradient slice");
                let mut replica = h
                    .replica
                    .lock()
                    .map_err(|_| anyhow::anyhow!("a replica-group collective panicked earlier"))?;
                if self.reduce == Kind::Float {
                    return replica.all_reduce_avg_tensor(&slice);
                }
                let sent = slice.to_kind(self.reduce);
                replica.all_reduce_avg_tensor(&sent)?;
                tch::no_grad(|| slice.shallow_clone().copy_(&sent));
                Ok(())
            }
            _ => Ok(()),
        }
    }

    /// The gradients of whole parameters that each rank of a tensor group computed a part of
    /// (`TensorGroups::partial`: with sequence parallelism the norms from its own tokens, and
    /// always a head's norm from its own heads): the step's gradient is their sum over the
    /// group (summed after the data-parallel mean, which commutes with it). The gradients of
    /// the whole parameters at stages 0 and 1, this rank's slice's pieces of them at stages 2
    /// and 3: the ranks of a tensor group hold equal parts of every layer, so their slices line
    /// up.
    fn add_partial_gradients(&self) -> Result<()> {
        let Some(t) = self.tensor.as_ref() else {
            return Ok(());
        };
        let grads = match &self.layout {
            Layout::Replicated(o) => o
                .params
                .iter()
                .filter(|p| t.partial(&p.name))
                .map(|p| p.param.grad())
                .filter(Tensor::defined)
                .collect(),
            Layout::Sharded(o) => o.gradient_pieces(|name| t.partial(name)),
        };
        if grads.is_empty() {
            return Ok(());
        }
        let flat = crate::dist::buckets::flatten(&grads).to_kind(Kind::Float);
        let mut unused = crate::dist::SingleProcess;
        on_group(Some(&t.tensor), &mut unused, |g| {
            g.all_reduce_sum_tensor(&flat)
        })?;
        crate::dist::buckets::unflatten(&flat, &grads);
        Ok(())
    }

    /// `debug.inject_nan_param`, after the reduction so that every rank agrees (with tensor
    /// parallelism into the first element of the whole parameter: rank 0's part of a split
    /// one, every rank's copy of a whole one).
    pub fn poison_gradient(&self, name: &str) {
        if let Some(e) = self.experts.as_ref().filter(|e| e.place.holds(name)) {
            return e.opt.poison_gradient(name);
        }
        if let Some(t) = &self.tensor {
            let first = t.place().is_ok_and(|(rank, _)| rank == 0);
            if !first && !t.replicated(name) {
                return;
            }
        }
        match &self.layout {
            Layout::Replicated(o) => o.poison_gradient(name),
            Layout::Sharded(o) => o.poison_gradient(name),
        }
    }

    /// The global gradient norm (before clipping), the same at every stage: squares summed in
    /// fp64 (`kernel::sum_of_squares`), across ranks in rank order where they are sharded.
    pub fn grad_norm(&self, pg: &mut dyn ProcessGroup) -> Result<f64> {
        let mut sum = self.grad_sum_of_squares(pg)?;
        if let Some(e) = &self.experts {
            sum += e.place.sum_over_group(e.opt.grad_sum_of_squares(pg)?)?;
        }
        Ok(kernel::norm_of(sum))
    }

    /// The squares of this layout's gradients summed over its ranks (fp64), each element
    /// once.
    fn grad_sum_of_squares(&self, pg: &mut dyn ProcessGroup) -> Result<f64> {
        if let Some(t) = &self.tensor {
            return self.split_grad_sums(t, pg);
        }
        match &self.layout {
            Layout::Replicated(o) => Ok(kernel::sum_of_squares(&o.gradients())),
            Layout::Sharded(o) => o.grad_sum_of_squares(pg),
        }
    }

    /// The global norm of a tensor-parallel model, each element counted once over the mesh:
    /// the squares of the split parameters' gradients summed over the data ranks, then over the
    /// tensor group (in rank order); those of the whole ones (the norms, equal on every rank of
    /// the tensor group) once.
    fn split_grad_sums(&self, t: &TensorGroups, pg: &mut dyn ProcessGroup) -> Result<f64> {
        let split = |name: &str| !t.replicated(name);
        let (parts, whole) = match &self.layout {
            Layout::Replicated(o) => {
                let of = |want: bool| -> Vec<Tensor> {
                    o.params
                        .iter()
                        .filter(|p| split(&p.name) == want)
                        .map(|p| p.param.grad())
                        .collect()
                };
                (
                    kernel::sum_of_squares(&of(true)),
                    kernel::sum_of_squares(&of(false)),
                )
            }
            Layout::Sharded(o) => o.grad_sums(pg, split)?,
        };
        let mut unused = crate::dist::SingleProcess;
        let parts: f64 = on_group(Some(&t.tensor), &mut unused, |g| g.all_gather_f64(parts))?
            .into_iter()
            .sum();
        Ok(parts + whole)
    }

    /// clip_grad_norm_'s scaling with the norm from [`Optimizer::grad_norm`].
    pub fn clip(&self, norm: f64, max_norm: f64) {
        for part in self.parts() {
            match &part.layout {
                Layout::Replicated(o) => kernel::clip_to(&o.gradients(), norm, max_norm),
                Layout::Sharded(o) => o.clip(norm, max_norm),
            }
        }
    }

    /// The update (sharded: of this rank's slice, then at stages 1 and 2 the all-gather of
    /// the parameters).
    pub fn step(&mut self, lr: f64, pg: &mut dyn ProcessGroup) -> Result<()> {
        if let Some(e) = &mut self.experts {
            e.opt.step(lr, pg)?;
        }
        match &mut self.layout {
            Layout::Replicated(o) => o.step(lr, pg),
            Layout::Sharded(o) => o.step(lr, pg),
        }
    }

    pub fn zero_grad(&mut self) {
        if let Some(e) = &mut self.experts {
            e.opt.zero_grad();
        }
        match &mut self.layout {
            Layout::Replicated(o) => o.zero_grad(),
            Layout::Sharded(o) => o.zero_grad(),
        }
    }

    /// Every parameter's full averaged gradient in `params`' order (a collective at stages 2
    /// and 3).
    pub fn full_gradients(
        &self,
        params: &[(String, Tensor)],
        pg: &mut dyn ProcessGroup,
    ) -> Result<Vec<Tensor>> {
        if let Some(e) = &self.experts {
            let (dense, experts) = self.split_list(params);
            let d = self.layout_full_gradients(&dense, pg)?;
            let x = e.opt.full_gradients(&experts, pg)?;
            return Ok(experts::merged(params, |n| self.is_expert(n), d, x));
        }
        self.layout_full_gradients(params, pg)
    }

    /// What the NaN/Inf report inspects and dumps: every parameter of `params` with its full
    /// value, and its full averaged gradient aligned with it; with expert parallelism the
    /// other positions' experts after them, so an expert is named whatever rank holds it.
    /// Collectives of every rank (gathers at stages 2 and 3, the experts' broadcasts).
    pub fn evidence(
        &self,
        params: &[(String, Tensor)],
        pg: &mut dyn ProcessGroup,
    ) -> Result<(Named, Vec<Tensor>)> {
        let mut grads = self.full_gradients(params, pg)?;
        let mut values = self.full_parameters(params, pg)?;
        let Some(e) = &self.experts else {
            return Ok((values, grads));
        };
        let own: Vec<usize> = (0..params.len())
            .filter(|&i| self.is_expert(&params[i].0))
            .collect();
        // Named by their full values, whose shapes a parameter's placeholder at stage 3 lacks.
        let mine: Named = own
            .iter()
            .map(|&i| (params[i].0.clone(), values[i].1.shallow_clone()))
            .collect();
        let own_values: Vec<Tensor> = own.iter().map(|&i| values[i].1.shallow_clone()).collect();
        let own_grads: Vec<Tensor> = own.iter().map(|&i| grads[i].shallow_clone()).collect();
        let others = e.place.other_positions(&mine, &own_values)?;
        let other_grads = e.place.other_positions(&mine, &own_grads)?;
        grads.extend(other_grads.into_iter().map(|(_, g)| g));
        values.extend(others);
        Ok((values, grads))
    }

    /// `params` cut into this layout's and the experts'.
    fn split_list(&self, params: &[(String, Tensor)]) -> (Named, Named) {
        params
            .iter()
            .map(|(n, p)| (n.clone(), p.shallow_clone()))
            .partition(|(n, _)| !self.is_expert(n))
    }

    /// [`Optimizer::full_gradients`] of this layout's parameters.
    fn layout_full_gradients(
        &self,
        params: &[(String, Tensor)],
        pg: &mut dyn ProcessGroup,
    ) -> Result<Vec<Tensor>> {
        let grads = match &self.layout {
            Layout::Replicated(_) => params.iter().map(|(_, p)| p.grad()).collect(),
            Layout::Sharded(o) => o.full_gradients(pg)?,
        };
        self.whole_values(params, grads)
    }

    /// With tensor parallelism, `values` of `params`' parts as whole tensors (a collective of
    /// the tensor group, whose ranks have the same gradients defined).
    fn whole_values(
        &self,
        params: &[(String, Tensor)],
        values: Vec<Tensor>,
    ) -> Result<Vec<Tensor>> {
        let Some(t) = &self.tensor else {
            return Ok(values);
        };
        params
            .iter()
            .zip(values)
            .map(|((name, _), v)| match v.defined() {
                true => Ok(t.whole(&[(name.clone(), v)])?.remove(0)),
                false => Ok(v),
            })
            .collect()
    }

    /// Every parameter's full values in `params`' order (a collective at stage 3).
    pub fn full_parameters(
        &self,
        params: &[(String, Tensor)],
        pg: &mut dyn ProcessGroup,
    ) -> Result<Vec<(String, Tensor)>> {
        if let Some(e) = &self.experts {
            let (dense, experts) = self.split_list(params);
            let values = |list: Vec<(String, Tensor)>| list.into_iter().map(|(_, t)| t).collect();
            let d = values(self.layout_full_parameters(&dense, pg)?);
            let x = values(e.opt.full_parameters(&experts, pg)?);
            let all = experts::merged(params, |n| self.is_expert(n), d, x);
            return Ok(params.iter().map(|(n, _)| n.clone()).zip(all).collect());
        }
        self.layout_full_parameters(params, pg)
    }

    /// [`Optimizer::full_parameters`] of this layout's parameters.
    fn layout_full_parameters(
        &self,
        params: &[(String, Tensor)],
        pg: &mut dyn ProcessGroup,
    ) -> Result<Vec<(String, Tensor)>> {
        let values = match &self.layout {
            Layout::Replicated(_) => params.iter().map(|(_, p)| p.detach()).collect(),
            Layout::Sharded(o) => o.full_parameters(pg)?,
        };
        let values = self.whole_values(params, values)?;
        Ok(params.iter().map(|(n, _)| n.clone()).zip(values).collect())
    }

    /// This rank's bytes of parameters, master weights, moments and gradients.
    pub fn state_bytes(&self) -> StateBytes {
        let dense = match &self.layout {
            Layout::Replicated(o) => o.state_bytes(),
            Layout::Sharded(o) => o.state_bytes(),
        };
        match &self.experts {
            Some(e) => experts::added(dense, e.opt.state_bytes()),
            None => dense,
        }
    }

    /// Who writes what into a checkpoint. Every rank writes a part, so that write bandwidth
    /// grows with the ranks: sharded, the rank whose slice holds a parameter's first element
    /// (in the first shard group); replicated, the parameters cut into `world` contiguous
    /// parts of about equal size in Hugging Face order, by the same rule. One rank alone
    /// writes the plain `model.safetensors` + `optimizer.safetensors`.
    pub fn writers(&self) -> Writers {
        // With expert parallelism every position's experts among the replicas' numbering
        // (holder h of position p is replica h·E + p), then the replicas' spread over the mesh.
        let writers = match &self.experts {
            Some(e) => e
                .place
                .writers(self.layout_writers(), e.opt.layout_writers()),
            None => self.layout_writers(),
        };
        let Some(t) = &self.tensor else {
            return writers;
        };
        // With tensor parallelism the data ranks' numbering spreads over the mesh: data rank
        // d's tensor group is world ranks d·T..(d+1)·T, of which the first writes the whole
        // weights (`tensor::whole_state`) and every one its optimizer file.
        let (rank, size) = t.place().unwrap_or((0, 1));
        Writers {
            params: writers
                .params
                .into_iter()
                .map(|(name, w, numel)| {
                    let whole = t.parameters.get(&name).map_or(numel, |p| p.numel());
                    (name, w * size, whole)
                })
                .collect(),
            world: writers.world * size,
            sharded: true,
            stage: writers.stage,
            this: writers.this.map(|w| w * size + rank),
        }
    }

    /// [`Optimizer::writers`] among the data-parallel ranks.
    fn layout_writers(&self) -> Writers {
        match &self.layout {
            Layout::Replicated(o) => {
                let numels: Vec<usize> = o.params.iter().map(|p| p.param.numel()).collect();
                let total: usize = numels.iter().sum();
                let share = total.div_ceil(self.world).max(1);
                let mut start = 0;
                let params = o
                    .params
                    .iter()
                    .zip(&numels)
                    .map(|(p, &n)| {
                        let writer = (start / share).min(self.world - 1);
                        start += n;
                        (p.name.clone(), writer, n)
                    })
                    .collect();
                Writers {
                    params,
                    world: self.world,
                    sharded: self.world > 1,
                    stage: ZeroStage::Replicated,
                    this: Some(self.rank),
                }
            }
            Layout::Sharded(o) => Writers {
                params: o
                    .layout
                    .params
                    .iter()
                    .map(|p| (p.name.clone(), o.layout.writer(p), p.numel))
                    .collect(),
                world: o.layout.world,
                sharded: true,
                stage: o.stage,
                this: self.writes().then_some(o.rank),
            },
        }
    }

    /// Whether this rank writes into checkpoints: every rank, except with hybrid sharding,
    /// where the first shard group writes (the others hold the same state).
    fn writes(&self) -> bool {
        match &self.hybrid {
            Some(h) => h.index == 0,
            None => true,
        }
    }

    /// What this rank writes into a checkpoint (a collective of the shard group where master
    /// weights are gathered); nothing where it writes nothing.
    pub fn state(&self, pg: &mut dyn ProcessGroup) -> Result<RankState> {
        let local = self.layout_state(pg)?;
        let state = match &self.tensor {
            Some(t) => t.whole_state(local)?,
            None => local,
        };
        match &self.experts {
            Some(e) => Ok(experts::joined(state, e.opt.state(pg)?)),
            None => Ok(state),
        }
    }

    /// [`Optimizer::state`] in the layout's own coordinates (with tensor parallelism, this
    /// rank's parts).
    fn layout_state(&self, pg: &mut dyn ProcessGroup) -> Result<RankState> {
        if !self.writes() {
            return Ok(RankState {
                weights: Vec::new(),
                moments: Vec::new(),
            });
        }
        match &self.layout {
            Layout::Replicated(o) => {
                let writers = self.layout_writers();
                let owned: std::collections::HashSet<&str> = writers
                    .params
                    .iter()
                    .filter(|(_, w, _)| *w == self.rank)
                    .map(|(n, _, _)| n.as_str())
                    .collect();
                let mine = |name: &str| owned.contains(name);
                let all = o.state();
                Ok(RankState {
                    weights: all.weights.into_iter().filter(|(n, _)| mine(n)).collect(),
                    moments: all.moments.into_iter().filter(|m| mine(&m.name)).collect(),
                })
            }
            Layout::Sharded(o) => o.state(pg),
        }
    }

    /// Restores parameters, masters, moments and the step count from a checkpoint of any
    /// stage and world size; with `weights_only` (`training.reset_optimizer`) the parameters
    /// and masters alone, the optimizer starting afresh.
    pub fn load(
        &mut self,
        src: &dyn StateSource,
        adam_step: u64,
        weights_only: bool,
    ) -> Result<()> {
        if let Some(e) = &mut self.experts {
            e.opt.load(src, adam_step, weights_only)?;
        }
        let parts;
        let src = match &self.tensor {
            Some(t) => {
                parts = t.source(src)?;
                &parts as &dyn StateSource
            }
            None => src,
        };
        match &mut self.layout {
            Layout::Replicated(o) => o.load(src, adam_step, weights_only),
            Layout::Sharded(o) => o.load(src, adam_step, weights_only),
        }
    }
}

/// The [`UnitEvents`] of one pass ([`Optimizer::pass`]).
struct Events<'o, 'q, 'a> {
    opt: &'o Optimizer,
    /// Stage 3: the layouts that gather (`gatherers`; empty below stage 3).
    layouts: Vec<&'o Sharded>,
    queue: &'q mut CommQueue<'a>,
    reduce: bool,
    /// Stage 3: the units in the order of their `before`, the position of the next one, how
    /// far the gathers have been issued, and those not yet taken (position, and each
    /// gathering layout's).
    order: &'o [GradUnit],
    next: usize,
    issued: usize,
    pending: VecDeque<(usize, Vec<Arriving>)>,
    /// Stage 3: the gathered buffer of each unit in use, by unit and layout (its parameters
    /// are views of it).
    live: Vec<(Held, Tensor)>,
    /// Stage 3: buffers of units used again later in the pass, their storage freed after the
    /// unit's use. The autograd graph of a unit's forward (no activation checkpointing) keeps
    /// views of its parameters, which share the buffer's storage: freed, they hold nothing
    /// until the unit's next gather fills the same storage again (torch FSDP's
    /// `_free_storage` / `_alloc_storage`).
    freed: Vec<(Held, Tensor)>,
}

/// A unit's buffer of one gathering layout: the unit, and the layout's index in
/// [`gatherers`] (with expert parallelism a decoder layer of a mixture has two: the experts'
/// gathered over their holders, the rest over the replicas).
type Held = (GradUnit, usize);

/// A gather in flight: the layout's index in [`gatherers`], and where its buffer arrives.
type Arriving = (usize, mpsc::Receiver<Tensor>);

/// Takes `key`'s entry out of a list of buffers.
fn take(list: &mut Vec<(Held, Tensor)>, key: Held) -> Option<Tensor> {
    let at = list.iter().position(|(k, _)| *k == key)?;
    Some(list.swap_remove(at).1)
}

/// Stage 3's sharded layouts (the optimizer's, and with expert parallelism its experts'),
/// none below stage 3.
fn gatherers(opt: &Optimizer) -> Vec<&Sharded> {
    opt.parts()
        .filter_map(|part| match &part.layout {
            Layout::Sharded(o) if o.stage.shards_parameters() => Some(o.as_ref()),
            _ => None,
        })
        .collect()
}

impl UnitEvents for Events<'_, '_, '_> {
    fn before(&mut self, unit: GradUnit) -> Result<()> {
        if self.layouts.is_empty() {
            return Ok(());
        }
        if self.order.get(self.next) != Some(&unit) {
            bail!(
                "internal: unit {unit:?} used at position {} of a pass planned as {:?}",
                self.next,
                self.order
            );
        }
        // Issue the gathers up to `prefetch` units ahead of this one (each layout holding
        // parameters of the unit its own), then wait for this one's.
        let ahead = (self.next + self.opt.prefetch).min(self.order.len() - 1);
        while self.issued <= ahead {
            let u = self.order[self.issued];
            let mut arriving = Vec::new();
            for (k, o) in self.layouts.iter().enumerate() {
                let Some(i) = o.unit_index(u) else {
                    continue;
                };
                let into = take(&mut self.freed, (u, k));
                let (job, rx) = o.gather_job(i, into)?;
                self.queue.submit(job);
                arriving.push((k, rx));
            }
            if arriving.is_empty() {
                bail!("internal: no parameters of unit {u:?} to gather");
            }
            self.pending.push_back((self.issued, arriving));
            self.issued += 1;
        }
        let Some((at, arriving)) = self.pending.pop_front() else {
            bail!("internal: no gather in flight for unit {unit:?}");
        };
        debug_assert_eq!(at, self.next);
        for (k, rx) in arriving {
            let buffer = self.queue.wait(&rx)?;
            let o = self.layouts[k];
            o.materialize(o.unit_index(unit).expect("checked when issued"), &buffer);
            self.live.push(((unit, k), buffer));
        }
        self.next += 1;
        Ok(())
    }

    fn after(&mut self, unit: GradUnit) -> Result<()> {
        if self.layouts.is_empty() {
            return Ok(());
        }
        // Used again later in the pass: the storage is freed although the graph of this use may
        // still refer to it, since the next use's gather fills it again first; unless that
        // gather is already issued (prefetch reaching the next use while this one ran) into a
        // buffer of its own, and this one is left to the graph. Not used again: the buffer is
        // only dropped, so that a graph read after the pass (none in training, whose backward
        // is inside it) still finds its values.
        let regathering = self.pending.iter().any(|(at, _)| self.order[*at] == unit);
        let again = self.order[self.next..].contains(&unit) && !regathering;
        for (k, o) in self.layouts.iter().enumerate() {
            if let Some(i) = o.unit_index(unit) {
                o.release(i);
            }
            let Some(buffer) = take(&mut self.live, (unit, k)) else {
                continue;
            };
            if again {
                crate::sys::storage::free(&buffer)?;
                self.freed.push(((unit, k), buffer));
            }
        }
        Ok(())
    }

    fn grads_final(&mut self, unit: GradUnit) -> Result<()> {
        for part in self.opt.parts() {
            if self.reduce {
                part.reducer.unit_final(unit, self.queue);
            } else {
                part.reducer.unit_accumulate(unit);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 45 item 27: at stage 3 without activation checkpointing, the graph of a unit's
    /// forward keeps views of its gathered parameters (here `w.tr()`, what a matmul saves).
    /// After the unit's forward their storage is freed (0 bytes while the graph lives); the
    /// gather before the backward fills the same storage again, and the gradient is exact.
    /// A stage-3 optimizer of one decoder layer's 4 × 3 fp32 weight (0..12) on one rank, no
    /// prefetch: with one, a second use's gather would be issued while the first runs, into a
    /// buffer of its own, and the first's is then left to the graph.
    fn one_weight() -> Result<(Vec<(String, Tensor)>, Optimizer)> {
        let hp = Hyper::from(AdamWParams {
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.0,
        });
        let cpu = (Kind::Float, tch::Device::Cpu);
        let w = Tensor::arange(12, cpu).view([4, 3]).set_requires_grad(true);
        let params = vec![(
            "model.layers.0.mlp.up_proj.weight".to_string(),
            w.shallow_clone(),
        )];
        let pg = crate::dist::SingleProcess;
        let unit = GradUnit::Layer(0);
        let table = crate::model::params::table_of(&[(&params[0].0, &w, unit)]);
        let opt = Optimizer::new(
            &params,
            &table,
            hp,
            ZeroStage::Parameters,
            &pg,
            25.0,
            Kind::Float,
        )?
        .with_prefetch(0);
        Ok((params, opt))
    }

    #[test]
    fn stage_3_frees_a_units_gathered_storage_between_its_forward_and_backward() -> Result<()> {
        let (params, opt) = one_weight()?;
        let w = params[0].1.shallow_clone();
        let mut pg = crate::dist::SingleProcess;
        let cpu = (Kind::Float, tch::Device::Cpu);
        let x = Tensor::arange(6, cpu).view([2, 3]);
        let layer = GradUnit::Layer(0);
        opt.pass(&mut pg, false, &[layer, layer], true, |units| {
            units.before(layer)?;
            let saved = w.tr();
            let y = x.matmul(&saved);
            assert_eq!(crate::sys::storage::bytes(&saved), 48, "gathered: 12 fp32");
            units.after(layer)?;
            assert_eq!(
                crate::sys::storage::bytes(&saved),
                0,
                "freed after the forward"
            );
            units.before(layer)?;
            assert_eq!(crate::sys::storage::bytes(&saved), 48, "gathered again");
            y.sum(Kind::Float).backward();
            units.grads_final(layer)?;
            units.after(layer)
        })?;
        let g = &opt.full_gradients(&params, &mut pg)?[0];
        // d Σ x·wᵀ / d w[i, j] = Σ_b x[b, j]: columns 0+3, 1+4, 2+5.
        let want = Tensor::from_slice(&[3f32, 5., 7.]).repeat([4, 1]);
        assert!(g.equal(&want), "gradient {g}");
        Ok(())
    }

    /// A unit's last use in a pass frees nothing: no gather fills its storage again, so a
    /// graph that outlives the pass (a forward with grad whose backward comes after it) must
    /// still read the gathered values; the buffer goes when its last holder does.
    #[test]
    fn stage_3_leaves_a_units_last_buffer_to_whoever_holds_it() -> Result<()> {
        let (params, opt) = one_weight()?;
        let w = &params[0].1;
        let mut pg = crate::dist::SingleProcess;
        let layer = GradUnit::Layer(0);
        let saved = opt.pass(&mut pg, false, &[layer], false, |units| {
            units.before(layer)?;
            let saved = w.tr();
            units.after(layer)?;
            Ok(saved)
        })?;
        assert_eq!(crate::sys::storage::bytes(&saved), 48, "not freed");
        let want = Tensor::arange(12, (Kind::Float, tch::Device::Cpu)).view([4, 3]);
        assert!(saved.tr().equal(&want), "{saved}");
        Ok(())
    }
}
