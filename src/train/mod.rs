//! Training. `Trainer` (trainer.rs) is composed of the components below and runs the loop;
//! `train_step` (step.rs) is one optimizer step; `rank` starts one rank from its environment.
//!
//! - `loader`: this rank's micro-batches; `eval`: the validation loss; `tasks`: downstream
//!   evaluation (multiple-choice tasks, scored as lm-evaluation-harness scores them)
//! - `optim`: the `Optimizer` of a run: AdamW (fused) replicated or sharded across ranks (ZeRO
//!   stages 1-3), the global norm and clipping, the LR schedule, and (`optim::reduce`)
//!   gradients averaged across ranks as backward finishes them
//! - `guard`: NaN/Inf and loss spikes; `faults`: the `debug.*` hooks
//! - `fit`: the start check against the memory plan, and the out-of-memory report
//! - `recorder`: step line, metrics.jsonl, TensorBoard, memory line
//! - `checkpoint`: writing and loading checkpoints (the `Checkpointer`, the save protocol in
//!   `checkpoint/writer.rs`); which checkpoints a run has, and its directory, are `crate::run`
//! - `preempt`: SIGTERM/SIGINT; `stragglers`: naming a rank slower than the others

pub mod build;
pub mod checkpoint;
pub mod device;
pub mod eval;
pub mod faults;
pub mod fit;
pub mod guard;
pub mod loader;
pub mod optim;
pub mod place;
pub mod preempt;
pub mod rank;
pub mod recorder;
pub mod step;
pub mod stragglers;
pub mod tasks;
pub mod tensor_parallel;
pub mod trainer;

pub use loader::Batch;
pub use place::Rank;
pub use rank::train_rank;
pub use step::{train_step, NanInjection, StepConfig, StepOutcome, StepPlan};
pub use trainer::{Summary, Trainer};
