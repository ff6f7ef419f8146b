//! Multiple-choice evaluation tasks from local `.jsonl` files (`lockstep eval --task`,
//! `training.eval_tasks`), scored as lm-evaluation-harness 0.4 scores `output_type:
//! multiple_choice` with its Hugging Face backend (docs/evaluation.md).
//!
//! A task file holds one item per line, in either of two forms (other keys are ignored):
//! - the general form, as lm-eval's multiple-choice tasks produce their docs:
//!   `{"query": str, "choices": [str, …], "gold": int | [int, …] | str}` (a list: any of them
//!   is right; a string: the text of the right choice, as lm-eval's `doc_to_target` may give it);
//! - HellaSwag's release: `{"ctx": str, "endings": [str, …], "label": int | "digits"}`.
//!
//! A task is named by its file's stem (`hellaswag.jsonl` → `hellaswag`). A problem with a file
//! is a `ConfigError` (exit code 2) naming the file, the line and the field, found before any
//! model runs.
//!
//! `task.rs` holds the types, `read.rs` reads and checks the files, `requests.rs` turns items
//! into token rows (lm-eval's context/continuation split and left truncation) and cuts them into
//! batches, `scores.rs` turns the choices' log-likelihoods into acc, acc_norm and their standard
//! errors.

mod read;
mod requests;
mod scores;
mod task;

pub use read::{load_tasks, read_task};
pub use requests::{row_align, Batch, Request, Requests};
pub use scores::{sample, score, ItemScore, TaskScores};
pub use task::{Gold, Item, Task};

use crate::config::Config;
use crate::data::tokenizer::Tokenizer;

/// The tasks of `training.eval_tasks` and their rows, as training scores them: the first
/// `training.eval_tasks_limit` items of each (0 = all), encoded with `data.tokenizer` for rows of
/// at most `training.context_length` tokens, in batches of `training.eval_tasks_batch_size`.
/// None without tasks.
pub fn of_config(cfg: &Config) -> anyhow::Result<Option<(Vec<Task>, Requests)>> {
    let t = &cfg.training;
    if t.eval_tasks.is_empty() {
        return Ok(None);
    }
    let limit = (t.eval_tasks_limit > 0).then_some(t.eval_tasks_limit);
    let tasks = load_tasks(&t.eval_tasks, "training.eval_tasks", limit)?;
    let tok = Tokenizer::load(&crate::data::hub::resolve_tokenizer(&cfg.data.tokenizer)?)?;
    let requests = Requests::build(&tasks, &tok, t.context_length, t.eval_tasks_batch_size)?;
    Ok(Some((tasks, requests)))
}

#[cfg(test)]
mod tests;
