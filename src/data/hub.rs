//! Hugging Face Hub names resolved from the local hub cache, without network access.
//!
//! A model or tokenizer given as `owner/name` (optionally `owner/name@revision`) that is not a
//! local path, and a dataset given as `owner/name`, `owner/name/<subdir>` or a bare name, are
//! looked up where `huggingface_hub` keeps downloads: `$HF_HUB_CACHE`, else `$HF_HOME/hub`, else
//! `$XDG_CACHE_HOME/huggingface/hub`, else `~/.cache/huggingface/hub` (datasets also in
//! `$HF_DATASETS_CACHE` / `$HF_HOME/datasets` when it holds the same `datasets--…` layout). A repo
//! lives in `models--owner--name/` (`datasets--owner--name/`): `refs/main` names the commit,
//! `snapshots/<commit>/` holds the files (links into `blobs/`).
//!
//! lockstep never downloads. What is missing is named in the error, with the command that
//! fetches it on a machine with Hub access (`hf download …`) and where to copy the result.

use std::path::{Component, Path, PathBuf};

use anyhow::{anyhow, bail, Result};

use super::sources::{list_files, DatasetFiles};
use super::tokenizer::BUILTIN_NAMES;

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

/// How to obtain a repo on a machine with Hub access and bring it here. `include` limits the
/// download to those glob patterns (a Llama repo also holds the original .pth weights).
fn how_to_get(kind: &str, repo: &str, include: &[&str]) -> String {
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
    format!(
        "lockstep does not download. On a machine with Hub access run \
         `hf download{flag} {repo}{hf_include}` (older huggingface_hub: \
         `huggingface-cli download{flag} {repo}{old_include}`; gated repos need `hf auth login` \
         or HF_TOKEN there), then copy its ~/.cache/huggingface/hub/{folder} to {} here, or set \
         HF_HUB_CACHE to a directory holding {folder}",
        cache.join(&folder).display()
    )
}

/// A local model directory for `model.model_path`: the path itself when it exists, else the
/// cached snapshot of Hub repo `owner/name[@revision]` holding `config.json` and safetensors
/// weights (`model.safetensors`, or an index and every shard it names).
pub fn resolve_model(id: &str) -> Result<PathBuf> {
    if Path::new(id).exists() {
        return Ok(PathBuf::from(id));
    }
    let Some((owner, name, revision)) = parse_repo_id(id) else {
        bail!(
            "model.model_path = {id:?}: no such directory, and not a Hugging Face model id \
             (owner/name); point it at a directory with config.json and model.safetensors"
        );
    };
    let repo = format!("{owner}/{name}");
    let include = &["*.json", "*.safetensors"];
    let repo_dir = hub_cache_dir().join(repo_folder("model", Some(owner), name));
    let not_cached = |what: String| {
        anyhow!(
            "model.model_path = {id:?} is not a local directory, and the Hugging Face cache {what}. {}",
            how_to_get("model", &repo, include)
        )
    };
    if !repo_dir.is_dir() {
        return Err(not_cached(format!(
            "has no {} (looked in {})",
            repo_dir.file_name().unwrap_or_default().to_string_lossy(),
            hub_cache_dir().display()
        )));
    }
    let (dir, commit) = snapshot(&repo_dir, revision)
        .map_err(|e| not_cached(format!("has no usable copy ({e:#})")))?;
    let mut missing = Vec::new();
    if !dir.join("config.json").is_file() {
        missing.push("config.json".to_string());
    }
    let index = dir.join("model.safetensors.index.json");
    if index.is_file() {
        let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&index)?)
            .map_err(|e| anyhow!("{}: invalid JSON ({e})", index.display()))?;
        let mut shards: Vec<&str> = v["weight_map"]
            .as_object()
            .map(|m| m.values().filter_map(|s| s.as_str()).collect())
            .unwrap_or_default();
        shards.sort();
        shards.dedup();
        missing.extend(
            shards
                .into_iter()
                .filter(|s| !dir.join(s).is_file())
                .map(str::to_string),
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
        return Err(not_cached(format!(
            "copy of {repo} (snapshot {commit}) lacks {}",
            missing.join(", ")
        )));
    }
    Ok(dir)
}

/// `data.tokenizer` as [`super::Tokenizer::load`] takes it: built-in names and existing files
/// unchanged, a directory → its `tokenizer.json`, a Hub id `owner/name[@revision]` → the cached
/// snapshot's `tokenizer.json`. Anything else is returned unchanged for `load` to reject.
pub fn resolve_tokenizer(spec: &str) -> Result<String> {
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
            "data.tokenizer = {spec:?}: the directory has no tokenizer.json; point it at a \
             tokenizer.json or a directory holding one"
        );
    }
    let Some((owner, name, revision)) = parse_repo_id(spec) else {
        return Ok(spec.to_string());
    };
    let repo = format!("{owner}/{name}");
    let include = &["tokenizer*"];
    let repo_dir = hub_cache_dir().join(repo_folder("model", Some(owner), name));
    let found = if repo_dir.is_dir() {
        snapshot(&repo_dir, revision)
            .map(|(dir, commit)| (dir.join("tokenizer.json"), commit))
            .map_err(|e| anyhow!("has no usable copy ({e:#})"))
    } else {
        Err(anyhow!(
            "has no {} (looked in {})",
            repo_dir.file_name().unwrap_or_default().to_string_lossy(),
            hub_cache_dir().display()
        ))
    };
    match found {
        Ok((file, _)) if file.is_file() => Ok(file.to_string_lossy().into_owned()),
        Ok((_, commit)) => bail!(
            "data.tokenizer = {spec:?}: the Hugging Face cache copy of {repo} (snapshot {commit}) \
             has no tokenizer.json (lockstep needs the fast-tokenizer file, not only \
             tokenizer.model). {}",
            how_to_get("model", &repo, include)
        ),
        Err(e) => bail!(
            "data.tokenizer = {spec:?} is neither a built-in encoding ({}) nor a local file, and \
             the Hugging Face cache {e:#}. {}",
            BUILTIN_NAMES.join(", "),
            how_to_get("model", &repo, include)
        ),
    }
}

/// One cached dataset repo: its folder and the first path segments of `data.path` it matched.
struct DatasetRepo {
    dir: PathBuf,
    repo: String,
    used: usize,
}

/// The cached repos `parts` can name: `owner/name` (`datasets--owner--name`) or a canonical
/// dataset without owner (`datasets--name`), in every dataset root.
fn dataset_repos(parts: &[&str]) -> Vec<DatasetRepo> {
    let mut out = Vec::new();
    for root in dataset_roots() {
        if parts.len() >= 2 {
            let dir = root.join(repo_folder("dataset", Some(parts[0]), parts[1]));
            if dir.is_dir() {
                out.push(DatasetRepo {
                    dir,
                    repo: format!("{}/{}", parts[0], parts[1]),
                    used: 2,
                });
            }
        }
        let dir = root.join(repo_folder("dataset", None, parts[0]));
        if dir.is_dir() {
            out.push(DatasetRepo {
                dir,
                repo: parts[0].to_string(),
                used: 1,
            });
        }
    }
    out
}

/// Every cached dataset snapshot (any root) with a top-level directory `config`: how a bare
/// configuration name such as `wikitext-103-raw-v1` is found.
fn repos_with_config(config: &str) -> Vec<(DatasetRepo, PathBuf, String)> {
    let mut out = Vec::new();
    for root in dataset_roots() {
        let Ok(entries) = std::fs::read_dir(&root) else {
            continue;
        };
        let mut dirs: Vec<PathBuf> = entries.flatten().map(|e| e.path()).collect();
        dirs.sort();
        for dir in dirs {
            let Some(folder) = dir.file_name().and_then(|n| n.to_str()) else {
                continue;
            };
            let Some(repo) = folder.strip_prefix("datasets--") else {
                continue;
            };
            if let Ok((snap, commit)) = snapshot(&dir, None) {
                if snap.join(config).is_dir() {
                    let repo = repo.replacen("--", "/", 1);
                    out.push((DatasetRepo { dir, repo, used: 0 }, snap, commit));
                }
            }
        }
    }
    out
}

/// Data files of a cached Hub dataset named by `data.path`.
///
/// `owner/name` takes the whole snapshot, `owner/name/<dir>[/<dir>]` one directory of it (a
/// configuration such as `Salesforce/wikitext/wikitext-103-raw-v1`, or `sample/10BT`), and a
/// bare `name` is a canonical dataset (`datasets--name`) or a configuration directory found in
/// exactly one cached dataset. Within the chosen directory the `.parquet`/`.jsonl`/`.txt` files
/// of the `train` split are used (files whose name starts with `train` or that sit in a `train`
/// directory) when there are any, else all of them. A whole snapshot whose data sits in several
/// top-level directories (configurations) is an error listing them. `None` when no cached
/// dataset has that name (see [`dataset_not_cached`] for the message).
pub fn cached_dataset(name: &str) -> Result<Option<DatasetFiles>> {
    let parts: Vec<&str> = name.split('/').collect();
    let mut candidates: Vec<(DatasetRepo, PathBuf, String)> = Vec::new();
    let mut problems = Vec::new();
    for repo in dataset_repos(&parts) {
        match snapshot(&repo.dir, None) {
            Ok((snap, commit)) => candidates.push((repo, snap, commit)),
            Err(e) => problems.push(format!("{e:#}")),
        }
    }
    if candidates.is_empty() && parts.len() == 1 {
        candidates = repos_with_config(parts[0]);
        if candidates.len() > 1 {
            let repos: Vec<String> = candidates
                .iter()
                .map(|(r, _, _)| format!("{}/{}", r.repo, parts[0]))
                .collect();
            bail!(
                "data.path = {name:?}: several cached datasets have a configuration of that name; \
                 set data.path to one of: {}",
                repos.join(", ")
            );
        }
    }
    let Some((repo, snap, commit)) = candidates.into_iter().next() else {
        if !problems.is_empty() {
            bail!(
                "data.path = {name:?}: the cached dataset is unusable: {}",
                problems.join("; ")
            );
        }
        return Ok(None);
    };
    let sub: PathBuf = parts[repo.used..].iter().collect();
    let base = snap.join(&sub);
    let sub_id = if sub.as_os_str().is_empty() {
        String::new()
    } else {
        format!("/{}", sub.to_string_lossy().replace('\\', "/"))
    };
    let what = format!("{}@{commit}{sub_id}", repo.repo);
    if !base.exists() {
        bail!(
            "data.path = {name:?}: the cached dataset {} (snapshot {commit}) has no {}; its \
             top-level entries: [{}]",
            repo.repo,
            sub.display(),
            top_level(&snap).join(", ")
        );
    }
    let dangling = dangling_links(&base);
    if !dangling.is_empty() {
        bail!(
            "data.path = {name:?}: the cached dataset {what} is incomplete: {} file(s) have no \
             downloaded content (e.g. {}). {}",
            dangling.len(),
            dangling[0].display(),
            how_to_get("dataset", &repo.repo, &[])
        );
    }
    let all = list_files(&base).map_err(|e| {
        anyhow!(
            "data.path = {name:?}: the cached dataset {what} has no usable data files ({e:#}); \
             lockstep reads .parquet, .jsonl and .txt (a `datasets` library Arrow cache is not \
             read: export it with Dataset.to_parquet)"
        )
    })?;
    let rel = |f: &Path| f.strip_prefix(&base).unwrap_or(f).to_path_buf();
    let is_train = |f: &Path| {
        let r = rel(f);
        let stem_train = r
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with("train"));
        stem_train || r.components().any(|c| c.as_os_str() == "train")
    };
    let train: Vec<PathBuf> = all.iter().filter(|f| is_train(f)).cloned().collect();
    let files = if train.is_empty() { all } else { train };
    if sub.as_os_str().is_empty() {
        let mut tops: Vec<String> = files
            .iter()
            .filter_map(|f| {
                let r = rel(f);
                let mut c = r.components();
                let first = c.next()?;
                c.next()?; // a file directly in the snapshot is not in a configuration
                match first {
                    Component::Normal(s) => Some(s.to_string_lossy().into_owned()),
                    _ => None,
                }
            })
            .collect();
        tops.sort();
        tops.dedup();
        if tops.len() > 1 {
            let choices: Vec<String> = tops.iter().map(|t| format!("{name}/{t}")).collect();
            bail!(
                "data.path = {name:?}: the cached dataset {what} has data in several directories \
                 (configurations or subsets: {}); choose one, e.g. data.path={}",
                tops.join(", "),
                choices[0]
            );
        }
    }
    Ok(Some(DatasetFiles {
        root: snap.clone(),
        id: format!("hf-dataset:{what}"),
        files,
    }))
}

/// What to add to the file-not-found error of a `data.path` that could name a Hub dataset.
pub fn dataset_not_cached(name: &str) -> String {
    let parts: Vec<&str> = name.split('/').collect();
    let repo = if parts.len() >= 2 {
        format!("{}/{}", parts[0], parts[1])
    } else {
        name.to_string()
    };
    let looked: Vec<String> = dataset_roots()
        .iter()
        .map(|r| r.display().to_string())
        .collect();
    format!(
        "It is not a cached Hugging Face dataset either (looked in {}). {}",
        looked.join(" and "),
        how_to_get("dataset", &repo, &[])
    )
}

fn top_level(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| !n.starts_with('.'))
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

/// Links below `dir` whose blob is missing (an interrupted or partial download/copy).
fn dangling_links(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in entries.flatten() {
            let p = e.path();
            match std::fs::metadata(&p) {
                Ok(m) if m.is_dir() => stack.push(p),
                Ok(_) => {}
                Err(_) => out.push(p),
            }
        }
    }
    out.sort();
    out
}

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
