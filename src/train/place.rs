//! A rank as the trainer sees it: its place among the ranks (`dist::Place`) and on the mesh
//! (`dist::Mesh`: tensor parallelism and the data ranks zero stages shard the state over), the
//! device it resolved and the tag its lines carry.

use anyhow::Result;
use tch::Device;

use super::device::resolve_device;
use crate::config::{Config, ConfigError};
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
        let mesh = mesh(cfg, place.rank, place.world)?;
        let device = resolve_device(cfg, place.world, place.local_rank)?;
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

/// Rank `rank`'s place on the mesh of `world` ranks (`dist::Mesh`: data × tensor ranks,
/// `system.tensor_parallel` innermost, hybrid sharding's `system.shard_degree` inside the data
/// ranks), checked against the world (`config::check_world`: a config error, exit 2).
pub fn mesh(cfg: &Config, rank: usize, world: usize) -> Result<Mesh, ConfigError> {
    let degree = crate::config::check_world(cfg, world)?;
    Ok(Mesh::new(
        rank,
        world,
        cfg.system.tensor_parallel,
        cfg.system.context_parallel,
        degree,
    ))
}
