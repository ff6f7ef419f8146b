//! Datasets in the local caches (`datasets--owner--name` in the hub cache or `$HF_HOME/datasets`);
//! never downloaded.

use std::path::{Component, Path, PathBuf};

use anyhow::{anyhow, bail, Result};

use super::super::sources::files::{list_files, DatasetFiles};
use super::cache::{dataset_roots, how_to_get, repo_folder, snapshot};

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
             downloaded content (e.g. {}). lockstep does not download datasets. {}",
            dangling.len(),
            dangling[0].display(),
            how_to_get("dataset", &repo.repo, None, &[])
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

/// What to add to the missing-path error of a `data.path` that could also name a Hub dataset.
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
        "If {name:?} is meant as a Hugging Face dataset: it is not in the local cache either \
         (looked in {}), and lockstep does not download datasets. {}",
        looked.join(" and "),
        how_to_get("dataset", &repo, None, &[])
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
