//! Presets embedded from `config/presets/*.json`; each overrides only what differs from the
//! schema defaults.

use super::error::ConfigError;

pub const DEFAULT: &str = "production";

pub const PRESETS: &[(&str, &str)] = &[
    (
        "production",
        include_str!("../../config/presets/production.json"),
    ),
    ("debug", include_str!("../../config/presets/debug.json")),
    ("tiny", include_str!("../../config/presets/tiny.json")),
    // Qwen3 dense: `tiny`'s size with Qwen3's layers (q_norm/k_norm, heads of 64 where
    // hidden / heads is 32, tied embeddings), and the released shapes (Hugging Face's
    // Qwen/Qwen3-*-Base config.json: every layer, vocabulary 151,936, RoPE base 1e6).
    (
        "qwen3-tiny",
        include_str!("../../config/presets/qwen3-tiny.json"),
    ),
    (
        "qwen3-0.6b",
        include_str!("../../config/presets/qwen3-0.6b.json"),
    ),
    (
        "qwen3-1.7b",
        include_str!("../../config/presets/qwen3-1.7b.json"),
    ),
    (
        "qwen3-4b",
        include_str!("../../config/presets/qwen3-4b.json"),
    ),
    (
        "qwen3-8b",
        include_str!("../../config/presets/qwen3-8b.json"),
    ),
    // Mixtures of experts: Qwen3-MoE's layers at `tiny`'s size (8 experts of 256, top 2), and
    // the released shapes (Hugging Face's Qwen/Qwen3-30B-A3B-Base and
    // mistralai/Mixtral-8x7B-v0.1 config.json).
    (
        "qwen3-moe-tiny",
        include_str!("../../config/presets/qwen3-moe-tiny.json"),
    ),
    (
        "qwen3-30b-a3b",
        include_str!("../../config/presets/qwen3-30b-a3b.json"),
    ),
    (
        "mixtral-8x7b",
        include_str!("../../config/presets/mixtral-8x7b.json"),
    ),
];

pub fn get(name: &str) -> Result<&'static str, ConfigError> {
    PRESETS
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, json)| *json)
        .ok_or_else(|| {
            let names: Vec<&str> = PRESETS.iter().map(|(n, _)| *n).collect();
            ConfigError(format!(
                "unknown preset \"{name}\"; available presets: {}",
                names.join(", ")
            ))
        })
}
