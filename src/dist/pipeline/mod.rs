//! Pipeline parallelism's arithmetic, written once for `plan` and (when the stages' runtime
//! lands) `train`: which decoder layers each stage holds, which rank of the pipeline holds each stage, and the schedules — each
//! rank's forward and backward actions as a list ([`schedule`]) that a test prints and checks
//! and a timeline ([`timeline`]) runs against their dependencies, for the bubble and the
//! activations each rank keeps.
//!
//! ## Stages
//! The decoder layers are cut into S contiguous stages: S = P with `1f1b`, P·V with
//! `interleaved` (`system.virtual_stages` = V), 2P with `zbv`. Stage 0 also embeds the tokens,
//! stage S − 1 also runs the final norm, the LM head and the loss. With L layers each stage
//! gets ⌊L/S⌋ and the L mod S left over go one each to stages 1, 2, …: never to the first (the
//! embedding's memory) and to the last (the LM head's work and memory) only when every stage
//! but the first takes one.
//!
//! ## Placement
//! - `1f1b`: stage r on rank r.
//! - `interleaved`: stage v·P + r on rank r (Megatron's virtual pipeline): a micro-batch visits
//!   every rank V times.
//! - `zbv`: stages r and 2P − 1 − r on rank r (the V of ZB-V): rank 0 holds the first stage and
//!   the last, so the loss turns around on the rank that embedded the tokens.

pub mod schedule;
mod stages;
pub mod timeline;

pub use crate::config::PipelineSchedule;
pub use schedule::{Action, Op};
pub use stages::Pipeline;
pub use timeline::{Costs, Durations, Timeline};
