//! What the launcher is asked to do on this node: the devices, the node's place, the
//! restarts, the logs.

use std::path::PathBuf;
use std::time::Duration;

use crate::dist::NodePlace;

/// Which devices the workers of this node run on; one worker per entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Devices {
    /// `n` CPU workers; each gets `CUDA_VISIBLE_DEVICES=""` so it never touches a GPU.
    Cpu(usize),
    /// One worker per physical GPU index (PCI bus order, as `nvidia-smi` lists them);
    /// local rank `i` gets `CUDA_VISIBLE_DEVICES=<ids[i]>`.
    Gpus(Vec<usize>),
}

impl Devices {
    /// Number of workers on this node.
    pub fn local_world(&self) -> usize {
        match self {
            Devices::Cpu(n) => *n,
            Devices::Gpus(ids) => ids.len(),
        }
    }
}

/// Everything the launcher needs to start this node's workers.
#[derive(Debug, Clone)]
pub struct LaunchPlan {
    /// Devices of this node (decides the number of local workers).
    pub devices: Devices,
    /// This node's place among the nodes and node 0's rendezvous address.
    pub node: NodePlace,
    /// How long a node waits for node 0's launcher (to connect, and for its decisions).
    pub rendezvous_timeout: Duration,
    /// Restarts after failures, and what they resume from.
    pub restart: RestartPolicy,
    /// Directory for `rank_<global rank>.log`, usually `logs/<run-id>/`; created if missing.
    pub log_dir: PathBuf,
    /// Time between SIGTERM and SIGKILL when the workers are stopped, after a worker failed
    /// or the launcher got SIGINT/SIGTERM (a second SIGINT/SIGTERM skips the wait).
    pub grace: Duration,
    /// Show every rank's lines on the console; otherwise rank 0 of node 0 in full and only
    /// warning/error-looking lines of the other ranks.
    pub log_ranks: LogRanks,
}

/// Which workers' lines the launcher shows on its console (every line goes to the rank's log).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogRanks {
    /// Rank 0's lines, and the other ranks' warnings and errors.
    Rank0,
    /// Every rank's lines.
    All,
}

/// The run's restart settings (`--max-restarts` and what a restart resumes from).
#[derive(Debug, Clone, Default)]
pub struct RestartPolicy {
    /// Restarts allowed after failures (0 = stop at the first failure).
    pub max_restarts: usize,
    /// The run's checkpoint directory, to say which step a restart resumes from.
    pub checkpoints: Option<PathBuf>,
    /// Where the first attempt resumed from (`--resume DIR`), for a restart before the run
    /// wrote a checkpoint of its own.
    pub resume_fallback: Option<PathBuf>,
}
