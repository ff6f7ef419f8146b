//! Fetching a model or tokenizer that is not cached, into the hub cache layout
//! (`blobs/<etag>`, `snapshots/<commit>/<file>` linked to it, `refs/<revision>`), with the token
//! never printed and never sent off the endpoint's own origin; and the offline switches that
//! forbid downloads.
//!
//! The HTTP is written here on `ureq` rather than through the `hf-hub` crate: hf-hub 0.4 sends
//! `Authorization` to whatever host a `/resolve` redirect names (its size probe follows an
//! absolute `Location` with the token set), and a mirror that redirects to S3 or a CDN would
//! receive the user's token. `huggingface_hub` drops the header on a cross-host redirect; so
//! does [`Download::follow`].

use std::io::{IsTerminal, Read, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use url::Url;

use super::cache::{hf_home, how_to_get, hub_cache_dir, repo_folder};
use super::index::{index_shards, INDEX};
use super::repo_id::parse_repo_id;

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
        if crate::sys::flock(&file, libc::LOCK_EX | libc::LOCK_NB).is_err() {
            eprintln!(
                "[hub] waiting for another process downloading {repo} (lock {})",
                path.display()
            );
            // Blocks until the other holder is done.
            crate::sys::flock(&file, libc::LOCK_EX)
                .map_err(|e| anyhow!("cannot lock {}: {e}", path.display()))?;
        }
        Ok(RepoLock(file))
    }
}

impl Drop for RepoLock {
    fn drop(&mut self) {
        // Unlocks what `take` locked (closing the file would too).
        let _ = crate::sys::flock(&self.0, libc::LOCK_UN);
    }
}

/// One file's fetch failed because the server has no such file (404, not a missing repo or
/// revision), or for another reason (already worded, token-free).
pub(super) enum Fetch {
    NotFound,
    Failed(String),
}

/// Redirects followed for one request before giving up.
const MAX_REDIRECTS: usize = 10;
/// Attempts at one file's body when the connection drops mid-way (each resumes where the last
/// stopped).
const BODY_ATTEMPTS: usize = 4;

/// The two kinds of request a download makes, each with its own read limit.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Leg {
    /// Metadata: answers within `HF_HUB_ETAG_TIMEOUT`.
    Meta,
    /// File bodies: data at least every `HF_HUB_DOWNLOAD_TIMEOUT`.
    Body,
}

/// The variable whose limit a timed-out request hit: connecting is bounded by
/// HF_HUB_ETAG_TIMEOUT for both legs (as in `huggingface_hub`), reading by the leg's own.
fn timeout_var(leg: Leg, connecting: bool) -> &'static str {
    match (leg, connecting) {
        (Leg::Body, false) => "HF_HUB_DOWNLOAD_TIMEOUT",
        _ => "HF_HUB_ETAG_TIMEOUT",
    }
}

/// A leg's agents: through the environment's proxy, and direct (for hosts the proxy rule,
/// `sys::net`, exempts; a redirect may lead to another host).
struct Agents {
    proxied: ureq::Agent,
    direct: ureq::Agent,
}

/// Downloads of one model repo into the hub cache.
pub(super) struct Download {
    /// Metadata requests: no automatic redirects, answers within `HF_HUB_ETAG_TIMEOUT`.
    meta: Agents,
    /// Body requests: no automatic redirects, data at least every `HF_HUB_DOWNLOAD_TIMEOUT`.
    body: Agents,
    /// NO_PROXY's value.
    no_proxy: String,
    repo: String,
    revision: String,
    pub(super) endpoint: String,
    /// The endpoint's origin (scheme, host, port): the only place the token is sent.
    origin: url::Origin,
    token: Option<String>,
    etag_timeout: Duration,
    download_timeout: Duration,
    /// The commit `revision` resolved to, once the first file is in.
    commit: Option<String>,
    repo_dir: PathBuf,
}

/// What the Hub says about one file before its bytes are fetched.
struct Meta {
    commit: String,
    etag: String,
    size: u64,
    /// Where the bytes are: the Hub URL itself, or the CDN/S3 URL it redirected to.
    location: Url,
}

impl Download {
    pub(super) fn new(repo: &str, revision: Option<&str>) -> Result<Download> {
        let cache = std::path::absolute(hub_cache_dir())?;
        let endpoint = endpoint();
        let origin = Url::parse(&endpoint)
            .map_err(|e| anyhow!("HF_ENDPOINT = {endpoint:?} is not a URL ({e})"))?
            .origin();
        let etag_timeout = timeout_from("HF_HUB_ETAG_TIMEOUT");
        let download_timeout = timeout_from("HF_HUB_DOWNLOAD_TIMEOUT");
        let agent = |read: Duration, proxy: bool| {
            ureq::AgentBuilder::new()
                .try_proxy_from_env(proxy)
                .redirects(0)
                .timeout_connect(etag_timeout)
                .timeout_read(read)
                .user_agent(&format!("lockstep/{}", env!("CARGO_PKG_VERSION")))
                .build()
        };
        let agents = |read: Duration| Agents {
            proxied: agent(read, true),
            direct: agent(read, false),
        };
        let (owner, name) = repo.split_once('/').unwrap_or(("", repo));
        Ok(Download {
            meta: agents(etag_timeout),
            body: agents(download_timeout),
            no_proxy: crate::sys::net::no_proxy(),
            repo: repo.to_string(),
            revision: revision.unwrap_or("main").to_string(),
            endpoint,
            origin,
            token: token(),
            etag_timeout,
            download_timeout,
            commit: None,
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

    /// Fetches `file` at the revision asked for, learning the commit (and writing
    /// `refs/<revision>` when the revision is a branch or tag); every later file is fetched at
    /// that commit, so a branch moving meanwhile cannot mix two versions. The snapshot
    /// directory.
    pub(super) fn first(&mut self, file: &str) -> Result<PathBuf> {
        let (path, commit) = match self.fetch(&self.revision.clone(), file) {
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
        if commit != self.revision {
            let refs = self.repo_dir.join("refs");
            std::fs::create_dir_all(&refs)
                .with_context(|| format!("cannot create {}", refs.display()))?;
            crate::sys::durable::write_atomic(&refs.join(&self.revision), commit.as_bytes())?;
        }
        self.commit = Some(commit);
        Ok(path
            .parent()
            .context("a downloaded file outside its snapshot")?
            .to_path_buf())
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

    /// One file into the cache: its metadata from the Hub, its bytes into `blobs/<etag>`
    /// (through a `.incomplete` file, renamed when whole), and the link
    /// `snapshots/<commit>/<file>`. The file's path in the snapshot and the commit.
    fn fetch(&self, revision: &str, file: &str) -> std::result::Result<(PathBuf, String), Fetch> {
        let url = format!("{}/{}/resolve/{revision}/{file}", self.endpoint, self.repo);
        let start = Instant::now();
        let meta = self.metadata(&url)?;
        let io = |what: &str, p: &Path, e: std::io::Error| {
            Fetch::Failed(format!("{url}: cannot {what} {}: {e}", p.display()))
        };
        let blobs = self.repo_dir.join("blobs");
        std::fs::create_dir_all(&blobs).map_err(|e| io("create", &blobs, e))?;
        let blob = blobs.join(&meta.etag);
        let fetched = if blob.is_file() {
            0
        } else {
            let part = blobs.join(format!("{}.incomplete", meta.etag));
            let n = self.body(&url, &meta, &part, file)?;
            std::fs::rename(&part, &blob).map_err(|e| io("rename into", &blob, e))?;
            n
        };
        let link = self
            .repo_dir
            .join("snapshots")
            .join(&meta.commit)
            .join(file);
        let parent = link.parent().unwrap_or(&self.repo_dir);
        std::fs::create_dir_all(parent).map_err(|e| io("create", parent, e))?;
        // snapshots/<commit>/<file> -> ../../blobs/<etag>, one more `..` per folder in `file`.
        let depth = 2 + Path::new(file).components().count() - 1;
        let target = Path::new(&"../".repeat(depth))
            .join("blobs")
            .join(&meta.etag);
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(&target, &link).map_err(|e| io("link", &link, e))?;
        let rev = &revision[..revision.len().min(12)];
        eprintln!(
            "[hub] downloaded {}@{rev} {file} ({}, {:.1}s)",
            self.repo,
            human_bytes(fetched),
            start.elapsed().as_secs_f64()
        );
        Ok((link, meta.commit))
    }

    /// The commit, etag and size of the file at `url`, as `huggingface_hub` learns them: a
    /// one-byte ranged GET, redirects followed by [`Download::follow`]; the commit and etag come
    /// from the Hub's own answer (`x-repo-commit`, `x-linked-etag` or `etag`), the size from the
    /// final answer's `Content-Range`.
    fn metadata(&self, url: &str) -> std::result::Result<Meta, Fetch> {
        let hop = self.follow(Leg::Meta, url, "bytes=0-0")?;
        let missing = |h: &str| {
            Fetch::Failed(format!(
                "{url}: the answer has no {h} header; is {} a Hugging Face Hub endpoint?",
                self.endpoint
            ))
        };
        let commit = hop.commit.ok_or_else(|| missing("x-repo-commit"))?;
        let etag = hop.etag.ok_or_else(|| missing("etag"))?;
        let size = hop
            .response
            .header("content-range")
            .and_then(|r| r.rsplit('/').next())
            .and_then(|n| n.trim().parse::<u64>().ok())
            .ok_or_else(|| missing("content-range"))?;
        // The etag names a file under blobs/: nothing that could leave that folder.
        if etag.is_empty() || !etag.chars().all(|c| c.is_ascii_alphanumeric() || c == '-') {
            return Err(Fetch::Failed(format!(
                "{url}: the etag {etag:?} is not a hash; is {} a Hugging Face Hub endpoint?",
                self.endpoint
            )));
        }
        if commit.is_empty() || !commit.chars().all(|c| c.is_ascii_alphanumeric()) {
            return Err(Fetch::Failed(format!(
                "{url}: x-repo-commit {commit:?} is not a commit hash"
            )));
        }
        Ok(Meta {
            commit,
            etag,
            size,
            location: hop.url,
        })
    }

    /// The file's bytes from `meta.location` into `part`, resuming after a dropped connection
    /// (up to [`BODY_ATTEMPTS`]); a progress bar on a terminal for files over 1 MiB. Bytes
    /// received.
    fn body(
        &self,
        url: &str,
        meta: &Meta,
        part: &Path,
        file: &str,
    ) -> std::result::Result<u64, Fetch> {
        let fail = |e: std::io::Error| {
            Fetch::Failed(format!("{url}: cannot write {}: {e}", part.display()))
        };
        let mut out = std::fs::File::create(part).map_err(fail)?;
        let bar = (std::io::stderr().is_terminal() && meta.size > 1 << 20).then(|| {
            let bar = indicatif::ProgressBar::new(meta.size);
            if let Ok(style) = indicatif::ProgressStyle::with_template(
                "{msg} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} ({eta})",
            ) {
                bar.set_style(style);
            }
            bar.set_message(format!("{} {file}", self.repo));
            bar
        });
        let mut have = 0u64;
        let mut buf = vec![0u8; 1 << 20];
        let mut attempt = 0;
        while have < meta.size {
            attempt += 1;
            let range = format!("bytes={have}-");
            let hop = self.follow(Leg::Body, meta.location.as_str(), &range)?;
            let mut reader = hop.response.into_reader();
            let stalled = loop {
                match reader.read(&mut buf) {
                    Ok(0) => break None,
                    Ok(n) => {
                        out.write_all(&buf[..n]).map_err(fail)?;
                        have += n as u64;
                        if let Some(bar) = &bar {
                            bar.set_position(have);
                        }
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(e) => break Some(e),
                }
            };
            if have >= meta.size {
                break;
            }
            let why = match stalled {
                Some(e) if is_timeout(&e) => format!(
                    "{url}: no data for {:.0}s (set HF_HUB_DOWNLOAD_TIMEOUT to wait longer)",
                    self.download_timeout.as_secs_f64()
                ),
                Some(e) => format!("{url}: the connection failed after {have} bytes: {e}"),
                None => format!(
                    "{url}: the server closed the connection after {have} of {} bytes",
                    meta.size
                ),
            };
            if attempt >= BODY_ATTEMPTS {
                return Err(Fetch::Failed(scrub(&why, self.token.as_deref())));
            }
            std::thread::sleep(Duration::from_millis(300 << attempt));
        }
        if let Some(bar) = bar {
            bar.finish_and_clear();
        }
        if have != meta.size {
            return Err(Fetch::Failed(format!(
                "{url}: received {have} bytes, the server announced {}",
                meta.size
            )));
        }
        out.sync_all().map_err(fail)?;
        Ok(have)
    }

    /// True when a request to `url` may carry the token: the endpoint's own origin (scheme,
    /// host and port), which also rules out a downgrade from https to http. A mirror's
    /// redirect to S3 or a CDN (signed URLs) gets no token, as with `huggingface_hub`.
    fn may_authorize(&self, url: &Url) -> bool {
        url.origin() == self.origin
    }

    /// GET `url` with `range`, following up to [`MAX_REDIRECTS`] redirects by hand so that the
    /// token goes only where [`Download::may_authorize`] allows. The Hub's commit and etag are
    /// read from every answer on the endpoint's origin (they ride on the Hub's 302 when the
    /// bytes live elsewhere).
    fn follow(&self, leg: Leg, url: &str, range: &str) -> std::result::Result<Hop, Fetch> {
        let mut at =
            Url::parse(url).map_err(|e| Fetch::Failed(format!("{url}: not a valid URL ({e})")))?;
        let (mut commit, mut etag) = (None, None);
        for _ in 0..=MAX_REDIRECTS {
            let mut req = self.agent(leg, &at).get(at.as_str()).set("Range", range);
            if let Some(t) = self.token.as_deref().filter(|_| self.may_authorize(&at)) {
                req = req.set("Authorization", &format!("Bearer {t}"));
            }
            let response = req.call().map_err(|e| self.explain(at.as_str(), e, leg))?;
            if self.may_authorize(&at) {
                if let Some(c) = response.header("x-repo-commit") {
                    commit = Some(c.trim().to_string());
                }
                if let Some(e) = response
                    .header("x-linked-etag")
                    .or_else(|| response.header("etag"))
                {
                    etag = Some(e.trim().trim_start_matches("W/").replace('"', ""));
                }
            }
            if !(300..400).contains(&response.status()) {
                return Ok(Hop {
                    response,
                    url: at,
                    commit,
                    etag,
                });
            }
            let Some(next) = response.header("location").and_then(|l| at.join(l).ok()) else {
                return Err(Fetch::Failed(format!(
                    "{at}: HTTP {} without a usable Location header",
                    response.status()
                )));
            };
            at = next;
        }
        Err(Fetch::Failed(format!(
            "{url}: more than {MAX_REDIRECTS} redirects"
        )))
    }

    /// The agent of `leg` for a request to `url`: direct where the proxy rule exempts its host.
    fn agent(&self, leg: Leg, url: &Url) -> &ureq::Agent {
        let agents = match leg {
            Leg::Meta => &self.meta,
            Leg::Body => &self.body,
        };
        match crate::sys::net::proxied(url.host_str().unwrap_or(""), &self.no_proxy) {
            true => &agents.proxied,
            false => &agents.direct,
        }
    }

    /// A token-free description of a failed request.
    fn explain(&self, url: &str, e: ureq::Error, leg: Leg) -> Fetch {
        let text = match &e {
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
            ureq::Error::Transport(t) => {
                let timed_out = std::error::Error::source(t)
                    .and_then(|s| s.downcast_ref::<std::io::Error>())
                    .is_some_and(is_timeout);
                if timed_out {
                    let var = timeout_var(leg, t.kind() == ureq::ErrorKind::ConnectionFailed);
                    let limit = match var {
                        "HF_HUB_DOWNLOAD_TIMEOUT" => self.download_timeout,
                        _ => self.etag_timeout,
                    };
                    format!(
                        "{url}: no answer within {:.0}s (set {var} to wait longer)",
                        limit.as_secs_f64()
                    )
                } else {
                    // ureq words these as "<url>: <kind>: <detail>"; no request headers.
                    t.to_string()
                }
            }
        };
        Fetch::Failed(scrub(&text, self.token.as_deref()))
    }
}

/// One answer after the redirects, with the Hub's commit and etag seen on the way.
struct Hop {
    response: ureq::Response,
    url: Url,
    commit: Option<String>,
    etag: Option<String>,
}

fn is_timeout(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock
    )
}

fn human_bytes(n: u64) -> String {
    match n {
        n if n >= 1 << 30 => format!("{:.2} GiB", n as f64 / (1u64 << 30) as f64),
        n if n >= 1 << 20 => format!("{:.1} MiB", n as f64 / (1u64 << 20) as f64),
        n if n >= 1 << 10 => format!("{:.1} KiB", n as f64 / 1024.0),
        n => format!("{n} B"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Finding 26: with both limits equal, a body that stalled was said to need
    /// HF_HUB_ETAG_TIMEOUT (the limit was told apart by its value).
    #[test]
    fn a_timeout_names_the_variable_of_its_request_and_phase() {
        assert_eq!(timeout_var(Leg::Body, false), "HF_HUB_DOWNLOAD_TIMEOUT");
        assert_eq!(timeout_var(Leg::Body, true), "HF_HUB_ETAG_TIMEOUT");
        assert_eq!(timeout_var(Leg::Meta, false), "HF_HUB_ETAG_TIMEOUT");
    }
}
