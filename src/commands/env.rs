//! `lockstep env`: what a bug report needs, one fact per line. It never fails on what it finds:
//! a wrong libtorch or a CUDA backend that does not load is printed, not raised, so the output
//! of a broken setup is the report itself.

use std::process::Command;

use anyhow::Result;

use crate::sys::{self, cuda, libtorch, nvml};
use crate::telemetry::wandb;

pub fn run() -> Result<()> {
    for (key, value) in facts() {
        println!("{key:<11}{value}");
    }
    Ok(())
}

/// The report as (key, value) lines, in order.
pub fn facts() -> Vec<(&'static str, String)> {
    let mut out: Vec<(&str, String)> = vec![("lockstep", libtorch::LOCKSTEP_VERSION.to_string())];
    if let Ok(exe) = std::env::current_exe() {
        out.push(("binary", exe.display().to_string()));
    }
    match libtorch::loaded() {
        Ok(t) => {
            let path = t.path.as_ref().map(|p| p.display().to_string());
            out.push((
                "libtorch",
                format!(
                    "{} from {}{}",
                    t.describe(),
                    path.as_deref().unwrap_or("an unknown file"),
                    t.commit
                        .as_deref()
                        .map(|c| format!(", PyTorch commit {}", &c[..c.len().min(12)]))
                        .unwrap_or_default()
                ),
            ));
            if let Err(e) = t.check() {
                out.push(("", format!("PROBLEM: {e}")));
            }
            if let Some(cudnn) = &t.cudnn {
                out.push(("cuDNN", format!("{cudnn} (libtorch's build)")));
            }
        }
        Err(e) => out.push(("libtorch", format!("PROBLEM: {e}"))),
    }
    out.extend(cuda_lines());
    out.push(("W&B Python", wandb_python()));
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    // SAFETY: sysconf has no preconditions.
    let online = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
    out.push((
        "CPUs",
        format!("{cpus} usable by this process ({online} online)"),
    ));
    out.push(("memory", memory()));
    out.push(("host", host()));
    out
}

/// The CUDA runtime, driver, NCCL and GPUs; loading libtorch's CUDA backend when the machine
/// has an NVIDIA driver, else saying why not.
fn cuda_lines() -> Vec<(&'static str, String)> {
    let mut out = Vec::new();
    if !cuda::nvidia_driver_present() {
        out.push((
            "CUDA",
            "no NVIDIA driver on this machine (/dev/nvidiactl missing): CPU only".to_string(),
        ));
        return out;
    }
    if let Err(e) = cuda::load_cuda_backend() {
        out.push((
            "CUDA",
            format!("PROBLEM: libtorch's CUDA backend does not load: {e}"),
        ));
    } else {
        let s = cuda::stack();
        let or = |v: &Option<String>| v.clone().unwrap_or_else(|| "unknown".to_string());
        out.push((
            "CUDA",
            format!(
                "runtime {}, the driver supports up to {}",
                or(&s.runtime),
                or(&s.driver_cuda)
            ),
        ));
        out.push((
            "NCCL",
            match (&s.nccl, &s.nccl_library) {
                (Some(v), Some(lib)) => format!("{v} from {}", lib.display()),
                (v, _) => or(v),
            },
        ));
    }
    out.push((
        "driver",
        nvml::driver_version().unwrap_or_else(|| "unknown (no NVML)".to_string()),
    ));
    let gpus = nvml::detect_gpus();
    if gpus.is_empty() {
        out.push(("GPUs", "none visible to NVML".to_string()));
    }
    for g in gpus {
        out.push((
            "GPU",
            format!(
                "{}: {}, {:.1} GiB, {:.1} GiB free",
                g.index,
                g.name,
                g.memory_total as f64 / (1u64 << 30) as f64,
                g.memory_total.saturating_sub(g.memory_used) as f64 / (1u64 << 30) as f64
            ),
        ));
    }
    out
}

/// The sidecar's default Python and whether it has `wandb`.
fn wandb_python() -> String {
    let python = wandb::default_python();
    let probe = Command::new(&python)
        .args([
            "-c",
            "import importlib.metadata as m\ntry: print(m.version('wandb'))\nexcept m.PackageNotFoundError: print('')",
        ])
        .output();
    let has = match probe {
        Ok(o) if o.status.success() => match String::from_utf8_lossy(&o.stdout).trim() {
            "" => "no wandb package (pip install \"lockstep[wandb]\" or wandb)".to_string(),
            v => format!("wandb {v}"),
        },
        Ok(o) => format!("does not run ({})", o.status),
        Err(e) => format!("does not run ({e})"),
    };
    format!("{} ({has})", python.display())
}

/// `MemTotal` and `MemAvailable` of /proc/meminfo.
fn memory() -> String {
    let text = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let kib = |key: &str| -> Option<f64> {
        let line = text.lines().find(|l| l.starts_with(key))?;
        line.split_whitespace().nth(1)?.parse::<f64>().ok()
    };
    match (kib("MemTotal:"), kib("MemAvailable:")) {
        (Some(t), Some(a)) => format!(
            "{:.1} GiB, {:.1} GiB available",
            t / (1 << 20) as f64,
            a / (1 << 20) as f64
        ),
        _ => "unknown (no /proc/meminfo)".to_string(),
    }
}

/// The host's name, kernel and glibc.
fn host() -> String {
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    // SAFETY: gnu_get_libc_version returns a static NUL-terminated string.
    let glibc = unsafe { sys::ffi::copy_c_string(libc::gnu_get_libc_version()) };
    format!(
        "{}, Linux {}, glibc {}",
        sys::hostname(),
        kernel.trim(),
        glibc.unwrap_or_default()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_report_names_versions_and_the_machine() {
        let facts = facts();
        let get = |k: &str| {
            facts
                .iter()
                .find(|(key, _)| *key == k)
                .map(|(_, v)| v.clone())
                .unwrap_or_else(|| panic!("no {k} line in {facts:?}"))
        };
        assert!(get("lockstep").starts_with(env!("CARGO_PKG_VERSION")));
        let t = get("libtorch");
        assert!(t.starts_with("2.11.0 (CUDA 13.0 build) from /"), "{t}");
        assert!(t.contains("libtorch_cpu.so, PyTorch commit "), "{t}");
        assert!(
            !facts.iter().any(|(_, v)| v.starts_with("PROBLEM")),
            "{facts:?}"
        );
        assert!(get("CPUs").contains("usable by this process"));
        assert!(
            get("memory").ends_with("GiB available"),
            "{}",
            get("memory")
        );
        assert!(get("host").contains(", glibc 2."), "{}", get("host"));
        // The venv this build was made against (scripts/env.sh installs wandb into it) has
        // the package; another machine's Python (a GPU machine running the carried unit-test
        // binary) is reported either way, by its path.
        let w = get("W&B Python");
        let python = wandb::default_python();
        assert!(w.starts_with(&format!("{} (", python.display())), "{w}");
        if python == std::path::Path::new(env!("LOCKSTEP_VENV_PYTHON")) {
            assert!(w.contains("(wandb 0."), "{w}");
        } else {
            assert!(
                w.contains("(wandb ") || w.contains("(no wandb package"),
                "{w}"
            );
        }
    }
}
