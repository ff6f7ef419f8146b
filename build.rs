//! 1. Embeds an rpath to the libtorch that torch-sys linked against, so `target/*/lockstep` runs
//!    without LD_LIBRARY_PATH. On another machine (the GPU box) LD_LIBRARY_PATH still wins:
//!    the linker writes RUNPATH, which the loader consults after LD_LIBRARY_PATH.
//! 2. Compiles the C++ shims against the same libtorch headers: the c10d TCPStore
//!    (`csrc/c10d_store.cpp`) and libtorch's fused AdamW kernel (`csrc/fused_adamw.cpp`).
fn main() {
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");
    println!("cargo:rerun-if-changed=csrc/c10d_store.cpp");
    println!("cargo:rerun-if-changed=csrc/fused_adamw.cpp");
    let lib = std::env::var("DEP_TCH_LIBTORCH_LIB")
        .expect("torch-sys exports DEP_TCH_LIBTORCH_LIB; build with LIBTORCH_USE_PYTORCH=1 (scripts/env.sh)");
    println!("cargo:rustc-link-arg=-Wl,-rpath,{lib}");
    cc::Build::new()
        .cpp(true)
        .file("csrc/c10d_store.cpp")
        .file("csrc/fused_adamw.cpp")
        .include(format!("{lib}/../include"))
        .include(format!("{lib}/../include/torch/csrc/api/include"))
        .flag("-std=c++17")
        .define("_GLIBCXX_USE_CXX11_ABI", "1")
        .warnings(false)
        .compile("lockstep_c10d");
    // After the static shim, so link order never depends on where torch-sys's flags land.
    println!("cargo:rustc-link-search=native={lib}");
    println!("cargo:rustc-link-lib=dylib=torch_cpu");
    println!("cargo:rustc-link-lib=dylib=c10");
}
