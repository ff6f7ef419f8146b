//! AdamW, the learning-rate schedule and global-norm clipping, matching torch.optim.AdamW
//! (decoupled decay `p *= 1 - lr·wd`, bias-corrected moments) and torch.nn.utils.clip_grad_norm_.
//! The update is libtorch's fused kernel (csrc/fused_adamw.cpp); the state lives here rather
//! than in libtorch's C++ optimizer so the moments can be checkpointed by parameter name and
//! restored bit for bit.

use anyhow::Result;
use tch::{Kind, Tensor};
use torch_sys::C_tensor;

use super::reduce::GradReducer;
pub use super::zero::{ShardedAdamW, StateBytes};
use crate::dist::overlap::CommQueue;
use crate::dist::ProcessGroup;
use crate::model::GradUnit;

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
        for decay in [true, false] {
            let group: Vec<&ParamState> = self
                .params
                .iter()
                .filter(|p| p.decay == decay && p.param.grad().defined())
                .collect();
            if group.is_empty() {
                continue;
            }
            let grads: Vec<Tensor> = group.iter().map(|p| p.param.grad()).collect();
            for p in &group {
                let _ = p.step_count.shallow_clone().fill_(self.step as f64);
            }
            let tensors = FusedGroup {
                params: group.iter().map(|p| &p.param).collect(),
                grads: grads.iter().collect(),
                exp_avgs: group.iter().map(|p| &p.exp_avg).collect(),
                exp_avg_sqs: group.iter().map(|p| &p.exp_avg_sq).collect(),
                steps: group.iter().map(|p| &p.step_count).collect(),
            };
            fused_adamw(&tensors, lr, &self.hp, decay)?;
        }
        Ok(())
    }

    /// Drops the gradients (`set_to_none`): the next backward allocates them afresh, so no
    /// memset per parameter and no gradient memory between steps.
    pub fn zero_grad(&mut self) {
        drop_grads(self.params.iter().map(|p| &p.param));
    }

    /// `debug.inject_nan_param`: a NaN in the first element of `name`'s gradient.
    pub fn poison_gradient(&self, name: &str) {
        if let Some(p) = self.params.iter().find(|p| p.name == name) {
            let _ = p.param.grad().view(-1).get(0).fill_(f64::NAN);
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

/// The optimizer of a run: AdamW, replicated (`system.zero_stage = 0`: every rank holds all
/// state and updates every parameter) or sharded (stages 1 and 2, [`ShardedAdamW`]), with the
/// [`GradReducer`] that averages its gradients across ranks during backward. The step
/// (src/train/step.rs) only calls these methods, so it reads the same for every stage.
pub struct Optimizer {
    pub adam: Adam,
    reducer: GradReducer,
}

pub enum Adam {
    Replicated(AdamW),
    Sharded(ShardedAdamW),
}

impl Optimizer {
    /// `stage` 0 → replicated; 1 or 2 → sharded over `pg`'s ranks. The parameters (fp32) must
    /// already be identical on every rank (the sharded masters are copied from them). `compute`
    /// is the matmul dtype: sharded with bf16 compute, the working parameters become bf16 and
    /// the fp32 masters live only in the slices; replicated keeps fp32 parameters and casts.
    pub fn new(
        params: &[(String, Tensor)],
        hp: AdamWParams,
        stage: usize,
        pg: &dyn ProcessGroup,
        bucket_mb: f64,
        compute: Kind,
    ) -> Optimizer {
        let named: Vec<(String, Tensor)> = params
            .iter()
            .map(|(n, p)| (n.clone(), p.shallow_clone()))
            .collect();
        let world = pg.world_size();
        let (adam, reducer) = match stage {
            0 => (
                Adam::Replicated(AdamW::new(named, hp)),
                GradReducer::all_reduce(params, world, bucket_mb),
            ),
            _ => {
                let sharded =
                    ShardedAdamW::new(named, hp, stage, (pg.rank(), world), bucket_mb, compute);
                let reducer = match sharded.grad_slice() {
                    Some(slice) if stage >= 2 => GradReducer::reduce_scatter(
                        params,
                        sharded.layout.clone(),
                        sharded.rank,
                        slice,
                    ),
                    _ => GradReducer::all_reduce(params, world, bucket_mb),
                };
                (Adam::Sharded(sharded), reducer)
            }
        };
        Optimizer { adam, reducer }
    }

    /// Completed optimizer steps.
    pub fn steps(&self) -> u64 {
        match &self.adam {
            Adam::Replicated(o) => o.step,
            Adam::Sharded(o) => o.step,
        }
    }

    /// Backward finished `unit` on the step's last micro-batch: the gradient reductions that
    /// became possible go to `queue` (see [`GradReducer`]).
    pub fn unit_final(&self, unit: GradUnit, queue: &mut CommQueue) {
        self.reducer.unit_final(unit, queue);
    }

    /// `debug.inject_nan_param`, after the reduction so that every rank agrees.
    pub fn poison_gradient(&self, name: &str) {
        match &self.adam {
            Adam::Replicated(o) => o.poison_gradient(name),
            Adam::Sharded(o) => o.poison_gradient(name),
        }
    }

    /// The global gradient norm (before clipping) as a 0-dim fp32 tensor.
    pub fn grad_norm(&self, pg: &mut dyn ProcessGroup) -> Result<Tensor> {
        match &self.adam {
            Adam::Replicated(o) => Ok(grad_norm(&o.gradients())),
            Adam::Sharded(o) => o.grad_norm(pg),
        }
    }

    /// clip_grad_norm_'s scaling with the norm from [`Optimizer::grad_norm`].
    pub fn clip(&self, norm: &Tensor, max_norm: f64) {
        match &self.adam {
            Adam::Replicated(o) => clip_to(&o.gradients(), norm, max_norm),
            Adam::Sharded(o) => o.clip(norm, max_norm),
        }
    }

    /// The update (sharded: of this rank's slice, then the all-gather of the parameters).
    pub fn step(&mut self, lr: f64, pg: &mut dyn ProcessGroup) -> Result<()> {
        match &mut self.adam {
            Adam::Replicated(o) => o.step(lr),
            Adam::Sharded(o) => o.step(lr, pg),
        }
    }

    pub fn zero_grad(&mut self) {
        match &mut self.adam {
            Adam::Replicated(o) => o.zero_grad(),
            Adam::Sharded(o) => o.zero_grad(),
        }
    }

    /// Every parameter's full averaged gradient in `params`' order (a collective at stage 2).
    pub fn full_gradients(
        &self,
        params: &[(String, Tensor)],
        pg: &mut dyn ProcessGroup,
    ) -> Result<Vec<Tensor>> {
        match &self.adam {
            Adam::Replicated(_) => Ok(params.iter().map(|(_, p)| p.grad()).collect()),
            Adam::Sharded(o) => o.full_gradients(pg),
        }
    }

    /// This rank's bytes of parameters, master weights, moments and gradients.
    pub fn state_bytes(&self) -> StateBytes {
        match &self.adam {
            Adam::Replicated(o) => {
                let bytes = |t: &Tensor| (t.numel() * t.kind().elt_size_in_bytes()) as u64;
                StateBytes {
                    params: o.params.iter().map(|p| bytes(&p.param)).sum(),
                    master: 0,
                    moments: o
                        .params
                        .iter()
                        .map(|p| bytes(&p.exp_avg) + bytes(&p.exp_avg_sq))
                        .sum(),
                    grads: o.params.iter().map(|p| bytes(&p.param)).sum(),
                }
            }
            Adam::Sharded(o) => o.state_bytes(),
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

/// `at::_fused_adamw_` over one group; `decay` picks the group's weight decay.
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

/// Drops the gradients of `params` (PyTorch's `zero_grad(set_to_none=True)`); tch can only
/// zero them in place.
pub fn drop_grads<'a>(params: impl Iterator<Item = &'a Tensor>) {
    let ptrs: Vec<*mut C_tensor> = params.map(|t| t.as_ptr() as *mut C_tensor).collect();
    // SAFETY: live tch tensor handles for the duration of the call; the shim cannot fail.
    unsafe { lockstep_drop_grads(ptrs.as_ptr(), ptrs.len()) };
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

/// Linear warmup from 0 to `peak` over `warmup` steps, then cosine decay to `floor` at `total`.
#[derive(Debug, Clone, Copy)]
pub struct Schedule {
    pub peak: f64,
    pub floor: f64,
    pub warmup: usize,
    pub total: usize,
}

impl Schedule {
    pub fn from_config(t: &crate::config::TrainingConfig) -> Schedule {
        Schedule {
            peak: t.learning_rate,
            floor: t.min_lr,
            warmup: t.warmup_steps,
            total: t.max_steps,
        }
    }

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
        let grads = [g1.shallow_clone(), g2.shallow_clone()];
        let total = grad_norm(&grads);
        clip_to(&grads, &total, 1.0);
        assert!((total.double_value(&[]) - 5.0).abs() < 1e-6);
        let after = (g1.pow_tensor_scalar(2).sum(Kind::Float)
            + g2.pow_tensor_scalar(2).sum(Kind::Float))
        .sqrt();
        assert!((after.double_value(&[]) - 1.0).abs() < 1e-5);
    }
}
