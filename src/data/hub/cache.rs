//! The local hub cache: where it is (chosen as `huggingface_hub` chooses it), how a repo is
//! laid out in it, and how to bring a repo into it by hand.

use std::path::{Path, PathBuf};

use anyhow::{bail, Result};

/// The hub cache directory, chosen exactly as `huggingface_hub` chooses it.
pub fn hub_cache_dir() -> PathBuf {
    let var = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    var("HF_HUB_CACHE")
        .or_else(|| var("HUGGINGFACE_HUB_CACHE"))
        .unwrap_or_else(|| hf_home().join("hub"))
}

pub(super) fn hf_home() -> PathBuf {
    let var = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    var("HF_HOME").unwrap_or_else(|| {
        var("XDG_CACHE_HOME")
            .or_else(|| var("HOME").map(|h| h.join(".cache")))
            .unwrap_or_else(|| PathBuf::from(".cache"))
            .join("huggingface")
    })
}

/// Where cached datasets may be: the hub cache, then the `datasets` library's cache directory.
pub(super) fn dataset_roots() -> Vec<PathBuf> {
    let mut roots = vec![hub_cache_dir()];
    let datasets = std::env::var_os("HF_DATASETS_CACHE")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| hf_home().join("datasets"));
    if !roots.contains(&datasets) {
        roots.push(datasets);
    }
    roots
}

/// The cache directory name of a repo: `models--owner--name` / `datasets--name`.
pub(super) fn repo_folder(kind: &str, owner: Option<&str>, name: &str) -> String {
    match owner {
        Some(o) => format!("{kind}s--{o}--{name}"),
        None => format!("{kind}s--{name}"),
    }
}

/// The snapshot directory of a cached repo for `revision` (a branch or tag in `refs/`, or a
/// commit hash; default `main`), and the commit. A cache without `refs/` but with exactly one
/// snapshot (copied by hand) uses that one.
pub(super) fn snapshot(repo_dir: &Path, revision: Option<&str>) -> Result<(PathBuf, String)> {
    let rev = revision.unwrap_or("main");
    let snapshots = repo_dir.join("snapshots");
    if let Ok(commit) = std::fs::read_to_string(repo_dir.join("refs").join(rev)) {
        let commit = commit.trim().to_string();
        let dir = snapshots.join(&commit);
        if dir.is_dir() {
            return Ok((dir, commit));
        }
        bail!(
            "{}: refs/{rev} names commit {commit} but snapshots/{commit} is missing; the cache \
             copy is incomplete",
            repo_dir.display()
        );
    }
    if snapshots.join(rev).is_dir() {
        return Ok((snapshots.join(rev), rev.to_string()));
    }
    let mut found: Vec<String> = std::fs::read_dir(&snapshots)
        .map(|d| {
            d.flatten()
                .filter(|e| e.path().is_dir())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    found.sort();
    match (revision, found.as_slice()) {
        (None, [only]) => Ok((snapshots.join(only), only.clone())),
        (_, []) => bail!(
            "{}: has no snapshots/ (nothing downloaded)",
            repo_dir.display()
        ),
        _ => bail!(
            "{}: no refs/{rev}; cached snapshots: {}; pick one with @<commit>",
            repo_dir.display(),
            found.join(", ")
        ),
    }
}

/// How to obtain a repo (at `revision`, default main) on a machine with Hub access and bring it
/// here. `include` limits the download to those glob patterns (a Llama repo also holds the
/// original .pth weights).
pub(super) fn how_to_get(
    kind: &str,
    repo: &str,
    revision: Option<&str>,
    include: &[&str],
) -> String {
    let cache = hub_cache_dir();
    let flag = if kind == "dataset" {
        " --repo-type dataset"
    } else {
        ""
    };
    // `hf` takes one pattern per --include; the older argparse CLI a list after one --include.
    let hf_include: String = include
        .iter()
        .map(|p| format!(" --include \"{p}\""))
        .collect();
    let old_include = if include.is_empty() {
        String::new()
    } else {
        let quoted: Vec<String> = include.iter().map(|p| format!("\"{p}\"")).collect();
        format!(" --include {}", quoted.join(" "))
    };
    let folder = format!("{kind}s--{}", repo.replace('/', "--"));
    let rev = revision
        .map(|r| format!(" --revision {r}"))
        .unwrap_or_default();
    format!(
        "On a machine with Hub access run \
         `hf download{flag} {repo}{rev}{hf_include}` (older huggingface_hub: \
         `huggingface-cli download{flag} {repo}{rev}{old_include}`; gated repos need `hf auth login` \
         or HF_TOKEN there), then copy its ~/.cache/huggingface/hub/{folder} to {} here, or set \
         HF_HUB_CACHE to a directory holding {folder}",
        cache.join(&folder).display()
    )
}
