//! A cache entry: what identifies it (the inputs hashed into its key) and where it lives, the
//! files in it (`train.tok`/`val.tok`, or the parts `part-IIIII-of-NNNNN.tok` with their
//! records), its `meta.json`, and whether it is complete and intact ([`cached`], [`damaged`]).

use std::fs;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result};
use serde_json::{json, Value};

use super::super::ids::{max_token_id, FileStamp, MaxIdRecord};
use super::super::sources::{resolve_dataset, Dataset};
use super::super::tokenizer::Tokenizer;
use super::super::tokfile::{dtype_for_vocab, TokFileInfo, TokenFile, TokenPrefix};
use super::encode::Tokenized;
use super::prepared::Prepared;
use super::spec::PrepareSpec;
use crate::sys::durable::file_blake3;

/// Bumped whenever the cache contents for the same inputs would change (2: the validation
/// split no longer depends on training.context_length, which left the key).
pub const CACHE_FORMAT_VERSION: u32 = 2;

/// A cache entry: the dataset, what identifies it (`inputs`, hashed into `key`) and where it
/// lives (`<cache_dir>/<first 16 hex digits of key>`).
pub(super) struct Entry {
    pub(super) dataset: Dataset,
    pub(super) inputs: Value,
    pub(super) key: String,
    pub(super) dir: PathBuf,
}

impl Entry {
    pub(super) fn new(spec: &PrepareSpec, tok: &Tokenizer) -> Result<Entry> {
        // A built-in corpus, a file, a directory, a glob pattern or a cached Hugging Face
        // dataset.
        let dataset = resolve_dataset(&spec.path)?;
        let (dataset_id, files) = dataset.fingerprint()?;
        let inputs = json!({
            "format_version": CACHE_FORMAT_VERSION,
            "tokenizer": tok.id(),
            "tokenizer_hash": blake3::Hash::from(tok.definition_hash()).to_hex().as_str(),
            "dataset": dataset_id,
            "files": files,
            "text_field": spec.text_field,
            "val_fraction": spec.val_fraction,
            "num_samples": spec.num_samples,
        });
        let key = blake3::hash(&serde_json::to_vec(&inputs)?)
            .to_hex()
            .to_string();
        fs::create_dir_all(&spec.cache_dir).with_context(|| {
            format!(
                "{}: cannot create the data cache directory; set data.cache_dir to a writable \
                 place",
                spec.cache_dir.display()
            )
        })?;
        let dir = spec.cache_dir.join(&key[..16]);
        Ok(Entry {
            dataset,
            inputs,
            key,
            dir,
        })
    }

    pub(super) fn short(&self) -> &str {
        &self.key[..16]
    }

    /// The entry's `meta.json`: its key and inputs, the tokenizer, what was `read`, whether the
    /// validation split is at a document boundary, the `parts` of an entry prepared in parts,
    /// and the `train` and `val` records.
    pub(super) fn meta(
        &self,
        tok: &Tokenizer,
        read: &Tokenized,
        at_boundary: bool,
        parts: Option<&[String]>,
        train: Value,
        val: Value,
    ) -> Value {
        let mut meta = json!({
            "key": self.key,
            "inputs": self.inputs,
            "tokenizer": { "id": tok.id(), "vocab_size": tok.vocab_size(), "eos_id": tok.eos_id() },
            "dtype_bytes": dtype_for_vocab(tok.vocab_size()),
            "documents": read.documents,
            "input_bytes": read.input_bytes,
            "split_at_document_boundary": at_boundary,
        });
        if let Some(parts) = parts {
            meta["parts"] = json!(parts);
        }
        meta["train"] = train;
        meta["val"] = val;
        meta["created_unix_s"] = json!(now_unix_s());
        meta
    }
}

pub(super) fn missing_parts(count: u64, present: &[u64]) -> Vec<u64> {
    (0..count).filter(|i| !present.contains(i)).collect()
}

/// The record `prepare --shard` left beside part `name`'s token file, if it is for `key` and
/// the token file is still the one it describes.
pub(super) fn part_record(dir: &Path, name: &str, key: &str) -> Option<Value> {
    let rec: Value =
        serde_json::from_slice(&fs::read(dir.join(format!("{name}.json"))).ok()?).ok()?;
    let stamp: FileStamp = serde_json::from_value(rec.get("stamp")?.clone()).ok()?;
    let now = FileStamp::of(&dir.join(format!("{name}.tok"))).ok()?;
    (rec.get("key")?.as_str()? == key && stamp == now).then_some(rec)
}

/// The part count and the parts written (with a valid record) in `dir`, if any.
pub(super) fn parts_present(dir: &Path, key: &str) -> Option<(u64, Vec<u64>)> {
    let mut count = None;
    let mut present = Vec::new();
    for e in fs::read_dir(dir).ok()?.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(stem) = name.strip_suffix(".json") else {
            continue;
        };
        let Some((i, n)) = stem
            .strip_prefix("part-")
            .and_then(|r| r.split_once("-of-"))
            .and_then(|(i, n)| Some((i.parse::<u64>().ok()?, n.parse::<u64>().ok()?)))
        else {
            continue;
        };
        if part_record(dir, stem, key).is_some() {
            count = Some(n);
            present.push(i);
        }
    }
    present.sort_unstable();
    count.map(|c| (c, present))
}

/// The training prefixes an entry's `meta.json` names: `train.tok` whole (an entry prepared
/// in one go), or the parts' prefixes (an entry prepared in parts).
fn train_prefixes(dir: &Path, meta: &Value) -> Option<Vec<TokenPrefix>> {
    let Some(prefixes) = meta["train"]["prefixes"].as_array() else {
        let tokens = meta["train"]["tokens"].as_u64()?;
        return Some(vec![TokenPrefix::whole(dir.join("train.tok"), tokens)]);
    };
    prefixes
        .iter()
        .map(|p| {
            Some(TokenPrefix {
                path: dir.join(p["file"].as_str()?),
                tokens: p["tokens"].as_u64()?,
                eos: p["eos"].as_u64().map(|e| e as u32),
            })
        })
        .collect()
}

/// The cache entry in `dir` if it is complete, made from `key` and readable.
pub(super) fn cached(
    dir: &Path,
    key: &str,
    tok: &Tokenizer,
    want_val: bool,
) -> Result<Option<Prepared>> {
    let valid = || -> Option<(Value, Vec<TokenPrefix>, TokenFile, Option<TokenFile>)> {
        let meta: Value = serde_json::from_slice(&fs::read(dir.join("meta.json")).ok()?).ok()?;
        if meta.get("key")?.as_str()? != key {
            return None;
        }
        let ours = |tf: TokenFile| (tf.tokenizer_hash()? == tok.definition_hash()).then_some(tf);
        let val = if want_val {
            Some(ours(TokenFile::open(&dir.join("val.tok")).ok()?)?)
        } else {
            None
        };
        let prefixes = train_prefixes(dir, &meta)?;
        let train = ours(TokenFile::open_prefixes(&prefixes).ok()?)?;
        Some((meta, prefixes, train, val))
    };
    let Some((meta, prefixes, train, val)) = valid() else {
        return Ok(None);
    };
    if let Some(why) = damaged(dir, &meta, want_val)? {
        eprintln!(
            "[data] cache entry {} is damaged ({why}); tokenizing it again",
            dir.display()
        );
        return Ok(None);
    }
    // From meta.json; entries of an older lockstep are scanned once (into the cache's max-ids/).
    let cache_dir = dir.parent();
    let train_max_id = if meta.get("parts").is_some() {
        meta["train"]["max_token_id"].as_u64().map(|m| m as u32)
    } else {
        max_token_id(&dir.join("train.tok"), &train, cache_dir)?
    };
    let val_max_id = match &val {
        Some(tf) => max_token_id(&dir.join("val.tok"), tf, cache_dir)?,
        None => None,
    };
    let (train_tokens, val_tokens) = (train.num_tokens(), val.map_or(0, |v| v.num_tokens()));
    Ok(Some(Prepared {
        dir: dir.to_path_buf(),
        train: prefixes,
        val: want_val.then(|| dir.join("val.tok")),
        cache_hit: true,
        engine: None,
        tokenizer_id: tok.id(),
        vocab_size: tok.vocab_size(),
        eos_id: tok.eos_id(),
        train_tokens,
        val_tokens,
        train_max_id,
        val_max_id,
    }))
}

/// Why the token files of the entry in `dir` (its `meta`) are not the bytes prepare wrote, if
/// they are not.
/// A file whose stamp still matches its record is taken as written (no read); one that changed
/// since (a copy, a `touch`, an overwrite) is hashed against the BLAKE3 that `meta.json`
/// recorded: equal, its new stamp is remembered; different, the entry is damaged. Entries
/// written before the checksum existed are not checked.
fn damaged(dir: &Path, meta: &Value, want_val: bool) -> Result<Option<String>> {
    // The token files and the keys of their records: `train` (one go) or each part's name.
    let mut parts: Vec<&str> = match meta["parts"].as_array() {
        Some(names) => names.iter().filter_map(Value::as_str).collect(),
        None => vec!["train"],
    };
    if want_val {
        parts.push("val");
    }
    for part in &parts {
        let path = dir.join(format!("{part}.tok"));
        if super::super::ids::unchanged(&path, dir.parent())? {
            continue;
        }
        let Some(want) = meta[*part]["blake3"].as_str() else {
            continue;
        };
        if file_blake3(&path)? != want {
            return Ok(Some(format!(
                "{part}.tok's bytes no longer match the BLAKE3 recorded in meta.json when it was \
                 written"
            )));
        }
    }
    Ok(None)
}

/// A token file's record in `meta.json`: counts, the largest id, and the file's stamp and
/// BLAKE3 so a changed file is never trusted with them.
pub(super) fn file_part(info: &TokFileInfo) -> Result<Value> {
    let rec = MaxIdRecord::new(&info.path, info.max_token_id)?;
    Ok(json!({
        "tokens": info.num_tokens,
        "documents": info.num_docs,
        "max_token_id": rec.max_token_id,
        "stamp": rec.stamp,
        "blake3": file_blake3(&info.path)?,
    }))
}

fn now_unix_s() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}
