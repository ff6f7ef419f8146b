//! End-to-end tests with real `/bin/sh` workers.
//!
//! Tests that signal the launcher itself run it in a child process (this test binary
//! re-executed on [`child_launcher`]), so signals never hit the test harness.

use std::io::Write;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::*;
use crate::dist::NodePlace;

/// Console and diagnostics captured in memory.
struct Captured {
    console: Arc<Mutex<Vec<u8>>>,
    diag: Arc<Mutex<Vec<u8>>>,
}

impl Captured {
    fn new() -> (Captured, Sinks) {
        let console = Arc::new(Mutex::new(Vec::new()));
        let diag = Arc::new(Mutex::new(Vec::new()));
        let sinks = Sinks {
            console: console.clone(),
            diag: diag.clone(),
        };
        (Captured { console, diag }, sinks)
    }
    fn console(&self) -> String {
        String::from_utf8(self.console.lock().unwrap().clone()).unwrap()
    }
    fn diag(&self) -> String {
        String::from_utf8(self.diag.lock().unwrap().clone()).unwrap()
    }
}

fn plan(devices: Devices, dir: &Path) -> LaunchPlan {
    LaunchPlan {
        devices,
        node: NodePlace {
            nnodes: 1,
            node_rank: 0,
            master_addr: "127.0.0.1".into(),
            master_port: 0,
        },
        rendezvous_timeout: Duration::from_secs(30),
        restart: RestartPolicy::default(),
        log_dir: dir.join("logs"),
        grace: Duration::from_secs(2),
        log_ranks: LogRanks::All,
    }
}

fn sh(script: &str) -> Vec<String> {
    vec!["-c".into(), script.into()]
}

/// Runs `script` under `/bin/sh` for every worker of `plan`.
fn run(plan: &LaunchPlan, script: &str) -> (Outcome, Captured) {
    let (cap, sinks) = Captured::new();
    let outcome = launch_with(plan, Path::new("/bin/sh"), &sh(script), &sinks).unwrap();
    (outcome, cap)
}

fn read(path: impl AsRef<Path>) -> String {
    std::fs::read_to_string(path.as_ref())
        .unwrap_or_else(|e| panic!("{}: {e}", path.as_ref().display()))
}

/// Whether `pid` is a running process (a zombie someone else has to reap counts as gone).
fn alive(pid: u32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    let state = stat
        .rsplit_once(") ")
        .and_then(|(_, rest)| rest.chars().next());
    !matches!(state, Some('Z') | Some('X'))
}

/// Whether `pid` still has a /proc entry whose parent is this test process: a zombie we failed
/// to reap, or a live child.
fn our_child(pid: u32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    let ppid = stat
        .rsplit_once(") ")
        .and_then(|(_, rest)| rest.split(' ').nth(1))
        .and_then(|p| p.parse::<u32>().ok());
    ppid == Some(std::process::id())
}

fn assert_all_gone(pids: &[u32]) {
    for &pid in pids {
        assert!(!alive(pid), "process {pid} survived");
        assert!(!our_child(pid), "process {pid} was not reaped");
    }
}

/// Pids that workers wrote to `<dir>/<prefix><rank>` (a worker stopped before writing its
/// file has none).
fn pid_files(dir: &Path, prefix: &str, ranks: usize) -> Vec<u32> {
    (0..ranks)
        .filter_map(|r| std::fs::read_to_string(dir.join(format!("{prefix}{r}"))).ok())
        .map(|s| s.trim().parse().unwrap())
        .collect()
}

fn wait_for(path: &Path, limit: Duration) {
    let deadline = Instant::now() + limit;
    while !path.exists() {
        assert!(
            Instant::now() < deadline,
            "{} never appeared",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn cpu_workers_get_rank_env_tags_and_logs() {
    let dir = tempfile::tempdir().unwrap();
    let p = plan(Devices::Cpu(2), dir.path());
    let (out, cap) = run(
        &p,
        "echo \"env RANK=$RANK WORLD_SIZE=$WORLD_SIZE LOCAL_RANK=$LOCAL_RANK \
         LOCAL_WORLD_SIZE=$LOCAL_WORLD_SIZE GROUP_RANK=$GROUP_RANK MASTER_ADDR=$MASTER_ADDR \
         MASTER_PORT=$MASTER_PORT CVD=[${CUDA_VISIBLE_DEVICES-unset}] L=$LOCKSTEP_LAUNCHER \
         TAG=$LOCKSTEP_TAG\"; echo \"[CPU$RANK] self-tagged\"; echo \"to stderr $RANK\" >&2",
    );
    assert_eq!(out.exit_code, 0);
    assert!(out.failure.is_none() && out.interrupted_by.is_none());
    assert_ne!(out.master_port, 0);
    let console = cap.console();
    for r in 0..2 {
        let env = format!(
            "[CPU{r}] env RANK={r} WORLD_SIZE=2 LOCAL_RANK={r} LOCAL_WORLD_SIZE=2 GROUP_RANK=0 \
             MASTER_ADDR=127.0.0.1 MASTER_PORT={} CVD=[] L=1 TAG=[CPU{r}]",
            out.master_port
        );
        assert!(console.contains(&env), "missing {env:?} in:\n{console}");
        assert!(
            console
                .lines()
                .any(|l| l == format!("[CPU{r}] self-tagged")),
            "{console}"
        );
        assert!(
            !console.contains(&format!("[CPU{r}] [CPU{r}]")),
            "double tag:\n{console}"
        );
        assert!(console.contains(&format!("[CPU{r}] to stderr {r}")));
        let log = read(p.log_dir.join(format!("rank_{r}.log")));
        assert!(log.contains(&env), "{log}");
        assert!(
            log.lines().any(|l| l == format!("[CPU{r}] self-tagged")),
            "{log}"
        );
        assert!(log.contains(&format!("[CPU{r}] to stderr {r}")));
        assert!(
            !log.contains(&format!("[CPU{}]", 1 - r)),
            "other rank in {log}"
        );
    }
    assert_eq!(console.lines().count(), 6, "{console}");
    assert!(cap.diag().is_empty(), "{}", cap.diag());
    assert_all_gone(&out.pids);
}

#[test]
fn console_shows_rank0_and_other_ranks_warnings_only() {
    let dir = tempfile::tempdir().unwrap();
    let mut p = plan(Devices::Cpu(3), dir.path());
    p.log_ranks = LogRanks::Rank0;
    let (out, cap) = run(
        &p,
        "echo \"step from $RANK\"; echo \"WARNING: slow from $RANK\"; echo \"Loss: NaN at $RANK\"",
    );
    assert_eq!(out.exit_code, 0);
    let console = cap.console();
    assert!(console.contains("[CPU0] step from 0"));
    for r in 1..3 {
        assert!(!console.contains(&format!("step from {r}")), "{console}");
        assert!(console.contains(&format!("[CPU{r}] WARNING: slow from {r}")));
        assert!(console.contains(&format!("[CPU{r}] Loss: NaN at {r}")));
        // The log keeps everything regardless of the console filter.
        let log = read(p.log_dir.join(format!("rank_{r}.log")));
        assert!(log.contains(&format!("[CPU{r}] step from {r}")), "{log}");
    }
}

/// Runs one launcher per node, each on its own thread (as on its own machine), with `script`
/// for every worker; node 0 hosts the store on a free port.
fn run_nodes(nodes: usize, mut p: LaunchPlan, script: &str) -> Vec<(Outcome, Captured)> {
    p.node.nnodes = nodes;
    p.node.master_port = crate::dist::free_port();
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..nodes)
            .map(|n| {
                let mut p = p.clone();
                p.node.node_rank = n;
                s.spawn(move || run(&p, script))
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn second_node_gets_global_ranks() {
    let dir = tempfile::tempdir().unwrap();
    let p = plan(Devices::Cpu(2), dir.path());
    let port_of = |out: &Outcome| out.master_port;
    let nodes = run_nodes(
        2,
        p.clone(),
        "echo \"RANK=$RANK WORLD_SIZE=$WORLD_SIZE LOCAL_RANK=$LOCAL_RANK GROUP_RANK=$GROUP_RANK \
         MASTER=$MASTER_ADDR:$MASTER_PORT\"",
    );
    let (out, cap) = &nodes[1];
    assert_eq!(out.exit_code, 0);
    assert_eq!(port_of(out), port_of(&nodes[0].0));
    let console = cap.console();
    for (local, rank) in [(0, 2), (1, 3)] {
        let line = format!(
            "[CPU{rank}] RANK={rank} WORLD_SIZE=4 LOCAL_RANK={local} GROUP_RANK=1 \
             MASTER=127.0.0.1:{}",
            out.master_port
        );
        assert!(console.contains(&line), "missing {line:?} in:\n{console}");
        assert!(read(p.log_dir.join(format!("rank_{rank}.log"))).contains(&line));
    }
    assert!(!nodes[0].1.console().contains("[CPU2]"));
}

#[test]
fn a_node_without_node_0_names_it() {
    let dir = tempfile::tempdir().unwrap();
    let mut p = plan(Devices::Cpu(1), dir.path());
    p.node.nnodes = 2;
    p.node.node_rank = 1;
    p.node.master_port = crate::dist::free_port();
    p.rendezvous_timeout = Duration::from_secs(1);
    let (_, sinks) = Captured::new();
    let err = launch_with(&p, Path::new("/bin/true"), &[], &sinks).unwrap_err();
    let msg = format!("{err:#}");
    assert!(
        msg.contains("node 1: cannot reach node 0's launcher at 127.0.0.1:")
            && msg.contains("--node-rank 0"),
        "{msg}"
    );
}

/// A trace file that says "one step done", for shell workers to copy to `$LOCKSTEP_TRACE`
/// (the launcher tells a failure before the first step from one after it by the trace).
fn stepped_trace(dir: &Path) -> String {
    use crate::dist::forensics::{trace::TraceFile, Forensics};
    let path = dir.join("stepped.trace");
    Forensics::new(0, "[CPU0]", Some(TraceFile::create(&path, 0).unwrap())).step_done(1);
    format!("cp {} \"$LOCKSTEP_TRACE\"", path.display())
}

fn restarts(max: usize, p: LaunchPlan) -> LaunchPlan {
    LaunchPlan {
        restart: RestartPolicy {
            max_restarts: max,
            ..Default::default()
        },
        ..p
    }
}

#[test]
fn failed_attempts_restart_every_worker_until_one_succeeds() {
    let dir = tempfile::tempdir().unwrap();
    let p = restarts(3, plan(Devices::Cpu(2), dir.path()));
    let stepped = stepped_trace(dir.path());
    // Rank 1 fails in attempts 0 and 1 after its first step; attempt 2 succeeds.
    let (out, cap) = run(
        &p,
        &format!(
            "{stepped}; echo attempt $TORCHELASTIC_RESTART_COUNT; \
             if [ $RANK = 1 ] && [ $TORCHELASTIC_RESTART_COUNT -lt 2 ]; then exit 5; fi; \
             [ $RANK = 1 ] || sleep 0.3"
        ),
    );
    let diag = cap.diag();
    assert_eq!(out.exit_code, 0, "{diag}");
    assert_eq!(out.restarts, 2);
    assert_eq!(out.pids.len(), 6, "two workers per attempt");
    assert!(
        diag.contains("lockstep run: restart 1 of 3: rank 1 (CPU) exited with code 5; all workers restart with --resume auto"),
        "{diag}"
    );
    assert!(
        diag.contains("lockstep run: restart 2 of 3: rank 1"),
        "{diag}"
    );
    assert!(!diag.contains("restart 3"), "{diag}");
    let log = read(p.log_dir.join("rank_0.log"));
    assert!(
        log.contains("[CPU0] attempt 0") && log.contains("[CPU0] attempt 2"),
        "{log}"
    );
    assert!(
        log.contains("[CPU0] lockstep run: restart 2: the worker starts again"),
        "{log}"
    );
    assert_all_gone(&out.pids);
}

#[test]
fn out_of_restarts_the_launcher_exits_with_the_workers_code() {
    let dir = tempfile::tempdir().unwrap();
    let p = restarts(2, plan(Devices::Cpu(2), dir.path()));
    let stepped = stepped_trace(dir.path());
    let (out, cap) = run(
        &p,
        &format!("{stepped}; if [ $RANK = 1 ]; then exit 9; fi; exec sleep 60"),
    );
    let diag = cap.diag();
    assert_eq!(out.exit_code, 9, "{diag}");
    assert_eq!(out.restarts, 2);
    assert!(diag.contains("restart 2 of 2"), "{diag}");
    assert!(
        diag.contains(
            "lockstep run: giving up: rank 1 (CPU) exited with code 9 after 2 restarts \
             (--max-restarts 2); exiting with its code 9"
        ),
        "{diag}"
    );
    assert_all_gone(&out.pids);
}

#[test]
fn failing_before_the_first_step_twice_in_a_row_stops_the_restarts() {
    let dir = tempfile::tempdir().unwrap();
    let p = restarts(5, plan(Devices::Cpu(2), dir.path()));
    // No trace file: the workers never got as far as a step.
    let (out, cap) = run(&p, "if [ $RANK = 0 ]; then exit 2; fi; exec sleep 60");
    let diag = cap.diag();
    assert_eq!(out.exit_code, 2, "{diag}");
    assert_eq!(out.restarts, 1, "{diag}");
    assert!(
        diag.contains("restart 1 of 5: rank 0 (CPU) exited with code 2 before its first step"),
        "{diag}"
    );
    assert!(
        diag.contains("not restarting: rank 0 (CPU) exited with code 2 before its first step, as in the previous attempt"),
        "{diag}"
    );
}

#[test]
fn a_failure_on_one_node_restarts_the_workers_of_every_node() {
    let dir = tempfile::tempdir().unwrap();
    let p = restarts(2, plan(Devices::Cpu(1), dir.path()));
    let stepped = stepped_trace(dir.path());
    // Rank 1 (node 1) fails in attempt 0; rank 0 (node 0) would run for a minute unless its
    // launcher stops it because of node 1.
    let nodes = run_nodes(
        2,
        p,
        &format!(
            "{stepped}; echo attempt $TORCHELASTIC_RESTART_COUNT; \
             if [ $TORCHELASTIC_RESTART_COUNT = 0 ]; then \
               if [ $RANK = 1 ]; then exit 4; else exec sleep 60; fi; fi"
        ),
    );
    for (n, (out, cap)) in nodes.iter().enumerate() {
        let diag = cap.diag();
        assert_eq!(out.exit_code, 0, "node {n}: {diag}");
        assert_eq!(out.restarts, 1, "node {n}: {diag}");
        assert!(
            diag.contains("restart 1 of 2: rank 1 (node 1, CPU) exited with code 4"),
            "node {n}: {diag}"
        );
        assert!(cap.console().contains(&format!("[CPU{n}] attempt 1")));
        assert_all_gone(&out.pids);
    }
    assert!(nodes[0]
        .1
        .diag()
        .contains("a worker on another node failed"));
}
#[test]
fn gpu_workers_see_exactly_their_device() {
    if !detect_gpus().is_empty() {
        // The ids below are made up; on a GPU machine they would be rejected.
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let p = plan(Devices::Gpus(vec![3, 5]), dir.path());
    let (out, cap) = run(&p, "echo \"CVD=$CUDA_VISIBLE_DEVICES RANK=$RANK\"");
    assert_eq!(out.exit_code, 0);
    let console = cap.console();
    assert!(console.contains("[GPU3] CVD=3 RANK=0"), "{console}");
    assert!(console.contains("[GPU5] CVD=5 RANK=1"), "{console}");
    assert!(read(p.log_dir.join("rank_1.log")).contains("[GPU5] CVD=5"));
}

#[test]
fn killed_rank_stops_the_others_and_returns_128_plus_signal() {
    let dir = tempfile::tempdir().unwrap();
    let mut p = plan(Devices::Cpu(2), dir.path());
    // Rank 1's lines are not on the console, so the failure report recalls them.
    p.log_ranks = LogRanks::Rank0;
    let d = dir.path().display();
    let started = Instant::now();
    let (out, cap) = run(
        &p,
        &format!(
            "echo $$ > {d}/pid_$RANK; if [ $RANK = 1 ]; then echo dying; kill -9 $$; fi; \
             exec sleep 60"
        ),
    );
    assert_eq!(out.exit_code, 137);
    assert!(started.elapsed() < p.grace + Duration::from_secs(5));
    let failure = out.failure.as_ref().unwrap();
    assert_eq!(failure.rank, 1);
    assert_eq!(failure.exit, ExitKind::Signal(9));
    let diag = cap.diag();
    assert!(
        diag.contains("lockstep run: rank 1 (CPU) failed: killed by signal SIGKILL (9)"),
        "{diag}"
    );
    assert!(diag.contains("    [CPU1] dying"), "{diag}");
    // Rank 0 was stopped by the launcher: not a failure of its own.
    assert!(!diag.contains("rank 0 (CPU) failed"), "{diag}");
    assert_all_gone(&out.pids);
    assert_all_gone(&pid_files(dir.path(), "pid_", 2));
}

#[test]
fn failing_rank_code_is_returned_and_reported() {
    let dir = tempfile::tempdir().unwrap();
    let mut p = plan(Devices::Cpu(2), dir.path());
    let script = "if [ $RANK = 1 ]; then for i in $(seq 1 30); do echo line $i; done; \
         echo 'Error: bad batch' >&2; exit 3; fi; exec sleep 60";
    // Every line on the console already: the report points there instead of repeating them.
    let (out, cap) = run(&p, script);
    assert_eq!(out.exit_code, 3);
    let diag = cap.diag();
    assert!(
        diag.contains("rank 1 (CPU) failed: exit code 3")
            && diag.contains("lockstep run: its last lines are above (log: ")
            && !diag.contains("    [CPU1] line 30"),
        "{diag}"
    );
    // Rank 1's lines hidden (the default): the report recalls its last ones.
    p.log_ranks = LogRanks::Rank0;
    let (out, cap) = run(&p, script);
    assert_eq!(out.exit_code, 3);
    assert_eq!(out.failure.as_ref().unwrap().rank, 1);
    let diag = cap.diag();
    assert!(diag.contains("rank 1 (CPU) failed: exit code 3"), "{diag}");
    assert!(diag.contains("rank_1.log"), "{diag}");
    // Only the tail: 20 lines ending with the error.
    assert!(diag.contains("    [CPU1] Error: bad batch"), "{diag}");
    assert!(diag.contains("    [CPU1] line 30\n"), "{diag}");
    assert!(!diag.contains("    [CPU1] line 11\n"), "{diag}");
    assert!(diag.contains("    [CPU1] line 12\n"), "{diag}");
    assert_all_gone(&out.pids);
}

#[test]
fn worker_ignoring_sigterm_is_killed_after_grace() {
    let dir = tempfile::tempdir().unwrap();
    let mut p = plan(Devices::Cpu(2), dir.path());
    p.grace = Duration::from_secs(1);
    let d = dir.path().display();
    let started = Instant::now();
    let (out, cap) = run(
        &p,
        &format!(
            "if [ $RANK = 1 ]; then while [ ! -e {d}/ready ]; do sleep 0.05; done; exit 1; fi; \
             trap '' TERM; echo $$ > {d}/sh; sleep 60 & echo $! > {d}/sleep; touch {d}/ready; \
             wait; wait; wait"
        ),
    );
    let took = started.elapsed();
    assert_eq!(out.exit_code, 1);
    assert!(took >= p.grace, "killed too early: {took:?}");
    assert!(
        took < p.grace + Duration::from_secs(5),
        "too slow: {took:?}"
    );
    let diag = cap.diag();
    assert!(diag.contains("rank 1 (CPU) failed: exit code 1"), "{diag}");
    assert!(
        diag.contains("rank(s) 0 still running 1.0s after SIGTERM; sending SIGKILL"),
        "{diag}"
    );
    let sh: u32 = read(dir.path().join("sh")).trim().parse().unwrap();
    let sleep: u32 = read(dir.path().join("sleep")).trim().parse().unwrap();
    assert_all_gone(&[sh, sleep]);
    assert_all_gone(&out.pids);
}

#[test]
fn busy_explicit_port_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let busy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = busy.local_addr().unwrap().port();
    let mut p = plan(Devices::Cpu(1), dir.path());
    p.node.master_port = port;
    let (_, sinks) = Captured::new();
    let err = launch_with(&p, Path::new("/bin/true"), &[], &sinks).unwrap_err();
    assert_eq!(
        err.to_string(),
        format!(
            "--master-port {port}: address 127.0.0.1:{port} is already in use; choose another \
             port or 0 for a free one"
        )
    );
    drop(busy);
    // The same port once freed is accepted and exported.
    let (out, cap) = run(&p, "echo port=$MASTER_PORT");
    assert_eq!(out.exit_code, 0);
    assert!(cap.console().contains(&format!("port={port}")));
}

#[test]
fn impossible_plans_are_rejected_before_starting() {
    let dir = tempfile::tempdir().unwrap();
    let (_, sinks) = Captured::new();
    let check = |p: LaunchPlan, want: &str| {
        let err = launch_with(&p, Path::new("/bin/true"), &[], &sinks).unwrap_err();
        assert!(err.to_string().contains(want), "{err:#} lacks {want:?}");
    };
    let base = plan(Devices::Cpu(1), dir.path());
    check(
        LaunchPlan {
            node: NodePlace {
                nnodes: 2,
                ..base.node.clone()
            },
            ..base.clone()
        },
        "--master-port 0",
    );
    check(
        LaunchPlan {
            node: NodePlace {
                nnodes: 2,
                node_rank: 2,
                master_port: 1234,
                ..base.node.clone()
            },
            ..base.clone()
        },
        "--node-rank 2 is out of range",
    );
    check(
        LaunchPlan {
            devices: Devices::Cpu(0),
            ..base.clone()
        },
        "--nproc",
    );
    check(
        LaunchPlan {
            devices: Devices::Gpus(vec![1, 1]),
            ..base.clone()
        },
        "listed twice",
    );
    check(
        LaunchPlan {
            devices: Devices::Gpus(vec![]),
            ..base.clone()
        },
        "at least one GPU",
    );
    assert!(
        !base.log_dir.exists(),
        "nothing may be created for a rejected plan"
    );
}

#[test]
fn missing_program_is_an_error_and_leaves_nothing_behind() {
    let dir = tempfile::tempdir().unwrap();
    let p = plan(Devices::Cpu(2), dir.path());
    let (_, sinks) = Captured::new();
    let err = launch_with(&p, Path::new("/nonexistent/lockstep"), &[], &sinks).unwrap_err();
    assert!(
        format!("{err:#}").contains("starting rank 0: /nonexistent/lockstep"),
        "{err:#}"
    );
}

// --- Signals to the launcher: run it in a child process. ---

/// Not a test: the launcher process for the tests below, configured through the environment.
#[test]
#[ignore = "entry point for tests that signal the launcher; runs only when they start it"]
fn child_launcher() {
    let Ok(dir) = std::env::var("LOCKSTEP_LAUNCH_TEST_DIR") else {
        return;
    };
    let script = std::env::var("LOCKSTEP_LAUNCH_TEST_SCRIPT").unwrap();
    let mut p = plan(Devices::Cpu(2), Path::new(&dir));
    p.grace = Duration::from_secs(30);
    let before = [
        handler(libc::SIGINT),
        handler(libc::SIGTERM),
        handler(libc::SIGUSR1),
    ];
    let code = launch(&p, Path::new("/bin/sh"), &sh(&script)).unwrap();
    std::io::stdout().flush().unwrap();
    // Alone in this process, the launcher must leave the dispositions as it found them.
    if before
        != [
            handler(libc::SIGINT),
            handler(libc::SIGTERM),
            handler(libc::SIGUSR1),
        ]
    {
        eprintln!("signal handlers were not restored");
        std::process::exit(99);
    }
    std::process::exit(code);
}

fn handler(sig: libc::c_int) -> libc::sighandler_t {
    // SAFETY: a query only (null new action) into a zeroed sigaction we own.
    unsafe {
        let mut old: libc::sigaction = std::mem::zeroed();
        libc::sigaction(sig, std::ptr::null(), &mut old);
        old.sa_sigaction
    }
}

/// Starts [`child_launcher`] in a new process with `script` as the workers' shell script.
fn start_child_launcher(dir: &Path, script: &str) -> Child {
    let path = module_path!()
        .split_once("::")
        .map_or(module_path!(), |(_, p)| p);
    Command::new(std::env::current_exe().unwrap())
        .args([
            &format!("{path}::child_launcher"),
            "--exact",
            "--ignored",
            "--nocapture",
        ])
        .env("LOCKSTEP_LAUNCH_TEST_DIR", dir)
        .env("LOCKSTEP_LAUNCH_TEST_SCRIPT", script)
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(dir.join("launcher.out")).unwrap())
        .stderr(std::fs::File::create(dir.join("launcher.err")).unwrap())
        .spawn()
        .unwrap()
}

fn wait_child(child: &mut Child, limit: Duration, dir: &Path) -> std::process::ExitStatus {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "launcher did not exit in {limit:?}; stderr:\n{}",
                read(dir.join("launcher.err"))
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn send(child: &Child, sig: libc::c_int) {
    // SAFETY: plain kill(2) to our own, not yet reaped, child.
    assert_eq!(unsafe { libc::kill(child.id() as libc::pid_t, sig) }, 0);
}

fn wait_ready(dir: &Path) -> Vec<u32> {
    for r in 0..2 {
        wait_for(&dir.join(format!("ready_{r}")), Duration::from_secs(10));
    }
    pid_files(dir, "pid_", 2)
}

/// SIGINT is forwarded as SIGTERM; a stop every worker saved and exited 0 from exits 0 (as
/// `lockstep train` after a signal; finding 22: it was 130/143), one a worker did not end
/// cleanly gives 128 + the signal.
#[test]
fn sigint_is_forwarded_as_sigterm_and_a_stop_every_worker_saved_exits_0() {
    for (worker_exit, launcher_exit) in [(0, 0), (1, 130)] {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().display();
        let mut child = start_child_launcher(
            dir.path(),
            &format!(
                "trap 'echo saved > {d}/term_$RANK; exit {worker_exit}' TERM; echo $$ > \
                 {d}/pid_$RANK; touch {d}/ready_$RANK; sleep 60 & wait $!"
            ),
        );
        let pids = wait_ready(dir.path());
        send(&child, libc::SIGINT);
        let status = wait_child(&mut child, Duration::from_secs(10), dir.path());
        let err = read(dir.path().join("launcher.err"));
        assert_eq!(status.code(), Some(launcher_exit), "{err}");
        assert!(
            err.contains("got SIGINT; asking the workers to stop"),
            "{err}"
        );
        for r in 0..2 {
            // Each worker ran its SIGTERM handler (where a trainer saves its checkpoint).
            assert_eq!(read(dir.path().join(format!("term_{r}"))).trim(), "saved");
        }
        assert_all_gone(&pids);
    }
}

#[test]
fn second_sigterm_kills_at_once_and_returns_143() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().display();
    let mut child = start_child_launcher(
        dir.path(),
        &format!("trap '' TERM; echo $$ > {d}/pid_$RANK; touch {d}/ready_$RANK; exec sleep 60"),
    );
    let pids = wait_ready(dir.path());
    let started = Instant::now();
    send(&child, libc::SIGTERM);
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        pids.iter().all(|&p| alive(p)),
        "workers ignoring SIGTERM must still run"
    );
    send(&child, libc::SIGTERM);
    // The grace is 30 s: returning quickly proves the second signal killed them.
    let status = wait_child(&mut child, Duration::from_secs(5), dir.path());
    let err = read(dir.path().join("launcher.err"));
    assert_eq!(status.code(), Some(143), "{err}");
    assert!(started.elapsed() < Duration::from_secs(5));
    assert!(err.contains("got SIGTERM; killing the workers"), "{err}");
    assert_all_gone(&pids);
}

#[test]
fn sigusr1_reports_and_stops_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().display();
    let mut child = start_child_launcher(
        dir.path(),
        &format!("echo $$ > {d}/pid_$RANK; touch {d}/ready_$RANK; exec sleep 60"),
    );
    let pids = wait_ready(dir.path());
    send(&child, libc::SIGUSR1);
    let deadline = Instant::now() + Duration::from_secs(10);
    while !read(dir.path().join("launcher.err")).contains("hang report (on SIGUSR1") {
        assert!(Instant::now() < deadline, "no report");
        std::thread::sleep(Duration::from_millis(20));
    }
    // Shell workers have no SIGUSR1 handler (no trace says so): they must not get one.
    std::thread::sleep(Duration::from_millis(200));
    assert!(pids.iter().all(|&p| alive(p)), "SIGUSR1 stopped a worker");
    let err = read(dir.path().join("launcher.err"));
    assert!(
        err.contains("(no trace: the worker did not get as far"),
        "{err}"
    );
    send(&child, libc::SIGKILL);
    child.wait().unwrap();
}

#[test]
fn killed_launcher_leaves_no_orphans() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().display();
    let mut child = start_child_launcher(
        dir.path(),
        &format!("echo $$ > {d}/pid_$RANK; touch {d}/ready_$RANK; exec sleep 60"),
    );
    let pids = wait_ready(dir.path());
    send(&child, libc::SIGKILL);
    child.wait().unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while pids.iter().any(|&p| alive(p)) {
        assert!(
            Instant::now() < deadline,
            "workers outlived a SIGKILLed launcher"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}
