//! What a checkpoint save costs: the bytes each rank writes, the host staging buffer of
//! `checkpoint.async`, and how long training stalls per save.
//!
//! A save writes the fp32 weights (4 B/param) and AdamW's two fp32 moments (8 B/param): 12·P
//! bytes (config.json and trainer.json are a few kB, not counted). With more than one rank
//! every rank writes a share at every zero stage (`train/checkpoint`), so W writing ranks
//! write 12·P/W each: W is the world, or with hybrid sharding (`system.shard_degree` = S) the
//! first shard group, W = S. The share is the mean: a rank writes whole parameters' weights
//! (those whose first element it holds, or at stage 0 a contiguous 1/W of them), so one rank
//! may write up to a parameter's 4 bytes × numel more.
//!
//! Synchronous (`checkpoint.async = false`), training stalls for the whole write: the busiest
//! node's bytes (its writing ranks' shares) over the node's storage bandwidth
//! (`lockstep plan --storage-gbps`, shared by the node's ranks; a figure for durable writes,
//! fsync included). Asynchronous, it stalls for the copy of the rank's share into its host
//! staging buffer (kept for the whole run: host memory on CPU, pinned host memory on CUDA) at
//! the copy bandwidths below, while a writer thread writes the node's bytes at the same storage
//! bandwidth; a save that comes before the previous one is written waits for the rest of it
//! (counted in the asynchronous stall). Where the fp32 master weights exist only as shards
//! (bf16 compute at zero stages 1 and 2, and stage 3) both kinds of save first all-gather them
//! in the shard group (4·P bytes, the ring's (S−1)/S of it sent per rank) at the plan's link
//! speed: folded into both stalls.
//!
//! With tensor parallelism (T) the ranks of a TP group hold different shares, so every one of
//! them writes: W is the shard group's data-parallel ranks times T (the first S·T ranks with
//! hybrid sharding), and the masters' gather runs among the data-parallel ranks on the rank's
//! TP share.

use serde::Serialize;

use super::comm;
use super::device::Device;
use super::setting::{Layout, Setting};
use crate::config::ZeroStage;

/// Bytes per parameter a save writes: fp32 weights (4) and AdamW's two fp32 moments (8).
pub const BYTES_PER_PARAM: f64 = 12.0;

/// Host-to-host copy into the staging buffer, bytes/s per CPU rank. An estimate: a memcpy on
/// one core of a current server streams about 10 GB/s.
pub const CPU_COPY_BW: f64 = 10e9;

/// Device-to-pinned-host copy into the staging buffer, bytes/s per GPU. An estimate: PCIe
/// Gen4 x16 carries about 25 GB/s, of which a device-to-host copy sustains about 20 (Gen5:
/// twice that).
pub const CUDA_COPY_BW: f64 = 20e9;

/// `lockstep plan --storage-gbps` default: GB/s one node writes durably to the checkpoint
/// storage, shared by its ranks. An estimate between a network filesystem (about 1 GB/s per
/// client) and a node's local NVMe drives (several GB/s).
pub const DEFAULT_STORAGE_GBPS: f64 = 2.0;

/// Host memory a save keeps free beside its staging copy, so the copy never brings on the OOM
/// killer (`Checkpointer` saves synchronously where the host lacks it).
pub const STAGING_HEADROOM: f64 = 1e9;

/// The cost of one checkpoint save of the configured layout.
#[derive(Debug, Clone, Serialize)]
pub struct Checkpoint {
    /// `checkpoint.async`.
    pub background: bool,
    /// `checkpoint.interval` (0 = only at the end).
    pub interval: usize,
    /// Ranks that write (the world, or the first shard group), and of them on the busiest node.
    pub writing_ranks: usize,
    pub writing_ranks_per_node: usize,
    /// Bytes of one save in all (12·P), from each writing rank (12·P/W), from the busiest node.
    pub bytes_per_save: f64,
    pub bytes_per_rank: f64,
    pub bytes_per_node: f64,
    /// Host memory of the staging buffers of a writing rank and of the busiest node (0 when
    /// `checkpoint.async` is off).
    pub staging_bytes_per_rank: f64,
    pub staging_bytes_per_node: f64,
    /// Whether the staging buffer is in the memory the per-rank estimate counts (CPU ranks).
    pub staging_in_rank_memory: bool,
    /// Bytes/s a node writes to storage, and a rank copies into its staging buffer.
    pub storage_bandwidth: f64,
    pub copy_bandwidth: f64,
    /// All-gather of the fp32 master weights before either kind of save (0 where a rank holds
    /// the whole fp32 weights).
    pub gather_seconds: f64,
    /// The node's bytes at the storage bandwidth: the synchronous write, or the writer thread's.
    pub write_seconds: f64,
    /// A rank's bytes at the copy bandwidth.
    pub copy_seconds: f64,
    /// Training stalled per save: synchronous (gather + write), asynchronous (gather + copy +
    /// any wait for the previous save's writer), and the configured one of the two.
    pub stall_sync_seconds: f64,
    pub stall_async_seconds: f64,
    pub stall_seconds: f64,
    /// Training between two saves at the estimated step time (None: one save, after the last
    /// step: `checkpoint.interval` is 0 or not below `training.max_steps`).
    pub seconds_between_saves: Option<f64>,
    /// Share of training time spent stalled by saves, synchronous, asynchronous and configured
    /// (None: one save, after the last step).
    pub time_lost_sync: Option<f64>,
    pub time_lost_async: Option<f64>,
    pub time_lost: Option<f64>,
}

/// Ranks that write a share of each save: the first shard group of every TP position, in every
/// pipeline stage.
pub fn writing_ranks(s: &Setting) -> usize {
    if s.world <= 1 {
        1
    } else {
        // Each pipeline stage's ranks write its own layers.
        s.pipeline_parallel * s.shard_ranks(s.world).max(1) * s.tensor_parallel
    }
}

/// Bytes of one save: the fp32 weights and the two moments (with Muon one momentum buffer for
/// each element of the decoder layers' matrices).
pub fn bytes_per_save(s: &Setting) -> f64 {
    let muon = match s.muon {
        Some(_) => 4.0 * super::muon::matrix_elements(s, 1),
        None => 0.0,
    };
    BYTES_PER_PARAM * s.parameters.count() as f64 - muon
}

/// Bytes one writing rank writes per save (the mean share).
pub fn bytes_per_rank(s: &Setting) -> f64 {
    bytes_per_save(s) / writing_ranks(s) as f64
}

/// Host memory a writing rank keeps for `checkpoint.async`'s staging copy (0 when off).
pub fn staging_per_rank(s: &Setting) -> f64 {
    if s.ckpt_async {
        bytes_per_rank(s)
    } else {
        0.0
    }
}

/// Writing ranks on the node that has the most: the writers are ranks 0 to W−1, nodes hold
/// `node_size` consecutive ranks.
pub fn writing_ranks_per_node(s: &Setting) -> usize {
    writing_ranks(s).min(s.node_size.max(1))
}

/// Whether a save first gathers full fp32 master weights from shards: bf16 compute at zero
/// stages 1 and 2 (the working weights are bf16), and stage 3 (no full weights are kept).
pub fn gathers_masters(s: &Setting, stage: ZeroStage) -> bool {
    stage.shards_parameters() || (stage.shards_optimizer() && s.bf16)
}

/// Seconds of the fp32 masters' all-gather (of the rank's TP share) in the shard group before
/// a save.
pub fn gather_seconds(s: &Setting, stage: ZeroStage) -> f64 {
    let shard = s.shard_ranks(s.world).max(1);
    if !gathers_masters(s, stage) || shard <= 1 {
        return 0.0;
    }
    let ring = (shard as f64 - 1.0) / shard as f64;
    // A pipeline rank's TP share is about 1/P of the model's.
    let share = super::tensor::share(s).parameters / s.pipeline_parallel as f64;
    ring * 4.0 * share / comm::data_parallel_bandwidth(s, shard)
}

/// Bytes/s a rank copies into its staging buffer.
pub fn copy_bandwidth(device: Device) -> f64 {
    match device {
        Device::Cpu => CPU_COPY_BW,
        Device::Cuda => CUDA_COPY_BW,
    }
}

/// The cost of saving the layout `l`, at `step_seconds` per step.
pub fn build(s: &Setting, l: &Layout, step_seconds: f64) -> Checkpoint {
    let per_rank = bytes_per_rank(s);
    let per_node_ranks = writing_ranks_per_node(s);
    let per_node = per_rank * per_node_ranks as f64;
    let staging = staging_per_rank(s);
    let copy_bandwidth = copy_bandwidth(s.device);
    let gather = gather_seconds(s, l.zero_stage);
    let write = per_node / s.storage_bw;
    let copy = per_rank / copy_bandwidth;
    let between = s
        .saves_between_steps()
        .then_some(s.ckpt_interval as f64 * step_seconds);
    let stall_sync = gather + write;
    // The writer has the training between two saves to finish; what it needs beyond that,
    // the next save waits for.
    let stall_async = gather + copy + between.map_or(0.0, |b| (write - b).max(0.0));
    let share = |stall: f64| between.map(|b| stall / (b + stall));
    let stall = if s.ckpt_async {
        stall_async
    } else {
        stall_sync
    };
    Checkpoint {
        background: s.ckpt_async,
        interval: s.ckpt_interval,
        writing_ranks: writing_ranks(s),
        writing_ranks_per_node: per_node_ranks,
        bytes_per_save: bytes_per_save(s),
        bytes_per_rank: per_rank,
        bytes_per_node: per_node,
        staging_bytes_per_rank: staging,
        staging_bytes_per_node: staging * per_node_ranks as f64,
        staging_in_rank_memory: s.device == Device::Cpu,
        storage_bandwidth: s.storage_bw,
        copy_bandwidth,
        gather_seconds: gather,
        write_seconds: write,
        copy_seconds: copy,
        stall_sync_seconds: stall_sync,
        stall_async_seconds: stall_async,
        stall_seconds: stall,
        seconds_between_saves: between,
        time_lost_sync: share(stall_sync),
        time_lost_async: share(stall_async),
        time_lost: share(stall),
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_setting;
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-9 * b.abs().max(1.0)
    }

    /// Llama-3.1-8B's dimensions with 8 layers and its 128,256-id vocabulary on `world` GPUs.
    fn setting(extra: &[&str], world: usize) -> (Setting, Layout) {
        let mut sets = vec!["model.num_layers=8", "model.vocab_size=128256"];
        sets.extend(extra);
        test_setting(&sets, world)
    }

    #[test]
    fn every_rank_writes_and_stages_12_bytes_per_parameter_over_the_writers() {
        for (sets, world, writers) in [
            (vec![], 1, 1),
            (vec!["system.zero_stage=0"], 8, 8),
            (vec!["system.zero_stage=1"], 16, 16),
            (vec!["system.zero_stage=3", "system.shard_degree=4"], 16, 4),
            // Every rank of a TP group holds its own share: all write.
            (vec!["system.tensor_parallel=8"], 16, 16),
            // The first shard group (2 data-parallel ranks) of each of the 2 TP positions.
            (
                vec![
                    "system.zero_stage=3",
                    "system.shard_degree=2",
                    "system.tensor_parallel=2",
                ],
                16,
                4,
            ),
        ] {
            let (s, l) = setting(&sets, world);
            let p = s.parameters.count() as f64;
            let c = build(&s, &l, 1.0);
            assert_eq!(c.writing_ranks, writers, "{sets:?}");
            assert!(close(c.bytes_per_save, 12.0 * p));
            assert!(close(c.bytes_per_rank, 12.0 * p / writers as f64));
            assert!(c.background, "checkpoint.async is on by default");
            assert_eq!(c.staging_bytes_per_rank, c.bytes_per_rank);
            // Nodes of 8 GPUs: the first node holds up to 8 writers.
            assert_eq!(c.writing_ranks_per_node, writers.min(8));
            assert!(close(
                c.staging_bytes_per_node,
                c.bytes_per_rank * writers.min(8) as f64
            ));
            assert!(
                !c.staging_in_rank_memory,
                "pinned host memory, not the GPU's"
            );
        }
        let (s, l) = setting(&["checkpoint.async=false"], 8);
        let c = build(&s, &l, 1.0);
        assert_eq!(c.staging_bytes_per_rank, 0.0);
        assert_eq!(c.stall_seconds, c.stall_sync_seconds);
    }

    #[test]
    fn a_synchronous_save_stalls_for_the_write_an_asynchronous_one_for_the_copy() {
        let (mut s, l) = setting(&["system.zero_stage=0", "checkpoint.interval=10"], 8);
        let c = build(&s, &l, 2.0);
        let node = 12.0 * s.parameters.count() as f64;
        assert_eq!(c.gather_seconds, 0.0, "stage 0 holds the fp32 weights");
        assert!(close(c.write_seconds, node / 2e9));
        assert!(close(c.stall_sync_seconds, c.write_seconds));
        assert!(close(c.stall_async_seconds, node / 8.0 / CUDA_COPY_BW));
        assert_eq!(c.stall_seconds, c.stall_async_seconds);
        assert_eq!(c.seconds_between_saves, Some(20.0));
        let lost = c.stall_sync_seconds / (20.0 + c.stall_sync_seconds);
        assert!(close(c.time_lost_sync.unwrap(), lost));
        // Twice the storage bandwidth halves the synchronous stall, not the asynchronous one.
        s.storage_bw *= 2.0;
        let fast = build(&s, &l, 2.0);
        assert!(close(fast.stall_sync_seconds, c.stall_sync_seconds / 2.0));
        assert_eq!(fast.stall_async_seconds, c.stall_async_seconds);
        // Saves closer together than the writer needs: the next save waits for the rest.
        s.ckpt_interval = 1;
        let tight = build(&s, &l, 2.0);
        assert!(close(
            tight.stall_async_seconds,
            fast.copy_seconds + fast.write_seconds - 2.0
        ));
        // One save, after the last step: no share of the training time.
        s.ckpt_interval = 0;
        assert_eq!(build(&s, &l, 2.0).time_lost, None);
        s.ckpt_interval = s.max_steps;
        assert_eq!(build(&s, &l, 2.0).seconds_between_saves, None);
    }

    #[test]
    fn sharded_fp32_masters_are_gathered_before_either_save() {
        let (s, l) = setting(&["system.zero_stage=3"], 8);
        let c = build(&s, &l, 1.0);
        let p = s.parameters.count() as f64;
        let gather = 7.0 / 8.0 * 4.0 * p / s.intra_bw;
        assert!(close(c.gather_seconds, gather));
        assert!(close(c.stall_sync_seconds, gather + c.write_seconds));
        assert!(close(c.stall_async_seconds, gather + c.copy_seconds));
        // bf16 at stage 1 gathers the master shards too; fp32 at stage 1 has them whole.
        assert!(gathers_masters(&s, ZeroStage::Optimizer));
        let (fp32, _) = setting(&["training.dtype=fp32"], 8);
        assert!(!gathers_masters(&fp32, ZeroStage::Optimizer));
        assert!(gathers_masters(&fp32, ZeroStage::Parameters));
    }
}
