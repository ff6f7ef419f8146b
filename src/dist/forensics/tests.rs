use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Result};

use super::*;
use crate::dist::group::ProcessGroup;
use crate::dist::{free_port, RingGroup, Store};

fn leak(f: Forensics) -> &'static Forensics {
    Box::leak(Box::new(f))
}

#[test]
fn trace_file_mirrors_the_snapshot_and_keeps_the_last_collectives() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("rank_3.trace");
    let f = Forensics::new(3, "[CPU3]", Some(trace::TraceFile::create(&path, 3)?));
    f.continue_numbering_at(5);
    f.set_phase(Phase::Forward);
    for i in 0..(HISTORY as u64 + 7) {
        let id = f.begin(
            if i % 2 == 0 {
                "all-reduce"
            } else {
                "a-very-long-operation-name-cut-on-disk"
            },
            i * 1000,
        );
        assert_eq!(f.snapshot().records.last().unwrap().seq, 5 + i);
        f.end(id, Outcome::Done);
    }
    // A subgroup's collective: numbered in its group, named with its tag, in the history but
    // not among the world group's numbers the ranks are compared on.
    let sub = f.begin_in(Some("shard0"), "reduce-scatter", 64);
    f.end(sub, Outcome::Done);
    f.step_done(12);
    f.begin("barrier", 0);
    let running = 5 + HISTORY as u64 + 7;
    f.set_phase(Phase::Reduce);

    let mem = f.snapshot();
    let disk = trace::read(&path)?;
    // The op name is cut to 32 bytes on disk; everything else is the same.
    let cut = |s: &Snapshot| {
        let mut s = s.clone();
        for r in &mut s.records {
            r.op.truncate(32);
        }
        s
    };
    assert_eq!(cut(&disk), cut(&mem));
    assert_eq!(disk.records.len(), HISTORY);
    assert_eq!(disk.records.last().unwrap().seq, running);
    let shard = &disk.records[disk.records.len() - 2];
    assert_eq!((shard.op.as_str(), shard.seq), ("reduce-scatter@shard0", 1));
    assert_eq!(disk.entered(), running);
    assert_eq!(
        disk.records.first().unwrap().seq,
        running + 2 - HISTORY as u64
    );
    assert_eq!(
        (disk.rank, disk.pid, disk.step, disk.steps_here),
        (3, std::process::id(), 12, 1)
    );
    assert_eq!(disk.phase, Phase::Reduce);
    assert_eq!(disk.unfinished().map(|r| r.seq), Some(running));
    assert_eq!(disk.last_completed().map(|r| r.seq), Some(running - 1));
    assert_eq!(disk.gave_up(), None);
    assert!(!disk.ready);

    assert!(trace::read(&dir.path().join("missing")).is_err());
    std::fs::write(dir.path().join("junk"), vec![0u8; trace::SIZE])?;
    let e = trace::read(&dir.path().join("junk")).unwrap_err();
    assert!(format!("{e}").contains("not a lockstep trace file"), "{e}");
    Ok(())
}

#[test]
fn busy_time_counts_the_ranks_own_work_only() {
    let f = Forensics::new(0, "[CPU0]", None);
    assert_eq!(f.busy_seconds(), 0.0, "startup is not busy time");
    f.set_phase(Phase::Forward);
    std::thread::sleep(Duration::from_millis(60));
    f.set_phase(Phase::Reduce);
    std::thread::sleep(Duration::from_millis(100));
    f.set_phase(Phase::Optimizer);
    std::thread::sleep(Duration::from_millis(30));
    let busy = f.busy_seconds();
    // At least the 90 ms slept in forward and optimizer; the 100 ms in reduce is not counted
    // (the bound leaves room for a loaded machine oversleeping, but not for 100 ms more).
    assert!((0.09..0.19).contains(&busy), "{busy}");
}

/// A group whose collectives fail the way the ring's do.
struct Failing(&'static str);

impl ProcessGroup for Failing {
    fn rank(&self) -> usize {
        0
    }
    fn world_size(&self) -> usize {
        2
    }
    fn all_reduce_sum_f32(&mut self, _buf: &mut [f32]) -> Result<()> {
        bail!("{}", self.0)
    }
    fn broadcast_f32(&mut self, _buf: &mut [f32], _root: usize) -> Result<()> {
        Ok(())
    }
    fn all_reduce_max_f64(&mut self, x: f64) -> Result<f64> {
        Ok(x)
    }
    fn barrier(&mut self) -> Result<()> {
        bail!("{}", self.0)
    }
}

#[test]
fn a_failed_collective_is_recorded_and_the_history_reported_once() -> Result<()> {
    let log = leak(Forensics::new(0, "[CPU0]", None));
    let mut g = Traced::new(
        Box::new(Failing(
            "all-reduce #2 timed out after 3 s: rank 1 has not reached it",
        )),
        log,
    );
    assert_eq!(g.all_reduce_max_f64(2.0)?, 2.0);
    let t = tch::Tensor::zeros([3], (tch::Kind::Float, tch::Device::Cpu));
    g.broadcast_tensor(&t, 0)?;
    assert!(g.all_reduce_avg_tensor(&t).is_err());
    assert!(log.lock().reported, "the first timeout prints the history");
    assert!(
        log.end(log.begin("barrier", 0), Outcome::TimedOut)
            .is_none(),
        "only once"
    );
    let s = log.snapshot();
    let summary: Vec<(u64, &str, u64, Outcome)> = s
        .records
        .iter()
        .map(|r| (r.seq, r.op.as_str(), r.bytes, r.outcome))
        .collect();
    assert_eq!(
        summary,
        [
            (1, "all-reduce-max", 8, Outcome::Done),
            (2, "broadcast", 12, Outcome::Done),
            (3, "all-reduce", 12, Outcome::TimedOut),
            (4, "barrier", 0, Outcome::TimedOut),
        ]
    );
    assert_eq!(s.gave_up(), Some(Outcome::TimedOut));
    // A failure that is not a timeout (a peer died) is recorded but not printed.
    let quiet = leak(Forensics::new(0, "[CPU0]", None));
    let mut g = Traced::new(Box::new(Failing("barrier #1 failed: rank 1 closed")), quiet);
    assert!(g.barrier().is_err());
    assert!(!quiet.lock().reported);
    assert_eq!(quiet.snapshot().gave_up(), Some(Outcome::Failed));
    Ok(())
}

#[test]
fn the_report_names_phase_and_collectives() {
    let f = Forensics::new(1, "[CPU1]", None);
    f.set_phase(Phase::Backward);
    f.end(f.begin("broadcast", 2_500_000), Outcome::Done);
    let seq = f.begin("all-reduce", 4);
    let text = f
        .end(seq, Outcome::TimedOut)
        .expect("a timeout reports the history");
    assert!(
        text.starts_with("[CPU1] Hang forensics: all-reduce #2 timed out"),
        "{text}"
    );
    assert!(text.contains("phase backward for"), "{text}");
    assert!(
        text.contains("#1      broadcast ") && text.contains(" 2.50 MB"),
        "{text}"
    );
    assert!(text.contains("timed out after"), "{text}");
    assert!(text.lines().all(|l| l.starts_with("[CPU1] ")), "{text}");
}

/// Two ring ranks behind `Traced`: both number their collectives alike, continuing the ring's
/// own numbering, so a rank's history and the ring's error messages agree.
#[test]
fn traced_ring_ranks_number_collectives_alike() -> Result<()> {
    let server = Arc::new(Store::server(
        "127.0.0.1",
        free_port(),
        2,
        Duration::from_secs(20),
    )?);
    let port = server.port();
    let seqs: Vec<Vec<u64>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..2)
            .map(|rank| {
                let server = server.clone();
                s.spawn(move || -> Result<Vec<u64>> {
                    let store = if rank == 0 {
                        server
                    } else {
                        Arc::new(Store::client("127.0.0.1", port, Duration::from_secs(20))?)
                    };
                    let mut ring = RingGroup::new(store, rank, 2, Duration::from_secs(20))?;
                    ring.barrier()?;
                    let log = leak(Forensics::new(rank, "[CPU]", None));
                    log.continue_numbering_at(ring.collectives_started() + 1);
                    let mut g = Traced::new(Box::new(ring), log);
                    let mut v = [1.0f32; 3];
                    g.all_reduce_sum_f32(&mut v)?;
                    g.barrier()?;
                    assert_eq!(v, [2.0; 3]);
                    Ok(log.snapshot().records.iter().map(|r| r.seq).collect())
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap().unwrap()).collect()
    });
    assert_eq!(seqs[0], [2, 3]);
    assert_eq!(seqs[0], seqs[1]);
    Ok(())
}

/// Every method of `ProcessGroup` must be forwarded by `Traced`: a method left to the trait's
/// default would bypass the wrapped backend's own implementation (NCCL's on-GPU collectives).
#[test]
fn traced_forwards_every_method() {
    let trait_src = include_str!("../group.rs");
    let start = trait_src
        .find("pub trait ProcessGroup")
        .expect("the trait is in group.rs");
    let body = &trait_src[start..];
    let body = &body[..body.find("\n}\n").expect("the trait block ends")];
    let methods: Vec<&str> = body
        .match_indices("fn ")
        .filter_map(|(i, _)| {
            let rest = &body[i + 3..];
            let end = rest.find(['(', '<'])?;
            Some(&rest[..end])
        })
        .collect();
    assert!(methods.contains(&"all_reduce_sum_f32"), "{methods:?}");
    let traced = include_str!("traced.rs");
    let missing: Vec<&&str> = methods
        .iter()
        .filter(|m| !traced.contains(&format!("fn {m}(")))
        .collect();
    assert!(
        missing.is_empty(),
        "src/dist/forensics/traced.rs does not forward {missing:?}: add them to `impl \
         ProcessGroup for Traced` in the shape of the others, or they bypass the backend's own \
         implementation and go unrecorded"
    );
}
