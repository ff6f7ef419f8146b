//! End-to-end through the binary: prepare and its cache, training whose loss falls, exact resume,
//! and the errors a user meets first.

use crate::common;

use common::{lockstep, losses, ok, output_text, run, small, small_gpt2, write_corpus};

fn args(base: &[String], extra: &[&str]) -> Vec<String> {
    base.iter()
        .cloned()
        .chain(extra.iter().map(|s| s.to_string()))
        .collect()
}

#[test]
fn prepare_caches_and_training_loss_falls() {
    let tmp = tempfile::tempdir().unwrap();
    let corpus = write_corpus(tmp.path());
    let base = small(&corpus);
    let mut prep = vec!["prepare".to_string()];
    prep.extend(base.iter().cloned());
    let first = ok(tmp.path(), &prep);
    assert!(first.contains("Data: prepared"), "{first}");
    let second = ok(tmp.path(), &prep);
    assert!(second.contains("Data: cache hit"), "{second}");

    let out = ok(
        tmp.path(),
        &args(&["train".into()], &[])
            .into_iter()
            .chain(base.clone())
            .chain(["--max-steps".into(), "40".into()])
            .collect::<Vec<_>>(),
    );
    let step_line = regex_like_step_line(&out);
    assert!(step_line, "no step line in:\n{out}");
    // A compact start: what runs where, not the resolved config, which is in the run directory.
    assert!(
        !out.contains("Resolved config") && !out.contains("\"training\": {"),
        "{out}"
    );
    assert!(
        out.contains("[CPU0] Run: runs/tiny (preset tiny; full config in runs/tiny/config.json)"),
        "{out}"
    );
    assert!(
        out.contains("[CPU0] Batch: 4 × 64 tokens × 1 accumulation × 1 rank = 256 tokens per step"),
        "{out}"
    );
    let saved_config: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(tmp.path().join("runs/tiny/config.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(saved_config["training"]["context_length"], 64);
    // It ends with the commands that use the final checkpoint, and they work as printed.
    let next: Vec<&str> = out
        .lines()
        .filter_map(|l| l.strip_prefix("[CPU0]   "))
        .collect();
    assert_eq!(next.len(), 3, "export, eval, generate:\n{out}");
    assert!(
        next[0].contains(" export --hf exports/tiny --checkpoint runs/tiny/checkpoints/step_40"),
        "{out}"
    );
    for command in &next {
        let words: Vec<String> = command
            .split_whitespace()
            .skip(1) // the binary
            .map(|w| w.trim_matches('"'))
            .map(|w| {
                if w == "64" {
                    "4".to_string()
                } else {
                    w.to_string()
                }
            }) // a short sample
            .collect();
        ok(tmp.path(), &words);
    }
    assert!(tmp.path().join("exports/tiny/model.safetensors").is_file());
    assert!(out.contains("Validation | Step [40/40]"), "{out}");
    let l = losses(&tmp.path().join("runs/tiny/metrics.jsonl"));
    let (first, last) = (l.first().unwrap().1, l.last().unwrap().1);
    // The tests' tokenizer has 512 ids (common::tokenizer): an untrained model starts near
    // ln(512) = 6.24 and 40 steps take ~1.2 nats off (measured 6.26 -> 5.10).
    assert!(
        (first - 512f64.ln()).abs() < 0.1,
        "starts near ln(512) = 6.24, got {first}"
    );
    assert!(
        first - last > 0.8,
        "loss should fall by > 0.8 nats in 40 steps: {first} -> {last}"
    );
    // The run's directory has the resolved config and the final checkpoint.
    let ckpt = tmp.path().join("runs/tiny/checkpoints/step_40");
    for f in [
        "model.safetensors",
        "optimizer.safetensors",
        "trainer.json",
        "config.json",
    ] {
        assert!(ckpt.join(f).is_file(), "missing {f}");
    }
    let saved: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(ckpt.join("trainer.json")).unwrap()).unwrap();
    assert_eq!(saved["config"]["training"]["context_length"], 64);
    // keep_last = 3 of steps 5..40 every 5.
    let kept: Vec<String> = std::fs::read_dir(tmp.path().join("runs/tiny/checkpoints"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.starts_with("step_"))
        .collect();
    assert_eq!(kept.len(), 3, "{kept:?}");
}

fn regex_like_step_line(out: &str) -> bool {
    out.lines().any(|l| {
        l.starts_with("[CPU0] Step [")
            && l.contains("] | Loss: ")
            && l.contains(" | LR: ")
            && l.contains("e-0")
            && l.contains(" | Grad Norm: ")
            && l.contains(" | Tok/s: ")
            && l.contains(" | ETA: ")
    })
}

#[test]
fn resume_is_bitwise_identical_to_an_uninterrupted_run() {
    let tmp = tempfile::tempdir().unwrap();
    let corpus = write_corpus(tmp.path());
    let base = small(&corpus);
    let train = |name: &str, extra: &[&str]| {
        let mut a = vec!["train".to_string()];
        a.extend(base.iter().cloned());
        a.extend(["--set".to_string(), format!("logging.run_name={name}")]);
        a.extend(extra.iter().map(|s| s.to_string()));
        ok(tmp.path(), &a)
    };
    train("straight", &["--max-steps", "20"]);
    // The interrupted run recomputes its activations (selective, then full after the resume):
    // checkpointing changes no bit of the gradients, so nothing may differ.
    let first = train(
        "resumed",
        &[
            "--max-steps",
            "20",
            "--stop-at-step",
            "10",
            "--set",
            "training.activation_checkpointing=selective",
        ],
    );
    assert!(
        first.contains("Checkpoint saved") && first.contains("step_10"),
        "{first}"
    );
    let out = train(
        "resumed",
        &[
            "--max-steps",
            "20",
            "--resume",
            "auto",
            "--set",
            "training.activation_checkpointing=full",
        ],
    );
    assert!(
        out.contains("Resumed from") && out.contains("at step 10"),
        "{out}"
    );

    let runs = tmp.path().join("runs");
    let a = losses(&runs.join("straight/metrics.jsonl"));
    let b = losses(&runs.join("resumed/metrics.jsonl"));
    assert_eq!(a.len(), 20);
    assert_eq!(a, b, "per-step losses must be bitwise equal");
    for file in ["model.safetensors", "optimizer.safetensors"] {
        let x = std::fs::read(runs.join("straight/checkpoints/step_20").join(file)).unwrap();
        let y = std::fs::read(runs.join("resumed/checkpoints/step_20").join(file)).unwrap();
        assert!(x == y, "{file} differs after resume");
    }
}

#[test]
fn existing_checkpoints_are_never_silently_overwritten() {
    let tmp = tempfile::tempdir().unwrap();
    let corpus = write_corpus(tmp.path());
    let mut a = vec!["train".to_string()];
    a.extend(small(&corpus));
    a.extend(["--max-steps".to_string(), "5".to_string()]);
    ok(tmp.path(), &a);
    let before = std::fs::read(
        tmp.path()
            .join("runs/tiny/checkpoints/step_5/model.safetensors"),
    )
    .unwrap();
    let out = run(tmp.path(), &a);
    assert_eq!(out.status.code(), Some(1));
    let text = output_text(&out);
    assert!(
        text.contains("already holds checkpoints") && text.contains("--resume auto"),
        "{text}"
    );
    let after = std::fs::read(
        tmp.path()
            .join("runs/tiny/checkpoints/step_5/model.safetensors"),
    )
    .unwrap();
    assert!(before == after);
}

#[test]
fn config_errors_exit_2_and_name_the_key() {
    let tmp = tempfile::tempdir().unwrap();
    let out = run(
        tmp.path(),
        &[
            "train".into(),
            "--set".into(),
            "training.lerning_rate=1e-3".into(),
        ],
    );
    assert_eq!(out.status.code(), Some(2));
    let text = output_text(&out);
    assert!(
        text.contains("unknown config key \"training.lerning_rate\"")
            && text.contains("training.learning_rate"),
        "{text}"
    );

    let out = run(
        tmp.path(),
        &[
            "train".into(),
            "--set".into(),
            "model.num_key_value_heads=3".into(),
        ],
    );
    assert_eq!(out.status.code(), Some(2));
    assert!(output_text(&out).contains("model.num_key_value_heads = 3 does not divide"));

    let out = run(
        tmp.path(),
        &[
            "train".into(),
            "--preset".into(),
            "tiny".into(),
            "--set".into(),
            "data.path=missing/dir".into(),
        ],
    );
    assert_eq!(out.status.code(), Some(1));
    assert!(
        output_text(&out).contains("missing/dir"),
        "{}",
        output_text(&out)
    );
}

#[test]
fn config_docs_and_printing() {
    let tmp = tempfile::tempdir().unwrap();
    let out = ok(tmp.path(), &["config".into(), "--debug".into()]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["model"]["num_layers"], 2);
    let keys = ok(tmp.path(), &["config".into(), "--keys".into()]);
    assert!(keys.contains("training.grad_accum_nums"));
}

#[test]
fn bf16_compute_tracks_fp32_and_keeps_fp32_master_weights() {
    let tmp = tempfile::tempdir().unwrap();
    let corpus = write_corpus(tmp.path());
    let run_with = |dtype: &str| {
        let mut a = vec!["train".to_string()];
        a.extend(small(&corpus));
        for s in [
            format!("training.dtype={dtype}"),
            format!("logging.run_name={dtype}"),
        ] {
            a.extend(["--set".to_string(), s]);
        }
        a.extend(["--max-steps".to_string(), "5".to_string()]);
        let out = ok(tmp.path(), &a);
        assert!(out.contains(&format!("| {dtype} compute")), "{out}");
        losses(&tmp.path().join(format!("runs/{dtype}/metrics.jsonl")))
    };
    let (fp32, bf16) = (run_with("fp32"), run_with("bf16"));
    for ((_, a), (_, b)) in fp32.iter().zip(&bf16) {
        assert!(
            (a - b).abs() < 2e-2 * a.abs(),
            "bf16 loss {b} strays from fp32 {a}"
        );
    }
    assert_ne!(fp32, bf16, "bf16 really ran in reduced precision");
    let ckpt = tmp
        .path()
        .join("runs/bf16/checkpoints/step_5/model.safetensors");
    let f = lockstep::tensor_io::SafeFile::open(&ckpt).unwrap();
    for name in f.names() {
        assert_eq!(
            f.tensor(&name).unwrap().kind(),
            tch::Kind::Float,
            "{name}: master weights are fp32"
        );
    }
}

#[test]
fn memory_is_logged_and_a_limit_warns() {
    let tmp = tempfile::tempdir().unwrap();
    let corpus = write_corpus(tmp.path());
    let mut a = vec!["train".to_string()];
    a.extend(small(&corpus));
    for s in ["logging.memory_interval=2", "system.max_memory_gb=0.01"] {
        a.extend(["--set".to_string(), s.to_string()]);
    }
    a.extend(["--max-steps".to_string(), "2".to_string()]);
    let out = ok(tmp.path(), &a);
    assert!(out.contains("[CPU0] Memory | RSS "), "{out}");
    assert!(
        out.contains("WARNING: resident memory") && out.contains("system.max_memory_gb = 0.01"),
        "{out}"
    );
    assert!(out.contains("[CPU0] Peak memory: RSS "), "{out}");
}

#[test]
fn tensorboard_events_hold_the_same_losses_as_metrics_jsonl() {
    let tmp = tempfile::tempdir().unwrap();
    let corpus = write_corpus(tmp.path());
    let mut a = vec!["train".to_string()];
    a.extend(small(&corpus));
    a.extend(["--max-steps".to_string(), "4".to_string()]);
    ok(tmp.path(), &a);
    let run = tmp.path().join("runs/tiny");
    let script = format!(
        "from tensorboard.backend.event_processing.event_accumulator import EventAccumulator as E\n\
         e = E('{}'); e.Reload()\n\
         print(sorted(e.Tags()['scalars']))\n\
         print([(s.step, s.value) for s in e.Scalars('train/loss')])",
        run.join("tensorboard").display()
    );
    let out = std::process::Command::new(common::python())
        .args(["-c", &script])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut lines = text.lines();
    let tags = lines.next().unwrap();
    for tag in [
        "train/loss",
        "train/lr",
        "train/grad_norm",
        "perf/tokens_per_s",
        "val/loss",
        "memory/rss_gb",
    ] {
        assert!(tags.contains(tag), "{tag} missing from {tags}");
    }
    // Compared as numbers: Python and Rust print a tie between two shortest decimals apart.
    let want: Vec<(u64, f64)> = losses(&run.join("metrics.jsonl"))
        .iter()
        .map(|(s, l)| (*s, (*l as f32) as f64))
        .collect();
    let line = lines.next().unwrap();
    let got: Vec<(u64, f64)> = line
        .trim_matches(|c| c == '[' || c == ']')
        .split("), (")
        .map(|pair| {
            let (s, v) = pair
                .trim_matches(|c| c == '(' || c == ')')
                .split_once(", ")
                .unwrap();
            (s.parse().unwrap(), v.parse().unwrap())
        })
        .collect();
    assert_eq!(got, want, "{line}");
}

#[test]
fn a_second_training_in_the_same_run_directory_is_refused_at_once() {
    let tmp = tempfile::tempdir().unwrap();
    let corpus = write_corpus(tmp.path());
    let mut a = vec!["train".to_string()];
    a.extend(small(&corpus));
    a.extend(["--max-steps".to_string(), "100000".to_string()]);
    let mut first = lockstep(tmp.path())
        .args(&a)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let metrics = tmp.path().join("runs/tiny/metrics.jsonl");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    while losses_or_empty(&metrics).len() < 2 {
        assert!(
            std::time::Instant::now() < deadline,
            "the first run never logged a step"
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    let started = std::time::Instant::now();
    let out = run(tmp.path(), &a);
    let text = output_text(&out);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(
        text.contains(&format!(
            "runs/tiny is in use by another training process (pid {}",
            first.id()
        )),
        "{text}"
    );
    assert!(text.contains("--set logging.run_name=NAME"), "{text}");
    assert!(
        !text.contains("Data:"),
        "refused before preparing anything:\n{text}"
    );
    assert!(
        started.elapsed().as_secs() < 30,
        "refused at once, not after setup"
    );

    // The first run is undisturbed: SIGTERM makes it checkpoint and exit 0, and its records
    // are its own, one line per step.
    // SAFETY: signalling a child we spawned and have not reaped.
    unsafe { libc::kill(first.id() as libc::pid_t, libc::SIGTERM) };
    assert!(first.wait().unwrap().success());
    let steps: Vec<u64> = losses(&metrics).into_iter().map(|(s, _)| s).collect();
    assert_eq!(steps, (1..=steps.len() as u64).collect::<Vec<_>>());
    // With the holder gone, the directory can be used again.
    let mut again = vec!["train".to_string()];
    again.extend(small(&corpus));
    again.extend(
        [
            "--max-steps",
            "100000",
            "--resume",
            "auto",
            "--stop-at-step",
        ]
        .map(String::from),
    );
    again.push((steps.len() + 1).to_string());
    ok(tmp.path(), &again);
}

fn losses_or_empty(metrics: &std::path::Path) -> Vec<(u64, f64)> {
    match std::fs::read_to_string(metrics) {
        Ok(text) if text.ends_with('\n') => losses(metrics),
        _ => Vec::new(),
    }
}

/// The default corpus is compiled into the binary: `prepare` and `train` work from a directory
/// that is not the repository, it is prepared once and cached, and it gives the same token files
/// as the repository's data/shakespeare directory read as an ordinary local path.
#[test]
fn default_corpus_is_built_in_and_works_from_any_directory() {
    let tmp = tempfile::tempdir().unwrap();
    let cwd = tmp.path();
    assert!(!cwd.join("data").exists());
    let config = ok(cwd, &["config".into(), "--preset".into(), "tiny".into()]);
    let v: serde_json::Value = serde_json::from_str(&config).unwrap();
    assert_eq!(v["data"]["path"], "builtin:shakespeare");

    let prep = |extra: &[&str]| {
        let mut a: Vec<String> = ["prepare", "--preset", "tiny"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        a.extend(extra.iter().map(|s| s.to_string()));
        ok(cwd, &a)
    };
    // data/README.md: 1,566,001 gpt2 tokens in 42 documents.
    let first = prep(&[]);
    assert!(
        first.contains("Data: prepared .lockstep/cache/")
            && first.contains("(1481490 train + 84511 val tokens"),
        "{first}"
    );
    assert!(prep(&[]).contains("Data: cache hit"));
    // The hit took the largest ids from meta.json (still valid after the entry's rename into
    // place): nothing was scanned into max-ids/.
    assert!(!cwd.join(".lockstep/cache/max-ids").exists());
    let entries: Vec<_> = std::fs::read_dir(cwd.join(".lockstep/cache"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(entries.len(), 1, "{entries:?}");
    let meta: serde_json::Value =
        serde_json::from_slice(&std::fs::read(entries[0].join("meta.json")).unwrap()).unwrap();
    assert_eq!(meta["inputs"]["dataset"], "builtin:shakespeare");
    assert_eq!(meta["inputs"]["files"].as_array().unwrap().len(), 42);
    assert_eq!(meta["train"]["max_token_id"], 50256);

    // The same corpus as a local directory: another cache entry, the same bytes.
    let dir = common::root().join("data/shakespeare");
    let local = prep(&[
        "--set",
        &format!("data.path={}", dir.display()),
        "--set",
        "data.cache_dir=local-cache",
    ]);
    assert!(local.contains("Data: prepared local-cache/"), "{local}");
    let local_entry = std::fs::read_dir(cwd.join("local-cache"))
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    for f in ["train.tok", "val.tok"] {
        assert!(
            std::fs::read(entries[0].join(f)).unwrap()
                == std::fs::read(local_entry.join(f)).unwrap(),
            "{f} differs between builtin:shakespeare and {}",
            dir.display()
        );
    }

    // train with the default data.path (a small model: seconds).
    // GPT-2's ids, as the default corpus was prepared above.
    let mut base = small_gpt2(std::path::Path::new("unused"));
    base.truncate(base.len() - 2); // drop `--set data.path=unused`: keep the default
    let out = ok(
        cwd,
        &args(&["train".into()], &[])
            .into_iter()
            .chain(base)
            .chain(["--max-steps".into(), "2".into()])
            .collect::<Vec<_>>(),
    );
    // Its context length differs from the preset's, which no longer keys the token cache (it
    // only cuts the tokens into windows): the same entry.
    assert!(out.contains("Data: cache hit .lockstep/cache/"), "{out}");
    assert!(cwd
        .join("runs/tiny/checkpoints/step_2/trainer.json")
        .is_file());
}

/// A printing command whose reader is gone (`lockstep config --keys | head`) ends quietly by
/// SIGPIPE, as a shell tool does, not with a panic (exit 101) about a failed print.
#[test]
fn a_printing_command_ends_quietly_when_its_reader_goes() {
    use std::os::unix::process::ExitStatusExt;
    let tmp = tempfile::tempdir().unwrap();
    for args in [&["config", "--keys"][..], &["plan", "--preset", "tiny"]] {
        let mut child = common::lockstep(tmp.path())
            .args(args)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        // The reader goes before anything is printed.
        drop(child.stdout.take());
        let out = child.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(
            out.status.signal(),
            Some(libc::SIGPIPE),
            "{args:?}: {:?} {err}",
            out.status
        );
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
}
