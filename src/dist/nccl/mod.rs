//! NCCL collectives for CUDA ranks: libtorch's own `c10d::ProcessGroupNCCL` through the C shim
//! in `csrc/nccl_group.cpp`.
//!
//! Why ProcessGroupNCCL rather than NCCL through `cudarc`: it is the code path PyTorch DDP runs
//! (same NCCL build, same communicator setup through the store, same stream semantics: a
//! collective is ordered after the work queued on libtorch's current stream and later work
//! waits for it, with no host synchronisation), and it brings the watchdog, per-collective
//! timeouts, flight recorder and `TORCH_NCCL_*` knobs users already know. With cudarc we would
//! need a C++ shim anyway to reach libtorch's current CUDA stream, and would re-implement
//! the timeout/abort machinery ourselves.
//!
//! The pieces: [`loader`] (the shim, embedded in the binary and loaded only by CUDA ranks) and
//! [`group`] ([`NcclGroup`], the process group built on it).
//!
//! Which collective goes where:
//! - gradients and parameters (the bulk, on the GPU): NCCL, in place on the device;
//! - scalars (loss, stop requests, the guard's agreement), eval sums and barriers: the CPU
//!   [`RingGroup`](super::RingGroup) over TCP. Each step's loss agreement runs after the gradient all-reduce
//!   is queued, on the host, so a stalled peer turns into the ring's timeout error naming
//!   the rank that is missing. NCCL's watchdog cannot name it (a collective only knows it did
//!   not finish), so its timeout is set longer, as the backstop that aborts the process if the
//!   ring never gets a chance.

mod group;
mod loader;

pub use group::{watchdog_timeout, NcclGroup, DUMP_SIGNAL_KEY};
pub use loader::version;

#[cfg(test)]
mod tests;
