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
