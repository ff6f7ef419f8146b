//! libtorch's CUDA backend, loaded on demand.

use std::sync::OnceLock;

use super::ffi::Library;

/// In the library's unit-test binary, `LOCKSTEP_TEST_DEVICE=cuda` loads the backend when the
/// process starts, before any test runs: ATen creates its CUDA hooks once, at the first device
/// query (`manual_seed` is one), so a CPU test run earlier in the same process left CUDA
/// disabled for every device test after it (seen on an H200: `model::` in one process, and 5
/// of `model::device_tests::` failed with "libtorch sees no CUDA device"; each alone passed).
/// The binary's `main` loads it first thing for the same reason. (An ELF constructor: the
/// test harness has no hook that runs before the tests.)
#[cfg(all(test, target_os = "linux"))]
#[used]
#[link_section = ".init_array"]
static LOAD_BEFORE_THE_TESTS: extern "C" fn() = {
    extern "C" fn load_for_device_tests() {
        if std::env::var("LOCKSTEP_TEST_DEVICE").as_deref() == Ok("cuda") {
            // An error is kept in LOADED; the device tests report it.
            let _ = load_cuda_backend();
            LOADED_AT_START.store(true, std::sync::atomic::Ordering::SeqCst);
        }
    }
    load_for_device_tests
};
#[cfg(test)]
static LOADED_AT_START: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// [`load_cuda_backend`]'s outcome, kept for the process.
static LOADED: OnceLock<Result<(), String>> = OnceLock::new();

/// Loads libtorch's CUDA backend. The linker drops `libtorch_cuda.so` from the binary's needed
/// libraries (nothing references its symbols; it registers kernels when loaded), so without
/// this `tch::Cuda::is_available()` is false even on a GPU machine. Loaded on demand so that
/// CPU runs neither pay for the ~1 GB library nor depend on the CUDA libraries being intact.
/// The first outcome is kept for the process.
pub fn load_cuda_backend() -> Result<(), String> {
    LOADED
        .get_or_init(|| {
            Library::open(c"libtorch_cuda.so", libc::RTLD_NOW | libc::RTLD_GLOBAL)?;
            if let Err(e) = apply_sync_debug_mode() {
                eprintln!("WARNING: LOCKSTEP_CUDA_SYNC_DEBUG is ignored: {e}");
            }
            Ok(())
        })
        .clone()
}

/// The CUDA stack a loaded backend brought in, for the ranks' version agreement
/// (`dist::versions`) and `lockstep env`. Each is `None` where it cannot be read.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CudaStack {
    /// The CUDA runtime's version (`cudaRuntimeGetVersion`), e.g. `13.0`.
    pub runtime: Option<String>,
    /// The newest CUDA version the driver supports (`cudaDriverGetVersion`), e.g. `13.0`.
    pub driver_cuda: Option<String>,
    /// NCCL's version as it reports itself at run time (`ncclGetVersion`), e.g. `2.28.9`.
    pub nccl: Option<String>,
    /// The libnccl file the loader picked.
    pub nccl_library: Option<std::path::PathBuf>,
}

/// The versions of the CUDA runtime, driver and NCCL that libtorch's CUDA backend loaded; all
/// `None` until [`load_cuda_backend`] succeeded (asking earlier would not load anything).
pub fn stack() -> CudaStack {
    if !matches!(LOADED.get(), Some(Ok(()))) {
        return CudaStack::default();
    }
    type VersionFn = unsafe extern "C" fn(*mut std::ffi::c_int) -> std::ffi::c_int;
    let ask = |name: &std::ffi::CStr| -> Option<i32> {
        let p = super::ffi::global_symbol(name).ok()?;
        // SAFETY: the three functions asked for take an `int*` and return a status, 0 for
        // success (cudaSuccess, ncclSuccess).
        let f: VersionFn =
            unsafe { std::mem::transmute::<*mut std::ffi::c_void, VersionFn>(p.as_ptr()) };
        let mut v = 0;
        // SAFETY: `v` is a live out-pointer.
        (unsafe { f(&mut v) } == 0).then_some(v)
    };
    // CUDA: 1000 × major + 10 × minor. NCCL ≥ 2.9: 10000 × major + 100 × minor + patch.
    let cuda = |v: i32| format!("{}.{}", v / 1000, (v % 1000) / 10);
    CudaStack {
        runtime: ask(c"cudaRuntimeGetVersion").map(cuda),
        driver_cuda: ask(c"cudaDriverGetVersion").filter(|&v| v > 0).map(cuda),
        nccl: ask(c"ncclGetVersion")
            .map(|v| format!("{}.{}.{}", v / 10000, (v % 10000) / 100, v % 100)),
        nccl_library: super::libtorch::library_of(c"ncclGetVersion"),
    }
}

/// Where c10 keeps `c10::cuda::warning_state()`'s object: the function is inline in
/// c10/cuda/CUDAFunctions.h, so its static is a unique global symbol of libc10_cuda.so
/// (`nm -D` shows it as `u`) and the only handle on it from outside C++. Its class,
/// `WarningState`, holds one `SyncDebugMode` (an `enum class` of int: 0 disabled, 1 warn,
/// 2 error); torch.cuda.set_sync_debug_mode writes the same int (checked with ctypes against
/// torch 2.11: benches/gpu/accept.sh repeats that check on the GPU machine).
const WARNING_STATE: &std::ffi::CStr = c"_ZZN3c104cuda13warning_stateEvE14warning_state_";

/// libtorch's CUDA synchronisation debug mode (`torch.cuda.set_sync_debug_mode`), from
/// `LOCKSTEP_CUDA_SYNC_DEBUG`: `1`/`warn` prints "called a synchronizing CUDA operation" at
/// every operation that makes the host wait for the GPU (a blocking copy, `.item()`, a stream
/// or device synchronize), `2`/`error` makes each one an error; unset, empty or `0` leaves it
/// off. A profiling aid (benches/gpu/accept.sh counts the warnings per step); the mode is a
/// prototype in PyTorch and does not see every synchronisation. Called once the backend is
/// loaded; the returned mode is the one now set.
fn apply_sync_debug_mode() -> Result<i32, String> {
    let mode = match std::env::var("LOCKSTEP_CUDA_SYNC_DEBUG").as_deref() {
        Err(_) | Ok("" | "0") => return Ok(0),
        Ok("1" | "warn") => 1,
        Ok("2" | "error") => 2,
        Ok(other) => return Err(format!("`{other}` is not 0, 1 (warn) or 2 (error)")),
    };
    let state = warning_state()?;
    // SAFETY: `state` points at c10's WarningState, whose only member is the int-sized mode
    // (see WARNING_STATE); c10 reads it without synchronisation too, and no CUDA work has
    // started yet (the backend was loaded a moment ago).
    unsafe { state.write_volatile(mode) };
    eprintln!(
        "LOCKSTEP_CUDA_SYNC_DEBUG={mode}: libtorch {} every host synchronisation with the GPU",
        if mode == 1 { "warns at" } else { "fails at" }
    );
    Ok(mode)
}

/// The mode's int inside libc10_cuda (loaded with libtorch_cuda), after checking that it holds
/// one of the three modes.
fn warning_state() -> Result<*mut i32, String> {
    // libtorch_cuda (RTLD_GLOBAL) brought libc10_cuda into the global scope.
    let p = super::ffi::global_symbol(WARNING_STATE)
        .map_err(|e| {
            format!("libc10_cuda has no {WARNING_STATE:?} ({e}): another libtorch than 2.11?")
        })?
        .as_ptr()
        .cast::<i32>();
    // SAFETY: the symbol is c10's WarningState object, at least an int in size.
    let now = unsafe { p.read_volatile() };
    if !(0..=2).contains(&now) {
        return Err(format!(
            "c10's sync debug mode reads {now}, not 0..=2: WarningState's layout changed"
        ));
    }
    Ok(p)
}

/// Whether libtorch can run on CUDA here: the NVIDIA driver is present, the backend loads and
/// a device is visible. Without the driver's device nodes no GPU can be visible, and loading
/// the backend anyway would only cost memory: libtorch_cuda and the CUDA libraries it pulls in
/// add ~240 MB to the resident memory of a CPU run (measured on the tiny preset).
pub fn cuda_available() -> bool {
    nvidia_driver_present() && load_cuda_backend().is_ok() && tch::Cuda::is_available()
}

/// Whether this machine has an NVIDIA driver: the kernel driver's control device (Linux), or the
/// GPU paravirtualisation device of WSL 2.
pub fn nvidia_driver_present() -> bool {
    ["/dev/nvidiactl", "/dev/dxg"]
        .iter()
        .any(|p| std::path::Path::new(p).exists())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// With `LOCKSTEP_TEST_DEVICE=cuda` the backend was loaded before any test ran
    /// (LOAD_BEFORE_THE_TESTS), not by whichever test asked first.
    #[test]
    fn the_device_tests_find_the_backend_loaded_at_start() {
        if std::env::var("LOCKSTEP_TEST_DEVICE").as_deref() == Ok("cuda") {
            assert!(
                LOADED_AT_START.load(std::sync::atomic::Ordering::SeqCst),
                "not loaded at process start"
            );
        }
    }

    /// The wheel's libtorch_cuda loads without a GPU too, so the symbol is checked everywhere;
    /// the mode starts disabled. (Setting it is left to the GPU machine: the process-wide mode
    /// would apply to every other test of this binary.)
    #[test]
    fn sync_debug_mode_is_found_where_libtorch_keeps_it() {
        if let Err(e) = load_cuda_backend() {
            eprintln!("libtorch_cuda does not load here ({e}); nothing to check");
            return;
        }
        let state = warning_state().unwrap();
        // SAFETY: checked by warning_state.
        let mode = unsafe { state.read_volatile() };
        let expected = match std::env::var("LOCKSTEP_CUDA_SYNC_DEBUG").as_deref() {
            Ok("1" | "warn") => 1,
            Ok("2" | "error") => 2,
            _ => 0,
        };
        assert_eq!(mode, expected);
    }
}
