//! The data pipeline: tokenizers, the `.tok` on-disk format, document
//! sources, the deterministic sampler and the tokenize-once cache.
//!
//! Typical use: [`prepare`] turns `data.path` (a built-in corpus, files on
//! disk or a cached Hub dataset) into cached `.tok` files, [`Prepared::check_ids_fit`]
//! makes sure their ids fit the model's vocabulary, [`TokenFile::open`] maps
//! them, and a [`Sampler`] with [`rank_indices`] and [`fill_batch`] produces
//! each rank's batches in a resumable order. A `data.sources` mixture prepares
//! each source the same way and a [`Mixture`] says which source (and which of
//! its samples) every global sample is; [`TokenFile::document_pieces`] gives
//! the documents inside a window for document masking.
//!
//! Layout: `sources/` resolves `data.path` into a [`Dataset`] (`files.rs` lists a
//! directory's data files and fingerprints them, and depends on nothing else here, so `hub/`
//! can use it; `read.rs` hands each file to its reader, `text.rs`, `jsonl.rs` or
//! `parquet.rs`); `hub/` finds models, tokenizers and datasets in the Hugging Face cache;
//! `prepare/` is the tokenize-once cache (`mod.rs` the entry points, `cache.rs` an entry,
//! `build.rs` one go, `parts.rs` in parts, `encode.rs` the parallel tokenizer); `tokfile/` the
//! token file formats; `ids.rs` the largest token ids; `sampler.rs` and `mixture.rs` the order
//! of the samples; `tasks/` the multiple-choice evaluation tasks (files, their rows, their
//! scores).

pub mod builtin;
pub mod hub;
pub mod ids;
pub mod mixture;
pub mod prepare;
pub mod sampler;
pub mod sources;
pub mod tasks;
pub mod tokenizer;
pub mod tokfile;

pub use ids::{check_file_ids_fit, max_token_id};
pub use mixture::{source_names, source_seed, Mixture};
pub use prepare::{prepare, PrepareSpec, Prepared};
pub use sampler::{fill_batch, rank_indices, Sampler};
pub use sources::{
    dataset_files, dataset_fingerprint, list_files, read_documents, resolve_dataset, Dataset,
    DatasetFiles, FileFingerprint,
};
pub use tokenizer::Tokenizer;
pub use tokfile::{dtype_for_vocab, SourceKind, TokFileInfo, TokFileWriter, TokenFile};
