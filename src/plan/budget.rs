//! How fast a rank's device and links are: read from the machine where it can be
//! (`sys::machine`), assumed (and said so) where it cannot. How much memory a rank has is
//! `start::rank_budget`.

use super::device::Device;
use crate::sys::machine;

/// Dense peak FLOP/s of one device for the compute dtype, and where the figure comes from.
pub fn peak_flops(device: Device, bf16: bool, cpu_threads: usize) -> (f64, String) {
    match device {
        Device::Cuda => {
            let (peak, source) = match machine::visible_gpu(0)
                .and_then(|g| machine::peak_bf16_flops(&g.name).map(|p| (p, g.name)))
            {
                Some((p, name)) => (p, name),
                None => (
                    989e12,
                    "H100 SXM, assumed: no known GPU visible".to_string(),
                ),
            };
            if bf16 {
                (peak, format!("{source}, dense bf16"))
            } else {
                // H100: 67 TFLOP/s fp32 without tensor cores against 989 bf16.
                (peak / 14.8, format!("{source}, fp32 = bf16 peak / 14.8"))
            }
        }
        Device::Cpu => {
            // Two 256-bit FMA ports: 32 fp32 FLOP per cycle, at an assumed 2.5 GHz.
            let per_core = 32.0 * 2.5e9;
            (
                per_core * cpu_threads.max(1) as f64,
                format!(
                    "{} CPU thread{} × 80 GFLOP/s (AVX2 FMA at 2.5 GHz, assumed)",
                    cpu_threads.max(1),
                    if cpu_threads == 1 { "" } else { "s" }
                ),
            )
        }
    }
}

/// Collective bandwidth within a node and across nodes (bytes/s per rank), ranks per node.
pub fn links(device: Device, world: usize) -> (f64, f64, usize) {
    match device {
        // NVLink 4 (H100 SXM) as NCCL's bus bandwidth reaches it; one 400 Gb/s InfiniBand NDR
        // port per GPU.
        Device::Cuda => (360e9, 40e9, 8),
        // The TCP ring on loopback (measured 1.07–1.23 GB/s, BENCHMARKS.md section 2) and
        // 10 GbE between machines.
        Device::Cpu => (1.0e9, 1.1e9, world.max(1)),
    }
}
