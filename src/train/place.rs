//! A rank as the trainer sees it: its place among the ranks (`dist::Place`), the device it
//! resolved and the tag its lines carry; and the groups zero stages shard the state over
//! (`system.shard_degree`).

use anyhow::Result;
use tch::Device;

use super::device::resolve_device;
use crate::config::{Config, ConfigError};
use crate::dist::Place;

/// A rank as the trainer sees it: its place, the device it resolved once at start, and the tag
/// (`[GPU3]`, `[CPU1]`) its lines carry.
#[derive(Debug, Clone)]
pub struct Rank {
    pub place: Place,
    pub device: Device,
    pub tag: String,
}

impl Rank {
    /// Resolves this rank's device (`system.device`) once; everything after uses `device`.
    pub fn new(cfg: &Config, place: Place) -> Result<Rank> {
        let device = resolve_device(cfg, place.world, place.local_rank)?;
        let tag = crate::telemetry::rank_tag(device.is_cuda(), place.rank);
        if place.world > 1 {
            crate::telemetry::set_process_tag(&tag);
        }
        Ok(Rank { place, device, tag })
    }

    /// Rank 0: the one that prints the run's summary and writes its records and checkpoints.
    pub fn lead(&self) -> bool {
        self.place.rank == 0
    }
}

/// The ranks that shard one copy of the state among `world` (`system.shard_degree`, 0 = all),
/// checked against the world and the stage (`config::check_world`): a config error (exit 2),
/// found at start-up.
pub fn shard_degree(cfg: &Config, world: usize) -> Result<usize, ConfigError> {
    crate::config::check_world(cfg, world)
}

/// Hybrid sharding's groups (`system.shard_degree` below the world size), formed by every rank
/// together, shard groups first; None when one group shards across all ranks.
pub fn hybrid_groups(
    cfg: &Config,
    pg: &mut dyn crate::dist::ProcessGroup,
) -> Result<Option<crate::train::optim::Hybrid>> {
    use std::sync::{Arc, Mutex};
    let (world, rank) = (pg.world_size(), pg.rank());
    let degree = shard_degree(cfg, world)?;
    if degree == world {
        return Ok(None);
    }
    let index = rank / degree;
    let shard: Vec<usize> = (index * degree..(index + 1) * degree).collect();
    let shard = pg.subgroup(&shard, &format!("shard{index}"))?;
    let position = rank % degree;
    let replica: Vec<usize> = (0..world / degree).map(|g| g * degree + position).collect();
    let replica = pg.subgroup(&replica, &format!("replica{position}"))?;
    Ok(Some(crate::train::optim::Hybrid {
        shard: Arc::new(Mutex::new(shard)),
        replica: Arc::new(Mutex::new(replica)),
        index,
    }))
}
