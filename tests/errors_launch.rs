//! Launching: the launcher and its workers, ranks, and the Slurm/torchrun environment. A
//! background save every rank had reported commits when a rank dies; a port in use, a backend or
//! device the workers cannot have, more CPU workers than the host's memory holds, Slurm variables
//! that disagree and a job started without srun are refused before any worker starts, naming the
//! fix; workers hold none of the launcher's sockets; the errors of srun tasks say their rank; a
//! broken torch install, a deleted working directory and scripts/env.sh in a job script are
//! handled. From the reliability rounds (issue 20; round 4, issue 32; round 5, issue 45: a bare
//! "Item N" is issue 45's) and the rows of docs/FAILURES.md; each finding's test failed before
//! its fix.

use crate::common;

use std::fs;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::{
    assert_bitwise_equal_checkpoints, cmd, fails, lockstep, ok, output_text, python, root, run,
    small, with, write_corpus,
};

/// The `step_*` entries of a checkpoint directory, complete or not, sorted.
fn saves(root: &Path) -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(root)
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with("step_"))
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

/// Two CPU ranks saving every 2 steps in the background, whose reports (rank 0: its commit)
/// wait 2 s, as a slow filesystem makes them.
fn two_ranks(base: &[String], name: &str, extra: &[&str]) -> Vec<String> {
    let tail = [
        "--max-steps",
        "6",
        "--set",
        "checkpoint.interval=2",
        "--set",
        "checkpoint.async=true",
        "--set",
        &format!("logging.run_name={name}"),
    ];
    with(
        base,
        &["run", "--nproc", "2", "--cpu"],
        &[&tail[..], extra].concat(),
    )
}

/// Item 6: rank 1 dies after every rank has written and reported its files of step_2 (saved in
/// the background), and rank 0, still before its commit, is SIGKILLed by the launcher's
/// teardown (`--grace-s 1`). The save is complete, so the restart commits it and resumes from
/// it (it used to restart from the start); the result is the uninterrupted run's, bit for bit.
/// A save that a rank never reported is still abandoned.
#[test]
fn a_background_save_every_rank_reported_commits_when_a_rank_dies() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let base = small(&write_corpus(dir));
    ok(dir, &with(&base, &["prepare"], &[]));
    ok(dir, &two_ranks(&base, "straight", &[]));

    let dies = [
        "--set",
        "debug.save_report_delay_ms=3000",
        "--set",
        "debug.fault_rank=1",
        "--set",
        "debug.fault_step=3",
        "--max-restarts",
        "1",
        "--grace-s",
        "1",
    ];
    let reported = [&dies[..], &["--set", "debug.fault=exit_after_save"]].concat();
    let text = ok(dir, &two_ranks(&base, "reported", &reported));
    assert!(
        text.contains(
            "lockstep run: restart 1 of 1: rank 1 (CPU) exited with code 3; all workers restart \
             from the latest complete checkpoint, runs/reported/checkpoints/step_2 (step 2, \
             committed now: every rank had written and reported its files)"
        ),
        "{text}"
    );
    assert_bitwise_equal_checkpoints(
        &dir.join("runs/straight/checkpoints/step_6"),
        &dir.join("runs/reported/checkpoints/step_6"),
    );
    let kept = saves(&dir.join("runs/reported/checkpoints"));
    assert_eq!(kept, ["step_2", "step_4", "step_6"], "{text}");
    for step in &kept {
        let ckpt = dir.join("runs/reported/checkpoints").join(step);
        let pending: Vec<_> = fs::read_dir(&ckpt)
            .unwrap()
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().contains("pending"))
            .collect();
        assert!(pending.is_empty(), "{step}: {pending:?}");
    }

    // Rank 1 dies while its report waits: step_2 is not committed, and the restart (which
    // meets the same fault) begins from the start.
    let unreported = [&dies[..], &["--set", "debug.fault=exit"]].concat();
    let out = run(dir, &two_ranks(&base, "unreported", &unreported));
    let text = fails(
        &out,
        3,
        &[
            "lockstep run: restart 1 of 1: rank 1 (CPU) exited with code 3; all workers restart \
           from the start (no complete checkpoint yet)",
        ],
    );
    let left = saves(&dir.join("runs/unreported/checkpoints"));
    assert!(left.iter().all(|n| n.ends_with(".tmp")), "{left:?}\n{text}");
}

/// Environment variables and their values.
type Vars<'a> = &'a [(&'a str, &'a str)];

/// `lockstep train` as one task of a job whose Slurm variables are `vars`.
fn slurm_task(dir: &Path, base: &[String], vars: Vars) -> std::process::Output {
    let mut cmd = lockstep(dir);
    cmd.args(with(base, &["train"], &["--max-steps", "1"]));
    for (k, v) in vars {
        cmd.env(k, v);
    }
    cmd.output().unwrap()
}

/// Items 20, 21: Slurm variables that contradict each other were accepted (SLURM_NTASKS=1 with
/// SLURM_TASKS_PER_NODE='2(x3),1' trained as one task; SLURM_NTASKS=99999 split the memory
/// 99999 ways), and SLURM_JOB_ID=abc did not say that MASTER_PORT bypasses it. Now each is
/// refused with exit 2 before anything is created, naming the variables and their values.
#[test]
fn slurm_variables_that_disagree_exit_2_naming_them() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let base = small(&write_corpus(dir));
    let cases: [(Vars, &[&str]); 3] = [
        (
            &[
                ("SLURM_PROCID", "0"),
                ("SLURM_NTASKS", "1"),
                ("SLURM_TASKS_PER_NODE", "2(x3),1"),
                ("SLURM_JOB_ID", "5"),
            ],
            &[
                "SLURM_NTASKS=1 but SLURM_TASKS_PER_NODE=\"2(x3),1\" adds up to 7 tasks",
                "start the tasks with srun",
            ],
        ),
        (
            &[
                ("SLURM_PROCID", "0"),
                ("SLURM_NTASKS", "99999"),
                ("SLURM_TASKS_PER_NODE", "1"),
                ("SLURM_JOB_ID", "5"),
            ],
            &["SLURM_NTASKS=99999 but SLURM_TASKS_PER_NODE=\"1\" adds up to 1 tasks"],
        ),
        (
            &[
                ("SLURM_PROCID", "0"),
                ("SLURM_NTASKS", "2"),
                ("SLURM_TASKS_PER_NODE", "2"),
                ("SLURM_JOB_NODELIST", "localhost"),
                ("SLURM_JOB_ID", "abc"),
            ],
            &[
                "SLURM_JOB_ID=\"abc\" is not a valid non-negative integer",
                "set MASTER_PORT (the same on every task) to bypass it",
            ],
        ),
    ];
    for (vars, parts) in cases {
        let out = slurm_task(dir, &base, vars);
        let text = fails(&out, 2, parts);
        assert_eq!(
            text.lines().filter(|l| l.contains("error")).count(),
            1,
            "{text}"
        );
        assert!(!dir.join("runs").exists(), "{vars:?}: {text}");
    }
}

/// Item 11: a batch script that ran `lockstep train` without srun starts task 0 only, which
/// waited silently for the whole system.collective_timeout_s. Now, after 10 s at the
/// rendezvous, it names the missing task and says that tasks start with srun; the timeout's
/// error names them too.
#[test]
fn a_slurm_task_started_without_srun_names_the_missing_tasks_and_srun() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let base = small(&write_corpus(dir));
    ok(dir, &with(&base, &["prepare"], &[]));
    let port = lockstep::dist::free_port().to_string();
    let mut cmd = lockstep(dir);
    cmd.args(with(
        &base,
        &["train"],
        &[
            "--max-steps",
            "1",
            "--set",
            "system.collective_timeout_s=12",
        ],
    ));
    for (k, v) in [
        ("SLURM_PROCID", "0"),
        ("SLURM_NTASKS", "2"),
        ("SLURM_TASKS_PER_NODE", "2"),
        ("SLURM_JOB_NODELIST", "localhost"),
        ("SLURM_JOB_ID", "7"),
        ("MASTER_PORT", port.as_str()),
    ] {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    fails(
        &out,
        1,
        &[
            "[CPU0] Rendezvous: waiting for rank 1 of 2 for 10 s now (up to 12 s, \
             system.collective_timeout_s); Slurm tasks start with srun: put `srun lockstep \
             train …` in the batch script, which starts all SLURM_NTASKS=2 of them",
            "error: rank 1 of 2 never arrived at the rendezvous on localhost:",
            "within 12 s (system.collective_timeout_s); Slurm tasks start with srun",
        ],
    );
}

/// A file's contents.
type Bytes<'a> = &'a [u8];

/// Item 10: a torch 2.11 whose libtorch_cpu.so is empty or not a library, or whose libc10.so
/// is missing, gave raw loader errors (exit 127) through the pip wheel's launcher. The launcher
/// (python/lockstep/__main__.py, run here on a fake torch) now checks each library the binary
/// links and says in one line which is broken and the fix (exit 2).
#[test]
fn a_broken_torch_install_is_named_by_the_launcher_with_the_fix() {
    let tmp = tempfile::tempdir().unwrap();
    let lib = tmp.path().join("torch/lib");
    fs::create_dir_all(&lib).unwrap();
    fs::write(tmp.path().join("torch/__init__.py"), "").unwrap();
    fs::write(
        tmp.path().join("torch/version.py"),
        "__version__ = '2.11.0+cpu'\n",
    )
    .unwrap();
    let elf: &[u8] = b"\x7fELF\x02\x01\x01";
    // (libtorch_cpu.so's bytes, libc10.so's if present, what the launcher says)
    let cases: [(Bytes, Option<Bytes>, &str); 3] = [
        (b"", Some(elf), "libtorch_cpu.so is empty (0 bytes)"),
        (elf, None, "libc10.so is missing"),
        (
            b"version https://git-lfs",
            Some(elf),
            "libtorch_cpu.so is not a shared library (no ELF header)",
        ),
    ];
    for (cpu, c10, says) in cases {
        fs::write(lib.join("libtorch_cpu.so"), cpu).unwrap();
        let _ = fs::remove_file(lib.join("libc10.so"));
        if let Some(c10) = c10 {
            fs::write(lib.join("libc10.so"), c10).unwrap();
        }
        let out = Command::new(python())
            .arg(root().join("python/lockstep/__main__.py"))
            .arg("--version")
            .env("PYTHONPATH", tmp.path())
            .output()
            .unwrap();
        let text = fails(
            &out,
            2,
            &[
                &format!("lockstep: {}/", lib.display()),
                says,
                "the torch 2.11.0+cpu install in",
                "is broken; reinstall it: pip install --force-reinstall \"torch==2.11.*\"",
            ],
        );
        assert_eq!(text.lines().count(), 1, "{text}");
    }
}

/// Item 10: `lockstep --version` (and `env`) from a working directory that was deleted died in
/// oneMKL's library constructor ("Intel oneMKL FATAL ERROR: Cannot load libtorch_cpu.so",
/// exit 2) before `main`; now they work, and a command that writes says its path is gone.
#[test]
fn version_and_env_work_from_a_deleted_working_directory() {
    let tmp = tempfile::tempdir().unwrap();
    let gone = tmp.path().join("gone");
    let from_gone = |args: &str| {
        fs::create_dir(&gone).unwrap();
        Command::new("sh")
            .arg("-c")
            .arg(format!(
                "cd '{}' && rmdir '{}' && exec '{}' {args}",
                gone.display(),
                gone.display(),
                env!("CARGO_BIN_EXE_lockstep")
            ))
            .output()
            .unwrap()
    };
    let out = from_gone("--version");
    assert!(out.status.success(), "{}", output_text(&out));
    assert!(
        output_text(&out).starts_with("lockstep "),
        "{}",
        output_text(&out)
    );
    let out = from_gone("env");
    assert!(out.status.success(), "{}", output_text(&out));
    assert!(
        output_text(&out).contains("libtorch"),
        "{}",
        output_text(&out)
    );
    let out = from_gone("train --preset tiny --max-steps 1");
    fails(&out, 1, &["cannot create run directory runs/tiny"]);
}

#[test]
fn master_port_in_use_exits_1_before_any_worker_starts() {
    let tmp = tempfile::tempdir().unwrap();
    let corpus = write_corpus(tmp.path());
    let busy = std::net::TcpListener::bind(("0.0.0.0", 0)).unwrap();
    let port = busy.local_addr().unwrap().port().to_string();
    let out = run(
        tmp.path(),
        &cmd(
            "run",
            &small(&corpus),
            &[
                "--cpu",
                "--nproc",
                "1",
                "--master-port",
                &port,
                "--max-steps",
                "1",
            ],
        ),
    );
    fails(
        &out,
        1,
        &[
            &format!("--master-port {port}: address 127.0.0.1:{port} is already in use"),
            "choose another port or 0 for a free one",
        ],
    );
    // No worker ran: no per-rank logs, no run directory.
    assert!(!tmp.path().join("logs").exists());
    assert!(!tmp.path().join("runs").exists());
    drop(busy);
}

#[test]
fn nccl_for_cpu_workers_exits_2_before_any_worker_starts() {
    let tmp = tempfile::tempdir().unwrap();
    let corpus = write_corpus(tmp.path());
    let out = run(
        tmp.path(),
        &cmd(
            "run",
            &small(&corpus),
            &[
                "--cpu",
                "--nproc",
                "2",
                "--set",
                "system.dist_backend=nccl",
                "--max-steps",
                "1",
            ],
        ),
    );
    fails(
        &out,
        2,
        &[
            "system.dist_backend = nccl needs CUDA ranks, but lockstep run starts CPU workers",
            "use system.dist_backend=auto or ring",
        ],
    );
    assert!(!tmp.path().join("logs").exists());
    assert!(!tmp.path().join("runs").exists());
}

#[test]
fn gpus_on_a_machine_without_a_gpu_are_refused_before_any_worker_starts() {
    if !lockstep::launch::detect_gpus().is_empty() {
        eprintln!("SKIPPED: this machine has a GPU");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let corpus = write_corpus(tmp.path());
    let out = run(
        tmp.path(),
        &cmd("run", &small(&corpus), &["--gpus", "0", "--max-steps", "1"]),
    );
    let text = fails(
        &out,
        1,
        &[
            "--gpus 0: no NVIDIA GPU found on this machine",
            "run CPU workers with --cpu --nproc N",
        ],
    );
    assert!(!text.contains("[GPU0]"), "no line may claim a GPU:\n{text}");
    assert!(!tmp.path().join("logs").exists());
    assert!(!tmp.path().join("runs").exists());
    // Asking for CUDA on CPU workers is a config error, also before anything starts.
    let out = run(
        tmp.path(),
        &cmd(
            "run",
            &small(&corpus),
            &["--cpu", "--set", "system.device=cuda", "--max-steps", "1"],
        ),
    );
    fails(
        &out,
        2,
        &["system.device = cuda, but lockstep run starts CPU workers"],
    );
    assert!(!tmp.path().join("runs").exists());
}

/// Issue 20, finding 11: `run --nproc 64 --cpu` on a small host started 64 workers that each
/// refused with "use more ranks"; the launcher now checks the node's memory once, before any start.
#[test]
fn too_many_cpu_workers_for_the_host_are_refused_by_the_launcher() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let corpus = write_corpus(dir);
    let big = with(
        &small(&corpus),
        &["run", "--cpu", "--nproc", "64", "--"],
        &[
            "--set",
            "model.hidden_size=1024",
            "--set",
            "model.num_layers=8",
            "--set",
            "model.intermediate_size=2816",
            "--set",
            "model.num_attention_heads=8",
            "--set",
            "model.num_key_value_heads=8",
            "--max-steps",
            "1",
        ],
    );
    let text = fails(
        &run(dir, &big),
        2,
        &[
            "--nproc 64: 64 CPU workers on this node share MemAvailable",
            "each needs an estimated",
            "more workers on one host only add copies",
        ],
    );
    assert!(!text.contains("use more ranks"), "{text}");
    assert!(!text.contains("[launcher] 64 workers"), "{text}");
    assert!(!dir.join("logs").exists() && !dir.join("runs").exists());
}

/// Issue 20, finding 15: the launcher's rendezvous store listening socket was inherited by every
/// worker (no close-on-exec), so a worker outliving its launcher kept the port bound.
#[test]
fn workers_do_not_inherit_the_stores_listening_socket() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let corpus = write_corpus(dir);
    let base = with(
        &small(&corpus),
        &["run", "--cpu", "--nproc", "1", "--"],
        &["--max-steps", "100000"],
    );
    let mut child = lockstep(dir)
        .args(&base)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut err = BufReader::new(child.stderr.take().unwrap()).lines();
    let port: u16 = loop {
        let line = err.next().expect("the launcher's line").unwrap();
        if let Some(rest) = line.split("rendezvous on 127.0.0.1:").nth(1) {
            break rest.split(',').next().unwrap().trim().parse().unwrap();
        }
    };
    // The listening socket's inode, from /proc/net/tcp (state 0A = LISTEN).
    let listen_inode = fs::read_to_string("/proc/net/tcp")
        .unwrap()
        .lines()
        .skip(1)
        .find_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let local_port = u16::from_str_radix(f[1].rsplit(':').next()?, 16).ok()?;
            (local_port == port && f[3] == "0A").then(|| f[9].to_string())
        })
        .expect("the store listens");
    let launcher = child.id();
    let worker = common::worker_of(launcher, Duration::from_secs(60));
    let held: Vec<String> = fs::read_dir(format!("/proc/{worker}/fd"))
        .unwrap()
        .filter_map(|e| fs::read_link(e.ok()?.path()).ok())
        .map(|l| l.display().to_string())
        .collect();
    // SAFETY: kill(2) of the launcher this test started (it stops its worker).
    unsafe { libc::kill(launcher as libc::pid_t, libc::SIGKILL) };
    // SAFETY: as above, for the worker.
    unsafe { libc::kill(worker as libc::pid_t, libc::SIGKILL) };
    let _ = child.wait();
    assert!(
        !held.contains(&format!("socket:[{listen_inode}]")),
        "the worker holds the store's listening socket: {held:?}"
    );
}

/// Round 4 (issue 32), finding 30: sourcing scripts/env.sh turned on `set -euo pipefail` in the
/// caller's shell, so a job script that sources it died at its first failing command. The caller's
/// options stay as they were.
#[test]
fn sourcing_env_sh_leaves_the_callers_shell_options() {
    let script = format!(
        "set +euo pipefail; source {}; false; echo \"survived $-\"; set -o | grep pipefail",
        common::root().join("scripts/env.sh").display()
    );
    let out = std::process::Command::new("bash")
        .args(["-c", &script])
        .output()
        .unwrap();
    let text = common::output_text(&out);
    let flags = text
        .lines()
        .find_map(|l| l.strip_prefix("survived "))
        .unwrap_or_else(|| panic!("the shell died after a failing command:\n{text}"));
    assert!(!flags.contains('e') && !flags.contains('u'), "{text}");
    assert!(text.contains("pipefail") && text.contains("off"), "{text}");
}

/// Round 4 (issue 32), finding 31: under srun, start-up errors carried no rank tag, so two tasks
/// printed the same error twice with nothing to tell them apart. Each rank of a job of several tags
/// its error.
#[test]
fn the_errors_of_srun_tasks_say_which_task_they_come_from() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    for r in 0..2 {
        let mut c = common::lockstep(dir);
        for k in [
            "RANK",
            "WORLD_SIZE",
            "LOCAL_RANK",
            "LOCAL_WORLD_SIZE",
            "LOCKSTEP_TAG",
        ] {
            c.env_remove(k);
        }
        let out = c
            .args(["train", "--set", "training.lerning_rate=1"])
            .env("SLURM_PROCID", r.to_string())
            .env("SLURM_NTASKS", "2")
            .output()
            .unwrap();
        let text = common::output_text(&out);
        assert_eq!(out.status.code(), Some(2), "{text}");
        assert!(
            text.starts_with(&format!(
                "[rank {r}] error: --set training.lerning_rate=1: unknown config key"
            )),
            "{text}"
        );
    }
}
