//! The parallel mesh: world = data × context × tensor ranks, tensor parallelism innermost,
//! then context parallelism.
//!
//! Rank r sits at (data index r / (C·T), context index (r / T) % C, tensor index r % T): the T
//! consecutive ranks of one (data, context) index share every layer (keep them inside a
//! node); the C ranks of one data and tensor index split every sequence between them and read
//! the same samples; the D·C ranks with the same tensor index — the replicas — hold the same
//! parts of the layers and are what data parallelism (ZeRO stages, hybrid sharding, gradient
//! averaging) works across. Expert parallelism (E) is carved out of the replicas: replicas
//! q..q+E−1 (q a multiple of E) split every MoE layer's experts between them (the expert
//! group), and the replicas at the same position of every expert group hold the same experts
//! (the holders, what an expert's gradient is averaged across). [`Mesh::groups`] forms this
//! rank's groups (subgroups of the world group, through the same store).

use std::sync::{Arc, Mutex};

use anyhow::Result;

use super::group::{ProcessGroup, SharedGroup};
use crate::config::MeshShape;

/// A rank's coordinates on the mesh.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mesh {
    pub rank: usize,
    pub world: usize,
    /// T: ranks per tensor-parallel group.
    pub tensor: usize,
    /// C: ranks per context-parallel group.
    pub context: usize,
    /// Hybrid sharding: replicas per shard group (`system.shard_degree`, resolved: all of them
    /// when it is 0).
    pub shard: usize,
    /// E: replicas per expert-parallel group (`system.expert_parallel`).
    pub expert: usize,
}

/// This rank's groups on the mesh. A dimension of size 1 (or the whole world) has none: its
/// collectives run on the world group itself.
pub struct MeshGroups {
    /// The T ranks that split the layers with this one (T > 1).
    pub tensor: Option<SharedGroup>,
    /// The C ranks that split the sequences with this one (C > 1).
    pub context: Option<SharedGroup>,
    /// The replicas data parallelism works across (T > 1: the D·C ranks of this tensor index).
    pub data: Option<SharedGroup>,
    /// Hybrid sharding (shard < D·C): the shard group and the replica group inside the
    /// replicas, and which shard group this rank is in.
    pub hybrid: Option<(SharedGroup, SharedGroup, usize)>,
    /// Expert parallelism (E > 1).
    pub expert: Option<ExpertGroups>,
}

/// Expert parallelism's groups of one rank.
pub struct ExpertGroups {
    /// The E ranks that split the experts with this one.
    pub group: SharedGroup,
    /// The ranks that hold the same experts (None where that is this rank alone).
    pub holders: Option<SharedGroup>,
    /// With hybrid sharding (E dividing the shard degree S): the holders inside this rank's
    /// shard group (S/E of them; a group of one where that is this rank alone), the holders
    /// at the same place of the other shard groups, and which shard group this is. The
    /// experts' state is sharded inside the first and replicated across the second, as the
    /// other parameters' are.
    pub hybrid: Option<(SharedGroup, SharedGroup, usize)>,
}

impl Mesh {
    /// `tensor` × `context` must divide `world`, and `shard` the replicas
    /// (`config::check_world` checks them with the keys named).
    pub fn new(rank: usize, world: usize, tensor: usize, context: usize, shard: usize) -> Mesh {
        let (tensor, context) = (tensor.max(1), context.max(1));
        assert!(
            world.is_multiple_of(tensor * context) && rank < world,
            "internal: mesh of {world} ranks with T = {tensor}, C = {context}"
        );
        let mut mesh = Mesh {
            rank,
            world,
            tensor,
            context,
            shard,
            expert: 1,
        };
        let replicas = mesh.replicas();
        if shard == 0 {
            mesh.shard = replicas;
        }
        assert!(
            replicas.is_multiple_of(mesh.shard),
            "internal: shard groups of {} among {replicas} replicas",
            mesh.shard
        );
        mesh
    }

    /// This mesh with expert-parallel groups of `expert` replicas (which must divide them:
    /// `config::check_world`).
    pub fn with_expert(mut self, expert: usize) -> Mesh {
        let expert = expert.max(1);
        assert!(
            self.replicas().is_multiple_of(expert),
            "internal: expert groups of {expert} among {} replicas",
            self.replicas()
        );
        self.expert = expert;
        self
    }

    /// This rank's position in its expert-parallel group: which experts it holds.
    pub fn expert_rank(&self) -> usize {
        self.replica_rank() % self.expert
    }

    /// World ranks of this rank's expert-parallel group.
    pub fn expert_members(&self) -> Vec<usize> {
        let first = self.replica_rank() / self.expert * self.expert;
        self.at_replicas(first..first + self.expert)
    }

    /// World ranks that hold the same experts as this one (one per expert group).
    pub fn holder_members(&self) -> Vec<usize> {
        let groups = self.replicas() / self.expert;
        self.at_replicas((0..groups).map(|g| g * self.expert + self.expert_rank()))
    }

    /// With hybrid sharding, the holders of this rank's experts inside its shard group (E
    /// divides the shard degree: its expert groups lie inside it).
    pub fn shard_holder_members(&self) -> Vec<usize> {
        let first = self.replica_rank() / self.shard * self.shard;
        let groups = self.shard / self.expert;
        self.at_replicas((0..groups).map(|g| first + g * self.expert + self.expert_rank()))
    }

    /// D: the data-parallel ranks, each reading its own samples.
    pub fn data(&self) -> usize {
        self.shape().data()
    }

    /// D·C: the ranks that hold the same parameters as this one (one per TP group), which
    /// ZeRO stages shard the state over and gradients are averaged across.
    pub fn replicas(&self) -> usize {
        self.shape().replicas()
    }

    /// The counts of this mesh (`config::MeshShape`: the arithmetic written once).
    pub fn shape(&self) -> MeshShape {
        MeshShape {
            world: self.world,
            // Training refuses pipeline stages yet (`config::check_trains`).
            pipeline: 1,
            tensor: self.tensor,
            context: self.context,
            shard_degree: self.shard,
        }
    }

    /// This rank's position in its tensor-parallel group.
    pub fn tensor_rank(&self) -> usize {
        self.rank % self.tensor
    }

    /// This rank's position in its context-parallel group: which chunks of a sequence it holds.
    pub fn context_rank(&self) -> usize {
        (self.rank / self.tensor) % self.context
    }

    /// This rank's position among the data-parallel ranks (what the sampler deals to).
    pub fn data_rank(&self) -> usize {
        self.rank / (self.tensor * self.context)
    }

    /// This rank's position among the replicas.
    pub fn replica_rank(&self) -> usize {
        self.rank / self.tensor
    }

    /// Whether this rank speaks for its samples: the first of its TP and CP groups, whose
    /// ranks all compute the same loss.
    pub fn leads_its_samples(&self) -> bool {
        self.tensor_rank() == 0 && self.context_rank() == 0
    }

    /// World ranks of this rank's tensor-parallel group.
    pub fn tensor_members(&self) -> Vec<usize> {
        let first = self.replica_rank() * self.tensor;
        (first..first + self.tensor).collect()
    }

    /// World ranks of this rank's context-parallel group.
    pub fn context_members(&self) -> Vec<usize> {
        let first = self.data_rank() * self.context * self.tensor + self.tensor_rank();
        (0..self.context).map(|c| first + c * self.tensor).collect()
    }

    /// World ranks of the replicas at replica indices `indices`, at this rank's tensor index.
    fn at_replicas(&self, indices: impl Iterator<Item = usize>) -> Vec<usize> {
        indices
            .map(|d| d * self.tensor + self.tensor_rank())
            .collect()
    }

    /// World ranks data parallelism works across with this one.
    pub fn replica_members(&self) -> Vec<usize> {
        self.at_replicas(0..self.replicas())
    }

    /// A group's tag: `shard1`, or `shard1.3` at tensor index 3.
    fn tag(&self, kind: &str, index: usize) -> String {
        if self.tensor == 1 {
            format!("{kind}{index}")
        } else {
            format!("{kind}{index}.{}", self.tensor_rank())
        }
    }

    /// Forms this rank's groups, every rank of `pg` (the world group) together: the tensor
    /// groups, the replica groups, the context groups, hybrid sharding's shard and replica
    /// groups, then the expert groups and the experts' holders.
    pub fn groups(&self, pg: &mut dyn ProcessGroup) -> Result<MeshGroups> {
        anyhow::ensure!(
            pg.world_size() == self.world && pg.rank() == self.rank,
            "internal: mesh of rank {} of {} over a group of rank {} of {}",
            self.rank,
            self.world,
            pg.rank(),
            pg.world_size()
        );
        let shared = |g: Box<dyn ProcessGroup>| -> SharedGroup { Arc::new(Mutex::new(g)) };
        let (replica_rank, tensor_rank) = (self.replica_rank(), self.tensor_rank());
        let (tensor, data) = if self.tensor > 1 {
            let t = pg.subgroup(&self.tensor_members(), &format!("tp{replica_rank}"))?;
            let d = pg.subgroup(&self.replica_members(), &format!("dp{tensor_rank}"))?;
            (Some(shared(t)), Some(shared(d)))
        } else {
            (None, None)
        };
        let context = if self.context > 1 {
            let tag = self.tag("cp", self.data_rank());
            Some(shared(pg.subgroup(&self.context_members(), &tag)?))
        } else {
            None
        };
        let hybrid = if self.shard < self.replicas() {
            let index = replica_rank / self.shard;
            let first = index * self.shard;
            let members = self.at_replicas(first..first + self.shard);
            let shard = pg.subgroup(&members, &self.tag("shard", index))?;
            let position = replica_rank % self.shard;
            let groups = self.replicas() / self.shard;
            let members = self.at_replicas((0..groups).map(|g| g * self.shard + position));
            let replica = pg.subgroup(&members, &self.tag("replica", position))?;
            Some((shared(shard), shared(replica), index))
        } else {
            None
        };
        let expert = if self.expert > 1 {
            let group = self.replica_rank() / self.expert;
            let ep = pg.subgroup(&self.expert_members(), &self.tag("ep", group))?;
            let holders = match self.replicas() / self.expert {
                1 => None,
                _ => {
                    let tag = self.tag("experts", self.expert_rank());
                    Some(shared(pg.subgroup(&self.holder_members(), &tag)?))
                }
            };
            let hybrid = if self.shard < self.replicas() {
                let (index, position) = (replica_rank / self.shard, replica_rank % self.shard);
                let members = self.shard_holder_members();
                let shard = match members.len() {
                    1 => shared(Box::new(super::SingleProcess)),
                    _ => {
                        let tag = self.tag(&format!("eshard{}_", self.expert_rank()), index);
                        shared(pg.subgroup(&members, &tag)?)
                    }
                };
                let groups = self.replicas() / self.shard;
                let members = self.at_replicas((0..groups).map(|g| g * self.shard + position));
                let replica = pg.subgroup(&members, &self.tag("ereplica", position))?;
                Some((shard, shared(replica), index))
            } else {
                None
            };
            Some(ExpertGroups {
                group: shared(ep),
                holders,
                hybrid,
            })
        } else {
            None
        };
        Ok(MeshGroups {
            tensor,
            context,
            data,
            hybrid,
            expert,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tensor_parallelism_is_innermost() {
        // 8 ranks = 2 data × 4 tensor.
        let m = Mesh::new(6, 8, 4, 1, 0);
        assert_eq!((m.data_rank(), m.tensor_rank()), (1, 2));
        assert_eq!(m.tensor_members(), [4, 5, 6, 7]);
        assert_eq!(m.replica_members(), [2, 6]);
        assert_eq!((m.data(), m.shard), (2, 2));
        // 16 ranks = 4 data × 4 tensor, shard groups of 2 data ranks.
        let m = Mesh::new(13, 16, 4, 1, 2);
        assert_eq!((m.data_rank(), m.tensor_rank()), (3, 1));
        assert_eq!(m.replica_members(), [1, 5, 9, 13]);
    }

    #[test]
    fn without_tensor_parallelism_the_data_ranks_are_the_world() {
        let m = Mesh::new(3, 4, 1, 1, 0);
        assert_eq!(m.replica_members(), [0, 1, 2, 3]);
        assert_eq!(m.tensor_members(), [3]);
        assert_eq!(m.context_members(), [3]);
    }

    #[test]
    fn expert_groups_are_consecutive_replicas_and_holders_share_a_position() {
        // 8 ranks, EP 2: rank 5 is position 1 of expert group [4, 5]; ranks 1, 3, 5, 7 hold
        // the same experts.
        let m = Mesh::new(5, 8, 1, 1, 0).with_expert(2);
        assert_eq!(m.expert_rank(), 1);
        assert_eq!(m.expert_members(), [4, 5]);
        assert_eq!(m.holder_members(), [1, 3, 5, 7]);
        // 8 ranks = 2 data × 2 context × 2 tensor, EP 4 over the 4 replicas: rank 6 is replica
        // 3 at tensor index 0.
        let m = Mesh::new(6, 8, 2, 2, 0).with_expert(4);
        assert_eq!((m.replica_rank(), m.expert_rank()), (3, 3));
        assert_eq!(m.expert_members(), [0, 2, 4, 6]);
        assert_eq!(m.holder_members(), [6]);
    }

    #[test]
    fn context_parallelism_sits_between_data_and_tensor() {
        // 16 ranks = 2 data × 2 context × 4 tensor: rank 13 = data 1, context 1, tensor 1.
        let m = Mesh::new(13, 16, 4, 2, 0);
        assert_eq!(
            (m.data_rank(), m.context_rank(), m.tensor_rank()),
            (1, 1, 1)
        );
        assert_eq!(m.tensor_members(), [12, 13, 14, 15]);
        assert_eq!(m.context_members(), [9, 13]);
        // The replicas: every rank of tensor index 1, across data and context.
        assert_eq!(m.replica_members(), [1, 5, 9, 13]);
        assert_eq!((m.data(), m.replicas(), m.shard), (2, 4, 4));
        assert!(!m.leads_its_samples());
        assert!(Mesh::new(8, 16, 4, 2, 0).leads_its_samples());
        // Without tensor parallelism a CP group is C consecutive ranks.
        let m = Mesh::new(5, 8, 1, 4, 0);
        assert_eq!((m.data_rank(), m.context_rank()), (1, 1));
        assert_eq!(m.context_members(), [4, 5, 6, 7]);
    }
}
