//! AdamW, the learning-rate schedule and global-norm clipping, matching torch.optim.AdamW
//! (decoupled decay `p *= 1 - lr·wd`, bias-corrected moments) and torch.nn.utils.clip_grad_norm_.
//! Written here rather than through libtorch's C++ optimizer so the moments can be checkpointed
//! by parameter name and restored bit for bit.

use tch::{Kind, Tensor};

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

    pub fn step(&mut self, lr: f64) {
        self.step += 1;
        let h = self.hp;
        let bias1 = 1.0 - h.beta1.powi(self.step as i32);
        let bias2_sqrt = (1.0 - h.beta2.powi(self.step as i32)).sqrt();
        let step_size = lr / bias1;
        tch::no_grad(|| {
            for p in &mut self.params {
                let grad = p.param.grad();
                if !grad.defined() {
                    continue;
                }
                if p.decay && h.weight_decay != 0.0 {
                    let _ = p.param.g_mul_scalar_(1.0 - lr * h.weight_decay);
                }
                let _ = p.exp_avg.lerp_(&grad, 1.0 - h.beta1);
                let _ = p.exp_avg_sq.g_mul_scalar_(h.beta2);
                let _ = p.exp_avg_sq.addcmul_(&(&grad * (1.0 - h.beta2)), &grad);
                let denom = p.exp_avg_sq.sqrt() / bias2_sqrt + h.eps;
                // Same association as torch's addcdiv_(exp_avg, denom, value=-step_size).
                let _ = p.param.g_add_(&((&p.exp_avg * -step_size) / denom));
            }
        });
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
