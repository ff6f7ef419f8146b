//! Raw text documents: which files make up a dataset and how each one is
//! split into documents.
//!
//! A dataset is a corpus compiled into the binary (`builtin:shakespeare`, see
//! [`super::builtin`]), a `.txt`/`.jsonl`/`.parquet` file, a directory walked
//! for them, a glob pattern (`data/*.parquet`), or the name of a Hugging Face
//! dataset in the local hub cache (see [`super::hub`]).
//!
//! How `data.path` is read, in order: `builtin:<name>` is the built-in corpus;
//! an existing file or directory is local; a pattern with `*`, `?` or `[` is a
//! glob; a name shaped like a Hub dataset id (`owner/name[/config]` or a bare
//! name, no data-file extension) that the hub cache holds is that dataset.
//! Anything else is a missing local path, reported with the absolute path it
//! was looked for at; when it is also shaped like a Hub id and its first
//! component is not a local directory, the message says where the hub cache
//! was searched too (it may have been meant as either).

use std::fs::{self, File};
use std::io::{BufRead, BufReader, Seek, SeekFrom};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::time::UNIX_EPOCH;

use anyhow::{anyhow, bail, Context, Result};
use serde::Serialize;
use serde_json::{json, Value};

use super::builtin::{self, BuiltinFile};

/// File extensions read as text sources.
pub const TEXT_EXTENSIONS: &[&str] = &["txt", "jsonl", "parquet"];

/// Documents read from a Parquet column per call into the parquet decoder.
const PARQUET_BATCH: usize = 1024;
/// A document larger than this (a `.txt` file, a `.jsonl` line) is read and handed on in pieces
/// of about this size, so one huge document is never held whole.
const PIECE: usize = if cfg!(test) { 1 << 16 } else { 16 << 20 };

fn has_text_extension(path: &Path) -> bool {
    path.extension()
        .and_then(|e| e.to_str())
        .is_some_and(|e| TEXT_EXTENSIONS.contains(&e))
}

fn is_hidden(path: &Path) -> bool {
    path.file_name()
        .and_then(|n| n.to_str())
        .is_some_and(|n| n.starts_with('.'))
}

/// The text files of a dataset: `path` itself if it is a file, otherwise every
/// `.txt`/`.jsonl`/`.parquet` file below it, recursively, skipping hidden
/// entries, sorted by path so the document order is the same on every machine.
pub fn list_files(path: &Path) -> Result<Vec<PathBuf>> {
    let meta = fs::metadata(path).map_err(|e| {
        anyhow!(
            "{}: cannot read the dataset ({e}); check `data.path` in the config",
            path.display()
        )
    })?;
    if !meta.is_file() && !meta.is_dir() {
        bail!(
            "{}: {}, not a file or a directory; lockstep reads data files more than once (to \
             split off the validation data, to tokenize in parallel), so copy the data into a \
             file and point data.path at it",
            path.display(),
            special_kind(&meta)
        );
    }
    if meta.is_file() {
        if !has_text_extension(path) {
            bail!(
                "{}: unsupported dataset file; accepted text files end in .{}, token files in \
                 .tok or .bin",
                path.display(),
                TEXT_EXTENSIONS.join(" or .")
            );
        }
        return Ok(vec![path.to_path_buf()]);
    }
    let mut files = Vec::new();
    walk(path, &mut files)?;
    files.sort();
    if files.is_empty() {
        bail!(
            "{}: no dataset files found (looked recursively for .{}, hidden files skipped); \
             check `data.path`",
            path.display(),
            TEXT_EXTENSIONS.join(" and .")
        );
    }
    Ok(files)
}

fn walk(dir: &Path, files: &mut Vec<PathBuf>) -> Result<()> {
    let entries =
        fs::read_dir(dir).with_context(|| format!("{}: cannot list directory", dir.display()))?;
    for entry in entries {
        let path = entry
            .with_context(|| format!("{}: cannot list directory", dir.display()))?
            .path();
        if is_hidden(&path) {
            continue;
        }
        // fs::metadata follows symlinks, so linked-in corpora are included; an entry that
        // cannot be read is an error, never a part of the corpus skipped without a word.
        let meta = match fs::metadata(&path) {
            Ok(meta) => meta,
            Err(e) => match fs::read_link(&path) {
                Ok(target) => bail!(
                    "{}: a symbolic link to {}, which {}; part of the corpus would be missing. \
                     Fix or remove the link (or point data.path elsewhere)",
                    path.display(),
                    target.display(),
                    match e.kind() {
                        std::io::ErrorKind::NotFound => "does not exist".to_string(),
                        _ => format!("cannot be read ({e})"),
                    }
                ),
                Err(_) => bail!(
                    "{}: cannot read it ({e}); part of the corpus would be missing. Fix its \
                     permissions or remove it",
                    path.display()
                ),
            },
        };
        if meta.is_dir() {
            walk(&path, files)?;
        } else if has_text_extension(&path) {
            if !meta.is_file() {
                bail!(
                    "{}: {}, not a data file; lockstep reads data files more than once, so \
                     replace it with a regular file or remove it",
                    path.display(),
                    special_kind(&meta)
                );
            }
            files.push(path);
        }
    }
    Ok(())
}

/// What a path that is neither a regular file nor a directory is, for messages.
fn special_kind(meta: &fs::Metadata) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    let t = meta.file_type();
    if t.is_fifo() {
        "a FIFO (named pipe)"
    } else if t.is_socket() {
        "a socket"
    } else if t.is_block_device() || t.is_char_device() {
        "a device"
    } else {
        "not a regular file"
    }
}

/// The files of a dataset and what identifies it in the cache key.
#[derive(Debug, Clone)]
pub struct DatasetFiles {
    /// The data files, canonical paths, in reading order.
    pub files: Vec<PathBuf>,
    /// The directory file fingerprints are taken relative to.
    pub root: PathBuf,
    /// What `data.path` named: the canonical path, the glob pattern with its
    /// fixed part canonical, or `hf-dataset:<repo>@<revision>[/<subdir>]`.
    pub id: String,
}

/// What `data.path` names, resolved (see the module docs for the rule).
#[derive(Debug, Clone)]
pub enum Dataset {
    /// Files on disk: a file, a directory, a glob pattern or a cached Hub dataset.
    Files(DatasetFiles),
    /// A corpus compiled into the binary, decompressed.
    Builtin {
        /// `builtin:<name>`.
        id: String,
        /// Its files in reading order, each one document.
        files: Vec<BuiltinFile>,
    },
}

/// Resolves `data.path`: a built-in corpus (`builtin:<name>`), else [`dataset_files`].
pub fn resolve_dataset(path: &Path) -> Result<Dataset> {
    if let Some(found) = path.to_str().and_then(builtin::lookup) {
        let corpus = found?;
        return Ok(Dataset::Builtin {
            id: corpus.id(),
            files: corpus.files()?,
        });
    }
    dataset_files(path).map(Dataset::Files)
}

impl Dataset {
    /// The dataset's identity in the cache key: what `data.path` resolved to, and per file its
    /// relative path with size and mtime (files on disk) or size and BLAKE3 of the content (a
    /// built-in corpus, whose files have no mtime; a rebuilt binary with other text is another
    /// dataset).
    pub fn fingerprint(&self) -> Result<(String, Value)> {
        Ok(match self {
            Dataset::Files(d) => (
                d.id.clone(),
                serde_json::to_value(dataset_fingerprint(&d.root, &d.files)?)?,
            ),
            Dataset::Builtin { id, files } => {
                let files: Vec<Value> = files
                    .iter()
                    .map(|f| {
                        json!({
                            "path": f.name,
                            "size": f.bytes.len(),
                            "blake3": blake3::hash(&f.bytes).to_hex().as_str(),
                        })
                    })
                    .collect();
                (id.clone(), Value::Array(files))
            }
        })
    }

    /// Input bytes, for the progress bar.
    pub fn total_bytes(&self) -> u64 {
        match self {
            Dataset::Files(d) => d
                .files
                .iter()
                .map(|f| fs::metadata(f).map(|m| m.len()).unwrap_or(0))
                .sum(),
            Dataset::Builtin { files, .. } => files.iter().map(|f| f.bytes.len() as u64).sum(),
        }
    }

    /// Part `index` of `count` of the dataset, as a range of its bytes (its files end to end,
    /// in reading order): equal shares of [`Dataset::total_bytes`]. Every document starts in
    /// exactly one part, so the parts' documents in order are the dataset's.
    pub fn part_bytes(&self, index: u64, count: u64) -> Range<u64> {
        let total = u128::from(self.total_bytes());
        let at = |i: u64| (total * u128::from(i) / u128::from(count)) as u64;
        let end = if index + 1 == count {
            u64::MAX
        } else {
            at(index + 1)
        };
        at(index)..end
    }

    /// Calls `f(text, ends_document)` with every document of the dataset that starts inside
    /// `bytes` (a range of the dataset's bytes, its files end to end: see
    /// [`Dataset::part_bytes`]; `0..u64::MAX` for all), in order (see [`read_documents`]; a
    /// built-in corpus's files are `.txt` files). A large `.txt` file's one document comes in
    /// pieces, all but the last with `ends_document` false. An error from `f` ends the walk.
    pub fn for_each_document(
        &self,
        text_field: &str,
        bytes: Range<u64>,
        mut f: impl FnMut(String, bool) -> Result<()>,
    ) -> Result<()> {
        let mut base = 0u64;
        // This file's share of `bytes`, in its own offsets, if documents may start there.
        let local = |base: u64, len: u64| -> Option<Range<u64>> {
            let start = bytes.start.saturating_sub(base);
            let end = bytes.end.saturating_sub(base).min(len.max(1));
            (start < end).then_some(start..end)
        };
        match self {
            Dataset::Files(d) => {
                for file in &d.files {
                    let len = fs::metadata(file).map(|m| m.len()).unwrap_or(0);
                    if let Some(range) = local(base, len) {
                        read_documents_in(file, text_field, range, &mut f)?;
                    }
                    base += len;
                }
            }
            Dataset::Builtin { id, files } => {
                for file in files {
                    let len = file.bytes.len() as u64;
                    if local(base, len).is_some_and(|r| r.start == 0) {
                        let what = format!("{id}/{}", file.name);
                        f(txt_document(file.bytes.clone(), &what)?, true)?;
                    }
                    base += len;
                }
            }
        }
        Ok(())
    }
}

/// Resolves a `data.path` on disk to its files: an existing file or directory (see
/// [`list_files`]), a glob pattern, or a Hugging Face dataset name found in the local hub cache
/// ([`super::hub::cached_dataset`]); anything else is a missing path (see the module docs).
pub fn dataset_files(path: &Path) -> Result<DatasetFiles> {
    // Any other failure (permissions) is reported by list_files with the OS error.
    let not_found =
        matches!(fs::metadata(path), Err(e) if e.kind() == std::io::ErrorKind::NotFound);
    if not_found {
        let text = path.to_string_lossy();
        if is_glob(&text) {
            return glob_files(&text);
        }
        let hub_like = super::hub::looks_like_dataset_name(&text);
        if hub_like {
            if let Some(cached) = super::hub::cached_dataset(&text)? {
                return Ok(cached);
            }
        }
        return Err(missing_path(path, hub_like));
    }
    let files = list_files(path)?;
    let canonical = path
        .canonicalize()
        .with_context(|| format!("{}: cannot resolve the dataset path", path.display()))?;
    let root = if canonical.is_dir() {
        canonical.clone()
    } else {
        canonical
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_default()
    };
    Ok(DatasetFiles {
        files: files
            .iter()
            .map(|f| f.canonicalize().unwrap_or_else(|_| f.clone()))
            .collect(),
        root,
        id: canonical.display().to_string(),
    })
}

/// The error for a `data.path` that is nothing on disk and no cached Hub dataset: the absolute
/// path it was looked for at, the working directory a relative one is taken from, what
/// `data.path` accepts, and, for a name that could also be a Hub dataset id (`hub_like`) whose
/// first component is not a local directory, where the hub cache was searched.
fn missing_path(path: &Path, hub_like: bool) -> anyhow::Error {
    let text = path.to_string_lossy();
    let absolute = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
    let mut msg = format!(
        "data.path = {text:?}: no such file or directory: {}",
        absolute.display()
    );
    if path.is_relative() {
        match std::env::current_dir() {
            Ok(cwd) => {
                msg += &format!(
                    " (a relative data.path is taken from the working directory, {})",
                    cwd.display()
                )
            }
            Err(e) => msg += &format!(" (the working directory cannot be read: {e})"),
        }
    }
    msg += &format!(
        ". Point data.path at an existing .{} file, a directory of them, a glob pattern or a \
         token file (.tok, .bin), or use the corpus built into lockstep: {}",
        TEXT_EXTENSIONS.join("/."),
        builtin::names().join(", ")
    );
    let first_is_local_dir = path
        .components()
        .next()
        .is_some_and(|c| Path::new(c.as_os_str()).is_dir());
    if hub_like && !first_is_local_dir {
        msg += &format!(". {}", super::hub::dataset_not_cached(&text));
    }
    anyhow!(msg)
}

fn is_glob(path: &str) -> bool {
    path.contains(['*', '?', '['])
}

/// Every data file a glob pattern matches (directories it matches are walked),
/// sorted and deduplicated; other files are ignored.
fn glob_files(pattern: &str) -> Result<DatasetFiles> {
    let options = glob::MatchOptions {
        case_sensitive: true,
        require_literal_separator: true,
        require_literal_leading_dot: true,
    };
    let matches = glob::glob_with(pattern, options)
        .map_err(|e| anyhow!("data.path = {pattern:?}: not a valid glob pattern ({e})"))?;
    let mut files = Vec::new();
    for entry in matches {
        let path = entry.map_err(|e| anyhow!("data.path = {pattern:?}: {e}"))?;
        if path.is_dir() {
            walk(&path, &mut files)?;
        } else if path.is_file() && has_text_extension(&path) {
            files.push(path);
        }
    }
    if files.is_empty() {
        bail!(
            "data.path = {pattern:?}: the pattern matches no .{} files (relative patterns are \
             taken from the working directory); check `data.path`",
            TEXT_EXTENSIONS.join(", .")
        );
    }
    let mut files: Vec<PathBuf> = files
        .iter()
        .map(|f| f.canonicalize().unwrap_or_else(|_| f.clone()))
        .collect();
    files.sort();
    files.dedup();
    // The part before the first component with a wildcard: fingerprints are
    // relative to it, and it is the canonical part of the id.
    let fixed: PathBuf = Path::new(pattern)
        .components()
        .take_while(|c| !is_glob(&c.as_os_str().to_string_lossy()))
        .collect();
    let fixed = if fixed.as_os_str().is_empty() {
        PathBuf::from(".")
    } else {
        fixed
    };
    let root = fixed
        .canonicalize()
        .with_context(|| format!("{}: cannot resolve the dataset path", fixed.display()))?;
    let rest = Path::new(pattern)
        .strip_prefix(&fixed)
        .unwrap_or(Path::new(pattern));
    Ok(DatasetFiles {
        id: format!("glob:{}", root.join(rest).display()),
        files,
        root,
    })
}

/// Calls `f` with every document of `file`, in order.
///
/// A `.txt` file is one document (a leading UTF-8 BOM is dropped). A `.jsonl`
/// file holds one JSON object per line whose `text_field` string is the
/// document; blank lines are skipped. A `.parquet` file holds one document
/// per row in its `text_field` string column; null values are skipped.
pub fn read_documents(
    file: &Path,
    text_field: &str,
    mut f: impl FnMut(String) -> Result<()>,
) -> Result<()> {
    let mut doc = String::new();
    read_documents_in(file, text_field, 0..u64::MAX, |text, ends| {
        doc.push_str(&text);
        if ends {
            f(std::mem::take(&mut doc))?;
        }
        Ok(())
    })
}

/// Like [`read_documents`], only the documents that start inside `bytes` (offsets in the
/// file: a `.txt` file's one document starts at 0, a `.jsonl` line where it starts, a
/// `.parquet` row group's documents where its text column chunk starts), as
/// `f(text, ends_document)`: a `.txt` file or a `.jsonl` line larger than [`PIECE`] comes in
/// pieces.
pub fn read_documents_in(
    file: &Path,
    text_field: &str,
    bytes: Range<u64>,
    mut f: impl FnMut(String, bool) -> Result<()>,
) -> Result<()> {
    let ext = file.extension().and_then(|e| e.to_str()).unwrap_or("");
    match ext {
        "txt" if bytes.start > 0 => Ok(()),
        "txt" => read_txt(file, f),
        "jsonl" => read_jsonl(file, text_field, bytes, f),
        "parquet" => read_parquet(file, text_field, bytes, |d| f(d, true)),
        _ => bail!(
            "{}: unsupported extension; text sources must end in .{}",
            file.display(),
            TEXT_EXTENSIONS.join(" or .")
        ),
    }
}

/// A `.txt` file's one document, in pieces of about [`PIECE`] bytes cut at character
/// boundaries (one piece for a smaller file), the last with `ends_document`.
fn read_txt(file: &Path, mut f: impl FnMut(String, bool) -> Result<()>) -> Result<()> {
    use std::io::Read;
    let what = file.display().to_string();
    let mut handle = File::open(file).with_context(|| format!("{what}: cannot open"))?;
    let len = handle.metadata().map(|m| m.len()).unwrap_or(0);
    if len <= PIECE as u64 {
        let mut bytes = Vec::new();
        handle
            .read_to_end(&mut bytes)
            .with_context(|| format!("{what}: cannot read"))?;
        return f(txt_document(bytes, &what)?, true);
    }
    let mut offset = 0u64;
    let read_error = |e: std::io::Error| anyhow!(e).context(format!("{what}: cannot read"));
    read_pieces(&mut handle, read_error, |bytes, last| {
        let n = bytes.len() as u64;
        let text = txt_piece(bytes, &what, offset)?;
        offset += n;
        f(text, last)
    })
}

/// Reads `r` to its end in pieces of at most [`PIECE`] bytes that end on whole characters
/// (one the next bytes may complete is held back for the next piece): `f(piece, last)`, the
/// last piece possibly empty. A read error goes through `read_error`; invalid UTF-8 is left
/// to `f` to report.
fn read_pieces<R: std::io::Read>(
    r: &mut R,
    read_error: impl Fn(std::io::Error) -> anyhow::Error,
    mut f: impl FnMut(Vec<u8>, bool) -> Result<()>,
) -> Result<()> {
    let mut carry = Vec::new();
    loop {
        let mut buf = carry;
        let have = buf.len();
        buf.resize(PIECE, 0);
        let n = read_full(r, &mut buf[have..]).map_err(&read_error)?;
        buf.truncate(have + n);
        // `read_full` stops short only at the end.
        let last = buf.len() < PIECE;
        carry = if last {
            Vec::new()
        } else {
            split_incomplete_char(&mut buf)
        };
        f(buf, last)?;
        if last {
            return Ok(());
        }
    }
}

/// Splits off the end of `buf` a character the next bytes may complete (its first 1 to 3
/// bytes), returned for the next piece; invalid UTF-8 elsewhere is left for the caller's
/// check to report.
fn split_incomplete_char(buf: &mut Vec<u8>) -> Vec<u8> {
    let keep = match std::str::from_utf8(buf) {
        Err(e) if e.error_len().is_none() => e.valid_up_to(),
        _ => buf.len(),
    };
    buf.split_off(keep)
}

/// Reads until `buf` is full or the file ends; the bytes read.
fn read_full(r: &mut impl std::io::Read, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match r.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

/// A `.txt` file's bytes (`what` names it in errors) as its one document: UTF-8, a leading
/// byte-order mark dropped.
pub fn txt_document(bytes: Vec<u8>, what: &str) -> Result<String> {
    txt_piece(bytes, what, 0)
}

/// The bytes of a `.txt` file (named `what`) from byte `offset` on as text, without the
/// byte-order mark a file may start with.
fn txt_piece(bytes: Vec<u8>, what: &str, offset: u64) -> Result<String> {
    let text = String::from_utf8(bytes).map_err(|e| {
        let head = (offset == 0).then_some(e.as_bytes());
        not_utf8(what, offset + e.utf8_error().valid_up_to() as u64, head)
    })?;
    Ok(match text.strip_prefix('\u{feff}') {
        Some(rest) if offset == 0 => rest.to_string(),
        _ => text,
    })
}

/// Text that is not UTF-8 at byte `at` of `what`; `head` is the file's first bytes when they
/// are at hand, so a UTF-16 or UTF-32 file (named by its byte-order mark) gets the conversion
/// that fits it rather than a guess.
fn not_utf8(what: &str, at: u64, head: Option<&[u8]>) -> anyhow::Error {
    let marked = head.and_then(|h| {
        [
            (&[0xFF, 0xFE, 0, 0][..], "UTF-32", "little"),
            (&[0, 0, 0xFE, 0xFF][..], "UTF-32", "big"),
            (&[0xFF, 0xFE][..], "UTF-16", "little"),
            (&[0xFE, 0xFF][..], "UTF-16", "big"),
        ]
        .into_iter()
        .find(|(mark, ..)| h.starts_with(mark))
    });
    match marked {
        Some((_, enc, endian)) => anyhow!(
            "{what}: {enc} text ({endian}-endian: it starts with that byte-order mark), not \
             UTF-8; convert it with `iconv -f {enc} -t UTF-8 FILE > FILE.utf8` and use the new \
             file"
        ),
        None => anyhow!(
            "{what}: invalid UTF-8 at byte offset {at}; convert the file to UTF-8 (e.g. \
             `iconv -f latin1 -t utf-8` if it is Latin-1; `file FILE` tells its encoding)"
        ),
    }
}

fn read_jsonl(
    file: &Path,
    text_field: &str,
    bytes: Range<u64>,
    mut f: impl FnMut(String, bool) -> Result<()>,
) -> Result<()> {
    let p = file.display();
    let mut handle = File::open(file).with_context(|| format!("{p}: cannot open"))?;
    // A line belongs to the range its first byte is in: from inside the file, skip to the
    // start of the first line that begins at or after `bytes.start`.
    let mut offset = bytes.start.saturating_sub(1);
    handle
        .seek(SeekFrom::Start(offset))
        .with_context(|| format!("{p}: cannot seek to byte {offset}"))?;
    let mut reader = BufReader::with_capacity(1 << 20, handle);
    let mut line = Vec::new();
    if bytes.start > 0 {
        offset +=
            skip_line(&mut reader).with_context(|| format!("{p}: read error at byte {offset}"))?;
    }
    // Line numbers are counted from the start of the file only when reading from there;
    // otherwise errors name the byte offset of the line.
    let from_start = bytes.start == 0;
    let mut line_no = 0u64;
    loop {
        if offset >= bytes.end {
            return Ok(());
        }
        line.clear();
        let (n, whole) = read_line_upto(&mut reader, &mut line, PIECE)
            .with_context(|| format!("{p}: read error after line {line_no}"))?;
        if n == 0 {
            return Ok(());
        }
        line_no += 1;
        let start = offset;
        let p = || {
            if from_start {
                format!("{p}:{line_no}")
            } else {
                format!("{p}: line at byte {start}")
            }
        };
        if !whole {
            offset += read_long_line(&mut reader, &line, text_field, &p(), &mut f)?;
            continue;
        }
        let text = std::str::from_utf8(&line).map_err(|e| {
            let head = (start == 0).then_some(line.as_slice());
            not_utf8(&p(), offset + e.valid_up_to() as u64, head)
        })?;
        offset += n as u64;
        if text.trim().is_empty() {
            continue;
        }
        let value: serde_json::Value =
            serde_json::from_str(text).map_err(|e| line_error::not_json(&p(), e))?;
        let serde_json::Value::Object(mut obj) = value else {
            return Err(line_error::not_an_object(
                &p(),
                text_field,
                json_type(&value),
            ));
        };
        match obj.remove(text_field) {
            Some(serde_json::Value::String(s)) => f(s, true)?,
            other => {
                let keys: Vec<&str> = obj.keys().map(String::as_str).collect();
                let found = other.as_ref().map(json_type);
                return Err(line_error::no_text(&p(), text_field, found, &keys));
            }
        }
    }
}

/// The errors of a `.jsonl` line (named `at`), parsed whole or as it is read.
mod line_error {
    use anyhow::anyhow;

    pub fn not_json(at: &str, why: impl std::fmt::Display) -> anyhow::Error {
        anyhow!("{at}: not valid JSON ({why}); each line of a .jsonl file must be one JSON object")
    }

    /// The line is a JSON value of type `found`, not an object.
    pub fn not_an_object(at: &str, text_field: &str, found: &str) -> anyhow::Error {
        let article = if found.starts_with(['a', 'o']) {
            "an"
        } else {
            "a"
        };
        anyhow!(
            "{at}: expected a JSON object with a \"{text_field}\" string field, found {article} \
             {found}"
        )
    }

    /// The object has no `text_field` (`found` None) or one of type `found`; `keys` are its
    /// other keys.
    pub fn no_text(
        at: &str,
        text_field: &str,
        found: Option<&str>,
        keys: &[impl AsRef<str>],
    ) -> anyhow::Error {
        let problem = match found {
            None => "has no".to_string(),
            Some(t) => format!("has a non-string ({t})"),
        };
        let keys: Vec<&str> = keys.iter().map(AsRef::as_ref).collect();
        anyhow!(
            "{at}: line {problem} field \"{text_field}\" (its other keys: [{}]); set \
             `data.text_field` to the key holding the text",
            keys.join(", ")
        )
    }
}

/// Reads `r` into `line` up to and including the next `\n`, or `limit` bytes if the line is
/// longer: the bytes read and whether the line is whole (its `\n` or the end of the file read).
fn read_line_upto(
    r: &mut impl BufRead,
    line: &mut Vec<u8>,
    limit: usize,
) -> std::io::Result<(usize, bool)> {
    let mut n = 0;
    loop {
        let buf = match r.fill_buf() {
            Ok(buf) => buf,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if buf.is_empty() {
            return Ok((n, true));
        }
        let room = limit.saturating_sub(line.len());
        if let Some(i) = memchr::memchr(b'\n', &buf[..buf.len().min(room)]) {
            line.extend_from_slice(&buf[..=i]);
            r.consume(i + 1);
            return Ok((n + i + 1, true));
        }
        let k = buf.len().min(room);
        line.extend_from_slice(&buf[..k]);
        r.consume(k);
        n += k;
        if line.len() >= limit {
            return Ok((n, false));
        }
    }
}

/// Skips `r` past the next `\n` (or to the end): the bytes skipped.
fn skip_line(r: &mut impl BufRead) -> std::io::Result<u64> {
    let mut rest = LineRest {
        r,
        read: 0,
        done: false,
    };
    std::io::copy(&mut rest, &mut std::io::sink())?;
    Ok(rest.read)
}

/// The rest of the line `r` is in, as a reader: its bytes up to the next `\n` (consumed with
/// the line, not returned) or the end of the file.
struct LineRest<'a, R> {
    r: &'a mut R,
    /// Bytes consumed from `r`, the `\n` included.
    read: u64,
    done: bool,
}

impl<R: BufRead> std::io::Read for LineRest<'_, R> {
    fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
        if self.done || out.is_empty() {
            return Ok(0);
        }
        let buf = self.r.fill_buf()?;
        let (k, used) = match memchr::memchr(b'\n', buf) {
            Some(i) if i <= out.len() => {
                self.done = true;
                (i, i + 1)
            }
            _ => {
                let k = buf.len().min(out.len());
                self.done = k == 0;
                (k, k)
            }
        };
        out[..k].copy_from_slice(&buf[..k]);
        self.r.consume(used);
        self.read += used as u64;
        Ok(k)
    }
}

/// One `.jsonl` line too long to hold whole: `head`, its first bytes, then the rest of the line
/// in `r`. The line is parsed as it is read (`struson`'s streaming reader): its `text_field`
/// string goes to `f(text, ends_document)` in pieces of about [`PIECE`] bytes, every other
/// value is checked and skipped. `at` names the line in errors. The bytes read from `r`.
///
/// Unlike a line parsed whole, where the last of repeated keys wins, a repeated `text_field`
/// is refused: its first value has been handed on already.
fn read_long_line(
    r: &mut impl BufRead,
    head: &[u8],
    text_field: &str,
    at: &str,
    f: &mut impl FnMut(String, bool) -> Result<()>,
) -> Result<u64> {
    use std::io::Read;
    use struson::reader::{
        JsonReader, JsonStreamReader, JsonSyntaxError, ReaderError, ReaderSettings, ValueType,
    };
    // struson's errors, found inside the string reader's io::Error too, with the position in
    // the line.
    fn describe(e: &(dyn std::error::Error + 'static)) -> String {
        let at = |what: String, pos: Option<u64>| match pos {
            Some(pos) => format!("{what} at byte {pos} of the line"),
            None => what,
        };
        if let Some(e) = e.downcast_ref::<JsonSyntaxError>() {
            return at(e.kind.to_string(), e.location.data_pos);
        }
        match e.downcast_ref::<ReaderError>() {
            Some(ReaderError::SyntaxError(e)) => describe(e),
            Some(ReaderError::IoError { error, location }) => match error.get_ref() {
                Some(inner) => describe(inner),
                None => at(error.to_string(), location.data_pos),
            },
            _ => match e.downcast_ref::<std::io::Error>().and_then(|e| e.get_ref()) {
                Some(inner) => describe(inner),
                None => e.to_string(),
            },
        }
    }
    let bad = |e: &(dyn std::error::Error + 'static)| {
        let what = describe(e);
        if what.contains("invalid UTF-8") {
            anyhow!("{at}: {what}; convert the file to UTF-8")
        } else {
            line_error::not_json(at, what)
        }
    };
    let kind = |t: ValueType| match t {
        ValueType::Array => "array",
        ValueType::Object => "object",
        ValueType::String => "string",
        ValueType::Number => "number",
        ValueType::Boolean => "boolean",
        ValueType::Null => "null",
    };
    let mut rest = LineRest {
        r,
        read: 0,
        done: false,
    };
    let settings = ReaderSettings {
        track_path: false,
        ..Default::default()
    };
    let mut json = JsonStreamReader::new_custom(head.chain(&mut rest), settings);
    match json.peek().map_err(|e| bad(&e))? {
        ValueType::Object => {}
        other => return Err(line_error::not_an_object(at, text_field, kind(other))),
    }
    json.begin_object().map_err(|e| bad(&e))?;
    // The other keys (for the error naming them) and the text's last piece, or the type of
    // a text field that is not a string.
    let mut keys: Vec<String> = Vec::new();
    let mut text: Option<std::result::Result<String, &str>> = None;
    while json.has_next().map_err(|e| bad(&e))? {
        let name = json.next_name_owned().map_err(|e| bad(&e))?;
        if name != text_field {
            keys.push(name);
            json.skip_value().map_err(|e| bad(&e))?;
            continue;
        }
        if text.is_some() {
            bail!(
                "{at}: the field \"{text_field}\" appears twice in this line, which is parsed as \
                 it is read (longer than {PIECE} bytes); keep one"
            );
        }
        let t = json.peek().map_err(|e| bad(&e))?;
        if t != ValueType::String {
            text = Some(Err(kind(t)));
            json.skip_value().map_err(|e| bad(&e))?;
            continue;
        }
        let mut reader = json.next_string_reader().map_err(|e| bad(&e))?;
        // The string reader's bytes are valid UTF-8: its pieces are whole characters. The
        // last is handed on once the rest of the line has been checked.
        let mut last_piece = String::new();
        read_pieces(
            &mut reader,
            |e| bad(&e),
            |piece, last| {
                let piece = String::from_utf8(piece).expect("struson checks UTF-8");
                if last {
                    last_piece = piece;
                    return Ok(());
                }
                f(piece, false)
            },
        )?;
        text = Some(Ok(last_piece));
    }
    json.end_object().map_err(|e| bad(&e))?;
    json.consume_trailing_whitespace().map_err(|e| bad(&e))?;
    match text {
        Some(Ok(last)) => f(last, true)?,
        Some(Err(t)) => return Err(line_error::no_text(at, text_field, Some(t), &keys)),
        None => return Err(line_error::no_text(at, text_field, None, &keys)),
    }
    Ok(head.len() as u64 + rest.read)
}

/// Streams the `text_field` column of a Parquet file, row group by row group,
/// in batches of [`PARQUET_BATCH`] values (never the whole file in memory).
fn read_parquet(
    file: &Path,
    text_field: &str,
    bytes: Range<u64>,
    mut f: impl FnMut(String) -> Result<()>,
) -> Result<()> {
    use parquet::basic::Type as Physical;
    use parquet::column::reader::ColumnReader;
    use parquet::file::reader::{FileReader, SerializedFileReader};

    let p = file.display();
    let handle = File::open(file).with_context(|| format!("{p}: cannot open"))?;
    let reader = SerializedFileReader::new(handle)
        .map_err(|e| anyhow!("{p}: not a readable Parquet file ({e})"))?;
    let schema = reader.metadata().file_metadata().schema_descr_ptr();
    let Some(column) = schema
        .columns()
        .iter()
        .position(|c| c.path().parts().join(".") == text_field)
    else {
        let names: Vec<String> = schema
            .root_schema()
            .get_fields()
            .iter()
            .map(|t| t.name().to_string())
            .collect();
        bail!(
            "{p}: no column \"{text_field}\" (its columns: [{}]); set `data.text_field` to the \
             column holding the text",
            names.join(", ")
        );
    };
    let descr = schema.column(column);
    if descr.physical_type() != Physical::BYTE_ARRAY || descr.max_rep_level() > 0 {
        let what = if descr.max_rep_level() > 0 {
            "a list".to_string()
        } else {
            format!("of type {}", descr.physical_type())
        };
        bail!(
            "{p}: column \"{text_field}\" is {what}, not a string column; set \
             `data.text_field` to the column holding the text"
        );
    }
    let nullable = descr.max_def_level() > 0;
    let mut values = Vec::with_capacity(PARQUET_BATCH);
    let mut defs = Vec::with_capacity(PARQUET_BATCH);
    let mut row = 0u64;
    for group in 0..reader.num_row_groups() {
        let meta = reader.metadata().row_group(group);
        if !bytes.contains(&meta.column(column).byte_range().0) {
            row += meta.num_rows() as u64;
            continue;
        }
        let rg = reader
            .get_row_group(group)
            .map_err(|e| anyhow!("{p}: row group {group}: {e}"))?;
        let ColumnReader::ByteArrayColumnReader(mut col) = rg
            .get_column_reader(column)
            .map_err(|e| parquet_error(file, group, e))?
        else {
            bail!("{p}: column \"{text_field}\" is not a byte-array column");
        };
        loop {
            values.clear();
            defs.clear();
            let (records, _, _) = col
                .read_records(
                    PARQUET_BATCH,
                    nullable.then_some(&mut defs),
                    None,
                    &mut values,
                )
                .map_err(|e| parquet_error(file, group, e))?;
            if records == 0 {
                break;
            }
            for v in values.drain(..) {
                row += 1;
                let text = String::from_utf8(v.data().to_vec()).map_err(|e| {
                    anyhow!(
                        "{p}: column \"{text_field}\" holds invalid UTF-8 (value {row} of the column, \
                         byte offset {}); it must be a UTF-8 string column",
                        e.utf8_error().valid_up_to()
                    )
                })?;
                f(text)?;
            }
        }
    }
    Ok(())
}

/// A decoding error; a codec left out of this build gets the list of those it has.
fn parquet_error(file: &Path, group: usize, e: parquet::errors::ParquetError) -> anyhow::Error {
    let p = file.display();
    let text = e.to_string();
    match text.split_once("Disabled feature at compile time: ") {
        Some((_, codec)) => anyhow!(
            "{p}: row group {group} is compressed with {codec}, which lockstep does not read \
             (it reads snappy, zstd, lz4, gzip and uncompressed Parquet); rewrite the file with \
             another codec, e.g. pyarrow.parquet.write_table(table, path, compression=\"zstd\")"
        ),
        None => anyhow!("{p}: cannot decode row group {group} ({text})"),
    }
}

fn json_type(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "boolean",
        serde_json::Value::Number(_) => "number",
        serde_json::Value::String(_) => "string",
        serde_json::Value::Array(_) => "array",
        serde_json::Value::Object(_) => "object",
    }
}

/// Identity of one input file for the cache key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct FileFingerprint {
    /// Path relative to the dataset root, `/`-separated.
    pub path: String,
    /// Size in bytes.
    pub size: u64,
    /// Modification time in nanoseconds since the Unix epoch (negative
    /// before it). Serialized as a string because JSON numbers lose i128.
    #[serde(serialize_with = "as_string")]
    pub mtime_ns: i128,
}

fn as_string<S: serde::Serializer>(v: &i128, s: S) -> std::result::Result<S::Ok, S::Error> {
    s.serialize_str(&v.to_string())
}

/// (relative path, size, mtime) of each file. Paths are relative to `root`
/// (the dataset directory, or the file's parent when the dataset is a single
/// file) so moving a dataset keeps only its canonical root in the key.
pub fn dataset_fingerprint(root: &Path, files: &[PathBuf]) -> Result<Vec<FileFingerprint>> {
    files
        .iter()
        .map(|file| {
            let meta = fs::metadata(file)
                .with_context(|| format!("{}: cannot read file metadata", file.display()))?;
            let mtime = meta
                .modified()
                .with_context(|| format!("{}: no modification time", file.display()))?;
            let mtime_ns = match mtime.duration_since(UNIX_EPOCH) {
                Ok(d) => d.as_nanos() as i128,
                Err(e) => -(e.duration().as_nanos() as i128),
            };
            let rel = file.strip_prefix(root).unwrap_or(file);
            let path = rel
                .components()
                .map(|c| c.as_os_str().to_string_lossy())
                .collect::<Vec<_>>()
                .join("/");
            Ok(FileFingerprint {
                path,
                size: meta.len(),
                mtime_ns,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn collect(file: &Path, field: &str) -> Result<Vec<String>> {
        let mut docs = Vec::new();
        read_documents(file, field, |d| {
            docs.push(d);
            Ok(())
        })?;
        Ok(docs)
    }

    #[test]
    fn lists_recursively_sorted_and_filtered() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        fs::create_dir_all(d.join("b/sub")).unwrap();
        fs::create_dir_all(d.join(".git")).unwrap();
        for f in [
            "z.txt",
            "a.jsonl",
            "b/sub/c.txt",
            "b/x.md",
            ".hidden.txt",
            ".git/y.txt",
        ] {
            fs::write(d.join(f), "x").unwrap();
        }
        let got = list_files(d).unwrap();
        let rel: Vec<_> = got.iter().map(|p| p.strip_prefix(d).unwrap()).collect();
        assert_eq!(
            rel,
            [
                Path::new("a.jsonl"),
                Path::new("b/sub/c.txt"),
                Path::new("z.txt")
            ]
        );
        assert_eq!(list_files(&d.join("z.txt")).unwrap(), vec![d.join("z.txt")]);
    }

    #[test]
    fn list_errors_are_helpful() {
        let dir = tempfile::tempdir().unwrap();
        let err = list_files(dir.path()).unwrap_err().to_string();
        assert!(
            err.contains("no dataset files") && err.contains(".txt"),
            "{err}"
        );
        let missing = dir.path().join("nope");
        let err = list_files(&missing).unwrap_err().to_string();
        assert!(err.contains("nope") && err.contains("data.path"), "{err}");
        fs::write(dir.path().join("x.csv"), "a").unwrap();
        let err = list_files(&dir.path().join("x.csv"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("unsupported"), "{err}");
    }

    #[test]
    fn missing_paths_and_builtin_names() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("nope/corpus");
        let err = dataset_files(&missing).unwrap_err().to_string();
        let shown = missing.display().to_string();
        assert!(
            err.starts_with(&format!(
                "data.path = {shown:?}: no such file or directory: {shown}. Point data.path at"
            )),
            "{err}"
        );
        // Absolute, so neither the working directory nor a Hub id is relevant.
        assert!(!err.contains("working directory") && !err.contains("Hugging Face"));
        assert!(err.contains("builtin:shakespeare"), "{err}");

        let err = resolve_dataset(Path::new("builtin:nope")).unwrap_err();
        assert!(err.to_string().contains("no built-in corpus"), "{err}");
        match resolve_dataset(Path::new("builtin:shakespeare")).unwrap() {
            Dataset::Builtin { id, files } => {
                assert_eq!((id.as_str(), files.len()), ("builtin:shakespeare", 42));
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn txt_is_one_document_and_bad_utf8_is_located() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.txt");
        fs::write(&path, "\u{feff}line one\nline two\n").unwrap();
        assert_eq!(
            collect(&path, "text").unwrap(),
            vec!["line one\nline two\n"]
        );
        fs::write(&path, b"caf\xe9 au lait").unwrap();
        let err = collect(&path, "text").unwrap_err().to_string();
        assert!(
            err.contains("byte offset 3") && err.contains("a.txt"),
            "{err}"
        );
        // A file read in pieces: the mark dropped once, a bad byte found by its offset in the
        // file, past the first piece.
        let mut big = "\u{feff}".to_string() + &"é中😀a".repeat(PIECE / 4);
        assert!(big.len() > 2 * PIECE);
        fs::write(&path, &big).unwrap();
        assert_eq!(collect(&path, "text").unwrap().concat(), big[3..]);
        let bad_at = big.len() - 5;
        big.truncate(bad_at);
        let mut bytes = big.into_bytes();
        bytes.extend_from_slice(b"\xff tail");
        fs::write(&path, bytes).unwrap();
        let err = collect(&path, "text").unwrap_err().to_string();
        assert!(err.contains(&format!("byte offset {bad_at};")), "{err}");
    }

    #[test]
    fn jsonl_documents_and_errors() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("d.jsonl");
        fs::write(
            &path,
            "{\"body\": \"first\", \"id\": 1}\n\n  \n{\"body\": \"sec\\nond\"}\n",
        )
        .unwrap();
        assert_eq!(collect(&path, "body").unwrap(), vec!["first", "sec\nond"]);

        let err = collect(&path, "text").unwrap_err().to_string();
        assert!(
            err.contains("d.jsonl:1") && err.contains("\"text\""),
            "{err}"
        );
        assert!(err.contains("[body, id]"), "{err}");

        fs::write(&path, "{\"text\": \"ok\"}\n{\"text\": 5}\n").unwrap();
        let err = collect(&path, "text").unwrap_err().to_string();
        assert!(err.contains("d.jsonl:2") && err.contains("number"), "{err}");

        fs::write(&path, "{\"text\": \"ok\"}\nnot json\n").unwrap();
        let err = collect(&path, "text").unwrap_err().to_string();
        assert!(
            err.contains("d.jsonl:2") && err.contains("not valid JSON"),
            "{err}"
        );
    }

    /// A `.jsonl` line longer than [`PIECE`] (64 KiB in tests) is parsed as it is read and its
    /// text handed on in pieces: the same documents as a line parsed whole, the same errors.
    #[test]
    fn long_jsonl_lines_stream_in_pieces() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("d.jsonl");
        // ~400 KB of text: escapes, a surrogate pair, raw 2/3/4-byte characters at every
        // alignment against the piece edges.
        let mut body = String::new();
        let mut k = 0usize;
        while body.len() < 400_000 {
            body.push_str(
                [
                    "ab",
                    "é",
                    "中",
                    "😀",
                    "\\n",
                    "\\\"",
                    "\\\\",
                    "\\u00e9",
                    "\\ud83d\\ude00",
                    " ",
                ][k % 10],
            );
            if k.is_multiple_of(7) {
                body.push('a');
            }
            k += 1;
        }
        let other = r#""meta": {"a": [1, -2.5e3, true, null, "x\"y", {"b": []}], "c": "\u00e9"}"#;
        let lines = [
            r#"{"text": "short one", "id": 1}"#.to_string(),
            format!(r#"{{{other}, "text": "{body}", "n": 7}}"#),
            format!(r#"  {{"text": "{body}{body}"}}  "#),
            r#"{"text": "after"}"#.to_string(),
        ];
        fs::write(&path, lines.join("\n") + "\r\n").unwrap();
        let expected: Vec<String> = lines
            .iter()
            .map(|l| {
                let v: serde_json::Value = serde_json::from_str(l).unwrap();
                v["text"].as_str().unwrap().to_string()
            })
            .collect();
        assert!(expected[1].len() > 3 * PIECE);
        assert!(["é", "中", "😀", "\n", "\"", "\\"]
            .iter()
            .all(|c| expected[1].contains(c)));
        assert_eq!(collect(&path, "text").unwrap(), expected);
        // In pieces, each at most a piece and whole characters.
        let mut pieces = Vec::new();
        read_documents_in(&path, "text", 0..u64::MAX, |t, ends| {
            assert!(t.len() <= PIECE, "{}", t.len());
            pieces.push(ends);
            Ok(())
        })
        .unwrap();
        assert!(pieces.len() > 10 && pieces.iter().filter(|&&e| e).count() == 4);
        // A part that starts inside a long line begins at the next line.
        let second = lines[0].len() as u64 + 1;
        let mut docs = Vec::new();
        read_documents_in(&path, "text", second + 5..u64::MAX, |t, ends| {
            docs.push((t, ends));
            Ok(())
        })
        .unwrap();
        let text: String = docs.iter().map(|(t, _)| t.as_str()).collect();
        assert_eq!(text, expected[2].clone() + &expected[3]);
        // Where a line would be a document, reading a range that starts at it takes it.
        let mut firsts = Vec::new();
        read_documents_in(&path, "text", second..second + 1, |t, _| {
            firsts.push(t);
            Ok(())
        })
        .unwrap();
        assert_eq!(firsts.concat(), expected[1]);

        let long = "x".repeat(PIECE + 10);
        let cases = [
            (
                format!(r#"{{"id": 3, "body": "{long}"}}"#),
                "has no field \"text\" (its other keys: [id, body])",
            ),
            (
                format!(r#"{{"pad": "{long}", "text": 5}}"#),
                "non-string (number) field",
            ),
            (format!(r#"{{"text": "{long}"}} x"#), "not valid JSON"),
            (format!(r#"{{"text": "{long}""#), "not valid JSON"),
            (format!(r#"{{"text": "{long}\q"}}"#), "not valid JSON"),
            (format!("{{\"text\": \"{long}\u{1}\"}}"), "not valid JSON"),
            (format!(r#"{{"text": "{long}\ud800"}}"#), "not valid JSON"),
            (
                format!(r#"{{"text": "{long}", "text": "b"}}"#),
                "appears twice",
            ),
            (format!(r#"["{long}"]"#), "expected a JSON object"),
        ];
        for (line, needle) in cases {
            fs::write(
                &path,
                format!("{{\"text\": \"ok\"}}\n{line}\n{{\"text\": \"ok\"}}\n"),
            )
            .unwrap();
            let err = collect(&path, "text").unwrap_err().to_string();
            assert!(
                err.contains("d.jsonl:2") && err.contains(needle),
                "{needle}: {err}"
            );
        }
        // Invalid UTF-8 inside the long string.
        let mut bytes = format!("{{\"text\": \"{long}").into_bytes();
        bytes.extend_from_slice(b"\xff\"}\n");
        fs::write(&path, bytes).unwrap();
        let err = collect(&path, "text").unwrap_err().to_string();
        assert!(
            err.contains("d.jsonl:1") && err.contains("invalid UTF-8"),
            "{err}"
        );
    }

    #[test]
    fn fingerprint_tracks_size_and_mtime() {
        let dir = tempfile::tempdir().unwrap();
        fs::create_dir(dir.path().join("s")).unwrap();
        let file = dir.path().join("s/a.txt");
        fs::write(&file, "hello").unwrap();
        let a = dataset_fingerprint(dir.path(), std::slice::from_ref(&file)).unwrap();
        assert_eq!(a[0].path, "s/a.txt");
        assert_eq!(a[0].size, 5);
        let f = File::options().write(true).open(&file).unwrap();
        f.set_modified(UNIX_EPOCH + std::time::Duration::from_secs(1_000_000))
            .unwrap();
        let b = dataset_fingerprint(dir.path(), std::slice::from_ref(&file)).unwrap();
        assert_eq!(b[0].mtime_ns, 1_000_000_000_000_000);
        assert_ne!(a, b);
    }
}
