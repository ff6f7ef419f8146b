//! Items as the model's rows, exactly as lm-evaluation-harness 0.4's Hugging Face backend
//! builds them (`TemplateLM.loglikelihood`, `_encode_pair`, `HFLM._loglikelihood_tokens`):
//!
//! - every choice is a request (context, `" " + choice`): the target delimiter is a space;
//! - trailing whitespace of the context (Python's `str.isspace`) moves to the continuation;
//! - the continuation's ids are those of the whole string (context + continuation) after the
//!   context's own ids, each string encoded as the tokenizer's `encode(text)` does by default:
//!   with the special tokens its post-processor adds (none for the embedded encodings), unless
//!   the text already starts with the prefix token's spelling;
//! - an empty context is the prefix token (BOS where the tokenizer has one, else EOS) before
//!   the continuation encoded without special tokens;
//! - context + continuation longer than the model's context T + 1 lose tokens from the left;
//!   the row is all but the last of them, and the continuation's log-likelihood is the sum of
//!   the log-probabilities of its tokens at the row's last positions.
//!
//! The rows are sorted longest first and cut into batches of a fixed number of rows, so a
//! batch is the same whichever rank evaluates it and however many ranks share the work.

use std::ops::Range;

use anyhow::{Context, Result};

use super::task::Task;
use crate::config::ConfigError;
use crate::data::tokenizer::Tokenizer;

/// One choice of one item, as a row of token ids.
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    pub task: usize,
    pub item: usize,
    pub choice: usize,
    /// Context + continuation after left truncation (at most T + 1 ids): the row is all but the
    /// last, and predicts all but the first.
    pub tokens: Vec<u32>,
    /// The continuation's ids: the row's last `scored` targets.
    pub scored: usize,
    /// Whether the context lost tokens to the model's context length.
    pub truncated: bool,
}

/// Every request of a set of tasks, and their batches.
#[derive(Debug, Clone)]
pub struct Requests {
    pub list: Vec<Request>,
    /// Request indices, longest row first (ties in task, item, choice order); batch b is
    /// `order[b·rows..(b+1)·rows]`.
    order: Vec<usize>,
    rows: usize,
    /// The model's context T: no row is longer.
    pub context: usize,
}

/// One forward pass: `inputs` and `targets` [rows, seq] (row-major; a row shorter than `seq`
/// is padded with id 0 and targets of -100, as are targets before its continuation), and the
/// requests of its rows.
#[derive(Debug, Clone, PartialEq)]
pub struct Batch {
    pub rows: usize,
    pub seq: usize,
    pub inputs: Vec<i64>,
    pub targets: Vec<i64>,
    pub requests: Vec<usize>,
}

impl Requests {
    /// The requests of every choice of every item of `tasks`, for a model of context `context`
    /// (T), in batches of `rows` rows.
    pub fn build(tasks: &[Task], tok: &Tokenizer, context: usize, rows: usize) -> Result<Requests> {
        anyhow::ensure!(rows > 0 && context > 0, "internal: empty batches");
        let enc = Encoder::new(tok);
        let mut list = Vec::new();
        for (t, task) in tasks.iter().enumerate() {
            for (i, item) in task.items.iter().enumerate() {
                let at = || format!("{}:{}", task.path.display(), item.line);
                let prefix = enc.context(&item.context).with_context(at)?;
                for (c, choice) in item.choices.iter().enumerate() {
                    let (mut tokens, scored) = enc.choice(&prefix, choice).with_context(at)?;
                    if scored == 0 {
                        return Err(ConfigError(format!(
                            "{}: choice {c} ({choice:?}) adds no token to the context's; \
                             lm-eval refuses such an item too",
                            at()
                        ))
                        .into());
                    }
                    if scored > context {
                        return Err(ConfigError(format!(
                            "{}: choice {c} is {scored} tokens, more than the model's context \
                             of {context}; shorten it, or evaluate with a longer context",
                            at()
                        ))
                        .into());
                    }
                    let truncated = tokens.len() > context + 1;
                    if truncated {
                        tokens.drain(..tokens.len() - (context + 1));
                    }
                    list.push(Request {
                        task: t,
                        item: i,
                        choice: c,
                        tokens,
                        scored,
                        truncated,
                    });
                }
            }
        }
        let mut order: Vec<usize> = (0..list.len()).collect();
        order.sort_by_key(|&r| std::cmp::Reverse(list[r].tokens.len()));
        Ok(Requests {
            list,
            order,
            rows,
            context,
        })
    }

    pub fn num_batches(&self) -> usize {
        self.order.len().div_ceil(self.rows)
    }

    /// The requests of batch `b`.
    fn batch_range(&self, b: usize) -> Range<usize> {
        let start = b * self.rows;
        start..(start + self.rows).min(self.order.len())
    }

    /// Batch `b`'s rows and their length, padded to a multiple of `align` tokens.
    pub fn batch_shape(&self, b: usize, align: usize) -> (usize, usize) {
        let range = self.batch_range(b);
        // Longest first: the batch's first row is its longest.
        let longest = self
            .order
            .get(range.start)
            .map_or(1, |&r| self.list[r].tokens.len() - 1);
        (range.len(), longest.div_ceil(align.max(1)) * align.max(1))
    }

    /// The continuation tokens of batch `b`: the positions whose log-probabilities count (and
    /// the only ones the LM head computes).
    pub fn batch_scored(&self, b: usize) -> usize {
        self.order[self.batch_range(b)]
            .iter()
            .map(|&r| self.list[r].scored)
            .sum()
    }

    /// Batch `b`, its rows padded to a multiple of `align` tokens (what tensor and context
    /// parallelism cut a sequence into).
    pub fn batch(&self, b: usize, align: usize) -> Batch {
        let requests: Vec<usize> = self.order[self.batch_range(b)].to_vec();
        let (rows, seq) = self.batch_shape(b, align);
        let mut inputs = vec![0i64; rows * seq];
        let mut targets = vec![-100i64; rows * seq];
        for (row, &r) in requests.iter().enumerate() {
            let req = &self.list[r];
            let n = req.tokens.len() - 1;
            let (x, y) = (&mut inputs[row * seq..], &mut targets[row * seq..]);
            for (o, &t) in x.iter_mut().zip(&req.tokens[..n]) {
                *o = t as i64;
            }
            let first = n - req.scored;
            for (o, &t) in y[first..n].iter_mut().zip(&req.tokens[first + 1..]) {
                *o = t as i64;
            }
        }
        Batch {
            rows,
            seq,
            inputs,
            targets,
            requests,
        }
    }

    /// The longest row's tokens (the RoPE table a model needs for these requests).
    pub fn longest_row(&self) -> usize {
        self.batch_shape(0, 1).1
    }

    /// Items whose context lost tokens to the model's context length.
    pub fn truncated_items(&self) -> usize {
        let mut items: Vec<(usize, usize)> = self
            .list
            .iter()
            .filter(|r| r.truncated)
            .map(|r| (r.task, r.item))
            .collect();
        items.dedup();
        items.len()
    }

    /// Tokens of every row (the work of a pass over the tasks).
    pub fn row_tokens(&self) -> usize {
        self.list.iter().map(|r| r.tokens.len() - 1).sum()
    }
}

/// What a row's length must be a multiple of on a mesh of `tensor` = T ranks (with
/// `sequence_parallel`, the config's `system.sequence_parallel`) and `context` = C: context
/// parallelism cuts a row into 2C chunks (each rank keeping two) and sequence parallelism then
/// cuts each rank's tokens among the T ranks, so a row of s tokens leaves s/C on a rank, a
/// multiple of T for any number of rows when s is a multiple of C·lcm(2, T) (T alone without
/// CP; 1 without either). Training's context is a multiple of it (the config's rules), so a
/// padded row never outgrows it.
pub fn row_align(tensor: usize, sequence_parallel: bool, context: usize) -> usize {
    let t = match sequence_parallel {
        true => tensor.max(1),
        false => 1,
    };
    match context {
        0 | 1 => t,
        c if t.is_multiple_of(2) => c * t,
        c => c * 2 * t,
    }
}

/// lm-eval's `tok_encode` and `_encode_pair` for one tokenizer.
struct Encoder<'a> {
    tok: &'a Tokenizer,
    /// lm-eval's `prefix_token_id`: BOS where the tokenizer has one, else EOS.
    prefix: u32,
    /// Its spelling: a text that starts with it is encoded without special tokens.
    prefix_text: Option<String>,
}

/// An item's context, ready for its choices: its ids and the text they are of (the trailing
/// whitespace taken off and kept for the continuation).
struct Prefix {
    /// The context without its trailing whitespace (None: the context is empty).
    text: Option<String>,
    /// Its trailing whitespace, which starts every continuation.
    moved: String,
    ids: Vec<u32>,
}

impl<'a> Encoder<'a> {
    fn new(tok: &'a Tokenizer) -> Encoder<'a> {
        let prefix = tok.bos().map_or(tok.eos_id(), |(id, _)| id);
        Encoder {
            tok,
            prefix,
            prefix_text: tok.decode(&[prefix]).ok(),
        }
    }

    /// `tok_encode(text)`: with the tokenizer's special tokens unless `text` starts with the
    /// prefix token's spelling (lm-eval's `has_bos_prefix`).
    fn encode(&self, text: &str) -> Result<Vec<u32>> {
        match &self.prefix_text {
            Some(p) if text.starts_with(p.as_str()) => self.tok.try_encode(text),
            _ => self.tok.encode_with_specials(text),
        }
    }

    fn context(&self, context: &str) -> Result<Prefix> {
        if context.is_empty() {
            return Ok(Prefix {
                text: None,
                moved: String::new(),
                ids: Vec::new(),
            });
        }
        let kept = context.trim_end_matches(is_python_space);
        let ids = self.encode(kept)?;
        if ids.is_empty() {
            return Err(ConfigError(
                "the context is only whitespace, which encodes to no token; lm-eval refuses \
                 such an item too: give it a context, or an empty one (the prefix token)"
                    .into(),
            )
            .into());
        }
        Ok(Prefix {
            text: Some(kept.to_string()),
            moved: context[kept.len()..].to_string(),
            ids,
        })
    }

    /// The ids of context + continuation (`" " + choice`) and how many of them are the
    /// continuation's.
    fn choice(&self, prefix: &Prefix, choice: &str) -> Result<(Vec<u32>, usize)> {
        let continuation = format!("{} {choice}", prefix.moved);
        let Some(context) = &prefix.text else {
            let mut cont = self.tok.try_encode(&continuation)?;
            if cont.first() == Some(&self.prefix) {
                return Ok((cont.clone(), cont.len() - 1));
            }
            let n = cont.len();
            cont.insert(0, self.prefix);
            return Ok((cont, n));
        };
        let whole = self.encode(&format!("{context}{continuation}"))?;
        let scored = whole.len().saturating_sub(prefix.ids.len());
        let mut tokens = prefix.ids.clone();
        tokens.extend_from_slice(&whole[whole.len() - scored..]);
        Ok((tokens, scored))
    }
}

/// Python's `str.isspace` (what `str.rstrip()` strips): Unicode's White_Space characters and
/// the information separators U+001C..U+001F.
pub(super) fn is_python_space(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}
