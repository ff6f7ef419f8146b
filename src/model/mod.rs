//! The LLaMA model: shape, RoPE, the decoder, and Hugging Face directory loading.

pub mod hf;
pub mod llama;
pub mod rope;
pub mod shape;

pub use llama::Llama;
pub use shape::{AttentionBackend, LlamaShape};
