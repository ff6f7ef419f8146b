//! The NaN/Inf report: when the loss or the global gradient norm is not finite, list every
//! parameter and gradient that holds NaN or Inf, with counts and first values, so the first bad
//! tensor can be found without a debugger.

use tch::{Kind, Tensor};

use super::optim::AdamW;

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

fn section(title: &str, findings: &[Finding]) -> String {
    let mut out = format!("{title} ({} tensors):\n", findings.len());
    for f in findings {
        let values: Vec<String> = f.first.iter().map(|v| format!("{v:.4}")).collect();
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

/// Builds the report; `tag` is `[CPU0]`-style, shown as `[CPU 0]` in the banner.
pub fn report_text(tag: &str, step: usize, loss: f64, grad_norm: f64, opt: &AdamW) -> String {
    let params: Vec<Finding> = opt
        .params
        .iter()
        .filter_map(|p| inspect(&p.name, &p.param))
        .collect();
    let grads: Vec<Finding> = opt
        .params
        .iter()
        .filter_map(|p| inspect(&p.name, &p.param.grad()))
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
        "Step: {step} | Loss: {loss:.4} | Gradient Norm: {grad_norm:.4}\n"
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

pub fn report(tag: &str, step: usize, loss: f64, grad_norm: f64, opt: &AdamW) {
    eprintln!("{}", report_text(tag, step, loss, grad_norm, opt));
}
