//! `lockstep eval --model DIR`: a Hugging Face Llama directory's mean next-token loss and
//! perplexity on a file (`--data`), and its scores on multiple-choice tasks (`--task`).
//!
//! `--data` is deterministic: the token stream (a `.tok`/`.bin` file, or text tokenized as
//! `prepare` does, EOS after every document) is cut from its start into consecutive,
//! non-overlapping windows of T + 1 tokens (T predictions each; a shorter tail is dropped),
//! taken in order in batches. The loss is the mean over every predicted token.
//!
//! `--task FILE` (repeatable) scores tasks as lm-evaluation-harness 0.4 scores them
//! (`data::tasks`; the loop is training's, `train::tasks`): acc, acc_norm, their standard
//! errors and n per task, and with `--log-samples` every item's log-likelihoods.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, ensure, Context, Result};
use clap::Args;
use serde_json::json;
use tch::{Device, Tensor};

use super::{Inference, ModelFlags, TrainedWith};
use crate::config::usage;
use crate::data::sources::{list_files, read_documents};
use crate::data::tasks::{self, Requests, Task};
use crate::data::tokenizer::Tokenizer;
use crate::data::tokfile::{is_token_file, TokenFile};
use crate::model::{Llama, NoEvents};
use crate::train::tasks::{score_requests, Deal, TaskResults};

#[derive(Args, Debug, Clone)]
pub struct EvalArgs {
    #[command(flatten)]
    pub open: ModelFlags,
    /// Loss and perplexity on a .txt/.jsonl file (or a directory of them), or a token file
    /// (.tok, nanoGPT .bin, llm.c shard).
    #[arg(long, value_name = "FILE")]
    pub data: Option<PathBuf>,
    /// A multiple-choice task: a .jsonl file (query/choices/gold, or HellaSwag's
    /// ctx/endings/label per line) or a directory of them; repeatable. Scored as
    /// lm-evaluation-harness scores multiple_choice (docs/evaluation.md).
    #[arg(long = "task", value_name = "FILE")]
    pub tasks: Vec<PathBuf>,
    /// Score only the first N items of each task.
    #[arg(long, value_name = "N")]
    pub limit: Option<usize>,
    /// Write every task item's per-choice log-likelihoods, predictions and scores to FILE
    /// (JSON lines).
    #[arg(long, value_name = "FILE")]
    pub log_samples: Option<PathBuf>,
    /// Print JSON instead of lines of text: one object for --data, one per task.
    #[arg(long)]
    pub json: bool,
    /// Windows (--data; default 8) or rows, one choice each (--task; default 32, as
    /// training.eval_tasks_batch_size) per forward pass.
    #[arg(long, value_name = "B")]
    pub batch_size: Option<usize>,
    /// Predictions per window (T) with --data, the longest row with --task (longer items lose
    /// tokens from the left); default: the context length the model was trained with
    /// (lockstep.json / trainer.json), else min(max_position_embeddings, 2048) with --data and
    /// max_position_embeddings with --task (what lm-evaluation-harness uses).
    #[arg(long, value_name = "T")]
    pub context_length: Option<usize>,
    /// Evaluate only the first N batches of --data.
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

fn load_stream(args: &EvalArgs, data: &Path, tok: Option<&Tokenizer>) -> Result<Stream> {
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
            // Validation's loss, as training computes it.
            let mean = model
                .loss_units(&x, &y, None, &mut crate::model::NoEvents)?
                .double_value(&[]);
            sum += mean * (n * ctx) as f64;
            first += n as u64;
        }
        Ok(())
    })?;
    Ok((sum / (windows * ctx as u64) as f64, windows))
}

/// Default windows (--data) and rows (--task) per forward pass.
const DATA_BATCH: usize = 8;
const TASK_BATCH: usize = 32;

/// The usage rules of the flags, before anything is opened.
fn check_flags(args: &EvalArgs) -> Result<()> {
    usage(args.data.is_some() || !args.tasks.is_empty(), || {
        "nothing to evaluate: pass --data FILE (loss and perplexity) and/or --task FILE \
         (multiple-choice accuracy; repeatable)"
            .into()
    })?;
    usage(args.batch_size != Some(0), || {
        "--batch-size 0: must be at least 1".into()
    })?;
    usage(args.max_batches != Some(0), || {
        "--max-batches 0 evaluates nothing; leave it out to evaluate the whole file".into()
    })?;
    usage(args.limit != Some(0), || {
        "--limit 0 scores nothing; leave it out to score every item".into()
    })?;
    usage(args.context_length != Some(0), || {
        "--context-length 0: must be at least 1".into()
    })?;
    let tasks_only = [
        ("--limit", args.limit.is_some()),
        ("--log-samples", args.log_samples.is_some()),
    ];
    for (flag, given) in tasks_only {
        usage(!given || !args.tasks.is_empty(), || {
            format!("{flag} applies to --task; pass the tasks to score")
        })?;
    }
    usage(args.max_batches.is_none() || args.data.is_some(), || {
        "--max-batches applies to --data; with --task, --limit N scores the first N items".into()
    })?;
    Ok(())
}

/// The model's tokenizer, which must fit its vocabulary.
fn check_tokenizer(args: &EvalArgs, opened: &Inference) -> Result<()> {
    if let Some(t) = &opened.tok {
        ensure!(
            t.vocab_size() <= opened.shape.vocab_size,
            "the tokenizer {} has {} ids but the model {} only {}; pass the --tokenizer it was \
             trained with",
            t.id(),
            t.vocab_size(),
            args.open.model.display(),
            opened.shape.vocab_size
        );
    }
    Ok(())
}

/// `--context-length`, else the context the model was trained with (lockstep.json /
/// trainer.json), else `fallback`; at most the model's max_position_embeddings.
fn context_length(args: &EvalArgs, opened: &Inference, fallback: usize) -> Result<usize> {
    let max = opened.shape.max_position_embeddings;
    let ctx = args
        .context_length
        .or(TrainedWith::read(&opened.dir)?.context_length)
        .unwrap_or(fallback);
    ensure!(
        ctx <= max,
        "--context-length {ctx} exceeds the model's max_position_embeddings ({max}); pass at most that"
    );
    Ok(ctx)
}

/// Loss and perplexity of the opened model on `data`.
pub fn eval_data(args: &EvalArgs, opened: &Inference, data: &Path) -> Result<EvalResult> {
    let start = Instant::now();
    let Inference { shape, tok, .. } = opened;
    let stream = load_stream(args, data, tok.as_ref())?;
    if let Stream::File(file) = &stream {
        crate::data::check_file_ids_fit(data, file, shape.vocab_size)?;
    }
    let n = stream.len();
    let mut ctx = context_length(args, opened, shape.max_position_embeddings.min(2048))?;
    ensure!(
        n >= 2,
        "--data {}: has {n} token(s); at least 2 are needed for one prediction",
        data.display()
    );
    if n < ctx as u64 + 1 {
        let short = n as usize - 1;
        eprintln!(
            "[eval] {} has {n} tokens, fewer than one window of {ctx} + 1; evaluating one window \
             of {short} predictions",
            data.display()
        );
        ctx = short;
    }
    let (_vs, model) = opened.load(ctx)?;
    let batch_size = args.batch_size.unwrap_or(DATA_BATCH);
    let max_windows = args
        .max_batches
        .map_or(u64::MAX, |b| (b * batch_size) as u64);
    let fill = |at: u64, len: usize, out: &mut [i64]| stream.window(at, len, out);
    let spec = Windows {
        context: ctx,
        batch_size,
        max: max_windows,
    };
    let (loss, windows) = evaluate_windows(&model, n, &fill, spec, opened.device, data)?;
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

/// The tasks scored: what they are, their rows, the results.
pub struct TaskEvaluation {
    pub tasks: Vec<Task>,
    pub requests: Requests,
    pub results: TaskResults,
}

/// The tasks of `--task`, read and checked (before the model is opened: a bad file fails fast).
fn read_tasks(args: &EvalArgs) -> Result<Vec<Task>> {
    tasks::load_tasks(&args.tasks, "--task", args.limit)
}

/// Scores `tasks` with the opened model: rows of at most `--context-length` tokens (default:
/// the trained context, else max_position_embeddings, as lm-evaluation-harness), in batches of
/// `--batch-size` rows.
pub fn eval_tasks(args: &EvalArgs, opened: &Inference, tasks: Vec<Task>) -> Result<TaskEvaluation> {
    let Some(tok) = &opened.tok else {
        bail!(
            "--task needs the model's tokenizer, and {} names none (no tokenizer.json, \
             lockstep.json or trainer.json); pass --tokenizer NAME|PATH",
            args.open.model.display()
        );
    };
    let shape = &opened.shape;
    let ctx = context_length(args, opened, shape.max_position_embeddings)?;
    let rows = args.batch_size.unwrap_or(TASK_BATCH);
    let requests = Requests::build(&tasks, tok, ctx, rows)?;
    if let Some(bad) = requests
        .list
        .iter()
        .flat_map(|r| &r.tokens)
        .find(|&&t| t as usize >= shape.vocab_size)
    {
        bail!(
            "the tokenizer {} gives id {bad}, outside the model's vocabulary (0..{}); pass the \
             --tokenizer the model was trained with",
            tok.id(),
            shape.vocab_size
        );
    }
    // RoPE tables for the longest row only (not max_position_embeddings).
    let (_vs, model) = opened.load(requests.longest_row())?;
    // The scoring's time (what items/s counts), without reading and encoding.
    let started = Instant::now();
    let lls = score_requests(&requests, Deal::ALONE, 1, opened.device, &mut |x, y| {
        model.row_log_likelihoods(x, y, &mut NoEvents)
    })?;
    let results = crate::train::tasks::results(&tasks, &requests, &lls, started);
    if let Some(path) = &args.log_samples {
        let mut text = String::new();
        for (task, items) in tasks.iter().zip(&results.items) {
            for (i, item) in items.iter().enumerate() {
                text.push_str(&tasks::sample(task, i, item).to_string());
                text.push('\n');
            }
        }
        crate::sys::durable::write_atomic(path, text.as_bytes())
            .with_context(|| format!("--log-samples {}", path.display()))?;
    }
    Ok(TaskEvaluation {
        tasks,
        requests,
        results,
    })
}

/// `lockstep eval`: evaluate and print lines of text or JSON objects.
pub fn run(args: &EvalArgs) -> Result<()> {
    check_flags(args)?;
    let tasks = match args.tasks.is_empty() {
        true => None,
        false => Some(read_tasks(args)?),
    };
    let opened = Inference::open(&args.open)?;
    check_tokenizer(args, &opened)?;
    if let Some(data) = &args.data {
        print_data(args, data, &eval_data(args, &opened, data)?);
    }
    if let Some(tasks) = tasks {
        print_tasks(args, &eval_tasks(args, &opened, tasks)?);
    }
    Ok(())
}

/// Each task's line (or JSON object): acc, acc_norm, their standard errors, n.
fn print_tasks(args: &EvalArgs, e: &TaskEvaluation) {
    let model = args.open.model.display().to_string();
    let truncated = e.requests.truncated_items();
    for (task, s) in e.tasks.iter().zip(&e.results.scores) {
        if args.json {
            println!(
                "{}",
                json!({
                    "task": s.task,
                    "acc": s.acc,
                    "acc_norm": s.acc_norm,
                    "acc_stderr": s.acc_stderr,
                    "acc_norm_stderr": s.acc_norm_stderr,
                    "n": s.n,
                    "file": task.path.display().to_string(),
                    "model": model,
                    "context_length": e.requests.context,
                    "seconds": e.results.seconds,
                })
            );
            continue;
        }
        println!(
            "[eval] {model} on {} ({}): {}",
            s.task,
            task.path.display(),
            s.summary()
        );
    }
    if !args.json {
        let cut = match truncated {
            0 => String::new(),
            n => format!(
                "; {n} item(s) longer than {} tokens lost tokens from the left",
                e.requests.context
            ),
        };
        println!(
            "[eval] {} rows in {:.1} s ({:.1} items/s){cut}",
            e.requests.list.len(),
            e.results.seconds,
            e.tasks.iter().map(|t| t.items.len()).sum::<usize>() as f64
                / e.results.seconds.max(1e-9)
        );
    }
}

/// The --data result as a line (or a JSON object).
fn print_data(args: &EvalArgs, data: &Path, r: &EvalResult) {
    if args.json {
        println!(
            "{}",
            json!({
                "model": args.open.model.display().to_string(),
                "data": data.display().to_string(),
                "loss": r.loss,
                "perplexity": r.perplexity,
                "tokens": r.tokens,
                "windows": r.windows,
                "context_length": r.context_length,
                "batch_size": args.batch_size.unwrap_or(DATA_BATCH),
                "stream_tokens": r.stream_tokens,
                "seconds": r.seconds,
            })
        );
    } else {
        println!(
            "[eval] {} on {}: loss {:.6} | perplexity {:.4} | {} tokens ({} windows x {}) | {:.1}s",
            args.open.model.display(),
            data.display(),
            r.loss,
            r.perplexity,
            r.tokens,
            r.windows,
            r.context_length,
            r.seconds
        );
    }
}
