//! Hugging Face Hub names resolved through the local hub cache, downloading what is missing.
//!
//! A model or tokenizer given as `owner/name` (optionally `owner/name@revision`) that is not a
//! local path, and a dataset given as `owner/name`, `owner/name/<subdir>` or a bare name, are
//! looked up where `huggingface_hub` keeps downloads: `$HF_HUB_CACHE`, else `$HF_HOME/hub`, else
//! `$XDG_CACHE_HOME/huggingface/hub`, else `~/.cache/huggingface/hub` (datasets also in
//! `$HF_DATASETS_CACHE` / `$HF_HOME/datasets` when it holds the same `datasets--…` layout). A repo
//! lives in `models--owner--name/` (`datasets--owner--name/`): `refs/main` names the commit,
//! `snapshots/<commit>/` holds the files (links into `blobs/`).
//!
//! A model or tokenizer missing from the cache is downloaded into that same layout (`download`,
//! from `$HF_ENDPOINT`, default `https://huggingface.co`, with the token of `$HF_TOKEN` or the
//! `hf auth login` token file), unless `HF_HUB_OFFLINE` is set: then what is missing is named in
//! the error, with the command that fetches it on a machine with Hub access (`hf download …`)
//! and where to copy the result. The token is never printed, and never sent off the endpoint's
//! origin (a redirect to a CDN gets the request without it). Datasets are never downloaded.

use std::path::{Component, Path, PathBuf};

use anyhow::{anyhow, bail, Result};

use super::tokenizer::BUILTIN_NAMES;

mod datasets;
mod download;

pub use datasets::{cached_dataset, dataset_not_cached};
pub use download::hub_offline;
use download::{download_failed, endpoint, offline_var, Download, RepoLock};

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

fn hf_home() -> PathBuf {
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
fn dataset_roots() -> Vec<PathBuf> {
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

/// A repo name segment as the Hub allows it: letters, digits, `-`, `_`, `.`, not starting or
/// ending with `.`/`-`, no `..`.
fn valid_segment(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 96
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        && !s.starts_with(['.', '-'])
        && !s.ends_with(['.', '-'])
        && !s.contains("..")
}

/// `owner/name` or `owner/name@revision`, split.
fn parse_repo_id(id: &str) -> Option<(&str, &str, Option<&str>)> {
    let (repo, revision) = match id.split_once('@') {
        Some((r, rev)) if !rev.is_empty() && !rev.contains(['/', '\\']) => (r, Some(rev)),
        Some(_) => return None,
        None => (id, None),
    };
    let (owner, name) = repo.split_once('/')?;
    (valid_segment(owner) && valid_segment(name)).then_some((owner, name, revision))
}

/// True for `owner/name[@revision]` that is not an existing local path: a Hub model id.
pub fn is_hub_model_id(s: &str) -> bool {
    !Path::new(s).exists() && parse_repo_id(s).is_some()
}

/// True when a `data.path` that does not exist could name a Hub dataset: one to a few relative
/// `/`-separated segments, no file extension on the first two (so a mistyped `corpus.txt` still
/// gets the ordinary file-not-found error).
pub fn looks_like_dataset_name(s: &str) -> bool {
    let parts: Vec<&str> = s.split('/').collect();
    (1..=4).contains(&parts.len())
        && parts.iter().all(|p| valid_segment(p))
        && parts.iter().take(2).all(|p| {
            !p.rsplit_once('.').is_some_and(|(_, ext)| {
                ["txt", "jsonl", "json", "parquet", "tok", "bin", "csv"].contains(&ext)
            })
        })
}

/// The cache directory name of a repo: `models--owner--name` / `datasets--name`.
fn repo_folder(kind: &str, owner: Option<&str>, name: &str) -> String {
    match owner {
        Some(o) => format!("{kind}s--{o}--{name}"),
        None => format!("{kind}s--{name}"),
    }
}

/// The snapshot directory of a cached repo for `revision` (a branch or tag in `refs/`, or a
/// commit hash; default `main`), and the commit. A cache without `refs/` but with exactly one
/// snapshot (copied by hand) uses that one.
fn snapshot(repo_dir: &Path, revision: Option<&str>) -> Result<(PathBuf, String)> {
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
fn how_to_get(kind: &str, repo: &str, revision: Option<&str>, include: &[&str]) -> String {
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

/// Why a model/tokenizer was not downloaded, and how to get it by hand.
fn offline_help(repo: &str, revision: Option<&str>, include: &[&str]) -> String {
    let var = offline_var().unwrap_or("HF_HUB_OFFLINE");
    format!(
        "{var} is set, so lockstep does not download (unset it to fetch the files from {}). {}",
        endpoint(),
        how_to_get("model", repo, revision, include)
    )
}

/// A local model directory for `model.model_path`: the path itself when it exists, else the
/// cached snapshot of Hub repo `owner/name[@revision]` holding `config.json` and safetensors
/// weights (`model.safetensors`, or an index and every shard it names), downloaded first when
/// the cache lacks it and downloads are allowed ([`hub_offline`]).
pub fn resolve_model(id: &str) -> Result<PathBuf> {
    resolve_model_as("model.model_path", id)
}

/// [`resolve_model`] for a setting named `label` in messages (`--model`).
pub fn resolve_model_as(label: &str, id: &str) -> Result<PathBuf> {
    if Path::new(id).exists() {
        return Ok(PathBuf::from(id));
    }
    let Some((owner, name, revision)) = parse_repo_id(id) else {
        bail!(
            "{label} = {id:?}: no such directory, and not a Hugging Face model id \
             (owner/name); point it at a directory with config.json and model.safetensors"
        );
    };
    let repo = format!("{owner}/{name}");
    let include = &["*.json", "*.safetensors"];
    let repo_dir = hub_cache_dir().join(repo_folder("model", Some(owner), name));
    let not_cached = |what: String| {
        format!("{label} = {id:?} is not a local directory, and the Hugging Face cache {what}")
    };
    let miss = match cached_model(&repo_dir, &repo, revision)? {
        Ok(dir) => return Ok(dir),
        Err(what) => what,
    };
    if hub_offline() {
        bail!(
            "{}. {}",
            not_cached(miss),
            offline_help(&repo, revision, include)
        );
    }
    let _lock = RepoLock::take(&repo_dir, &repo)?;
    // Another process (a rank beside this one) may have downloaded it while this one waited.
    if let Ok(dir) = cached_model(&repo_dir, &repo, revision)? {
        return Ok(dir);
    }
    let mut dl = Download::new(&repo, revision).map_err(|e| download_failed(label, id, e))?;
    dl.model().map_err(|e| download_failed(label, id, e))?;
    match cached_model(&repo_dir, &repo, revision)? {
        Ok(dir) => Ok(dir),
        Err(what) => bail!(
            "{label} = {id:?}: downloaded from {}, but the Hugging Face cache {what}",
            dl.endpoint
        ),
    }
}

/// The cached snapshot of a model repo with everything lockstep reads; `Ok(Err(what))` says
/// what is missing.
fn cached_model(
    repo_dir: &Path,
    repo: &str,
    revision: Option<&str>,
) -> Result<std::result::Result<PathBuf, String>> {
    if !repo_dir.is_dir() {
        return Ok(Err(format!(
            "has no {} (looked in {})",
            repo_dir.file_name().unwrap_or_default().to_string_lossy(),
            hub_cache_dir().display()
        )));
    }
    let (dir, commit) = match snapshot(repo_dir, revision) {
        Ok(found) => found,
        Err(e) => return Ok(Err(format!("has no usable copy ({e:#})"))),
    };
    let mut missing = Vec::new();
    if !dir.join("config.json").is_file() {
        missing.push("config.json".to_string());
    }
    let index = dir.join(INDEX);
    if index.is_file() {
        missing.extend(
            index_shards(&index)?
                .into_iter()
                .filter(|s| !dir.join(s).is_file()),
        );
    } else if !dir.join("model.safetensors").is_file() {
        let only_bin = dir.join("pytorch_model.bin").is_file()
            || dir.join("pytorch_model.bin.index.json").is_file();
        missing.push(if only_bin {
            "model.safetensors (the cache has only PyTorch .bin weights; lockstep reads \
             safetensors)"
                .to_string()
        } else {
            "model.safetensors or model.safetensors.index.json".to_string()
        });
    }
    if !missing.is_empty() {
        return Ok(Err(format!(
            "copy of {repo} (snapshot {commit}) lacks {}",
            missing.join(", ")
        )));
    }
    Ok(Ok(dir))
}

const INDEX: &str = "model.safetensors.index.json";

/// The shard files a safetensors index names, sorted, once each.
fn index_shards(index: &Path) -> Result<Vec<String>> {
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(index)?)
        .map_err(|e| anyhow!("{}: invalid JSON ({e})", index.display()))?;
    let mut shards: Vec<String> = v["weight_map"]
        .as_object()
        .map(|m| {
            m.values()
                .filter_map(|s| s.as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default();
    shards.sort();
    shards.dedup();
    // Names come from the server: keep them inside the snapshot.
    if let Some(bad) = shards.iter().find(|s| {
        Path::new(s.as_str())
            .components()
            .any(|c| !matches!(c, Component::Normal(_)))
    }) {
        bail!(
            "{}: shard name {bad:?} is not a relative file name",
            index.display()
        );
    }
    Ok(shards)
}

/// `data.tokenizer` as [`super::Tokenizer::load`] takes it: built-in names and existing files
/// unchanged, a directory → its `tokenizer.json`, a Hub id `owner/name[@revision]` → the cached
/// snapshot's `tokenizer.json`, downloaded first (with `tokenizer_config.json`) when missing and
/// downloads are allowed. Anything else is returned unchanged for `load` to reject.
pub fn resolve_tokenizer(spec: &str) -> Result<String> {
    resolve_tokenizer_as("data.tokenizer", spec)
}

/// [`resolve_tokenizer`] for a setting named `label` in messages (`--tokenizer`).
pub fn resolve_tokenizer_as(label: &str, spec: &str) -> Result<String> {
    let path = Path::new(spec);
    if BUILTIN_NAMES.contains(&spec) || path.is_file() {
        return Ok(spec.to_string());
    }
    if path.is_dir() {
        let file = path.join("tokenizer.json");
        if file.is_file() {
            return Ok(file.to_string_lossy().into_owned());
        }
        bail!(
            "{label} = {spec:?}: the directory has no tokenizer.json; point it at a \
             tokenizer.json or a directory holding one"
        );
    }
    let Some((owner, name, revision)) = parse_repo_id(spec) else {
        return Ok(spec.to_string());
    };
    let repo = format!("{owner}/{name}");
    let include = &["tokenizer*"];
    let repo_dir = hub_cache_dir().join(repo_folder("model", Some(owner), name));
    let cached = || -> std::result::Result<String, String> {
        if !repo_dir.is_dir() {
            return Err(format!(
                "has no {} (looked in {})",
                repo_dir.file_name().unwrap_or_default().to_string_lossy(),
                hub_cache_dir().display()
            ));
        }
        let (dir, commit) =
            snapshot(&repo_dir, revision).map_err(|e| format!("has no usable copy ({e:#})"))?;
        let file = dir.join("tokenizer.json");
        if file.is_file() {
            Ok(file.to_string_lossy().into_owned())
        } else {
            Err(format!(
                "copy of {repo} (snapshot {commit}) has no tokenizer.json (lockstep needs the \
                 fast-tokenizer file, not only tokenizer.model)"
            ))
        }
    };
    let miss = match cached() {
        Ok(file) => return Ok(file),
        Err(what) => what,
    };
    if hub_offline() {
        bail!(
            "{label} = {spec:?} is neither a built-in encoding ({}) nor a local file, and the \
             Hugging Face cache {miss}. {}",
            BUILTIN_NAMES.join(", "),
            offline_help(&repo, revision, include)
        );
    }
    let _lock = RepoLock::take(&repo_dir, &repo)?;
    if let Ok(file) = cached() {
        return Ok(file);
    }
    let mut dl = Download::new(&repo, revision).map_err(|e| download_failed(label, spec, e))?;
    dl.tokenizer()
        .map_err(|e| download_failed(label, spec, e))?;
    cached().map_err(|what| {
        anyhow!(
            "{label} = {spec:?}: downloaded from {}, but the Hugging Face cache {what}",
            dl.endpoint
        )
    })
}

// ---------------------------------------------------------------------------------------------
// Downloads.

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repo_ids_and_dataset_names() {
        assert_eq!(
            parse_repo_id("meta-llama/Llama-3.1-8B"),
            Some(("meta-llama", "Llama-3.1-8B", None))
        );
        assert_eq!(parse_repo_id("a/b@v1.0"), Some(("a", "b", Some("v1.0"))));
        for bad in [
            "a", "a/b/c", "/abs/x", "./x/y", "a/..", "a/b@", "a/.b", "a b/c",
        ] {
            assert_eq!(parse_repo_id(bad), None, "{bad}");
        }
        for ok in [
            "wikitext-103-raw-v1",
            "Salesforce/wikitext",
            "HuggingFaceFW/fineweb/sample/10BT",
        ] {
            assert!(looks_like_dataset_name(ok), "{ok}");
        }
        for bad in [
            "corpus.txt",
            "data/x.jsonl",
            "/abs/data",
            "../x",
            "a/b/c/d/e",
            "",
        ] {
            assert!(!looks_like_dataset_name(bad), "{bad}");
        }
    }
}
