//! Everything a run decides before its first step: where this rank runs (device, collectives,
//! precision), its run and checkpoint directories, the prepared data, the model shape and the
//! checkpoint to resume from.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use tch::{Device, Kind};

use super::checkpoint;
use crate::config::{
    check_backend_device, Config, ConfigError, DeviceChoice, DistBackendChoice, Resolved,
};
use crate::data::prepare::{prepare, PrepareSpec, Prepared};
use crate::dist::Backend;
use crate::model::{hf, LlamaShape};
use crate::sys::cuda::{cuda_available, load_cuda_backend};

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

/// This process's place among the ranks.
#[derive(Debug, Clone, Copy)]
pub struct Topology {
    pub rank: usize,
    pub world: usize,
    /// Rank on this node: under torchrun it picks the CUDA device.
    pub local_rank: usize,
}

impl Topology {
    pub const SINGLE: Topology = Topology {
        rank: 0,
        world: 1,
        local_rank: 0,
    };
}

/// A rank as the trainer sees it: its place, the device it resolved once at start, and the tag
/// (`[GPU3]`, `[CPU1]`) its lines carry.
#[derive(Debug, Clone)]
pub struct Rank {
    pub topo: Topology,
    pub device: Device,
    pub tag: String,
}

impl Rank {
    /// Resolves this rank's device (`system.device`) once; everything after uses `device`.
    pub fn new(cfg: &Config, topo: Topology) -> Result<Rank> {
        let device = resolve_device(cfg, topo)?;
        Ok(Rank {
            topo,
            device,
            tag: crate::telemetry::rank_tag(device.is_cuda(), topo.rank),
        })
    }

    /// Rank 0: the one that prints the run's summary and writes its records and checkpoints.
    pub fn lead(&self) -> bool {
        self.topo.rank == 0
    }
}

/// The CUDA index of this rank: `lockstep run` narrows CUDA_VISIBLE_DEVICES to one GPU per
/// worker (index 0), and so does srun with `--gpus-per-task=1`; torchrun leaves all visible,
/// so LOCAL_RANK picks one.
fn cuda_index(cfg: &Config, topo: Topology) -> usize {
    let one_visible = std::env::var("CUDA_VISIBLE_DEVICES")
        .is_ok_and(|v| !v.trim().is_empty() && !v.contains(','));
    if topo.world == 1 {
        cfg.system.device_id
    } else if std::env::var_os("LOCKSTEP_LAUNCHER").is_some() || one_visible {
        0
    } else {
        topo.local_rank
    }
}

fn resolve_device(cfg: &Config, topo: Topology) -> Result<Device> {
    let index = cuda_index(cfg, topo);
    Ok(match cfg.system.device {
        DeviceChoice::Cpu => Device::Cpu,
        DeviceChoice::Cuda => {
            if let Err(e) = load_cuda_backend() {
                bail!("system.device = cuda but libtorch's CUDA backend does not load ({e}); point LD_LIBRARY_PATH at a CUDA build of torch 2.11's lib/, or use system.device=cpu");
            }
            if !tch::Cuda::is_available() {
                bail!("system.device = cuda but no CUDA device is visible to libtorch (driver, CUDA_VISIBLE_DEVICES?); use system.device=cpu or auto");
            }
            Device::Cuda(index)
        }
        DeviceChoice::Auto if cuda_available() => Device::Cuda(index),
        DeviceChoice::Auto => Device::Cpu,
    })
}

/// The collectives of a multi-rank run on `device` (`system.dist_backend`).
pub fn dist_backend(cfg: &Config, device: Device) -> Result<Backend> {
    let runs_on = format!(
        "this rank runs on the CPU (system.device = {})",
        cfg.system.device
    );
    check_backend_device(cfg.system.dist_backend, device.is_cuda(), &runs_on)?;
    Ok(match (cfg.system.dist_backend, device) {
        (DistBackendChoice::Ring, _) | (_, Device::Cpu) => Backend::Ring,
        (_, Device::Cuda(cuda_device)) => Backend::Nccl { cuda_device },
        (_, other) => bail!("device {other:?} is not supported; use system.device=cpu or cuda"),
    })
}

/// `system.reduce_dtype` as a tensor dtype.
pub fn reduce_kind(cfg: &Config) -> Kind {
    match cfg.system.reduce_dtype {
        crate::config::ReduceDtype::Fp32 => Kind::Float,
        crate::config::ReduceDtype::Bf16 => Kind::BFloat16,
    }
}

/// The ranks that shard one copy of the state among `world` (`system.shard_degree`, 0 = all),
/// checked against the world and the stage: a config error (exit 2), found at start-up.
pub fn shard_degree(cfg: &Config, world: usize) -> Result<usize, ConfigError> {
    let degree = match cfg.system.shard_degree {
        0 => world,
        d => d,
    };
    if degree > world || !world.is_multiple_of(degree) {
        return Err(ConfigError(format!(
            "system.shard_degree = {degree}: must divide the number of ranks, {world} (e.g. the \
             ranks of one node), or be 0 for all ranks"
        )));
    }
    if degree < world && !cfg.system.zero_stage.shards_optimizer() {
        return Err(ConfigError(format!(
            "system.shard_degree = {degree} shards the training state at zero_stage >= 1, and \
             system.zero_stage = 0 replicates everything; set system.zero_stage (e.g. 3) or \
             system.shard_degree = 0"
        )));
    }
    Ok(degree)
}

/// Hybrid sharding's groups (`system.shard_degree` below the world size), formed by every rank
/// together, shard groups first; None when one group shards across all ranks.
pub fn hybrid_groups(
    cfg: &Config,
    pg: &mut dyn crate::dist::ProcessGroup,
) -> Result<Option<crate::train::optim::Hybrid>> {
    use std::sync::{Arc, Mutex};
    let (world, rank) = (pg.world_size(), pg.rank());
    let degree = shard_degree(cfg, world)?;
    if degree == world {
        return Ok(None);
    }
    let index = rank / degree;
    let shard: Vec<usize> = (index * degree..(index + 1) * degree).collect();
    let shard = pg.subgroup(&shard, &format!("shard{index}"))?;
    let position = rank % degree;
    let replica: Vec<usize> = (0..world / degree).map(|g| g * degree + position).collect();
    let replica = pg.subgroup(&replica, &format!("replica{position}"))?;
    Ok(Some(crate::train::optim::Hybrid {
        shard: Arc::new(Mutex::new(shard)),
        replica: Arc::new(Mutex::new(replica)),
        index,
    }))
}

/// The dtype the matmuls run in (`training.dtype`; master weights stay fp32).
pub fn compute_kind(cfg: &Config, device: Device) -> Kind {
    if cfg.training.dtype.is_bf16(device.is_cuda()) {
        Kind::BFloat16
    } else {
        Kind::Float
    }
}

pub fn checkpoint_dir(resolved: &Resolved) -> PathBuf {
    match &resolved.config.checkpoint.dir {
        Some(d) => PathBuf::from(d),
        None => resolved.run_dir().join("checkpoints"),
    }
}

/// One source of the run's data: `data.path`, or an entry of `data.sources`.
#[derive(Debug, Clone)]
pub struct SourceSpec {
    /// For logs, metrics and TensorBoard tags.
    pub name: String,
    /// Relative sampling weight (1 for `data.path`).
    pub weight: f64,
    pub prepare: PrepareSpec,
}

/// A source with its token files.
#[derive(Debug, Clone)]
pub struct DataSource {
    pub name: String,
    pub weight: f64,
    pub prepared: Prepared,
}

/// What identifies the data a run trains on, as recorded in every checkpoint: per source its
/// name, weight, tokenizer, token counts, and a hash of three 64 KiB samples of its training
/// tokens (start, middle, end). Path- and time-free, so a copied or re-prepared corpus is the
/// same data, and cheap on any corpus size.
pub fn data_identity(sources: &[DataSource]) -> Result<serde_json::Value> {
    use std::io::{Read, Seek, SeekFrom};
    const SAMPLE: u64 = 64 << 10;
    let mut out = Vec::new();
    for s in sources {
        let p = &s.prepared;
        let mut f = std::fs::File::open(&p.train)
            .with_context(|| format!("{}: cannot open", p.train.display()))?;
        let len = f.metadata()?.len();
        let mut hasher = blake3::Hasher::new();
        let mut buf = vec![0u8; SAMPLE as usize];
        for at in [
            0,
            len.saturating_sub(SAMPLE) / 2,
            len.saturating_sub(SAMPLE),
        ] {
            f.seek(SeekFrom::Start(at))?;
            let n = f.read(&mut buf)?;
            hasher.update(&buf[..n]);
        }
        out.push(serde_json::json!({
            "name": s.name,
            "weight": s.weight,
            "tokenizer": p.tokenizer_id,
            "train_tokens": p.train_tokens,
            "val_tokens": p.val_tokens,
            "sample_blake3": hasher.finalize().to_hex().as_str(),
        }));
    }
    Ok(serde_json::Value::Array(out))
}

/// How the data `now` differs from the checkpoint's `then` ([`data_identity`]), in words; None
/// when they are the same.
pub fn data_difference(then: &serde_json::Value, now: &serde_json::Value) -> Option<String> {
    if then == now {
        return None;
    }
    let (a, b) = (
        then.as_array().cloned().unwrap_or_default(),
        now.as_array().cloned().unwrap_or_default(),
    );
    if a.len() != b.len() {
        return Some(format!("{} source(s) then, {} now", a.len(), b.len()));
    }
    let mut diffs = Vec::new();
    for (x, y) in a.iter().zip(&b) {
        let name = y["name"].as_str().unwrap_or("?");
        for (key, what) in [
            ("name", "name"),
            ("weight", "weight"),
            ("tokenizer", "tokenizer"),
            ("train_tokens", "training tokens"),
            ("val_tokens", "validation tokens"),
            ("sample_blake3", "token content"),
        ] {
            if x[key] != y[key] {
                diffs.push(if key == "sample_blake3" {
                    format!("source {name}: {what} differs")
                } else {
                    format!("source {name}: {what} {} then, {} now", x[key], y[key])
                });
            }
        }
    }
    Some(diffs.join("; "))
}

/// The run's sources: the entries of `data.sources`, else `data.path` alone. Each is prepared
/// and cached on its own, so adding a source never tokenizes the others again.
pub fn source_specs(cfg: &Config, progress: bool) -> Vec<SourceSpec> {
    let d = &cfg.data;
    let spec = |path: &str, text_field: Option<&str>| PrepareSpec {
        tokenizer: d.tokenizer.clone(),
        path: PathBuf::from(path),
        text_field: text_field.unwrap_or(&d.text_field).to_string(),
        val_fraction: d.val_fraction,
        context_length: cfg.training.context_length,
        num_samples: d.num_samples,
        cache_dir: PathBuf::from(&d.cache_dir),
        num_threads: cfg.training.num_workers,
        progress,
    };
    if d.sources.is_empty() {
        let name = crate::data::source_names(&[(None, d.path.as_str())]).remove(0);
        return vec![SourceSpec {
            name,
            weight: 1.0,
            prepare: spec(&d.path, None),
        }];
    }
    let named: Vec<(Option<&str>, &str)> = d
        .sources
        .iter()
        .map(|s| (s.name.as_deref(), s.path.as_str()))
        .collect();
    let names = crate::data::source_names(&named);
    d.sources
        .iter()
        .zip(names)
        .map(|(s, name)| SourceSpec {
            name,
            weight: s.weight,
            prepare: spec(&s.path, s.text_field.as_deref()),
        })
        .collect()
}

/// Every source's token files, prepared or found in the cache, without a word (ranks that
/// find what local rank 0 or the launcher prepared).
pub fn prepare_quietly(cfg: &Config) -> Result<Vec<DataSource>> {
    source_specs(cfg, false)
        .into_iter()
        .map(|s| {
            Ok(DataSource {
                prepared: prepare(&s.prepare)?,
                name: s.name,
                weight: s.weight,
            })
        })
        .collect()
}

/// Prepares (or finds cached) every source's token files and says which.
pub fn prepare_data(cfg: &Config, tag: &str) -> Result<Vec<DataSource>> {
    let mixture = !cfg.data.sources.is_empty();
    let mut out = Vec::new();
    for (i, s) in source_specs(cfg, true).into_iter().enumerate() {
        let start = Instant::now();
        let p = prepare(&s.prepare).map_err(|e| {
            if mixture {
                e.context(format!("data.sources[{i}] ({})", s.name))
            } else {
                e
            }
        })?;
        let what = if p.cache_hit { "cache hit" } else { "prepared" };
        let which = if mixture {
            format!(" {} (weight {})", s.name, s.weight)
        } else {
            String::new()
        };
        println!(
            "{tag} Data{which}: {what} {} ({} train + {} val tokens, tokenizer {}, {:.1}s)",
            p.dir.display(),
            p.train_tokens,
            p.val_tokens,
            p.tokenizer_id,
            start.elapsed().as_secs_f64()
        );
        out.push(DataSource {
            name: s.name,
            weight: s.weight,
            prepared: p,
        });
    }
    Ok(out)
}

/// The model's shape, checked against the data: the vocabulary covers the tokenizer's and
/// every source's token ids.
pub fn model_shape(cfg: &Config, sources: &[DataSource]) -> Result<LlamaShape> {
    let data = &sources
        .first()
        .ok_or_else(|| anyhow::anyhow!("no data source"))?
        .prepared;
    let vocab = data.vocab_size;
    let shape = match &cfg.model.model_path {
        Some(dir) => hf::shape_from_dir(&crate::data::hub::resolve_model(dir)?, &cfg.model)?,
        None => LlamaShape::from_config(&cfg.model, vocab)?,
    };
    anyhow::ensure!(
        shape.vocab_size >= vocab,
        "the model's vocabulary ({}) is smaller than the tokenizer's ({vocab}); the tokenizer in data.tokenizer does not fit this model",
        shape.vocab_size
    );
    for s in sources {
        s.prepared.check_ids_fit(shape.vocab_size)?;
    }
    Ok(shape)
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{resolve, ConfigError, Sources};

    fn with(sets: &[&str]) -> Config {
        resolve(&Sources {
            sets: sets.iter().map(|s| s.to_string()).collect(),
            ..Default::default()
        })
        .unwrap()
        .config
    }

    #[test]
    fn dist_backend_follows_the_device_unless_forced() {
        let gpu = Device::Cuda(3);
        let auto = with(&[]);
        assert_eq!(dist_backend(&auto, Device::Cpu).unwrap(), Backend::Ring);
        assert_eq!(
            dist_backend(&auto, gpu).unwrap(),
            Backend::Nccl { cuda_device: 3 }
        );
        let ring = with(&["system.dist_backend=ring"]);
        assert_eq!(dist_backend(&ring, gpu).unwrap(), Backend::Ring);
        // `system.device = auto` that found no GPU: a config error naming the key and the fix.
        let nccl = with(&["system.dist_backend=nccl"]);
        let e = dist_backend(&nccl, Device::Cpu).unwrap_err();
        assert!(e.downcast_ref::<ConfigError>().is_some());
        assert!(
            e.to_string().contains(
                "needs CUDA ranks, but this rank runs on the CPU (system.device = auto); use system.dist_backend=auto or ring"
            ),
            "{e}"
        );
    }
}
