//! Shared by the integration tests: the project venv's Python, the built binary, temp dirs.
#![allow(dead_code)]

pub mod fetch;
pub mod mlflow;
pub mod ranks;
pub mod runs;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

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

/// The tests' tokenizer: byte-level BPE, 512 ids, trained on data/shakespeare
/// (tests/fixtures/make_tokenizer.py). With GPT-2's 50257 ids a `small` model would be 99%
/// vocabulary: its LM head, AdamW's moments and every checkpoint several times larger.
pub fn tokenizer() -> PathBuf {
    root().join("tests/fixtures/tokenizer-512.json")
}

/// A small model on a small corpus, with the tests' 512-id [`tokenizer`]: about a second per
/// run on two cores, most of it start-up.
pub fn small(corpus: &Path) -> Vec<String> {
    small_with(corpus, &tokenizer().display().to_string())
}

/// [`small`] with GPT-2's tokenizer (the default, 50257 ids), for tests about GPT-2 ids and
/// token files, and where the vocabulary must be large.
pub fn small_gpt2(corpus: &Path) -> Vec<String> {
    small_with(corpus, "gpt2")
}

/// [`small`]'s flags with `data.tokenizer = tokenizer`; `data.path` comes last (tests drop it).
fn small_with(corpus: &Path, tokenizer: &str) -> Vec<String> {
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
    .chain([
        "--set".into(),
        format!("data.tokenizer={tokenizer}"),
        "--set".into(),
        format!("data.path={}", corpus.display()),
    ])
    .collect()
}

/// Every record of a metrics.jsonl.
pub fn records(metrics: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(metrics)
        .unwrap_or_else(|e| panic!("{}: {e}", metrics.display()))
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// (step, loss) of every line of a metrics.jsonl.
pub fn losses(metrics: &Path) -> Vec<(u64, f64)> {
    records(metrics)
        .iter()
        .map(|v| (v["step"].as_u64().unwrap(), v["loss"].as_f64().unwrap()))
        .collect()
}

/// The number printed right after the first `marker` in `text` (`Stopped by signal at step `
/// → the step a stopped run names); panics, showing `text`, when there is none.
pub fn number_after<T: std::str::FromStr>(text: &str, marker: &str) -> T {
    let digits: String = text
        .split_once(marker)
        .unwrap_or_else(|| panic!("no {marker:?} in:\n{text}"))
        .1
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits
        .parse()
        .unwrap_or_else(|_| panic!("no number after {marker:?} in:\n{text}"))
}

/// A server on 127.0.0.1 that reads each request whole (headers and a Content-Length body)
/// and answers it with `response` (status line, headers and body). Returns its port.
pub fn canned_http(response: &'static str) -> u16 {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for conn in listener.incoming().flatten() {
            let _ = conn.set_read_timeout(Some(Duration::from_secs(2)));
            let mut reader = BufReader::new(conn);
            let mut length = 0usize;
            loop {
                let mut line = String::new();
                if reader.read_line(&mut line).unwrap_or(0) == 0 || line == "\r\n" {
                    break;
                }
                let lower = line.to_ascii_lowercase();
                if let Some(v) = lower.strip_prefix("content-length:") {
                    length = v.trim().parse().unwrap_or(0);
                }
            }
            let mut body = vec![0; length];
            let _ = reader.read_exact(&mut body);
            let _ = reader.get_mut().write_all(response.as_bytes());
        }
    });
    port
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
            .stderr(Stdio::null())
            .status();
        if status.is_ok_and(|s| s.success()) {
            Some(Tmpfs(dir.to_path_buf()))
        } else {
            privilege_missing(&format!("cannot mount a tmpfs at {}", dir.display()));
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

/// A test that needs root / CAP_SYS_ADMIN (a tmpfs to fill, network namespaces) and cannot
/// get it fails: CI has the privilege, so a test that silently passed there without running
/// would prove nothing (round 5, finding 32). Where the privilege is knowingly absent,
/// `LOCKSTEP_TESTS_UNPRIVILEGED=1` lets it return after printing SKIPPED.
pub fn privilege_missing(what: &str) {
    let note = format!("{what} here (needs root / CAP_SYS_ADMIN)");
    assert!(
        std::env::var_os("LOCKSTEP_TESTS_UNPRIVILEGED").is_some_and(|v| v == "1"),
        "{note}; run the tests as root, or set LOCKSTEP_TESTS_UNPRIVILEGED=1 to skip the tests \
         that need it"
    );
    eprintln!("SKIPPED: {note}");
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

/// Every path under `dir` (files, directories, links), relative to it, sorted; none where `dir`
/// does not exist.
pub fn tree(dir: &Path) -> Vec<String> {
    fn walk(root: &Path, dir: &Path, out: &mut Vec<String>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            out.push(p.strip_prefix(root).unwrap().display().to_string());
            if p.is_dir() {
                walk(root, &p, out);
            }
        }
    }
    let mut out = Vec::new();
    if dir.exists() {
        walk(dir, dir, &mut out);
    }
    out.sort();
    out
}

/// Every path under `dir` with its bytes (a directory: `None`), but the lock a run holds on its
/// checkpoint directory (which names the latest holder): what a refused command must leave as
/// it was.
pub fn snapshot(dir: &Path) -> std::collections::BTreeMap<PathBuf, Option<Vec<u8>>> {
    tree(dir)
        .into_iter()
        .map(PathBuf::from)
        .filter(|rel| rel.file_name().is_some_and(|n| n != "checkpoints.lock"))
        .map(|rel| {
            let path = dir.join(&rel);
            let bytes = (!path.is_dir()).then(|| std::fs::read(&path).unwrap());
            (rel, bytes)
        })
        .collect()
}

/// Paths under `dir` whose name contains `.tmp` (a half-written file or directory).
pub fn tmp_leftovers(dir: &Path) -> Vec<String> {
    tree(dir)
        .into_iter()
        .filter(|p| p.contains(".tmp"))
        .collect()
}

/// `&str` views of an argument list.
pub fn strs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

/// `sub` + `base` + `extra` as one argument list.
pub fn cmd(sub: &str, base: &[String], extra: &[&str]) -> Vec<String> {
    with(base, &[sub], extra)
}

/// A launcher started in the background whose stderr (the launcher's own messages) and stdout
/// are collected line by line, with the time each line arrived.
pub struct Launcher {
    child: Child,
    lines: Arc<Mutex<Vec<(Instant, String)>>>,
    readers: Vec<std::thread::JoinHandle<()>>,
}

impl Launcher {
    /// `lockstep ARGS` in `dir`.
    pub fn start(dir: &Path, args: &[String]) -> Launcher {
        let mut cmd = lockstep(dir);
        cmd.args(args);
        Launcher::spawn(cmd)
    }

    /// Any command (`ip netns exec … lockstep …`), its output collected the same way.
    pub fn spawn(mut cmd: Command) -> Launcher {
        let mut child = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let lines = Arc::new(Mutex::new(Vec::new()));
        let mut readers = Vec::new();
        let out: Box<dyn std::io::Read + Send> = Box::new(child.stdout.take().unwrap());
        let err: Box<dyn std::io::Read + Send> = Box::new(child.stderr.take().unwrap());
        for pipe in [out, err] {
            let lines = lines.clone();
            readers.push(std::thread::spawn(move || {
                for line in BufReader::new(pipe).lines().map_while(Result::ok) {
                    lines.lock().unwrap().push((Instant::now(), line));
                }
            }));
        }
        Launcher {
            child,
            lines,
            readers,
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn text(&self) -> String {
        let lines = self.lines.lock().unwrap();
        lines.iter().map(|(_, l)| format!("{l}\n")).collect()
    }

    /// Waits (at most `limit`) until a line contains `needle`.
    pub fn wait_for(&self, needle: &str, limit: Duration) {
        let deadline = Instant::now() + limit;
        while self.seen(needle).is_none() {
            assert!(
                Instant::now() < deadline,
                "no {needle:?} within {limit:?}:\n{}",
                self.text()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The pid of this launcher's first worker, once it has exec'd (see [`worker_of`]).
    pub fn worker(&self) -> u32 {
        worker_of(self.pid(), Duration::from_secs(60))
    }

    /// When the first line containing `needle` arrived.
    pub fn seen(&self, needle: &str) -> Option<Instant> {
        let lines = self.lines.lock().unwrap();
        lines
            .iter()
            .find(|(_, l)| l.contains(needle))
            .map(|(t, _)| *t)
    }

    pub fn running(&mut self) -> bool {
        self.child.try_wait().unwrap().is_none()
    }

    /// Waits for the exit (at most `limit`) and returns the code and everything printed.
    pub fn finish(self, limit: Duration) -> (Option<i32>, String) {
        self.finish_since(limit, None)
    }

    /// As [`Launcher::finish`], each line after `t0` prefixed with its arrival (`+1.23s`), for
    /// a test that asserts how long something took.
    pub fn finish_timed(self, limit: Duration, t0: Instant) -> (Option<i32>, String) {
        self.finish_since(limit, Some(t0))
    }

    fn finish_since(mut self, limit: Duration, t0: Option<Instant>) -> (Option<i32>, String) {
        let deadline = Instant::now() + limit;
        let status = loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                break s;
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                let _ = self.child.wait();
                panic!("launcher still running after {limit:?}:\n{}", self.text());
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        for r in self.readers.drain(..) {
            let _ = r.join();
        }
        let text = match t0 {
            None => self.text(),
            Some(t0) => {
                let lines = self.lines.lock().unwrap();
                lines
                    .iter()
                    .map(|(t, l)| match t.checked_duration_since(t0) {
                        Some(d) => format!("+{:.2}s {l}\n", d.as_secs_f64()),
                        None => format!("{l}\n"),
                    })
                    .collect()
            }
        };
        (status.code(), text)
    }
}

impl Drop for Launcher {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// The first child of `parent` that has exec'd into a lockstep worker (`train --worker-spec`):
/// close-on-exec and the worker's own state exist only after the exec, not at the fork.
pub fn worker_of(parent: u32, limit: Duration) -> u32 {
    let deadline = Instant::now() + limit;
    loop {
        let kids = std::fs::read_to_string(format!("/proc/{parent}/task/{parent}/children"))
            .unwrap_or_default();
        if let Some(k) = kids.split_whitespace().next() {
            let cmdline = std::fs::read(format!("/proc/{k}/cmdline")).unwrap_or_default();
            if String::from_utf8_lossy(&cmdline).contains("worker-spec") {
                return k.parse().unwrap();
            }
        }
        assert!(
            Instant::now() < deadline,
            "no worker of pid {parent} within {limit:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Every `*.safetensors` of a checkpoint, by name (the model and the optimizer state).
pub fn tensor_files(ckpt: &Path) -> Vec<(String, Vec<u8>)> {
    let mut files: Vec<(String, Vec<u8>)> = std::fs::read_dir(ckpt)
        .unwrap_or_else(|e| panic!("{}: {e}", ckpt.display()))
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .map(|p| {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            (name, std::fs::read(&p).unwrap())
        })
        .collect();
    files.sort();
    files
}

/// Every model and optimizer file of checkpoints `a` and `b` is byte for byte the same.
pub fn assert_bitwise_equal_checkpoints(a: &Path, b: &Path) {
    let (fa, fb) = (tensor_files(a), tensor_files(b));
    let names = |f: &[(String, Vec<u8>)]| f.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>();
    assert_eq!(names(&fa), names(&fb));
    assert!(
        names(&fa).iter().any(|n| n.starts_with("model"))
            && names(&fa).iter().any(|n| n.starts_with("optimizer")),
        "{:?}",
        names(&fa)
    );
    for ((name, x), (_, y)) in fa.iter().zip(&fb) {
        assert!(
            x == y,
            "{name} differs between {} and {}",
            a.display(),
            b.display()
        );
    }
}

/// Every Rust source file under `dir`, relative to it: sorted, a folder's mod.rs first.
pub fn rust_files(dir: &Path) -> Vec<PathBuf> {
    fn walk(dir: &Path, rel: &Path, out: &mut Vec<PathBuf>) {
        let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        entries.sort_by_key(|p| (p.file_name().unwrap() != "mod.rs", p.is_dir(), p.clone()));
        for p in entries {
            let name = rel.join(p.file_name().unwrap());
            if p.is_dir() {
                walk(&p, &name, out);
            } else if p.extension().is_some_and(|e| e == "rs") {
                out.push(name);
            }
        }
    }
    let mut out = Vec::new();
    walk(dir, Path::new(""), &mut out);
    out
}

/// A mixture of 4 experts of width 32, top 2 (renormalised), every layer a MoE layer but
/// layer 1 (dense), the load-balancing loss weighted `aux_loss_coef`.
pub fn tiny_moe(aux_loss_coef: f64) -> lockstep::model::MoeShape {
    lockstep::model::MoeShape {
        num_experts: 4,
        top_k: 2,
        expert_size: 32,
        sparse_step: 1,
        dense_layers: vec![1],
        norm_topk_prob: true,
        aux_loss_coef,
    }
}

/// The optimizer settings of the default config with Muon (`training.optimizer=muon`,
/// `training.muon_adjust_lr=adjust`, `debug.muon_all_gather=all_gather`): torch.optim.Muon's
/// and torch.optim.AdamW's settings in the parity tests (momentum 0.95, 5 Newton–Schulz steps,
/// betas 0.9 / 0.95, eps 1e-8, weight decay 0.1).
pub fn muon_hyper(
    adjust: lockstep::config::MuonAdjust,
    all_gather: bool,
) -> lockstep::train::optim::Hyper {
    let sets = [
        "training.optimizer=muon".to_string(),
        format!("training.muon_adjust_lr={adjust}"),
        format!("debug.muon_all_gather={all_gather}"),
    ];
    let cfg = lockstep::config::resolve(&lockstep::config::Sources {
        sets: sets.to_vec(),
        ..Default::default()
    })
    .unwrap()
    .config;
    lockstep::train::optim::Hyper::from_config(&cfg)
}
