//! Runs that survive and explain themselves, through real `lockstep` processes on loopback:
//! `lockstep run --max-restarts` after kill -9s (also mid-save, also on another "node") ends
//! bitwise equal to an uninterrupted run; restarts give up when they should; a hung rank is
//! named with its phase; SIGUSR1 snapshots; stragglers; `srun`-style variables; and the
//! rendezvous store listening on the master address only.

use crate::common;

use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use common::{
    assert_bitwise_equal_checkpoints, lockstep, losses, ok, output_text, run, small, with,
    write_corpus, Launcher,
};
use lockstep::dist::forensics::{trace, Snapshot};

fn signal(pid: u32, sig: libc::c_int) {
    // SAFETY: plain kill(2); a process that is already gone gives ESRCH, which is fine here.
    unsafe { libc::kill(pid as libc::pid_t, sig) };
}

fn process_state(pid: u32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(") ")?.1.chars().next()
}

/// The `logs/<run_name>-<time>/` directories of launchers started in `dir`. Two launchers
/// ("nodes") of one run that start in different seconds write two of them, each holding its
/// own ranks' files.
fn log_dirs(dir: &Path, run_name: &str) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir.join("logs")) else {
        return Vec::new();
    };
    entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(&format!("{run_name}-")))
        })
        .collect()
}

/// The one log directory of a single launcher started in `dir` (None until it exists).
fn log_dir(dir: &Path, run_name: &str) -> Option<PathBuf> {
    let dirs = log_dirs(dir, run_name);
    assert!(
        dirs.len() <= 1,
        "more than one launcher logged {run_name}: {dirs:?}"
    );
    dirs.into_iter().next()
}

/// Rank `rank`'s trace, once its worker has written one, in whichever launcher's log
/// directory holds it.
fn rank_trace(dir: &Path, run_name: &str, rank: usize) -> Option<Snapshot> {
    log_dirs(dir, run_name)
        .iter()
        .find_map(|d| trace::read(&d.join(format!("rank_{rank}.trace"))).ok())
}

/// Waits until `cond` holds for rank `rank`'s trace of a live worker; panics after `limit`.
fn wait_trace(
    dir: &Path,
    run_name: &str,
    rank: usize,
    limit: Duration,
    what: &str,
    cond: impl Fn(&Snapshot) -> bool,
) -> Snapshot {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(t) = rank_trace(dir, run_name, rank) {
            if cond(&t) && process_state(t.pid).is_some_and(|s| s != 'Z') {
                return t;
            }
        }
        assert!(
            Instant::now() < deadline,
            "rank {rank} never reached: {what}; its last trace: {:?}; log directories: {:?}",
            rank_trace(dir, run_name, rank).map(|t| (t.step, t.pid, process_state(t.pid))),
            log_dirs(dir, run_name)
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A deterministic schedule: the same kills at the same steps on every run of the test.
struct Lcg(u64);

impl Lcg {
    fn range(&mut self, lo: usize, hi: usize) -> usize {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        lo + ((self.0 >> 33) as usize) % (hi - lo + 1)
    }
}

/// Watches a checkpoint directory for a save in progress (`step_N.tmp` being created), with
/// inotify: polling could miss a save of a small model entirely.
struct SaveWatch {
    fd: libc::c_int,
    dir: PathBuf,
}

impl SaveWatch {
    fn new(dir: &Path) -> SaveWatch {
        let c = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: plain inotify calls on a descriptor we own and close in Drop.
        let fd = unsafe { libc::inotify_init1(libc::IN_CLOEXEC | libc::IN_NONBLOCK) };
        assert!(fd >= 0);
        // SAFETY: as above; `c` is a valid C string for the call.
        let wd = unsafe { libc::inotify_add_watch(fd, c.as_ptr(), libc::IN_CREATE) };
        assert!(wd >= 0, "inotify on {}", dir.display());
        SaveWatch {
            fd,
            dir: dir.to_path_buf(),
        }
    }

    /// The next `step_N.tmp` created, waiting up to `limit`.
    fn next_save(&self, limit: Duration) -> Option<PathBuf> {
        let deadline = Instant::now() + limit;
        let mut buf = [0u8; 4096];
        while Instant::now() < deadline {
            let mut pfd = libc::pollfd {
                fd: self.fd,
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one valid pollfd.
            unsafe { libc::poll(&mut pfd, 1, 100) };
            // SAFETY: reads into our buffer, at most its length.
            let n = unsafe { libc::read(self.fd, buf.as_mut_ptr().cast(), buf.len()) };
            let mut at = 0usize;
            while n > 0 && at + 16 <= n as usize {
                let len = u32::from_ne_bytes(buf[at + 12..at + 16].try_into().unwrap()) as usize;
                let name = &buf[at + 16..at + 16 + len];
                let name = String::from_utf8_lossy(name)
                    .trim_end_matches('\0')
                    .to_string();
                at += 16 + len;
                let saving = name.starts_with("step_")
                    && name.ends_with(".tmp")
                    && !name.contains(".deleted")
                    && !name.contains(".replaced")
                    && !name.contains("write_test");
                if saving {
                    return Some(self.dir.join(name));
                }
            }
        }
        None
    }
}

impl Drop for SaveWatch {
    fn drop(&mut self) {
        // SAFETY: our descriptor, closed once.
        unsafe { libc::close(self.fd) };
    }
}

fn restart_lines(text: &str) -> usize {
    text.lines()
        .filter(|l| l.starts_with("lockstep run: restart "))
        .count()
}

#[test]
fn kill_9s_during_training_and_a_save_end_bitwise_equal_to_an_uninterrupted_run() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let base = small(&write_corpus(dir));
    let tail = |name: &str| {
        vec![
            "--max-steps".to_string(),
            "30".into(),
            "--set".into(),
            "checkpoint.interval=2".into(),
            "--set".into(),
            format!("logging.run_name={name}"),
        ]
    };
    let args = |name: &str, head: &[&str]| {
        let t = tail(name);
        with(
            &base,
            head,
            &t.iter().map(String::as_str).collect::<Vec<_>>(),
        )
    };
    ok(dir, &args("straight", &["run", "--nproc", "2", "--cpu"]));

    let launcher = Launcher::start(
        dir,
        &args(
            "killed",
            &[
                "run",
                "--nproc",
                "2",
                "--cpu",
                "--max-restarts",
                "5",
                "--grace-s",
                "2",
            ],
        ),
    );
    let limit = Duration::from_secs(120);
    let mut rng = Lcg(0x1ea5_7e9d);
    // Workers killed so far: a wait for the next kill only accepts a worker started since.
    let mut dead: Vec<u32> = Vec::new();
    let kill_at = |rank: usize, step: usize, dead: &mut Vec<u32>| {
        let t = wait_trace(dir, "killed", rank, limit, &format!("step {step}"), |t| {
            t.step as usize >= step && t.steps_here >= 1 && !dead.contains(&t.pid)
        });
        signal(t.pid, libc::SIGKILL);
        dead.push(t.pid);
    };
    // 1. A random rank, a few steps in.
    kill_at(rng.range(0, 1), rng.range(3, 8), &mut dead);

    // 2. Rank 0, the one that writes, in the middle of a save at or after step 12.
    let step = rng.range(12, 16);
    wait_trace(
        dir,
        "killed",
        0,
        limit,
        &format!("step {}", step - 2),
        |t| t.step as usize + 2 >= step && t.steps_here >= 1 && !dead.contains(&t.pid),
    );
    let watch = SaveWatch::new(&dir.join("runs/killed/checkpoints"));
    let saving = loop {
        let saving = watch.next_save(limit).expect("no checkpoint save started");
        let pid = rank_trace(dir, "killed", 0).unwrap().pid;
        // Freeze the writer, then kill it only if its save is still in progress (the
        // directory not yet renamed into place); otherwise let it go on to the next save.
        signal(pid, libc::SIGSTOP);
        if saving.is_dir() {
            signal(pid, libc::SIGKILL);
            dead.push(pid);
            break saving;
        }
        signal(pid, libc::SIGCONT);
    };

    // 3. A random rank again, past step 20.
    kill_at(rng.range(0, 1), rng.range(20, 25), &mut dead);

    let (code, text) = launcher.finish(limit);
    assert_eq!(code, Some(0), "{text}");
    assert_eq!(restart_lines(&text), 3, "{text}");
    assert!(
        text.contains("lockstep run: restart 1 of 5: rank ")
            && text.contains("was killed by signal SIGKILL (9)"),
        "{text}"
    );
    // The interrupted save was left incomplete and skipped on resume (or, when the kill came
    // after every rank had written and reported its files, committed before the restart).
    let saving = saving.strip_prefix(dir).unwrap().display().to_string();
    let committed = saving.strip_suffix(".tmp").unwrap_or(&saving).to_string();
    assert!(
        text.contains(&format!("Ignoring incomplete checkpoint {saving}"))
            || (text.contains(&format!("{committed} (step ")) && text.contains("committed now")),
        "{text}"
    );
    assert_bitwise_equal_checkpoints(
        &dir.join("runs/straight/checkpoints/step_30"),
        &dir.join("runs/killed/checkpoints/step_30"),
    );
}

/// Two launchers as two "nodes" on loopback, one worker each: killing node 1's worker makes
/// both launchers restart their workers (agreed through node 0's store), and the result is the
/// uninterrupted one-node run's, bit for bit.
#[test]
fn a_kill_on_one_node_restarts_both_nodes_and_the_result_is_unchanged() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let base = small(&write_corpus(dir));
    ok(dir, &with(&base, &["prepare"], &[]));
    let tail = ["--max-steps", "12", "--set", "checkpoint.interval=2"];
    ok(
        dir,
        &with(
            &base,
            &["run", "--nproc", "2", "--cpu"],
            &[&tail[..], &["--set", "logging.run_name=onenode"]].concat(),
        ),
    );
    let port = lockstep::dist::free_port().to_string();
    let node = |r: &str| {
        let head = [
            "run",
            "--nproc",
            "1",
            "--cpu",
            "--nnodes",
            "2",
            "--node-rank",
            r,
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            &port,
            "--max-restarts",
            "3",
            "--grace-s",
            "2",
        ];
        Launcher::start(
            dir,
            &with(
                &base,
                &head,
                &[&tail[..], &["--set", "logging.run_name=twonodes"]].concat(),
            ),
        )
    };
    let (n0, n1) = (node("0"), node("1"));
    let limit = Duration::from_secs(120);
    let victim = wait_trace(dir, "twonodes", 1, limit, "step 5", |t| t.step >= 5);
    signal(victim.pid, libc::SIGKILL);
    for (i, n) in [n0, n1].into_iter().enumerate() {
        let (code, text) = n.finish(limit);
        assert_eq!(code, Some(0), "node {i}:\n{text}");
        assert_eq!(restart_lines(&text), 1, "node {i}:\n{text}");
        assert!(
            text.contains("lockstep run: restart 1 of 3: rank 1 (node 1, CPU) was killed by signal SIGKILL (9)"),
            "node {i}:\n{text}"
        );
    }
    assert_bitwise_equal_checkpoints(
        &dir.join("runs/onenode/checkpoints/step_12"),
        &dir.join("runs/twonodes/checkpoints/step_12"),
    );
}

#[test]
fn restarts_give_up_after_max_restarts_with_the_workers_code() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let base = small(&write_corpus(dir));
    let out = run(
        dir,
        &with(
            &base,
            &[
                "run",
                "--nproc",
                "2",
                "--cpu",
                "--grace-s",
                "2",
                "--max-restarts",
                "2",
            ],
            &[
                "--max-steps",
                "20",
                "--set",
                "debug.fault=exit",
                "--set",
                "debug.fault_rank=1",
                "--set",
                "debug.fault_step=3",
                "--set",
                "debug.fault_exit_code=7",
            ],
        ),
    );
    let text = output_text(&out);
    assert_eq!(out.status.code(), Some(7), "{text}");
    assert_eq!(restart_lines(&text), 2, "{text}");
    assert!(
        text.contains("lockstep run: restart 1 of 2: rank 1 (CPU) exited with code 7; all workers restart from the start (no complete checkpoint yet)"),
        "{text}"
    );
    assert!(
        text.contains("lockstep run: giving up: rank 1 (CPU) exited with code 7 after 2 restarts (--max-restarts 2); exiting with its code 7"),
        "{text}"
    );
}

#[test]
fn a_rank_failing_before_its_first_step_twice_stops_the_restarts() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let base = small(&write_corpus(dir));
    let out = run(
        dir,
        &with(
            &base,
            &[
                "run",
                "--nproc",
                "2",
                "--cpu",
                "--grace-s",
                "2",
                "--max-restarts",
                "5",
            ],
            &[
                "--max-steps",
                "20",
                "--set",
                "debug.fault=exit",
                "--set",
                "debug.fault_rank=0",
                "--set",
                "debug.fault_step=1",
                "--set",
                "debug.fault_exit_code=9",
            ],
        ),
    );
    let text = output_text(&out);
    assert_eq!(out.status.code(), Some(9), "{text}");
    assert_eq!(restart_lines(&text), 1, "{text}");
    assert!(
        text.contains("lockstep run: not restarting: rank 0 (CPU) exited with code 9 before its first step, as in the previous attempt"),
        "{text}"
    );
}

/// A SIGSTOPped rank: within the collective timeout the launcher prints one screen naming it
/// and its phase, and the rank that waited for it has its collective history in its log.
#[test]
fn a_stopped_rank_is_named_with_its_phase_at_the_collective_timeout() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let base = small(&write_corpus(dir));
    ok(dir, &with(&base, &["prepare"], &[]));
    let timeout_s = 3;
    let mut launcher = Launcher::start(
        dir,
        &with(
            &base,
            &["run", "--nproc", "2", "--cpu", "--grace-s", "2"],
            &[
                "--max-steps",
                "50",
                "--set",
                "debug.fault=stop",
                "--set",
                "debug.fault_rank=1",
                "--set",
                "debug.fault_step=3",
                "--set",
                &format!("system.collective_timeout_s={timeout_s}"),
            ],
        ),
    );
    let limit = Duration::from_secs(90);
    let stuck = wait_trace(dir, "tiny", 1, limit, "step 2", |t| t.step >= 2);
    let deadline = Instant::now() + limit;
    while process_state(stuck.pid) != Some('T') {
        assert!(
            Instant::now() < deadline && launcher.running(),
            "rank 1 never stopped"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let stopped_at = Instant::now();
    let logs = log_dir(dir, "tiny").unwrap();
    let reported_at = loop {
        if let Some(t) = launcher.seen("lockstep run: hang report (a collective timed out)") {
            break t;
        }
        assert!(
            Instant::now() < deadline && launcher.running(),
            "no hang report:\n{}",
            launcher.text()
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    // Rank 0 waits at most the timeout in the step's first collective; a loaded machine gets
    // a few seconds more to notice and report.
    let after = reported_at.saturating_duration_since(stopped_at);
    assert!(
        after <= Duration::from_secs(timeout_s + 10),
        "the report came {after:?} after the stop"
    );
    let (code, text) = launcher.finish(limit);
    assert_eq!(code, Some(1), "{text}");
    assert!(
        text.contains(&format!(
            "lockstep run:   stuck: rank 1 (CPU, pid {}) in phase data for",
            stuck.pid
        )) && text.contains("its process is stopped (SIGSTOP; SIGCONT resumes it)")
            && text.contains("it has not entered collective #"),
        "{text}"
    );
    let rank0 = std::fs::read_to_string(logs.join("rank_0.log")).unwrap();
    assert!(
        rank0.contains("[CPU0] Hang forensics: all-reduce #") && rank0.contains("timed out after"),
        "{rank0}"
    );
}

/// Finding 27: a subgroup's errors named ranks by their position in it, and its collectives
/// were missing from the hang history. Hybrid sharding on 4 ranks (shard groups [0, 1] and
/// [2, 3]) with rank 3 stopped: the rank waiting for it in its shard group names the subgroup
/// and rank 3 (not "rank 1", its position), and its history lists the subgroup's collectives.
#[test]
fn a_subgroup_names_global_ranks_and_its_collectives_are_in_the_history() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let base = small(&write_corpus(dir));
    ok(dir, &with(&base, &["prepare"], &[]));
    let launcher = Launcher::start(
        dir,
        &with(
            &base,
            &["run", "--nproc", "4", "--cpu", "--grace-s", "2"],
            &[
                "--max-steps",
                "50",
                "--set",
                "system.zero_stage=2",
                "--set",
                "system.shard_degree=2",
                "--set",
                "debug.fault=stop",
                "--set",
                "debug.fault_rank=3",
                "--set",
                "debug.fault_step=3",
                "--set",
                "system.collective_timeout_s=3",
            ],
        ),
    );
    let (code, text) = launcher.finish(Duration::from_secs(120));
    assert_eq!(code, Some(1), "{text}");
    let logs = log_dir(dir, "tiny").unwrap();
    let rank2 = std::fs::read_to_string(logs.join("rank_2.log")).unwrap();
    assert!(
        rank2.contains(
            " in subgroup shard1 (ranks [2, 3]) timed out after 3 s: rank 3 has not reached it"
        ) && !rank2.contains("rank 1 has not reached it"),
        "{rank2}"
    );
    assert!(
        rank2.contains("[CPU2] Hang forensics: reduce-scatter@shard1 #")
            && rank2.contains(" reduce-scatter@shard1 "),
        "{rank2}"
    );
}

/// SIGUSR1 to the launcher: every rank prints its phase and collectives, the launcher its hang
/// report, and training goes on.
#[test]
fn sigusr1_makes_every_rank_print_its_snapshot_without_stopping() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let base = small(&write_corpus(dir));
    ok(dir, &with(&base, &["prepare"], &[]));
    let launcher = Launcher::start(
        dir,
        &with(
            &base,
            &["run", "--nproc", "2", "--cpu", "--grace-s", "5"],
            &["--max-steps", "400"],
        ),
    );
    let limit = Duration::from_secs(90);
    for r in 0..2 {
        wait_trace(dir, "tiny", r, limit, "step 2 and a SIGUSR1 handler", |t| {
            t.step >= 2 && t.ready
        });
    }
    signal(launcher.pid(), libc::SIGUSR1);
    let logs = log_dir(dir, "tiny").unwrap();
    let deadline = Instant::now() + limit;
    let snapshot_in = |r: usize| {
        std::fs::read_to_string(logs.join(format!("rank_{r}.log"))).is_ok_and(|l| {
            l.contains(&format!(
                "[CPU{r}] Snapshot on SIGUSR1 (training continues):"
            ))
        })
    };
    while !(snapshot_in(0) && snapshot_in(1)) {
        assert!(
            Instant::now() < deadline,
            "no snapshot:\n{}",
            launcher.text()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let step = rank_trace(dir, "tiny", 0).unwrap().step;
    wait_trace(dir, "tiny", 0, limit, "two more steps", |t| {
        t.step >= step + 2
    });
    // Stop it (a checkpoint is saved and the workers exit 0, and so does the launcher).
    signal(launcher.pid(), libc::SIGINT);
    let (code, text) = launcher.finish(limit);
    assert_eq!(code, Some(0), "{text}");
    assert!(
        text.contains("lockstep run: hang report (on SIGUSR1; nothing is stopped):"),
        "{text}"
    );
    let log = std::fs::read_to_string(logs.join("rank_1.log")).unwrap();
    assert!(
        log.contains("[CPU1]   phase ") && log.contains("[CPU1]     #"),
        "{log}"
    );
}

#[test]
fn a_slow_rank_is_named_as_a_straggler() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let base = small(&write_corpus(dir));
    let out = ok(
        dir,
        &with(
            &base,
            &["run", "--nproc", "2", "--cpu"],
            &[
                "--max-steps",
                "6",
                "--set",
                "logging.interval=2",
                "--set",
                "debug.fault=slow",
                "--set",
                "debug.fault_rank=1",
                "--set",
                "debug.fault_delay_ms=400",
            ],
        ),
    );
    let line = out
        .lines()
        .find(|l| l.starts_with("[CPU0] Straggler: rank 1 spends "))
        .unwrap_or_else(|| panic!("no straggler line:\n{out}"));
    assert!(line.contains("above logging.straggler_pct = 20"), "{line}");
    assert!(!out.contains("Straggler: rank 0"), "{out}");
}

/// A port whose Slurm-derived value (15000 + job id % 10000) is free now, and that job id.
fn free_slurm_job_id() -> (u64, u16) {
    let start = std::process::id() as u64 % 10000;
    (0..10000)
        .map(|k| 7_000_000 + (start + k * 37) % 10000)
        .map(|id| (id, lockstep::dist::slurm::port_from_job_id(id)))
        .find(|&(_, p)| std::net::TcpListener::bind(("127.0.0.1", p)).is_ok())
        .expect("a free port in 15000..25000")
}

/// Two `lockstep train` tasks driven only by what srun sets train exactly like
/// `lockstep run --nproc 2`.
#[test]
fn srun_style_tasks_train_like_lockstep_run() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let base = small(&write_corpus(dir));
    let tail = ["--max-steps", "5"];
    ok(
        dir,
        &with(
            &base,
            &["run", "--nproc", "2", "--cpu"],
            &[&tail[..], &["--set", "logging.run_name=viarun"]].concat(),
        ),
    );
    let (job, port) = free_slurm_job_id();
    // The threads from SLURM_CPUS_PER_TASK (finding 29: each task took every core), 1 as the
    // run's workers have.
    let args = with(
        &base,
        &["train"],
        &[
            &tail[..],
            &[
                "--set",
                "logging.run_name=viaslurm",
                "--set",
                "system.num_threads=0",
            ],
        ]
        .concat(),
    );
    let tasks: Vec<Child> = (0..2)
        .map(|r| {
            let mut c = lockstep(dir);
            for k in [
                "RANK",
                "WORLD_SIZE",
                "LOCAL_RANK",
                "LOCAL_WORLD_SIZE",
                "MASTER_ADDR",
                "MASTER_PORT",
                "OMP_NUM_THREADS",
            ] {
                c.env_remove(k);
            }
            c.args(&args)
                .env("SLURM_CPUS_PER_TASK", "1")
                .env("SLURM_PROCID", r.to_string())
                .env("SLURM_LOCALID", r.to_string())
                .env("SLURM_NTASKS", "2")
                .env("SLURM_NODEID", "0")
                .env("SLURM_NNODES", "1")
                .env("SLURM_TASKS_PER_NODE", "2")
                .env("SLURM_JOB_NODELIST", "localhost")
                .env("SLURM_JOB_ID", job.to_string())
                .env("CUDA_VISIBLE_DEVICES", "")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let outs: Vec<_> = tasks
        .into_iter()
        .map(|c| c.wait_with_output().unwrap())
        .collect();
    for (r, o) in outs.iter().enumerate() {
        assert!(o.status.success(), "task {r}:\n{}", output_text(o));
    }
    let rank0 = output_text(&outs[0]);
    assert!(
        rank0.contains(&format!(
            "MASTER_ADDR=localhost, the first host of SLURM_JOB_NODELIST=localhost; MASTER_PORT={port} derived from SLURM_JOB_ID={job}"
        )),
        "{rank0}"
    );
    assert!(rank0.contains("| 2 ranks | CPU, 1 thread |"), "{rank0}");
    // Finding 28: each task budgeted the whole node's memory; it shares it with the node's
    // other task (SLURM_TASKS_PER_NODE), as under lockstep run.
    assert!(rank0.contains(" / 2 ranks on this node)"), "{rank0}");
    let runs = dir.join("runs");
    assert_eq!(
        losses(&runs.join("viaslurm/metrics.jsonl")),
        losses(&runs.join("viarun/metrics.jsonl"))
    );
    assert_bitwise_equal_checkpoints(
        &runs.join("viarun/checkpoints/step_5"),
        &runs.join("viaslurm/checkpoints/step_5"),
    );
}

/// `lockstep run` under srun with more than one task per node would start workers twice.
#[test]
fn lockstep_run_under_srun_needs_one_task_per_node() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let base = small(&write_corpus(dir));
    let out = lockstep(dir)
        .args(with(
            &base,
            &["run", "--cpu", "--nproc", "1"],
            &["--max-steps", "1"],
        ))
        .env("SLURM_PROCID", "0")
        .env("SLURM_NTASKS", "4")
        .env("SLURM_NNODES", "2")
        .env("SLURM_NODEID", "0")
        .env("SLURM_JOB_NODELIST", "localhost")
        .env("SLURM_JOB_ID", "1")
        .output()
        .unwrap();
    let text = output_text(&out);
    assert_eq!(out.status.code(), Some(2), "{text}");
    assert!(
        text.contains("SLURM_NTASKS=4 on SLURM_NNODES=2") && text.contains("--ntasks-per-node=1"),
        "{text}"
    );
    assert!(!dir.join("logs").exists() && !dir.join("runs").exists());
}

/// A node whose node 0 never comes up is named, with the fix.
#[test]
fn a_node_that_cannot_reach_node_0_says_so() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let base = small(&write_corpus(dir));
    let port = lockstep::dist::free_port().to_string();
    let out = run(
        dir,
        &with(
            &base,
            &[
                "run",
                "--cpu",
                "--nproc",
                "1",
                "--nnodes",
                "2",
                "--node-rank",
                "1",
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                &port,
            ],
            &["--max-steps", "1", "--set", "system.collective_timeout_s=2"],
        ),
    );
    let text = output_text(&out);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(
        text.contains(&format!("node 1: cannot reach node 0's launcher at 127.0.0.1:{port} within 2 s; is `lockstep run --node-rank 0` running there with the same --master-port?")),
        "{text}"
    );
}

/// This machine's IPv4 addresses other than loopback.
fn non_loopback_ipv4() -> Vec<std::net::Ipv4Addr> {
    let mut out = Vec::new();
    // SAFETY: getifaddrs allocates a list we walk read-only and free once.
    unsafe {
        let mut list: *mut libc::ifaddrs = std::ptr::null_mut();
        if libc::getifaddrs(&mut list) != 0 {
            return out;
        }
        let mut cur = list;
        while !cur.is_null() {
            let a = (*cur).ifa_addr;
            if !a.is_null() && i32::from((*a).sa_family) == libc::AF_INET {
                let sin = &*(a as *const libc::sockaddr_in);
                let ip = std::net::Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr));
                if !ip.is_loopback() {
                    out.push(ip);
                }
            }
            cur = (*cur).ifa_next;
        }
        libc::freeifaddrs(list);
    }
    out
}

/// During `lockstep run --nproc 2`, the rendezvous store answers on the master address
/// (127.0.0.1) and nowhere else: not on the machine's other addresses.
#[test]
fn the_rendezvous_store_is_not_reachable_on_other_addresses() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let base = small(&write_corpus(dir));
    ok(dir, &with(&base, &["prepare"], &[]));
    let port = lockstep::dist::free_port();
    let launcher = Launcher::start(
        dir,
        &with(
            &base,
            &[
                "run",
                "--nproc",
                "2",
                "--cpu",
                "--master-port",
                &port.to_string(),
            ],
            &["--max-steps", "400"],
        ),
    );
    wait_trace(dir, "tiny", 1, Duration::from_secs(90), "step 1", |t| {
        t.step >= 1
    });
    assert!(std::net::TcpStream::connect(("127.0.0.1", port)).is_ok());
    // 127.0.0.2 is this machine too (all of 127/8 is); the other interfaces' addresses when
    // there are any.
    let mut others = vec![std::net::Ipv4Addr::new(127, 0, 0, 2)];
    others.extend(non_loopback_ipv4());
    for ip in &others {
        let c = std::net::TcpStream::connect_timeout(&(*ip, port).into(), Duration::from_secs(2));
        assert!(c.is_err(), "the store answered on {ip}:{port}");
    }
    if others.len() == 1 {
        eprintln!("note: this machine has no non-loopback IPv4 address; checked 127.0.0.2 only");
    }
    signal(launcher.pid(), libc::SIGKILL);
    drop(launcher);
}

/// Soak: many kill -9s at seeded random moments (each at least one step into an attempt, so the
/// first-step rule does not end the run), any rank, saves included by chance. Slow; figures in
/// BENCHMARKS.md. `cargo test --release --test suite resilience::soak -- --ignored --nocapture`
#[test]
#[ignore = "soak, minutes; run by hand (BENCHMARKS.md)"]
fn soak_random_kill_9s_end_bitwise_equal_to_an_uninterrupted_run() {
    let kills: usize = std::env::var("LOCKSTEP_SOAK_KILLS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10);
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let base = small(&write_corpus(dir));
    let tail = |name: &str| {
        [
            "--max-steps",
            "60",
            "--set",
            "checkpoint.interval=3",
            "--set",
            &format!("logging.run_name={name}"),
        ]
        .map(String::from)
    };
    let args = |name: &str, head: &[&str]| {
        let t = tail(name);
        with(
            &base,
            head,
            &t.iter().map(String::as_str).collect::<Vec<_>>(),
        )
    };
    let started = Instant::now();
    ok(dir, &args("straight", &["run", "--nproc", "2", "--cpu"]));
    let straight_s = started.elapsed().as_secs_f64();
    let max = (kills + 2).to_string();
    let mut launcher = Launcher::start(
        dir,
        &args(
            "killed",
            &[
                "run",
                "--nproc",
                "2",
                "--cpu",
                "--max-restarts",
                &max,
                "--grace-s",
                "2",
            ],
        ),
    );
    let started = Instant::now();
    let mut rng = Lcg(0x50a6_2026);
    let mut dead: Vec<u32> = Vec::new();
    let limit = Duration::from_secs(600);
    for _ in 0..kills {
        let rank = rng.range(0, 1);
        let deadline = Instant::now() + limit;
        let t = loop {
            match rank_trace(dir, "killed", rank) {
                Some(t)
                    if t.steps_here >= 1
                        && !dead.contains(&t.pid)
                        && process_state(t.pid).is_some_and(|s| s != 'Z') =>
                {
                    break Some(t)
                }
                _ if !launcher.running() => break None,
                _ => {}
            }
            assert!(
                Instant::now() < deadline,
                "no progress:\n{}",
                launcher.text()
            );
            std::thread::sleep(Duration::from_millis(20));
        };
        let Some(t) = t else { break };
        std::thread::sleep(Duration::from_millis(rng.range(0, 1500) as u64));
        signal(t.pid, libc::SIGKILL);
        dead.push(t.pid);
        // The next kill belongs to the next attempt: wait for the restart (or the end).
        let before = restart_lines(&launcher.text());
        while restart_lines(&launcher.text()) == before && launcher.running() {
            assert!(
                Instant::now() < deadline,
                "no restart:\n{}",
                launcher.text()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    let (code, text) = launcher.finish(limit);
    let killed_s = started.elapsed().as_secs_f64();
    assert_eq!(code, Some(0), "{text}");
    let restarts = restart_lines(&text);
    let mid_save = text
        .lines()
        .filter(|l| l.starts_with("[CPU0] Ignoring incomplete checkpoint"))
        .count();
    eprintln!(
        "soak: {} kills, {restarts} restarts, {mid_save} interrupted saves; uninterrupted {straight_s:.1} s, with kills {killed_s:.1} s",
        dead.len()
    );
    assert_bitwise_equal_checkpoints(
        &dir.join("runs/straight/checkpoints/step_60"),
        &dir.join("runs/killed/checkpoints/step_60"),
    );
}
