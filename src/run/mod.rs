//! A run as a thing on disk, shared by the trainer, the launcher and the commands: its
//! directory and the locks that give it to one process (`dir`), what it resumes from and the
//! per-invocation options (`resume`), its checkpoints as directories — which are complete,
//! which a crash left, whether one loads, `trainer.json` (`checkpoints`) —, its prepared data
//! and the model shape checked against it (`data`), and the spec its workers train from
//! (`worker`). Writing and loading a checkpoint's tensors is `train::checkpoint`; starting
//! processes is `launch`.

pub mod checkpoints;
pub mod data;
pub mod dir;
pub mod resume;
pub mod worker;

pub use dir::RunDir;
pub use resume::{checkpoint_dir, resume_target, Resume, RunOptions};
pub use worker::WorkerSpec;
