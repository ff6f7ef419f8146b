//! Training: the loop (`trainer`), what it sets up first (`setup`), batches and validation
//! (`eval`), AdamW and the LR schedule (`optim`), checkpoints (`checkpoint`), the NaN/Inf and
//! loss-spike guard (`guard`) and SIGTERM/SIGINT handling (`preempt`).

pub mod checkpoint;
pub mod eval;
pub mod guard;
pub mod optim;
pub mod preempt;
pub mod setup;
pub mod trainer;

pub use trainer::{train, Resume, RunOptions, Summary, Topology};
