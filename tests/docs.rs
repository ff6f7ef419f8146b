//! The doc test: every command the docs show is run, so the docs cannot rot.
//!
//! It reads README.md and docs/*.md (docs/CONFIG.md aside: it is generated from the code and
//! holds no commands) and runs their fenced code blocks tagged `bash`. The convention:
//!
//! - A ```` ```bash ```` block is run. A ```` ```text ````, ```` ```json ```` or
//!   ```` ```console ```` block (or one with no tag) is not: use those for output samples,
//!   config snippets and file trees. `sh` and `shell` are refused (say `bash` or `text`).
//! - A `bash` block that cannot run here (it needs GPUs, Slurm, the network, a server; or it is
//!   one of the README's two commands, which CI runs itself) has
//!   `<!-- doc-test: skip — REASON -->` on the line right before its fence. The reason is
//!   required; the skips are counted and listed in the output.
//! - Commands are written as a user types them: `lockstep …` is the binary under test (first on
//!   PATH through a symlink), `python` the project venv's (its bin/ comes next on PATH).
//! - The blocks of one markdown file run in order, each with `bash -euo pipefail`, in one fresh
//!   working directory per file, so `prepare` → `train` → `train --resume auto` → `export`
//!   flow from block to block. The directory starts with a stand-in for "your own data":
//!   `corpus/` (four plays of data/shakespeare as .txt files) and `notes.jsonl` (the sonnets,
//!   one `{"id": N, "content": "…"}` line per stanza). The environment has `HF_HUB_OFFLINE=1`,
//!   `WANDB_MODE=offline`, an empty `HF_HOME` of its own, and none of the launchers' variables
//!   (RANK, SLURM_*, …) of the shell that started the test.
//! - A block fails the test when it exits non-zero (or runs past 10 minutes); the failure names
//!   the file, the fence's line, the commands and the output, and that file's directory is
//!   kept for a look. The rest of that file's blocks are not run (they build on it); the other
//!   files still are.
//! - Every command that trains uses `--preset tiny` and a few steps (`--max-steps 20` at most),
//!   so the whole test stays within a few minutes on two cores.
//!
//! - `DOC_TEST_FILES=README.md,docs/data.md` runs only those files' blocks (while writing one).
//!
//! A second test checks that every relative link `](path)` of these files names a file or
//! directory that exists.

use crate::common;

use std::io::Write;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const SKIP: &str = "<!-- doc-test: skip";
const BLOCK_LIMIT: Duration = Duration::from_secs(600);

/// One fenced code block of a markdown file.
struct Block {
    /// The 1-based line of its opening fence.
    line: usize,
    tag: String,
    code: String,
    /// The reason of a `doc-test: skip` marker on the line before the fence.
    skip: Option<String>,
}

/// README.md, then docs/*.md in name order, without the generated docs/CONFIG.md.
fn markdown_files() -> Vec<PathBuf> {
    let root = common::root();
    let mut docs: Vec<PathBuf> = std::fs::read_dir(root.join("docs"))
        .expect("docs/ exists")
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .filter(|p| p.file_name().is_some_and(|n| n != "CONFIG.md"))
        .collect();
    docs.sort();
    std::iter::once(root.join("README.md"))
        .chain(docs)
        .collect()
}

fn display(path: &Path) -> String {
    path.strip_prefix(common::root())
        .unwrap_or(path)
        .display()
        .to_string()
}

/// The fenced blocks of `text`; errors name the line of a malformed fence or marker.
fn blocks(text: &str) -> Result<Vec<Block>, String> {
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let line = lines[i];
        let trimmed = line.trim_start();
        if trimmed.starts_with(SKIP) {
            let next = lines.get(i + 1).map(|l| l.trim_start()).unwrap_or("");
            if !next.starts_with("```") {
                return Err(format!(
                    "line {}: a doc-test skip marker must be the line right before a ```bash fence",
                    i + 1
                ));
            }
        }
        let ticks = trimmed.chars().take_while(|&c| c == '`').count();
        // A fence: three or more backticks and an info string without any (CommonMark), so
        // inline code such as ```` ```bash ```` at the start of a line is not one.
        if ticks < 3 || trimmed[ticks..].contains('`') {
            i += 1;
            continue;
        }
        let indent = line.len() - trimmed.len();
        let tag = trimmed[ticks..].trim().to_string();
        let skip = match i.checked_sub(1).map(|p| lines[p].trim()) {
            Some(prev) if prev.starts_with(SKIP) => Some(skip_reason(prev, i)?),
            _ => None,
        };
        let fence = "`".repeat(ticks);
        let mut code = String::new();
        let mut j = i + 1;
        loop {
            let Some(l) = lines.get(j) else {
                return Err(format!("line {}: code fence never closed", i + 1));
            };
            let t = l.trim_start();
            if t.starts_with(&fence) && t.trim_start_matches('`').trim().is_empty() {
                break;
            }
            // Lines of an indented block (one inside a list item) lose the fence's indent.
            let cut = l.len() - l.trim_start().len();
            code.push_str(&l[cut.min(indent)..]);
            code.push('\n');
            j += 1;
        }
        if matches!(tag.as_str(), "sh" | "shell") {
            return Err(format!(
                "line {}: a ```{tag} block: tag it bash (run by the doc test) or text (not run)",
                i + 1
            ));
        }
        if skip.is_some() && tag != "bash" {
            return Err(format!(
                "line {}: a doc-test skip marker before a ```{tag} block, which is never run; drop the marker",
                i + 1
            ));
        }
        out.push(Block {
            line: i + 1,
            tag,
            code,
            skip,
        });
        i = j + 1;
    }
    Ok(out)
}

/// The REASON of `<!-- doc-test: skip — REASON -->` (the marker on line `fence` of the file).
fn skip_reason(marker: &str, fence: usize) -> Result<String, String> {
    let reason = marker
        .strip_prefix(SKIP)
        .and_then(|r| r.trim().strip_suffix("-->"))
        .map(|r| r.trim().trim_start_matches(['—', '-', ':']).trim())
        .unwrap_or("");
    if reason.is_empty() {
        return Err(format!(
            "line {fence}: write the reason into the marker: <!-- doc-test: skip — REASON -->"
        ));
    }
    Ok(reason.to_string())
}

/// The stand-in for "your own data" every file's directory starts with.
fn seed(dir: &Path) {
    let plays = common::root().join("data/shakespeare");
    let corpus = dir.join("corpus");
    std::fs::create_dir_all(&corpus).unwrap();
    for play in [
        "comedy_of_errors_gut.txt",
        "macbeth_gut.txt",
        "midsummer_nights_dream_gut.txt",
        "tempest_gut.txt",
    ] {
        std::fs::copy(plays.join(play), corpus.join(play)).unwrap();
    }
    let sonnets = std::fs::read_to_string(plays.join("sonnets_gut.txt")).unwrap();
    let mut notes = String::new();
    let stanzas = sonnets
        .split("\n\n")
        .map(str::trim)
        .filter(|s| !s.is_empty());
    for (i, stanza) in stanzas.enumerate() {
        let line = serde_json::json!({"id": i, "content": stanza});
        notes.push_str(&line.to_string());
        notes.push('\n');
    }
    std::fs::write(dir.join("notes.jsonl"), notes).unwrap();
}

/// Variables of the shell that started the test that would change what a block does.
fn inherited_noise(name: &str) -> bool {
    name.starts_with("SLURM_")
        || name.starts_with("TORCHELASTIC_")
        || name.starts_with("HF_")
        || name.starts_with("MLFLOW_")
        || name.starts_with("WANDB_")
        || matches!(
            name,
            "RANK"
                | "WORLD_SIZE"
                | "LOCAL_RANK"
                | "LOCAL_WORLD_SIZE"
                | "MASTER_ADDR"
                | "MASTER_PORT"
                | "LOCKSTEP_LAUNCHER"
                | "CUDA_VISIBLE_DEVICES"
        )
}

/// Runs `code` with bash in `dir`; the exit status (None: killed at the limit) and the output.
fn run_block(
    code: &str,
    dir: &Path,
    scripts: &Path,
    n: usize,
    path: &str,
) -> (Option<i32>, String) {
    let script = scripts.join(format!("block-{n}.sh"));
    std::fs::write(&script, code).unwrap();
    let log_path = scripts.join(format!("block-{n}.log"));
    let log = std::fs::File::create(&log_path).unwrap();
    let mut cmd = Command::new("bash");
    cmd.args(["-euo", "pipefail"])
        .arg(&script)
        .current_dir(dir)
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .process_group(0);
    for (name, _) in std::env::vars_os() {
        if inherited_noise(&name.to_string_lossy()) {
            cmd.env_remove(&name);
        }
    }
    cmd.env("PATH", path)
        .env("HF_HUB_OFFLINE", "1")
        .env("HF_HOME", dir.join(".hf"))
        .env("WANDB_MODE", "offline")
        .env("OMP_WAIT_POLICY", "PASSIVE");
    let mut child = cmd.spawn().expect("bash runs");
    let t0 = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status.code();
        }
        if t0.elapsed() > BLOCK_LIMIT {
            // The whole group: `lockstep run` and its workers with the shell.
            unsafe { libc::kill(-(child.id() as libc::pid_t), libc::SIGKILL) };
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    (
        status,
        std::fs::read_to_string(&log_path).unwrap_or_default(),
    )
}

/// The last `n` lines of `text`.
fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// A progress line on the real stderr, shown even while the test harness captures output.
fn say(line: &str) {
    let _ = writeln!(std::io::stderr(), "{line}");
}

#[test]
fn every_bash_block_of_the_docs_runs() {
    let t0 = Instant::now();
    let bin_dir = tempfile::tempdir().unwrap();
    std::os::unix::fs::symlink(
        env!("CARGO_BIN_EXE_lockstep"),
        bin_dir.path().join("lockstep"),
    )
    .unwrap();
    let mut path = vec![bin_dir.path().to_path_buf()];
    if let Some(venv_bin) = common::python().parent().filter(|d| d.is_dir()) {
        path.push(venv_bin.to_path_buf());
    }
    path.extend(std::env::split_paths(
        &std::env::var_os("PATH").unwrap_or_default(),
    ));
    let path = std::env::join_paths(path).unwrap();
    let path = path.to_string_lossy().into_owned();

    let only = std::env::var("DOC_TEST_FILES").ok();
    let (mut ran, mut skipped, mut failures) = (0, Vec::new(), Vec::new());
    for file in markdown_files() {
        let name = display(&file);
        if only
            .as_deref()
            .is_some_and(|o| !o.split(',').any(|f| f.trim() == name))
        {
            continue;
        }
        let text = std::fs::read_to_string(&file).unwrap();
        let blocks = match blocks(&text) {
            Ok(b) => b,
            Err(e) => {
                say(&format!("doc test: {name}: {e}"));
                failures.push(format!("{name}: {e}"));
                continue;
            }
        };
        let work = tempfile::tempdir().unwrap();
        let scripts = tempfile::tempdir().unwrap();
        seed(work.path());
        let mut failed = false;
        for (n, block) in blocks.iter().enumerate().filter(|(_, b)| b.tag == "bash") {
            let at = format!("{name}:{}", block.line);
            if let Some(reason) = &block.skip {
                skipped.push(format!("{at}: {reason}"));
                continue;
            }
            let t = Instant::now();
            let (status, output) = run_block(&block.code, work.path(), scripts.path(), n, &path);
            ran += 1;
            let secs = t.elapsed().as_secs_f64();
            if status == Some(0) {
                say(&format!("doc test: {at} ok ({secs:.1} s)"));
                continue;
            }
            let how = match status {
                Some(code) => format!("exit code {code}"),
                None => format!("killed after {} s", BLOCK_LIMIT.as_secs()),
            };
            say(&format!("doc test: {at} FAILED ({how}, {secs:.1} s)"));
            failures.push(format!(
                "{at}: the ```bash block failed ({how}) in {} (kept for a look):\n{}--- its output (last 60 lines) ---\n{}\n(the rest of {name} was not run)",
                work.path().display(),
                block.code,
                tail(&output, 60)
            ));
            failed = true;
            break;
        }
        if failed {
            let _ = work.keep();
        }
    }
    say(&format!(
        "doc test: {ran} blocks run, {} skipped, in {:.0} s",
        skipped.len(),
        t0.elapsed().as_secs_f64()
    ));
    for s in &skipped {
        say(&format!("doc test: skipped {s}"));
    }
    assert!(
        failures.is_empty(),
        "{} of the docs' blocks failed:\n\n{}",
        failures.len(),
        failures.join("\n\n")
    );
}

#[test]
fn every_relative_link_of_the_docs_names_a_file() {
    let mut broken = Vec::new();
    for file in markdown_files() {
        let text = std::fs::read_to_string(&file).unwrap();
        let dir = file.parent().unwrap();
        for (n, line) in text.lines().enumerate() {
            let mut rest = line;
            while let Some(at) = rest.find("](") {
                rest = &rest[at + 2..];
                let Some(end) = rest.find(')') else { break };
                let target = &rest[..end];
                rest = &rest[end..];
                if target.contains("://")
                    || target.starts_with('#')
                    || target.starts_with("mailto:")
                {
                    continue;
                }
                let target = target.split('#').next().unwrap();
                if !dir.join(target).exists() {
                    broken.push(format!("{}:{}: {target}", display(&file), n + 1));
                }
            }
        }
    }
    assert!(
        broken.is_empty(),
        "links to files that do not exist:\n{}",
        broken.join("\n")
    );
}

/// The folders of src/ in layer order, each above the ones it may use.
const LAYERS: &[&str] = &[
    "",
    "commands",
    "launch",
    "train",
    "run",
    "plan",
    "model",
    "dist",
    "data",
    "telemetry",
    "config",
    "sys",
];

/// The first sentence of a Rust file's `//!` docs, on one line.
fn summary(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap();
    let mut para = String::new();
    for line in text.lines() {
        let Some(doc) = line.strip_prefix("//!") else {
            break;
        };
        let doc = doc.trim();
        if doc.is_empty() {
            if para.is_empty() {
                continue;
            }
            break;
        }
        if !para.is_empty() {
            para.push(' ');
        }
        para.push_str(doc);
    }
    let para = plain(&para);
    let end = para
        .match_indices(". ")
        .map(|(i, _)| i + 1)
        .find(|&i| !para[..i].ends_with("e.g.") && !para[..i].ends_with("i.e."))
        .unwrap_or(para.len());
    para[..end].to_string()
}

/// Rustdoc's links as their text: `[`Tracker`](super::tracker::Tracker)` and `[`Tracker`]`
/// become `` `Tracker` `` (their targets are Rust paths, not files a page can link to).
fn plain(doc: &str) -> String {
    let mut out = String::new();
    let mut rest = doc;
    while let Some(open) = rest.find('[') {
        out.push_str(&rest[..open]);
        let after = &rest[open + 1..];
        let Some(close) = after.find(']') else {
            out.push_str(&rest[open..]);
            return out;
        };
        out.push_str(&after[..close]);
        rest = &after[close + 1..];
        if rest.starts_with('(') {
            if let Some(end) = rest.find(')') {
                rest = &rest[end + 1..];
            }
        }
    }
    out.push_str(rest);
    out
}

/// `name` then `text` wrapped at 100 columns, continued under the text's first column.
fn entry(name: &str, text: &str, out: &mut String) {
    const COLUMN: usize = 28;
    let mut line = format!("{name:<width$}", width = COLUMN - 1);
    if line.len() >= COLUMN {
        line.push('\n');
        out.push_str(&line);
        line = " ".repeat(COLUMN - 1);
    }
    for word in text.split_whitespace() {
        if line.len() + 1 + word.len() > 100 && !line.trim().is_empty() && line.len() > COLUMN {
            out.push_str(line.trim_end());
            out.push('\n');
            line = " ".repeat(COLUMN - 1);
        }
        line.push(' ');
        line.push_str(word);
    }
    out.push_str(line.trim_end());
    out.push('\n');
}

/// The tree of src/, folder by folder in layer order, each file with the first sentence of its
/// module docs.
fn layout() -> String {
    let src = common::root().join("src");
    let mut out = String::new();
    for layer in LAYERS {
        let files: Vec<PathBuf> = if layer.is_empty() {
            // The files beside the folders: those without a folder in their path.
            common::rust_files(&src)
                .into_iter()
                .filter(|f| f.parent() == Some(Path::new("")))
                .collect()
        } else {
            out.push_str(&format!("\nsrc/{layer}/\n"));
            common::rust_files(&src.join(layer))
        };
        let base = src.join(layer);
        for f in files {
            let name = if layer.is_empty() {
                format!("src/{}", f.display())
            } else {
                format!("  {}", f.display())
            };
            entry(&name, &summary(&base.join(&f)), &mut out);
        }
    }
    out
}

const LAYOUT_BEGIN: &str =
    "<!-- layout: generated by tests/docs.rs from each file's module docs -->\n```text\n";
const LAYOUT_END: &str = "```\n<!-- layout: end -->";

/// docs/layout.md's tree is the source tree as it is: every file, with the first sentence of
/// its module docs. `LOCKSTEP_WRITE_DOCS=1 cargo test --release --test suite docs::the_layout`
/// rewrites it after a change.
#[test]
fn the_layout_page_lists_every_source_file_with_its_module_docs() {
    let path = common::root().join("docs/layout.md");
    let text = std::fs::read_to_string(&path).unwrap();
    let (Some(a), Some(b)) = (text.find(LAYOUT_BEGIN), text.find(LAYOUT_END)) else {
        panic!("docs/layout.md: no generated tree between `{LAYOUT_BEGIN}` and `{LAYOUT_END}`")
    };
    let now = layout();
    let shown = &text[a + LAYOUT_BEGIN.len()..b];
    if shown == now {
        return;
    }
    if std::env::var_os("LOCKSTEP_WRITE_DOCS").is_some() {
        let new = format!("{}{LAYOUT_BEGIN}{now}{}", &text[..a], &text[b..]);
        std::fs::write(&path, new).unwrap();
        return;
    }
    panic!(
        "docs/layout.md's tree is not the source tree; rewrite it with \
         `LOCKSTEP_WRITE_DOCS=1 cargo test --release --test suite docs::the_layout`:\n{now}"
    );
}
