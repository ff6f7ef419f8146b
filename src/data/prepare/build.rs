//! An entry prepared in one go: the corpus tokenized into `train.tok`, whose tail becomes
//! `val.tok`, with `meta.json`, in a staging directory that becomes the entry whole.

use std::fs;
use std::path::Path;

use anyhow::{Context, Result};
use serde_json::{json, Value};

use super::super::sources::Dataset;
use super::super::tokenizer::Tokenizer;
use super::super::tokfile::{dtype_for_vocab, TokFileWriter};
use super::cache::{file_part, now_unix_s};
use super::encode::tokenize_corpus;
use super::room::{check_room, out_of_room};
use super::split::{check_splittable, choose_cut};
use super::PrepareSpec;

/// Token counts and largest ids of a new cache entry.
pub(super) struct Built {
    pub(super) train_tokens: u64,
    pub(super) val_tokens: u64,
    pub(super) train_max_id: Option<u32>,
    pub(super) val_max_id: Option<u32>,
}

/// Tokenizes and writes `train.tok`, `val.tok` and `meta.json` into `tmp`: the tokens
/// stream into `train.tok`, whose tail then becomes `val.tok` ([`TokFileWriter::finish_split`]).
pub(super) fn build(
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
