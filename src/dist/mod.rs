//! Distributed communication: rendezvous, rank layout and CPU collectives.
//!
//! Design:
//! - **Rendezvous** goes through libtorch's own `c10d::TCPStore` (C++ shim in
//!   `csrc/c10d_store.cpp`, wrapped by [`store::Store`]). Using the real TCPStore rather than a
//!   home-grown key-value server means torchrun's elastic agent store
//!   (`TORCHELASTIC_USE_AGENT_STORE=True`) works unchanged: every rank is then a client of the
//!   store the agent already hosts. Otherwise rank 0 hosts it at `MASTER_ADDR:MASTER_PORT`.
//! - **CPU collectives** are a ring over plain TCP written in Rust ([`ring::RingGroup`]). The
//!   PyPI torch wheel ships no gloo headers, and Debian's `libgloo-dev` is an older gloo than
//!   the one compiled into torch 2.11, so building `ProcessGroupGloo` against it would risk ODR
//!   / ABI mismatches inside one process. A ring all-reduce is bandwidth-optimal, small, and
//!   lets every failure name the rank responsible.
//! - **CUDA collectives** are NCCL through libtorch's `ProcessGroupNCCL` ([`nccl::NcclGroup`],
//!   the reasons are in its module docs): gradients and parameters are reduced on the GPU,
//!   while scalars and barriers stay on the CPU ring, whose timeouts name the missing rank.
//!   The NCCL communicator bootstraps through the same store.
//!
//! - **Subgroups** ([`ProcessGroup::subgroup`]: hybrid sharding's shard and replica groups) are
//!   rings of their own through the same store under their own keys, with an NCCL
//!   communicator over them on CUDA ranks. Their errors name the subgroup and the ranks'
//!   global numbers, and their collectives are in the hang history as `op@tag`, numbered in
//!   their group.
//!
//! - **Versions** ([`versions`]): before any collective, the ranks compare lockstep, libtorch,
//!   CUDA and NCCL versions through the store, and a difference stops them all at once.
//!
//! Where a rank sits: [`place`] (what [`env`] reads from torchrun's variables and [`slurm`]
//! from srun's). Entry point: [`env::DistEnv::from_env`] then [`init`]. Gradients are reduced by
//! `train::optim::reduce` as backward finishes them, through [`overlap::with_queue`].

pub mod buckets;
pub mod env;
pub mod flat_layout;
pub mod forensics;
pub mod group;
pub mod mesh;
pub mod nccl;
pub mod overlap;
pub mod owners;
pub mod pipeline;
pub mod place;
pub mod ring;
pub mod single_rank;
pub mod slurm;
pub mod store;
pub mod versions;

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

pub use env::DistEnv;
pub use group::{on_group, ProcessGroup, SharedGroup, SingleProcess};
pub use mesh::{ExpertGroups, Mesh, MeshGroups};
pub use place::{NodePlace, Place};
pub use ring::{RingConfig, RingGroup};
pub(crate) use single_rank::SINGLE_RANK_ADDR;
pub use store::{free_port, Store, StoreError, StoreErrorKind};

/// Which collectives carry the tensors of a multi-rank group (`system.dist_backend`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// The Rust TCP ring for everything.
    Ring,
    /// NCCL for tensors on this CUDA device; the ring for host scalars and barriers.
    Nccl { cuda_device: usize },
}

/// How long rank 0 waits at the rendezvous before it says which ranks have not arrived.
const ROLL_CALL_NOTICE: Duration = Duration::from_secs(10);

/// Every rank checks in at the store; rank 0 waits until all have. After [`ROLL_CALL_NOTICE`]
/// it says which ranks are missing and how ranks are started (a batch script that ran
/// `lockstep train` without srun starts task 0 only), and after `timeout` it fails with the
/// same.
fn roll_call(store: &Store, env: &DistEnv, timeout: Duration) -> Result<()> {
    let prefix = format!("lockstep/{}/arrived/", env.restart_count);
    let (rank, world) = (env.place.rank, env.place.world);
    store.set(&format!("{prefix}{rank}"), b"1")?;
    store.add(&format!("{prefix}count"), 1)?;
    if rank != 0 {
        return Ok(());
    }
    let missing = || -> Result<String> {
        let mut absent = Vec::new();
        for r in 1..world {
            if !store.check(&[&format!("{prefix}{r}")])? {
                absent.push(r.to_string());
            }
        }
        let n = absent.len();
        absent.truncate(8);
        let more = match n.saturating_sub(8) {
            0 => String::new(),
            k => format!(" and {k} more"),
        };
        Ok(format!("rank {}{more} of {world}", absent.join(", ")))
    };
    let started = Instant::now();
    let mut said = false;
    while (store.add(&format!("{prefix}count"), 0)? as usize) < world {
        let waited = started.elapsed();
        if waited > timeout {
            bail!(
                "{} never arrived at the rendezvous on {}:{} within {} s \
                 (system.collective_timeout_s); {}",
                missing()?,
                env.master_addr,
                env.master_port,
                timeout.as_secs(),
                env.missing_ranks_hint()
            );
        }
        if !said && waited >= ROLL_CALL_NOTICE {
            said = true;
            let tag = forensics::global().map_or_else(|| "[rank 0]".into(), |f| f.tag());
            println!(
                "{tag} Rendezvous: waiting for {} for {} s now (up to {} s, \
                 system.collective_timeout_s); {}",
                missing()?,
                waited.as_secs(),
                timeout.as_secs(),
                env.missing_ranks_hint()
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    Ok(())
}

/// Builds the process group for `env`: [`SingleProcess`] for a world of one; otherwise rank 0
/// hosts the store at `MASTER_ADDR:MASTER_PORT` (unless torchrun's agent hosts it), the other
/// ranks connect to it, all join a [`RingGroup`], and with [`Backend::Nccl`] an NCCL group on
/// top. `timeout` bounds the rendezvous, each blocking store read, and how long a collective
/// may wait without progress.
///
/// The store lives as long as the returned group; rank 0's group must outlive the others' use
/// of the store, so end a run with a final `barrier()` before dropping the group.
pub fn init(env: &DistEnv, timeout: Duration, backend: Backend) -> Result<Box<dyn ProcessGroup>> {
    if env.place.world == 1 {
        return Ok(Box::new(SingleProcess));
    }
    let (addr, port) = (env.master_addr.as_str(), env.master_port);
    let host_here = env.place.rank == 0 && !env.agent_store;
    let store = if host_here {
        if env.place.world > env.place.local_world {
            store::check_reachable_name(addr)?;
        }
        Store::server(addr, port, env.place.world, timeout)?
    } else {
        Store::client(addr, port, timeout).with_context(|| {
            format!(
                "rank {} cannot reach the rendezvous store at {addr}:{port}; is {} running?",
                env.place.rank,
                if env.agent_store {
                    "the torchrun agent"
                } else {
                    "rank 0"
                }
            )
        })?
    };
    roll_call(&store, env, timeout)?;
    let cfg = RingConfig {
        // The agent store outlives worker restarts; namespacing by restart keeps a new attempt
        // from reading the dead attempt's addresses and sequence numbers.
        key_prefix: format!("lockstep/{}/ring/", env.restart_count),
        store_owner: if env.agent_store && env.lockstep_launcher {
            format!("the lockstep run launcher of node 0 on {addr}")
        } else if env.agent_store {
            format!("the torchrun agent on {addr}")
        } else {
            format!("rank 0 on {addr}")
        },
        subgroup: None,
    };
    if env.place.rank == 0 && matches!(backend, Backend::Nccl { .. }) {
        // ProcessGroupNCCL's monitor polls this key at the store's root (below any prefix): a
        // previous torchrun attempt's timeout would make this attempt dump and terminate. The
        // ring's formation below is a rendezvous, so no rank's NCCL group exists yet.
        store.delete(nccl::DUMP_SIGNAL_KEY)?;
    }
    let store = Arc::new(store);
    let mut ring =
        RingGroup::with_config(store.clone(), env.place.rank, env.place.world, timeout, cfg)?;
    agree_on_backend(&mut ring, backend)?;
    let nccl = matches!(backend, Backend::Nccl { .. });
    let mine = versions::Versions::here(env.place.rank, nccl);
    let prefix = format!("lockstep/{}/", env.restart_count);
    versions::agree(&store, &prefix, env.place.world, &mine)?;
    let next_seq = ring.collectives_started() + 1;
    let group: Box<dyn ProcessGroup> = match backend {
        Backend::Ring => Box::new(ring),
        Backend::Nccl { cuda_device } => {
            let prefix = format!("lockstep/{}/nccl", env.restart_count);
            Box::new(nccl::NcclGroup::new(
                store,
                ring,
                cuda_device,
                &prefix,
                timeout,
            )?)
        }
    };
    // Every collective from here on is recorded for the hang forensics, numbered on from the
    // ring's own count so that its error messages ("all-reduce #57 timed out") and the history
    // agree on the CPU ring.
    Ok(match forensics::global() {
        Some(log) => {
            log.continue_numbering_at(next_seq);
            Box::new(forensics::Traced::new(group, log))
        }
        None => group,
    })
}

/// Every rank must pick the same backend and be able to use it before any rank enters NCCL's
/// communicator setup, which has no timeout: a rank whose GPU did not come up (auto → ring) or
/// whose NCCL shim does not load would otherwise leave the others blocked there for good.
fn agree_on_backend(ring: &mut RingGroup, backend: Backend) -> Result<()> {
    let code = f64::from(u8::from(matches!(backend, Backend::Nccl { .. })));
    let (hi, lo) = (
        ring.all_reduce_max_f64(code)?,
        -ring.all_reduce_max_f64(-code)?,
    );
    anyhow::ensure!(
        hi == lo,
        "rank {}: ranks disagree on the collectives: some use NCCL (CUDA), some the TCP ring \
         (CPU); does every rank see a GPU? set system.device and system.dist_backend explicitly",
        ring.rank()
    );
    if code == 0.0 {
        return Ok(());
    }
    let local = nccl::version().err();
    let failed = if local.is_some() {
        ring.rank() as f64
    } else {
        -1.0
    };
    let worst = ring.all_reduce_max_f64(failed)?;
    match local {
        Some(e) => Err(e),
        None if worst >= 0.0 => anyhow::bail!(
            "rank {}: rank {worst} cannot load the NCCL backend (see its log); no rank starts NCCL",
            ring.rank()
        ),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `f` on one thread per rank of a loopback world, with the environment `lockstep run`
    /// (or, with `agent_restart`, torchrun's agent on its Nth restart) would give each rank.
    fn each_rank<T: Send>(
        world: usize,
        port: u16,
        agent_restart: Option<u64>,
        f: impl Fn(DistEnv) -> T + Sync,
    ) -> Vec<T> {
        let f = &f;
        std::thread::scope(|s| {
            let hs: Vec<_> = (0..world)
                .map(|rank| {
                    s.spawn(move || {
                        f(DistEnv {
                            place: Place {
                                rank,
                                world,
                                local_rank: rank,
                                local_world: world,
                            },
                            master_addr: "127.0.0.1".into(),
                            master_port: port,
                            agent_store: agent_restart.is_some(),
                            restart_count: agent_restart.unwrap_or(0),
                            lockstep_launcher: false,
                            slurm: false,
                            note: None,
                        })
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn init_builds_a_working_group_per_rank() {
        let sums = each_rank(3, free_port(), None, |env| {
            let mut g = init(&env, Duration::from_secs(10), Backend::Ring).unwrap();
            assert_eq!((g.rank(), g.world_size()), (env.place.rank, 3));
            let mut v = vec![env.place.rank as f32; 5];
            g.all_reduce_sum_f32(&mut v).unwrap();
            g.barrier().unwrap();
            v
        });
        for v in sums {
            assert_eq!(v, [3.0; 5]);
        }
    }

    /// Ranks of one world on different backends (a rank whose GPU did not come up picks the
    /// ring under `auto`) must all fail with a message, not block in NCCL's setup.
    #[test]
    fn ranks_that_disagree_on_the_backend_all_fail() {
        let errors = each_rank(2, free_port(), None, |env| {
            let backend = if env.place.rank == 0 {
                Backend::Nccl { cuda_device: 0 }
            } else {
                Backend::Ring
            };
            init(&env, Duration::from_secs(10), backend)
                .err()
                .map(|e| e.to_string())
        });
        for e in errors {
            let e = e.expect("a mixed world must not start");
            assert!(e.contains("ranks disagree on the collectives"), "{e}");
        }
    }

    #[test]
    fn init_single_process() {
        let env = DistEnv::from_lookup(|k| match k {
            "RANK" => Some("0".into()),
            "WORLD_SIZE" => Some("1".into()),
            _ => None,
        })
        .unwrap()
        .unwrap();
        let g = init(&env, Duration::from_secs(1), Backend::Ring).unwrap();
        assert_eq!(g.world_size(), 1);
    }

    #[test]
    fn init_with_agent_store_makes_rank0_a_client() {
        // Simulate torchrun's agent: someone else hosts the store; rank 0 must not try to.
        let agent = Store::server("127.0.0.1", 0, 2, Duration::from_secs(10)).unwrap();
        let maxima = each_rank(2, agent.port(), Some(1), |env| {
            let mut g = init(&env, Duration::from_secs(10), Backend::Ring).unwrap();
            g.all_reduce_max_f64(env.place.rank as f64).unwrap()
        });
        assert_eq!(maxima, [1.0, 1.0]);
        assert!(agent.check(&["lockstep/1/ring/nonce"]).unwrap());
    }
}
