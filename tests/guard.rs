//! The NaN/Inf guard and preemption end to end, on one rank and on two: the report, the
//! evidence it saves, each policy, and SIGTERM → checkpoint → lossless resume.

use crate::common;

use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use common::{lockstep, losses, number_after, ok, output_text, run, small, with, write_corpus};

const UP: &str = "model.layers.0.mlp.up_proj.weight";

#[test]
fn abort_reports_the_poisoned_tensor_saves_evidence_and_exits_3() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let base = small(&write_corpus(dir));
    let inject = [
        "--max-steps",
        "6",
        "--set",
        "debug.inject_nan_at_step=3",
        "--set",
        &format!("debug.inject_nan_param={UP}"),
    ];
    let out = run(dir, &with(&base, &["train"], &inject));
    let text = output_text(&out);
    assert_eq!(out.status.code(), Some(3), "{text}");
    assert!(text.contains("NaN GRADIENT DETECTED [CPU 0]"), "{text}");
    assert!(
        text.contains("Step: 3 | Loss: ") && text.contains("Gradient Norm: nan"),
        "{text}"
    );
    assert!(
        text.contains("Gradients with NaN/Inf (1 tensors)"),
        "{text}"
    );
    assert!(
        text.contains(&format!(
            "• {UP}  shape [128, 64]  NaN 1/8192  Inf 0/8192  values [nan,"
        )),
        "{text}"
    );
    let run_dir = dir.join("runs/tiny");
    assert!(run_dir
        .join("checkpoints/nan_step_3/model.safetensors")
        .is_file());
    let dump = run_dir.join("debug/nan_step_3.safetensors");
    // numpy reads the dump: exactly one NaN, in the injected gradient.
    let script = format!(
        "from safetensors.numpy import load_file; import numpy as np; d = load_file('{}'); \
         print(sorted((k, int(np.isnan(v).sum())) for k, v in d.items() if np.isnan(v).any()))",
        dump.display()
    );
    let py = std::process::Command::new(common::python())
        .args(["-c", &script])
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&py.stdout).trim(),
        format!("[('{UP}.grad', 1)]")
    );
    // A NaN checkpoint is evidence, never a resume point.
    let resumed = ok(
        dir,
        &with(&base, &["train"], &["--max-steps", "2", "--resume", "auto"]),
    );
    assert!(resumed.contains("no complete checkpoint"), "{resumed}");
}

#[test]
fn skip_drops_the_update_and_training_goes_on() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let base = small(&write_corpus(dir));
    let out = ok(
        dir,
        &with(
            &base,
            &["train"],
            &[
                "--max-steps",
                "6",
                "--set",
                "training.nan_policy=skip",
                "--set",
                "debug.inject_nan_at_step=3",
                // The NaN travels through the layer-by-layer backward with recomputation.
                "--set",
                "training.activation_checkpointing=full",
            ],
        ),
    );
    assert!(out.contains("Guard: non-finite loss or gradient norm at step 3; skipping the update (1 of 10 allowed)"), "{out}");
    assert!(out.contains("Step [6/6]"), "{out}");
    let l = losses(&dir.join("runs/tiny/metrics.jsonl"));
    assert_eq!(
        l.iter().map(|(s, _)| *s).collect::<Vec<_>>(),
        vec![1, 2, 4, 5, 6],
        "step 3 was skipped"
    );
    assert!(
        l.iter().all(|(_, v)| v.is_finite()),
        "weights stayed finite: {l:?}"
    );

    // max_nan_skips = 0: the first skip already exceeds it.
    let limit = [
        "--max-steps",
        "6",
        "--set",
        "training.nan_policy=skip",
        "--set",
        "training.max_nan_skips=0",
        "--set",
        "debug.inject_nan_at_step=2",
        "--set",
        "logging.run_name=limit",
    ];
    let out = run(dir, &with(&base, &["train"], &limit));
    assert_eq!(out.status.code(), Some(3), "{}", output_text(&out));
    assert!(output_text(&out).contains("exceed training.max_nan_skips = 0"));
}

#[test]
fn rollback_reloads_the_last_checkpoint_with_a_lower_lr() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let base = small(&write_corpus(dir));
    let tail = [
        "--max-steps",
        "8",
        "--set",
        "checkpoint.interval=2",
        "--set",
        "training.nan_policy=rollback",
        "--set",
        "debug.inject_nan_at_step=5",
    ];
    let out = ok(dir, &with(&base, &["train"], &tail));
    assert!(
        out.contains("Rolled back to") && out.contains("step_4 (step 4); LR scale now 0.5"),
        "{out}"
    );
    let l = losses(&dir.join("runs/tiny/metrics.jsonl"));
    let steps: Vec<u64> = l.iter().map(|(s, _)| *s).collect();
    assert_eq!(
        steps,
        vec![1, 2, 3, 4, 5, 6, 7, 8],
        "step 5 redone after the rollback"
    );
    let state: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("runs/tiny/checkpoints/step_8/trainer.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(state["lr_scale"], 0.5);
    assert_eq!(state["guard_events"], 1);
    // The rollback took new data: 8 steps done but 9 batches consumed (batch 4).
    assert_eq!(state["samples_consumed"], 36);
}

#[test]
fn two_ranks_agree_on_a_nan_and_both_stop() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let base = small(&write_corpus(dir));
    let inject = ["--max-steps", "6", "--set", "debug.inject_nan_at_step=2"];
    let out = run(
        dir,
        &with(
            &base,
            &["run", "--nproc", "2", "--cpu", "--log-ranks", "all"],
            &inject,
        ),
    );
    let text = output_text(&out);
    assert_eq!(out.status.code(), Some(3), "{text}");
    assert!(
        text.contains("[CPU0] error:") || text.contains("[CPU0] non-finite"),
        "{text}"
    );
    assert!(
        text.matches("non-finite loss or gradient norm at step 2")
            .count()
            >= 2,
        "both ranks stop: {text}"
    );

    let skip = [
        "--max-steps",
        "4",
        "--set",
        "training.nan_policy=skip",
        "--set",
        "debug.inject_nan_at_step=2",
        "--set",
        "logging.run_name=skip2",
    ];
    let text = ok(dir, &with(&base, &["run", "--nproc", "2", "--cpu"], &skip));
    assert!(text.contains("Step [4/4]"), "{text}");
}

fn wait_for(path: &Path, what: &str, limit: Duration) {
    let start = Instant::now();
    while !std::fs::read_to_string(path).is_ok_and(|s| s.contains(what)) {
        assert!(
            start.elapsed() < limit,
            "{what} never appeared in {}",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn sigterm_saves_a_checkpoint_exits_0_and_resume_is_lossless() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let base = small(&write_corpus(dir));
    ok(
        dir,
        &with(
            &base,
            &["train"],
            &[
                "--max-steps",
                "30",
                "--set",
                "logging.run_name=straight",
                "--set",
                "checkpoint.interval=0",
            ],
        ),
    );

    let tail = [
        "--max-steps",
        "30",
        "--set",
        "logging.run_name=preempted",
        "--set",
        "checkpoint.interval=0",
    ];
    let child = lockstep(dir)
        .args(with(&base, &["train"], &tail))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_for(
        &dir.join("runs/preempted/metrics.jsonl"),
        "\"step\":3,",
        Duration::from_secs(60),
    );
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let out = child.wait_with_output().unwrap();
    let text = output_text(&out);
    assert_eq!(out.status.code(), Some(0), "{text}");
    assert!(
        text.contains("Stopped by signal at step") && text.contains("--resume auto"),
        "{text}"
    );
    // The notice names the step the run then stops at (round 5, finding 17: a signal after a
    // step's stop vote named that step, and the run went on to save the next one).
    assert_eq!(
        number_after::<usize>(&text, "saving a checkpoint after step "),
        number_after::<usize>(&text, "Stopped by signal at step "),
        "{text}"
    );
    let stopped = losses(&dir.join("runs/preempted/metrics.jsonl")).len();
    assert!(stopped < 30, "stopped early at {stopped}");

    ok(
        dir,
        &with(
            &base,
            &["train"],
            &[&tail[..], &["--resume", "auto"]].concat(),
        ),
    );
    assert_eq!(
        losses(&dir.join("runs/preempted/metrics.jsonl")),
        losses(&dir.join("runs/straight/metrics.jsonl"))
    );
}

#[test]
fn sigterm_to_the_launcher_stops_both_ranks_at_one_step_and_resume_is_lossless() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let base = small(&write_corpus(dir));
    let two = ["run", "--nproc", "2", "--cpu"];
    let straight = [
        "--max-steps",
        "20",
        "--set",
        "logging.run_name=straight",
        "--set",
        "checkpoint.interval=0",
    ];
    ok(dir, &with(&base, &two, &straight));

    let tail = [
        "--max-steps",
        "20",
        "--set",
        "logging.run_name=preempted",
        "--set",
        "checkpoint.interval=0",
    ];
    let child = lockstep(dir)
        .args(with(&base, &two, &tail))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_for(
        &dir.join("runs/preempted/metrics.jsonl"),
        "\"step\":3,",
        Duration::from_secs(60),
    );
    // SAFETY: kill(2) on our own child, the launcher; it forwards SIGTERM to both workers.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let out = child.wait_with_output().unwrap();
    let text = output_text(&out);
    assert_eq!(
        out.status.code(),
        Some(0),
        "every worker saved and exited 0, and so does the launcher: {text}"
    );
    assert!(text.contains("Stopped by signal at step"), "{text}");
    let ckpts: Vec<String> = std::fs::read_dir(dir.join("runs/preempted/checkpoints"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.starts_with("step_"))
        .collect();
    assert_eq!(ckpts.len(), 1, "one agreed step, one checkpoint: {ckpts:?}");

    ok(
        dir,
        &with(&base, &two, &[&tail[..], &["--resume", "auto"]].concat()),
    );
    assert_eq!(
        losses(&dir.join("runs/preempted/metrics.jsonl")),
        losses(&dir.join("runs/straight/metrics.jsonl"))
    );
}
