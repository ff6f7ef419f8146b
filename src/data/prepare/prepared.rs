//! What a preparation gives: where the token files are and what they contain.

use std::path::PathBuf;

use anyhow::Result;

use super::super::ids::check_max_id;
use super::super::tokfile::TokenPrefix;

/// Where the prepared token files are and what they contain.
#[derive(Debug, Clone)]
pub struct Prepared {
    /// The cache entry directory (or the token file's directory).
    pub dir: PathBuf,
    /// Training tokens: `train.tok` whole, or the prefixes of the parts of an entry prepared
    /// in parts (read as one stream by
    /// [`TokenFile::open_prefixes`](crate::data::tokfile::TokenFile::open_prefixes)).
    pub train: Vec<TokenPrefix>,
    /// Validation tokens, if a split was requested.
    pub val: Option<PathBuf>,
    /// True when nothing had to be tokenized.
    pub cache_hit: bool,
    /// What tokenized the text
    /// ([`Tokenizer::engine`](crate::data::tokenizer::Tokenizer::engine)) when this call did.
    pub engine: Option<String>,
    /// [`Tokenizer::id`](crate::data::tokenizer::Tokenizer::id) of the tokenizer used.
    pub tokenizer_id: String,
    /// Tokenizer vocabulary size, special tokens included.
    pub vocab_size: usize,
    /// End-of-document token id.
    pub eos_id: u32,
    /// Tokens in `train`.
    pub train_tokens: u64,
    /// Tokens in `val` (0 without one).
    pub val_tokens: u64,
    /// The largest token id in `train` (`None` without tokens); see [`Prepared::check_ids_fit`].
    pub train_max_id: Option<u32>,
    /// The largest token id in `val`.
    pub val_max_id: Option<u32>,
}

impl Prepared {
    /// Fails unless every token of the train and validation files is below `vocab_size`, the
    /// model's vocabulary ([`check_max_id`], with the largest ids counted when the
    /// files were written or scanned).
    pub fn check_ids_fit(&self, vocab_size: usize) -> Result<()> {
        let files = [
            (self.train.first().map(|p| &p.path), self.train_max_id),
            (self.val.as_ref(), self.val_max_id),
        ];
        for (path, max) in files {
            if let Some(path) = path {
                check_max_id(path, max, vocab_size, &self.tokenizer_id, self.vocab_size)?;
            }
        }
        Ok(())
    }
}
