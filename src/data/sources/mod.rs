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

pub(super) mod files;
mod jsonl;
mod parquet;
mod read;
mod text;

use std::fs;
use std::ops::Range;
use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};
use serde_json::{json, Value};

use super::builtin::{self, BuiltinFile};
pub use files::{dataset_fingerprint, list_files, DatasetFiles, FileFingerprint, TEXT_EXTENSIONS};
use files::{has_text_extension, walk};
pub(crate) use jsonl::json_type;
pub use read::{read_documents, read_documents_in};
pub(crate) use text::not_utf8;
pub use text::txt_document;

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

#[cfg(test)]
mod tests {
    use super::*;

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
}
