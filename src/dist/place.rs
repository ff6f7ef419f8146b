//! Where a rank and a node sit in a job: the one description of each, whatever gave it —
//! torchrun's variables (`env`), srun's (`slurm`) or `lockstep run`'s flags.

/// A rank's place in the job: the one description of it, whether torchrun's variables, srun's
/// or lockstep's launcher gave it, and what the trainer reads (`train::place::Rank`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Place {
    /// Global rank, `0..world` (`RANK`, `SLURM_PROCID`).
    pub rank: usize,
    /// Number of ranks in the job (`WORLD_SIZE`, `SLURM_NTASKS`).
    pub world: usize,
    /// Rank on this node, used to pick the GPU (`LOCAL_RANK`; defaults to `rank % local_world`).
    pub local_rank: usize,
    /// Ranks on this node (`LOCAL_WORLD_SIZE`; defaults to `world`, i.e. one node).
    pub local_world: usize,
}

impl Place {
    /// A job of one rank.
    pub const SINGLE: Place = Place {
        rank: 0,
        world: 1,
        local_rank: 0,
        local_world: 1,
    };
}

/// A node's place in a job and where node 0's rendezvous store is: the one description of it,
/// whether `lockstep run`'s flags or srun's variables (`slurm::node_layout`) gave it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodePlace {
    /// Number of nodes taking part; every node runs the same number of workers.
    pub nnodes: usize,
    /// This node's index in `0..nnodes`.
    pub node_rank: usize,
    /// Address of node 0, exported as `MASTER_ADDR`; node 0's launcher hosts the rendezvous
    /// store there (on that address only).
    pub master_addr: String,
    /// Rendezvous port exported as `MASTER_PORT`; 0 picks a free one (single node only).
    pub master_port: u16,
}
