//! Everything a run decides before its first step: device, precision, run and checkpoint
//! directories, the prepared data, the model shape and the checkpoint to resume from.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Result};
use tch::{Device, Kind};

use super::checkpoint;
use super::trainer::{Resume, Topology};
use crate::config::{Config, ConfigError, Resolved};
use crate::data::prepare::{prepare, PrepareSpec, Prepared};
use crate::dist::Backend;
use crate::model::{hf, LlamaShape};

/// The CUDA index of this rank: `lockstep run` narrows CUDA_VISIBLE_DEVICES to one GPU per
/// worker (index 0); torchrun leaves all visible, so LOCAL_RANK picks one.
fn cuda_index(cfg: &Config, topo: Topology) -> usize {
    if topo.world == 1 {
        cfg.system.device_id
    } else if std::env::var_os("LOCKSTEP_LAUNCHER").is_some() {
        0
    } else {
        topo.local_rank
    }
}

/// Loads libtorch's CUDA backend. The linker drops `libtorch_cuda.so` from the binary's needed
/// libraries (nothing references its symbols; it registers kernels when loaded), so without
/// this `tch::Cuda::is_available()` is false even on a GPU machine. Loaded on demand so that
/// CPU runs neither pay for the ~1 GB library nor depend on the CUDA libraries being intact.
pub fn load_cuda_backend() -> Result<(), String> {
    static LOADED: std::sync::OnceLock<Result<(), String>> = std::sync::OnceLock::new();
    LOADED
        .get_or_init(|| {
            let name = c"libtorch_cuda.so";
            // SAFETY: dlopen with a NUL-terminated name; the handle is kept for the process.
            let handle = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
            if handle.is_null() {
                // SAFETY: dlerror returns a thread-local NUL-terminated message or NULL.
                let err = unsafe { libc::dlerror() };
                let msg = if err.is_null() {
                    "unknown error".to_string()
                } else {
                    unsafe { std::ffi::CStr::from_ptr(err) }
                        .to_string_lossy()
                        .into_owned()
                };
                return Err(msg);
            }
            Ok(())
        })
        .clone()
}

/// Whether libtorch can run on CUDA here: the backend loads and a device is visible.
pub fn cuda_available() -> bool {
    load_cuda_backend().is_ok() && tch::Cuda::is_available()
}

pub fn resolve_device(cfg: &Config, topo: Topology) -> Result<Device> {
    let index = cuda_index(cfg, topo);
    Ok(match cfg.system.device.as_str() {
        "cpu" => Device::Cpu,
        "cuda" => {
            if let Err(e) = load_cuda_backend() {
                bail!("system.device = cuda but libtorch's CUDA backend does not load ({e}); point LD_LIBRARY_PATH at a CUDA build of torch 2.11's lib/, or use system.device=cpu");
            }
            if !tch::Cuda::is_available() {
                bail!("system.device = cuda but no CUDA device is visible to libtorch (driver, CUDA_VISIBLE_DEVICES?); use system.device=cpu or auto");
            }
            Device::Cuda(index)
        }
        _ if cuda_available() => Device::Cuda(index),
        _ => Device::Cpu,
    })
}

/// The collectives of a multi-rank run on `device` (`system.dist_backend`).
pub fn dist_backend(cfg: &Config, device: Device) -> Result<Backend> {
    Ok(match (cfg.system.dist_backend.as_str(), device) {
        ("ring", _) | ("auto", Device::Cpu) => Backend::Ring,
        (_, Device::Cuda(cuda_device)) => Backend::Nccl { cuda_device },
        _ => {
            return Err(ConfigError(format!(
                "system.dist_backend = nccl needs CUDA ranks, but this rank runs on {device:?} \
                 (system.device = {}); use system.dist_backend=auto or ring",
                cfg.system.device
            ))
            .into())
        }
    })
}

pub fn compute_kind(cfg: &Config, device: Device) -> Kind {
    match (cfg.training.dtype.as_str(), device) {
        ("bf16", _) | ("auto", Device::Cuda(_)) => Kind::BFloat16,
        _ => Kind::Float,
    }
}

pub fn run_dir(resolved: &Resolved) -> PathBuf {
    let c = &resolved.config.logging;
    Path::new(&c.dir).join(c.run_name.as_deref().unwrap_or(&resolved.preset))
}

pub fn checkpoint_dir(resolved: &Resolved) -> PathBuf {
    match &resolved.config.checkpoint.dir {
        Some(d) => PathBuf::from(d),
        None => run_dir(resolved).join("checkpoints"),
    }
}

pub fn prepare_spec(cfg: &Config, progress: bool) -> PrepareSpec {
    PrepareSpec {
        tokenizer: cfg.data.tokenizer.clone(),
        path: PathBuf::from(&cfg.data.path),
        text_field: cfg.data.text_field.clone(),
        val_fraction: cfg.data.val_fraction,
        context_length: cfg.training.context_length,
        num_samples: cfg.data.num_samples,
        cache_dir: PathBuf::from(&cfg.data.cache_dir),
        num_threads: cfg.training.num_workers,
        progress,
    }
}

/// Prepares (or finds cached) token files and says which.
pub fn prepare_data(cfg: &Config, tag: &str) -> Result<Prepared> {
    let start = Instant::now();
    let p = prepare(&prepare_spec(cfg, true))?;
    let what = if p.cache_hit { "cache hit" } else { "prepared" };
    println!(
        "{tag} Data: {what} {} ({} train + {} val tokens, tokenizer {}, {:.1}s)",
        p.dir.display(),
        p.train_tokens,
        p.val_tokens,
        p.tokenizer_id,
        start.elapsed().as_secs_f64()
    );
    Ok(p)
}

pub fn model_shape(cfg: &Config, vocab: usize) -> Result<LlamaShape> {
    let shape = match &cfg.model.model_path {
        Some(dir) => hf::shape_from_dir(&crate::data::hub::resolve_model(dir)?, &cfg.model)?,
        None => LlamaShape::from_config(&cfg.model, vocab)?,
    };
    anyhow::ensure!(
        shape.vocab_size >= vocab,
        "the model's vocabulary ({}) is smaller than the tokenizer's ({vocab}); the tokenizer in data.tokenizer does not fit this model",
        shape.vocab_size
    );
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
            let found = checkpoint::latest(root);
            if found.is_none() {
                println!("{tag} --resume auto: no complete checkpoint in {}; starting from scratch", root.display());
            }
            Ok(found)
        }
        Some(Resume::Dir(dir)) => {
            anyhow::ensure!(dir.join("trainer.json").is_file(), "--resume {}: not a complete checkpoint directory (no trainer.json)", dir.display());
            Ok(Some(dir.clone()))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{resolve, Sources};

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
            e.to_string()
                .contains("use system.dist_backend=auto or ring"),
            "{e}"
        );
    }
}
