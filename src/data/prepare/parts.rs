//! An entry prepared in parts (`prepare --shard I/N`): each part tokenized into its own token
//! file and record, and the entry completed when the last part is there (the validation tail
//! split off into `val.tok`, `meta.json` naming the parts' training prefixes).

use std::fs;
use std::path::Path;

use anyhow::{anyhow, Result};
use serde_json::{json, Value};

use super::super::ids::MaxIdRecord;
use super::super::tokenizer::Tokenizer;
use super::super::tokfile::{
    dtype_for_vocab, partition_point, TokFileInfo, TokFileWriter, TokenFile, TokenPrefix,
};
use super::cache::{file_part, part_record, Entry};
use super::encode::tokenize_corpus;
use super::encode::Tokenized;
use super::prepared::Prepared;
use super::room::out_of_room;
use super::shard::{part_name, Shard};
use super::spec::PrepareSpec;
use super::split::{check_splittable, choose_cut};
use crate::sys::durable::file_blake3;

/// Tokenizes part `shard` into `<dir>/part-….tok` and records it in `part-….json`; returns
/// its token count.
pub(super) fn write_part(
    spec: &PrepareSpec,
    tok: &Tokenizer,
    entry: &Entry,
    shard: Shard,
) -> Result<u64> {
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
pub(super) fn complete(
    spec: &PrepareSpec,
    tok: &Tokenizer,
    entry: &Entry,
    count: u64,
) -> Result<Prepared> {
    let dir = &entry.dir;
    let names: Vec<String> = (0..count).map(|i| part_name(i, count)).collect();
    let records = part_records(entry, &names)?;
    let whole: Vec<TokenPrefix> = names
        .iter()
        .zip(&records)
        .map(|(n, r)| {
            let tokens = r["tokens"].as_u64().unwrap_or(0);
            TokenPrefix::whole(dir.join(format!("{n}.tok")), tokens)
        })
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
    let (train, train_max) = train_up_to(
        &whole,
        &records,
        cut,
        (!at_boundary).then_some(tok.eos_id()),
    );
    let val = match want_val {
        true => Some(write_val(spec, tok, dir, &stream, cut)?),
        false => None,
    };
    let train_tokens: u64 = train
        .iter()
        .map(|p| p.tokens + u64::from(p.eos.is_some()))
        .sum();
    let sum = |field: &str| records.iter().map(|r| r[field].as_u64().unwrap_or(0)).sum();
    let read = Tokenized {
        documents: sum("documents"),
        input_bytes: sum("input_bytes"),
    };
    let train_record = json!({
        "tokens": train_tokens,
        "max_token_id": train_max,
        "prefixes": train.iter().map(|p| json!({
            "file": p.path.file_name().map(|f| f.to_string_lossy().into_owned()),
            "tokens": p.tokens,
            "eos": p.eos,
        })).collect::<Vec<_>>(),
    });
    let val_record = val.as_ref().map(file_part).transpose()?.into();
    let mut meta = entry.meta(
        tok,
        &read,
        at_boundary,
        Some(&names),
        train_record,
        val_record,
    );
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

/// The records of the parts `names` of `entry`, each still valid.
fn part_records(entry: &Entry, names: &[String]) -> Result<Vec<Value>> {
    let dir = &entry.dir;
    names
        .iter()
        .map(|n| {
            part_record(dir, n, &entry.key)
                .ok_or_else(|| anyhow!("{}: part {n} vanished while completing", dir.display()))
        })
        .collect()
}

/// The training tokens of the parts (`whole`, with their `records`) read as one stream cut at
/// token `cut`: every part up to the cut, the one it falls in up to there, its cut document
/// closed with `eos` when the cut is inside one (as a preparation in one go closes it); and
/// their largest id.
fn train_up_to(
    whole: &[TokenPrefix],
    records: &[Value],
    cut: u64,
    eos: Option<u32>,
) -> (Vec<TokenPrefix>, Option<u32>) {
    let (mut train, mut base, mut train_max) = (Vec::new(), 0u64, None);
    for (prefix, rec) in whole.iter().zip(records) {
        if base >= cut {
            break;
        }
        let t = prefix.tokens;
        let last = base + t >= cut;
        let keep = if last { cut - base } else { t };
        let eos = if last { eos } else { None };
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
    (train, train_max)
}

/// Writes `<dir>/val.tok`: the documents of `stream` from token `cut` on (the one holding the
/// cut from there).
fn write_val(
    spec: &PrepareSpec,
    tok: &Tokenizer,
    dir: &Path,
    stream: &TokenFile,
    cut: u64,
) -> Result<TokFileInfo> {
    let (total, docs) = (stream.num_tokens(), stream.num_docs());
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
    w.finish()
}
