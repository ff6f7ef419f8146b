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

use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Result};

use super::tokenizer::BUILTIN_NAMES;

mod cache;
mod datasets;
mod download;
mod index;
mod repo_id;

pub use cache::hub_cache_dir;
use cache::{how_to_get, repo_folder, snapshot};
pub use datasets::{cached_dataset, dataset_not_cached};
pub use download::hub_offline;
use download::{download_failed, endpoint, offline_var, Download, RepoLock};
use index::{index_shards, INDEX};
use repo_id::parse_repo_id;
pub use repo_id::{is_hub_model_id, looks_like_dataset_name};

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
