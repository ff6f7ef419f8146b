//! The crate's bottom layer: what talks to C. It depends on nothing else in the crate, so every
//! other module (dist, train, telemetry, launch, commands) may use it without pulling in another.
//!
//! - [`ffi`]: the C++ shims' error convention, taking ownership of C strings, checked `dlopen`;
//! - [`cuda`]: loading libtorch's CUDA backend on demand;
//! - [`cwd`]: starting from a deleted working directory (oneMKL's constructor needs one);
//! - [`libtorch`]: the loaded libtorch (path, version, build) and the start-up version check;
//! - [`durable`]: fsync, and the atomic directory checkpoints and exports are written as;
//! - [`machine`]: host memory, this process's resident memory, GPU memory and peak FLOP/s;
//! - [`nvml`]: the GPUs of this machine as NVIDIA's management library reports them;
//! - [`oom`]: allocation failures caught at a phase boundary and named by phase;
//! - [`storage`]: a tensor's storage freed and re-allocated in place (zero stage 3's gathers);
//! - [`phase`]: what the process is doing now (read by the OOM report and the hang forensics);
//! - [`lower_thread_priority`]: a background thread that takes only idle CPU time;
//! - [`count`]: a count for people (12.3k, 4.56M);
//! - [`hostname`]: this machine's name, fit for a file name;
//! - [`net`]: the one proxy rule of lockstep's HTTP clients (NO_PROXY, loopback);
//! - [`flock`]: an advisory lock on an open file (the run directory's, a checkpoint's reader);
//! - [`skip_static_destructors_at_exit`]: an exit that does not tear libtorch down first.

pub mod cuda;
pub mod cwd;
pub mod durable;
pub mod ffi;
pub mod libtorch;
pub mod machine;
pub mod net;
pub mod nvml;
pub mod oom;
pub mod phase;
pub mod storage;

/// `flock(2)` on `file` with `op` (`LOCK_SH`, `LOCK_EX`, `| LOCK_NB`); a lock held elsewhere
/// under `LOCK_NB` is the error `EWOULDBLOCK`.
pub fn flock(file: &std::fs::File, op: i32) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    // SAFETY: flock on a descriptor `file` owns.
    match unsafe { libc::flock(file.as_raw_fd(), op) } {
        0 => Ok(()),
        _ => Err(std::io::Error::last_os_error()),
    }
}

/// From here on, the process's exit (`main` returning, `std::process::exit`, clap's usage
/// errors) flushes C's stdio and ends the process there, before the C++ static destructors
/// libtorch registered as it loaded: they take its operators out of the dispatcher one by one,
/// 0.12-0.2 s of CPU at every exit, a third of a short command's life (BENCHMARKS.md §18).
/// Nothing of lockstep's is in them: when a command returns, its files are written and synced,
/// its threads joined and its children waited for, and Rust flushes its own stdout before it
/// calls `exit`. Handlers registered after this one (a library loaded later, such as libtorch's
/// CUDA backend) run first, as before.
pub fn skip_static_destructors_at_exit() {
    extern "C" fn end(status: libc::c_int, _: *mut libc::c_void) {
        // SAFETY: fflush(NULL) flushes every C stdio stream; _exit ends the process with the
        // status exit() was given, and an exit handler may call it.
        unsafe {
            libc::fflush(std::ptr::null_mut());
            libc::_exit(status)
        }
    }
    unsafe extern "C" {
        /// glibc's: `f(status, arg)` runs at exit, after the handlers registered later.
        fn on_exit(
            f: extern "C" fn(libc::c_int, *mut libc::c_void),
            arg: *mut libc::c_void,
        ) -> libc::c_int;
    }
    // SAFETY: registers a handler that calls only fflush and _exit.
    unsafe {
        on_exit(end, std::ptr::null_mut());
    }
}

/// A write to a closed pipe ends the process quietly (SIGPIPE's default action), as it does a
/// shell tool, instead of failing the write: for commands whose output is all they do.
pub fn die_on_closed_pipe() {
    // SAFETY: restores a signal's default disposition; no handler runs Rust code.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

/// Makes the calling thread a background writer: CPU priority nice 10 (a tenth of a normal
/// thread's share when they compete: not idle-only, which would starve it on a host whose
/// cores training keeps busy) and the lowest best-effort I/O priority, so a checkpoint written
/// while training goes on takes mostly time training leaves over. Best effort: where the
/// kernel refuses, the thread keeps its normal priority.
pub fn lower_thread_priority() {
    // SAFETY: plain syscalls on the calling thread: setpriority on its thread id,
    // ioprio_set(IOPRIO_WHO_PROCESS, 0 = this thread, class BE (2) << 13 | level 7).
    unsafe {
        let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
        libc::setpriority(libc::PRIO_PROCESS, tid, 10);
        libc::syscall(libc::SYS_ioprio_set, 1, 0, (2 << 13) | 7);
    }
}

/// A count for people: 950, 12.3k, 4.56M, 7.89B.
pub fn count(n: u64) -> String {
    let x = n as f64;
    match n {
        0..10_000 => n.to_string(),
        10_000..1_000_000 => format!("{:.1}k", x / 1e3),
        1_000_000..1_000_000_000 => format!("{:.2}M", x / 1e6),
        _ => format!("{:.2}B", x / 1e9),
    }
}

/// This machine's name, fit for a file name (other characters become `_`; `localhost` when
/// it has none).
pub fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: the buffer is valid for its length; gethostname NUL-terminates on success.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    let name = if rc == 0 {
        let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
        String::from_utf8_lossy(&buf[..end]).into_owned()
    } else {
        String::new()
    };
    let clean: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "-_.".contains(c) {
                c
            } else {
                '_'
            }
        })
        .collect();
    if clean.is_empty() {
        "localhost".into()
    } else {
        clean
    }
}
