//! The replicated layout (`system.zero_stage = 0`): every rank holds every parameter (fp32,
//! their own masters), its full gradient and its moments, and updates all of them
//! identically: AdamW's parameters each on every rank, Muon's matrices each orthogonalized by
//! one rank and the results shared (`orthogonal.rs`).
//!
//! Buffers, per parameter p of shape P (all fp32, on the parameters' device):
//! - `param` [P]: the parameter itself (the model's tensor);
//! - AdamW: `exp_avg`, `exp_avg_sq` [P]; Muon: `momentum_buffer` [P];
//! - `param.grad` [P]: between backward and the update only (dropped after it).

use anyhow::Result;
use tch::{Kind, Tensor};

use super::kernel::{drop_grads, fused_adamw, AdamWParams, FusedGroup};
use super::muon::{self, MuonParams, Rule};
use super::orthogonal::{Orthogonalizer, Setup};
use super::state::{EXP_AVG, EXP_AVG_SQ, MOMENTUM};
use super::{MomentPiece, RankState, StateBytes, StateSource};
use crate::dist::ProcessGroup;

pub struct ParamState {
    pub name: String,
    pub param: Tensor,
    pub rule: Rule,
    /// AdamW's first moment (exp_avg), or Muon's momentum buffer.
    pub first: Tensor,
    /// AdamW's second moment (exp_avg_sq); undefined for Muon.
    pub second: Tensor,
    /// The fused kernel reads the step count from a per-parameter fp32 tensor.
    step_count: Tensor,
}

impl ParamState {
    /// The moments by their checkpoint keys.
    fn moments(&self) -> Vec<(&'static str, &Tensor)> {
        match self.rule {
            Rule::Muon => vec![(MOMENTUM, &self.first)],
            _ => vec![(EXP_AVG, &self.first), (EXP_AVG_SQ, &self.second)],
        }
    }
}

/// Muon's part of a replicated optimizer: its parameters (indices into `params`, in order) and
/// who orthogonalizes which.
struct Muon {
    hp: MuonParams,
    params: Vec<usize>,
    orthogonal: Orthogonalizer,
}

pub struct Replicated {
    pub adamw: AdamWParams,
    pub params: Vec<ParamState>,
    /// Completed optimizer steps (torch keeps one per parameter; they are always equal here).
    pub step: u64,
    muon: Option<Muon>,
}

impl Replicated {
    /// The optimizer of `named` (with their `rules`); `muon` where some are Muon's.
    pub fn new(
        named: Vec<(String, Tensor)>,
        rules: &[Rule],
        adamw: AdamWParams,
        muon: Option<Setup>,
    ) -> Replicated {
        let params: Vec<ParamState> = named
            .into_iter()
            .zip(rules)
            .map(|((name, param), &rule)| ParamState {
                rule,
                step_count: Tensor::zeros([], (Kind::Float, param.device())),
                first: param.zeros_like().detach(),
                second: match rule {
                    Rule::Muon => Tensor::new(),
                    _ => param.zeros_like().detach(),
                },
                name,
                param,
            })
            .collect();
        let muon = muon.map(|setup| {
            // Every rank holds every element of every matrix.
            let every = |n: usize| (0..setup.data.size).map(|r| (r, 0..n)).collect();
            let list: Vec<usize> = (0..params.len())
                .filter(|&i| params[i].rule == Rule::Muon)
                .collect();
            let matrices = list
                .iter()
                .map(|&i| setup.matrix(i, &params[i].param.size(), every))
                .collect();
            Muon {
                hp: setup.hp,
                orthogonal: setup.build(matrices),
                params: list,
            }
        });
        Replicated {
            adamw,
            params,
            step: 0,
            muon,
        }
    }

    /// One update: Muon's matrices (a collective where Muon has ranks to share its work with),
    /// then AdamW, one fused call per weight-decay group. AdamW leaves a parameter without a
    /// gradient alone (as torch.optim.AdamW); Muon reads it as zeros, as every rank of a
    /// sharded layout must.
    pub fn step(&mut self, lr: f64, pg: &mut dyn ProcessGroup) -> Result<()> {
        self.step += 1;
        if let Some(m) = &self.muon {
            let updates: Vec<Option<Tensor>> = m
                .params
                .iter()
                .map(|&i| {
                    let p = &self.params[i];
                    let g = p.param.grad();
                    let u = muon::nesterov(&p.first, g.defined().then_some(&g), m.hp.momentum);
                    Some(u.reshape(-1))
                })
                .collect();
            let results = m.orthogonal.run(pg, &updates)?;
            for ((&i, o), matrix) in m.params.iter().zip(results).zip(m.orthogonal.matrices()) {
                let p = &self.params[i].param;
                let adjusted = m.hp.adjusted_lr(lr, matrix.whole);
                muon::apply(p, &o.view(p.size().as_slice()), lr, adjusted, &m.hp)?;
            }
        }
        for rule in [Rule::Decay, Rule::Plain] {
            let group: Vec<&ParamState> = self
                .params
                .iter()
                .filter(|p| p.rule == rule && p.param.grad().defined())
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
                exp_avgs: group.iter().map(|p| &p.first).collect(),
                exp_avg_sqs: group.iter().map(|p| &p.second).collect(),
                steps: group.iter().map(|p| &p.step_count).collect(),
            };
            fused_adamw(&tensors, lr, &self.adamw, rule == Rule::Decay)?;
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
                    moments: p
                        .moments()
                        .into_iter()
                        .map(|(k, t)| (k, t.view(-1)))
                        .collect(),
                })
                .collect(),
        }
    }

    /// Restores the weights and, unless `weights_only` (`training.reset_optimizer`), the
    /// moments and the step count.
    pub fn load(
        &mut self,
        src: &dyn StateSource,
        adam_step: u64,
        weights_only: bool,
    ) -> Result<()> {
        for p in &self.params {
            let w = src.weight(&p.name, &p.param.size())?;
            let dev = p.param.device();
            tch::no_grad(|| p.param.shallow_clone().copy_(&w.to_device(dev)));
            if weights_only {
                continue;
            }
            for (key, t) in p.moments() {
                let m = src.moment(&p.name, key, &(0..p.param.numel()))?;
                tch::no_grad(|| t.view(-1).copy_(&m.to_device(dev)));
            }
        }
        self.step = if weights_only { 0 } else { adam_step };
        Ok(())
    }

    pub fn state_bytes(&self) -> StateBytes {
        let bytes = |t: &Tensor| match t.defined() {
            true => (t.numel() * t.kind().elt_size_in_bytes()) as u64,
            false => 0,
        };
        let params = self.params.iter().map(|p| bytes(&p.param)).sum();
        StateBytes {
            params,
            master: 0,
            moments: self
                .params
                .iter()
                .map(|p| bytes(&p.first) + bytes(&p.second))
                .sum(),
            grads: params,
        }
    }
}
