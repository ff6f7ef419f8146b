//! The optimizer's arithmetic, shared by every layout: libtorch's fused AdamW, dropping
//! gradients, the global gradient norm and clipping. Depends on nothing else in `train`.

use tch::{Kind, Tensor};
use torch_sys::C_tensor;

extern "C" {
    /// csrc/fused_adamw.cpp: at::_fused_adamw_ over n parameters; a status and `err` as in
    /// crate::sys::ffi.
    fn lockstep_fused_adamw(
        params: *const *mut C_tensor,
        grads: *const *mut C_tensor,
        exp_avgs: *const *mut C_tensor,
        exp_avg_sqs: *const *mut C_tensor,
        steps: *const *mut C_tensor,
        n: usize,
        lr: f64,
        beta1: f64,
        beta2: f64,
        weight_decay: f64,
        eps: f64,
        err: *mut *mut libc::c_char,
    ) -> libc::c_int;

    /// csrc/fused_adamw.cpp: resets each tensor's gradient to undefined.
    fn lockstep_drop_grads(params: *const *mut C_tensor, n: usize);
}

#[derive(Debug, Clone, Copy)]
pub struct AdamWParams {
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
}

impl AdamWParams {
    pub fn from_config(t: &crate::config::TrainingConfig) -> AdamWParams {
        AdamWParams {
            beta1: t.beta1,
            beta2: t.beta2,
            eps: t.adam_eps,
            weight_decay: t.weight_decay,
        }
    }
}

/// The tensors of one fused AdamW call (one weight-decay group), aligned by position.
pub struct FusedGroup<'a> {
    pub params: Vec<&'a Tensor>,
    pub grads: Vec<&'a Tensor>,
    pub exp_avgs: Vec<&'a Tensor>,
    pub exp_avg_sqs: Vec<&'a Tensor>,
    /// fp32 scalars holding the step number (the kernel's bias correction reads them).
    pub steps: Vec<&'a Tensor>,
}

/// `at::_fused_adamw_` over one group (`torch.optim.AdamW(fused=True)`: one call instead of ~8
/// elementwise passes per parameter); `decay` picks the group's weight decay.
pub fn fused_adamw(
    g: &FusedGroup<'_>,
    lr: f64,
    hp: &AdamWParams,
    decay: bool,
) -> anyhow::Result<()> {
    let ptrs = |ts: &[&Tensor]| -> Vec<*mut C_tensor> {
        ts.iter().map(|t| t.as_ptr() as *mut C_tensor).collect()
    };
    let (params, grads, m, v, steps) = (
        ptrs(&g.params),
        ptrs(&g.grads),
        ptrs(&g.exp_avgs),
        ptrs(&g.exp_avg_sqs),
        ptrs(&g.steps),
    );
    let n = params.len();
    anyhow::ensure!(
        [grads.len(), m.len(), v.len(), steps.len()] == [n; 4],
        "internal: a fused AdamW group with unequal tensor lists"
    );
    let weight_decay = if decay { hp.weight_decay } else { 0.0 };
    // SAFETY: every pointer is a live tch tensor handle (`at::Tensor*`) borrowed for the
    // duration of the call; the shim catches all C++ exceptions.
    crate::sys::ffi::call(|err| unsafe {
        lockstep_fused_adamw(
            params.as_ptr(),
            grads.as_ptr(),
            m.as_ptr(),
            v.as_ptr(),
            steps.as_ptr(),
            n,
            lr,
            hp.beta1,
            hp.beta2,
            weight_decay,
            hp.eps,
            err,
        )
    })
    .map_err(|e| anyhow::anyhow!("fused AdamW step failed: {e}"))
}

/// Drops the gradients of `params` (PyTorch's `zero_grad(set_to_none=True)`): the next
/// backward allocates them afresh, so no memset per parameter and no gradient memory between
/// steps. tch can only zero them in place.
pub fn drop_grads<'a>(params: impl Iterator<Item = &'a Tensor>) {
    let ptrs: Vec<*mut C_tensor> = params.map(|t| t.as_ptr() as *mut C_tensor).collect();
    // SAFETY: live tch tensor handles for the duration of the call; the shim cannot fail.
    unsafe { lockstep_drop_grads(ptrs.as_ptr(), ptrs.len()) };
}

/// Elements per chunk of [`sum_of_squares`] on the CPU: bounds its fp64 temporary (8 MB).
const NORM_CHUNK: i64 = 1 << 20;
/// Elements per chunk on a GPU: each chunk is three kernel launches (widen, dot, add), and at
/// 1M elements the 1.1B model's norm was ~3,300 launches, 24.5 ms of host time a step and the
/// whole gap to PyTorch eager on an H200 (BENCHMARKS.md §4). At 4M the fp64 temporary (32 MB)
/// still fits in the L2 cache (50 MB on an H100, 60 on an H200), so the dot reads it from
/// there, and the launches are 4× fewer.
const NORM_CHUNK_GPU: i64 = 1 << 22;

/// Σ x² over every element of `tensors`, accumulated in fp64, as a host number. Each element
/// is widened to fp64 before it is squared (exact: a 24-bit mantissa squared fits in 53 bits)
/// and summed in chunks, so the result is accurate to ~1e-15 relative whatever the sizes and
/// however the elements are cut into slices: every zero stage gets the same norm (to the last
/// bit of its fp32 value, in all but rare rounding ties). libtorch's fp32 `norm()` on CPU, which
/// PyTorch's clip_grad_norm_ uses, is off by ~2e-3 relative on 12.9M elements (FACTS.md).
pub fn sum_of_squares(tensors: &[Tensor]) -> f64 {
    tch::no_grad(|| {
        let mut total: Option<Tensor> = None;
        for t in tensors.iter().filter(|t| t.defined() && t.numel() > 0) {
            let flat = t.reshape(-1);
            let n = flat.numel() as i64;
            let chunk = if flat.device().is_cuda() {
                NORM_CHUNK_GPU
            } else {
                NORM_CHUNK
            };
            for at in (0..n).step_by(chunk as usize) {
                let part = flat.narrow(0, at, chunk.min(n - at)).to_kind(Kind::Double);
                let s = part.dot(&part);
                total = Some(match total {
                    Some(sum) => sum + s,
                    None => s,
                });
            }
        }
        // One host read for all of them.
        total.map_or(0.0, |t| t.double_value(&[]))
    })
}

/// The global L2 norm from a sum of squares, rounded to fp32 as PyTorch reports it.
pub fn norm_of(sum_of_squares: f64) -> f64 {
    sum_of_squares.sqrt() as f32 as f64
}

/// Scales gradients so their global norm `total` is at most `max_norm`, as clip_grad_norm_
/// does in fp32: coef = min(1, max_norm / (total + 1e-6)); `max_norm` 0 = no clipping.
/// Separate from the norm so the NaN guard sees the gradients before a NaN norm would spread
/// into every one of them.
pub fn clip_to(grads: &[Tensor], total: f64, max_norm: f64) {
    if max_norm <= 0.0 {
        return;
    }
    let coef = (max_norm as f32 / (total as f32 + 1e-6)).min(1.0);
    if coef >= 1.0 {
        return;
    }
    tch::no_grad(|| {
        for g in grads.iter().filter(|g| g.defined()) {
            let _ = g.shallow_clone().g_mul_scalar_(f64::from(coef));
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clip_scales_to_max_norm() {
        let g1 = Tensor::from_slice(&[3.0f32, 0.0]);
        let g2 = Tensor::from_slice(&[0.0f32, 4.0]);
        let grads = [g1.shallow_clone(), g2.shallow_clone()];
        let total = norm_of(sum_of_squares(&grads));
        assert_eq!(total, 5.0);
        clip_to(&grads, total, 1.0);
        let after = norm_of(sum_of_squares(&grads));
        assert!((after - 1.0).abs() < 1e-6, "{after}");
        clip_to(&grads, after, 10.0);
        assert!(
            (norm_of(sum_of_squares(&grads)) - after).abs() < 1e-12,
            "no scale-up"
        );
    }

    /// The case libtorch's fp32 kernel gets wrong (FACTS.md): 12.9M elements of randn·1e-3
    /// with every 7th × 30. The fp64 reference is computed independently here on the host.
    #[test]
    fn the_norm_is_accurate_and_independent_of_how_the_elements_are_cut() {
        tch::manual_seed(7);
        let n = 12_866_048i64;
        let x = Tensor::randn([n], (Kind::Float, tch::Device::Cpu)) * 1e-3;
        let _ = x.slice(0, 0, n, 7).g_mul_scalar_(30.0);
        let host = Vec::<f32>::try_from(&x).unwrap();
        let reference: f64 = host.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
        let whole = sum_of_squares(std::slice::from_ref(&x));
        assert!(
            ((whole - reference) / reference).abs() < 1e-12,
            "{whole} vs {reference}"
        );
        // Cut into uneven pieces (as the ranks' slices cut parameters), summed in fp64.
        let cuts = [0, 1_000_003, 5_000_000, 5_000_001, 12_000_000, n];
        let parts: f64 = cuts
            .windows(2)
            .map(|w| sum_of_squares(&[x.narrow(0, w[0], w[1] - w[0])]))
            .sum();
        assert_eq!(norm_of(parts), norm_of(whole));
    }
}
