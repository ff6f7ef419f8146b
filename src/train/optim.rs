//! AdamW, the learning-rate schedule and global-norm clipping, matching torch.optim.AdamW
//! (decoupled decay `p *= 1 - lr·wd`, bias-corrected moments) and torch.nn.utils.clip_grad_norm_.
//! The update is libtorch's fused kernel (csrc/fused_adamw.cpp); the state lives here rather
//! than in libtorch's C++ optimizer so the moments can be checkpointed by parameter name and
//! restored bit for bit.

use tch::{Kind, Tensor};
use torch_sys::C_tensor;

extern "C" {
    /// csrc/fused_adamw.cpp: at::_fused_adamw_ over n parameters; NULL or an error message.
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
    ) -> *mut libc::c_char;
}

#[derive(Debug, Clone, Copy)]
pub struct AdamWParams {
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
}

pub struct ParamState {
    pub name: String,
    pub param: Tensor,
    /// First moment (exp_avg).
    pub exp_avg: Tensor,
    /// Second moment (exp_avg_sq).
    pub exp_avg_sq: Tensor,
    /// Matrices and embeddings decay; norm weights and biases (1-D) do not.
    pub decay: bool,
    /// The fused kernel reads the step count from a per-parameter fp32 tensor.
    step_count: Tensor,
}

pub struct AdamW {
    pub hp: AdamWParams,
    pub params: Vec<ParamState>,
    /// Completed optimizer steps (torch keeps one per parameter; they are always equal here).
    pub step: u64,
}

impl AdamW {
    pub fn new(named: Vec<(String, Tensor)>, hp: AdamWParams) -> AdamW {
        let params = named
            .into_iter()
            .map(|(name, param)| ParamState {
                decay: param.dim() >= 2,
                step_count: Tensor::zeros([], (Kind::Float, param.device())),
                exp_avg: param.zeros_like().detach(),
                exp_avg_sq: param.zeros_like().detach(),
                name,
                param,
            })
            .collect();
        AdamW {
            hp,
            params,
            step: 0,
        }
    }

    /// One AdamW update with libtorch's fused kernel (`torch.optim.AdamW(fused=True)`): one
    /// call per weight-decay group instead of ~8 elementwise passes per parameter.
    pub fn step(&mut self, lr: f64) -> anyhow::Result<()> {
        self.step += 1;
        let h = self.hp;
        for decay in [true, false] {
            let group: Vec<&ParamState> = self
                .params
                .iter()
                .filter(|p| p.decay == decay && p.param.grad().defined())
                .collect();
            if group.is_empty() {
                continue;
            }
            let weight_decay = if decay { h.weight_decay } else { 0.0 };
            let grads: Vec<Tensor> = group.iter().map(|p| p.param.grad()).collect();
            for p in &group {
                let _ = p.step_count.shallow_clone().fill_(self.step as f64);
            }
            let ptrs = |f: &dyn Fn(&ParamState) -> &Tensor| -> Vec<*mut C_tensor> {
                group
                    .iter()
                    .map(|p| f(p).as_ptr() as *mut C_tensor)
                    .collect()
            };
            let (params, moments1, moments2, steps) = (
                ptrs(&|p| &p.param),
                ptrs(&|p| &p.exp_avg),
                ptrs(&|p| &p.exp_avg_sq),
                ptrs(&|p| &p.step_count),
            );
            let grad_ptrs: Vec<*mut C_tensor> =
                grads.iter().map(|g| g.as_ptr() as *mut C_tensor).collect();
            // SAFETY: every pointer is a live tch tensor handle (`at::Tensor*`) borrowed for the
            // duration of the call; the shim catches all C++ exceptions.
            let err = unsafe {
                lockstep_fused_adamw(
                    params.as_ptr(),
                    grad_ptrs.as_ptr(),
                    moments1.as_ptr(),
                    moments2.as_ptr(),
                    steps.as_ptr(),
                    group.len(),
                    lr,
                    h.beta1,
                    h.beta2,
                    weight_decay,
                    h.eps,
                )
            };
            if !err.is_null() {
                // SAFETY: the shim returns a NUL-terminated strdup'ed message we now own.
                let msg = unsafe { std::ffi::CStr::from_ptr(err) }
                    .to_string_lossy()
                    .into_owned();
                unsafe { libc::free(err.cast()) };
                anyhow::bail!("fused AdamW step failed: {msg}");
            }
        }
        Ok(())
    }

    pub fn zero_grad(&mut self) {
        for p in &mut self.params {
            p.param.zero_grad();
        }
    }

    pub fn gradients(&self) -> Vec<Tensor> {
        self.params
            .iter()
            .map(|p| p.param.grad())
            .filter(Tensor::defined)
            .collect()
    }
}

/// Global L2 norm of all gradients as a 0-dim fp32 tensor (no host sync here).
pub fn grad_norm(grads: &[Tensor]) -> Tensor {
    tch::no_grad(|| {
        let norms: Vec<Tensor> = grads
            .iter()
            .map(|g| g.norm_scalaropt_dtype(2, Kind::Float))
            .collect();
        Tensor::stack(&norms, 0).norm_scalaropt_dtype(2, Kind::Float)
    })
}

/// Scales gradients so their global norm `total` is at most `max_norm`, exactly as
/// clip_grad_norm_: coef = min(1, max_norm / (total + 1e-6)); `max_norm` 0 = no clipping.
/// Separate from `grad_norm` so the NaN guard sees the gradients before a NaN norm would
/// spread into every one of them.
pub fn clip_to(grads: &[Tensor], total: &Tensor, max_norm: f64) {
    if max_norm <= 0.0 {
        return;
    }
    tch::no_grad(|| {
        let coef = (max_norm / (total + 1e-6)).clamp_max(1.0);
        for g in grads {
            let _ = g.shallow_clone().g_mul_(&coef);
        }
    });
}

/// `grad_norm` then `clip_to`; returns the norm before clipping.
pub fn clip_grad_norm(grads: &[Tensor], max_norm: f64) -> Tensor {
    let total = grad_norm(grads);
    clip_to(grads, &total, max_norm);
    total
}

/// Linear warmup from 0 to `peak` over `warmup` steps, then cosine decay to `floor` at `total`.
#[derive(Debug, Clone, Copy)]
pub struct Schedule {
    pub peak: f64,
    pub floor: f64,
    pub warmup: usize,
    pub total: usize,
}

impl Schedule {
    /// Learning rate of optimizer step `step` (0-based).
    pub fn lr(&self, step: usize) -> f64 {
        if step < self.warmup {
            return self.peak * (step + 1) as f64 / self.warmup as f64;
        }
        let span = self.total.saturating_sub(self.warmup).max(1) as f64;
        let progress = ((step - self.warmup) as f64 / span).min(1.0);
        self.floor
            + 0.5 * (1.0 + (std::f64::consts::PI * progress).cos()) * (self.peak - self.floor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedule_warms_up_then_decays_to_the_floor() {
        let s = Schedule {
            peak: 1e-3,
            floor: 1e-4,
            warmup: 10,
            total: 110,
        };
        assert!((s.lr(0) - 1e-4).abs() < 1e-12);
        assert!((s.lr(9) - 1e-3).abs() < 1e-12);
        assert!((s.lr(10) - 1e-3).abs() < 1e-12);
        assert!((s.lr(60) - 5.5e-4).abs() < 1e-12, "midpoint of the cosine");
        assert!((s.lr(110) - 1e-4).abs() < 1e-12);
        assert!(
            (s.lr(500) - 1e-4).abs() < 1e-12,
            "stays at the floor past the end"
        );
        for i in 10..110 {
            assert!(s.lr(i + 1) <= s.lr(i));
        }
    }

    #[test]
    fn clip_scales_to_max_norm_and_reports_the_unclipped_norm() {
        let g1 = Tensor::from_slice(&[3.0f32, 0.0]);
        let g2 = Tensor::from_slice(&[0.0f32, 4.0]);
        let total = clip_grad_norm(&[g1.shallow_clone(), g2.shallow_clone()], 1.0);
        assert!((total.double_value(&[]) - 5.0).abs() < 1e-6);
        let after = (g1.pow_tensor_scalar(2).sum(Kind::Float)
            + g2.pow_tensor_scalar(2).sum(Kind::Float))
        .sqrt();
        assert!((after.double_value(&[]) - 1.0).abs() < 1e-5);
    }
}
