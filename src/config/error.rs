//! The error of a config problem the user must fix.

/// A config problem the user must fix; `main` maps it to exit code 2.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct ConfigError(pub String);
