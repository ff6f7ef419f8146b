//! The libtorch this process loaded: where it is, its version and build, and the start-up
//! check that it is the one lockstep was built for.
//!
//! tch has no stable ABI: lockstep 0.1 is compiled against libtorch 2.11's headers, and another
//! minor version either fails to load (a missing symbol, which the dynamic loader reports
//! before `main`) or loads and misbehaves. [`check`] turns the second case into one line at
//! start; the wheel's launcher (`python/lockstep/__main__.py`) catches the first before it
//! starts the binary.

use std::collections::BTreeMap;
use std::ffi::{c_char, c_int, CStr};
use std::path::PathBuf;
use std::sync::OnceLock;

use super::ffi::{call, take_c_string};

/// The libtorch version lockstep is built for, as `major.minor` (tch 0.24 ↔ libtorch 2.11).
pub const REQUIRED: &str = "2.11";

/// lockstep's version and the commit it was built from: `0.1.0 (commit 0123456789ab)`.
pub const LOCKSTEP_VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (commit ",
    env!("LOCKSTEP_COMMIT"),
    ")"
);

extern "C" {
    /// csrc/torch_info.cpp: caffe2::GetBuildOptions() as malloc'd "KEY=VALUE\n" lines.
    fn ls_torch_build_options(out: *mut *mut c_char, err: *mut *mut c_char) -> c_int;
}

/// What the loaded libtorch reports about its build.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Libtorch {
    /// The `libtorch_cpu.so` file the loader picked.
    pub path: Option<PathBuf>,
    /// `TORCH_VERSION`, e.g. `2.11.0` (without pip's `+cu130` local tag).
    pub version: String,
    /// The CUDA version it was built for (`CUDA_VERSION`, e.g. `13.0`); None for a CPU build.
    pub cuda: Option<String>,
    /// The cuDNN version it was built with (`CUDNN_VERSION`).
    pub cudnn: Option<String>,
    /// `COMMIT_SHA`: the PyTorch commit.
    pub commit: Option<String>,
    /// `USE_NCCL`: whether it has NCCL.
    pub nccl: bool,
}

impl Libtorch {
    /// Reads the build table of a libtorch (one `KEY=VALUE` per line, as the shim returns it).
    pub fn from_build_options(lines: &str, path: Option<PathBuf>) -> Libtorch {
        let options: BTreeMap<&str, &str> =
            lines.lines().filter_map(|l| l.split_once('=')).collect();
        let get = |k: &str| {
            options
                .get(k)
                .map(|v| v.trim().to_string())
                .filter(|v| !v.is_empty())
        };
        let on = |k: &str| get(k).is_some_and(|v| matches!(v.as_str(), "1" | "ON" | "TRUE"));
        Libtorch {
            path,
            version: get("TORCH_VERSION").unwrap_or_else(|| "unknown".to_string()),
            cuda: get("CUDA_VERSION").filter(|_| on("USE_CUDA")),
            cudnn: get("CUDNN_VERSION").filter(|_| on("USE_CUDNN")),
            commit: get("COMMIT_SHA"),
            nccl: on("USE_NCCL"),
        }
    }

    /// `2.11.0 (CUDA 13.0 build)` / `2.11.0 (CPU build)`.
    pub fn describe(&self) -> String {
        match &self.cuda {
            Some(cuda) => format!("{} (CUDA {cuda} build)", self.version),
            None => format!("{} (CPU build)", self.version),
        }
    }

    /// Whether this is the libtorch lockstep was built for; the error is one line naming the
    /// version found, where, and the fix.
    pub fn check(&self) -> Result<(), String> {
        let minor = |v: &str| v.splitn(3, '.').take(2).collect::<Vec<_>>().join(".");
        if minor(&self.version) == REQUIRED {
            return Ok(());
        }
        let at = self
            .path
            .as_ref()
            .map(|p| format!(" ({})", p.display()))
            .unwrap_or_default();
        Err(format!(
            "lockstep {LOCKSTEP_VERSION} needs libtorch {REQUIRED}.x, but the libtorch it loaded{at} \
             is {}; install it into this Python environment with `pip install \"torch=={REQUIRED}.*\"` \
             (or point LD_LIBRARY_PATH at the lib/ directory of a torch {REQUIRED} install)",
            self.version
        ))
    }
}

/// The loaded libtorch, read once.
pub fn loaded() -> &'static Result<Libtorch, String> {
    static INFO: OnceLock<Result<Libtorch, String>> = OnceLock::new();
    INFO.get_or_init(|| {
        let mut out: *mut c_char = std::ptr::null_mut();
        // SAFETY: both out-pointers are valid for the call.
        call(|err| unsafe { ls_torch_build_options(&mut out, err) })
            .map_err(|e| format!("cannot read libtorch's build options: {e}"))?;
        // SAFETY: on success `out` is a malloc'd string that we now own.
        let lines = unsafe { take_c_string(out) }.unwrap_or_default();
        let path = library_of(c"_ZN6caffe215GetBuildOptionsB5cxx11Ev");
        Ok(Libtorch::from_build_options(&lines, path))
    })
}

/// The start-up check: the loaded libtorch is [`REQUIRED`].
pub fn check() -> anyhow::Result<()> {
    loaded()
        .as_ref()
        .map_err(|e| anyhow::anyhow!("{e}"))?
        .check()
        .map_err(anyhow::Error::msg)
}

/// The file of the loaded library that defines `symbol` (searched in the global scope), as
/// the dynamic loader opened it.
pub fn library_of(symbol: &CStr) -> Option<PathBuf> {
    let p = super::ffi::global_symbol(symbol).ok()?.as_ptr();
    // SAFETY: `info` is a valid out-pointer; dladdr fills it for an address inside a loaded
    // object, and dli_fname then points at the loader's NUL-terminated copy of the name.
    unsafe {
        let mut info: libc::Dl_info = std::mem::zeroed();
        if libc::dladdr(p, &mut info) == 0 || info.dli_fname.is_null() {
            return None;
        }
        let name = CStr::from_ptr(info.dli_fname)
            .to_string_lossy()
            .into_owned();
        Some(std::fs::canonicalize(&name).unwrap_or_else(|_| PathBuf::from(name)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_loaded_libtorch_is_2_11_and_says_where_it_is() {
        let t = loaded().as_ref().unwrap();
        assert!(t.version.starts_with("2.11."), "{t:?}");
        assert_eq!(t.check(), Ok(()));
        let path = t.path.as_ref().expect("dladdr finds libtorch_cpu");
        assert!(path.ends_with("libtorch_cpu.so"), "{}", path.display());
        // PyPI's torch 2.11.0 is the CUDA 13.0 build, with NCCL.
        assert_eq!(t.cuda.as_deref(), Some("13.0"), "{t:?}");
        assert!(t.nccl);
        assert_eq!(t.commit.as_deref().map(str::len), Some(40), "{t:?}");
    }

    #[test]
    fn another_version_fails_with_the_version_the_path_and_the_fix() {
        let lines = "TORCH_VERSION=2.10.0\nCUDA_VERSION=12.8\nUSE_CUDA=ON\nUSE_NCCL=1\n";
        let t = Libtorch::from_build_options(
            lines,
            Some(PathBuf::from("/env/torch/lib/libtorch_cpu.so")),
        );
        assert_eq!(t.describe(), "2.10.0 (CUDA 12.8 build)");
        let e = t.check().unwrap_err();
        assert!(e.contains("needs libtorch 2.11.x"), "{e}");
        assert!(
            e.contains("(/env/torch/lib/libtorch_cpu.so) is 2.10.0"),
            "{e}"
        );
        assert!(e.contains("pip install \"torch==2.11.*\""), "{e}");
        assert!(!e.contains('\n'), "one line: {e}");
        // 2.11 with any patch release passes; 2.1 or 2.110 do not pass for 2.11.
        for (v, ok) in [
            ("2.11.3", true),
            ("2.1.0", false),
            ("2.110.0", false),
            ("3.11.0", false),
        ] {
            let t = Libtorch::from_build_options(&format!("TORCH_VERSION={v}\n"), None);
            assert_eq!(t.check().is_ok(), ok, "{v}");
            assert_eq!(t.describe(), format!("{v} (CPU build)"));
        }
        // A table without the key is "unknown", which fails.
        assert!(Libtorch::from_build_options("", None)
            .check()
            .unwrap_err()
            .contains("is unknown"));
    }
}
