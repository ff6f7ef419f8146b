//! `lockstep eval --model DIR --data FILE`: mean next-token loss and perplexity of a Hugging Face
//! Llama directory on a file. Deterministic: the token stream (a `.tok`/`.bin` file, or text
//! tokenized as `prepare` does, EOS after every document) is cut from its start into consecutive,
//! non-overlapping windows of T + 1 tokens (T predictions each; a shorter tail is dropped), taken
//! in order in batches. The loss is the mean over every predicted token.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, ensure, Result};
use clap::Args;
use serde_json::json;
use tch::{Device, Tensor};

use super::{Inference, ModelFlags, TrainedWith};
use crate::config::usage;
use crate::data::sources::{list_files, read_documents};
use crate::data::tokenizer::Tokenizer;
use crate::data::tokfile::{is_token_file, TokenFile};
use crate::model::Llama;

#[derive(Args, Debug, Clone)]
pub struct EvalArgs {
    #[command(flatten)]
    pub open: ModelFlags,
    /// A .txt/.jsonl file (or a directory of them), or a token file (.tok, nanoGPT .bin,
    /// llm.c shard).
    #[arg(long, value_name = "FILE")]
    pub data: PathBuf,
    /// Print one JSON object instead of a line of text.
    #[arg(long)]
    pub json: bool,
    /// Windows per forward pass.
    #[arg(long, value_name = "B", default_value_t = 8)]
    pub batch_size: usize,
    /// Predictions per window (T); default: the context length the model was trained with
    /// (lockstep.json / trainer.json), else min(max_position_embeddings, 2048).
    #[arg(long, value_name = "T")]
    pub context_length: Option<usize>,
    /// Evaluate only the first N batches.
    #[arg(long, value_name = "N")]
    pub max_batches: Option<usize>,
    /// JSON key holding the text in .jsonl files.
    #[arg(long, value_name = "KEY", default_value = "text")]
    pub text_field: String,
}

/// The result of an evaluation.
#[derive(Debug, Clone)]
pub struct EvalResult {
    pub loss: f64,
    pub perplexity: f64,
    /// Predicted tokens (windows × T).
    pub tokens: u64,
    pub windows: u64,
    pub context_length: usize,
    /// Tokens in the stream.
    pub stream_tokens: u64,
    pub seconds: f64,
}

/// A token stream: in memory (tokenized text) or a mapped token file.
enum Stream {
    Memory(Vec<u32>),
    File(TokenFile),
}

impl Stream {
    fn len(&self) -> u64 {
        match self {
            Stream::Memory(v) => v.len() as u64,
            Stream::File(f) => f.num_tokens(),
        }
    }

    fn window(&self, start: u64, len: usize, out: &mut [i64]) {
        match self {
            Stream::Memory(v) => {
                let s = start as usize;
                for (o, &t) in out.iter_mut().zip(&v[s..s + len]) {
                    *o = t as i64;
                }
            }
            Stream::File(f) => f.copy_window(start, len, out),
        }
    }
}

/// Tokens of the text at `path` exactly as `prepare` lays them out: the files in sorted order,
/// every document followed by EOS.
pub fn tokenize_text(path: &Path, tok: &Tokenizer, text_field: &str) -> Result<Vec<u32>> {
    let mut tokens = Vec::new();
    for file in list_files(path)? {
        read_documents(&file, text_field, |doc| {
            tokens.extend(tok.try_encode(&doc)?);
            tokens.push(tok.eos_id());
            Ok(())
        })?;
    }
    Ok(tokens)
}

fn load_stream(args: &EvalArgs, tok: Option<&Tokenizer>) -> Result<Stream> {
    let data = &args.data;
    ensure!(
        data.exists(),
        "--data {}: no such file; pass a .txt/.jsonl file or a .tok token file",
        data.display()
    );
    if is_token_file(data) {
        let f = TokenFile::open(data)?;
        if let (Some(t), Some(h)) = (tok, f.tokenizer_hash()) {
            ensure!(
                h == t.definition_hash(),
                "--data {}: was tokenized with a different tokenizer than {} (the model's); pass \
                 --tokenizer with the one that wrote it, or evaluate the text instead",
                data.display(),
                t.id()
            );
        }
        return Ok(Stream::File(f));
    }
    let Some(tok) = tok else {
        bail!(
            "--data {} is text, and {} names no tokenizer (no tokenizer.json, lockstep.json or \
             trainer.json); pass --tokenizer NAME|PATH",
            data.display(),
            args.open.model.display()
        );
    };
    Ok(Stream::Memory(tokenize_text(data, tok, &args.text_field)?))
}

/// How a stream is cut into evaluation windows.
#[derive(Debug, Clone, Copy)]
pub struct Windows {
    /// T: each window holds T + 1 tokens and predicts T.
    pub context: usize,
    /// Windows per forward pass.
    pub batch_size: usize,
    /// Evaluate at most this many windows from the start.
    pub max: u64,
}

/// Mean cross-entropy over the first `windows.max` windows of T + 1 tokens (summed in f64) and
/// how many windows that was. `fill(start, len, out)` copies tokens of the stream.
pub fn evaluate_windows(
    model: &Llama,
    stream_len: u64,
    fill: &dyn Fn(u64, usize, &mut [i64]),
    windows_spec: Windows,
    device: Device,
    what: &Path,
) -> Result<(f64, u64)> {
    let Windows {
        context: ctx,
        batch_size,
        max: max_windows,
    } = windows_spec;
    let w = ctx as u64 + 1;
    let windows = (stream_len / w).min(max_windows);
    let vocab = model.shape.vocab_size as i64;
    let mut buf = vec![0i64; batch_size * (ctx + 1)];
    let mut sum = 0.0f64;
    tch::no_grad(|| -> Result<()> {
        let mut first = 0u64;
        while first < windows {
            let n = (windows - first).min(batch_size as u64) as usize;
            let rows = &mut buf[..n * (ctx + 1)];
            for (i, row) in rows.chunks_exact_mut(ctx + 1).enumerate() {
                fill((first + i as u64) * w, ctx + 1, row);
            }
            if let Some(bad) = rows.iter().find(|&&t| t >= vocab) {
                bail!(
                    "{}: holds token id {bad}, outside the model's vocabulary (0..{vocab}); the \
                     data was tokenized with another tokenizer",
                    what.display()
                );
            }
            let rows = Tensor::from_slice(rows)
                .view([n as i64, ctx as i64 + 1])
                .to_device(device);
            let x = rows.narrow(1, 0, ctx as i64);
            let y = rows.narrow(1, 1, ctx as i64);
            let mean = model.loss(&x, &y).double_value(&[]);
            sum += mean * (n * ctx) as f64;
            first += n as u64;
        }
        Ok(())
    })?;
    Ok((sum / (windows * ctx as u64) as f64, windows))
}

pub fn eval(args: &EvalArgs) -> Result<EvalResult> {
    let start = Instant::now();
    usage(args.batch_size > 0, || {
        "--batch-size 0: must be at least 1".into()
    })?;
    usage(args.max_batches != Some(0), || {
        "--max-batches 0 evaluates nothing; leave it out to evaluate the whole file".into()
    })?;
    let opened = Inference::open(&args.open)?;
    let Inference {
        dir, shape, tok, ..
    } = &opened;
    if let Some(t) = tok {
        ensure!(
            t.vocab_size() <= shape.vocab_size,
            "the tokenizer {} has {} ids but the model {} only {}; pass the --tokenizer it was \
             trained with",
            t.id(),
            t.vocab_size(),
            args.open.model.display(),
            shape.vocab_size
        );
    }
    let stream = load_stream(args, tok.as_ref())?;
    if let Stream::File(file) = &stream {
        crate::data::check_file_ids_fit(&args.data, file, shape.vocab_size)?;
    }
    let n = stream.len();
    let trained = TrainedWith::read(dir)?;
    let mut ctx = args
        .context_length
        .or(trained.context_length)
        .unwrap_or(shape.max_position_embeddings.min(2048));
    usage(ctx > 0, || "--context-length 0: must be at least 1".into())?;
    ensure!(
        ctx <= shape.max_position_embeddings,
        "--context-length {ctx} exceeds the model's max_position_embeddings ({}); pass at most that",
        shape.max_position_embeddings
    );
    ensure!(
        n >= 2,
        "--data {}: has {n} token(s); at least 2 are needed for one prediction",
        args.data.display()
    );
    if n < ctx as u64 + 1 {
        let short = n as usize - 1;
        eprintln!(
            "[eval] {} has {n} tokens, fewer than one window of {ctx} + 1; evaluating one window \
             of {short} predictions",
            args.data.display()
        );
        ctx = short;
    }
    let (_vs, model) = opened.load(ctx)?;
    let max_windows = args
        .max_batches
        .map_or(u64::MAX, |b| (b * args.batch_size) as u64);
    let fill = |at: u64, len: usize, out: &mut [i64]| stream.window(at, len, out);
    let spec = Windows {
        context: ctx,
        batch_size: args.batch_size,
        max: max_windows,
    };
    let (loss, windows) = evaluate_windows(&model, n, &fill, spec, opened.device, &args.data)?;
    Ok(EvalResult {
        loss,
        perplexity: loss.exp(),
        tokens: windows * ctx as u64,
        windows,
        context_length: ctx,
        stream_tokens: n,
        seconds: start.elapsed().as_secs_f64(),
    })
}

/// `lockstep eval`: evaluate and print a line or one JSON object.
pub fn run(args: &EvalArgs) -> Result<()> {
    let r = eval(args)?;
    if args.json {
        println!(
            "{}",
            json!({
                "model": args.open.model.display().to_string(),
                "data": args.data.display().to_string(),
                "loss": r.loss,
                "perplexity": r.perplexity,
                "tokens": r.tokens,
                "windows": r.windows,
                "context_length": r.context_length,
                "batch_size": args.batch_size,
                "stream_tokens": r.stream_tokens,
                "seconds": r.seconds,
            })
        );
    } else {
        println!(
            "[eval] {} on {}: loss {:.6} | perplexity {:.4} | {} tokens ({} windows x {}) | {:.1}s",
            args.open.model.display(),
            args.data.display(),
            r.loss,
            r.perplexity,
            r.tokens,
            r.windows,
            r.context_length,
            r.seconds
        );
    }
    Ok(())
}
