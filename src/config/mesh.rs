//! The mesh's arithmetic, written once: how many ranks of a world of W read their own samples
//! (D), hold the same parameters (the replicas, D·C) and shard one copy of the training state
//! (the shard group). `dist::Mesh` (a rank's coordinates), `plan` (any world it plans for) and
//! `check_world` (the rules, with the keys named) all count through [`MeshShape`].

/// World = pipeline × data × context × tensor ranks, with hybrid sharding's groups inside the
/// replicas of a stage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MeshShape {
    pub world: usize,
    /// P: pipeline stages' ranks (0 counts as 1), the outermost dimension.
    pub pipeline: usize,
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
            pipeline: c.system.pipeline_parallel,
            tensor: c.system.tensor_parallel,
            context: c.system.context_parallel,
            shard_degree: c.system.shard_degree,
        }
    }

    /// D: the data-parallel ranks of a pipeline stage, each reading its own samples (one per
    /// C × T group).
    pub fn data(&self) -> usize {
        self.stage_world() / (self.tensor.max(1) * self.context.max(1))
    }

    /// The ranks of one pipeline stage (all of them without pipeline parallelism).
    pub fn stage_world(&self) -> usize {
        self.world / self.pipeline.max(1)
    }

    /// D·C: the replicas, the ranks that hold the same parameters (one per TP group), which
    /// the zero stages shard the state over and gradients are averaged across.
    pub fn replicas(&self) -> usize {
        self.stage_world() / self.tensor.max(1)
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
            pipeline: 1,
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
        let piped = MeshShape {
            world: 64,
            pipeline: 4,
            ..m
        };
        assert_eq!(
            (piped.data(), piped.replicas(), piped.stage_world()),
            (2, 8, 16)
        );
        let flat = MeshShape {
            world: 3,
            pipeline: 0,
            tensor: 0,
            context: 0,
            shard_degree: 0,
        };
        assert_eq!((flat.data(), flat.replicas(), flat.shard()), (3, 3, 3));
    }
}
