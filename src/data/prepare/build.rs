//! An entry prepared in one go: the corpus tokenized into `train.tok`, whose tail becomes
//! `val.tok`, with `meta.json`, in a staging directory of this process's own
//! (`<short>.tmp-<pid>`) that becomes the entry whole ([`AtomicDir`]), and the staging
//! directories killed runs left.

use std::fs;
use std::path::Path;

use anyhow::Result;

use super::super::tokenizer::Tokenizer;
use super::super::tokfile::{dtype_for_vocab, TokFileWriter, TokenPrefix};
use super::cache::{file_part, Entry};
use super::encode::tokenize_corpus;
use super::prepared::Prepared;
use super::room::{check_room, out_of_room};
use super::spec::PrepareSpec;
use super::split::{check_splittable, choose_cut};
use crate::sys::durable::{write_synced, AtomicDir};

/// What a staging directory's name adds to its entry's (`<short>.tmp-<pid>`).
const STAGING: &str = ".tmp-";

/// Prepares `entry` in one go. Killed runs' staging directories are removed first; the new
/// one becomes the entry only once complete and fsynced, replacing a leftover invalid entry
/// (or one a concurrent run just finished, which holds identical data); on an error it is
/// removed and the cache is left as it was.
pub(super) fn build_entry(spec: &PrepareSpec, tok: &Tokenizer, entry: &Entry) -> Result<Prepared> {
    remove_stale_builds(&spec.cache_dir, entry.short());
    let staging = AtomicDir::begin_own(&entry.dir, &format!("{STAGING}{}", std::process::id()))?;
    let built = match build(spec, tok, entry, staging.path()) {
        Ok(b) => b,
        Err(e) => {
            staging.abandon();
            return Err(e);
        }
    };
    let dir = staging.commit()?;
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

/// Removes `<short>.tmp-<pid>` directories left by crashed runs (and the `.replaced` entry
/// one may have moved aside); directories of processes still alive (a concurrent prepare) are
/// left alone.
fn remove_stale_builds(cache_dir: &Path, short: &str) {
    let Ok(entries) = fs::read_dir(cache_dir) else {
        return;
    };
    let prefix = format!("{short}{STAGING}");
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name.to_str().and_then(|n| n.strip_prefix(&prefix)) else {
            continue;
        };
        let pid = pid.strip_suffix(".replaced").unwrap_or(pid);
        let have_proc = Path::new("/proc/self").exists();
        let alive = have_proc && Path::new("/proc").join(pid).exists();
        if !alive || pid == std::process::id().to_string() {
            let _ = fs::remove_dir_all(entry.path());
        }
    }
}

/// Token counts and largest ids of a new cache entry.
struct Built {
    train_tokens: u64,
    val_tokens: u64,
    train_max_id: Option<u32>,
    val_max_id: Option<u32>,
}

/// Tokenizes and writes `train.tok`, `val.tok` and `meta.json` into `tmp`, each fsynced: the
/// tokens stream into `train.tok`, whose tail then becomes `val.tok`
/// ([`TokFileWriter::finish_split`]).
fn build(spec: &PrepareSpec, tok: &Tokenizer, entry: &Entry, tmp: &Path) -> Result<Built> {
    let dataset = &entry.dataset;
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

    let meta = entry.meta(
        tok,
        &corpus,
        at_boundary,
        None,
        file_part(&train)?,
        val.as_ref().map(file_part).transpose()?.into(),
    );
    write_synced(&tmp.join("meta.json"), &serde_json::to_vec_pretty(&meta)?)?;
    Ok(Built {
        train_tokens: train.num_tokens,
        val_tokens: val.as_ref().map_or(0, |v| v.num_tokens),
        train_max_id: train.max_token_id,
        val_max_id: val.and_then(|v| v.max_token_id),
    })
}
