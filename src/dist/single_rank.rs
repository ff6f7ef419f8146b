//! Where a job of one rank rendezvouses: nowhere that anything connects to, at torchrun's
//! default address and port.

/// The rendezvous address and port of a job of one rank, where nothing connects (torchrun's
/// defaults); `env` and `slurm` both use them.
pub(crate) const SINGLE_RANK_ADDR: &str = "127.0.0.1";
pub(crate) const SINGLE_RANK_PORT: u16 = 29500;
