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
