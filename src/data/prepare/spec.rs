//! What a preparation is asked for: the corpus, the tokenizer and where to cache the tokens.

use std::path::PathBuf;

/// What to tokenize and where to cache it.
#[derive(Debug, Clone)]
pub struct PrepareSpec {
    /// Tokenizer name or `tokenizer.json` path (see
    /// [`Tokenizer::load`](crate::data::tokenizer::Tokenizer::load)).
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
