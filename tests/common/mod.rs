//! Shared by the integration tests: the project venv's Python, the built binary, temp dirs.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The venv Python that scripts/env.sh installs (torch, transformers, safetensors).
pub fn python() -> PathBuf {
    std::env::var_os("LOCKSTEP_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join(".venv/bin/python"))
}

pub fn run_python(script: &str, args: &[&str]) {
    let py = python();
    assert!(
        py.exists(),
        "{} missing: run scripts/test.sh, which installs the venv",
        py.display()
    );
    let out = Command::new(&py)
        .arg(root().join(script))
        .args(args)
        .output()
        .expect("python runs");
    assert!(
        out.status.success(),
        "{script} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The `lockstep` binary built for this test run.
pub fn lockstep(dir: &Path) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_lockstep"));
    c.current_dir(dir).env("OMP_WAIT_POLICY", "PASSIVE");
    c
}

pub fn output_text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// A small corpus on disk: a few documents of varied English text.
pub fn write_corpus(dir: &Path) -> PathBuf {
    let corpus = dir.join("corpus");
    std::fs::create_dir_all(&corpus).unwrap();
    let src = std::fs::read_to_string(root().join("data/shakespeare/hamlet_gut.txt"))
        .or_else(|_| std::fs::read_to_string(first_text(&root().join("data/shakespeare"))))
        .expect("the shipped corpus is present");
    let text: String = src.chars().take(120_000).collect();
    for (i, part) in text.as_bytes().chunks(30_000).enumerate() {
        std::fs::write(
            corpus.join(format!("doc{i}.txt")),
            String::from_utf8_lossy(part).as_bytes(),
        )
        .unwrap();
    }
    corpus
}

fn first_text(dir: &Path) -> PathBuf {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    files
        .into_iter()
        .find(|p| p.extension().is_some_and(|e| e == "txt"))
        .unwrap()
}

/// A small model on a small corpus: seconds per run on two cores.
pub fn small(corpus: &Path) -> Vec<String> {
    [
        "--preset",
        "tiny",
        "--set",
        "model.hidden_size=64",
        "--set",
        "model.num_attention_heads=4",
        "--set",
        "model.num_key_value_heads=2",
        "--set",
        "model.intermediate_size=128",
        "--set",
        "model.num_layers=2",
        "--set",
        "training.context_length=64",
        "--set",
        "training.batch_size=4",
        "--set",
        "training.learning_rate=1e-2",
        "--set",
        "training.min_lr=1e-3",
        "--set",
        "training.warmup_steps=3",
        "--set",
        "training.eval_interval=0",
        "--set",
        "training.eval_batches=2",
        "--set",
        "system.num_threads=1",
        "--set",
        "checkpoint.interval=5",
    ]
    .iter()
    .map(|s| s.to_string())
    .chain(["--set".into(), format!("data.path={}", corpus.display())])
    .collect()
}

/// (step, loss) of every line of a metrics.jsonl.
pub fn losses(metrics: &Path) -> Vec<(u64, f64)> {
    std::fs::read_to_string(metrics)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .map(|v| (v["step"].as_u64().unwrap(), v["loss"].as_f64().unwrap()))
        .collect()
}

pub fn run(dir: &Path, args: &[String]) -> Output {
    lockstep(dir).args(args).output().expect("lockstep runs")
}

pub fn ok(dir: &Path, args: &[String]) -> String {
    let out = run(dir, args);
    let text = output_text(&out);
    assert!(out.status.success(), "lockstep {args:?} failed:\n{text}");
    text
}

/// `head` + `base` + `tail` as one argument list.
pub fn with(base: &[String], head: &[&str], tail: &[&str]) -> Vec<String> {
    head.iter()
        .map(|s| s.to_string())
        .chain(base.iter().cloned())
        .chain(tail.iter().map(|s| s.to_string()))
        .collect()
}

/// The (pid, RANK) of every live child of a `lockstep run` launcher.
pub fn workers_of(launcher: u32) -> Vec<(u32, String)> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        let after = &stat[stat.rfind(')').unwrap() + 2..];
        let ppid: u32 = after.split(' ').nth(1).unwrap().parse().unwrap();
        if ppid != launcher {
            continue;
        }
        let env = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
        let rank = env
            .split(|b| *b == 0)
            .filter_map(|kv| std::str::from_utf8(kv).ok())
            .find_map(|kv| kv.strip_prefix("RANK="))
            .unwrap_or("?")
            .to_string();
        found.push((pid, rank));
    }
    found
}

/// The weights of a checkpoint directory, whichever ranks wrote them (one file, or one shard
/// per writing rank and an index), by name.
pub fn checkpoint_weights(dir: &Path) -> std::collections::HashMap<String, tch::Tensor> {
    let w = lockstep::model::hf::Weights::open(dir).unwrap();
    w.names()
        .into_iter()
        .map(|n| {
            let t = w.tensor(&n).unwrap();
            (n, t)
        })
        .collect()
}

/// Mounts a tmpfs at `dir` for the guard's lifetime; `None` (and a note) where mounting is not
/// allowed (no CAP_SYS_ADMIN), so those environments skip the check instead of faking it.
pub struct Tmpfs(PathBuf);

impl Tmpfs {
    pub fn mount(dir: &Path, options: &str) -> Option<Tmpfs> {
        std::fs::create_dir_all(dir).unwrap();
        let status = Command::new("mount")
            .args(["-t", "tmpfs", "-o", options, "tmpfs"])
            .arg(dir)
            .stderr(std::process::Stdio::null())
            .status();
        if status.is_ok_and(|s| s.success()) {
            Some(Tmpfs(dir.to_path_buf()))
        } else {
            eprintln!(
                "SKIPPED: cannot mount a tmpfs at {} here (needs root / CAP_SYS_ADMIN)",
                dir.display()
            );
            None
        }
    }

    pub fn remount(&self, options: &str) {
        let ok = Command::new("mount")
            .args(["-o", &format!("remount,{options}")])
            .arg(&self.0)
            .status()
            .unwrap()
            .success();
        assert!(ok, "remount {options}");
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

/// |a − b| / |b| (relative difference against the reference `b`).
pub fn rel(a: f64, b: f64) -> f64 {
    (a - b).abs() / b.abs().max(1e-12)
}

/// Asserts the exit code and that the output holds every one of `parts`; the output.
pub fn fails(out: &Output, code: i32, parts: &[&str]) -> String {
    let text = output_text(out);
    assert_eq!(out.status.code(), Some(code), "{text}");
    for p in parts {
        assert!(text.contains(p), "expected `{p}` in:\n{text}");
    }
    text
}

/// `&str` views of an argument list.
pub fn strs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

/// `sub` + `base` + `extra` as one argument list.
pub fn cmd(sub: &str, base: &[String], extra: &[&str]) -> Vec<String> {
    with(base, &[sub], extra)
}
