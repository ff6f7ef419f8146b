//! 1. Embeds an rpath to the libtorch that torch-sys linked against, so `target/*/lockstep` runs
//!    without LD_LIBRARY_PATH. On another machine (the GPU box) LD_LIBRARY_PATH still wins:
//!    the linker writes RUNPATH, which the loader consults after LD_LIBRARY_PATH.
//! 2. Compiles the C++ shims against the same libtorch headers: the c10d TCPStore
//!    (`csrc/c10d_store.cpp`), libtorch's fused AdamW kernel (`csrc/fused_adamw.cpp`), Muon's
//!    Newton-Schulz iteration and update (`csrc/muon.cpp`), libtorch's variable-length flash
//!    attention (`csrc/flash_varlen.cpp`), a backward seeded with given
//!    gradients (`csrc/autograd.cpp`) and a storage freed and re-allocated in place
//!    (`csrc/storage.cpp`).
//! 3. Builds the NCCL shim (`csrc/nccl_group.cpp`, c10d's ProcessGroupNCCL) as a shared library
//!    in OUT_DIR, which src/dist/nccl/loader.rs embeds and loads at run time on CUDA ranks only:
//!    linking it into the binary would make every CPU run load libtorch_cuda and the CUDA stack.
//! 4. Packs the default corpus, `data/shakespeare/**/*.txt`, into one zstd stream in OUT_DIR,
//!    which src/data/builtin.rs embeds as `data.path = builtin:shakespeare`, so the default
//!    works from any directory. Packed here rather than committed as a blob so the text files
//!    stay the only copy and the two can never disagree.
//!
//! 5. Names the Python of the venv that libtorch came from (`LOCKSTEP_VENV_PYTHON`, empty when
//!    it is not a venv): the W&B sidecar's default interpreter (src/telemetry/wandb.rs).
//! 6. Names the commit the binary is built from (`LOCKSTEP_COMMIT`: `git rev-parse`, with
//!    `+modified` when the code differs from it; `LOCKSTEP_COMMIT` in the environment wins),
//!    for `--version` and `lockstep env`. The script reruns whenever the code changes, so the
//!    shims (2.–3.) are recompiled only when their sources, flags or libtorch changed.
//!
//! 7. Links csrc/glibc_compat.cpp into the binary and the NCCL shim: what newer C++ headers
//!    make the objects ask of glibc and libstdc++ beyond the manylinux_2_28 floor, defined
//!    inside them (scripts/build-manylinux.sh builds the wheel's binary against glibc 2.28).
//!
//! All shims share csrc/ffi_util.hpp (the error convention; see src/sys/ffi.rs).
use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");
    for f in [
        "c10d_store.cpp",
        "fused_adamw.cpp",
        "muon.cpp",
        "flash_varlen.cpp",
        "autograd.cpp",
        "storage.cpp",
        "torch_info.cpp",
        "nccl_group.cpp",
        "glibc_compat.cpp",
        "ffi_util.hpp",
    ] {
        println!("cargo:rerun-if-changed=csrc/{f}");
    }
    println!("cargo::rustc-check-cfg=cfg(lockstep_nccl)");
    let lib = std::env::var("DEP_TCH_LIBTORCH_LIB")
        .expect("torch-sys exports DEP_TCH_LIBTORCH_LIB; build with LIBTORCH_USE_PYTORCH=1 (scripts/env.sh)");
    println!("cargo:rustc-link-arg=-Wl,-rpath,{lib}");
    let venv_python = Path::new(&lib)
        .ancestors()
        .find(|d| d.join("pyvenv.cfg").exists())
        .map(|d| d.join("bin/python").display().to_string());
    println!(
        "cargo:rustc-env=LOCKSTEP_VENV_PYTHON={}",
        venv_python.unwrap_or_default()
    );
    let torch_includes = [
        format!("{lib}/../include"),
        format!("{lib}/../include/torch/csrc/api/include"),
    ];
    // The NCCL shim (one g++ of ~30 s) and the corpus on a thread of their own, beside the seven
    // shims (~40 s, one after another): this script is on the build's critical path, between
    // torch-sys's and lockstep's own compilation (BENCHMARKS.md §18).
    std::thread::scope(|s| {
        s.spawn(|| {
            build_nccl_shim(Path::new(&lib), &torch_includes);
            pack_corpus("shakespeare");
        });
        link_shims(&lib, &torch_includes);
    });
    commit();
}

/// Compiles the shims into one static library and glibc_compat.o, and links them and libtorch.
fn link_shims(lib: &str, torch_includes: &[String]) {
    let shims = [
        "csrc/c10d_store.cpp",
        "csrc/fused_adamw.cpp",
        "csrc/muon.cpp",
        "csrc/flash_varlen.cpp",
        "csrc/autograd.cpp",
        "csrc/storage.cpp",
        "csrc/torch_info.cpp",
    ];
    let out = PathBuf::from(std::env::var("OUT_DIR").unwrap());
    if up_to_date(&out.join("liblockstep_c10d.a"), &shims, lib) {
        // What cc's compile() prints, without compiling again.
        println!("cargo:rustc-link-search=native={}", out.display());
        println!("cargo:rustc-link-lib=static=lockstep_c10d");
        println!("cargo:rustc-link-lib=stdc++");
    } else {
        cc::Build::new()
            .cpp(true)
            .files(shims)
            .includes(torch_includes)
            .flag("-std=c++17")
            .define("_GLIBCXX_USE_CXX11_ABI", "1")
            .warnings(false)
            .compile("lockstep_c10d");
        stamp(&out.join("liblockstep_c10d.a"), lib);
    }
    // An object on the link line, not an archive member, so that it serves torch-sys's libtch
    // as well as the shims whatever the link order (see the file).
    let compat = out.join("glibc_compat.o");
    if !up_to_date(&compat, &["csrc/glibc_compat.cpp"], lib) {
        let compiler = cc::Build::new().cpp(true).get_compiler();
        let mut cmd = compiler.to_command();
        cmd.args([
            "-c",
            "-fPIC",
            "-O2",
            "-std=c++17",
            "-D_GLIBCXX_USE_CXX11_ABI=1",
        ])
        .arg("csrc/glibc_compat.cpp")
        .arg("-o")
        .arg(&compat);
        run_compiler(&mut cmd, "csrc/glibc_compat.cpp");
        stamp(&compat, lib);
    }
    println!("cargo:rustc-link-arg={}", compat.display());
    // After the static shim, so link order never depends on where torch-sys's flags land.
    println!("cargo:rustc-link-search=native={lib}");
    println!("cargo:rustc-link-lib=dylib=torch_cpu");
    println!("cargo:rustc-link-lib=dylib=c10");
}

/// Sets `LOCKSTEP_COMMIT` (6. above). Watches the code and what a commit or a checkout moves
/// (HEAD, the branch's ref, packed refs), so that either reruns the script; not git's index,
/// which `git status` rewrites without any change to the code.
fn commit() {
    println!("cargo:rerun-if-env-changed=LOCKSTEP_COMMIT");
    let head = std::fs::read_to_string(".git/HEAD").unwrap_or_default();
    let branch = head
        .strip_prefix("ref: ")
        .map(|r| format!(".git/{}", r.trim()));
    // What the binary is built from: `+modified` when any of it differs from HEAD.
    let code = ["src", "csrc", "build.rs", "Cargo.toml", "Cargo.lock"];
    let git_refs = [".git/HEAD", ".git/packed-refs"];
    for w in code
        .iter()
        .chain(&git_refs)
        .copied()
        .chain(branch.as_deref())
    {
        if Path::new(w).exists() {
            println!("cargo:rerun-if-changed={w}");
        }
    }
    let id = std::env::var("LOCKSTEP_COMMIT")
        .ok()
        .filter(|c| !c.is_empty())
        .or_else(|| {
            let git = |args: &[&str]| Command::new("git").args(args).output().ok();
            let head = git(&["rev-parse", "--short=12", "HEAD"]).filter(|o| o.status.success())?;
            let head = String::from_utf8_lossy(&head.stdout).trim().to_string();
            let clean = git(&[&["diff", "--quiet", "HEAD", "--"][..], &code[..]].concat())
                .is_some_and(|o| o.status.success());
            Some(if clean {
                head
            } else {
                format!("{head}+modified")
            })
        });
    println!(
        "cargo:rustc-env=LOCKSTEP_COMMIT={}",
        id.unwrap_or_else(|| "unknown".to_string())
    );
}

/// Whether `artifact` was built from the current `inputs` against the libtorch in `lib`: it is
/// newer than each input and its stamp (written by [`stamp`]) names `lib`.
fn up_to_date(artifact: &Path, inputs: &[&str], lib: &str) -> bool {
    let mtime = |p: &Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
    let Some(built) = mtime(artifact) else {
        return false;
    };
    let stamp = std::fs::read_to_string(artifact.with_extension("stamp")).unwrap_or_default();
    stamp == lib
        && ["csrc/ffi_util.hpp", "build.rs"]
            .iter()
            .chain(inputs)
            .all(|i| mtime(Path::new(i)).is_some_and(|t| t < built))
}

/// Runs a compiler command that builds `what`; the build script fails with the command line
/// if it cannot run or fails.
fn run_compiler(cmd: &mut Command, what: &str) {
    let status = cmd
        .status()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    assert!(status.success(), "compiling {what} failed: {cmd:?}");
}

fn stamp(artifact: &Path, lib: &str) {
    std::fs::write(artifact.with_extension("stamp"), lib).unwrap();
}

/// `data/<name>`'s `.txt` files (hidden entries skipped), sorted by relative path as
/// `data::list_files` sorts a directory, packed as: per file a u32 name length, the
/// `/`-separated relative name, a u64 byte length and the bytes (little-endian); then zstd
/// level 12 (5.06 MB of text → 1.73 MB). Written to OUT_DIR/<name>.pack.zst; the uncompressed
/// pack is kept beside it so a rerun of this script for another reason skips the compression.
fn pack_corpus(name: &str) {
    let dir = Path::new("data").join(name);
    // A directory: cargo reruns the script when anything below it changes.
    println!("cargo:rerun-if-changed={}", dir.display());
    let mut files = Vec::new();
    collect_txt(&dir, &mut files);
    files.sort();
    assert!(
        !files.is_empty(),
        "{}: no .txt files to embed",
        dir.display()
    );
    let mut pack = Vec::new();
    for file in &files {
        let rel: Vec<String> = file
            .strip_prefix(&dir)
            .unwrap()
            .components()
            .map(|c| {
                c.as_os_str()
                    .to_str()
                    .expect("UTF-8 file names")
                    .to_string()
            })
            .collect();
        let rel = rel.join("/");
        let bytes = std::fs::read(file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
        pack.extend_from_slice(&(rel.len() as u32).to_le_bytes());
        pack.extend_from_slice(rel.as_bytes());
        pack.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
        pack.extend_from_slice(&bytes);
    }
    let out = PathBuf::from(std::env::var("OUT_DIR").unwrap());
    let (raw, packed) = (
        out.join(format!("{name}.pack")),
        out.join(format!("{name}.pack.zst")),
    );
    if packed.is_file() && std::fs::read(&raw).is_ok_and(|old| old == pack) {
        return;
    }
    // Level 12: 1.5 s for the 5.06 MB pack, 1.73 MB out; level 19 took 11 s of every clean build
    // for 1.60 MB (measured with the zstd CLI on this 2-core machine).
    let compressed = zstd::stream::encode_all(&pack[..], 12).expect("zstd compression");
    std::fs::write(&packed, compressed).unwrap();
    std::fs::write(&raw, &pack).unwrap();
}

fn collect_txt(dir: &Path, out: &mut Vec<PathBuf>) {
    let entries = std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    for entry in entries {
        let path = entry.unwrap().path();
        let hidden = path
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with('.'));
        if hidden {
            continue;
        }
        if path.is_dir() {
            collect_txt(&path, out);
        } else if path.extension().is_some_and(|e| e == "txt") {
            out.push(path);
        }
    }
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
    let lib_key = lib.display().to_string();
    if up_to_date(
        &out,
        &["csrc/nccl_group.cpp", "csrc/glibc_compat.cpp"],
        &lib_key,
    ) {
        println!("cargo:rustc-cfg=lockstep_nccl");
        println!("cargo:rustc-env=LOCKSTEP_NCCL_SHIM={}", out.display());
        return;
    }
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
        .arg("csrc/glibc_compat.cpp")
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
    run_compiler(&mut cmd, "csrc/nccl_group.cpp");
    stamp(&out, &lib_key);
    println!("cargo:rustc-cfg=lockstep_nccl");
    println!("cargo:rustc-env=LOCKSTEP_NCCL_SHIM={}", out.display());
}
