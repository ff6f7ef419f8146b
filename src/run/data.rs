//! The data of a run: its sources (`data.path` or `data.sources`), prepared (tokenized and
//! cached) once per node, the model shape checked against them, and the identity of the data
//! that checkpoints record.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Result;

use crate::config::Config;
use crate::data::prepare::{prepare, prepare_part, PartOutcome, PrepareSpec, Prepared, Shard};
use crate::data::tokfile::TokenFile;
use crate::model::LlamaShape;

/// One source of the run's data: `data.path`, or an entry of `data.sources`.
#[derive(Debug, Clone)]
pub struct SourceSpec {
    /// For logs, metrics and TensorBoard tags.
    pub name: String,
    /// Relative sampling weight (1 for `data.path`).
    pub weight: f64,
    pub prepare: PrepareSpec,
}

/// A source with its token files.
#[derive(Debug, Clone)]
pub struct DataSource {
    pub name: String,
    pub weight: f64,
    pub prepared: Prepared,
}

/// What identifies the data a run trains on, as recorded in every checkpoint: per source its
/// name, weight, tokenizer, token counts, and a hash of three samples of 32k of its training
/// tokens (start, middle, end) as u32 little-endian; and the context length, which cuts the
/// tokens into samples (another one moves every sample's window and the data order).
/// Path-, time- and layout-free, so a copied or re-prepared corpus (in one go or in parts) is
/// the same data, and cheap on any corpus size.
pub fn data_identity(sources: &[DataSource], context_length: usize) -> Result<serde_json::Value> {
    const SAMPLE: u64 = 32 << 10;
    let mut out = Vec::new();
    for s in sources {
        let p = &s.prepared;
        let tokens = TokenFile::open_prefixes(&p.train)?;
        let n = tokens.num_tokens();
        let mut hasher = blake3::Hasher::new();
        let mut buf = vec![0i64; SAMPLE.min(n) as usize];
        for at in [0, n.saturating_sub(SAMPLE) / 2, n.saturating_sub(SAMPLE)] {
            tokens.copy_window(at, buf.len(), &mut buf);
            for &t in &buf {
                hasher.update(&(t as u32).to_le_bytes());
            }
        }
        out.push(serde_json::json!({
            "name": s.name,
            "weight": s.weight,
            "tokenizer": p.tokenizer_id,
            "train_tokens": p.train_tokens,
            "val_tokens": p.val_tokens,
            "token_blake3": hasher.finalize().to_hex().as_str(),
            "context_length": context_length,
        }));
    }
    Ok(serde_json::Value::Array(out))
}

/// How the data `now` differs from the checkpoint's `then` ([`data_identity`]), in words; None
/// when they are the same.
pub fn data_difference(then: &serde_json::Value, now: &serde_json::Value) -> Option<String> {
    if then == now {
        return None;
    }
    let (a, b) = (
        then.as_array().cloned().unwrap_or_default(),
        now.as_array().cloned().unwrap_or_default(),
    );
    if a.len() != b.len() {
        return Some(format!("{} source(s) then, {} now", a.len(), b.len()));
    }
    let mut diffs = Vec::new();
    // Checkpoints from before the context length was recorded do not compare it.
    let context = |v: &[serde_json::Value]| v.first().map(|s| s["context_length"].clone());
    if let (Some(x), Some(y)) = (context(&a), context(&b)) {
        if !x.is_null() && x != y {
            diffs.push(format!(
                "training.context_length {x} then, {y} now: every sample's window and the data \
                 order move"
            ));
        }
    }
    for (x, y) in a.iter().zip(&b) {
        let name = y["name"].as_str().unwrap_or("?");
        if x.get("tokenizer").is_some() && x["tokenizer"] != y["tokenizer"] {
            // The counts and the content differ with it; the tokenizer is the difference.
            diffs.push(format!(
                "source {name}: tokenizer {} then, {} now: its ids stand for other text; set \
                 data.tokenizer back",
                x["tokenizer"], y["tokenizer"]
            ));
            continue;
        }
        for (key, what) in [
            ("name", "name"),
            ("weight", "weight"),
            ("tokenizer", "tokenizer"),
            ("train_tokens", "training tokens"),
            ("val_tokens", "validation tokens"),
            ("token_blake3", "token content"),
        ] {
            // A checkpoint of an older lockstep hashed file bytes (`sample_blake3`), which
            // this one does not compare: its counts still are.
            if x.get(key).is_some() && x[key] != y[key] {
                diffs.push(if key == "token_blake3" {
                    format!("source {name}: {what} differs")
                } else {
                    format!("source {name}: {what} {} then, {} now", x[key], y[key])
                });
            }
        }
    }
    Some(diffs.join("; "))
}

/// The run's sources: the entries of `data.sources`, else `data.path` alone. Each is prepared
/// and cached on its own, so adding a source never tokenizes the others again.
pub fn source_specs(cfg: &Config, progress: bool) -> Vec<SourceSpec> {
    let d = &cfg.data;
    let spec = |path: &str, text_field: Option<&str>| PrepareSpec {
        tokenizer: d.tokenizer.clone(),
        path: PathBuf::from(path),
        text_field: text_field.unwrap_or(&d.text_field).to_string(),
        val_fraction: d.val_fraction,
        num_samples: d.num_samples,
        cache_dir: PathBuf::from(&d.cache_dir),
        num_threads: cfg.training.num_workers,
        progress,
    };
    if d.sources.is_empty() {
        let name = crate::data::source_names(&[(None, d.path.as_str())]).remove(0);
        return vec![SourceSpec {
            name,
            weight: 1.0,
            prepare: spec(&d.path, None),
        }];
    }
    let named: Vec<(Option<&str>, &str)> = d
        .sources
        .iter()
        .map(|s| (s.name.as_deref(), s.path.as_str()))
        .collect();
    let names = crate::data::source_names(&named);
    d.sources
        .iter()
        .zip(names)
        .map(|(s, name)| SourceSpec {
            name,
            weight: s.weight,
            prepare: spec(&s.path, s.text_field.as_deref()),
        })
        .collect()
}

/// Every source's token files, prepared or found in the cache, without a word (ranks that
/// find what local rank 0 or the launcher prepared).
pub fn prepare_quietly(cfg: &Config) -> Result<Vec<DataSource>> {
    source_specs(cfg, false)
        .into_iter()
        .map(|s| {
            Ok(DataSource {
                prepared: prepare(&s.prepare)?,
                name: s.name,
                weight: s.weight,
            })
        })
        .collect()
}

/// Prepares (or finds cached) every source's token files and says which.
pub fn prepare_data(cfg: &Config, tag: &str) -> Result<Vec<DataSource>> {
    let mixture = !cfg.data.sources.is_empty();
    let mut out = Vec::new();
    for (i, s) in source_specs(cfg, true).into_iter().enumerate() {
        let start = Instant::now();
        let p = prepare(&s.prepare).map_err(|e| {
            if mixture {
                e.context(format!("data.sources[{i}] ({})", s.name))
            } else {
                e
            }
        })?;
        let what = if p.cache_hit { "cache hit" } else { "prepared" };
        let engine = p
            .engine
            .as_ref()
            .map_or(String::new(), |e| format!(", encoded by {e}"));
        let which = if mixture {
            format!(" {} (weight {})", s.name, s.weight)
        } else {
            String::new()
        };
        println!(
            "{tag} Data{which}: {what} {} ({} train + {} val tokens, tokenizer {}{engine}, \
             {:.1}s)",
            p.dir.display(),
            p.train_tokens,
            p.val_tokens,
            p.tokenizer_id,
            start.elapsed().as_secs_f64()
        );
        out.push(DataSource {
            name: s.name,
            weight: s.weight,
            prepared: p,
        });
    }
    Ok(out)
}

/// `lockstep prepare --shard I/N`: part I of every source into its shared cache entry, which
/// the last part written completes; says what was written and which parts are still missing.
pub fn prepare_parts(cfg: &Config, tag: &str, shard: Shard) -> Result<()> {
    let mixture = !cfg.data.sources.is_empty();
    let (i, n) = (shard.index, shard.count);
    for (k, s) in source_specs(cfg, true).into_iter().enumerate() {
        let start = Instant::now();
        let which = if mixture {
            format!(" {}", s.name)
        } else {
            String::new()
        };
        let outcome = prepare_part(&s.prepare, shard).map_err(|e| {
            if mixture {
                e.context(format!("data.sources[{k}] ({})", s.name))
            } else {
                e
            }
        })?;
        let secs = start.elapsed().as_secs_f64();
        match outcome {
            PartOutcome::Complete(p) => println!(
                "{tag} Data{which}: part {i}/{n} there; the entry is complete: {} ({} train + {} \
                 val tokens, tokenizer {}, {secs:.1}s)",
                p.dir.display(),
                p.train_tokens,
                p.val_tokens,
                p.tokenizer_id
            ),
            PartOutcome::Waiting {
                dir,
                tokens,
                missing,
            } => println!(
                "{tag} Data{which}: part {i}/{n} written to {} ({tokens} tokens, {secs:.1}s); \
                 the entry completes when parts {} of {n} are written too (`lockstep prepare \
                 --shard J/{n}` for each)",
                dir.display(),
                missing
                    .iter()
                    .map(u64::to_string)
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        }
    }
    Ok(())
}

/// The model's shape, checked against the data: the vocabulary covers the tokenizer's and
/// every source's token ids.
pub fn model_shape(cfg: &Config, sources: &[DataSource]) -> Result<LlamaShape> {
    let data = &sources
        .first()
        .ok_or_else(|| anyhow::anyhow!("no data source"))?
        .prepared;
    let vocab = data.vocab_size;
    let shape = crate::plan::shape_with(cfg, || Ok(vocab))?;
    anyhow::ensure!(
        shape.vocab_size >= vocab,
        "the model's vocabulary ({}) is smaller than the tokenizer's ({vocab}); the tokenizer in data.tokenizer does not fit this model",
        shape.vocab_size
    );
    for s in sources {
        s.prepared.check_ids_fit(shape.vocab_size)?;
    }
    Ok(shape)
}
