//! The integration tests, one crate: each `tests/NAME.rs` is the module `NAME` (run one with
//! `cargo test --release --test suite NAME::`, or `bash scripts/test.sh --test suite NAME::`).
//! One crate, not one per file: forty test binaries compiled `common` forty times and linked
//! lockstep forty times, 5 min 19 s of build on two cores against 3 min 40 s for this one
//! (BENCHMARKS.md §18).
//! `scripts/test.sh` runs the modules one after another, each in a process of its own (some
//! set process-wide state: hub_cache's environment), and reports each one's time.

mod common;

mod activation_memory;
mod checkpoint_async;
mod context_parallel;
mod crash_safety;
mod distributed;
mod doc_masking;
mod docs;
mod downstream_eval;
mod errors_checkpoints;
mod errors_config;
mod errors_data;
mod errors_launch;
mod errors_run_dir;
mod errors_training;
mod export_eval_generate;
mod guard;
mod hf_parity;
mod hub_cache;
mod hub_download;
mod layers;
mod mixtures;
mod mlflow_sink;
mod muon;
mod parallel_run;
mod parquet;
mod plan;
mod plan_memory;
mod prepare_memory;
mod prepare_shards;
mod resilience;
mod tensor_parallel;
mod tensorboard;
mod tokenizer_parity;
mod tracking_mlflow;
mod tracking_wandb;
mod train_cli;
mod two_hosts;
mod zero;
