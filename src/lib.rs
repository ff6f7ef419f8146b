//! lockstep: LLaMA pretraining on libtorch. See DESIGN.md in the shared docs for the data flow;
//! each module owns one concern:
//! `config` (keys, presets, resolution), `data` (tokenizers, token files, sampler, prepare),
//! `model` (LLaMA, RoPE, HF loading), `train` (loop, AdamW, checkpoints, NaN guard),
//! `telemetry` (step line, metrics), `tensor_io` (safetensors ⇄ tch), `commands` (export to
//! Hugging Face, eval, generate).

pub mod cli;
pub mod commands;
pub mod config;
pub mod data;
pub mod dist;
pub mod launch;
pub mod model;
pub mod telemetry;
pub mod tensor_io;
pub mod train;
