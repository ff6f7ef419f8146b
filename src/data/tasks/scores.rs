//! acc and acc_norm from the choices' log-likelihoods, as lm-evaluation-harness 0.4 computes
//! them for `multiple_choice` (`ConfigurableTask.process_results`, `mean`, `mean_stderr`):
//! the prediction is the first choice of the largest log-likelihood (numpy's argmax), acc_norm's
//! the first of the largest log-likelihood divided by the choice's length in characters (the
//! choice's text, without the space before it); each metric is the mean over items of 0/1,
//! its standard error the sample standard deviation over √n (none for one item).

use super::requests::Requests;
use super::task::{Gold, Task};

/// One item's result (what `--log-samples` writes).
#[derive(Debug, Clone, PartialEq)]
pub struct ItemScore {
    /// Each choice's log-likelihood: the sum of its continuation's token log-probabilities.
    pub lls: Vec<f64>,
    pub pred: usize,
    pub pred_norm: usize,
    pub acc: bool,
    pub acc_norm: bool,
    /// Its context lost tokens to the model's context length.
    pub truncated: bool,
}

/// One task's metrics.
#[derive(Debug, Clone, PartialEq)]
pub struct TaskScores {
    pub task: String,
    pub n: usize,
    pub acc: f64,
    pub acc_norm: f64,
    /// None with a single item (lm-eval: "N/A").
    pub acc_stderr: Option<f64>,
    pub acc_norm_stderr: Option<f64>,
}

impl TaskScores {
    /// `acc 0.2500 ± 0.0433, acc_norm 0.2700 ± 0.0446 (n 100)`: the console's words for them
    /// (no ± for a single item).
    pub fn summary(&self) -> String {
        let pm = |se: Option<f64>| se.map_or(String::new(), |se| format!(" ± {se:.4}"));
        format!(
            "acc {:.4}{}, acc_norm {:.4}{} (n {})",
            self.acc,
            pm(self.acc_stderr),
            self.acc_norm,
            pm(self.acc_norm_stderr),
            self.n
        )
    }
}

/// Every task's metrics and its items' results, from `lls` (request r's log-likelihood at
/// index r of `requests.list`).
pub fn score(
    tasks: &[Task],
    requests: &Requests,
    lls: &[f32],
) -> Vec<(TaskScores, Vec<ItemScore>)> {
    let mut items: Vec<Vec<ItemScore>> = tasks
        .iter()
        .map(|t| {
            t.items
                .iter()
                .map(|item| ItemScore {
                    lls: vec![f64::NAN; item.choices.len()],
                    pred: 0,
                    pred_norm: 0,
                    acc: false,
                    acc_norm: false,
                    truncated: false,
                })
                .collect()
        })
        .collect();
    for (req, &ll) in requests.list.iter().zip(lls) {
        let item = &mut items[req.task][req.item];
        item.lls[req.choice] = ll as f64;
        item.truncated |= req.truncated;
    }
    tasks
        .iter()
        .zip(items)
        .map(|(task, mut scored)| {
            for (item, s) in task.items.iter().zip(scored.iter_mut()) {
                s.pred = argmax(s.lls.iter().copied());
                let lens = item.choices.iter().map(|c| c.chars().count() as f64);
                s.pred_norm = argmax(s.lls.iter().zip(lens).map(|(ll, n)| ll / n));
                s.acc = item.gold.accepts(s.pred);
                s.acc_norm = item.gold.accepts(s.pred_norm);
            }
            let acc: Vec<f64> = scored.iter().map(|s| s.acc as u8 as f64).collect();
            let norm: Vec<f64> = scored.iter().map(|s| s.acc_norm as u8 as f64).collect();
            let scores = TaskScores {
                task: task.name.clone(),
                n: scored.len(),
                acc: mean(&acc),
                acc_norm: mean(&norm),
                acc_stderr: mean_stderr(&acc),
                acc_norm_stderr: mean_stderr(&norm),
            };
            (scores, scored)
        })
        .collect()
}

/// The index of the first largest value (numpy's argmax; a NaN is largest, as there).
fn argmax(values: impl Iterator<Item = f64>) -> usize {
    let mut best: Option<(usize, f64)> = None;
    for (i, v) in values.enumerate() {
        match best {
            Some((_, b)) if b.is_nan() || !(v > b || v.is_nan()) => {}
            _ => best = Some((i, v)),
        }
    }
    best.map_or(0, |(i, _)| i)
}

/// lm-eval's `mean`: the sum in order over the count.
fn mean(x: &[f64]) -> f64 {
    x.iter().sum::<f64>() / x.len() as f64
}

/// lm-eval's `mean_stderr`: the sample standard deviation over √n; None for fewer than two.
fn mean_stderr(x: &[f64]) -> Option<f64> {
    if x.len() < 2 {
        return None;
    }
    let mu = mean(x);
    let ss: f64 = x.iter().map(|v| (v - mu) * (v - mu)).sum();
    Some((ss / (x.len() - 1) as f64).sqrt() / (x.len() as f64).sqrt())
}

/// Item `index` of `task` with its result, as a line of `--log-samples`: where it is (`line`
/// of `file`), `gold`, every choice's log-likelihood (`loglikelihoods`, in choice order) and
/// length in characters, the predictions and whether each is right.
pub fn sample(task: &Task, index: usize, s: &ItemScore) -> serde_json::Value {
    let item = &task.items[index];
    let gold = match &item.gold {
        Gold::One(i) => serde_json::json!(i),
        Gold::AnyOf(v) => serde_json::json!(v),
    };
    let lengths: Vec<usize> = item.choices.iter().map(|c| c.chars().count()).collect();
    serde_json::json!({
        "task": task.name,
        "doc_id": index,
        "file": task.path.display().to_string(),
        "line": item.line,
        "gold": gold,
        "loglikelihoods": s.lls,
        "choice_lengths": lengths,
        "pred": s.pred,
        "pred_norm": s.pred_norm,
        "acc": s.acc as u8,
        "acc_norm": s.acc_norm as u8,
        "truncated": s.truncated,
    })
}
