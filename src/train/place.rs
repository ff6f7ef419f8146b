//! A rank as the trainer sees it: its place among the ranks (`dist::Place`) and on the mesh
//! (`dist::Mesh`: tensor parallelism and the data ranks zero stages shard the state over), the
//! device it resolved and the tag its lines carry.

use anyhow::Result;
use tch::Device;

use super::device::resolve_device;
use crate::config::{check_ranks, Config};
use crate::dist::{Mesh, Place};

/// A rank as the trainer sees it: its place, the device it resolved once at start, and the tag
/// (`[GPU3]`, `[CPU1]`) its lines carry.
#[derive(Debug, Clone)]
pub struct Rank {
    pub place: Place,
    /// Its coordinates on the mesh of data × tensor ranks (`system.tensor_parallel`).
    pub mesh: Mesh,
    pub device: Device,
    pub tag: String,
}

impl Rank {
    /// Resolves this rank's device (`system.device`) once; everything after uses `device`.
    pub fn new(cfg: &Config, place: Place) -> Result<Rank> {
        let device = resolve_device(cfg, place.world, place.local_rank)?;
        let runs_on = format!(
            "this rank runs on the CPU (system.device = {})",
            cfg.system.device
        );
        let degree = check_ranks(cfg, place.world, device.is_cuda(), &runs_on)?;
        crate::config::check_trains(cfg)?;
        let mesh = Mesh::new(
            place.rank,
            place.world,
            cfg.system.tensor_parallel,
            cfg.system.context_parallel,
            degree,
        )
        .with_expert(cfg.system.expert_parallel);
        let tag = crate::telemetry::rank_tag(device.is_cuda(), place.rank);
        if place.world > 1 {
            crate::telemetry::set_process_tag(&tag);
        }
        Ok(Rank {
            place,
            mesh,
            device,
            tag,
        })
    }

    /// Rank 0: the one that prints the run's summary and writes its records and checkpoints.
    pub fn lead(&self) -> bool {
        self.place.rank == 0
    }
}
