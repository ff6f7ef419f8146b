//! Training: the loop (`trainer`), AdamW and the LR schedule (`optim`), checkpoints
//! (`checkpoint`) and the NaN/Inf report (`guard`).

pub mod checkpoint;
pub mod guard;
pub mod optim;
pub mod trainer;

pub use trainer::{train, Resume, RunOptions, Summary, Topology};
