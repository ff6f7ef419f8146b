//! A multiple-choice task as lockstep holds it: its items, each a context, its choices and
//! which of them are right.

use std::path::PathBuf;

/// One task: its items, in file order.
#[derive(Debug, Clone)]
pub struct Task {
    /// The file's stem, with any character other than letters, digits, `_`, `-` and `.` made
    /// `_` (it names the task's series in metrics.jsonl, TensorBoard, W&B and MLflow).
    pub name: String,
    pub path: PathBuf,
    pub items: Vec<Item>,
}

/// One multiple-choice question.
#[derive(Debug, Clone, PartialEq)]
pub struct Item {
    /// Its line in the file (1-based).
    pub line: usize,
    /// The text the choices continue (lm-eval's context, `doc_to_text`).
    pub context: String,
    /// Each continues the context after a space (lm-eval's target delimiter).
    pub choices: Vec<String>,
    pub gold: Gold,
}

/// Which choices are right.
#[derive(Debug, Clone, PartialEq)]
pub enum Gold {
    One(usize),
    /// Any of these (lm-eval's multiple targets).
    AnyOf(Vec<usize>),
}

impl Gold {
    pub fn accepts(&self, choice: usize) -> bool {
        match self {
            Gold::One(g) => *g == choice,
            Gold::AnyOf(g) => g.contains(&choice),
        }
    }
}
