//! lockstep: LLaMA pretraining on libtorch. The design (data flow, formats, conventions) is in
//! `DESIGN.md` of the project's shared docs, beside the repository (`../shared/`), not in it;
//! each module owns one concern:
//! `config` (keys, presets, resolution), `data` (tokenizers, token files, sampler, prepare),
//! `model` (LLaMA, RoPE, HF loading, the layer-by-layer training pass), `plan` (memory, FLOP
//! and communication estimates), `run` (a run on disk: its directory, checkpoints, data, resume
//! target), `train` (loop, AdamW, writing and loading checkpoints, NaN guard),
//! `telemetry` (step line, metrics), `tensor_io` (safetensors ⇄ tch), `commands` (export to
//! Hugging Face, eval, generate), `sys` (the bottom layer: FFI helpers, CUDA and NVML loading).

pub mod cli;
pub mod commands;
pub mod config;
pub mod data;
pub mod dist;
pub mod launch;
pub mod model;
pub mod plan;
pub mod run;
pub mod sys;
pub mod telemetry;
pub mod tensor_io;
pub mod train;
