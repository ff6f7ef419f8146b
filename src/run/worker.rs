//! The workers' spec: what every worker of a `lockstep run` trains, written once by the
//! launcher and read by each worker (`lockstep train --worker-spec FILE`).

use std::path::Path;

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

use super::RunOptions;
use crate::config::{Config, ConfigError, Resolved};

/// What every worker of a `lockstep run` trains: the launcher resolves the config once and
/// writes this file; each worker reads it (`lockstep train --worker-spec FILE`), so no worker
/// re-resolves presets, files and flags on its own.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct WorkerSpec {
    pub preset: String,
    pub config: Config,
    pub options: RunOptions,
}

impl WorkerSpec {
    pub fn write(&self, path: &Path) -> Result<()> {
        std::fs::write(path, serde_json::to_vec_pretty(self)?)
            .with_context(|| format!("{}: cannot write the workers' spec", path.display()))
    }

    /// Reads and re-validates a spec (the file may have been edited by hand).
    pub fn read(path: &Path) -> Result<(Resolved, RunOptions)> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("--worker-spec {}: cannot read", path.display()))?;
        let spec: WorkerSpec = serde_json::from_str(&text).map_err(|e| {
            ConfigError(format!(
                "--worker-spec {}: not a worker spec written by `lockstep run` ({e})",
                path.display()
            ))
        })?;
        Ok((Resolved::new(spec.config, spec.preset)?, spec.options))
    }
}
