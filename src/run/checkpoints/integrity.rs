//! Whether a checkpoint directory can be loaded, decided before any state is touched: every
//! file its layout requires is there, and each is the bytes its writer wrote.
//!
//! trainer.json, written last by rank 0, lists every other file of the directory with its size
//! and BLAKE3 (`"files"`), which each rank computed over the file it had just written, on the
//! writer thread for a background save. A file overwritten in place (a disk error, a bad copy),
//! one missing, or one written by another run into the same directory then fails [`verify`]
//! with its name; `--resume auto` falls back to the checkpoint before. Checkpoints written
//! before the list existed are checked by their layout alone (and each safetensors file's
//! header against its length).
//!
//! ```text
//!   model.safetensors                      one writer, or
//!   model.safetensors.index.json           + every model-0000i-of-0000K.safetensors it names
//!   optimizer.safetensors                  one rank, or
//!   optimizer-0000r-of-0000N.safetensors   for every r in 1..=N (one per rank)
//!   config.json
//!   trainer.json                           the list of the files above, with their checksums
//! ```

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::Path;

use anyhow::{bail, ensure, Context, Result};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::sys::durable::file_blake3;
use crate::tensor_io::SafeFile;

/// The key of trainer.json that lists the checkpoint's other files.
pub const FILES_KEY: &str = "files";

/// A file as its writer left it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileSum {
    pub bytes: u64,
    /// BLAKE3 of the contents, hex.
    pub blake3: String,
}

impl FileSum {
    pub fn of_file(path: &Path) -> Result<FileSum> {
        let bytes = fs::metadata(path)
            .with_context(|| format!("{}: cannot read", path.display()))?
            .len();
        Ok(FileSum {
            bytes,
            blake3: file_blake3(path)?,
        })
    }

    pub fn of_bytes(bytes: &[u8]) -> FileSum {
        FileSum {
            bytes: bytes.len() as u64,
            blake3: blake3::hash(bytes).to_hex().to_string(),
        }
    }
}

/// File name → what was written, for every file of a checkpoint but trainer.json.
pub type FileSums = BTreeMap<String, FileSum>;

/// Which of a checkpoint's files a rank reads back to check its checksum: file i (in name
/// order) is rank i mod `of`'s, so the ranks of a resume share the reading.
#[derive(Debug, Clone, Copy)]
pub struct Share {
    pub index: usize,
    pub of: usize,
}

impl Share {
    /// One process checks every file.
    pub const ALL: Share = Share { index: 0, of: 1 };
}

/// The files of a checkpoint's layout, found from its file names and its index.
#[derive(Debug)]
pub struct Layout {
    /// `model.safetensors`, or the shards the index names.
    pub model: Vec<String>,
    /// Whether the model is sharded (so `model.safetensors.index.json` is part of it).
    pub indexed: bool,
    /// `optimizer.safetensors`, or `optimizer-0000r-of-0000N.safetensors` for r in 1..=N.
    pub optimizer: Vec<String>,
}

pub const INDEX: &str = "model.safetensors.index.json";

/// Which files of a checkpoint a check covers.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Scope {
    /// Everything a resume reads.
    All,
    /// The model alone (config.json, the weights and their index): what `eval`, `generate`
    /// and `export` read.
    Model,
}

impl Layout {
    pub fn of(dir: &Path) -> Result<Layout> {
        Layout::scoped(dir, Scope::All)
    }

    /// The layout of `scope`'s files (no optimizer files for [`Scope::Model`]).
    fn scoped(dir: &Path, scope: Scope) -> Result<Layout> {
        let names: BTreeSet<String> = fs::read_dir(dir)
            .with_context(|| format!("{}: cannot list", dir.display()))?
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .collect();
        let (model, indexed) = if names.contains(INDEX) {
            (index_shards(&dir.join(INDEX))?, true)
        } else if names.contains("model.safetensors") {
            (vec!["model.safetensors".to_string()], false)
        } else {
            match names.iter().find(|n| numbered(n, "model").is_some()) {
                Some(shard) => bail!(
                    "{}: missing: the model is in shards ({shard}, …) and the index that names \
                     the shard of every tensor is gone",
                    dir.join(INDEX).display()
                ),
                None => bail!(
                    "{}: no model weights (neither model.safetensors nor {INDEX})",
                    dir.display()
                ),
            }
        };
        let optimizer = if scope == Scope::Model {
            Vec::new()
        } else if names.contains("optimizer.safetensors") {
            vec!["optimizer.safetensors".to_string()]
        } else {
            let counts: BTreeSet<usize> = names
                .iter()
                .filter_map(|n| numbered(n, "optimizer").map(|(_, of)| of))
                .collect();
            match counts.into_iter().collect::<Vec<_>>().as_slice() {
                [] => bail!(
                    "{}: no optimizer state (optimizer.safetensors or \
                     optimizer-*-of-*.safetensors)",
                    dir.display()
                ),
                [n] => (1..=*n)
                    .map(|r| numbered_name("optimizer", r, *n))
                    .collect(),
                more => bail!(
                    "{}: optimizer files of {} different world sizes ({more:?}): files of \
                     different saves are mixed in this directory",
                    dir.display(),
                    more.len()
                ),
            }
        };
        Ok(Layout {
            model,
            indexed,
            optimizer,
        })
    }

    /// Every file the layout requires, trainer.json aside, sorted.
    pub fn files(&self) -> Vec<String> {
        let mut all: BTreeSet<String> = self.model.iter().cloned().collect();
        all.extend(self.optimizer.iter().cloned());
        if self.indexed {
            all.insert(INDEX.to_string());
        }
        all.insert("config.json".to_string());
        all.into_iter().collect()
    }
}

/// `<stem>-0000i-of-0000N.safetensors` → (i, N).
fn numbered(name: &str, stem: &str) -> Option<(usize, usize)> {
    let rest = name.strip_prefix(stem)?.strip_prefix('-')?;
    let (i, n) = rest.strip_suffix(".safetensors")?.split_once("-of-")?;
    Some((i.parse().ok()?, n.parse().ok()?))
}

pub fn numbered_name(stem: &str, i: usize, n: usize) -> String {
    format!("{stem}-{i:05}-of-{n:05}.safetensors")
}

/// The files an index's `weight_map` names, sorted.
fn index_shards(index: &Path) -> Result<Vec<String>> {
    let text =
        fs::read_to_string(index).with_context(|| format!("{}: cannot read", index.display()))?;
    let v: Value = serde_json::from_str(&text)
        .with_context(|| format!("{}: not valid JSON (damaged?)", index.display()))?;
    let map = v["weight_map"]
        .as_object()
        .with_context(|| format!("{}: no weight_map", index.display()))?;
    let files: BTreeSet<String> = map
        .values()
        .filter_map(Value::as_str)
        .map(str::to_string)
        .collect();
    Ok(files.into_iter().collect())
}

/// What trainer.json lists, if it lists anything (checkpoints from before the list do not).
pub fn recorded(dir: &Path) -> Result<Option<FileSums>> {
    let path = dir.join("trainer.json");
    let text =
        fs::read_to_string(&path).with_context(|| format!("{}: cannot read", path.display()))?;
    let v: Value = serde_json::from_str(&text)
        .with_context(|| format!("{}: unreadable trainer.json", path.display()))?;
    match v.get(FILES_KEY) {
        None => Ok(None),
        Some(files) => serde_json::from_value(files.clone())
            .map(Some)
            .with_context(|| format!("{}: unreadable \"{FILES_KEY}\"", path.display())),
    }
}

/// Fails, naming the file and what is wrong with it, unless every file of `scope` the
/// checkpoint in `dir` needs is there and whole: the files of its layout and those trainer.json
/// lists, each of the recorded size; each safetensors file's header matches its length; and the
/// files of `share` hash to the recorded BLAKE3. trainer.json itself is checked by its reader
/// (`read_state`).
pub fn verify_files(dir: &Path, share: Share, scope: Scope) -> Result<()> {
    let layout = Layout::scoped(dir, scope)?;
    let sums = recorded(dir)?;
    let mut names: BTreeSet<String> = layout.files().into_iter().collect();
    if let Some(sums) = &sums {
        for name in &names {
            ensure!(
                sums.contains_key(name),
                "{}: not part of the checkpoint as it was saved (trainer.json does not list \
                 it): another process wrote into this directory",
                dir.join(name).display()
            );
        }
        if scope == Scope::All {
            names.extend(sums.keys().cloned());
        }
    }
    for (i, name) in names.iter().enumerate() {
        let path = dir.join(name);
        let len = match fs::metadata(&path) {
            Ok(m) => m.len(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                bail!("{}: missing{}", path.display(), why_needed(name, &layout))
            }
            Err(e) => return Err(e).with_context(|| format!("{}: cannot read", path.display())),
        };
        if let Some(want) = sums.as_ref().and_then(|s| s.get(name)) {
            ensure!(
                len == want.bytes,
                "{}: damaged: {len} bytes, but {} when it was written (trainer.json)",
                path.display(),
                want.bytes
            );
            if i % share.of == share.index {
                let got = file_blake3(&path)?;
                ensure!(
                    got == want.blake3,
                    "{}: damaged: its contents are not the bytes that were written (BLAKE3 {}… \
                     where trainer.json recorded {}…)",
                    path.display(),
                    &got[..16],
                    &want.blake3[..want.blake3.len().min(16)]
                );
            }
        }
        if name.ends_with(".safetensors") {
            SafeFile::open(&path)?;
        }
    }
    Ok(())
}

fn why_needed(name: &str, layout: &Layout) -> String {
    if layout.optimizer.len() > 1 && layout.optimizer.iter().any(|o| o == name) {
        format!(
            " (the checkpoint was written by {} ranks, one optimizer file each)",
            layout.optimizer.len()
        )
    } else if layout.indexed && layout.model.iter().any(|m| m == name) {
        format!(" ({INDEX} names it as a shard of the model)")
    } else {
        String::new()
    }
}
