//! Facts of this machine that the planner, the start check, the step line and the
//! out-of-memory report read: host memory (/proc), this process's resident memory, the GPUs'
//! memory (NVML, through the CUDA index a rank sees) and their data-sheet peak FLOP/s.
//! Read here once, so every reader agrees on what a figure means.

use super::nvml;

/// `MemAvailable` of /proc/meminfo in bytes: what the kernel says can be allocated without
/// swapping (free memory plus reclaimable caches).
pub fn mem_available() -> Option<f64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    parse_meminfo(&text, "MemAvailable:")
}

fn parse_meminfo(text: &str, field: &str) -> Option<f64> {
    let line = text.lines().find(|l| l.starts_with(field))?;
    let kb: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024.0)
}

/// (free, total) bytes of the GPU behind CUDA index `cuda_index`, from NVML.
pub fn gpu_memory(cuda_index: usize) -> Option<(f64, f64)> {
    let g = visible_gpu(cuda_index)?;
    (g.memory_total > 0).then(|| {
        (
            g.memory_total.saturating_sub(g.memory_used) as f64,
            g.memory_total as f64,
        )
    })
}

/// Resident memory of this process in bytes, from /proc/self/status (0 where it is unavailable).
pub fn rss_bytes() -> u64 {
    status_kb("VmRSS:").unwrap_or(0) * 1024
}

/// Peak resident memory of this process in bytes.
pub fn peak_rss_bytes() -> u64 {
    status_kb("VmHWM:").unwrap_or(0) * 1024
}

fn status_kb(field: &str) -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with(field))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// Bytes as (decimal) GB.
pub fn gb(bytes: u64) -> f64 {
    bytes as f64 / 1e9
}

/// Dense (non-sparse) bf16 tensor-core peak in FLOP/s, from NVIDIA's data sheets.
pub fn peak_bf16_flops(gpu_name: &str) -> Option<f64> {
    let n = gpu_name.to_ascii_uppercase();
    let tflops = if n.contains("H100") && (n.contains("PCIE") || n.contains("PCI")) {
        756.0
    } else if n.contains("H100") && n.contains("NVL") {
        835.0
    } else if n.contains("H100") || n.contains("H200") || n.contains("H800") || n.contains("GH200")
    {
        989.0
    } else if n.contains("B200") {
        2250.0
    } else if n.contains("A100") {
        312.0
    } else if n.contains("L40S") {
        362.0
    } else if n.contains("A10G") {
        70.0
    } else {
        return None;
    };
    Some(tflops * 1e12)
}

/// The GPU behind a CUDA index, by NVML. CUDA_VISIBLE_DEVICES (which `lockstep run` sets to
/// the physical index) maps CUDA indices to NVML ones; without it they are the same.
pub fn visible_gpu(cuda_index: usize) -> Option<nvml::GpuInfo> {
    let physical = std::env::var("CUDA_VISIBLE_DEVICES")
        .ok()
        .and_then(|v| {
            v.split(',')
                .nth(cuda_index)
                .and_then(|s| s.trim().parse().ok())
        })
        .unwrap_or(cuda_index);
    nvml::gpu(physical)
}

/// Dense bf16 peak of the GPU behind `cuda_index`, when NVML names a known device.
pub fn device_peak(cuda_index: usize) -> Option<f64> {
    visible_gpu(cuda_index).and_then(|g| peak_bf16_flops(&g.name))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meminfo_fields_are_read_in_bytes() {
        let text = "MemTotal:       24567892 kB\nMemFree:  100 kB\nMemAvailable:   22000000 kB\n";
        assert_eq!(
            parse_meminfo(text, "MemAvailable:"),
            Some(22_000_000.0 * 1024.0)
        );
        assert_eq!(parse_meminfo(text, "Missing:"), None);
        assert!(mem_available().is_some_and(|b| b > 0.0));
    }

    #[test]
    fn a_touched_allocation_shows_in_resident_and_peak_memory() {
        // Other tests in this process allocate and free concurrently, so compare against the
        // allocation itself (and the peak, which never goes down), not against a "before".
        // black_box: an allocation nothing reads may be removed by the optimizer altogether.
        let v = std::hint::black_box(vec![1u8; 256 << 20]);
        let rss = rss_bytes();
        assert!(rss >= 256 << 20, "{rss}");
        assert!(peak_rss_bytes() >= 256 << 20);
        drop(v);
    }

    #[test]
    fn known_and_unknown_devices() {
        assert_eq!(peak_bf16_flops("NVIDIA H100 80GB HBM3"), Some(989e12));
        assert_eq!(peak_bf16_flops("NVIDIA H100 PCIe"), Some(756e12));
        assert_eq!(peak_bf16_flops("NVIDIA H100 NVL"), Some(835e12));
        assert_eq!(peak_bf16_flops("NVIDIA H200"), Some(989e12));
        assert_eq!(peak_bf16_flops("NVIDIA GeForce GTX 1080"), None);
    }

    #[test]
    fn mfu_is_the_peak_of_the_gpu_nvml_names_and_none_without_one() {
        // Without an NVIDIA driver (CI) MFU is omitted rather than guessed; on a GPU machine it
        // is the data-sheet peak of the device NVML reports.
        match visible_gpu(0) {
            None => assert_eq!(device_peak(0), None),
            Some(gpu) => {
                assert!(gpu.memory_total > 0, "{}", gpu.name);
                assert_eq!(device_peak(0), peak_bf16_flops(&gpu.name), "{}", gpu.name);
            }
        }
    }
}
