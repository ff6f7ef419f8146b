//! Model FLOPs utilisation: achieved training FLOPs over the GPU's dense bf16 peak, shown in the
//! step line only where the peak of the device is known.

use crate::sys::nvml;

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
pub fn nvml_device(cuda_index: usize) -> Option<nvml::GpuInfo> {
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
    nvml_device(cuda_index).and_then(|g| peak_bf16_flops(&g.name))
}

#[cfg(test)]
mod tests {
    use super::*;

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
        match nvml_device(0) {
            None => assert_eq!(device_peak(0), None),
            Some(gpu) => {
                assert!(gpu.memory_total > 0, "{}", gpu.name);
                assert_eq!(device_peak(0), peak_bf16_flops(&gpu.name), "{}", gpu.name);
            }
        }
    }
}
