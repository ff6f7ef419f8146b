//! The NaN/Inf report: when the loss or the global gradient norm is not finite, list every
//! parameter and gradient that holds NaN or Inf, with counts and first values, so the first bad
//! tensor can be found without a debugger.

use tch::{Kind, Tensor};

use crate::config::{GuardPolicy, TrainingConfig};

/// A tensor's NaN and Inf counts and first values, or None when it is all finite.
pub struct Finding {
    pub name: String,
    pub shape: Vec<i64>,
    pub nans: i64,
    pub infs: i64,
    pub numel: i64,
    pub first: Vec<f64>,
}

pub fn inspect(name: &str, t: &Tensor) -> Option<Finding> {
    if !t.defined() {
        return None;
    }
    let t = t.detach();
    let nans = t.isnan().sum(Kind::Int64).int64_value(&[]);
    let infs = t.isinf().sum(Kind::Int64).int64_value(&[]);
    if nans == 0 && infs == 0 {
        return None;
    }
    let flat = t.flatten(0, -1);
    let n = flat.size()[0].min(5);
    let first = (0..n).map(|i| flat.double_value(&[i])).collect();
    Some(Finding {
        name: name.to_string(),
        shape: t.size(),
        nans,
        infs,
        numel: t.numel() as i64,
        first,
    })
}

/// Python's spelling (`nan`, `inf`), which is what users grep for.
fn num(v: f64) -> String {
    if v.is_nan() {
        "nan".into()
    } else if v.is_infinite() {
        if v > 0.0 {
            "inf".into()
        } else {
            "-inf".into()
        }
    } else {
        format!("{v:.4}")
    }
}

fn section(title: &str, findings: &[Finding]) -> String {
    let mut out = format!("{title} ({} tensors):\n", findings.len());
    for f in findings {
        let values: Vec<String> = f.first.iter().map(|v| num(*v)).collect();
        out.push_str(&format!(
            "  • {}  shape {:?}  NaN {}/{}  Inf {}/{}  values [{}, …]\n",
            f.name,
            f.shape,
            f.nans,
            f.numel,
            f.infs,
            f.numel,
            values.join(", ")
        ));
    }
    out
}

/// Every parameter with its full (averaged) gradient, the latter undefined where there is none:
/// what the report and the dump look at, on every zero stage alike.
pub struct Evidence<'a> {
    pub params: &'a [(String, Tensor)],
    /// Aligned with `params`.
    pub grads: &'a [Tensor],
}

/// Builds the report; `tag` is `[CPU0]`-style, shown as `[CPU 0]` in the banner.
pub fn report_text(tag: &str, step: usize, loss: f64, grad_norm: f64, ev: &Evidence) -> String {
    let params: Vec<Finding> = ev
        .params
        .iter()
        .filter_map(|(name, p)| inspect(name, p))
        .collect();
    let grads: Vec<Finding> = ev
        .params
        .iter()
        .zip(ev.grads)
        .filter_map(|((name, _), g)| inspect(name, g))
        .collect();
    let what = if grads.is_empty() && params.is_empty() {
        "NaN LOSS"
    } else if grads.is_empty() {
        "NaN PARAMETER"
    } else {
        "NaN GRADIENT"
    };
    let banner = tag
        .trim_matches(['[', ']'])
        .replacen("GPU", "GPU ", 1)
        .replacen("CPU", "CPU ", 1);
    let mut out = format!("{}\n{what} DETECTED [{banner}]\n", "=".repeat(80));
    out.push_str(&format!(
        "Step: {step} | Loss: {} | Gradient Norm: {}\n",
        num(loss),
        num(grad_norm)
    ));
    if !grads.is_empty() {
        out.push_str(&section("Gradients with NaN/Inf", &grads));
    }
    if !params.is_empty() {
        out.push_str(&section("Parameters with NaN/Inf", &params));
    }
    if grads.is_empty() && params.is_empty() {
        out.push_str("All parameters and gradients are finite: the non-finite value arose in the forward pass (check the data and the learning rate).\n");
    }
    out.push_str(&"=".repeat(80));
    out
}

/// A NaN/Inf or loss-spike stop (`training.nan_policy = abort`, or too many skips/rollbacks);
/// `main` exits with code 3 for it, so schedulers can tell it from other failures.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct NanAbort(pub String);

/// Why the guard stopped a step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Event {
    /// The loss or the global gradient norm is NaN/Inf.
    NonFinite,
    /// The loss is `z` standard deviations above the recent window.
    Spike { z: f64 },
}

impl Event {
    pub fn describe(self) -> &'static str {
        match self {
            Event::NonFinite => "non-finite loss or gradient norm",
            Event::Spike { .. } => "loss spike",
        }
    }
}

/// The guard of a run: checks every step's loss and global gradient norm (`training.nan_check`)
/// and watches for loss spikes (`training.spike_zscore`), and says what a bad step leads to
/// (`training.nan_policy` / `spike_policy`, at most `training.max_nan_skips` times).
pub struct Guard {
    nan_check: bool,
    spikes: Option<SpikeDetector>,
    nan_policy: GuardPolicy,
    spike_policy: GuardPolicy,
    /// Skips plus rollbacks allowed in one run.
    pub max_events: usize,
    /// `training.spike_window`, for the warning's text.
    spike_window: usize,
}

impl Guard {
    pub fn new(t: &TrainingConfig) -> Guard {
        Guard {
            nan_check: t.nan_check,
            spikes: SpikeDetector::new(t.spike_window, t.spike_zscore),
            nan_policy: t.nan_policy,
            spike_policy: t.spike_policy,
            max_events: t.max_nan_skips,
            spike_window: t.spike_window,
        }
    }

    /// Whether a step with this (global) loss and gradient norm must not be applied.
    pub fn judge(&self, loss: f64, grad_norm: f64) -> Option<Event> {
        if self.nan_check && !(loss.is_finite() && grad_norm.is_finite()) {
            return Some(Event::NonFinite);
        }
        self.spikes
            .as_ref()
            .and_then(|s| s.spike(loss))
            .map(|z| Event::Spike { z })
    }

    /// Records the loss of an applied step in the spike detector's window.
    pub fn accept(&mut self, loss: f64) {
        if let (Some(s), true) = (self.spikes.as_mut(), loss.is_finite()) {
            s.accept(loss);
        }
    }

    /// What the config says to do about `event`.
    pub fn policy(&self, event: Event) -> GuardPolicy {
        match event {
            Event::NonFinite => self.nan_policy,
            Event::Spike { .. } => self.spike_policy,
        }
    }

    /// The warning printed for a loss spike.
    pub fn spike_warning(&self, tag: &str, step: usize, loss: f64, z: f64) -> String {
        format!(
            "{tag} WARNING: loss spike at step {step}: loss {loss:.4} is {z:.1} standard deviations above the last {} losses",
            self.spike_window
        )
    }
}

/// Z-score loss-spike detector over a window of recent accepted losses.
pub struct SpikeDetector {
    recent: std::collections::VecDeque<f64>,
    window: usize,
    threshold: f64,
}

impl SpikeDetector {
    /// None when `threshold` is 0 (detection off).
    pub fn new(window: usize, threshold: f64) -> Option<SpikeDetector> {
        (threshold > 0.0).then(|| SpikeDetector {
            recent: Default::default(),
            window: window.max(2),
            threshold,
        })
    }

    /// The z-score of `loss` when it is a spike; judged only once half the window is filled,
    /// since early training losses fall too fast for a meaningful mean.
    pub fn spike(&self, loss: f64) -> Option<f64> {
        let n = self.recent.len();
        if n < self.window / 2 || n < 2 {
            return None;
        }
        let mean = self.recent.iter().sum::<f64>() / n as f64;
        let var = self.recent.iter().map(|l| (l - mean).powi(2)).sum::<f64>() / (n - 1) as f64;
        let z = (loss - mean) / var.sqrt().max(1e-12);
        (z > self.threshold).then_some(z)
    }

    /// Adds a loss that was not a spike.
    pub fn accept(&mut self, loss: f64) {
        if self.recent.len() == self.window {
            self.recent.pop_front();
        }
        self.recent.push_back(loss);
    }
}

/// Parameters and gradients as safetensors (`<name>` and `<name>.grad`), readable from numpy
/// with `safetensors.numpy.load_file`.
pub fn dump(path: &std::path::Path, ev: &Evidence) -> anyhow::Result<()> {
    let mut tensors = Vec::new();
    for ((name, p), g) in ev.params.iter().zip(ev.grads) {
        tensors.push((name.clone(), p.detach()));
        if g.defined() {
            tensors.push((format!("{name}.grad"), g.detach()));
        }
    }
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    crate::tensor_io::save(path, &tensors, None)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spike_detector_flags_outliers_only_after_warming_up() {
        let mut d = SpikeDetector::new(10, 4.0).unwrap();
        assert!(SpikeDetector::new(10, 0.0).is_none(), "threshold 0 = off");
        assert_eq!(d.spike(100.0), None, "no judgement on an empty window");
        for i in 0..10 {
            d.accept(3.0 + 0.01 * (i % 3) as f64);
        }
        assert_eq!(d.spike(3.02), None);
        let z = d.spike(4.0).expect("a jump of ~100 sigma is a spike");
        assert!(z > 50.0, "{z}");
    }

    #[test]
    fn report_names_the_tensors_with_nan_and_inf() {
        let a = Tensor::from_slice(&[1.0f32, 2.0, 3.0]).set_requires_grad(true);
        let b = Tensor::from_slice(&[1.0f32, 2.0]).set_requires_grad(true);
        let loss =
            (&a * Tensor::from_slice(&[f32::NAN, 1.0, 1.0])).sum(Kind::Float) + b.sum(Kind::Float);
        loss.backward();
        let grads = [a.grad(), b.grad()];
        let params = [("a".to_string(), a), ("b".to_string(), b)];
        let ev = Evidence {
            params: &params,
            grads: &grads,
        };
        let text = report_text("[GPU6]", 0, f64::NAN, f64::NAN, &ev);
        assert!(text.contains("NaN GRADIENT DETECTED [GPU 6]"), "{text}");
        assert!(
            text.contains("Gradients with NaN/Inf (1 tensors)"),
            "{text}"
        );
        assert!(text.contains("• a  shape [3]  NaN 1/3  Inf 0/3"), "{text}");
        assert!(!text.contains("• b "), "{text}");
    }
}
