//! `--gpus`: parsing a list and picking the least used GPUs. Discovery itself is NVML's
//! ([`crate::sys::nvml`]), re-exported here for the launcher's callers.

use anyhow::{bail, Result};

pub use crate::sys::nvml::{detect_gpus, GpuInfo};

/// The `n` least used GPUs, least used first (memory in use, then utilisation, then index),
/// for `--gpus auto-free`. Returns fewer than `n` when there are fewer GPUs.
pub fn pick_free_gpus(gpus: &[GpuInfo], n: usize) -> Vec<usize> {
    let mut sorted: Vec<&GpuInfo> = gpus.iter().collect();
    sorted.sort_by_key(|g| (g.memory_used, g.utilization, g.index));
    sorted.into_iter().take(n).map(|g| g.index).collect()
}

/// Parses a `--gpus` list such as `0,1,3` (spaces around entries are allowed).
pub fn parse_gpu_list(s: &str) -> Result<Vec<usize>> {
    const HINT: &str = "expected comma-separated GPU indices such as 0,1,3";
    if s.trim().is_empty() {
        bail!("--gpus: empty list; {HINT}");
    }
    let mut ids = Vec::new();
    for (i, item) in s.split(',').enumerate() {
        let item = item.trim();
        if item.is_empty() {
            bail!("--gpus '{s}': entry {} is empty; {HINT}", i + 1);
        }
        match item.parse::<usize>() {
            Ok(id) => ids.push(id),
            Err(_) => bail!("--gpus '{s}': '{item}' is not a GPU index; {HINT}"),
        }
    }
    check_unique(&ids)?;
    Ok(ids)
}

/// Two workers on one GPU is never what was meant (and would usually run out of memory).
pub(super) fn check_unique(ids: &[usize]) -> Result<()> {
    for (i, id) in ids.iter().enumerate() {
        if ids[..i].contains(id) {
            bail!("--gpus: GPU {id} is listed twice; each GPU runs one worker");
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu(index: usize, used_gib: u64, utilization: u32) -> GpuInfo {
        GpuInfo {
            index,
            name: "test".into(),
            memory_used: used_gib << 30,
            memory_total: 80 << 30,
            utilization,
        }
    }

    #[test]
    fn parses_lists() {
        assert_eq!(parse_gpu_list("0,1,3").unwrap(), vec![0, 1, 3]);
        assert_eq!(parse_gpu_list(" 2 , 0 ").unwrap(), vec![2, 0]);
        assert_eq!(parse_gpu_list("7").unwrap(), vec![7]);
    }

    #[test]
    fn rejects_bad_lists_clearly() {
        let err = |s: &str| parse_gpu_list(s).unwrap_err().to_string();
        assert!(err("").contains("empty list"), "{}", err(""));
        assert!(err("0,,1").contains("entry 2 is empty"), "{}", err("0,,1"));
        assert!(err("0,1,").contains("entry 3 is empty"));
        assert!(err("0,x").contains("'x' is not a GPU index"));
        assert!(err("-1").contains("'-1' is not a GPU index"));
        assert!(err("0,1,0").contains("GPU 0 is listed twice"));
        assert!(err("auto").contains("such as 0,1,3"));
    }

    #[test]
    fn picks_least_used_first() {
        let gpus = [gpu(0, 40, 90), gpu(1, 0, 0), gpu(2, 1, 5), gpu(3, 0, 30)];
        assert_eq!(pick_free_gpus(&gpus, 2), vec![1, 3]);
        assert_eq!(pick_free_gpus(&gpus, 4), vec![1, 3, 2, 0]);
        assert_eq!(pick_free_gpus(&gpus, 9).len(), 4);
        assert!(pick_free_gpus(&[], 2).is_empty());
        // Ties fall back to the index, so the choice is stable.
        assert_eq!(pick_free_gpus(&[gpu(5, 0, 0), gpu(4, 0, 0)], 1), vec![4]);
    }
}
