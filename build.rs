//! Embeds an rpath to the libtorch that torch-sys linked against, so `target/*/lockstep` runs
//! without LD_LIBRARY_PATH. On another machine (e.g. the GPU box) LD_LIBRARY_PATH still wins,
//! because the linker writes RUNPATH, which the loader consults after LD_LIBRARY_PATH.
fn main() {
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");
    if let Ok(lib) = std::env::var("DEP_TCH_LIBTORCH_LIB") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{lib}");
    }
}
