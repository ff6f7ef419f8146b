//! Ring tests: every rank is a thread of this process with its own store client.

use std::io::Write;
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::collectives::BCAST_SEGMENT;
use super::wire::Hello;
use super::{RingConfig, RingGroup};
use crate::dist::group::{piece, ProcessGroup};
use crate::dist::store::Store;

const STORE_T: Duration = Duration::from_secs(20);

/// Runs `f(rank, group)` on `world` threads joined in one ring; returns the results by rank.
/// (Other modules' tests use it for their multi-rank logic.)
pub(crate) fn run_ranks<T: Send>(
    world: usize,
    timeout: Duration,
    f: impl Fn(usize, RingGroup) -> T + Sync,
) -> Vec<T> {
    let server = Store::server("127.0.0.1", 0, world, STORE_T).unwrap();
    let port = server.port();
    let f = &f;
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..world)
            .map(|r| {
                s.spawn(move || {
                    let st = Arc::new(Store::client("127.0.0.1", port, STORE_T).unwrap());
                    let g = RingGroup::new(st, r, world, timeout).unwrap();
                    f(r, g)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Deterministic pseudo-random values (xorshift), distinct per rank.
fn values(rank: usize, n: usize, integers: bool) -> Vec<f32> {
    let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ (rank as u64 + 1).wrapping_mul(0x1234_5678_9abc_def1);
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            if integers {
                // Small integers: every summation order is exact, so the ring must equal the
                // sequential sum bitwise.
                ((x % 2001) as i64 - 1000) as f32
            } else {
                ((x >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) as f32 * 1e3
            }
        })
        .collect()
}

const SIZES: [usize; 4] = [0, 1, 7, 1_000_003];

#[test]
fn all_reduce_sum_matches_sequential_sum_and_is_bitwise_identical() {
    for world in [2, 3, 4] {
        let results = run_ranks(world, Duration::from_secs(10), |r, mut g| {
            SIZES
                .iter()
                .map(|&n| {
                    let mut exact = values(r, n, true);
                    g.all_reduce_sum_f32(&mut exact).unwrap();
                    let mut a = values(r, n, false);
                    g.all_reduce_sum_f32(&mut a).unwrap();
                    // Same inputs again on the same group: same bits (determinism run to run).
                    let mut b = values(r, n, false);
                    g.all_reduce_sum_f32(&mut b).unwrap();
                    assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()));
                    (exact, a)
                })
                .collect::<Vec<_>>()
        });
        for (i, &n) in SIZES.iter().enumerate() {
            let inputs: Vec<Vec<f32>> = (0..world).map(|r| values(r, n, true)).collect();
            let seq: Vec<f32> = (0..n)
                .map(|j| inputs.iter().fold(0.0f32, |acc, v| acc + v[j]))
                .collect();
            let finputs: Vec<Vec<f32>> = (0..world).map(|r| values(r, n, false)).collect();
            for (r, res) in results.iter().enumerate() {
                let (exact, a) = &res[i];
                assert_eq!(exact, &seq, "world {world} n {n} rank {r}: integer sum");
                for (j, &v) in a.iter().enumerate() {
                    let want: f64 = finputs.iter().map(|x| x[j] as f64).sum();
                    assert!(
                        (v as f64 - want).abs() <= 1e-3 * world as f64,
                        "world {world} n {n} rank {r} [{j}]: {v} vs {want}"
                    );
                    let r0 = results[0][i].1[j];
                    assert_eq!(
                        v.to_bits(),
                        r0.to_bits(),
                        "rank {r} differs from rank 0 at {j}"
                    );
                }
            }
        }
    }
}

/// Uneven pieces, empty ones included, as a flat parameter space cut at shard boundaries gives.
#[test]
fn reduce_scatter_and_all_gather_over_uneven_pieces() {
    for world in [1, 2, 3, 4] {
        let cases: Vec<Vec<usize>> = vec![
            vec![5; world],
            (0..world).map(|r| [0, 3, 1_000, 7][r % 4]).collect(),
            (0..world)
                .map(|r| if r == 0 { 300_001 } else { 0 })
                .collect(),
        ];
        let results = run_ranks(world, Duration::from_secs(10), |r, mut g| {
            cases
                .iter()
                .map(|splits| {
                    let n = splits.iter().sum();
                    let mut buf = values(r, n, true);
                    g.reduce_scatter_avg_f32(&mut buf, splits).unwrap();
                    let mine = buf[piece(splits, r)].to_vec();
                    // All-gather what the reduce-scatter produced: the averaged buffer.
                    let mut all = vec![f32::NAN; n];
                    all[piece(splits, r)].copy_from_slice(&mine);
                    g.all_gather_f32(&mut all, splits).unwrap();
                    all
                })
                .collect::<Vec<_>>()
        });
        for (i, splits) in cases.iter().enumerate() {
            let n: usize = splits.iter().sum();
            let inputs: Vec<Vec<f32>> = (0..world).map(|r| values(r, n, true)).collect();
            let mean: Vec<f32> = (0..n)
                .map(|j| inputs.iter().fold(0.0f32, |acc, v| acc + v[j]) / world as f32)
                .collect();
            for (r, res) in results.iter().enumerate() {
                assert_eq!(res[i], mean, "world {world} splits {splits:?} rank {r}");
            }
        }
    }
}

/// With two ranks every sum has two terms, so the reduce-scatter equals the all-reduce bit for
/// bit (what makes ZeRO-2 on two ranks bitwise equal to replicated training).
#[test]
fn two_rank_reduce_scatter_is_bitwise_the_all_reduce() {
    let n = 100_003;
    let splits = [40_000, 60_003];
    let out = run_ranks(2, Duration::from_secs(10), |r, mut g| {
        let mut a = values(r, n, false);
        g.all_reduce_avg_f32(&mut a).unwrap();
        let mut b = values(r, n, false);
        g.reduce_scatter_avg_f32(&mut b, &splits).unwrap();
        let p = piece(&splits, r);
        a[p.clone()]
            .iter()
            .zip(&b[p])
            .all(|(x, y)| x.to_bits() == y.to_bits())
    });
    assert_eq!(out, [true, true]);
}

#[test]
fn ranks_that_disagree_on_the_pieces_fail_instead_of_mixing_data() {
    let errs = run_ranks(2, Duration::from_secs(5), |r, mut g| {
        let splits = if r == 0 { [2, 2] } else { [1, 3] };
        let mut buf = vec![1.0; 4];
        g.reduce_scatter_avg_f32(&mut buf, &splits)
            .err()
            .map(|e| format!("{e:#}"))
    });
    for e in errs {
        assert!(e.is_some(), "a disagreement must fail");
    }
}

#[test]
fn all_reduce_avg_broadcast_max_barrier() {
    for world in [2, 3, 4] {
        let entered = AtomicUsize::new(0);
        run_ranks(world, Duration::from_secs(10), |r, mut g| {
            // avg: the sum divided by the world size.
            let n = 1001;
            let mut v = values(r, n, true);
            g.all_reduce_avg_f32(&mut v).unwrap();
            let want: Vec<f32> = (0..n)
                .map(|j| (0..world).fold(0.0f32, |a, q| a + values(q, n, true)[j]) / world as f32)
                .collect();
            assert_eq!(v, want);

            // broadcast from the last rank (non-zero root), large enough for several segments.
            let root = world - 1;
            for n in [0, 5, 2 * BCAST_SEGMENT + 3] {
                let mut b = if r == root {
                    values(99, n, false)
                } else {
                    vec![f32::NAN; n]
                };
                g.broadcast_f32(&mut b, root).unwrap();
                let want = values(99, n, false);
                assert!(b.iter().zip(&want).all(|(x, y)| x.to_bits() == y.to_bits()));
            }
            assert!(g.broadcast_f32(&mut [], world).is_err());

            assert_eq!(g.all_reduce_max_f64(r as f64).unwrap(), (world - 1) as f64);
            let x = if r == 1 { f64::NAN } else { 1.0 };
            assert!(g.all_reduce_max_f64(x).unwrap().is_nan());
            assert_eq!(g.all_reduce_max_f64(-(r as f64) - 1.0).unwrap(), -1.0);

            // barrier: stagger arrivals; nobody may leave before everybody entered.
            std::thread::sleep(Duration::from_millis(50 * r as u64));
            entered.fetch_add(1, Ordering::SeqCst);
            g.barrier().unwrap();
            assert_eq!(
                entered.load(Ordering::SeqCst),
                world,
                "rank {r} left the barrier early"
            );
        });
    }
}

/// Counts past fp32's 2^24 (the experts' token counts of a long logging interval) sum exactly.
#[test]
fn counts_sum_exactly_past_what_fp32_holds() {
    for world in [2, 3] {
        let sums = run_ranks(world, Duration::from_secs(10), |r, mut g| {
            let r = r as u64;
            let mut c = vec![0, 1 + r, (1 << 24) + 1 + r, (1 << 35) + 12_345 * r, 4095];
            g.all_reduce_sum_u64(&mut c).unwrap();
            c
        });
        let w = world as u64;
        let tri = w * (w - 1) / 2;
        let want = vec![
            0,
            w + tri,
            w * ((1 << 24) + 1) + tri,
            w * (1 << 35) + 12_345 * tri,
            4095 * w,
        ];
        for got in sums {
            assert_eq!(got, want);
        }
    }
}

#[test]
fn mismatched_sizes_are_an_error_not_garbage() {
    let errs = run_ranks(2, Duration::from_secs(2), |r, mut g| {
        let mut v = vec![1.0f32; 10 + r];
        g.all_reduce_sum_f32(&mut v).unwrap_err().to_string()
    });
    for e in errs {
        eprintln!("mismatch: {e}");
        assert!(e.contains("different"), "{e}");
    }
}

#[test]
fn timeout_names_the_missing_rank() {
    let timeout = Duration::from_secs(2);
    let done = AtomicUsize::new(0);
    let out = run_ranks(3, timeout, |r, mut g| {
        g.barrier().unwrap();
        if r == 1 {
            // Stall: never enter collective #2, but keep the sockets open until the others are
            // done, like a hung process.
            let t0 = Instant::now();
            while done.load(Ordering::SeqCst) < 2 && t0.elapsed() < Duration::from_secs(20) {
                std::thread::sleep(Duration::from_millis(20));
            }
            return None;
        }
        let t0 = Instant::now();
        let mut v = vec![1.0f32; 1000];
        let e = g.all_reduce_sum_f32(&mut v).unwrap_err();
        let took = t0.elapsed();
        // Later calls fail fast with the same diagnosis.
        let again = g.barrier().unwrap_err().to_string();
        done.fetch_add(1, Ordering::SeqCst);
        Some((e.to_string(), took, again))
    });
    for (r, o) in out.into_iter().enumerate() {
        let Some((msg, took, again)) = o else {
            continue;
        };
        eprintln!("rank {r} after {took:?}: {msg}");
        assert!(
            took < timeout + Duration::from_secs(2),
            "rank {r} took {took:?}"
        );
        assert!(
            msg.contains("all-reduce #2")
                && msg.contains("rank 1 has not reached it (its last collective was #1)"),
            "rank {r}: {msg}"
        );
        assert!(
            again.contains("rank 1 has not reached it"),
            "rank {r}: {again}"
        );
    }
}

#[test]
fn dead_store_is_named() {
    let timeout = Duration::from_secs(2);
    let server = Store::server("127.0.0.1", 0, 2, STORE_T).unwrap();
    let port = server.port();
    let server = std::sync::Mutex::new(Some(server));
    let ready = AtomicUsize::new(0);
    let done = AtomicUsize::new(0);
    let msg = std::thread::scope(|s| {
        let hs: Vec<_> = (0..2)
            .map(|r| {
                let (server, ready, done) = (&server, &ready, &done);
                s.spawn(move || {
                    let st = Arc::new(Store::client("127.0.0.1", port, STORE_T).unwrap());
                    let cfg = RingConfig {
                        key_prefix: "t/".into(),
                        store_owner: "the test host".into(),
                        subgroup: None,
                    };
                    let mut g = RingGroup::with_config(st, r, 2, timeout, cfg).unwrap();
                    g.barrier().unwrap();
                    ready.fetch_add(1, Ordering::SeqCst);
                    if r == 1 {
                        // Rank 1 hangs; meanwhile the store host dies.
                        while done.load(Ordering::SeqCst) == 0 {
                            std::thread::sleep(Duration::from_millis(20));
                        }
                        return String::new();
                    }
                    while ready.load(Ordering::SeqCst) < 2 {
                        std::thread::sleep(Duration::from_millis(5));
                    }
                    drop(server.lock().unwrap().take());
                    let e = g.all_reduce_max_f64(1.0).unwrap_err().to_string();
                    done.store(1, Ordering::SeqCst);
                    e
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).next().unwrap()
    });
    eprintln!("dead store: {msg}");
    assert!(
        msg.contains("store") && msg.contains("the test host") && msg.contains("unreachable"),
        "{msg}"
    );
}

#[test]
fn bootstrap_names_the_rank_that_never_came() {
    let server = Arc::new(Store::server("127.0.0.1", 0, 3, STORE_T).unwrap());
    let port = server.port();
    let t = Duration::from_secs(1);
    let errs = std::thread::scope(|s| {
        // Ranks 0 and 1 of 3 start; rank 2 never does.
        let hs: Vec<_> = (0..2)
            .map(|r| {
                s.spawn(move || {
                    let st = Arc::new(Store::client("127.0.0.1", port, STORE_T).unwrap());
                    format!("{:#}", RingGroup::new(st, r, 3, t).unwrap_err())
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().unwrap())
            .collect::<Vec<_>>()
    });
    eprintln!("bootstrap: {errs:#?}");
    // Rank 1 dials rank 2; rank 0 waits for rank 2 to dial it.
    assert!(
        errs[1].contains("rank 2 did not publish its ring address"),
        "{}",
        errs[1]
    );
    assert!(errs[0].contains("rank 2 did not connect"), "{}", errs[0]);
}

#[test]
fn world_of_one_needs_no_peers() {
    let server = Arc::new(Store::server("127.0.0.1", 0, 1, STORE_T).unwrap());
    let mut g = RingGroup::new(server, 0, 1, Duration::from_secs(1)).unwrap();
    let mut v = vec![1.0f32, 2.0];
    g.all_reduce_avg_f32(&mut v).unwrap();
    g.broadcast_f32(&mut v, 0).unwrap();
    g.barrier().unwrap();
    assert_eq!(v, [1.0, 2.0]);
    assert_eq!(g.all_reduce_max_f64(3.0).unwrap(), 3.0);
}

#[test]
fn stray_connection_is_rejected() {
    // Rank 0 publishes its address; a stranger dials it first with a wrong nonce; the ring
    // must still form with the real rank 1.
    let server = Store::server("127.0.0.1", 0, 2, STORE_T).unwrap();
    let port = server.port();
    std::thread::scope(|s| {
        let stranger = s.spawn(|| {
            let st = Store::client("127.0.0.1", port, STORE_T).unwrap();
            st.wait(&["ring/addr/0"], STORE_T).unwrap();
            let a: SocketAddr = String::from_utf8(st.get("ring/addr/0").unwrap())
                .unwrap()
                .parse()
                .unwrap();
            let mut c = TcpStream::connect(a).unwrap();
            let h = Hello {
                nonce: 1,
                rank: 1,
                world: 2,
            };
            let _ = c.write_all(&h.encode());
            std::thread::sleep(Duration::from_millis(300));
        });
        let hs: Vec<_> = (0..2)
            .map(|r| {
                s.spawn(move || {
                    if r == 1 {
                        std::thread::sleep(Duration::from_millis(200));
                    }
                    let st = Arc::new(Store::client("127.0.0.1", port, STORE_T).unwrap());
                    let mut g = RingGroup::new(st, r, 2, Duration::from_secs(5)).unwrap();
                    let mut v = vec![r as f32 + 1.0; 3];
                    g.all_reduce_sum_f32(&mut v).unwrap();
                    v
                })
            })
            .collect();
        for h in hs {
            assert_eq!(h.join().unwrap(), [3.0; 3]);
        }
        stranger.join().unwrap();
    });
}

/// Loopback throughput of a 25 MB all-reduce between 2 ranks. Run with
/// `cargo test --release -- --ignored --nocapture bench_all_reduce`.
#[test]
#[ignore]
fn bench_all_reduce_25mb() {
    let n = 25_000_000 / 4;
    let times = run_ranks(2, Duration::from_secs(60), |r, mut g| {
        let mut v = values(r, n, false);
        g.all_reduce_sum_f32(&mut v).unwrap(); // warm-up
        let mut t = Vec::new();
        for _ in 0..7 {
            g.barrier().unwrap();
            let t0 = Instant::now();
            g.all_reduce_sum_f32(&mut v).unwrap();
            t.push(t0.elapsed().as_secs_f64());
        }
        t
    });
    let mut t = times[0].clone();
    t.sort_by(f64::total_cmp);
    let med = t[t.len() / 2];
    println!(
        "all-reduce 25 MB, 2 ranks: median {:.1} ms = {:.0} MB/s (runs {:?})",
        med * 1e3,
        25.0 / med,
        t.iter().map(|x| (x * 1e3).round()).collect::<Vec<_>>()
    );
}

/// The pieces of an all-to-all test: rank `from` sends rank `to` `(from·7 + to·3) % 5` rows of
/// 3 fp32 values each (empty pieces included, different both ways), valued so that every
/// element names its origin, destination and position.
fn a2a_rows(from: usize, to: usize) -> usize {
    (from * 7 + to * 3) % 5
}

fn a2a_piece(from: usize, to: usize) -> Vec<f32> {
    (0..a2a_rows(from, to) * 3)
        .map(|i| (from * 10_000 + to * 100 + i) as f32)
        .collect()
}

/// The all-to-all against the exchange written out (rank s's piece for r lands as rank r's
/// piece s), on the ring's bytes, its tensors (bf16 and a strided input), and a world of 1.
#[test]
fn all_to_all_delivers_uneven_pieces_to_their_ranks() {
    use tch::{Kind, Tensor};
    for world in [1, 2, 3, 4] {
        run_ranks(world, Duration::from_secs(10), |r, mut g| {
            let send: Vec<f32> = (0..world).flat_map(|to| a2a_piece(r, to)).collect();
            let want: Vec<f32> = (0..world).flat_map(|from| a2a_piece(from, r)).collect();
            let send_rows: Vec<usize> = (0..world).map(|to| a2a_rows(r, to)).collect();
            let recv_rows: Vec<usize> = (0..world).map(|from| a2a_rows(from, r)).collect();
            let bytes = |rows: &[usize]| rows.iter().map(|n| n * 12).collect::<Vec<_>>();
            let mut got = vec![f32::NAN; want.len()];
            let src = super::wire::f32_bytes(&send);
            let dst = super::wire::f32_bytes_mut(&mut got);
            g.all_to_all_bytes(src, &bytes(&send_rows), dst, &bytes(&recv_rows))
                .unwrap();
            assert_eq!(got, want, "rank {r} of {world}");
            // Tensors: bf16 rows (exact for these small integers only up to 256: use a
            // pattern that is) from a transposed, non-contiguous input.
            let n: usize = send_rows.iter().sum();
            let t = Tensor::from_slice(&send)
                .view([n as i64, 3])
                .remainder(256)
                .to_kind(Kind::BFloat16)
                .tr()
                .contiguous()
                .tr();
            let out = g.all_to_all_tensor(&t, &send_rows, &recv_rows).unwrap();
            let m: usize = recv_rows.iter().sum();
            assert_eq!(
                (out.size(), out.kind()),
                (vec![m as i64, 3], Kind::BFloat16)
            );
            let expect = Tensor::from_slice(&want)
                .view([m as i64, 3])
                .remainder(256)
                .to_kind(Kind::BFloat16);
            assert!(out.equal(&expect), "rank {r} of {world}: {out}");
        });
    }
}

/// Ranks that disagree on who sends whom how much fail, naming the ranks, instead of
/// reading another piece's bytes.
#[test]
fn all_to_all_pieces_that_disagree_fail_and_name_the_sender() {
    let errs = run_ranks(2, Duration::from_secs(5), |r, mut g| {
        // Rank 0 sends rank 1 two bytes; rank 1 expects three.
        let send = [1u8; 4];
        let mut recv = [0u8; 5];
        let (send_splits, recv_splits) = if r == 0 {
            ([2, 2], [2, 3])
        } else {
            ([2, 2], [3, 2])
        };
        g.all_to_all_bytes(&send, &send_splits, &mut recv, &recv_splits)
            .unwrap_err()
            .to_string()
    });
    for e in &errs {
        eprintln!("{e}");
    }
    assert!(
        errs.iter()
            .any(|e| e.contains("rank 0 sends rank 1 2 bytes, which expects 3")),
        "{errs:?}"
    );
}

/// A rank that never enters the all-to-all is named by the others' timeout.
#[test]
fn all_to_all_timeout_names_the_missing_rank() {
    let timeout = Duration::from_secs(2);
    let done = AtomicUsize::new(0);
    let out = run_ranks(3, timeout, |r, mut g| {
        g.barrier().unwrap();
        if r == 2 {
            let t0 = Instant::now();
            while done.load(Ordering::SeqCst) < 2 && t0.elapsed() < Duration::from_secs(20) {
                std::thread::sleep(Duration::from_millis(20));
            }
            return None;
        }
        let send = [7u8; 3];
        let mut recv = [0u8; 3];
        let e = g
            .all_to_all_bytes(&send, &[1, 1, 1], &mut recv, &[1, 1, 1])
            .unwrap_err();
        done.fetch_add(1, Ordering::SeqCst);
        Some(e.to_string())
    });
    for msg in out.into_iter().flatten() {
        eprintln!("{msg}");
        assert!(
            msg.contains("all-to-all #2")
                && msg.contains("rank 2 has not reached it (its last collective was #1)"),
            "{msg}"
        );
    }
}
