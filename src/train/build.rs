//! The model and its optimizer on this rank's place of the mesh: the parameters made (drawn
//! from the seeded RNG in `Llama::new`'s order, so every rank draws the numbers one rank would,
//! or read from `model.model_path`), split among the tensor-parallel ranks
//! (`system.tensor_parallel`), the sequences split among the context-parallel ranks
//! (`system.context_parallel`), and the optimizer over the replicas, the data × context ranks
//! that hold the same parameters (`system.zero_stage`, `system.shard_degree`,
//! `system.reduce_dtype`).

use anyhow::{Context, Result};
use tch::nn::VarStore;
use tch::{Kind, Tensor};

use super::device;
use super::faults;
use super::optim::{ExpertPlace, Experts, Hybrid, Hyper, Optimizer, Sharding, TensorGroups};
use super::place::Rank;
use super::tensor_parallel::GroupComm;
use crate::config::Config;
use crate::dist::buckets::broadcast_parameters;
use crate::dist::{on_group, ExpertGroups, MeshGroups, ProcessGroup, SharedGroup};
use crate::model::llama::{init_parameter, MakeParameter};
use crate::model::{
    hf, ActivationMemory, ContextParallel, ExpertParallel, Llama, LlamaShape, Parameters,
    TensorParallel,
};
use crate::sys::phase::{self, Phase};

/// A model, its parameters by name, and their optimizer.
pub struct Built {
    pub model: Llama,
    pub params: Vec<(String, Tensor)>,
    pub opt: Optimizer,
}

/// This rank's part of a tensor-parallel group.
struct Part {
    group: SharedGroup,
    rank: usize,
    size: usize,
}

impl Part {
    /// This rank's part of the whole parameter `name` of `table`.
    fn of(&self, table: &Parameters, name: &str, whole: &Tensor) -> Result<Tensor> {
        Ok(table.split(name)?.shard(whole, self.rank, self.size))
    }
}

/// The model, its parameters and the optimizer for `shape`, in `vs` (seeded, in the model-build
/// phase; sharded parameters at zero stage 3), with the configured prefetch and activation
/// memory. Every rank forms its mesh groups here, together.
pub fn build(
    cfg: &Config,
    shape: &LlamaShape,
    vs: &VarStore,
    compute: Kind,
    rank: &Rank,
    pg: &mut dyn ProcessGroup,
) -> Result<Built> {
    faults::arm_model_build_oom(cfg, rank.device);
    phase::enter(Phase::ModelBuild);
    tch::manual_seed(cfg.system.seed as i64);
    let mut groups = rank.mesh.groups(pg)?;
    let context = groups.context.take();
    let experts = match &groups.expert {
        Some(e) => Some(expert_parallel(cfg, shape, rank, &e.group)?),
        None => None,
    };
    let part = groups.tensor.as_ref().map(|g| Part {
        group: g.clone(),
        rank: rank.mesh.tensor_rank(),
        size: rank.mesh.tensor,
    });
    let Built {
        mut model,
        params,
        opt,
    } = if cfg.system.zero_stage.shards_parameters() {
        build_sharded(cfg, shape, vs, compute, (rank, experts), pg, (groups, part))?
    } else {
        build_whole(cfg, shape, vs, compute, (rank, experts), pg, (groups, part))?
    };
    model.set_activation_memory(ActivationMemory::from_config(&cfg.training));
    model.set_router_z_loss(cfg.model.router_z_loss_coef);
    if let Some(group) = context {
        let comm = GroupComm::new(group)?;
        let (at, size) = (rank.mesh.context_rank(), rank.mesh.context);
        model.set_context_parallel(ContextParallel::new(at, size, Box::new(comm)));
    }
    Ok(Built {
        model,
        params,
        opt: opt.with_prefetch(crate::config::prefetch_units(cfg, shape.num_layers)),
    })
}

/// This rank's place in its expert-parallel group `group` (`system.expert_parallel`), checked
/// against the model's experts.
fn expert_parallel(
    cfg: &Config,
    shape: &LlamaShape,
    rank: &Rank,
    group: &SharedGroup,
) -> Result<ExpertParallel> {
    let experts = shape.moe.as_ref().map_or(0, |m| m.num_experts);
    let source = match &cfg.model.model_path {
        Some(dir) => format!("model.model_path = {dir}"),
        None => "the model (model.num_experts)".to_string(),
    };
    crate::config::check_expert_parallel_model(cfg.system.expert_parallel, experts, &source)?;
    let comm = GroupComm::new(group.clone())?;
    let (at, size) = (rank.mesh.expert_rank(), rank.mesh.expert);
    Ok(ExpertParallel::new(at, size, Box::new(comm)))
}

/// The model with each parameter made by `make` (whole; with tensor parallelism this rank
/// keeps its part, with expert parallelism its experts).
fn model(
    cfg: &Config,
    shape: &LlamaShape,
    vs: &VarStore,
    compute: Kind,
    (part, ep): (Option<&Part>, Option<ExpertParallel>),
    make: &mut MakeParameter,
) -> Result<Llama> {
    let max_seq = cfg.training.context_length;
    let tp = match part {
        Some(p) => {
            let comm = GroupComm::new(p.group.clone())?;
            let sp = cfg.system.sequence_parallel;
            Some(TensorParallel::new(p.rank, p.size, sp, Box::new(comm)))
        }
        None => None,
    };
    if tp.is_none() && ep.is_none() {
        return Ok(Llama::new_with(&vs.root(), shape, max_seq, compute, make));
    }
    Llama::new_parallel(&vs.root(), shape, max_seq, compute, (tp, ep), make)
}

/// The run's optimizer over `params` (this rank's parts of `model`'s): `system.zero_stage` on
/// the data ranks of the mesh, hybrid sharding among them, `system.reduce_dtype`.
fn optimizer(
    cfg: &Config,
    params: &[(String, Tensor)],
    model: &Llama,
    compute: Kind,
    pg: &mut dyn ProcessGroup,
    groups: MeshGroups,
) -> Result<Optimizer> {
    // With tensor parallelism: the groups of parameters whose data-parallel ranks are `data`.
    let tp = groups.tensor;
    let tensor_groups = |data: SharedGroup| {
        tp.clone().map(|tensor| TensorGroups {
            data,
            tensor,
            sequence_parallel: cfg.system.sequence_parallel,
            parameters: model.parameters().clone(),
        })
    };
    let tensor = groups.data.and_then(tensor_groups);
    let sharding = Sharding {
        stage: cfg.system.zero_stage,
        hybrid: groups.hybrid.map(|(shard, replica, index)| Hybrid {
            shard,
            replica,
            index,
        }),
        reduce: device::reduce_kind(cfg),
        tensor,
    };
    let hp = Hyper::from_config(cfg);
    let table = model.parameters();
    let Some(ExpertGroups {
        group,
        holders,
        hybrid,
    }) = groups.expert
    else {
        return Optimizer::with_sharding(
            params,
            table,
            hp,
            sharding,
            pg,
            cfg.system.bucket_mb,
            compute,
        );
    };
    let (dense, experts): (Vec<_>, Vec<_>) = params
        .iter()
        .map(|(n, p)| (n.clone(), p.shallow_clone()))
        .partition(|(n, _)| !table.is_expert(n));
    let stage = (cfg.system.zero_stage, sharding.reduce);
    let dense = Optimizer::with_sharding(
        &dense,
        table,
        hp,
        sharding,
        pg,
        cfg.system.bucket_mb,
        compute,
    )?;
    let total = model.shape.moe.as_ref().map_or(0, |m| m.num_experts);
    let (ep_rank, ep) = (model.expert_rank(), cfg.system.expert_parallel);
    let place = ExpertPlace::new(&experts, (group, holders), (ep_rank, ep, total / ep));
    // With hybrid sharding the experts' state is sharded among their holders in this rank's
    // shard group and replicated across the groups, as the other parameters' is.
    let hybrid = hybrid.map(|(shard, replica, index)| Hybrid {
        shard,
        replica,
        index,
    });
    let experts = Experts::new(place, |over| {
        // With tensor parallelism each expert is split by its width over the tensor group, as
        // without EP: its parts are made whole over that group, its holders are the data group.
        let tensor = tensor_groups(over.clone());
        Optimizer::over_group(
            &experts,
            table,
            hp,
            (stage, hybrid, tensor),
            over,
            pg,
            (cfg.system.bucket_mb, compute),
        )
    })?;
    Ok(dense.with_experts(experts))
}

/// The model and its optimizer at zero stages 0-2: every rank builds its part of the model
/// (the whole without tensor parallelism; fresh or from `model.model_path`), starts from the
/// first data rank's values, and the optimizer takes its state from them.
fn build_whole(
    cfg: &Config,
    shape: &LlamaShape,
    vs: &VarStore,
    compute: Kind,
    (rank, ep): (&Rank, Option<ExpertParallel>),
    pg: &mut dyn ProcessGroup,
    (groups, part): (MeshGroups, Option<Part>),
) -> Result<Built> {
    let device = vs.device();
    let whole = part.is_none() && ep.is_none();
    let model = model(
        cfg,
        shape,
        vs,
        compute,
        (part.as_ref(), ep),
        &mut |_, dims, init| init_parameter(dims, init, device),
    )?;
    let table = model.parameters();
    if let Some(dir) = &cfg.model.model_path {
        let path = crate::data::hub::resolve_model(dir)?;
        let read = if whole {
            hf::load_weights(&path, vs)
        } else {
            // This rank's part of each tensor (tensor parallelism) and its experts only
            // (expert parallelism: another rank's are skipped).
            let variables = vs.variables();
            hf::read_weights(&path, &table.shapes(), |name, value| {
                let Some(param) = variables.get(name) else {
                    return not_held(table, name);
                };
                let value = value.to_kind(param.kind());
                let value = match &part {
                    Some(p) => p.of(table, name, &value)?,
                    None => value,
                };
                tch::no_grad(|| param.shallow_clone().copy_(&value.to_device(device)));
                Ok(())
            })
        };
        read.with_context(|| format!("model.model_path = {dir}"))?;
        loaded(rank, dir, &path, shape);
    }
    let params = Llama::named_parameters(vs);
    // Every rank starts from the first data rank's values (fresh init or HF weights); a
    // checkpoint later overwrites them identically on every data rank.
    // With expert parallelism the experts from the first of their holders.
    let (mut experts, mut dense) = (Vec::new(), Vec::new());
    for (name, p) in &params {
        match table.is_expert(name) {
            true => experts.push(p.shallow_clone()),
            false => dense.push(p.shallow_clone()),
        }
    }
    let bucket = cfg.system.bucket_mb;
    on_group(groups.data.as_ref(), pg, |g| {
        broadcast_parameters(g, &dense, bucket)
    })?;
    if let Some(e) = &groups.expert {
        let mut alone = crate::dist::SingleProcess;
        on_group(e.holders.as_ref(), &mut alone, |g| {
            broadcast_parameters(g, &experts, bucket)
        })?;
    }
    // On NCCL the broadcast is only queued; a host-side barrier turns a peer that never
    // joined it into the ring's timeout naming that rank, rather than a hang later.
    pg.barrier()?;
    let opt = optimizer(cfg, &params, &model, compute, pg, groups)?;
    Ok(Built { model, params, opt })
}

/// The model and its optimizer at zero stage 3, without any rank ever holding the whole model:
/// the model's parameters are empty placeholders, and each parameter's value is made (drawn
/// from the seeded RNG in `Llama::new`'s order, so every rank draws the same numbers as a
/// replicated run, or read from `model.model_path`) one at a time, and only this rank's slice
/// of its part kept; with expert parallelism another position's experts are made and dropped.
fn build_sharded(
    cfg: &Config,
    shape: &LlamaShape,
    vs: &VarStore,
    compute: Kind,
    (rank, ep): (&Rank, Option<ExpertParallel>),
    pg: &mut dyn ProcessGroup,
    (groups, part): (MeshGroups, Option<Part>),
) -> Result<Built> {
    let device = vs.device();
    let model = model(
        cfg,
        shape,
        vs,
        compute,
        (part.as_ref(), ep),
        &mut |_, _, _| Tensor::empty([0], (Kind::Float, device)),
    )?;
    let params = Llama::named_parameters(vs);
    let opt = optimizer(cfg, &params, &model, compute, pg, groups)?;
    let table = model.parameters();
    let variables = vs.variables();
    let keep = |name: &str, value: Tensor| {
        if !variables.contains_key(name) {
            return not_held(table, name);
        }
        let value = match &part {
            Some(p) => p.of(table, name, &value)?,
            None => value,
        };
        opt.set_initial(name, &value)
    };
    match &cfg.model.model_path {
        None => {
            // The table's order is `Llama::new`'s: the same random draws as a replicated run.
            for p in table.iter() {
                keep(&p.name, init_parameter(&p.shape, p.init, device))?;
            }
        }
        Some(dir) => {
            let path = crate::data::hub::resolve_model(dir)?;
            hf::read_weights(&path, &table.shapes(), keep)
                .with_context(|| format!("model.model_path = {dir}"))?;
            loaded(rank, dir, &path, shape);
        }
    }
    Ok(Built { model, params, opt })
}

/// A parameter of the model this rank does not hold, skipped: only another position's expert
/// (expert parallelism) may be one.
fn not_held(table: &Parameters, name: &str) -> Result<()> {
    anyhow::ensure!(table.is_expert(name), "internal: no parameter {name}");
    Ok(())
}

fn loaded(rank: &Rank, dir: &str, path: &std::path::Path, shape: &LlamaShape) {
    println!(
        "{} Loaded weights from {dir} ({}, {} layers)",
        rank.tag,
        path.display(),
        shape.num_layers
    );
}
