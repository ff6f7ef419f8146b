//! How a run starts: the per-invocation options (`--resume`, `--stop-at-step`), its checkpoint
//! directory and the checkpoint to resume from. Where a rank runs is `place` and `device`; the
//! run's data is `run_data`.

use std::path::{Path, PathBuf};

use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};

use super::checkpoint;
use crate::config::Resolved;

/// Where to resume from (`--resume`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Resume {
    /// The latest complete checkpoint in the checkpoint directory, or a fresh start if none.
    Auto,
    Dir(PathBuf),
}

impl std::str::FromStr for Resume {
    type Err = std::convert::Infallible;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(if s == "auto" {
            Resume::Auto
        } else {
            Resume::Dir(PathBuf::from(s))
        })
    }
}

/// Per-invocation choices that are not part of the run's config.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RunOptions {
    pub resume: Option<Resume>,
    /// Checkpoint and exit after this step (time-sliced jobs); the schedule still spans max_steps.
    pub stop_at_step: Option<usize>,
}

pub fn checkpoint_dir(resolved: &Resolved) -> PathBuf {
    match &resolved.config.checkpoint.dir {
        Some(d) => PathBuf::from(d),
        None => resolved.run_dir().join("checkpoints"),
    }
}

/// The checkpoint to resume from. Without `--resume`, an existing checkpoint is an error rather
/// than something silently overwritten or ignored.
pub fn resume_target(root: &Path, resume: Option<&Resume>, tag: &str) -> Result<Option<PathBuf>> {
    for partial in checkpoint::incomplete(root) {
        println!(
            "{tag} Ignoring incomplete checkpoint {} (a save was interrupted)",
            partial.display()
        );
    }
    match resume {
        None => match checkpoint::latest(root) {
            Some(found) => bail!(
                "{} already holds checkpoints (latest {}); pass --resume auto to continue that run, or set logging.run_name / checkpoint.dir to start a new one",
                root.display(),
                found.display()
            ),
            None => Ok(None),
        },
        Some(Resume::Auto) => {
            let all = checkpoint::list(root);
            if all.is_empty() {
                println!("{tag} --resume auto: no complete checkpoint in {}; starting from scratch", root.display());
                return Ok(None);
            }
            // The newest that loads: a checkpoint damaged after it was committed (a truncated
            // file, a disk error) costs the steps since the one before it, not the run.
            let mut skipped: Vec<usize> = Vec::new();
            for (step, dir) in all.iter().rev() {
                match checkpoint::verify(dir) {
                    Ok(()) => {
                        if let Some(&newest) = skipped.first() {
                            println!(
                                "{tag} --resume auto: resuming from {} instead; steps {}..={newest} \
                                 will be trained again",
                                dir.display(),
                                step + 1
                            );
                        }
                        return Ok(Some(dir.clone()));
                    }
                    Err(e) => {
                        println!(
                            "{tag} --resume auto: skipping damaged checkpoint {} ({e:#}); \
                             delete it once you have looked at it",
                            dir.display()
                        );
                        skipped.push(*step);
                    }
                }
            }
            bail!(
                "--resume auto: none of the {} checkpoints in {} loads (each is damaged, see \
                 above); resume from a copy with --resume DIR, or move them aside to start \
                 from scratch",
                all.len(),
                root.display()
            )
        }
        Some(Resume::Dir(dir)) => {
            if !dir.is_dir() {
                return Err(crate::config::ConfigError(format!(
                    "--resume {}: {}; pass a checkpoint directory (…/checkpoints/step_N), or \
                     --resume auto for the run's latest",
                    dir.display(),
                    if dir.exists() { "not a directory" } else { "no such directory" }
                ))
                .into());
            }
            anyhow::ensure!(dir.join("trainer.json").is_file(), "--resume {}: not a complete checkpoint directory (no trainer.json)", dir.display());
            Ok(Some(dir.clone()))
        }
    }
}
