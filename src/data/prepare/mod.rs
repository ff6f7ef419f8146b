//! Tokenize a text dataset once into `.tok` files kept in a content-addressed
//! cache directory, so every later run (and every rank) just memory-maps them.
//!
//! The entry points are here: [`prepare`] (in one go, or a ready token file used in place) and
//! [`prepare_part`] (one part of a preparation spread over machines). The rest, by concern:
//! `cache` (an entry: its key, layout, `meta.json`, whether it is complete and intact),
//! `build` (an entry prepared in one go, written whole or not at all), `parts` (an entry
//! prepared in parts, completed by the last one), `encode` (tokenizing the corpus in
//! parallel), `split` (where the validation tokens start) and `room` (disk space).

mod build;
mod cache;
mod encode;
mod parts;
mod prepared;
mod room;
mod shard;
mod spec;
mod split;
#[cfg(test)]
mod tests;

use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde_json::Value;

use super::hub::resolve_tokenizer;
use super::ids::max_token_id;
use super::tokenizer::{Tokenizer, BUILTIN_NAMES};
use super::tokfile::{is_token_file, TokenFile, TokenPrefix};
use build::build_entry;
use cache::{cached, missing_parts, part_record, parts_present, Entry};
use parts::{complete, write_part};

pub use cache::CACHE_FORMAT_VERSION;
pub use prepared::Prepared;
pub use shard::Shard;
pub use spec::PrepareSpec;

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

    build_entry(spec, &tok, &entry)
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
