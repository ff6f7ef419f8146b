//! Replicated AdamW (`system.zero_stage = 0`): every rank holds every parameter (fp32, their
//! own masters), its full gradient and both moments, and updates all of them identically.
//!
//! Buffers, per parameter p of shape P (all fp32, on the parameters' device):
//! - `param` [P]: the parameter itself (the model's tensor);
//! - `exp_avg`, `exp_avg_sq` [P]: AdamW's moments;
//! - `param.grad` [P]: between backward and the update only (dropped after it).

use anyhow::Result;
use tch::{Kind, Tensor};

use super::kernel::{decays, drop_grads, fused_adamw, AdamWParams, FusedGroup};
use super::{MomentPiece, RankState, StateBytes, StateSource};

pub struct ParamState {
    pub name: String,
    pub param: Tensor,
    /// First moment (exp_avg).
    pub exp_avg: Tensor,
    /// Second moment (exp_avg_sq).
    pub exp_avg_sq: Tensor,
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
                decay: decays(&param.size()),
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

    /// One AdamW update, one fused call per weight-decay group. A parameter without a gradient
    /// is not updated (as torch.optim.AdamW).
    pub fn step(&mut self, lr: f64) -> Result<()> {
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

    pub fn zero_grad(&mut self) {
        drop_grads(self.params.iter().map(|p| &p.param));
    }

    /// `debug.inject_nan_param`: a NaN in the first element of `name`'s gradient.
    pub fn poison_gradient(&self, name: &str) {
        if let Some(p) = self.params.iter().find(|p| p.name == name) {
            let g = p.param.grad();
            if g.defined() {
                let _ = g.view(-1).get(0).fill_(f64::NAN);
            }
        }
    }

    /// The parameters' gradients (defined ones).
    pub fn gradients(&self) -> Vec<Tensor> {
        self.params
            .iter()
            .map(|p| p.param.grad())
            .filter(Tensor::defined)
            .collect()
    }

    /// Everything, for the rank that writes the checkpoint.
    pub fn state(&self) -> RankState {
        RankState {
            weights: self
                .params
                .iter()
                .map(|p| (p.name.clone(), p.param.detach()))
                .collect(),
            moments: self
                .params
                .iter()
                .map(|p| MomentPiece {
                    name: p.name.clone(),
                    range: 0..p.param.numel(),
                    exp_avg: p.exp_avg.view(-1),
                    exp_avg_sq: p.exp_avg_sq.view(-1),
                })
                .collect(),
        }
    }

    pub fn load(&mut self, src: &dyn StateSource, adam_step: u64) -> Result<()> {
        for p in &self.params {
            let w = src.weight(&p.name, &p.param.size())?;
            let (m, v) = src.moments(&p.name, &(0..p.param.numel()))?;
            let dev = p.param.device();
            tch::no_grad(|| {
                p.param.shallow_clone().copy_(&w.to_device(dev));
                p.exp_avg.view(-1).copy_(&m.to_device(dev));
                p.exp_avg_sq.view(-1).copy_(&v.to_device(dev));
            });
        }
        self.step = adam_step;
        Ok(())
    }

    pub fn state_bytes(&self) -> StateBytes {
        let bytes = |t: &Tensor| (t.numel() * t.kind().elt_size_in_bytes()) as u64;
        let params = self.params.iter().map(|p| bytes(&p.param)).sum();
        StateBytes {
            params,
            master: 0,
            moments: self
                .params
                .iter()
                .map(|p| bytes(&p.exp_avg) + bytes(&p.exp_avg_sq))
                .sum(),
            grads: params,
        }
    }
}
