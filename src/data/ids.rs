//! Token ids against the model's vocabulary.
//!
//! A token file written with another tokenizer (a nanoGPT `.bin` of GPT-2 ids given to a model
//! with a smaller vocabulary, or any file of random bytes ending in `.bin`) holds ids past the
//! embedding's last row. libtorch notices only inside the embedding lookup and aborts the
//! process with a C++ stack, so [`check_max_id`] compares each file's largest id with the
//! model's vocabulary before training starts.
//!
//! Finding the largest id reads the whole file, so it is remembered with a [`FileStamp`] (size,
//! mtime, ctime, inode) and used only while the file still has that stamp: a file rewritten in
//! place, replaced, or touched is scanned again (ctime cannot be set back by hand, unlike mtime).
//! - A `.tok` that `lockstep prepare` wrote has it in its cache entry's `meta.json`, counted
//!   while writing: no scan, ever.
//! - Any other token file (nanoGPT `.bin`, llm.c shard, a `.tok` from elsewhere) is scanned once
//!   ([`TokenFile::scan_max_token_id`]) and the result kept in
//!   `<data.cache_dir>/max-ids/<BLAKE3 of the canonical path>.json`.

use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::tokfile::TokenFile;

/// Subdirectory of the data cache holding the largest ids of token files lockstep did not write.
pub const MAX_IDS_DIR: &str = "max-ids";

/// What identifies one version of a file: a remembered value is used only while all of it
/// matches.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileStamp {
    /// Size in bytes.
    pub bytes: u64,
    /// Modification time, ns since the epoch (a string: JSON numbers lose i128).
    pub mtime_ns: String,
    /// Status-change time, ns since the epoch: set by the kernel on every write or rename.
    pub ctime_ns: String,
    /// Inode number: a replaced file is another inode.
    pub inode: u64,
}

impl FileStamp {
    /// The stamp `path` has now.
    pub fn of(path: &Path) -> Result<Self> {
        let m = fs::metadata(path)
            .with_context(|| format!("{}: cannot read file metadata", path.display()))?;
        let ns = |s: i64, n: i64| (s as i128 * 1_000_000_000 + n as i128).to_string();
        Ok(FileStamp {
            bytes: m.len(),
            mtime_ns: ns(m.mtime(), m.mtime_nsec()),
            ctime_ns: ns(m.ctime(), m.ctime_nsec()),
            inode: m.ino(),
        })
    }
}

/// A remembered largest id: the file's stamp when it was found, and the id (`None` for a file
/// without tokens).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MaxIdRecord {
    /// The file, as given (for people reading the cache).
    pub path: String,
    /// The file's stamp when the id was found.
    pub stamp: FileStamp,
    /// The largest token id.
    pub max_token_id: Option<u32>,
}

impl MaxIdRecord {
    /// The record for `path` (a file just written) with the largest id its writer counted.
    pub fn new(path: &Path, max_token_id: Option<u32>) -> Result<Self> {
        Ok(MaxIdRecord {
            path: path.display().to_string(),
            stamp: FileStamp::of(path)?,
            max_token_id,
        })
    }
}

/// The largest token id of `file` (mapped from `path`), from the first record still valid for
/// it: its cache entry's `meta.json` (a `.tok` that prepare wrote), then
/// `<cache_dir>/max-ids/`; otherwise the file is scanned and, with a `cache_dir`, the result
/// kept there (best effort: an unwritable cache only means scanning again next time).
pub fn max_token_id(
    path: &Path,
    file: &TokenFile,
    cache_dir: Option<&Path>,
) -> Result<Option<u32>> {
    let stamp = FileStamp::of(path)?;
    if let Some(rec) = recorded(path, &stamp, cache_dir)? {
        return Ok(rec.max_token_id);
    }
    let max_token_id = file.scan_max_token_id();
    if let Some(dir) = cache_dir {
        let sidecar = sidecar_path(dir, path)?;
        let rec = MaxIdRecord {
            path: path.display().to_string(),
            stamp,
            max_token_id,
        };
        let _ = crate::sys::durable::write_atomic(&sidecar, &serde_json::to_vec_pretty(&rec)?);
    }
    Ok(max_token_id)
}

/// True when `path` still has the stamp a record of it holds (its cache entry's `meta.json`, or
/// `<cache_dir>/max-ids/`): it has not changed since lockstep wrote or last checked it.
pub fn unchanged(path: &Path, cache_dir: Option<&Path>) -> Result<bool> {
    Ok(recorded(path, &FileStamp::of(path)?, cache_dir)?.is_some())
}

/// The first record of `path` still valid for its `stamp`: its cache entry's `meta.json`, then
/// `<cache_dir>/max-ids/`.
fn recorded(
    path: &Path,
    stamp: &FileStamp,
    cache_dir: Option<&Path>,
) -> Result<Option<MaxIdRecord>> {
    if let Some(rec) = from_meta_json(path).filter(|r| r.stamp == *stamp) {
        return Ok(Some(rec));
    }
    let Some(dir) = cache_dir else {
        return Ok(None);
    };
    let rec: Option<MaxIdRecord> = fs::read(sidecar_path(dir, path)?)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok());
    Ok(rec.filter(|r| r.stamp == *stamp))
}

/// The record prepare left in `meta.json` beside `path` (`train.tok` → its `"train"` part).
fn from_meta_json(path: &Path) -> Option<MaxIdRecord> {
    let part = path.file_name()?.to_str()?.strip_suffix(".tok")?;
    let meta: Value =
        serde_json::from_slice(&fs::read(path.parent()?.join("meta.json")).ok()?).ok()?;
    let part = meta.get(part)?;
    Some(MaxIdRecord {
        path: path.display().to_string(),
        stamp: serde_json::from_value(part.get("stamp")?.clone()).ok()?,
        // Present (null for an empty file) only in entries that recorded it.
        max_token_id: serde_json::from_value(part.get("max_token_id")?.clone()).ok()?,
    })
}

/// `<cache_dir>/max-ids/<first 16 bytes of BLAKE3 of the canonical path, hex>.json`.
fn sidecar_path(cache_dir: &Path, path: &Path) -> Result<PathBuf> {
    let canonical = path
        .canonicalize()
        .with_context(|| format!("{}: cannot resolve the path", path.display()))?;
    let hash = blake3::hash(canonical.as_os_str().as_encoded_bytes());
    Ok(cache_dir
        .join(MAX_IDS_DIR)
        .join(format!("{}.json", &hash.to_hex()[..32])))
}

/// Fails unless `max`, the largest id of the prepared token file `path` (tokenized with
/// `tokenizer`, `tokenizer_vocab` ids), is below `vocab_size`, the model's vocabulary (its
/// embedding rows, which may exceed the tokenizer's). Checked before the model sees a batch
/// ([`crate::data::Prepared::check_ids_fit`]): an id past the embedding aborts libtorch.
pub fn check_max_id(
    path: &Path,
    max: Option<u32>,
    vocab_size: usize,
    tokenizer: &str,
    tokenizer_vocab: usize,
) -> Result<()> {
    let Some(max) = max else {
        return Ok(());
    };
    if max as usize >= vocab_size {
        bail!(
            "{}: holds token id {max}, but the model's vocabulary has {vocab_size} ids \
             (0..={}), so the file was not tokenized with data.tokenizer ({tokenizer}, \
             {tokenizer_vocab} ids). Set data.tokenizer to the tokenizer that wrote the file, or \
             point data.path at the text to tokenize it with this one; if the ids are right and \
             the model's embedding should be larger, set model.vocab_size to at least {}",
            path.display(),
            vocab_size - 1,
            max as u64 + 1
        );
    }
    Ok(())
}

/// [`check_max_id`] for one token file given on the command line as `--data` (`lockstep
/// eval`): its largest id (from its cache entry's `meta.json`, else a scan) against the model's
/// vocabulary.
pub fn check_file_ids_fit(path: &Path, file: &TokenFile, vocab_size: usize) -> Result<()> {
    let Some(max) = max_token_id(path, file, None)? else {
        return Ok(());
    };
    if max as usize >= vocab_size {
        bail!(
            "--data {}: holds token id {max}, but the model's vocabulary has {vocab_size} ids \
             (0..={}), so the file was tokenized with another tokenizer than the model's. \
             Evaluate the text instead (--data with the .txt/.jsonl, tokenized with the model's \
             tokenizer), or a token file written with that tokenizer",
            path.display(),
            vocab_size - 1
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::tokfile::TokFileWriter;

    fn nanogpt(path: &Path, ids: &[u16]) {
        let bytes: Vec<u8> = ids.iter().flat_map(|t| t.to_le_bytes()).collect();
        fs::write(path, bytes).unwrap();
    }

    #[test]
    fn foreign_files_are_scanned_once_and_rescanned_when_changed() {
        let dir = tempfile::tempdir().unwrap();
        let cache = dir.path().join("cache");
        let bin = dir.path().join("x.bin");
        nanogpt(&bin, &[5, 60_000, 7]);
        let f = TokenFile::open(&bin).unwrap();
        assert_eq!(max_token_id(&bin, &f, Some(&cache)).unwrap(), Some(60_000));
        let sidecars: Vec<PathBuf> = fs::read_dir(cache.join(MAX_IDS_DIR))
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        assert_eq!(sidecars.len(), 1);
        let rec: MaxIdRecord = serde_json::from_slice(&fs::read(&sidecars[0]).unwrap()).unwrap();
        assert_eq!(rec.max_token_id, Some(60_000));
        assert_eq!(rec.stamp, FileStamp::of(&bin).unwrap());

        // The record is what is read: a forged one with the file's stamp is believed…
        let forged = MaxIdRecord {
            max_token_id: Some(3),
            ..rec.clone()
        };
        fs::write(&sidecars[0], serde_json::to_vec(&forged).unwrap()).unwrap();
        assert_eq!(max_token_id(&bin, &f, Some(&cache)).unwrap(), Some(3));
        // …but not once the file changed, even to the same size with the old mtime.
        drop(f);
        // Past the kernel's timestamp granularity (a jiffy), so the rewrite gets a new ctime.
        std::thread::sleep(std::time::Duration::from_millis(50));
        nanogpt(&bin, &[5, 9, 7]);
        let old_mtime: i128 = rec.stamp.mtime_ns.parse().unwrap();
        let t = std::time::UNIX_EPOCH + std::time::Duration::from_nanos(old_mtime as u64);
        fs::File::options()
            .write(true)
            .open(&bin)
            .unwrap()
            .set_modified(t)
            .unwrap();
        let f = TokenFile::open(&bin).unwrap();
        assert_eq!(max_token_id(&bin, &f, Some(&cache)).unwrap(), Some(9));
        assert_eq!(max_token_id(&bin, &f, None).unwrap(), Some(9));
    }

    #[test]
    fn prepared_tok_files_are_read_from_meta_json() {
        let dir = tempfile::tempdir().unwrap();
        let tok = dir.path().join("train.tok");
        let mut w = TokFileWriter::create(&tok, 2, [0; 32]).unwrap();
        w.push_document(&[1, 400, 2]).unwrap();
        let info = w.finish().unwrap();
        assert_eq!(info.max_token_id, Some(400));
        let rec = MaxIdRecord::new(&tok, info.max_token_id).unwrap();
        let meta = serde_json::json!({
            "train": { "tokens": 3, "max_token_id": 7, "stamp": rec.stamp },
        });
        fs::write(dir.path().join("meta.json"), meta.to_string()).unwrap();
        let f = TokenFile::open(&tok).unwrap();
        // 7, not 400: the recorded value is used, nothing is scanned or written.
        let cache = dir.path().join("cache");
        assert_eq!(max_token_id(&tok, &f, Some(&cache)).unwrap(), Some(7));
        assert!(!cache.exists());
        // A meta.json of an older lockstep (no max_token_id) means a scan.
        let meta = serde_json::json!({ "train": { "tokens": 3, "stamp": rec.stamp } });
        fs::write(dir.path().join("meta.json"), meta.to_string()).unwrap();
        assert_eq!(max_token_id(&tok, &f, None).unwrap(), Some(400));
    }

    #[test]
    fn eval_check_names_the_file_the_id_and_the_vocabulary() {
        let dir = tempfile::tempdir().unwrap();
        let bin = dir.path().join("x.bin");
        nanogpt(&bin, &[1, 50_300, 2]);
        let f = TokenFile::open(&bin).unwrap();
        check_file_ids_fit(&bin, &f, 50_301).unwrap();
        let err = check_file_ids_fit(&bin, &f, 50_257)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("x.bin: holds token id 50300")
                && err.contains("vocabulary has 50257 ids (0..=50256)")
                && err.contains("Evaluate the text instead"),
            "{err}"
        );
    }
}
