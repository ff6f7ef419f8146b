//! What the optimizer's layouts share: the state a rank holds and hands to a checkpoint (and
//! reads back from one), and how that state is sharded across ranks.

use std::ops::Range;

use anyhow::Result;
use tch::{Kind, Tensor};

use crate::config::ZeroStage;
use crate::dist::SharedGroup;

/// Bytes of this rank's training state, by kind (the memory line's breakdown).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StateBytes {
    /// Working parameters (what the forward reads) present now.
    pub params: u64,
    /// fp32 master weights kept apart from the parameters (sharded stages only).
    pub master: u64,
    /// The optimizer's moments: AdamW's two, Muon's momentum buffer.
    pub moments: u64,
    /// Gradients kept between the reduction and the update.
    pub grads: u64,
}

/// The names of the optimizers' moments in checkpoints (torch.optim's state keys).
pub const EXP_AVG: &str = "exp_avg";
pub const EXP_AVG_SQ: &str = "exp_avg_sq";
pub const MOMENTUM: &str = "momentum_buffer";
/// Every moment a checkpoint may hold.
pub const MOMENT_KEYS: [&str; 3] = [EXP_AVG, EXP_AVG_SQ, MOMENTUM];

/// Part of one parameter's optimizer moments: elements `range` of the flattened parameter.
pub struct MomentPiece {
    pub name: String,
    pub range: Range<usize>,
    /// The moments of those elements by key (AdamW's [`EXP_AVG`] and [`EXP_AVG_SQ`], Muon's
    /// [`MOMENTUM`]): the parameter's shape when the piece is whole and replicated, else 1-D.
    pub moments: Vec<(&'static str, Tensor)>,
}

/// What one rank contributes to a checkpoint.
pub struct RankState {
    /// Full fp32 parameters this rank writes into the model files.
    pub weights: Vec<(String, Tensor)>,
    /// The moments this rank holds.
    pub moments: Vec<MomentPiece>,
}

/// Which rank writes which parameter of a checkpoint, derived from the layout alone so every
/// rank agrees without talking.
pub struct Writers {
    /// (parameter, the rank that writes it, elements), in flat order.
    pub params: Vec<(String, usize, usize)>,
    pub world: usize,
    /// One optimizer file per rank (sharded) rather than one for all (replicated).
    pub sharded: bool,
    pub stage: ZeroStage,
    /// This rank's optimizer file (its rank among the writers), None when it writes nothing
    /// (replicated: all but rank 0; hybrid: all but the first shard group).
    pub this: Option<usize>,
}

/// Hybrid sharding (`system.shard_degree` below the world size): this rank's shard group
/// (consecutive ranks that shard one copy of the state) and replica group (the ranks at the
/// same position of every shard group, which hold the same slice).
pub struct Hybrid {
    pub shard: SharedGroup,
    pub replica: SharedGroup,
    /// Which shard group this rank is in (group 0 writes checkpoints).
    pub index: usize,
}

/// Tensor parallelism (`system.tensor_parallel` > 1): the ranks data parallelism works across
/// (those at this rank's tensor index; they hold the same parts of the layers), and this rank's
/// tensor-parallel group.
pub struct TensorGroups {
    pub data: SharedGroup,
    pub tensor: SharedGroup,
    /// `system.sequence_parallel`: the norm weights' gradients are partial sums over the
    /// tensor group's tokens, added across it before the update.
    pub sequence_parallel: bool,
    /// The model's parameter table: each parameter's whole shape (the layouts see the parts'
    /// shapes) and split.
    pub parameters: std::sync::Arc<crate::model::Parameters>,
}

/// How the state is sharded (the stage, and across which ranks) and how gradients travel.
pub struct Sharding {
    pub stage: ZeroStage,
    /// None: across all data-parallel ranks.
    pub hybrid: Option<Hybrid>,
    /// `system.reduce_dtype`: the dtype of the buffers gradients are reduced in (fp32 or bf16).
    pub reduce: Kind,
    /// None: no tensor parallelism, the data-parallel ranks are the whole group.
    pub tensor: Option<TensorGroups>,
}

/// A checkpoint as the optimizer reads it back (implemented by `train::checkpoint`).
pub trait StateSource {
    /// The full fp32 parameter `name`, checked to have `shape` (on the CPU).
    fn weight(&self, name: &str, shape: &[i64]) -> Result<Tensor>;
    /// Elements `range` of the fp32 parameter `name` (of full shape `shape`) flattened: 1-D
    /// on the CPU, read without the rest of the tensor.
    fn weight_range(&self, name: &str, shape: &[i64], range: &Range<usize>) -> Result<Tensor>;
    /// Moment `key` ([`MOMENT_KEYS`]) of elements `range` of `name` flattened: 1-D fp32 on
    /// the CPU.
    fn moment(&self, name: &str, key: &str, range: &Range<usize>) -> Result<Tensor>;
}
