//! Tokenizing the corpus into a token file: documents read in order, batches of text encoded
//! on a thread pool (large documents cut into segments) while the next batch is read, tokens
//! written in order with an EOS after each document, and the progress shown meanwhile.

use std::io::IsTerminal;

use anyhow::{anyhow, Result};
use indicatif::{ProgressBar, ProgressStyle};
use rayon::prelude::*;

use super::super::sources::Dataset;
use super::super::tokenizer::Tokenizer;
use super::super::tokfile::TokFileWriter;
use super::spec::PrepareSpec;

/// Text accumulated before a parallel tokenization pass.
const BATCH_BYTES: usize = 16 << 20;

/// Large documents are cut into pieces of about this size for parallelism.
const SEGMENT_BYTES: usize = 256 << 10;

/// What was read while tokenizing.
#[derive(Default)]
pub(super) struct Tokenized {
    pub(super) documents: u64,
    pub(super) input_bytes: u64,
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
pub(super) fn tokenize_corpus(
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
