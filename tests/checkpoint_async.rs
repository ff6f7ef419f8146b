//! Asynchronous checkpoints (`checkpoint.async`, the default): the files are the bytes a
//! synchronous save writes, at every zero stage on one and two ranks; a run resumed from them
//! ends bitwise equal to an uninterrupted one; SIGTERM while a save is being written exits 0
//! with a complete checkpoint; `checkpoint.keep_every` keeps what it says. (Kills during
//! background writes and a full disk: tests/crash_safety.rs, whose runs save asynchronously.)

use crate::common;

use std::fs;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use common::{lockstep, ok, small, with, write_corpus};
use serde_json::Value;

/// The files of a checkpoint directory, sorted by name, with their bytes.
fn files(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut v: Vec<(String, Vec<u8>)> = fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .map(|p| {
            (
                p.file_name().unwrap().to_string_lossy().into_owned(),
                fs::read(&p).unwrap(),
            )
        })
        .collect();
    v.sort();
    v
}

/// trainer.json with the keys that name where and how a run saved (they differ between the
/// runs compared) taken out.
fn trainer_state(bytes: &[u8]) -> Value {
    let mut v: Value = serde_json::from_slice(bytes).unwrap();
    let config = v["config"].as_object_mut().unwrap();
    config["checkpoint"]
        .as_object_mut()
        .unwrap()
        .remove("async");
    config["logging"]
        .as_object_mut()
        .unwrap()
        .remove("run_name");
    v
}

/// Every file of two checkpoints is bitwise equal (trainer.json up to the keys above).
fn assert_same_checkpoint(a: &Path, b: &Path) {
    let (fa, fb) = (files(a), files(b));
    let names = |f: &[(String, Vec<u8>)]| f.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>();
    assert_eq!(names(&fa), names(&fb), "{} vs {}", a.display(), b.display());
    for ((name, x), (_, y)) in fa.iter().zip(&fb) {
        if name == "trainer.json" {
            assert_eq!(trainer_state(x), trainer_state(y), "{}", a.display());
        } else {
            assert!(x == y, "{name} differs: {} vs {}", a.display(), b.display());
        }
    }
}

fn args(corpus: &Path, world: usize, stage: usize, name: &str, background: bool) -> Vec<String> {
    let head: Vec<String> = if world == 1 {
        vec!["train".into()]
    } else {
        vec![
            "run".into(),
            "--cpu".into(),
            "--nproc".into(),
            world.to_string(),
        ]
    };
    let head: Vec<&str> = head.iter().map(String::as_str).collect();
    with(
        &small(corpus),
        &head,
        &[
            "--set",
            "checkpoint.interval=3",
            "--set",
            &format!("system.zero_stage={stage}"),
            "--set",
            &format!("logging.run_name={name}"),
            "--set",
            &format!("checkpoint.async={background}"),
        ],
    )
}

#[test]
fn async_saves_are_the_bytes_of_sync_saves_and_resume_bitwise_at_stages_0_1_2_on_1_and_2_ranks() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let corpus = write_corpus(dir);
    ok(dir, &with(&small(&corpus), &["prepare"], &[]));
    let ckpt = |name: &str, step: usize| -> PathBuf {
        dir.join(format!("runs/{name}/checkpoints/step_{step}"))
    };
    for world in [1, 2] {
        for stage in [0, 1, 2] {
            let tag = format!("w{world}s{stage}");
            let (sync, bg, resumed) = (
                format!("{tag}_sync"),
                format!("{tag}_async"),
                format!("{tag}_resumed"),
            );
            let max = ["--max-steps", "6"];
            ok(
                dir,
                &with(&args(&corpus, world, stage, &sync, false), &[], &max),
            );
            let out = ok(
                dir,
                &with(&args(&corpus, world, stage, &bg, true), &[], &max),
            );
            assert!(
                out.contains("Checkpoint step_3: staged in ")
                    && out.contains("writing in the background")
                    && out.contains(&format!(
                        "Checkpoint saved: runs/{bg}/checkpoints/step_6 (written in the background in "
                    )),
                "{out}"
            );
            for step in [3, 6] {
                assert_same_checkpoint(&ckpt(&sync, step), &ckpt(&bg, step));
            }
            // Every rank writes its part, at stage 0 too.
            let names: Vec<String> = files(&ckpt(&bg, 6)).into_iter().map(|(n, _)| n).collect();
            if world == 2 {
                for part in [
                    "model-00001-of-00002.safetensors",
                    "model-00002-of-00002.safetensors",
                    "optimizer-00001-of-00002.safetensors",
                    "optimizer-00002-of-00002.safetensors",
                ] {
                    assert!(names.iter().any(|n| n == part), "{tag}: {names:?}");
                }
            }

            // Stopped at step 3 and resumed (both asynchronous): the same step_6.
            let stop = ["--max-steps", "6", "--stop-at-step", "3"];
            ok(
                dir,
                &with(&args(&corpus, world, stage, &resumed, true), &[], &stop),
            );
            let out = ok(
                dir,
                &with(
                    &args(&corpus, world, stage, &resumed, true),
                    &[],
                    &["--max-steps", "6", "--resume", "auto"],
                ),
            );
            assert!(out.contains("Resumed from "), "{out}");
            assert_same_checkpoint(&ckpt(&sync, 6), &ckpt(&resumed, 6));
            println!("{tag}: async == sync, resumed == uninterrupted");
        }
    }
}

/// A model whose checkpoint (~0.5 GB) takes a noticeable time to write, so a signal lands
/// while one is being written.
fn heavy(corpus: &Path) -> Vec<String> {
    with(
        &small(corpus),
        &["train"],
        &[
            "--set",
            "model.hidden_size=512",
            "--set",
            "model.num_attention_heads=8",
            "--set",
            "model.num_key_value_heads=4",
            "--set",
            "model.intermediate_size=1024",
            "--set",
            "model.num_layers=4",
            "--set",
            "training.batch_size=1",
            "--set",
            "training.context_length=16",
            "--set",
            "checkpoint.interval=1",
            "--set",
            "checkpoint.keep_last=2",
            "--max-steps",
            "100000",
        ],
    )
}

#[test]
fn sigterm_while_a_save_is_written_in_the_background_exits_0_with_complete_checkpoints() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let corpus = write_corpus(dir);
    let args = heavy(&corpus);
    ok(dir, &with(&args[1..], &["prepare"], &[]));
    let mut child = lockstep(dir)
        .args(&args)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut text = String::new();
    let deadline = Instant::now() + Duration::from_secs(120);
    // The second save: the first one's buffers exist, so this one is a plain copy.
    let mut staged = 0;
    while staged < 2 {
        let line = lines.next().expect("output until a save").unwrap();
        text.push_str(&line);
        text.push('\n');
        staged += usize::from(line.contains("writing in the background"));
        assert!(Instant::now() < deadline, "{text}");
    }
    // SAFETY: a plain kill(2) of the child this test started.
    unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
    for line in lines {
        text.push_str(&line.unwrap());
        text.push('\n');
    }
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(0), "{text}");
    let stopped: usize = common::number_after(&text, "Stopped by signal at step ");
    let root = dir.join("runs/tiny/checkpoints");
    let mut names: Vec<String> = fs::read_dir(&root)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert!(
        names.iter().all(|n| !n.ends_with(".tmp")),
        "a save was left half-done: {names:?}\n{text}"
    );
    assert!(
        names.contains(&format!("step_{stopped}")),
        "{names:?}\n{text}"
    );
    assert!(
        text.contains(&format!(
            "Checkpoint saved: runs/tiny/checkpoints/step_{stopped} "
        )),
        "{text}"
    );
    let state: Value = serde_json::from_slice(
        &fs::read(root.join(format!("step_{stopped}/trainer.json"))).unwrap(),
    )
    .unwrap();
    assert_eq!(state["step"], stopped);
    // And it resumes from there.
    let mut again = args.clone();
    let at = again.iter().position(|a| a == "100000").unwrap();
    again[at] = (stopped + 1).to_string();
    let out = ok(dir, &with(&again, &[], &["--resume", "auto"]));
    assert!(
        out.contains(&format!(
            "Resumed from {} at step {stopped} ",
            root.join(format!("step_{stopped}")).display()
        )) || out.contains(&format!(
            "runs/tiny/checkpoints/step_{stopped} at step {stopped} "
        )),
        "{out}"
    );
}

#[test]
fn keep_every_keeps_its_multiples_besides_the_last_ones() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let corpus = write_corpus(dir);
    ok(
        dir,
        &with(
            &small(&corpus),
            &["train"],
            &[
                "--set",
                "checkpoint.interval=1",
                "--set",
                "checkpoint.keep_last=2",
                "--set",
                "checkpoint.keep_every=3",
                "--max-steps",
                "8",
            ],
        ),
    );
    let mut names: Vec<String> = fs::read_dir(dir.join("runs/tiny/checkpoints"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n != "checkpoints.lock")
        .collect();
    names.sort();
    assert_eq!(names, ["step_3", "step_6", "step_7", "step_8"]);
}
