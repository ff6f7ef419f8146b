//! `data.sources` end to end through the binary: one source is exactly the `data.path` run; a
//! mixture of three (packed documents masked) reports tokens and validation loss per source in
//! metrics.jsonl, TensorBoard and the verbose step line, says when a source starts a new epoch,
//! and resumes bitwise on the same world size and onto two ranks with the same samples.

use crate::common;

use std::path::{Path, PathBuf};

use common::{losses, ok, small_gpt2, with};
use serde_json::Value;

/// `small_gpt2()` without its `data.path` (a mixture may not set both). GPT-2's ids: the
/// token counts below are its.
fn base(corpus: &Path) -> Vec<String> {
    let mut b = small_gpt2(corpus);
    let at = b.iter().position(|a| a.starts_with("data.path=")).unwrap();
    b.drain(at - 1..=at);
    b
}

/// A corpus directory of `parts` documents of `chars` characters each from one play.
fn corpus(dir: &Path, name: &str, play: &str, parts: usize, chars: usize) -> PathBuf {
    let out = dir.join(name);
    std::fs::create_dir_all(&out).unwrap();
    let text = std::fs::read_to_string(common::root().join("data/shakespeare").join(play)).unwrap();
    let text: Vec<char> = text.chars().skip(5000).collect();
    for (i, part) in text.chunks(chars).take(parts).enumerate() {
        let doc: String = part.iter().collect();
        std::fs::write(out.join(format!("{name}{i}.txt")), doc).unwrap();
    }
    out
}

fn records(run: &Path) -> Vec<Value> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn one_source_is_the_data_path_run_bitwise() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let corpus = common::write_corpus(dir);
    let tail = ["--max-steps", "6", "--set", "training.eval_interval=3"];
    let plain = with(&small_gpt2(&corpus), &["train"], &tail);
    ok(dir, &with(&plain, &[], &["--set", "logging.run_name=path"]));
    let source = format!(
        r#"data.sources=[{{"path":"{}","weight":0.4}}]"#,
        corpus.display()
    );
    let mixed = with(&base(&corpus), &["train"], &tail);
    let out = ok(
        dir,
        &with(
            &mixed,
            &[],
            &["--set", &source, "--set", "logging.run_name=one"],
        ),
    );
    assert!(out.contains("Data corpus (weight 0.4): cache hit"), "{out}");
    let runs = dir.join("runs");
    let (a, b) = (records(&runs.join("path")), records(&runs.join("one")));
    assert_eq!(a.len(), 6);
    for (x, y) in a.iter().zip(&b) {
        for key in ["loss", "grad_norm", "val_loss", "samples_consumed"] {
            assert_eq!(x[key], y[key], "step {}: {key}", x["step"]);
        }
    }
    assert!(a[2]["val_loss"].is_f64() && a[5]["val_loss"].is_f64());
    for file in ["model.safetensors", "optimizer.safetensors"] {
        let x = std::fs::read(runs.join("path/checkpoints/step_6").join(file)).unwrap();
        let y = std::fs::read(runs.join("one/checkpoints/step_6").join(file)).unwrap();
        assert!(x == y, "{file} differs");
    }
}

#[test]
fn a_masked_mixture_reports_per_source_and_resumes_exactly() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let sources = [
        corpus(dir, "plays", "hamlet_gut.txt", 6, 12_000),
        corpus(dir, "sonnets", "sonnets_gut.txt", 8, 4_000),
        // Small: its windows run out within the run, so it starts a second epoch.
        corpus(dir, "lear", "lear_gut.txt", 1, 1_200),
    ];
    let spec = format!(
        r#"data.sources=[{{"path":"{}","weight":0.5}},{{"path":"{}","weight":0.3}},{{"path":"{}","weight":0.2,"name":"king"}}]"#,
        sources[0].display(),
        sources[1].display(),
        sources[2].display()
    );
    let mut common_args = base(&sources[0]);
    common_args.extend(
        [
            "--set",
            &spec,
            "--set",
            "data.document_masking=true",
            "--set",
            "data.reset_position_ids=true",
            "--set",
            "training.eval_interval=4",
            // king's 359 tokens: a fifth (72) holds a validation window of 65.
            "--set",
            "data.val_fraction=0.2",
            "--set",
            "logging.verbose=true",
            "--max-steps",
            "8",
        ]
        .map(String::from),
    );
    let train = |name: &str, extra: &[&str]| {
        let mut args = with(&common_args, &["train"], extra);
        args.extend(["--set".into(), format!("logging.run_name={name}")]);
        ok(dir, &args)
    };
    let out = train("straight", &[]);
    for line in [
        "Data plays (weight 0.5): prepared",
        "Data sonnets (weight 0.3): prepared",
        "Data king (weight 0.2): prepared",
        "Data: king starts epoch 2",
        "Data: plays ",
    ] {
        assert!(out.contains(line), "no {line:?} in:\n{out}");
    }
    let validation = out
        .lines()
        .find(|l| l.contains("Validation | Step [4/8]"))
        .unwrap_or_else(|| panic!("{out}"));
    assert!(
        validation.contains("| plays ") && validation.contains("| king "),
        "{validation}"
    );

    let runs = dir.join("runs");
    let recs = records(&runs.join("straight"));
    assert_eq!(recs.len(), 8);
    let last = &recs[7];
    let tokens = last["tokens_by_source"].as_object().unwrap();
    let names: Vec<&String> = tokens.keys().collect();
    assert_eq!(names, ["plays", "sonnets", "king"], "in source order");
    let total: u64 = tokens.values().map(|v| v.as_u64().unwrap()).sum();
    // 8 steps × 4 samples × 64 tokens.
    assert_eq!(total, 8 * 4 * 64);
    let val = last["val_loss_by_source"].as_object().unwrap();
    assert_eq!(val.len(), 3);
    let mean = val["plays"].as_f64().unwrap() * 0.5
        + val["sonnets"].as_f64().unwrap() * 0.3
        + val["king"].as_f64().unwrap() * 0.2;
    assert!((mean - last["val_loss"].as_f64().unwrap()).abs() < 1e-5 * mean);
    assert!(recs[0]["val_loss_by_source"].is_null());

    // TensorBoard has the same per-source series.
    let script = format!(
        "from tensorboard.backend.event_processing.event_accumulator import EventAccumulator as E\n\
         e = E('{}'); e.Reload()\n\
         print(sorted(t for t in e.Tags()['scalars'] if t.count('/') == 2))\n\
         print([(s.step, s.value) for s in e.Scalars('val/loss/king')])\n\
         print([(s.step, s.value) for s in e.Scalars('data/tokens/plays')][-1])",
        runs.join("straight/tensorboard").display()
    );
    let py = std::process::Command::new(common::python())
        .args(["-c", &script])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&py.stdout).to_string();
    assert!(
        py.status.success(),
        "{}",
        String::from_utf8_lossy(&py.stderr)
    );
    let mut lines = text.lines();
    assert_eq!(
        lines.next().unwrap(),
        "['data/tokens/king', 'data/tokens/plays', 'data/tokens/sonnets', 'val/loss/king', 'val/loss/plays', 'val/loss/sonnets']"
    );
    let king: Vec<f64> = recs
        .iter()
        .filter_map(|r| r["val_loss_by_source"]["king"].as_f64())
        .collect();
    assert_eq!(
        lines.next().unwrap(),
        format!(
            "[(4, {}), (8, {})]",
            king[0] as f32 as f64, king[1] as f32 as f64
        )
    );
    assert_eq!(
        lines.next().unwrap(),
        format!("(8, {:.1})", tokens["plays"].as_u64().unwrap() as f64)
    );

    // Stopped at step 3 and resumed: bitwise the same run.
    train("split", &["--stop-at-step", "3"]);
    let resumed = train("split", &["--resume", "auto"]);
    assert!(
        resumed.contains("at step 3 (12 samples consumed; loaded in "),
        "{resumed}"
    );
    assert_eq!(
        losses(&runs.join("split/metrics.jsonl")),
        losses(&runs.join("straight/metrics.jsonl"))
    );
    let split = records(&runs.join("split"));
    assert_eq!(split[7]["tokens_by_source"], last["tokens_by_source"]);
    assert_eq!(split[7]["val_loss_by_source"], last["val_loss_by_source"]);
    for file in ["model.safetensors", "optimizer.safetensors"] {
        let x = std::fs::read(runs.join("straight/checkpoints/step_8").join(file)).unwrap();
        let y = std::fs::read(runs.join("split/checkpoints/step_8").join(file)).unwrap();
        assert!(x == y, "{file} differs after resume");
    }

    // The step-5 checkpoint continued by two ranks of two samples each: the same global
    // samples, so the losses track the one-rank run. The launcher prepares every source once.
    let ckpt = runs
        .join("straight/checkpoints/step_5")
        .display()
        .to_string();
    let two = with(
        &common_args,
        &["run", "--nproc", "2", "--cpu"],
        &[
            "--set",
            "training.batch_size=2",
            "--set",
            "logging.run_name=two",
            "--resume",
            &ckpt,
        ],
    );
    let out = ok(dir, &two);
    for name in ["plays", "sonnets", "king"] {
        let line = format!("[launcher] Data {name} (weight");
        assert_eq!(out.matches(&line).count(), 1, "{line}:\n{out}");
    }
    let two = losses(&runs.join("two/metrics.jsonl"));
    let straight = losses(&runs.join("straight/metrics.jsonl"));
    assert_eq!(two.len(), 3);
    for ((s, a), (t, b)) in two.iter().zip(&straight[5..]) {
        assert_eq!(s, t);
        assert!(
            (a - b).abs() < 1e-4 * b,
            "step {s}: {a} on two ranks vs {b}"
        );
    }
}
