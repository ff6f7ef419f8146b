//! Runs of `lockstep run --cpu` that tests compare: starting them, and comparing what they
//! leave (losses, weights) across layouts.

use std::collections::HashMap;
use std::path::Path;

use super::{ok, with};

/// Worst per-tensor relative L2 difference.
pub fn worst(a: &HashMap<String, tch::Tensor>, b: &HashMap<String, tch::Tensor>) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .map(|(n, x)| {
            let y = &b[n];
            (x - y).norm().double_value(&[]) / y.norm().double_value(&[]).max(1e-30)
        })
        .fold(0.0, f64::max)
}

pub fn bitwise(a: &HashMap<String, tch::Tensor>, b: &HashMap<String, tch::Tensor>) -> bool {
    a.len() == b.len() && a.iter().all(|(n, x)| x.equal(&b[n]))
}

/// `--set` before each of `sets`.
pub fn set_flags<S: AsRef<str>>(sets: &[S]) -> Vec<&str> {
    sets.iter().flat_map(|s| ["--set", s.as_ref()]).collect()
}

/// `lockstep run --cpu` of `base` on `world` ranks at zero `stage` as run `name` (its folder
/// `dir/runs/name`), then the `extra` arguments: its output (the run must succeed).
pub fn run_at(
    dir: &Path,
    base: &[String],
    (world, stage): (usize, usize),
    name: &str,
    extra: &[&str],
) -> String {
    let sets = [
        format!("system.zero_stage={stage}"),
        format!("logging.run_name={name}"),
    ];
    let mut tail = set_flags(&sets);
    tail.extend(extra);
    let nproc = world.to_string();
    ok(
        dir,
        &with(base, &["run", "--cpu", "--nproc", &nproc], &tail),
    )
}

/// `lockstep run --cpu` of `base` on `world` ranks with `extra`, which must exit 2 (a bad
/// input refused before training): its output.
pub fn refused_run(dir: &Path, base: &[String], world: usize, extra: &[&str]) -> String {
    let nproc = world.to_string();
    let out = super::run(
        dir,
        &with(base, &["run", "--cpu", "--nproc", &nproc], extra),
    );
    let text = super::output_text(&out);
    assert_eq!(out.status.code(), Some(2), "{text}");
    text
}

pub fn close_losses(a: &[(u64, f64)], b: &[(u64, f64)], tol: f64) {
    assert_eq!(a.len(), b.len(), "{a:?} vs {b:?}");
    for ((sa, la), (sb, lb)) in a.iter().zip(b) {
        assert_eq!(sa, sb);
        assert!((la - lb).abs() <= tol * lb.abs(), "step {sa}: {la} vs {lb}");
    }
}
