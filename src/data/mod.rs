//! The data pipeline: tokenizers, the `.tok` on-disk format, document
//! sources, the deterministic sampler and the tokenize-once cache.
//!
//! Typical use: [`prepare`] turns `data.path` into cached `.tok` files,
//! [`TokenFile::open`] maps them, and a [`Sampler`] with [`rank_indices`] and
//! [`fill_batch`] produces each rank's batches in a resumable order.

pub mod hub;
pub mod prepare;
pub mod sampler;
pub mod sources;
pub mod tokenizer;
pub mod tokfile;

pub use prepare::{prepare, PrepareSpec, Prepared};
pub use sampler::{fill_batch, rank_indices, Sampler};
pub use sources::{
    dataset_files, dataset_fingerprint, list_files, read_documents, DatasetFiles, FileFingerprint,
};
pub use tokenizer::Tokenizer;
pub use tokfile::{dtype_for_vocab, SourceKind, TokFileInfo, TokFileWriter, TokenFile};
