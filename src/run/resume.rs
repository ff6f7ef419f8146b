//! What a run resumes from: the per-invocation options (`--resume`, `--stop-at-step`), its
//! checkpoint directory and the checkpoint to resume from.

use std::path::{Path, PathBuf};

use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};

use super::checkpoints::{self, Share};
use crate::config::Resolved;
use crate::dist::ProcessGroup;

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

/// The checkpoint to resume from, in the run's checkpoint directory ([`checkpoint_dir`]; every
/// rank calls it: the ranks share the reading of the checksums, `checkpoints::verify`, and
/// agree on the result). Without `--resume`, an existing checkpoint is an error rather than
/// something silently overwritten or ignored.
pub fn resume_target(
    resolved: &Resolved,
    resume: Option<&Resume>,
    tag: &str,
    pg: &mut dyn ProcessGroup,
) -> Result<Option<PathBuf>> {
    let root = &checkpoint_dir(resolved);
    let lead = pg.rank() == 0;
    if lead {
        // The launcher commits these before a restart; a run started again by hand does here.
        for dir in checkpoints::reported::commit_reported(root) {
            println!(
                "{tag} Committed {}: every rank had written and reported its files when the \
                 run stopped",
                dir.display()
            );
        }
        for (stray, why) in checkpoints::strays(root) {
            match stray.extension().is_some_and(|e| e == "tmp") {
                true => println!(
                    "{tag} Ignoring incomplete checkpoint {} ({why})",
                    stray.display()
                ),
                false => println!("{tag} Ignoring {}: {why}", stray.display()),
            }
        }
    }
    // The other ranks list the directory once rank 0 has committed: a rank that listed it
    // before the commit saw no checkpoint where rank 0 saw one, and took another path through
    // the collectives below (found by a two-rank kill-during-save test under load:
    // all-reduce-max #3 on rank 0, barrier #3 on rank 1).
    pg.barrier()?;
    let chosen = match resume {
        None => match checkpoints::latest(root) {
            // A checkpoint.dir of its own is where a run's name does not matter.
            Some(found) if resolved.config.checkpoint.dir.is_some() => bail!(
                "checkpoint.dir {} already holds checkpoints (latest {}), of this run or \
                 another; pass --resume auto to continue from them, or give this run a \
                 checkpoint.dir of its own (--set checkpoint.dir=DIR, or leave it unset to save \
                 under the run directory)",
                root.display(),
                found.display()
            ),
            Some(found) => bail!(
                "{} already holds checkpoints (latest {}); pass --resume auto to continue that \
                 run, or set logging.run_name to start a new one",
                root.display(),
                found.display()
            ),
            None => None,
        },
        Some(Resume::Auto) => resume_auto(root, tag, pg)?,
        Some(Resume::Dir(dir)) => {
            if !dir.is_dir() {
                return Err(crate::config::ConfigError(format!(
                    "--resume {}: {}; pass a checkpoint directory (…/checkpoints/step_N), or \
                     --resume auto for the run's latest",
                    dir.display(),
                    if dir.exists() {
                        "not a directory"
                    } else {
                        "no such directory"
                    }
                ))
                .into());
            }
            anyhow::ensure!(
                dir.join("trainer.json").is_file(),
                "--resume {}: not a complete checkpoint directory (no trainer.json)",
                dir.display()
            );
            if let Some(why) = verified(dir, tag, pg)? {
                bail!(
                    "--resume {}: the checkpoint is damaged ({why}); resume from an earlier \
                     one, or with --resume auto, which skips damaged checkpoints",
                    dir.display()
                );
            }
            Some(dir.clone())
        }
    };
    if let (Some(dir), true) = (&chosen, lead) {
        if let Some(note) = checkpoints::unverified(dir) {
            println!("{tag} Warning: {note}");
        }
    }
    Ok(chosen)
}

/// `--resume auto`: the newest checkpoint that loads. A checkpoint damaged after it was
/// committed (a truncated or overwritten file, a disk error, a file missing) costs the steps
/// since the one before it, not the run; it is renamed `step_N.damaged`, so that the run's next
/// save of step N does not overwrite the evidence.
fn resume_auto(root: &Path, tag: &str, pg: &mut dyn ProcessGroup) -> Result<Option<PathBuf>> {
    let lead = pg.rank() == 0;
    let all = checkpoints::list(root);
    // Every rank must see the same newest checkpoint, or the ranks would verify different
    // directories (and call the collectives below in different orders): one shared directory,
    // as `lockstep run` and Slurm jobs require, always agrees; a per-host directory, or a
    // network filesystem that has not shown one host's rename to another yet, may not.
    let newest = all.last().map_or(0.0, |(step, _)| *step as f64 + 1.0);
    let (most, least) = (
        pg.all_reduce_max_f64(newest)?,
        -pg.all_reduce_max_f64(-newest)?,
    );
    if most != least {
        let says = |n: f64| match n as usize {
            0 => "no checkpoint".to_string(),
            n => format!("step_{} as the newest", n - 1),
        };
        bail!(
            "--resume auto: the ranks see different checkpoints in {} (this rank: {}; the \
             ranks range from {} to {}); every rank must read one shared checkpoint directory \
             (checkpoint.dir on a filesystem all hosts share)",
            root.display(),
            says(newest),
            says(least),
            says(most)
        );
    }
    if all.is_empty() {
        if lead {
            println!(
                "{tag} --resume auto: no complete checkpoint in {}; starting from scratch",
                root.display()
            );
        }
        return Ok(None);
    }
    let mut skipped: Vec<(usize, &PathBuf)> = Vec::new();
    for (step, dir) in all.iter().rev() {
        match verified(dir, tag, pg)? {
            None => {
                if let (Some(&(newest, _)), true) = (skipped.first(), lead) {
                    for (_, damaged) in &skipped {
                        let kept = checkpoints::set_damaged_aside(damaged)?;
                        println!(
                            "{tag} --resume auto: renamed the damaged {} to {} so that this \
                             run's next save does not overwrite it; delete it once you have \
                             looked at it",
                            damaged.display(),
                            kept.display()
                        );
                    }
                    println!(
                        "{tag} --resume auto: resuming from {} instead; steps {}..={newest} \
                         will be trained again",
                        dir.display(),
                        step + 1
                    );
                }
                return Ok(Some(dir.clone()));
            }
            Some(why) => {
                if lead {
                    println!(
                        "{tag} --resume auto: skipping damaged checkpoint {} ({why})",
                        dir.display()
                    );
                }
                skipped.push((*step, dir));
            }
        }
    }
    bail!(
        "--resume auto: none of the {} checkpoints in {} loads (each is damaged, see above); \
         resume from a copy with --resume DIR, or move them aside to start from scratch",
        all.len(),
        root.display()
    )
}

/// None when `dir` passes `checkpoints::verify` on every rank (each reading its share of the
/// files), else why not: this rank's finding, or which rank found one.
fn verified(dir: &Path, tag: &str, pg: &mut dyn ProcessGroup) -> Result<Option<String>> {
    let share = Share {
        index: pg.rank(),
        of: pg.world_size(),
    };
    let mine = checkpoints::verify(dir, share).err();
    // The highest rank that found damage, plus one (0: none did).
    let found = pg.all_reduce_max_f64(mine.as_ref().map_or(0.0, |_| pg.rank() as f64 + 1.0))?;
    Ok(match (mine, found as usize) {
        (_, 0) => None,
        (Some(e), _) => {
            if pg.rank() != 0 {
                // Rank 0 says it is skipped; the reason is here.
                println!("{tag} Warning: {} is damaged: {e:#}", dir.display());
            }
            Some(format!("{e:#}"))
        }
        (None, r) => Some(format!(
            "rank {} found a damaged file; its warning names it",
            r - 1
        )),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{resolve, Sources};
    use std::time::Duration;

    /// Two ranks whose checkpoint directories differ (per-host directories; or a rank that
    /// listed before rank 0 committed, which the barrier now rules out): both refuse with the
    /// same finding, rather than verifying different checkpoints and failing later at a
    /// collective that the other rank never calls.
    #[test]
    fn ranks_that_see_different_checkpoints_refuse_together() {
        let tmp = tempfile::tempdir().unwrap();
        let dirs = [tmp.path().join("a"), tmp.path().join("b")];
        std::fs::create_dir_all(dirs[0].join("step_1")).unwrap();
        std::fs::write(dirs[0].join("step_1/trainer.json"), "{}").unwrap();
        std::fs::create_dir_all(&dirs[1]).unwrap();
        let got = crate::dist::ring::tests::run_ranks(2, Duration::from_secs(20), |rank, mut g| {
            let resolved = resolve(&Sources {
                preset: Some("tiny".into()),
                sets: vec![format!("checkpoint.dir={}", dirs[rank].display())],
                ..Default::default()
            })
            .unwrap();
            resume_target(&resolved, Some(&Resume::Auto), "[test]", &mut g)
                .map_err(|e| format!("{e:#}"))
        });
        for (rank, this) in [(0, "step_1 as the newest"), (1, "no checkpoint")] {
            let e = got[rank].as_ref().expect_err("the ranks disagree");
            let want = format!(
                "--resume auto: the ranks see different checkpoints in {} (this rank: {this}; \
                 the ranks range from no checkpoint to step_1 as the newest); every rank must \
                 read one shared checkpoint directory (checkpoint.dir on a filesystem all hosts \
                 share)",
                dirs[rank].display()
            );
            assert_eq!(e, &want, "rank {rank}");
        }
    }
}
