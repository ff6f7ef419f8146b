//! Where the launcher writes: the workers' lines and its own messages.

use std::io::Write;
use std::sync::{Arc, Mutex};

/// A writer shared between the output threads; each holder locks it for one whole line.
pub type SharedWriter = Arc<Mutex<dyn Write + Send>>;

/// Where the launcher writes: `console` gets the workers' (prefixed) lines, `diag` the
/// launcher's own messages (failure reports, signal notes).
#[derive(Clone)]
pub struct Sinks {
    /// Workers' lines; stdout for the CLI.
    pub console: SharedWriter,
    /// Launcher messages; stderr for the CLI.
    pub diag: SharedWriter,
}

impl Sinks {
    /// stdout for worker lines, stderr for launcher messages.
    pub fn stdio() -> Self {
        Sinks {
            console: Arc::new(Mutex::new(std::io::stdout())),
            diag: Arc::new(Mutex::new(std::io::stderr())),
        }
    }
}
