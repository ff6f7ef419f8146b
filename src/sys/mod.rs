//! The crate's bottom layer: what talks to C. It depends on nothing else in the crate, so every
//! other module (dist, train, telemetry, launch, commands) may use it without pulling in another.
//!
//! - [`ffi`]: the C++ shims' error convention, taking ownership of C strings, checked `dlopen`;
//! - [`cuda`]: loading libtorch's CUDA backend on demand;
//! - [`durable`]: fsync, and the atomic directory checkpoints and exports are written as;
//! - [`nvml`]: the GPUs of this machine as NVIDIA's management library reports them;
//! - [`oom`]: allocation failures caught at a phase boundary and named by phase;
//! - [`phase`]: what the process is doing now (read by the OOM report and the hang forensics).

pub mod cuda;
pub mod durable;
pub mod ffi;
pub mod nvml;
pub mod oom;
pub mod phase;
