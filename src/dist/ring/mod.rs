//! CPU collectives as a ring over plain TCP, bootstrapped through the [`Store`].
//!
//! Topology: rank `r` holds one connection to `r+1` (it only writes to it) and one from `r-1`
//! (it only reads from it). The pieces:
//! - [`wire`](self::wire): the handshake and message framing;
//! - [`bootstrap`](self::bootstrap): sockets, the run nonce, connecting the ring;
//! - [`collectives`](self::collectives): all-reduce, broadcast, maximum and barrier;
//! - [`diagnose`](self::diagnose): turning a failed step into an error that names the rank
//!   responsible (or the store host).
//!
//! After any failure the group is poisoned: the byte streams may be out of step, so every later
//! call fails with the original message.

mod bootstrap;
mod collectives;
mod diagnose;
mod wire;

use std::net::{Shutdown, TcpStream};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, ensure, Context, Result};

use super::store::Store;

/// Settings beyond the basics of [`RingGroup::new`].
#[derive(Debug, Clone)]
pub struct RingConfig {
    /// Namespace of this group's store keys. Must differ between groups sharing a store, and
    /// between restarts that reuse a store (torchrun's agent store survives worker restarts).
    pub key_prefix: String,
    /// Who hosts the store, for error messages ("rank 0", "the torchrun agent on node0").
    pub store_owner: String,
    /// A subgroup's tag and the global rank of each of its positions, so its messages name
    /// ranks as every other message does; None for the world's ring.
    pub subgroup: Option<(String, Vec<usize>)>,
}

impl Default for RingConfig {
    fn default() -> Self {
        RingConfig {
            key_prefix: "ring/".to_owned(),
            store_owner: "rank 0".to_owned(),
            subgroup: None,
        }
    }
}

/// A process group whose collectives run over a TCP ring. See the module docs.
pub struct RingGroup {
    store: Arc<Store>,
    rank: usize,
    world: usize,
    timeout: Duration,
    cfg: RingConfig,
    /// Connection to `rank + 1`, write-only. `None` in a world of one.
    next: Option<TcpStream>,
    /// Connection from `rank - 1`, read-only. `None` in a world of one.
    prev: Option<TcpStream>,
    /// Number of the collective in progress (or last finished); the first is #1.
    seq: u64,
    /// Receive buffer for reduce-scatter, kept to avoid reallocating per call.
    scratch: Vec<f32>,
    /// Payload bytes this rank has sent to its successor, all collectives together.
    sent: u64,
    /// Set after a failure: the message every later call returns.
    broken: Option<String>,
}

fn fmt_secs(d: Duration) -> String {
    let s = d.as_secs_f64();
    if (s - s.round()).abs() < 1e-9 {
        format!("{s:.0} s")
    } else {
        format!("{s:.1} s")
    }
}

impl RingGroup {
    /// Joins the ring of `world` ranks as `rank`, with default [`RingConfig`]. Every rank must
    /// call this (on its own `Store` handle or a shared one) within `timeout` of the others.
    /// `timeout` also bounds how long any collective waits without progress.
    pub fn new(
        store: Arc<Store>,
        rank: usize,
        world: usize,
        timeout: Duration,
    ) -> Result<RingGroup> {
        Self::with_config(store, rank, world, timeout, RingConfig::default())
    }

    /// [`RingGroup::new`] with explicit key prefix and store-owner description.
    pub fn with_config(
        store: Arc<Store>,
        rank: usize,
        world: usize,
        timeout: Duration,
        cfg: RingConfig,
    ) -> Result<RingGroup> {
        ensure!(world >= 1, "a ring needs at least one rank");
        ensure!(
            rank < world,
            "rank {rank} out of range for a world of {world}"
        );
        ensure!(
            world <= u32::MAX as usize,
            "world of {world} ranks is too large"
        );
        let mut g = RingGroup {
            store,
            rank,
            world,
            timeout,
            cfg,
            next: None,
            prev: None,
            seq: 0,
            scratch: Vec::new(),
            sent: 0,
            broken: None,
        };
        if world > 1 {
            g.bootstrap()
                .with_context(|| format!("rank {rank} could not join the ring of {world} ranks"))?;
        }
        Ok(g)
    }

    /// The ring of `members` (see `ProcessGroup::subgroup`), formed through the same store under
    /// keys of its own. Its errors name the subgroup and the ranks' global numbers.
    pub fn split(&self, members: &[usize], tag: &str) -> Result<RingGroup> {
        let rank = super::group::position_in(members, self.rank, tag)?;
        let global: Vec<usize> = members.iter().map(|&m| self.global(m)).collect();
        let cfg = RingConfig {
            key_prefix: format!("{}{tag}/", self.cfg.key_prefix),
            store_owner: self.cfg.store_owner.clone(),
            subgroup: Some((tag.to_string(), global.clone())),
        };
        RingGroup::with_config(self.store.clone(), rank, members.len(), self.timeout, cfg)
            .with_context(|| format!("subgroup {tag} of ranks {global:?}"))
    }

    /// The global rank of position `pos` of this ring (the same number in the world's ring).
    pub(super) fn global(&self, pos: usize) -> usize {
        match &self.cfg.subgroup {
            Some((_, ranks)) => ranks.get(pos).copied().unwrap_or(pos),
            None => pos,
        }
    }

    /// " in subgroup shard0 (ranks [0, 1])" for a subgroup's messages; empty for the world's.
    pub(super) fn where_(&self) -> String {
        match &self.cfg.subgroup {
            Some((tag, ranks)) => format!(" in subgroup {tag} (ranks {ranks:?})"),
            None => String::new(),
        }
    }

    /// The store and a key prefix of this ring's own, for `ProcessGroup::side_store`.
    pub fn side_store(&self) -> (Arc<Store>, String) {
        (self.store.clone(), self.key("side/"))
    }

    /// How many collectives this group has started (the number of the last one).
    pub fn collectives_started(&self) -> u64 {
        self.seq
    }

    fn key(&self, what: &str) -> String {
        format!("{}{what}", self.cfg.key_prefix)
    }

    /// Starts collective `what`: refuses on a broken group, bumps and records the sequence number.
    fn begin(&mut self, what: &str) -> Result<()> {
        if let Some(m) = &self.broken {
            bail!("the process group is unusable after an earlier failure: {m}");
        }
        self.seq += 1;
        if self.world == 1 {
            return Ok(());
        }
        let key = self.key(&format!("seq/{}", self.rank));
        if let Err(e) = self.store.set(&key, self.seq.to_string().as_bytes()) {
            let why = self.store_gone(&e).unwrap_or_else(|| format!("{e:#}"));
            let m = format!("{what} #{} could not start: {why}", self.seq);
            self.poison(&m);
            bail!(m);
        }
        Ok(())
    }

    fn poison(&mut self, msg: &str) {
        self.broken = Some(msg.to_owned());
        // Wake neighbours blocked on us now rather than after their timeout.
        for s in [&self.next, &self.prev].into_iter().flatten() {
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

impl std::fmt::Debug for RingGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RingGroup")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("seq", &self.seq)
            .field("broken", &self.broken.is_some())
            .finish()
    }
}

#[cfg(test)]
pub(crate) mod tests;
