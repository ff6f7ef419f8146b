//! The LLaMA model: shape, RoPE, the decoder, Hugging Face directories (load and write), and
//! KV-cached generation.

pub mod generate;
pub mod hf;
pub mod llama;
pub mod rope;
pub mod shape;

pub use llama::{KvCache, Llama};
pub use shape::{AttentionBackend, LlamaShape};
