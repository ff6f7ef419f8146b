//! 1. Embeds an rpath to the libtorch that torch-sys linked against, so `target/*/lockstep` runs
//!    without LD_LIBRARY_PATH. On another machine (the GPU box) LD_LIBRARY_PATH still wins:
//!    the linker writes RUNPATH, which the loader consults after LD_LIBRARY_PATH.
//! 2. Compiles the C++ shims against the same libtorch headers: the c10d TCPStore
//!    (`csrc/c10d_store.cpp`) and libtorch's fused AdamW kernel (`csrc/fused_adamw.cpp`).
//! 3. Builds the NCCL shim (`csrc/nccl_group.cpp`, c10d's ProcessGroupNCCL) as a shared library
//!    in OUT_DIR, which src/dist/nccl.rs embeds and loads at run time on CUDA ranks only: linking
//!    it into the binary would make every CPU run load libtorch_cuda and the CUDA stack.
use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");
    for f in [
        "c10d_store.cpp",
        "fused_adamw.cpp",
        "nccl_group.cpp",
        "ffi_util.hpp",
    ] {
        println!("cargo:rerun-if-changed=csrc/{f}");
    }
    println!("cargo::rustc-check-cfg=cfg(lockstep_nccl)");
    let lib = std::env::var("DEP_TCH_LIBTORCH_LIB")
        .expect("torch-sys exports DEP_TCH_LIBTORCH_LIB; build with LIBTORCH_USE_PYTORCH=1 (scripts/env.sh)");
    println!("cargo:rustc-link-arg=-Wl,-rpath,{lib}");
    let torch_includes = [
        format!("{lib}/../include"),
        format!("{lib}/../include/torch/csrc/api/include"),
    ];
    cc::Build::new()
        .cpp(true)
        .file("csrc/c10d_store.cpp")
        .file("csrc/fused_adamw.cpp")
        .includes(&torch_includes)
        .flag("-std=c++17")
        .define("_GLIBCXX_USE_CXX11_ABI", "1")
        .warnings(false)
        .compile("lockstep_c10d");
    // After the static shim, so link order never depends on where torch-sys's flags land.
    println!("cargo:rustc-link-search=native={lib}");
    println!("cargo:rustc-link-lib=dylib=torch_cpu");
    println!("cargo:rustc-link-lib=dylib=c10");

    build_nccl_shim(Path::new(&lib), &torch_includes);
}

/// The pip wheel's layout: torch/lib next to nvidia/{nccl,cu13}/include. Without those headers
/// (a libtorch not from the wheel, or nvidia-cuda-crt missing), or with LOCKSTEP_NO_NCCL set,
/// the binary is built without the NCCL backend and says so when a CUDA rank asks for it.
fn build_nccl_shim(lib: &Path, torch_includes: &[String]) {
    println!("cargo:rerun-if-env-changed=LOCKSTEP_NO_NCCL");
    if std::env::var_os("LOCKSTEP_NO_NCCL").is_some() {
        println!("cargo:warning=LOCKSTEP_NO_NCCL is set: building without the NCCL backend");
        return;
    }
    let nvidia = lib.join("../../nvidia");
    let nccl_inc = nvidia.join("nccl/include");
    let cuda_inc = nvidia.join("cu13/include");
    // Watched so that installing the headers later turns the backend on without a clean build.
    let missing: Vec<PathBuf> = [
        nccl_inc.join("nccl.h"),
        cuda_inc.join("cuda_runtime_api.h"),
        cuda_inc.join("crt/host_config.h"),
        cuda_inc.join("cccl/nv/target"),
        lib.join("libtorch_cuda.so"),
    ]
    .into_iter()
    .inspect(|p| println!("cargo:rerun-if-changed={}", p.display()))
    .filter(|p| !p.exists())
    .collect();
    if !missing.is_empty() {
        println!(
            "cargo:warning=building without the NCCL backend: missing {missing:?} (install scripts/requirements.txt)"
        );
        return;
    }
    let out = PathBuf::from(std::env::var("OUT_DIR").unwrap()).join("liblockstep_nccl.so");
    let compiler = cc::Build::new().cpp(true).get_compiler();
    let mut cmd = Command::new(compiler.path());
    cmd.args(["-shared", "-fPIC", "-O2", "-g0", "-s", "-std=c++17"])
        .args([
            "-D_GLIBCXX_USE_CXX11_ABI=1",
            "-DUSE_C10D_NCCL",
            "-DUSE_CUDA",
        ])
        .args(torch_includes.iter().map(|i| format!("-I{i}")))
        .arg(format!("-I{}", nccl_inc.display()))
        .arg(format!("-I{}", cuda_inc.display()))
        .arg(format!("-I{}", cuda_inc.join("cccl").display()))
        .arg("-Wno-interference-size")
        .arg("csrc/nccl_group.cpp")
        .arg(format!("-L{}", lib.display()))
        // --no-as-needed: the shim must pull in libtorch_cuda (ProcessGroupNCCL lives there)
        // and the soname is what the loader matches against the already-loaded backend.
        .args([
            "-Wl,--no-as-needed",
            "-ltorch_cuda",
            "-lc10_cuda",
            "-ltorch_cpu",
            "-lc10",
        ])
        .arg(format!("-Wl,-rpath,{}", lib.display()))
        .arg("-o")
        .arg(&out);
    let status = cmd
        .status()
        .unwrap_or_else(|e| panic!("cannot run {:?}: {e}", compiler.path()));
    assert!(
        status.success(),
        "compiling csrc/nccl_group.cpp failed: {cmd:?}"
    );
    println!("cargo:rustc-cfg=lockstep_nccl");
    println!("cargo:rustc-env=LOCKSTEP_NCCL_SHIM={}", out.display());
}
