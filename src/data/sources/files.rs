//! Which files make up a dataset on disk and what identifies them: the text file extensions,
//! a directory walked for its data files ([`list_files`]), [`DatasetFiles`] (what `data.path`
//! resolved to) and the per-file fingerprints of the cache key. Depends on nothing else of
//! the data module, so the hub cache ([`crate::data::hub`]) can list a snapshot's files too.

use std::fs;
use std::path::{Path, PathBuf};
use std::time::UNIX_EPOCH;

use anyhow::{anyhow, bail, Context, Result};
use serde::Serialize;

/// File extensions read as text sources.
pub const TEXT_EXTENSIONS: &[&str] = &["txt", "jsonl", "parquet"];

pub(super) fn has_text_extension(path: &Path) -> bool {
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

pub(super) fn walk(dir: &Path, files: &mut Vec<PathBuf>) -> Result<()> {
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
    use std::fs::File;

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
