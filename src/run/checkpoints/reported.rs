//! A save every rank had finished, left uncommitted because the run stopped (a rank died, the
//! launcher tore the workers down and SIGKILLed rank 0 before its rename). Besides its store
//! reports, a save leaves on disk in `step_N.tmp/` what its commit needs:
//!
//! ```text
//!   commit.pending.json    rank 0, at the start: the trainer state, the rank count, and the
//!                          files only rank 0 writes (index, config.json)
//!   report-<r>.pending.json rank r, once its files are fsynced: their sizes and BLAKE3
//! ```
//!
//! [`commit_reported`] (the launcher before a restart, rank 0 before it resumes) commits a
//! `step_N.tmp` whose every rank reported and whose files still have the reported checksums,
//! exactly as rank 0 would have; anything less stays an interrupted save, which resume
//! ignores and the next save removes. A committed checkpoint holds neither file.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{ensure, Context, Result};
use serde::{Deserialize, Serialize};

use super::{trainer_json, FileSum, FileSums, TrainerState};
use crate::sys::durable::{write_synced, AtomicDir};

const COMMIT: &str = "commit.pending.json";

fn report_name(rank: usize) -> String {
    format!("report-{rank}.pending.json")
}

/// What rank 0 would write to complete the save.
#[derive(Serialize, Deserialize)]
struct Intent {
    world: usize,
    state: TrainerState,
    /// Rank 0's files written at the commit (JSON text): name → contents.
    lead: BTreeMap<String, String>,
}

/// Rank 0, once `staging` exists: what completes it (`lead` files, `state`) for `world` ranks.
pub fn write_intent(
    staging: &Path,
    world: usize,
    state: &TrainerState,
    lead: &[(&str, Vec<u8>)],
) -> Result<()> {
    let intent = Intent {
        world,
        state: state.clone(),
        lead: lead
            .iter()
            .map(|(n, b)| (n.to_string(), String::from_utf8_lossy(b).into_owned()))
            .collect(),
    };
    write_synced(&staging.join(COMMIT), &serde_json::to_vec(&intent)?)
}

/// Rank `rank`, once its files in `staging` are durable: their checksums.
pub fn write_report(staging: &Path, rank: usize, sums: &FileSums) -> Result<()> {
    write_synced(&staging.join(report_name(rank)), &serde_json::to_vec(sums)?)
}

/// What completes a save in `staging` once every one of `world` ranks' files is durable (`sums`:
/// what each wrote), written one way by rank 0's commit and by [`commit_reported`]: the `lead`
/// files (rank 0's own), trainer.json with `state` and every file's checksum; then the pending
/// files go, so a committed checkpoint holds none. The rename into place is the caller's.
pub fn complete<'a>(
    staging: &Path,
    world: usize,
    state: &TrainerState,
    lead: impl IntoIterator<Item = (&'a str, &'a [u8])>,
    mut sums: FileSums,
) -> Result<()> {
    for (name, bytes) in lead {
        sums.insert(name.to_string(), FileSum::of_bytes(bytes));
        write_synced(&staging.join(name), bytes)?;
    }
    write_synced(&staging.join("trainer.json"), &trainer_json(state, &sums)?)?;
    for name in (0..world).map(report_name).chain([COMMIT.to_string()]) {
        let _ = fs::remove_file(staging.join(name));
    }
    Ok(())
}

/// Commits every `step_N.tmp` under `root` whose every rank reported its files and whose files
/// are as reported; returns the checkpoints it committed.
pub fn commit_reported(root: &Path) -> Vec<PathBuf> {
    let Ok(entries) = fs::read_dir(root) else {
        return Vec::new();
    };
    let mut staged: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.join(COMMIT).is_file())
        .collect();
    staged.sort();
    staged
        .into_iter()
        .filter_map(|tmp| {
            let name = tmp.file_name()?.to_str()?.strip_suffix(".tmp")?;
            let dest = root.join(name);
            (super::step_of(&dest).is_some() && !dest.exists())
                .then(|| commit(&tmp, &dest).ok())
                .flatten()
        })
        .collect()
}

fn commit(tmp: &Path, dest: &Path) -> Result<PathBuf> {
    let read = |name: &str| -> Result<Vec<u8>> {
        fs::read(tmp.join(name)).with_context(|| format!("{}: no {name}", tmp.display()))
    };
    let intent: Intent = serde_json::from_slice(&read(COMMIT)?)?;
    let mut sums = FileSums::new();
    for r in 0..intent.world {
        let theirs: FileSums = serde_json::from_slice(&read(&report_name(r))?)?;
        sums.extend(theirs);
    }
    for (name, sum) in &sums {
        ensure!(
            &FileSum::of_file(&tmp.join(name))? == sum,
            "{}: {name} is not as reported",
            tmp.display()
        );
    }
    let lead = intent.lead.iter().map(|(n, t)| (n.as_str(), t.as_bytes()));
    complete(tmp, intent.world, &intent.state, lead, sums)?;
    AtomicDir::adopt(dest).commit()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(step: usize) -> TrainerState {
        serde_json::from_value(serde_json::json!({
            "format": super::super::FORMAT_VERSION, "step": step, "samples_consumed": 8,
            "seed": 1, "adam_step": step, "loss": 1.0, "world_size": 2,
            "model_shape": {
                "vocab_size": 8, "hidden_size": 4, "num_layers": 1, "num_heads": 1,
                "num_kv_heads": 1, "intermediate_size": 8, "max_position_embeddings": 16,
                "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": false,
                "init_std": 0.02, "attention": "sdpa"
            },
            "config": {}, "versions": {}
        }))
        .unwrap()
    }

    /// Rank `rank` writes `bytes` as `name` into `tmp` and reports it.
    fn written(tmp: &Path, rank: usize, name: &str, bytes: &[u8]) {
        fs::write(tmp.join(name), bytes).unwrap();
        let sums = FileSums::from([(name.to_string(), FileSum::of_bytes(bytes))]);
        write_report(tmp, rank, &sums).unwrap();
    }

    #[test]
    fn only_a_save_every_rank_reported_with_its_files_intact_is_committed() {
        let root = tempfile::tempdir().unwrap();
        let tmp = root.path().join("step_4.tmp");
        fs::create_dir(&tmp).unwrap();
        write_intent(&tmp, 2, &state(4), &[("config.json", b"{}".to_vec())]).unwrap();
        written(&tmp, 0, "optimizer-00001-of-00002.safetensors", b"zero");
        // Rank 1 has not reported: nothing is committed.
        assert!(commit_reported(root.path()).is_empty());
        written(&tmp, 1, "optimizer-00002-of-00002.safetensors", b"one");
        // A file that is not as reported: nothing is committed.
        fs::write(tmp.join("optimizer-00002-of-00002.safetensors"), b"two").unwrap();
        assert!(commit_reported(root.path()).is_empty());
        assert!(tmp.is_dir());
        fs::write(tmp.join("optimizer-00002-of-00002.safetensors"), b"one").unwrap();
        let dest = root.path().join("step_4");
        assert_eq!(commit_reported(root.path()), std::slice::from_ref(&dest));
        assert!(!tmp.exists());
        let recorded = super::super::integrity::recorded(&dest).unwrap().unwrap();
        assert_eq!(recorded.len(), 3, "{recorded:?}");
        assert_eq!(super::super::read_state(&dest).unwrap().step, 4);
        let pending: Vec<_> = fs::read_dir(&dest)
            .unwrap()
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().contains("pending"))
            .collect();
        assert!(pending.is_empty(), "{pending:?}");
    }
}
