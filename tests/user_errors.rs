//! Findings of a 67-input probe (issue 20): each test failed before its fix. Usage errors exit
//! 2 and name the key or flag and the fix; nothing the user wrote is overwritten; nothing is
//! created outside the places asked for; what a run skips or loses is said.

mod common;

use std::fs;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use common::{fails, lockstep, ok, output_text, run, small, with, write_corpus};

fn args(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| s.to_string()).collect()
}

/// Every path under `dir` (relative), sorted.
fn tree(dir: &Path) -> Vec<String> {
    fn walk(root: &Path, dir: &Path, out: &mut Vec<String>) {
        for e in fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            out.push(p.strip_prefix(root).unwrap().display().to_string());
            if p.is_dir() {
                walk(root, &p, out);
            }
        }
    }
    let mut out = Vec::new();
    walk(dir, dir, &mut out);
    out.sort();
    out
}

/// Finding 2: `--config experiments/exp1/config.json` with `logging.dir=experiments` and
/// `logging.run_name=exp1` replaced the user's file with the resolved config.
#[test]
fn a_config_file_in_the_run_directory_is_never_overwritten() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let corpus = write_corpus(dir);
    fs::create_dir_all(dir.join("experiments/exp1")).unwrap();
    let mine = r#"{"training": {"learning_rate": 0.002}}"#;
    let file = dir.join("experiments/exp1/config.json");
    fs::write(&file, mine).unwrap();
    let base = with(
        &small(&corpus),
        &["train"],
        &[
            "--config",
            "experiments/exp1/config.json",
            "--set",
            "logging.dir=experiments",
            "--set",
            "logging.run_name=exp1",
            "--max-steps",
            "1",
        ],
    );
    fails(
        &run(dir, &base),
        2,
        &[
            "--config experiments/exp1/config.json is the run directory's config.json",
            "logging.run_name = \"exp1\"",
            "Keep your config outside the run directory",
            "--set logging.run_name=NAME",
        ],
    );
    assert_eq!(
        fs::read_to_string(&file).unwrap(),
        mine,
        "the file was changed"
    );
    assert_eq!(tree(&dir.join("experiments")), ["exp1", "exp1/config.json"]);

    // The config.json lockstep wrote, given back unchanged, is fine (nothing would change).
    let plain = with(&small(&corpus), &["train"], &["--max-steps", "1"]);
    ok(dir, &plain);
    let written = dir.join("runs/tiny/config.json");
    let before = fs::read(&written).unwrap();
    ok(
        dir,
        &args(&[
            "train",
            "--preset",
            "tiny",
            "--config",
            "runs/tiny/config.json",
            "--resume",
            "auto",
        ]),
    );
    assert_eq!(fs::read(&written).unwrap(), before);
}

/// Finding 3: run names that are not one plain folder name wrote outside `logging.dir`, into
/// it, or into the working directory.
#[test]
fn run_names_that_are_not_one_folder_name_are_refused_and_create_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("work");
    fs::create_dir_all(&dir).unwrap();
    let corpus = write_corpus(tmp.path());
    let before = tree(tmp.path());
    for name in ["../../escape", "/abs/path", "..", ".", "", "a/b"] {
        let set = format!("logging.run_name={name}");
        for sub in [&["train"][..], &["run", "--cpu", "--nproc", "1", "--"][..]] {
            let out = run(
                &dir,
                &with(&small(&corpus), sub, &["--set", &set, "--max-steps", "1"]),
            );
            fails(
                &out,
                2,
                &[
                    &format!("logging.run_name = {name:?}"),
                    "one plain folder name (e.g. --set logging.run_name=exp1)",
                ],
            );
        }
    }
    assert_eq!(tree(tmp.path()), before, "something was created");
    assert!(!Path::new("/abs/path").exists());
}

/// Findings 13 and 15: usage errors found after parsing exit 2 like clap's, and a negative
/// number is a value, not a flag.
#[test]
fn usage_errors_exit_2_naming_the_flag_and_the_fix() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    for (list, parts) in [
        (
            &[
                "generate",
                "--model",
                "m",
                "--prompt",
                "hi",
                "--temperature",
                "-1",
            ][..],
            &["--temperature -1 must be a finite number >= 0"][..],
        ),
        (
            &["generate", "--model", "m", "--prompt", "hi", "--top-p", "2"],
            &["--top-p 2 must be in (0, 1]"],
        ),
        (
            &["run", "--cpu", "--nproc", "0", "--", "--preset", "tiny"],
            &["--nproc 0: must be at least 1"],
        ),
        (
            &[
                "train",
                "--preset",
                "tiny",
                "--resume",
                "/nonexistent/step_5",
            ],
            &[
                "--resume /nonexistent/step_5: no such directory",
                "--resume auto",
            ],
        ),
        (
            &["train", "--preset", "tiny", "--set", "model.vocab_size=0"],
            &["model.vocab_size = 0: must be at least the tokenizer's"],
        ),
    ] {
        fails(&run(dir, &args(list)), 2, parts);
    }
    assert!(!dir.join("runs").exists(), "a refused start left runs/");
    let help = output_text(&run(dir, &args(&["export", "--help"])));
    assert!(help.contains("fp32|bf16|fp16"), "{help}");
}

/// Finding 15: a start refused after the run directory was claimed (here: no such data) leaves
/// no empty `runs/`; more threads than CPUs are named.
#[test]
fn a_refused_start_leaves_no_empty_runs_and_too_many_threads_are_named() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let corpus = write_corpus(dir);
    let missing = with(
        &small(&corpus),
        &["train"],
        &["--set", "data.path=nowhere.txt", "--max-steps", "1"],
    );
    let out = run(dir, &missing);
    assert_eq!(out.status.code(), Some(1), "{}", output_text(&out));
    assert!(!dir.join("runs").exists(), "{:?}", tree(dir));

    let many = with(
        &small(&corpus),
        &["train"],
        &["--set", "system.num_threads=1000", "--max-steps", "1"],
    );
    let text = ok(dir, &many);
    assert!(
        text.contains("Warning: system.num_threads = 1000 is more than the")
            && text.contains("CPUs this process may use"),
        "{text}"
    );
}

/// Finding 7: a damaged newest checkpoint no longer stops `--resume auto`: it falls back to the
/// newest one that loads and says what is trained again.
#[test]
fn resume_auto_skips_a_damaged_newest_checkpoint_and_says_what_is_redone() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let corpus = write_corpus(dir);
    let base = with(
        &small(&corpus),
        &["train"],
        &[
            "--set",
            "checkpoint.interval=2",
            "--set",
            "checkpoint.keep_last=3",
        ],
    );
    ok(dir, &with(&base, &[], &["--max-steps", "4"]));
    let root = dir.join("runs/tiny/checkpoints");
    for damage in ["weights", "trainer.json"] {
        match damage {
            "weights" => {
                let f = root.join("step_4/model.safetensors");
                let len = fs::metadata(&f).unwrap().len();
                fs::File::options()
                    .write(true)
                    .open(&f)
                    .unwrap()
                    .set_len(len - 1000)
                    .unwrap();
            }
            _ => {
                let f = root.join("step_4/trainer.json");
                let text = fs::read_to_string(&f).unwrap();
                fs::write(&f, &text[..text.len() / 2]).unwrap();
            }
        }
        let text = ok(
            dir,
            &with(&base, &[], &["--max-steps", "4", "--resume", "auto"]),
        );
        assert!(
            text.contains("skipping damaged checkpoint runs/tiny/checkpoints/step_4 (")
                && text.contains(
                    "resuming from runs/tiny/checkpoints/step_2 instead; steps 3..=4 will be \
                     trained again"
                )
                && text.contains("Resumed from")
                && text.contains("at step 2 "),
            "{damage}: {text}"
        );
        // The damaged one was set aside (step_4.damaged…) and step 4 saved anew.
        assert!(text.contains("Checkpoint saved"), "{text}");
    }
    fails(
        &run(dir, &with(&base, &[], &["--resume", "runs/none/step_1"])),
        2,
        &["--resume runs/none/step_1: no such directory"],
    );
}

/// Finding 14: a resumed checkpoint already past `--max-steps` or `--stop-at-step` says so.
#[test]
fn nothing_to_do_says_why_and_what_to_pass() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let corpus = write_corpus(dir);
    let base = with(&small(&corpus), &["train"], &[]);
    ok(dir, &with(&base, &[], &["--max-steps", "4"]));
    let text = ok(
        dir,
        &with(&base, &[], &["--max-steps", "2", "--resume", "auto"]),
    );
    assert!(
        text.contains("Nothing to do: the checkpoint is at step 4, past training.max_steps = 2")
            && text.contains("pass --max-steps (or training.max_steps) above 4"),
        "{text}"
    );
    let text = ok(
        dir,
        &with(
            &base,
            &[],
            &[
                "--max-steps",
                "8",
                "--stop-at-step",
                "3",
                "--resume",
                "auto",
            ],
        ),
    );
    assert!(
        text.contains("Nothing to do: --stop-at-step 3 is not after the resumed step 4")
            && text.contains("pass a step between 5 and 8"),
        "{text}"
    );
}

/// Finding 5: metrics.jsonl reads as one run after a resume from an earlier checkpoint, and a
/// fresh start begins a new record, keeping the old one under a name that says so.
#[test]
fn metrics_rewind_on_resume_and_start_anew_on_a_fresh_start() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let corpus = write_corpus(dir);
    let base = with(
        &small(&corpus),
        &["train"],
        &[
            "--set",
            "checkpoint.interval=2",
            "--set",
            "checkpoint.keep_last=3",
            "--set",
            "logging.tensorboard=true",
        ],
    );
    ok(dir, &with(&base, &[], &["--max-steps", "5"]));
    let run_dir = dir.join("runs/tiny");
    let steps = |p: &Path| -> Vec<u64> { common::losses(p).into_iter().map(|s| s.0).collect() };
    assert_eq!(steps(&run_dir.join("metrics.jsonl")), [1, 2, 3, 4, 5]);
    // As if killed after step 5 with step_4 the last checkpoint.
    fs::remove_dir_all(run_dir.join("checkpoints/step_5")).unwrap();
    let text = ok(
        dir,
        &with(&base, &[], &["--max-steps", "6", "--resume", "auto"]),
    );
    assert!(
        text.contains("metrics.jsonl: removed 1 records after step 4"),
        "{text}"
    );
    assert_eq!(steps(&run_dir.join("metrics.jsonl")), [1, 2, 3, 4, 5, 6]);

    // A fresh start in the same directory (checkpoints gone).
    fs::remove_dir_all(run_dir.join("checkpoints")).unwrap();
    let text = ok(
        dir,
        &with(&base, &[], &["--max-steps", "2", "--resume", "auto"]),
    );
    assert!(
        text.contains("metrics.jsonl: a fresh start; the earlier record is kept as")
            && text.contains("TensorBoard: a fresh start; the earlier run's events are kept in"),
        "{text}"
    );
    assert_eq!(steps(&run_dir.join("metrics.jsonl")), [1, 2]);
    let previous: Vec<_> = fs::read_dir(&run_dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("metrics.previous-") && n.ends_with(".jsonl"))
        .collect();
    assert_eq!(previous.len(), 1, "{previous:?}");
    assert_eq!(steps(&run_dir.join(&previous[0])), [1, 2, 3, 4, 5, 6]);
    let tb: Vec<String> = tree(&run_dir.join("tensorboard"));
    assert!(
        tb.iter()
            .any(|p| p.starts_with("previous-") && p.contains("events.out")),
        "{tb:?}"
    );
}

/// Finding 4: two Ctrl-C in quick succession. The first says it saves after the current step
/// and how to exit at once; the second exits 130 and says what is lost.
#[test]
fn two_interrupts_say_what_each_does() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let corpus = write_corpus(dir);
    let base = with(
        &small(&corpus),
        &["train"],
        &[
            "--max-steps",
            "100000",
            "--set",
            "checkpoint.interval=3",
            "--set",
            "model.num_layers=6",
            "--set",
            "model.hidden_size=256",
        ],
    );
    ok(dir, &with(&base[1..], &["prepare"], &[]));
    let mut child = lockstep(dir)
        .args(&base)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut text = String::new();
    // After the first checkpoint, so something is saved and later steps can be lost.
    while !text.contains("Checkpoint saved") {
        let line = lines.next().expect("output until a save").unwrap();
        text.push_str(&line);
        text.push('\n');
        assert!(Instant::now() < deadline, "{text}");
    }
    let pid = child.id() as libc::pid_t;
    // SAFETY: kill(2) of the child this test started.
    unsafe { libc::kill(pid, libc::SIGINT) };
    std::thread::sleep(Duration::from_millis(300));
    // SAFETY: as above.
    unsafe { libc::kill(pid, libc::SIGINT) };
    for line in lines {
        text.push_str(&line.unwrap());
        text.push('\n');
    }
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    if out.status.code() == Some(0) {
        // The first stop finished (save included) before the second signal: nothing lost.
        assert!(
            err.contains("lockstep: SIGINT: saving a checkpoint after step"),
            "{err}"
        );
        eprintln!("the stop finished within 300 ms; the second signal found nothing to cut");
        return;
    }
    assert_eq!(out.status.code(), Some(130), "{text}{err}");
    // Round 4, finding 31: the notice says which rank it is from (srun tasks have no launcher
    // to prefix it).
    assert!(
        err.lines()
            .any(|l| l.starts_with("[CPU0] lockstep: SIGINT: saving a checkpoint after step")),
        "{err}"
    );
    assert!(
        err.contains("lockstep: SIGINT: saving a checkpoint after step")
            && err.contains("send it again (Ctrl-C) to exit at once without saving")
            && err.contains("lockstep: SIGINT again: exiting now without saving")
            && err.contains("the steps after the last complete checkpoint (step ")
            && err.contains(") are lost")
            && err.contains("--resume auto continues from there"),
        "{text}{err}"
    );
}

/// Finding 11: `run --nproc 64 --cpu` on a small host started 64 workers that each refused
/// with "use more ranks"; the launcher now checks the node's memory once, before any start.
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

/// Finding 8: a full disk during `prepare` printed the bare OS error; it names the cache, the
/// bytes needed and the key, and leaves no partial entry.
#[test]
fn prepare_on_a_full_disk_names_the_cache_the_size_and_the_key() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let corpus = write_corpus(dir);
    let cache = dir.join("small-cache");
    let Some(_mount) = common::Tmpfs::mount(&cache, "size=16k") else {
        return;
    };
    let out = run(
        dir,
        &with(
            &small(&corpus),
            &["prepare"],
            &["--set", &format!("data.cache_dir={}", cache.display())],
        ),
    );
    let text = fails(
        &out,
        1,
        &[
            &format!("data.cache_dir {}: the token files need", cache.display()),
            "MB free; free space there, or set data.cache_dir to a disk with room",
        ],
    );
    assert!(!text.contains("panicked"), "{text}");
    assert_eq!(
        tree(&cache),
        Vec::<String>::new(),
        "a partial entry was left"
    );
}

/// Finding 6: a resume on other data was accepted without a word (a changed seed was refused
/// "because the data order would change"); now it is refused the same way, or continued on
/// the new data with the order starting anew where the user says so.
#[test]
fn resuming_on_other_data_is_refused_unless_asked_for() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let corpus = write_corpus(dir);
    let other = dir.join("other.txt");
    let text: String = fs::read_to_string(corpus.join("doc1.txt")).unwrap();
    fs::write(&other, text.repeat(2)).unwrap();
    let base = with(&small(&corpus), &["train"], &[]);
    ok(dir, &with(&base, &[], &["--max-steps", "2"]));
    let moved = ["--set", "data.path=other.txt"];
    let out = run(
        dir,
        &with(
            &base,
            &[],
            &[&moved[..], &["--max-steps", "3", "--resume", "auto"]].concat(),
        ),
    );
    let text = fails(
        &out,
        1,
        &[
            "the checkpoint was trained on other data (source",
            "set data.allow_new_data_on_resume=true",
        ],
    );
    assert!(!text.contains("Step [3/3]"), "{text}");
    // Asked for: the model continues, the data order starts at the new data's first sample.
    let text = ok(
        dir,
        &with(
            &base,
            &[],
            &[
                &moved[..],
                &[
                    "--set",
                    "data.allow_new_data_on_resume=true",
                    "--max-steps",
                    "3",
                    "--resume",
                    "auto",
                ],
            ]
            .concat(),
        ),
    );
    assert!(
        text.contains("Resumed from")
            && text.contains("data.allow_new_data_on_resume is set, so the data order starts anew"),
        "{text}"
    );
    // The same data again, prepared anew (cache removed): the same identity, accepted.
    fs::remove_dir_all(dir.join(".lockstep/cache")).unwrap();
    let again = with(
        &base,
        &[],
        &[&moved[..], &["--max-steps", "4", "--resume", "auto"]].concat(),
    );
    let text = ok(dir, &again);
    assert!(!text.contains("New data"), "{text}");
}

/// Finding 15: the launcher's rendezvous store listening socket was inherited by every worker
/// (no close-on-exec), so a worker outliving its launcher kept the port bound.
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

/// Finding 9: a cache entry whose token file was overwritten in place (2000 bytes) was blamed on
/// the tokenizer ("set model.vocab_size"); it is found damaged by its checksum and rebuilt,
/// while a copied cache (new stamps, same bytes) is used as it is.
#[test]
fn a_damaged_cache_entry_is_rebuilt_and_a_copied_one_is_used() {
    use std::io::{Seek, SeekFrom, Write};
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let corpus = write_corpus(dir);
    let base = with(&small(&corpus), &["train"], &["--max-steps", "1"]);
    ok(dir, &with(&base[1..], &["prepare"], &[]));
    let cache = dir.join(".lockstep/cache");
    let entry = fs::read_dir(&cache)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.join("train.tok").is_file())
        .expect("a cache entry");
    let train = entry.join("train.tok");
    let original = fs::read(&train).unwrap();
    // A copy of the whole cache elsewhere: other inodes and times, the same bytes.
    let copied = dir.join("copied-cache");
    let status = std::process::Command::new("cp")
        .args(["-r"])
        .arg(&cache)
        .arg(&copied)
        .status()
        .unwrap();
    assert!(status.success());
    let set_copied = format!("data.cache_dir={}", copied.display());
    let text = ok(dir, &with(&base, &[], &["--set", &set_copied]));
    assert!(
        text.contains("Data: cache hit") && !text.contains("damaged"),
        "{text}"
    );

    let mut f = fs::File::options().write(true).open(&train).unwrap();
    f.seek(SeekFrom::Start(original.len() as u64 / 2)).unwrap();
    f.write_all(&[0xFF; 2000]).unwrap();
    drop(f);
    let text = ok(dir, &with(&base, &[], &["--set", "logging.run_name=after"]));
    assert!(
        text.contains(&format!(
            "cache entry .lockstep/cache/{} is damaged (train.tok's bytes no longer match the \
             BLAKE3 recorded in meta.json when it was written); tokenizing it again",
            entry.file_name().unwrap().to_str().unwrap()
        )) && !text.contains("model.vocab_size"),
        "{text}"
    );
    assert!(
        fs::read(&train).unwrap() == original,
        "not rebuilt as it was"
    );
}
