//! The mesh's arithmetic, written once: how many ranks of a world of W read their own samples
//! (D), hold the same parameters (the replicas, D·C) and shard one copy of the training state
//! (the shard group). `dist::Mesh` (a rank's coordinates), `plan` (any world it plans for) and
//! `check_world` (the rules, with the keys named) all count through [`MeshShape`].

/// World = data × context × tensor ranks, with hybrid sharding's groups inside the replicas.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MeshShape {
    pub world: usize,
    /// T: ranks per tensor-parallel group (0 counts as 1).
    pub tensor: usize,
    /// C: ranks per context-parallel group (0 counts as 1).
    pub context: usize,
    /// `system.shard_degree`: replicas per shard group; 0 = all of them.
    pub shard_degree: usize,
}

impl MeshShape {
    /// The mesh `c` lays out on `world` ranks.
    pub fn of(c: &super::Config, world: usize) -> MeshShape {
        MeshShape {
            world,
            tensor: c.system.tensor_parallel,
            context: c.system.context_parallel,
            shard_degree: c.system.shard_degree,
        }
    }

    /// D: the data-parallel ranks, each reading its own samples (one per C × T group).
    pub fn data(&self) -> usize {
        self.world / (self.tensor.max(1) * self.context.max(1))
    }

    /// D·C: the replicas, the ranks that hold the same parameters (one per TP group), which
    /// the zero stages shard the state over and gradients are averaged across.
    pub fn replicas(&self) -> usize {
        self.world / self.tensor.max(1)
    }

    /// The replicas that shard one copy of the state: all of them, or `shard_degree` of them
    /// (hybrid sharding; at most all).
    pub fn shard(&self) -> usize {
        match self.shard_degree {
            0 => self.replicas(),
            d => d.min(self.replicas()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::MeshShape;

    #[test]
    fn data_replicas_and_shards_of_a_mesh() {
        let m = MeshShape {
            world: 16,
            tensor: 2,
            context: 4,
            shard_degree: 0,
        };
        assert_eq!((m.data(), m.replicas(), m.shard()), (2, 8, 8));
        let hybrid = MeshShape {
            shard_degree: 4,
            ..m
        };
        assert_eq!(hybrid.shard(), 4);
        let flat = MeshShape {
            world: 3,
            tensor: 0,
            context: 0,
            shard_degree: 0,
        };
        assert_eq!((flat.data(), flat.replicas(), flat.shard()), (3, 3, 3));
    }
}
