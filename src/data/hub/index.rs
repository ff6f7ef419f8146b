//! A sharded model's safetensors index: the shard files it names.

use std::path::{Component, Path};

use anyhow::{anyhow, bail, Result};

pub(super) const INDEX: &str = "model.safetensors.index.json";

/// The shard files a safetensors index names, sorted, once each.
pub(super) fn index_shards(index: &Path) -> Result<Vec<String>> {
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(index)?)
        .map_err(|e| anyhow!("{}: invalid JSON ({e})", index.display()))?;
    let mut shards: Vec<String> = v["weight_map"]
        .as_object()
        .map(|m| {
            m.values()
                .filter_map(|s| s.as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default();
    shards.sort();
    shards.dedup();
    // Names come from the server: keep them inside the snapshot.
    if let Some(bad) = shards.iter().find(|s| {
        Path::new(s.as_str())
            .components()
            .any(|c| !matches!(c, Component::Normal(_)))
    }) {
        bail!(
            "{}: shard name {bad:?} is not a relative file name",
            index.display()
        );
    }
    Ok(shards)
}
