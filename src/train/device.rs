//! Where a rank computes: its device (`system.device`, the CUDA index under each launcher), the
//! collectives that device takes (`system.dist_backend`), and the dtypes of its matmuls and
//! reductions.

use anyhow::{bail, Result};
use tch::{Device, Kind};

use crate::config::{check_backend_device, Config, DeviceChoice, DistBackendChoice};
use crate::dist::Backend;
use crate::sys::cuda::{cuda_available, load_cuda_backend};

/// The CUDA index of this rank: `lockstep run` narrows CUDA_VISIBLE_DEVICES to one GPU per
/// worker (index 0), and so does srun with `--gpus-per-task=1`; torchrun leaves all visible,
/// so LOCAL_RANK picks one.
fn cuda_index(cfg: &Config, world: usize, local_rank: usize) -> usize {
    let one_visible = std::env::var("CUDA_VISIBLE_DEVICES")
        .is_ok_and(|v| !v.trim().is_empty() && !v.contains(','));
    if world == 1 {
        cfg.system.device_id
    } else if std::env::var_os("LOCKSTEP_LAUNCHER").is_some() || one_visible {
        0
    } else {
        local_rank
    }
}

/// This rank's device (`system.device`), resolved once at start (`place::Rank::new`).
pub fn resolve_device(cfg: &Config, world: usize, local_rank: usize) -> Result<Device> {
    let index = cuda_index(cfg, world, local_rank);
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

/// The dtype the matmuls run in (`training.dtype`; master weights stay fp32).
pub fn compute_kind(cfg: &Config, device: Device) -> Kind {
    if cfg.training.dtype.is_bf16(device.is_cuda()) {
        Kind::BFloat16
    } else {
        Kind::Float
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
