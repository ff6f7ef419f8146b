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
//! A model or tokenizer missing from the cache is downloaded into that same layout (the `hf-hub`
//! crate, from `$HF_ENDPOINT`, default `https://huggingface.co`, with the token of `$HF_TOKEN` or
//! the `hf auth login` token file), unless `HF_HUB_OFFLINE` is set: then what is missing is named
//! in the error, with the command that fetches it on a machine with Hub access (`hf download …`)
//! and where to copy the result. The token is never printed. Datasets are never downloaded.

use std::io::IsTerminal;
use std::path::{Component, Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use hf_hub::api::sync::{Api, ApiBuilder, ApiError};
use hf_hub::api::Progress;
use hf_hub::{Cache, Repo, RepoType};

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

/// The variable that turns downloads off, when set true: `HF_HUB_OFFLINE`, else (unset or empty)
/// `TRANSFORMERS_OFFLINE`, read as `huggingface_hub` reads them (1/ON/YES/TRUE).
fn offline_var() -> Option<&'static str> {
    let set = |k: &'static str| {
        std::env::var(k)
            .ok()
            .filter(|v| !v.is_empty())
            .map(|v| (k, v))
    };
    let (k, v) = set("HF_HUB_OFFLINE").or_else(|| set("TRANSFORMERS_OFFLINE"))?;
    ["1", "ON", "YES", "TRUE"]
        .contains(&v.trim().to_ascii_uppercase().as_str())
        .then_some(k)
}

/// True when downloads are off (`HF_HUB_OFFLINE=1`): a model or tokenizer missing from the
/// cache is then an error saying how to get it.
pub fn hub_offline() -> bool {
    offline_var().is_some()
}

/// `$HF_ENDPOINT` without a trailing `/`, default `https://huggingface.co`.
fn endpoint() -> String {
    std::env::var("HF_ENDPOINT")
        .ok()
        .map(|e| e.trim().trim_end_matches('/').to_string())
        .filter(|e| !e.is_empty())
        .unwrap_or_else(|| "https://huggingface.co".to_string())
}

/// The access token, found as `huggingface_hub` finds it: `$HF_TOKEN` (or the older
/// `$HUGGING_FACE_HUB_TOKEN`), else the file `$HF_TOKEN_PATH`, else `$HF_HOME/token` (where
/// `hf auth login` saves it).
fn token() -> Option<String> {
    let clean = |t: String| Some(t.trim().to_string()).filter(|t| !t.is_empty());
    for var in ["HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"] {
        if let Some(t) = std::env::var(var).ok().and_then(clean) {
            return Some(t);
        }
    }
    let file = std::env::var_os("HF_TOKEN_PATH")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| hf_home().join("token"));
    std::fs::read_to_string(file).ok().and_then(clean)
}

/// Seconds from `$var` (as `huggingface_hub`'s `HF_HUB_ETAG_TIMEOUT` / `HF_HUB_DOWNLOAD_TIMEOUT`),
/// default 10.
fn timeout_from(var: &str) -> Duration {
    std::env::var(var)
        .ok()
        .and_then(|v| v.trim().parse::<f64>().ok())
        .filter(|s| s.is_finite() && *s > 0.0)
        .map_or(Duration::from_secs(10), Duration::from_secs_f64)
}

/// `text` with every occurrence of the token replaced: what leaves this module never holds it.
fn scrub(text: &str, token: Option<&str>) -> String {
    match token {
        Some(t) if !t.is_empty() => text.replace(t, "<HF_TOKEN>"),
        _ => text.to_string(),
    }
}

/// The error for a download that failed: the id, the endpoint, the cause, and how to go offline.
fn download_failed(label: &str, id: &str, e: anyhow::Error) -> anyhow::Error {
    let (owner, name, revision) = parse_repo_id(id).unwrap_or(("", "", None));
    let repo = format!("{owner}/{name}");
    let include: &[&str] = if label.contains("tokenizer") {
        &["tokenizer*"]
    } else {
        &["*.json", "*.safetensors"]
    };
    // The cause was scrubbed where it was made; once more in case a layer added text.
    let cause = scrub(&format!("{e:#}"), token().as_deref());
    let not_local = if label.contains("tokenizer") {
        "neither a built-in encoding nor a local file"
    } else {
        "not a local directory"
    };
    anyhow!(
        "{label} = {id:?} is {not_local}, and not in the Hugging Face cache ({}); downloading it \
         from {} failed: {cause}. Without Hub access from here, set HF_HUB_OFFLINE=1 and bring \
         the files yourself. {}",
        hub_cache_dir().display(),
        endpoint(),
        how_to_get("model", &repo, revision, include)
    )
}

/// An exclusive lock per repo (`<cache>/.locks/models--owner--name/lockstep.lock`), so that
/// ranks or runs starting together download once: the others wait, then find the files cached.
struct RepoLock(std::fs::File);

impl RepoLock {
    fn take(repo_dir: &Path, repo: &str) -> Result<RepoLock> {
        use std::os::fd::AsRawFd;
        let cache = repo_dir.parent().unwrap_or(Path::new("."));
        let folder = repo_dir.file_name().unwrap_or_default();
        let dir = cache.join(".locks").join(folder);
        std::fs::create_dir_all(&dir)
            .with_context(|| format!("cannot create {} for downloads", dir.display()))?;
        let path = dir.join("lockstep.lock");
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .with_context(|| format!("cannot open {}", path.display()))?;
        let fd = file.as_raw_fd();
        // SAFETY: flock on a descriptor this function owns.
        if unsafe { libc::flock(fd, libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            eprintln!(
                "[hub] waiting for another process downloading {repo} (lock {})",
                path.display()
            );
            // SAFETY: as above; blocks until the other holder is done.
            if unsafe { libc::flock(fd, libc::LOCK_EX) } != 0 {
                bail!(
                    "cannot lock {}: {}",
                    path.display(),
                    std::io::Error::last_os_error()
                );
            }
        }
        Ok(RepoLock(file))
    }
}

impl Drop for RepoLock {
    fn drop(&mut self) {
        use std::os::fd::AsRawFd;
        // SAFETY: unlocks the descriptor locked in `take`.
        unsafe { libc::flock(self.0.as_raw_fd(), libc::LOCK_UN) };
    }
}

/// One file's fetch failed because the server has no such file (404, not a missing repo or
/// revision), or for another reason (already worded, token-free).
enum Fetch {
    NotFound,
    Failed(String),
}

/// Downloads of one model repo into the hub cache, through `hf-hub`'s sync client.
struct Download {
    api: Api,
    repo: String,
    revision: String,
    endpoint: String,
    token: Option<String>,
    etag_timeout: Duration,
    download_timeout: Duration,
    /// The commit `revision` resolved to, once the first file is in.
    commit: Option<String>,
    /// `refs/<commit>` that hf-hub writes when files are fetched by commit and that
    /// `huggingface_hub` would not write: removed when done.
    stray_ref: Option<PathBuf>,
    repo_dir: PathBuf,
}

impl Download {
    fn new(repo: &str, revision: Option<&str>) -> Result<Download> {
        let cache = std::path::absolute(hub_cache_dir())?;
        let endpoint = endpoint();
        let token = token();
        let api = ApiBuilder::from_cache(Cache::new(cache.clone()))
            .with_endpoint(endpoint.clone())
            .with_token(token.clone())
            .with_progress(false)
            .with_retries(3)
            .with_user_agent("lockstep", env!("CARGO_PKG_VERSION"))
            .build()
            .map_err(|e| anyhow!("{}", scrub(&e.to_string(), token.as_deref())))?;
        let (owner, name) = repo.split_once('/').unwrap_or(("", repo));
        Ok(Download {
            api,
            repo: repo.to_string(),
            revision: revision.unwrap_or("main").to_string(),
            endpoint,
            token,
            etag_timeout: timeout_from("HF_HUB_ETAG_TIMEOUT"),
            download_timeout: timeout_from("HF_HUB_DOWNLOAD_TIMEOUT"),
            commit: None,
            stray_ref: None,
            repo_dir: cache.join(repo_folder("model", Some(owner), name)),
        })
    }

    /// config.json, then the safetensors index and its shards (else model.safetensors), then
    /// the tokenizer and generation files the repo has.
    fn model(&mut self) -> Result<()> {
        let snap = self.first("config.json")?;
        let mut files: Vec<(String, bool)> = Vec::new();
        let index = snap.join(INDEX);
        let have_index = index.is_file() || self.get(INDEX, false)?;
        if have_index {
            let shards = index_shards(&index)?;
            if shards.is_empty() {
                bail!("{}: the weight_map names no shard files", index.display());
            }
            files.extend(shards.into_iter().map(|s| (s, true)));
        } else {
            files.push(("model.safetensors".to_string(), true));
        }
        for f in [
            "tokenizer.json",
            "tokenizer_config.json",
            "generation_config.json",
        ] {
            files.push((f.to_string(), false));
        }
        for (f, required) in files {
            if !snap.join(&f).is_file() {
                self.get(&f, required)?;
            }
        }
        Ok(())
    }

    /// tokenizer.json, then tokenizer_config.json when the repo has one.
    fn tokenizer(&mut self) -> Result<()> {
        let snap = self.first("tokenizer.json")?;
        if !snap.join("tokenizer_config.json").is_file() {
            self.get("tokenizer_config.json", false)?;
        }
        Ok(())
    }

    /// Fetches `file` at the revision asked for, learning the commit; every later file is
    /// fetched at that commit, so a branch moving meanwhile cannot mix two versions. The
    /// snapshot directory.
    fn first(&mut self, file: &str) -> Result<PathBuf> {
        let rev_ref = self.repo_dir.join("refs").join(&self.revision);
        let had_rev_ref = rev_ref.is_file();
        let path = match self.fetch(&self.revision.clone(), file) {
            Ok(p) => p,
            Err(Fetch::NotFound) => bail!(
                "{} has no {file} at revision {}{}",
                self.repo,
                self.revision,
                if file == "tokenizer.json" {
                    " (lockstep needs the fast-tokenizer file, not only tokenizer.model)"
                } else {
                    ""
                }
            ),
            Err(Fetch::Failed(why)) => bail!("{why}"),
        };
        let snap = path
            .parent()
            .context("hf-hub returned a path outside a snapshot")?
            .to_path_buf();
        let commit = snap
            .file_name()
            .unwrap_or_default()
            .to_string_lossy()
            .into_owned();
        let commit_ref = self.repo_dir.join("refs").join(&commit);
        let had = if commit == self.revision {
            had_rev_ref
        } else {
            commit_ref.is_file()
        };
        if !had {
            self.stray_ref = Some(commit_ref);
        }
        self.commit = Some(commit);
        Ok(snap)
    }

    /// Fetches `file` at the resolved commit: true when downloaded, false when the repo has no
    /// such file and it is optional.
    fn get(&self, file: &str, required: bool) -> Result<bool> {
        let commit = self.commit.clone().context("no commit resolved yet")?;
        match self.fetch(&commit, file) {
            Ok(_) => Ok(true),
            Err(Fetch::NotFound) if !required => Ok(false),
            Err(Fetch::NotFound) if file == "model.safetensors" => bail!(
                "{} has no model.safetensors or {INDEX} at revision {} (commit {commit}); \
                 lockstep reads safetensors weights, not PyTorch .bin files",
                self.repo,
                self.revision
            ),
            Err(Fetch::NotFound) => bail!(
                "{} has no {file} at revision {} (commit {commit})",
                self.repo,
                self.revision
            ),
            Err(Fetch::Failed(why)) => bail!("{why}"),
        }
    }

    /// One file into the cache, on a worker thread watched for stalls: no answer within
    /// `HF_HUB_ETAG_TIMEOUT`, or no data for `HF_HUB_DOWNLOAD_TIMEOUT`, fails (the thread is left
    /// blocked; the error ends the command). `hf-hub` has no timeouts of its own.
    fn fetch(&self, revision: &str, file: &str) -> std::result::Result<PathBuf, Fetch> {
        let url = format!("{}/{}/resolve/{revision}/{file}", self.endpoint, self.repo);
        let start = Instant::now();
        let meter = Meter {
            start,
            last_ms: Arc::new(AtomicU64::new(0)),
            body: Arc::new(AtomicBool::new(false)),
            bytes: Arc::new(AtomicU64::new(0)),
            bar: None,
            name: format!("{} {file}", self.repo),
        };
        let (last_ms, body, bytes) = (
            meter.last_ms.clone(),
            meter.body.clone(),
            meter.bytes.clone(),
        );
        let repo = Repo::with_revision(self.repo.clone(), RepoType::Model, revision.to_string());
        let api = self.api.clone();
        let name = file.to_string();
        let (tx, rx) = mpsc::channel();
        let spawned = std::thread::Builder::new()
            .name("hub-download".into())
            .spawn(move || {
                let _ = tx.send(api.repo(repo).download_with_progress(&name, meter));
            });
        if let Err(e) = spawned {
            return Err(Fetch::Failed(format!(
                "cannot start a download thread: {e}"
            )));
        }
        let result = loop {
            match rx.recv_timeout(Duration::from_millis(50)) {
                Ok(r) => break r,
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    let idle = start
                        .elapsed()
                        .saturating_sub(Duration::from_millis(last_ms.load(Ordering::Relaxed)));
                    let (limit, var, what) = if body.load(Ordering::Relaxed) {
                        (
                            self.download_timeout,
                            "HF_HUB_DOWNLOAD_TIMEOUT",
                            "no data for",
                        )
                    } else {
                        (self.etag_timeout, "HF_HUB_ETAG_TIMEOUT", "no answer within")
                    };
                    if idle > limit {
                        return Err(Fetch::Failed(format!(
                            "{url}: {what} {:.0}s (set {var} to wait longer)",
                            limit.as_secs_f64()
                        )));
                    }
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    return Err(Fetch::Failed(format!("{url}: the download thread failed")))
                }
            }
        };
        match result {
            Ok(path) => {
                let n = bytes.load(Ordering::Relaxed);
                let rev = &revision[..revision.len().min(12)];
                eprintln!(
                    "[hub] downloaded {}@{rev} {file} ({}, {:.1}s)",
                    self.repo,
                    human_bytes(n),
                    start.elapsed().as_secs_f64()
                );
                Ok(path)
            }
            Err(e) => Err(self.explain(&url, e)),
        }
    }

    /// A token-free description of an hf-hub error.
    fn explain(&self, url: &str, e: ApiError) -> Fetch {
        let text = match &e {
            ApiError::RequestError(err) => match err.as_ref() {
                ureq::Error::Status(code, resp) => {
                    let code_name = resp.header("x-error-code").unwrap_or("");
                    if *code == 404 && !matches!(code_name, "RepoNotFound" | "RevisionNotFound") {
                        return Fetch::NotFound;
                    }
                    let msg = resp
                        .header("x-error-message")
                        .map(|m| format!(" ({m})"))
                        .unwrap_or_default();
                    let hint = match *code {
                        401 => {
                            if self.token.is_some() {
                                "; the repo does not exist, or the token has no access to it"
                            } else {
                                "; the repo does not exist, or it is private or gated and needs \
                                 a token: set HF_TOKEN (or run `hf auth login`)"
                            }
                        }
                        403 => {
                            "; access denied: for a gated repo, accept its terms on the Hub with \
                             the account of the token"
                        }
                        404 if code_name == "RevisionNotFound" => "; no such revision",
                        404 => "; no such repo",
                        _ => "",
                    };
                    format!("{url}: HTTP {code}{msg}{hint}")
                }
                // ureq words these as "<url>: <kind>: <detail>"; no request headers.
                ureq::Error::Transport(t) => t.to_string(),
            },
            ApiError::MissingHeader(h) => format!(
                "{url}: the answer has no {h} header; is {} a Hugging Face Hub endpoint?",
                self.endpoint
            ),
            other => format!("{url}: {other}"),
        };
        Fetch::Failed(scrub(&text, self.token.as_deref()))
    }
}

impl Drop for Download {
    fn drop(&mut self) {
        if let Some(stray) = self.stray_ref.take() {
            let _ = std::fs::remove_file(stray);
        }
    }
}

fn human_bytes(n: u64) -> String {
    match n {
        n if n >= 1 << 30 => format!("{:.2} GiB", n as f64 / (1u64 << 30) as f64),
        n if n >= 1 << 20 => format!("{:.1} MiB", n as f64 / (1u64 << 20) as f64),
        n if n >= 1 << 10 => format!("{:.1} KiB", n as f64 / 1024.0),
        n => format!("{n} B"),
    }
}

/// hf-hub's progress callbacks: mark activity for the stall watch, count bytes, and draw a bar
/// on a terminal.
struct Meter {
    start: Instant,
    last_ms: Arc<AtomicU64>,
    body: Arc<AtomicBool>,
    bytes: Arc<AtomicU64>,
    bar: Option<indicatif::ProgressBar>,
    name: String,
}

impl Meter {
    fn touch(&self) {
        let ms = self.start.elapsed().as_millis() as u64;
        self.last_ms.store(ms, Ordering::Relaxed);
    }
}

impl Progress for Meter {
    fn init(&mut self, size: usize, _filename: &str) {
        self.touch();
        self.body.store(true, Ordering::Relaxed);
        if self.bar.is_none() && std::io::stderr().is_terminal() && size > 1 << 20 {
            let bar = indicatif::ProgressBar::new(size as u64);
            if let Ok(style) = indicatif::ProgressStyle::with_template(
                "{msg} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} ({eta})",
            ) {
                bar.set_style(style);
            }
            bar.set_message(self.name.clone());
            self.bar = Some(bar);
        }
    }

    fn update(&mut self, size: usize) {
        self.touch();
        let total = self.bytes.fetch_add(size as u64, Ordering::Relaxed) + size as u64;
        if let Some(bar) = &self.bar {
            bar.set_position(total);
        }
    }

    fn finish(&mut self) {
        self.touch();
        if let Some(bar) = self.bar.take() {
            bar.finish_and_clear();
        }
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
        "It is not a cached Hugging Face dataset either (looked in {}). lockstep does not \
         download datasets. {}",
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
