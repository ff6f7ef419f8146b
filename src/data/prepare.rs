//! Tokenize a text dataset once into `.tok` files kept in a content-addressed
//! cache directory, so every later run (and every rank) just memory-maps them.

use std::fs;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{anyhow, bail, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use rayon::prelude::*;
use serde_json::{json, Value};

use super::hub::resolve_tokenizer;
use super::ids::{check_max_id, max_token_id, FileStamp, MaxIdRecord};
use super::sources::{resolve_dataset, Dataset};
use super::tokenizer::{Tokenizer, BUILTIN_NAMES};
use super::tokfile::{
    dtype_for_vocab, is_token_file, partition_point, sync_parent_dir, TokFileInfo, TokFileWriter,
    TokenFile, TokenPrefix,
};
use crate::sys::durable::file_blake3;

/// Bumped whenever the cache contents for the same inputs would change (2: the validation
/// split no longer depends on training.context_length, which left the key).
pub const CACHE_FORMAT_VERSION: u32 = 2;

/// Text accumulated before a parallel tokenization pass.
const BATCH_BYTES: usize = 16 << 20;
/// Large documents are cut into pieces of about this size for parallelism.
const SEGMENT_BYTES: usize = 256 << 10;

/// What to tokenize and where to cache it.
#[derive(Debug, Clone)]
pub struct PrepareSpec {
    /// Tokenizer name or `tokenizer.json` path (see [`Tokenizer::load`]).
    pub tokenizer: String,
    /// `data.path`: a built-in corpus (`builtin:shakespeare`), a text file, a directory of
    /// them, a glob pattern, a cached Hub dataset, or a ready token file.
    pub path: PathBuf,
    /// JSON key holding the document text in `.jsonl` files.
    pub text_field: String,
    /// Share of tokens (taken from the end) used for validation, in `[0, 1)`.
    pub val_fraction: f64,
    /// Only the first N documents; `None` = all.
    pub num_samples: Option<u64>,
    /// Root of the tokenized-data cache.
    pub cache_dir: PathBuf,
    /// Tokenization threads; 0 = all cores.
    pub num_threads: usize,
    /// Show a progress bar (only when stderr is a terminal).
    pub progress: bool,
}

/// Where the prepared token files are and what they contain.
#[derive(Debug, Clone)]
pub struct Prepared {
    /// The cache entry directory (or the token file's directory).
    pub dir: PathBuf,
    /// Training tokens: `train.tok` whole, or the prefixes of the parts of an entry prepared
    /// in parts (read as one stream by [`TokenFile::open_prefixes`]).
    pub train: Vec<TokenPrefix>,
    /// Validation tokens, if a split was requested.
    pub val: Option<PathBuf>,
    /// True when nothing had to be tokenized.
    pub cache_hit: bool,
    /// What tokenized the text ([`Tokenizer::engine`]) when this call did.
    pub engine: Option<String>,
    /// [`Tokenizer::id`] of the tokenizer used.
    pub tokenizer_id: String,
    /// Tokenizer vocabulary size, special tokens included.
    pub vocab_size: usize,
    /// End-of-document token id.
    pub eos_id: u32,
    /// Tokens in `train`.
    pub train_tokens: u64,
    /// Tokens in `val` (0 without one).
    pub val_tokens: u64,
    /// The largest token id in `train` (`None` without tokens); see [`Prepared::check_ids_fit`].
    pub train_max_id: Option<u32>,
    /// The largest token id in `val`.
    pub val_max_id: Option<u32>,
}

impl Prepared {
    /// Fails unless every token of the train and validation files is below `vocab_size`, the
    /// model's vocabulary ([`super::ids::check_max_id`], with the largest ids counted when the
    /// files were written or scanned).
    pub fn check_ids_fit(&self, vocab_size: usize) -> Result<()> {
        let files = [
            (self.train.first().map(|p| &p.path), self.train_max_id),
            (self.val.as_ref(), self.val_max_id),
        ];
        for (path, max) in files {
            if let Some(path) = path {
                check_max_id(path, max, vocab_size, &self.tokenizer_id, self.vocab_size)?;
            }
        }
        Ok(())
    }
}

/// Part `index` of `count` of a preparation spread over machines (`prepare --shard I/N`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shard {
    /// From 0 to `count - 1`.
    pub index: u64,
    /// How many parts the corpus is cut into.
    pub count: u64,
}

impl Shard {
    /// `I/N` (I from 0 to N−1, like RANK), or `slurm` for SLURM_PROCID/SLURM_NTASKS (one
    /// part per task of `srun lockstep prepare --shard slurm`).
    pub fn parse(text: &str) -> Result<Shard> {
        let (index, count) = if text == "slurm" {
            let var = |name: &str| -> Result<String> {
                std::env::var(name).map_err(|_| {
                    anyhow!(
                        "--shard slurm: {name} is not set; run it as `srun lockstep prepare \
                         --shard slurm`, or give the part as --shard I/N"
                    )
                })
            };
            (var("SLURM_PROCID")?, var("SLURM_NTASKS")?)
        } else {
            let (i, n) = text.split_once('/').ok_or_else(|| {
                anyhow!("--shard {text}: expected I/N (e.g. 0/8: the first of 8 parts) or slurm")
            })?;
            (i.to_string(), n.to_string())
        };
        let num = |v: &str| v.trim().parse::<u64>().ok();
        match (num(&index), num(&count)) {
            (Some(index), Some(count)) if index < count && count <= 99_999 => {
                Ok(Shard { index, count })
            }
            _ => bail!(
                "--shard {text}: the part must be I/N with 0 <= I < N <= 99999 (got {index}/{count})"
            ),
        }
    }

    /// `part-IIIII-of-NNNNN`: the name of its token file (`.tok`) and record (`.json`).
    fn name(&self) -> String {
        part_name(self.index, self.count)
    }
}

fn part_name(index: u64, count: u64) -> String {
    format!("part-{index:05}-of-{count:05}")
}

/// What `prepare --shard I/N` did.
#[derive(Debug)]
pub enum PartOutcome {
    /// All parts are there: the entry is complete (by this part, or already).
    Complete(Prepared),
    /// This part is written; these parts are still missing.
    Waiting {
        /// The cache entry.
        dir: PathBuf,
        /// Tokens in this part.
        tokens: u64,
        /// The parts not written yet, by index.
        missing: Vec<u64>,
    },
}

/// Checks `spec`'s values, then returns its tokenizer.
fn checked(spec: &PrepareSpec) -> Result<Tokenizer> {
    if !(0.0..1.0).contains(&spec.val_fraction) {
        bail!(
            "data.val_fraction is {} but must be at least 0 and below 1",
            spec.val_fraction
        );
    }
    if spec.num_samples == Some(0) {
        bail!("data.num_samples is 0; leave it unset to use every document");
    }
    Tokenizer::load(&resolve_tokenizer(&spec.tokenizer)?)
}

/// A cache entry: the dataset, what identifies it (`inputs`, hashed into `key`) and where it
/// lives (`<cache_dir>/<first 16 hex digits of key>`).
struct Entry {
    dataset: Dataset,
    inputs: Value,
    key: String,
    dir: PathBuf,
}

impl Entry {
    fn new(spec: &PrepareSpec, tok: &Tokenizer) -> Result<Entry> {
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

    fn short(&self) -> &str {
        &self.key[..16]
    }
}

/// Returns token files for `spec`, tokenizing only when the cache has no
/// valid entry for exactly these inputs. Prints nothing but the progress bar.
pub fn prepare(spec: &PrepareSpec) -> Result<Prepared> {
    let tok = checked(spec)?;
    if is_token_file(&spec.path) {
        return use_token_file(spec, &tok);
    }
    let entry = Entry::new(spec, &tok)?;
    let dir = entry.dir.clone();
    if let Some(hit) = cached(&dir, &entry.key, &tok, spec.val_fraction > 0.0)? {
        return Ok(hit);
    }
    if let Some((count, present)) = parts_present(&dir, &entry.key) {
        let missing = missing_parts(count, &present);
        bail!(
            "{}: this data is being prepared in {count} parts (`lockstep prepare --shard I/N`) \
             and parts {} are missing; run `lockstep prepare --shard I/{count}` for each of \
             them (the entry completes when the last one is written), or delete the directory \
             to prepare the data in one go",
            dir.display(),
            list(&missing)
        );
    }

    let short = entry.short().to_string();
    remove_stale_builds(&spec.cache_dir, &short);
    let tmp = spec
        .cache_dir
        .join(format!("{short}.tmp-{}", std::process::id()));
    let _ = fs::remove_dir_all(&tmp);
    fs::create_dir(&tmp).with_context(|| format!("{}: cannot create", tmp.display()))?;
    let built = build(spec, &tok, &entry.dataset, &tmp, &entry.key, entry.inputs);
    let built = match built {
        Ok(b) => b,
        Err(e) => {
            let _ = fs::remove_dir_all(&tmp);
            return Err(e);
        }
    };
    // A leftover invalid entry (or one a concurrent run just finished, which
    // holds identical data) is replaced: rename cannot overwrite a non-empty
    // directory.
    if dir.exists() {
        fs::remove_dir_all(&dir).with_context(|| format!("{}: cannot replace", dir.display()))?;
    }
    fs::rename(&tmp, &dir)
        .with_context(|| format!("cannot rename {} to {}", tmp.display(), dir.display()))?;
    sync_parent_dir(&dir);
    Ok(Prepared {
        train: vec![TokenPrefix::whole(
            dir.join("train.tok"),
            built.train_tokens,
        )],
        val: (spec.val_fraction > 0.0).then(|| dir.join("val.tok")),
        dir,
        cache_hit: false,
        engine: Some(tok.engine()),
        tokenizer_id: tok.id(),
        vocab_size: tok.vocab_size(),
        eos_id: tok.eos_id(),
        train_tokens: built.train_tokens,
        val_tokens: built.val_tokens,
        train_max_id: built.train_max_id,
        val_max_id: built.val_max_id,
    })
}

/// Prepares part `shard` of `spec`'s data into the shared cache entry
/// (`part-IIIII-of-NNNNN.tok`), unless it is there already, and completes the entry when every
/// part is: the validation tail is split off the last parts into `val.tok`, and `meta.json`
/// makes the entry usable (training reads the parts as one stream, in the same order as a
/// preparation in one go). Any part may finish last; two machines writing one part, or
/// completing the entry at once, write the same bytes through temporary names.
pub fn prepare_part(spec: &PrepareSpec, shard: Shard) -> Result<PartOutcome> {
    let tok = checked(spec)?;
    if is_token_file(&spec.path) {
        bail!(
            "{}: is a token file already; --shard prepares text (point data.path at the \
             .txt/.jsonl/.parquet files)",
            spec.path.display()
        );
    }
    if let Some(n) = spec.num_samples {
        bail!(
            "data.num_samples = {n} takes the first documents of the whole corpus, which no part \
             can know; unset it to prepare in parts, or prepare without --shard"
        );
    }
    let entry = Entry::new(spec, &tok)?;
    let dir = entry.dir.clone();
    if let Some(hit) = cached(&dir, &entry.key, &tok, spec.val_fraction > 0.0)? {
        return Ok(PartOutcome::Complete(hit));
    }
    if let Some((count, _)) = parts_present(&dir, &entry.key) {
        if count != shard.count {
            bail!(
                "{}: this data is being prepared in {count} parts, not {}; use --shard I/{count} \
                 (or delete the directory to start again with {} parts)",
                dir.display(),
                shard.count,
                shard.count
            );
        }
    }
    fs::create_dir_all(&dir).with_context(|| format!("{}: cannot create", dir.display()))?;
    let name = shard.name();
    let tokens = match part_record(&dir, &name, &entry.key) {
        Some(rec) => rec["tokens"].as_u64().unwrap_or(0),
        None => write_part(spec, &tok, &entry, shard)?,
    };
    let present = parts_present(&dir, &entry.key).map_or(Vec::new(), |(_, p)| p);
    let missing = missing_parts(shard.count, &present);
    if !missing.is_empty() {
        return Ok(PartOutcome::Waiting {
            dir,
            tokens,
            missing,
        });
    }
    complete(spec, &tok, &entry, shard.count).map(PartOutcome::Complete)
}

/// `0, 2, 5`.
fn list(items: &[u64]) -> String {
    items
        .iter()
        .map(u64::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

fn missing_parts(count: u64, present: &[u64]) -> Vec<u64> {
    (0..count).filter(|i| !present.contains(i)).collect()
}

/// The record `prepare --shard` left beside part `name`'s token file, if it is for `key` and
/// the token file is still the one it describes.
fn part_record(dir: &Path, name: &str, key: &str) -> Option<Value> {
    let rec: Value =
        serde_json::from_slice(&fs::read(dir.join(format!("{name}.json"))).ok()?).ok()?;
    let stamp: FileStamp = serde_json::from_value(rec.get("stamp")?.clone()).ok()?;
    let now = FileStamp::of(&dir.join(format!("{name}.tok"))).ok()?;
    (rec.get("key")?.as_str()? == key && stamp == now).then_some(rec)
}

/// The part count and the parts written (with a valid record) in `dir`, if any.
fn parts_present(dir: &Path, key: &str) -> Option<(u64, Vec<u64>)> {
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

/// Tokenizes part `shard` into `<dir>/part-….tok` and records it in `part-….json`; returns
/// its token count.
fn write_part(spec: &PrepareSpec, tok: &Tokenizer, entry: &Entry, shard: Shard) -> Result<u64> {
    let name = shard.name();
    let path = entry.dir.join(format!("{name}.tok"));
    let dtype = dtype_for_vocab(tok.vocab_size());
    let bytes = entry.dataset.part_bytes(shard.index, shard.count);
    remove_stale_part_files(&entry.dir, &name);
    let mut writer = TokFileWriter::create(&path, dtype, tok.definition_hash())?;
    let room = |e: anyhow::Error, w: &TokFileWriter| {
        out_of_room(spec, &entry.dir, w.num_tokens() * u64::from(dtype), e)
    };
    let read = match tokenize_corpus(spec, tok, &entry.dataset, bytes, &mut writer) {
        Ok(r) => r,
        Err(e) => return Err(room(e, &writer)),
    };
    let info = writer.finish()?;
    let rec = MaxIdRecord::new(&info.path, info.max_token_id)?;
    let record = json!({
        "key": entry.key,
        "part": shard.index,
        "parts": shard.count,
        "documents": read.documents,
        "input_bytes": read.input_bytes,
        "tokens": info.num_tokens,
        "max_token_id": rec.max_token_id,
        "stamp": rec.stamp,
        "blake3": file_blake3(&info.path)?,
    });
    crate::sys::durable::write_atomic(
        &entry.dir.join(format!("{name}.json")),
        &serde_json::to_vec_pretty(&record)?,
    )?;
    Ok(info.num_tokens)
}

/// Removes the temporary files a killed `prepare --shard` of part `name` left on this host
/// (`<name>.tok.tmp-<host>-<pid>[.offsets]` of a process that is gone); other hosts' are
/// left to them.
fn remove_stale_part_files(dir: &Path, name: &str) {
    let prefix = format!("{name}.tok.tmp-{}-", crate::sys::hostname());
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let file = e.file_name().to_string_lossy().into_owned();
        let Some(pid) = file.strip_prefix(&prefix) else {
            continue;
        };
        let pid = pid.strip_suffix(".offsets").unwrap_or(pid);
        let gone = Path::new("/proc/self").exists() && !Path::new("/proc").join(pid).exists();
        if gone {
            let _ = fs::remove_file(e.path());
        }
    }
}

/// Completes an entry whose `count` parts are all written: splits the validation tail off
/// into `val.tok` and writes `meta.json`, whose `train` names the parts' prefixes that hold
/// the training tokens.
fn complete(spec: &PrepareSpec, tok: &Tokenizer, entry: &Entry, count: u64) -> Result<Prepared> {
    let dir = &entry.dir;
    let names: Vec<String> = (0..count).map(|i| part_name(i, count)).collect();
    let records: Vec<Value> = names
        .iter()
        .map(|n| {
            part_record(dir, n, &entry.key)
                .ok_or_else(|| anyhow!("{}: part {n} vanished while completing", dir.display()))
        })
        .collect::<Result<_>>()?;
    let tokens: Vec<u64> = records
        .iter()
        .map(|r| r["tokens"].as_u64().unwrap_or(0))
        .collect();
    let whole: Vec<TokenPrefix> = names
        .iter()
        .zip(&tokens)
        .map(|(n, &t)| TokenPrefix::whole(dir.join(format!("{n}.tok")), t))
        .collect();
    let stream = TokenFile::open_prefixes(&whole)?;
    let (total, docs) = (stream.num_tokens(), stream.num_docs());
    check_splittable(spec, docs, total)?;
    let want_val = spec.val_fraction > 0.0;
    let (cut, at_boundary) = if want_val {
        choose_cut(docs, |i| stream.doc_offset(i), total, spec.val_fraction)
    } else {
        (total, true)
    };
    // The training tokens: every part up to the cut, the one it falls in up to there (its cut
    // document closed with an EOS, as a preparation in one go closes it).
    let (mut train, mut base, mut train_max) = (Vec::new(), 0u64, None);
    for ((prefix, rec), &t) in whole.iter().zip(&records).zip(&tokens) {
        if base >= cut {
            break;
        }
        let last = base + t >= cut;
        let keep = if last { cut - base } else { t };
        let eos = (last && !at_boundary).then_some(tok.eos_id());
        train.push(TokenPrefix {
            path: prefix.path.clone(),
            tokens: keep,
            eos,
        });
        train_max = train_max
            .max(rec["max_token_id"].as_u64().map(|m| m as u32))
            .max(eos);
        base += t;
    }
    let val = if want_val {
        let path = dir.join("val.tok");
        let mut w = TokFileWriter::create(
            &path,
            dtype_for_vocab(tok.vocab_size()),
            tok.definition_hash(),
        )?;
        // The document holding the cut: the last one starting at or before it.
        let first = partition_point(docs, |i| stream.doc_offset(i) <= cut).saturating_sub(1);
        let mut buf: Vec<i64> = Vec::new();
        let mut doc: Vec<u32> = Vec::new();
        for i in first..docs {
            let end = if i + 1 < docs {
                stream.doc_offset(i + 1)
            } else {
                total
            };
            let start = stream.doc_offset(i).max(cut);
            buf.resize((end - start) as usize, 0);
            stream.copy_window(start, buf.len(), &mut buf);
            doc.clear();
            doc.extend(buf.iter().map(|&t| t as u32));
            w.push_document(&doc)
                .map_err(|e| out_of_room(spec, dir, (total - cut) * 4, e))?;
        }
        Some(w.finish()?)
    } else {
        None
    };
    let train_tokens: u64 = train
        .iter()
        .map(|p| p.tokens + u64::from(p.eos.is_some()))
        .sum();
    let mut meta = json!({
        "key": entry.key,
        "inputs": entry.inputs,
        "tokenizer": { "id": tok.id(), "vocab_size": tok.vocab_size(), "eos_id": tok.eos_id() },
        "dtype_bytes": dtype_for_vocab(tok.vocab_size()),
        "documents": records.iter().map(|r| r["documents"].as_u64().unwrap_or(0)).sum::<u64>(),
        "input_bytes": records.iter().map(|r| r["input_bytes"].as_u64().unwrap_or(0)).sum::<u64>(),
        "split_at_document_boundary": at_boundary,
        "parts": names,
        "train": {
            "tokens": train_tokens,
            "max_token_id": train_max,
            "prefixes": train.iter().map(|p| json!({
                "file": p.path.file_name().map(|f| f.to_string_lossy().into_owned()),
                "tokens": p.tokens,
                "eos": p.eos,
            })).collect::<Vec<_>>(),
        },
        "val": match &val {
            Some(info) => file_part(info)?,
            None => Value::Null,
        },
        "created_unix_s": now_unix_s(),
    });
    for (n, rec) in names.iter().zip(&records) {
        meta[n] = rec.clone();
    }
    crate::sys::durable::write_atomic(&dir.join("meta.json"), &serde_json::to_vec_pretty(&meta)?)?;
    Ok(Prepared {
        train,
        val: val.as_ref().map(|v| v.path.clone()),
        dir: dir.clone(),
        cache_hit: false,
        engine: Some(tok.engine()),
        tokenizer_id: tok.id(),
        vocab_size: tok.vocab_size(),
        eos_id: tok.eos_id(),
        train_tokens,
        val_tokens: val.as_ref().map_or(0, |v| v.num_tokens),
        train_max_id: train_max,
        val_max_id: val.and_then(|v| v.max_token_id),
    })
}

/// A ready token file is used in place: no cache entry, no validation split. Only its largest
/// id may be remembered in the cache directory ([`max_token_id`]).
fn use_token_file(spec: &PrepareSpec, tok: &Tokenizer) -> Result<Prepared> {
    let (path, configured) = (spec.path.as_path(), spec.tokenizer.as_str());
    let tf = TokenFile::open(path)?;
    if let Some(h) = tf.tokenizer_hash() {
        if h != tok.definition_hash() {
            let p = path.display();
            match tokenizer_that_wrote(path, h) {
                Some(name) => bail!(
                    "{p}: was tokenized with a different tokenizer (`{name}`) than \
                     data.tokenizer = `{configured}`; set data.tokenizer={name}, or point \
                     data.path at the text to tokenize it with `{configured}`"
                ),
                None => bail!(
                    "{p}: was tokenized with a different tokenizer than data.tokenizer = \
                     `{configured}`; set data.tokenizer to the one `lockstep prepare` used, or \
                     point data.path at the text to tokenize it again"
                ),
            }
        }
    }
    Ok(Prepared {
        dir: match path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        },
        train: vec![TokenPrefix::whole(path.to_path_buf(), tf.num_tokens())],
        val: None,
        cache_hit: true,
        engine: None,
        tokenizer_id: tok.id(),
        vocab_size: tok.vocab_size(),
        eos_id: tok.eos_id(),
        train_tokens: tf.num_tokens(),
        val_tokens: 0,
        train_max_id: max_token_id(path, &tf, Some(&spec.cache_dir))?,
        val_max_id: None,
    })
}

/// Which tokenizer wrote a token file whose header holds `hash`: a built-in one with that
/// definition hash, else the one its cache entry's `meta.json` names. Only for error messages.
fn tokenizer_that_wrote(path: &Path, hash: [u8; 32]) -> Option<String> {
    let builtin = BUILTIN_NAMES
        .iter()
        .find(|name| Tokenizer::load(name).is_ok_and(|t| t.definition_hash() == hash));
    if let Some(name) = builtin {
        return Some(name.to_string());
    }
    let meta: Value =
        serde_json::from_slice(&fs::read(path.parent()?.join("meta.json")).ok()?).ok()?;
    let id = meta["tokenizer"]["id"].as_str()?;
    Some(id.strip_prefix("hf:").unwrap_or(id).to_string())
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
fn cached(dir: &Path, key: &str, tok: &Tokenizer, want_val: bool) -> Result<Option<Prepared>> {
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
        if super::ids::unchanged(&path, dir.parent())? {
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

/// Removes `<short>.tmp-<pid>` directories left by crashed runs; directories
/// of processes still alive (a concurrent prepare) are left alone.
fn remove_stale_builds(cache_dir: &Path, short: &str) {
    let Ok(entries) = fs::read_dir(cache_dir) else {
        return;
    };
    let prefix = format!("{short}.tmp-");
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name.to_str().and_then(|n| n.strip_prefix(&prefix)) else {
            continue;
        };
        let have_proc = Path::new("/proc/self").exists();
        let alive = have_proc && Path::new("/proc").join(pid).exists();
        if !alive || pid == std::process::id().to_string() {
            let _ = fs::remove_dir_all(entry.path());
        }
    }
}

/// What was read while tokenizing.
#[derive(Default)]
struct Tokenized {
    documents: u64,
    input_bytes: u64,
}

/// Marks the early end of reading once `num_samples` documents are in.
#[derive(Debug)]
struct EnoughDocuments;

impl std::fmt::Display for EnoughDocuments {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("document limit reached")
    }
}

impl std::error::Error for EnoughDocuments {}

/// Tokenizes every document into `out`, EOS after each, in order. Memory stays bounded
/// whatever the corpus: at most [`BATCH_BYTES`] of text (plus the document being read) and
/// its tokens are held at a time; tokens go straight to the file.
fn tokenize_corpus(
    spec: &PrepareSpec,
    tok: &Tokenizer,
    dataset: &Dataset,
    bytes: std::ops::Range<u64>,
    out: &mut TokFileWriter,
) -> Result<Tokenized> {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(spec.num_threads)
        .build()
        .map_err(|e| anyhow!("cannot start {} tokenizer threads: {e}", spec.num_threads))?;
    let share = bytes
        .end
        .min(dataset.total_bytes())
        .saturating_sub(bytes.start);
    let mut progress = Progress::new(spec.progress, share);
    let mut done = Tokenized::default();
    let limit = spec.num_samples.unwrap_or(u64::MAX);
    // Text to encode, in order: (text, whether it ends its document).
    let mut pending: Vec<(String, bool)> = Vec::new();
    let mut pending_bytes = 0usize;
    // The current document's text not queued yet (a document arriving in pieces), and
    // whether its start is in `out` already.
    let mut carry = String::new();
    let mut open = false;
    let mut docs = 0u64;
    // With several threads, a batch is encoded while the next one is read (and the one before
    // written): reading and parsing the input run beside the tokenizer threads.
    let overlap = pool.current_num_threads() > 1;
    std::thread::scope(|scope| -> Result<()> {
        let mut inflight: Option<std::thread::ScopedJoinHandle<'_, Encoded>> = None;
        let mut write = |enc: Encoded, progress: &mut Progress| -> Result<()> {
            write_batch(enc, tok, &mut open, out, &mut done)?;
            progress.update(&done, out.num_tokens());
            Ok(())
        };
        let read = dataset.for_each_document(&spec.text_field, bytes, |text, ends| {
            if docs == limit {
                return Err(EnoughDocuments.into());
            }
            // Cut points in `carry` before the new text were searched already (cut_ok looks
            // one byte either side).
            let searched = carry.len().saturating_sub(2);
            carry.push_str(&text);
            if ends {
                docs += 1;
                pending_bytes += carry.len();
                pending.push((std::mem::take(&mut carry), true));
            } else if let Some(cut) = tok.last_cut(&carry, searched) {
                // A piece of a large document: everything up to the last safe cut goes on; a
                // document with no such point is held until one comes (or it ends).
                let rest = carry.split_off(cut);
                pending_bytes += cut;
                pending.push((std::mem::replace(&mut carry, rest), false));
            }
            if pending_bytes >= BATCH_BYTES {
                let batch = std::mem::take(&mut pending);
                pending_bytes = 0;
                if let Some(h) = inflight.take() {
                    write(join(h)?, &mut progress)?;
                }
                if overlap {
                    let pool = &pool;
                    inflight = Some(scope.spawn(move || encode_batch(pool, tok, batch)));
                } else {
                    write(encode_batch(&pool, tok, batch), &mut progress)?;
                }
            }
            Ok(())
        });
        if let Some(h) = inflight.take() {
            write(join(h)?, &mut progress)?;
        }
        match read {
            Err(e) if e.is::<EnoughDocuments>() => {}
            other => other?,
        }
        write(
            encode_batch(&pool, tok, std::mem::take(&mut pending)),
            &mut progress,
        )
    })?;
    progress.finish(&done, out.num_tokens());
    Ok(done)
}

/// A batch of text (each item: text, whether it ends its document) and the ids of its
/// segments, in order: `items[k]` is the item segment `k` belongs to.
struct Encoded {
    batch: Vec<(String, bool)>,
    items: Vec<usize>,
    ids: Vec<Result<Vec<u32>>>,
}

fn join(h: std::thread::ScopedJoinHandle<'_, Encoded>) -> Result<Encoded> {
    h.join()
        .map_err(|_| anyhow!("a tokenizer thread panicked; this is a bug in lockstep"))
}

/// Tokenizes a batch on the pool: a large text is cut into segments encoded on several
/// threads.
fn encode_batch(pool: &rayon::ThreadPool, tok: &Tokenizer, batch: Vec<(String, bool)>) -> Encoded {
    let segments: Vec<(usize, &str)> = batch
        .iter()
        .enumerate()
        .flat_map(|(i, (text, _))| {
            let pieces = tok.split_for_parallel(text, SEGMENT_BYTES);
            pieces.into_iter().map(move |p| (i, p))
        })
        .collect();
    let ids: Vec<Result<Vec<u32>>> = pool.install(|| {
        segments
            .par_iter()
            .map(|(_, s)| tok.try_encode(s))
            .collect()
    });
    let items = segments.iter().map(|(i, _)| *i).collect();
    Encoded { batch, items, ids }
}

/// Appends an encoded batch to `out` in order: a document's first piece starts it (`open`
/// says whether one is started), the piece that ends it is followed by EOS.
fn write_batch(
    enc: Encoded,
    tok: &Tokenizer,
    open: &mut bool,
    out: &mut TokFileWriter,
    done: &mut Tokenized,
) -> Result<()> {
    let mut segments = enc.items.iter().zip(enc.ids).peekable();
    while let Some((i, ids)) = segments.next() {
        if !*open {
            out.start_document()?;
            *open = true;
        }
        out.push_tokens(&ids?)?;
        // Every item has at least one (possibly empty) segment: after its last one, a
        // document that ends there gets its EOS.
        let item_done = segments.peek().is_none_or(|(next, _)| *next != i);
        if item_done && enc.batch[*i].1 {
            out.push_tokens(&[tok.eos_id()])?;
            *open = false;
            done.documents += 1;
        }
    }
    done.input_bytes += enc.batch.iter().map(|(t, _)| t.len() as u64).sum::<u64>();
    Ok(())
}

/// Tokenization progress: a bar on a terminal (bytes, documents, tokens, speed, ETA), a line
/// every [`Progress::LOG_EVERY`] in a log (stderr not a terminal), nothing when not wanted.
struct Progress {
    bar: Option<ProgressBar>,
    log: bool,
    total: u64,
    start: std::time::Instant,
    last_line: std::time::Instant,
}

impl Progress {
    const LOG_EVERY: std::time::Duration = std::time::Duration::from_secs(30);

    fn new(wanted: bool, total: u64) -> Progress {
        let terminal = std::io::stderr().is_terminal();
        let bar = (wanted && terminal).then(|| {
            let bar = ProgressBar::new(total);
            if let Ok(style) = ProgressStyle::with_template(
                "tokenizing [{bar:30}] {binary_bytes}/{binary_total_bytes} \
                 {binary_bytes_per_sec} {msg} eta {eta}",
            ) {
                bar.set_style(style.progress_chars("=> "));
            }
            bar
        });
        let now = std::time::Instant::now();
        Progress {
            bar,
            log: wanted && !terminal,
            total,
            start: now,
            last_line: now,
        }
    }

    fn counts(done: &Tokenized, tokens: u64) -> String {
        format!(
            "{} documents, {} tokens",
            crate::sys::count(done.documents),
            crate::sys::count(tokens)
        )
    }

    fn update(&mut self, done: &Tokenized, tokens: u64) {
        if let Some(bar) = &self.bar {
            bar.set_position(done.input_bytes);
            bar.set_message(Self::counts(done, tokens));
        } else if self.log && self.last_line.elapsed() >= Self::LOG_EVERY {
            self.last_line = std::time::Instant::now();
            let secs = self.start.elapsed().as_secs_f64().max(1e-3);
            let rate = done.input_bytes as f64 / secs;
            let left = self.total.saturating_sub(done.input_bytes) as f64 / rate.max(1.0);
            eprintln!(
                "[data] tokenizing: {:.1} of {:.1} MB ({:.0}%), {}, {:.1} MB/s, eta {:.0} s",
                done.input_bytes as f64 / 1e6,
                self.total as f64 / 1e6,
                100.0 * done.input_bytes as f64 / self.total.max(1) as f64,
                Self::counts(done, tokens),
                rate / 1e6,
                left
            );
        }
    }

    fn finish(&mut self, done: &Tokenized, tokens: u64) {
        self.update(done, tokens);
        if let Some(bar) = self.bar.take() {
            bar.finish_and_clear();
        }
    }
}

/// Where the validation part starts in a stream of `total` tokens whose `count` documents
/// start at `start(i)`, and whether that is a document boundary.
///
/// The target is the last `val_fraction` of tokens, at least one token on each side. The
/// nearest document start is used if it moves the validation size by at most half; otherwise
/// the cut falls inside a document, so a corpus of one big file still gets a split. It depends
/// on the tokens alone, not on the context length: a change of `training.context_length`
/// finds the same cache entry, and training checks each split against its windows.
fn choose_cut(
    count: u64,
    start: impl Fn(u64) -> u64,
    total: u64,
    val_fraction: f64,
) -> (u64, bool) {
    let wanted = (total as f64 * val_fraction).round() as u64;
    let val = wanted.clamp(1, total - 1);
    let target = total - val;
    let tolerance = val / 2;
    let ok = |b: u64| b >= 1 && total - b >= 1 && b.abs_diff(target) <= tolerance;
    // The first document starting at or after the target.
    let lo = partition_point(count, |i| start(i) < target);
    let below = lo.checked_sub(1).map(&start);
    let above = (lo < count).then(|| start(lo));
    let best = [below, above]
        .into_iter()
        .flatten()
        .filter(|&b| ok(b))
        .min_by_key(|&b| b.abs_diff(target));
    match best {
        Some(b) => (b, true),
        None => (target, false),
    }
}

/// Bytes free to this user on the file system holding `dir` (None where it cannot be read).
fn free_bytes(dir: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    // SAFETY: statvfs fills the zeroed struct; the path is a valid C string.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    (unsafe { libc::statvfs(c.as_ptr(), &mut st) } == 0)
        .then(|| st.f_bavail as u64 * st.f_frsize as u64)
}

/// The error for a cache entry that does not fit: where, how much, and the key to change.
fn room_error(spec: &PrepareSpec, need: u64, free: Option<u64>) -> String {
    let free = free.map_or(String::new(), |f| {
        format!(", {:.1} MB free", f as f64 / 1e6)
    });
    format!(
        "data.cache_dir {}: the token files need {:.1} MB{free}; free space there, or set \
         data.cache_dir to a disk with room (nothing was kept: an entry is written whole or not \
         at all)",
        spec.cache_dir.display(),
        need as f64 / 1e6
    )
}

/// Refuses before writing when the file system holding `tmp` has less room than `need`.
fn check_room(spec: &PrepareSpec, tmp: &Path, need: u64) -> Result<()> {
    match free_bytes(tmp) {
        Some(free) if free < need => bail!("{}", room_error(spec, need, Some(free))),
        _ => Ok(()),
    }
}

/// A write that failed for want of room (another writer took it meanwhile) says what
/// [`check_room`] says; other errors pass unchanged.
fn out_of_room(spec: &PrepareSpec, tmp: &Path, need: u64, e: anyhow::Error) -> anyhow::Error {
    let full = e.chain().any(|c| {
        c.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.raw_os_error() == Some(libc::ENOSPC))
    });
    if full {
        let why = room_error(spec, need, free_bytes(tmp));
        e.context(why)
    } else {
        e
    }
}

/// Fails unless the corpus has documents and, with a validation split, tokens for both sides.
fn check_splittable(spec: &PrepareSpec, documents: u64, tokens: u64) -> Result<()> {
    if documents == 0 {
        bail!(
            "{}: the dataset has no documents (all .jsonl/.parquet files are empty); add text",
            spec.path.display()
        );
    }
    if spec.val_fraction > 0.0 && tokens < 2 {
        bail!(
            "{}: the dataset has only {tokens} token(s), too few to split off validation data; \
             set data.val_fraction to 0 or add text",
            spec.path.display()
        );
    }
    Ok(())
}

/// A token file's record in `meta.json`: counts, the largest id, and the file's stamp and
/// BLAKE3 so a changed file is never trusted with them.
fn file_part(info: &TokFileInfo) -> Result<Value> {
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

/// Token counts and largest ids of a new cache entry.
struct Built {
    train_tokens: u64,
    val_tokens: u64,
    train_max_id: Option<u32>,
    val_max_id: Option<u32>,
}

/// Tokenizes and writes `train.tok`, `val.tok` and `meta.json` into `tmp`: the tokens
/// stream into `train.tok`, whose tail then becomes `val.tok` ([`TokFileWriter::finish_split`]).
fn build(
    spec: &PrepareSpec,
    tok: &Tokenizer,
    dataset: &Dataset,
    tmp: &Path,
    key: &str,
    inputs: Value,
) -> Result<Built> {
    let want_val = spec.val_fraction > 0.0;
    let dtype = dtype_for_vocab(tok.vocab_size());
    // At least this much: every tokenizer here packs fewer than 8 bytes of text into a token
    // on average (English: ~4). A full disk found while writing says the same below.
    let need = dataset.total_bytes() / 8 * u64::from(dtype);
    check_room(spec, tmp, need)?;
    let mut writer = TokFileWriter::create(&tmp.join("train.tok"), dtype, tok.definition_hash())?;
    let no_room = |e: anyhow::Error, written: u64| out_of_room(spec, tmp, written.max(need), e);
    let corpus = match tokenize_corpus(spec, tok, dataset, 0..u64::MAX, &mut writer) {
        Ok(c) => c,
        Err(e) => {
            let written = writer.num_tokens() * u64::from(dtype);
            return Err(no_room(e, written));
        }
    };
    let total = writer.num_tokens();
    let written = total * u64::from(dtype);
    check_splittable(spec, corpus.documents, total)?;
    let (train, val) = if want_val {
        let (train, val) = writer
            .finish_split(&tmp.join("val.tok"), tok.eos_id(), |starts, total| {
                choose_cut(starts.len(), |i| starts.get(i), total, spec.val_fraction).0
            })
            .map_err(|e| no_room(e, written))?;
        (train, Some(val))
    } else {
        (writer.finish().map_err(|e| no_room(e, written))?, None)
    };
    // The split document's head got an EOS of its own: one token more than the stream.
    let at_boundary = train.num_tokens + val.as_ref().map_or(0, |v| v.num_tokens) == total;

    let meta = json!({
        "key": key,
        "inputs": inputs,
        "tokenizer": { "id": tok.id(), "vocab_size": tok.vocab_size(), "eos_id": tok.eos_id() },
        "dtype_bytes": dtype,
        "documents": corpus.documents,
        "input_bytes": corpus.input_bytes,
        "split_at_document_boundary": at_boundary,
        "train": file_part(&train)?,
        "val": val.as_ref().map(file_part).transpose()?,
        "created_unix_s": now_unix_s(),
    });
    let meta_path = tmp.join("meta.json");
    fs::write(&meta_path, serde_json::to_vec_pretty(&meta)?)
        .with_context(|| format!("{}: cannot write", meta_path.display()))?;
    Ok(Built {
        train_tokens: train.num_tokens,
        val_tokens: val.as_ref().map_or(0, |v| v.num_tokens),
        train_max_id: train.max_token_id,
        val_max_id: val.and_then(|v| v.max_token_id),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::sources::list_files;

    fn spec(path: &Path, cache: &Path) -> PrepareSpec {
        PrepareSpec {
            tokenizer: "gpt2".into(),
            path: path.to_path_buf(),
            text_field: "text".into(),
            val_fraction: 0.1,
            num_samples: None,
            cache_dir: cache.to_path_buf(),
            num_threads: 2,
            progress: false,
        }
    }

    fn corpus(dir: &Path) -> PathBuf {
        let data = dir.join("corpus");
        fs::create_dir_all(data.join("more")).unwrap();
        for i in 0..6 {
            let text = format!("Document {i}. ").repeat(40 + i * 7);
            fs::write(data.join(format!("d{i}.txt")), text).unwrap();
        }
        fs::write(data.join("more/e.txt"), "Last one, short.").unwrap();
        data
    }

    fn all_tokens(path: &Path) -> Vec<u32> {
        let f = TokenFile::open(path).unwrap();
        (0..f.num_tokens()).map(|i| f.get(i)).collect()
    }

    fn docs_end_with_eos(path: &Path, eos: u32) {
        let f = TokenFile::open(path).unwrap();
        assert!(f.num_docs() > 0);
        for d in 0..f.num_docs() {
            let end = if d + 1 < f.num_docs() {
                f.doc_offset(d + 1)
            } else {
                f.num_tokens()
            };
            assert_eq!(f.get(end - 1), eos, "document {d} of {}", path.display());
        }
    }

    #[test]
    fn second_run_is_a_cache_hit() {
        let dir = tempfile::tempdir().unwrap();
        let data = corpus(dir.path());
        let s = spec(&data, &dir.path().join("cache"));
        let a = prepare(&s).unwrap();
        assert!(!a.cache_hit);
        assert_eq!(a.eos_id, 50256);
        let train = fs::read(&a.train[0].path).unwrap();
        let val = fs::read(a.val.as_ref().unwrap()).unwrap();
        assert!(a.dir.join("meta.json").is_file());

        let b = prepare(&s).unwrap();
        assert!(b.cache_hit);
        assert_eq!(b.dir, a.dir);
        assert_eq!(
            (b.train_tokens, b.val_tokens),
            (a.train_tokens, a.val_tokens)
        );
        assert_eq!(fs::read(&b.train[0].path).unwrap(), train);
        assert_eq!(fs::read(b.val.unwrap()).unwrap(), val);
        // Only the entry itself is left in the cache, no temporary builds.
        assert_eq!(fs::read_dir(dir.path().join("cache")).unwrap().count(), 1);
    }

    #[test]
    fn changed_file_is_a_miss() {
        let dir = tempfile::tempdir().unwrap();
        let data = corpus(dir.path());
        let s = spec(&data, &dir.path().join("cache"));
        let a = prepare(&s).unwrap();
        fs::write(data.join("d0.txt"), "Document changed. ".repeat(40)).unwrap();
        let b = prepare(&s).unwrap();
        assert!(!b.cache_hit);
        assert_ne!(a.dir, b.dir);
        assert_ne!(all_tokens(&a.train[0].path), all_tokens(&b.train[0].path));
        // Same size, new mtime only.
        let f = fs::File::options()
            .write(true)
            .open(data.join("d0.txt"))
            .unwrap();
        f.set_modified(UNIX_EPOCH + std::time::Duration::from_secs(12345))
            .unwrap();
        assert!(!prepare(&s).unwrap().cache_hit);
    }

    #[test]
    fn split_adds_up_and_documents_end_with_eos() {
        let dir = tempfile::tempdir().unwrap();
        let data = corpus(dir.path());
        let tok = Tokenizer::load("gpt2").unwrap();
        let mut expected = Vec::new();
        for f in list_files(&data).unwrap() {
            expected.extend(tok.encode(&fs::read_to_string(f).unwrap()));
            expected.push(50256);
        }
        let s = spec(&data, &dir.path().join("cache"));
        let p = prepare(&s).unwrap();
        let (train, val) = (
            all_tokens(&p.train[0].path),
            all_tokens(p.val.as_ref().unwrap()),
        );
        docs_end_with_eos(&p.train[0].path, 50256);
        docs_end_with_eos(p.val.as_ref().unwrap(), 50256);
        let total = expected.len() as u64;
        let meta: Value =
            serde_json::from_slice(&fs::read(p.dir.join("meta.json")).unwrap()).unwrap();
        if meta["split_at_document_boundary"].as_bool().unwrap() {
            assert_eq!(p.train_tokens + p.val_tokens, total);
            assert_eq!([train, val].concat(), expected);
        } else {
            assert_eq!(p.train_tokens + p.val_tokens, total + 1);
        }
        let share = p.val_tokens as f64 / total as f64;
        assert!((0.05..=0.15).contains(&share), "val share {share}");
    }

    #[test]
    fn one_document_is_split_inside() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("one.txt");
        fs::write(&file, "word ".repeat(1000)).unwrap();
        let p = prepare(&spec(&file, &dir.path().join("cache"))).unwrap();
        let whole = Tokenizer::load("gpt2")
            .unwrap()
            .encode(&"word ".repeat(1000));
        let total = whole.len() as u64 + 1;
        // One extra EOS closes the train half of the split document.
        assert_eq!(p.train_tokens + p.val_tokens, total + 1);
        assert_eq!(p.val_tokens, (total as f64 * 0.1).round() as u64);
        let train = all_tokens(&p.train[0].path);
        let val = all_tokens(p.val.as_ref().unwrap());
        assert_eq!(
            [&train[..train.len() - 1], &val[..]].concat(),
            [whole, vec![50256]].concat()
        );
        docs_end_with_eos(&p.train[0].path, 50256);
    }

    #[test]
    fn a_large_text_file_streams_in_pieces_with_the_same_tokens() {
        // Larger than the unit tests' 64 KiB .txt piece: read, cut and encoded in pieces, with
        // characters of 2, 3 and 4 bytes across piece boundaries, long lines without a break,
        // and a byte-order mark in front.
        let dir = tempfile::tempdir().unwrap();
        let mut text = String::new();
        for i in 0..6000 {
            text.push_str(&format!("word{i} café 日本 🦀 and more words "));
            if i % 500 == 0 {
                text.push_str("end of a line.\n");
            }
        }
        let file = dir.path().join("big.txt");
        fs::write(&file, format!("\u{feff}{text}")).unwrap();
        assert!(fs::metadata(&file).unwrap().len() > 3 * (1 << 16));
        for tokenizer in ["gpt2", "o200k_base"] {
            let mut s = spec(&file, &dir.path().join(format!("cache-{tokenizer}")));
            s.val_fraction = 0.0;
            s.tokenizer = tokenizer.into();
            let p = prepare(&s).unwrap();
            let tok = Tokenizer::load(tokenizer).unwrap();
            let mut expected = tok.encode(&text);
            expected.push(tok.eos_id());
            assert_eq!(all_tokens(&p.train[0].path), expected, "{tokenizer}");
            assert_eq!(TokenFile::open(&p.train[0].path).unwrap().num_docs(), 1);
        }
    }

    #[test]
    fn jsonl_text_field_and_sample_limit() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("d.jsonl");
        let lines: Vec<String> = (0..50)
            .map(|i| format!("{{\"id\": {i}, \"content\": \"row {i} says hello\"}}"))
            .collect();
        fs::write(&file, lines.join("\n")).unwrap();
        let mut s = spec(&file, &dir.path().join("cache"));
        s.text_field = "content".into();
        s.val_fraction = 0.0;
        s.num_samples = Some(3);
        let p = prepare(&s).unwrap();
        assert!(p.val.is_none());
        let tok = Tokenizer::load("gpt2").unwrap();
        let mut expected = Vec::new();
        for i in 0..3 {
            expected.extend(tok.encode(&format!("row {i} says hello")));
            expected.push(50256);
        }
        assert_eq!(all_tokens(&p.train[0].path), expected);
        assert_eq!(TokenFile::open(&p.train[0].path).unwrap().num_docs(), 3);

        s.text_field = "text".into();
        s.num_samples = None;
        let err = prepare(&s).unwrap_err().to_string();
        assert!(
            err.contains("d.jsonl:1") && err.contains("content"),
            "{err}"
        );
    }

    #[test]
    fn token_file_is_used_directly() {
        let dir = tempfile::tempdir().unwrap();
        let data = corpus(dir.path());
        let p = prepare(&spec(&data, &dir.path().join("cache"))).unwrap();
        let direct = prepare(&spec(&p.train[0].path, &dir.path().join("other"))).unwrap();
        assert!(direct.cache_hit && direct.val.is_none());
        assert_eq!(
            (direct.train.clone(), direct.train_tokens),
            (p.train.clone(), p.train_tokens)
        );
        assert!(!dir.path().join("other").exists());

        let mut s = spec(&p.train[0].path, &dir.path().join("other"));
        s.tokenizer = "cl100k_base".into();
        let err = prepare(&s).unwrap_err().to_string();
        assert!(
            err.contains("different tokenizer") && err.contains("set data.tokenizer=gpt2"),
            "{err}"
        );
    }

    #[test]
    fn stale_builds_are_removed() {
        let dir = tempfile::tempdir().unwrap();
        let data = corpus(dir.path());
        let cache = dir.path().join("cache");
        let first = prepare(&spec(&data, &cache)).unwrap();
        let short = first.dir.file_name().unwrap().to_str().unwrap().to_string();
        fs::remove_dir_all(&first.dir).unwrap();
        // pid 0 is never a live user process.
        let stale = cache.join(format!("{short}.tmp-0"));
        fs::create_dir_all(&stale).unwrap();
        let again = prepare(&spec(&data, &cache)).unwrap();
        assert!(!again.cache_hit && !stale.exists());
    }

    #[test]
    fn cut_rules() {
        let cut = |starts: &[u64], total, fraction| {
            choose_cut(starts.len() as u64, |i| starts[i as usize], total, fraction)
        };
        // Boundary close to the 10% target is taken.
        assert_eq!(cut(&[0, 50, 88, 95], 100, 0.1), (88, true));
        // Far boundaries are not: the cut falls inside the document.
        assert_eq!(cut(&[0, 50], 100, 0.1), (90, false));
        // A small fraction still leaves a token on each side.
        assert_eq!(cut(&[0], 100, 0.001), (99, false));
        // Tiny corpora still split.
        assert_eq!(cut(&[0], 2, 0.5), (1, false));
    }
}
