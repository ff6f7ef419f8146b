//! Fetching a model or tokenizer that is not cached, into the hub cache layout, with the
//! token never printed; and the offline switches that forbid it.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use hf_hub::api::sync::{Api, ApiBuilder, ApiError};
use hf_hub::api::Progress;
use hf_hub::{Cache, Repo, RepoType};

use super::{hf_home, how_to_get, hub_cache_dir, index_shards, parse_repo_id, repo_folder, INDEX};

/// The variable that turns downloads off, when set true: `HF_HUB_OFFLINE`, else (unset or empty)
/// `TRANSFORMERS_OFFLINE`, read as `huggingface_hub` reads them (1/ON/YES/TRUE).
pub(super) fn offline_var() -> Option<&'static str> {
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
pub(super) fn endpoint() -> String {
    std::env::var("HF_ENDPOINT")
        .ok()
        .map(|e| e.trim().trim_end_matches('/').to_string())
        .filter(|e| !e.is_empty())
        .unwrap_or_else(|| "https://huggingface.co".to_string())
}

/// The access token, found as `huggingface_hub` finds it: `$HF_TOKEN` (or the older
/// `$HUGGING_FACE_HUB_TOKEN`), else the file `$HF_TOKEN_PATH`, else `$HF_HOME/token` (where
/// `hf auth login` saves it).
pub(super) fn token() -> Option<String> {
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
pub(super) fn download_failed(label: &str, id: &str, e: anyhow::Error) -> anyhow::Error {
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
pub(super) struct RepoLock(std::fs::File);

impl RepoLock {
    pub(super) fn take(repo_dir: &Path, repo: &str) -> Result<RepoLock> {
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
pub(super) enum Fetch {
    NotFound,
    Failed(String),
}

/// Downloads of one model repo into the hub cache, through `hf-hub`'s sync client.
pub(super) struct Download {
    api: Api,
    repo: String,
    revision: String,
    pub(super) endpoint: String,
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
    pub(super) fn new(repo: &str, revision: Option<&str>) -> Result<Download> {
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
    pub(super) fn model(&mut self) -> Result<()> {
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
    pub(super) fn tokenizer(&mut self) -> Result<()> {
        let snap = self.first("tokenizer.json")?;
        if !snap.join("tokenizer_config.json").is_file() {
            self.get("tokenizer_config.json", false)?;
        }
        Ok(())
    }

    /// Fetches `file` at the revision asked for, learning the commit; every later file is
    /// fetched at that commit, so a branch moving meanwhile cannot mix two versions. The
    /// snapshot directory.
    pub(super) fn first(&mut self, file: &str) -> Result<PathBuf> {
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
    pub(super) fn get(&self, file: &str, required: bool) -> Result<bool> {
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
    pub(super) fn fetch(&self, revision: &str, file: &str) -> std::result::Result<PathBuf, Fetch> {
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
    pub(super) fn explain(&self, url: &str, e: ApiError) -> Fetch {
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
    pub(super) fn touch(&self) {
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
