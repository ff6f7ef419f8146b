//! The LLaMA model: shape, RoPE, the decoder (with packed-document attention), the training
//! pass (forward + backward a decoder half at a time, activation checkpointing, tensor and
//! context parallelism), mixture-of-experts MLPs, the chunked LM head with its cross-entropy (training, validation and
//! the log-likelihood of chosen tokens for multiple-choice evaluation), Hugging Face
//! directories (load and write), and KV-cached generation.

mod autograd;
pub mod backward;
mod context_parallel;
#[cfg(test)]
mod device_tests;
pub mod documents;
mod expert_parallel;
mod flash;
pub mod generate;
mod head;
pub mod hf;
pub mod llama;
mod moe;
pub mod params;
pub mod registry;
pub mod rope;
pub mod shape;
pub mod split;
mod swiglu;
mod tensor_parallel;
pub mod units;

pub use backward::ActivationCheckpointing;
pub use context_parallel::ContextParallel;
pub use documents::DocumentMask;
pub use expert_parallel::ExpertParallel;
pub use llama::{KvCache, Llama, Objective};
pub use moe::RouterLog;
pub use params::{Parameter, Parameters};
pub use registry::Family;
pub use shape::{AttentionBackend, LlamaShape, MoeShape};
pub use split::{Split, TensorParallel, TpComm};
pub use units::{ActivationMemory, GradUnit, NoEvents, UnitEvents};
