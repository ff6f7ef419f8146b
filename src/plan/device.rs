//! Where a plan's run runs, and what that decides of its precision.

use serde::Serialize;

use crate::config::Config;

/// What the plan is for: where it runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Device {
    Cpu,
    Cuda,
}

/// Whether bf16 matmuls run (`training.dtype`; auto = bf16 on CUDA).
pub fn bf16_compute(cfg: &Config, device: Device) -> bool {
    cfg.training.dtype.is_bf16(device == Device::Cuda)
}
