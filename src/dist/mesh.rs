//! The parallel mesh: world = data × tensor ranks, tensor parallelism innermost.
//!
//! Rank r sits at (data index r / T, tensor index r % T): the T consecutive ranks of one
//! data index share every layer (keep them inside a node), and the D = world / T ranks with
//! the same tensor index hold the same parts of the layers and are what data parallelism —
//! ZeRO stages, hybrid sharding, gradient averaging — works across. [`Mesh::groups`] forms
//! this rank's groups (subgroups of the world group, through the same store).

use std::sync::{Arc, Mutex};

use anyhow::Result;

use super::group::{ProcessGroup, SharedGroup};

/// A rank's coordinates on the mesh.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mesh {
    pub rank: usize,
    pub world: usize,
    /// T: ranks per tensor-parallel group.
    pub tensor: usize,
    /// Hybrid sharding: data-parallel ranks per shard group (`system.shard_degree`, resolved:
    /// all of them when it is 0).
    pub shard: usize,
}

/// This rank's groups on the mesh. A dimension of size 1 (or the whole world) has none: its
/// collectives run on the world group itself.
pub struct MeshGroups {
    /// The T ranks that split the layers with this one (T > 1).
    pub tensor: Option<SharedGroup>,
    /// The ranks data parallelism works across (T > 1: the D ranks of this tensor index).
    pub data: Option<SharedGroup>,
    /// Hybrid sharding (shard < D): the shard group and the replica group inside the data
    /// ranks, and which shard group this rank is in.
    pub hybrid: Option<(SharedGroup, SharedGroup, usize)>,
}

impl Mesh {
    /// `tensor` must divide `world`, and `shard` the data ranks (`config::check_world`
    /// checks both with the keys named).
    pub fn new(rank: usize, world: usize, tensor: usize, shard: usize) -> Mesh {
        let tensor = tensor.max(1);
        assert!(
            world.is_multiple_of(tensor) && rank < world,
            "internal: mesh of {world} ranks with T = {tensor}"
        );
        let data = world / tensor;
        let shard = if shard == 0 { data } else { shard };
        assert!(
            data.is_multiple_of(shard),
            "internal: shard groups of {shard} among {data} data ranks"
        );
        Mesh {
            rank,
            world,
            tensor,
            shard,
        }
    }

    /// D: the data-parallel ranks.
    pub fn data(&self) -> usize {
        self.world / self.tensor
    }

    /// This rank's position in its tensor-parallel group.
    pub fn tensor_rank(&self) -> usize {
        self.rank % self.tensor
    }

    /// This rank's position among the data-parallel ranks (what the sampler deals to).
    pub fn data_rank(&self) -> usize {
        self.rank / self.tensor
    }

    /// World ranks of this rank's tensor-parallel group.
    pub fn tensor_members(&self) -> Vec<usize> {
        let first = self.data_rank() * self.tensor;
        (first..first + self.tensor).collect()
    }

    /// World ranks of the data-parallel ranks at data indices `indices`, at this rank's
    /// tensor index.
    fn at_data(&self, indices: impl Iterator<Item = usize>) -> Vec<usize> {
        indices
            .map(|d| d * self.tensor + self.tensor_rank())
            .collect()
    }

    /// World ranks data parallelism works across with this one.
    pub fn data_members(&self) -> Vec<usize> {
        self.at_data(0..self.data())
    }

    /// A hybrid-sharding group's tag: `shard1`, or `shard1.3` at tensor index 3.
    fn tag(&self, kind: &str, index: usize) -> String {
        if self.tensor == 1 {
            format!("{kind}{index}")
        } else {
            format!("{kind}{index}.{}", self.tensor_rank())
        }
    }

    /// Forms this rank's groups, every rank of `pg` (the world group) together: the tensor
    /// groups, the data groups, then hybrid sharding's shard and replica groups.
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
        let (data_rank, tensor_rank) = (self.data_rank(), self.tensor_rank());
        let (tensor, data) = if self.tensor > 1 {
            let t = pg.subgroup(&self.tensor_members(), &format!("tp{data_rank}"))?;
            let d = pg.subgroup(&self.data_members(), &format!("dp{tensor_rank}"))?;
            (Some(shared(t)), Some(shared(d)))
        } else {
            (None, None)
        };
        let hybrid = if self.shard < self.data() {
            let index = data_rank / self.shard;
            let first = index * self.shard;
            let members = self.at_data(first..first + self.shard);
            let shard = pg.subgroup(&members, &self.tag("shard", index))?;
            let position = data_rank % self.shard;
            let groups = self.data() / self.shard;
            let members = self.at_data((0..groups).map(|g| g * self.shard + position));
            let replica = pg.subgroup(&members, &self.tag("replica", position))?;
            Some((shared(shard), shared(replica), index))
        } else {
            None
        };
        Ok(MeshGroups {
            tensor,
            data,
            hybrid,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tensor_parallelism_is_innermost() {
        // 8 ranks = 2 data × 4 tensor.
        let m = Mesh::new(6, 8, 4, 0);
        assert_eq!((m.data_rank(), m.tensor_rank()), (1, 2));
        assert_eq!(m.tensor_members(), [4, 5, 6, 7]);
        assert_eq!(m.data_members(), [2, 6]);
        assert_eq!((m.data(), m.shard), (2, 2));
        // 16 ranks = 4 data × 4 tensor, shard groups of 2 data ranks.
        let m = Mesh::new(13, 16, 4, 2);
        assert_eq!((m.data_rank(), m.tensor_rank()), (3, 1));
        assert_eq!(m.data_members(), [1, 5, 9, 13]);
    }

    #[test]
    fn without_tensor_parallelism_the_data_ranks_are_the_world() {
        let m = Mesh::new(3, 4, 1, 0);
        assert_eq!(m.data_members(), [0, 1, 2, 3]);
        assert_eq!(m.tensor_members(), [3]);
    }
}
