//! CPU ranks on threads of this process, joined by the TCP ring: what the model-level tests of
//! tensor and context parallelism run on.

use std::time::Duration;

use lockstep::dist::{self, Backend, DistEnv, Place, ProcessGroup};
use tch::{Kind, Tensor};

/// Runs `f(group)` on one thread per rank of a loopback world of `world`, then a barrier: rank
/// 0 hosts the store, which must outlive the others' collectives.
pub fn each_rank<T: Send>(world: usize, f: impl Fn(&mut dyn ProcessGroup) -> T + Sync) -> Vec<T> {
    let port = dist::free_port();
    let f = &f;
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..world)
            .map(|rank| {
                s.spawn(move || {
                    let env = DistEnv {
                        place: Place {
                            rank,
                            world,
                            local_rank: rank,
                            local_world: world,
                        },
                        master_addr: "127.0.0.1".into(),
                        master_port: port,
                        agent_store: false,
                        restart_count: 0,
                        lockstep_launcher: false,
                        slurm: false,
                        note: None,
                    };
                    let mut pg = dist::init(&env, Duration::from_secs(60), Backend::Ring).unwrap();
                    let out = f(&mut *pg);
                    pg.barrier().unwrap();
                    out
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// A tensor as plain data, to hand to the rank threads (tch tensors are not `Sync`).
pub struct Plain(pub Vec<i64>, pub Vec<f64>, pub Kind);

impl Plain {
    pub fn of(t: &Tensor) -> Plain {
        let data = Vec::<f64>::try_from(t.to_kind(Kind::Double).reshape(-1)).unwrap();
        Plain(t.size(), data, t.kind())
    }

    pub fn tensor(&self) -> Tensor {
        Tensor::from_slice(&self.1)
            .to_kind(self.2)
            .view(self.0.as_slice())
    }
}

/// ‖a − b‖ / ‖b‖ in fp64.
pub fn rel_tensor(a: &Tensor, b: &Tensor) -> f64 {
    let (a, b) = (a.to_kind(Kind::Double), b.to_kind(Kind::Double));
    let diff = (&a - &b).norm().double_value(&[]);
    diff / b.norm().double_value(&[]).max(1e-30)
}

/// [batch, seq] token ids below `vocab` from `seed` (splitmix64): not libtorch's global RNG,
/// which the tests running at the same time in this process share.
pub fn token_ids(seed: u64, vocab: usize, batch: i64, seq: i64) -> Tensor {
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    let ids: Vec<i64> = (0..batch * seq)
        .map(|_| {
            state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            ((z ^ (z >> 31)) % vocab as u64) as i64
        })
        .collect();
    Tensor::from_slice(&ids).view([batch, seq])
}
