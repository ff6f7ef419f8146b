//! Muon (`training.optimizer = muon`), its numbers exactly `torch.optim.Muon`'s: for each
//! matrix with gradient G and momentum buffer B (fp32, zero at first),
//!
//! ```text
//! B ← B.lerp(G, 1 − μ)                     (B = μB + (1 − μ)G)
//! U ← G.lerp(B, μ)                         (Nesterov)
//! O ← NS(U)                                 in bf16: X = U / max(‖U‖_F, 1e-7) (transposed when
//!                                           rows > columns), then `ns_steps` times
//!                                           X ← aX + (bA + cA²)X with A = XXᵀ,
//!                                           (a, b, c) = (3.4445, −4.775, 2.0315)
//! W ← W · (1 − lr·wd)                       decoupled weight decay, the unadjusted lr
//! W ← W − lr·adjust(A, B) · O               match_rms_adamw: 0.2·√max(A, B);
//!                                           original: √max(1, A/B)
//! ```
//!
//! Which parameters ([`Rule::of`]): every 2-D weight inside a decoder layer (the attention and
//! MLP projections, a mixture's router, each expert's matrices on their own, as separate
//! parameters); the embeddings, the LM head and every 1-D parameter keep AdamW, as Keller
//! Jordan's Muon and torchtitan do. The elementwise parts (momentum, Nesterov, the update) run
//! on whatever piece of a matrix a rank holds; Newton–Schulz needs the whole matrix, which
//! `orthogonal.rs` assembles on one rank.
//!
//! The Newton–Schulz iteration and the update are csrc/muon.cpp: libtorch's `addmm` with beta
//! and alpha and `add_` with alpha, which tch lacks (emulated with separate ops they round
//! differently), op for op as torch runs them, so one rank's update is bitwise PyTorch's from
//! the same gradient.

use tch::{Kind, Tensor};
use torch_sys::C_tensor;

use crate::config::{Config, MuonAdjust};
use crate::model::Parameter;

extern "C" {
    /// csrc/muon.cpp: torch.optim.Muon's `_zeropower_via_newtonschulz` of the 2-D `update`
    /// into a new bf16 tensor `*out`; a status and `err` as in crate::sys::ffi.
    fn lockstep_newton_schulz(
        update: *mut C_tensor,
        a: f64,
        b: f64,
        c: f64,
        steps: i64,
        eps: f64,
        out: *mut *mut C_tensor,
        err: *mut *mut libc::c_char,
    ) -> libc::c_int;

    /// csrc/muon.cpp: `param.mul_(decay); param.add_(update, alpha)`.
    fn lockstep_muon_apply(
        param: *mut C_tensor,
        update: *mut C_tensor,
        decay: f64,
        alpha: f64,
        err: *mut *mut libc::c_char,
    ) -> libc::c_int;
}

/// The quintic iteration's coefficients (Keller Jordan's, torch.optim.Muon's defaults).
const NS_COEFFICIENTS: (f64, f64, f64) = (3.4445, -4.775, 2.0315);
/// The Frobenius norm's floor before the first iteration (torch.optim.Muon's `eps`).
const NS_EPS: f64 = 1e-7;

/// Muon's settings (`training.muon_*`, `training.weight_decay`); Nesterov momentum always.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MuonParams {
    pub momentum: f64,
    pub ns_steps: usize,
    pub adjust: MuonAdjust,
    pub weight_decay: f64,
    /// `debug.muon_all_gather`: every holder of a matrix orthogonalizes it (`orthogonal.rs`).
    pub all_gather: bool,
}

impl MuonParams {
    pub fn from_config(c: &Config) -> MuonParams {
        let t = &c.training;
        MuonParams {
            momentum: t.muon_momentum,
            ns_steps: t.muon_ns_steps,
            adjust: t.muon_adjust_lr,
            weight_decay: t.weight_decay,
            all_gather: c.debug.muon_all_gather,
        }
    }

    /// The learning rate of an `a` × `b` matrix (its whole Hugging Face shape) at the
    /// scheduled `lr`: torch.optim.Muon's `_adjust_lr`, in the same f64 arithmetic.
    pub fn adjusted_lr(&self, lr: f64, [a, b]: [i64; 2]) -> f64 {
        let (a, b) = (a as f64, b as f64);
        let ratio = match self.adjust {
            MuonAdjust::Original => (a / b).max(1.0).sqrt(),
            MuonAdjust::MatchRmsAdamw => 0.2 * a.max(b).sqrt(),
        };
        lr * ratio
    }
}

/// How a parameter is updated. The order is the flat layout's group order
/// (`dist::flat_layout`): Muon's matrices, then AdamW's decayed parameters, then the rest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rule {
    Muon = 0,
    /// AdamW with `training.weight_decay` (matrices and embeddings).
    Decay = 1,
    /// AdamW without decay (1-D: norm weights).
    Plain = 2,
}

impl Rule {
    /// `p`'s rule in a run with Muon (`muon`) or AdamW alone.
    pub fn of(p: &Parameter, muon: bool) -> Rule {
        if muon && p.is_layer_matrix() {
            Rule::Muon
        } else {
            Rule::adamw(&p.shape)
        }
    }

    /// AdamW's rule for a parameter of `shape`: matrices and embeddings decay, norm weights
    /// and biases (1-D) do not (the GPT-2/Llama convention).
    pub fn adamw(shape: &[i64]) -> Rule {
        if shape.len() >= 2 {
            Rule::Decay
        } else {
            Rule::Plain
        }
    }

    /// The flat layout's group.
    pub fn group(self) -> usize {
        self as usize
    }
}

/// `B ← B.lerp(G, 1 − μ)`, then the Nesterov update `G.lerp(B, μ)` in bf16 (what
/// Newton–Schulz reads first): elementwise, so any piece of a matrix gives the whole's values.
/// An undefined gradient counts as zeros (a rank's slice of a parameter nothing reached).
pub fn nesterov(buffer: &Tensor, grad: Option<&Tensor>, momentum: f64) -> Tensor {
    tch::no_grad(|| {
        let zeros;
        let grad = match grad {
            Some(g) => g,
            None => {
                zeros = buffer.zeros_like();
                &zeros
            }
        };
        let _ = buffer.shallow_clone().lerp_(grad, 1.0 - momentum);
        grad.lerp(buffer, momentum).to_kind(Kind::BFloat16)
    })
}

/// The Newton–Schulz orthogonalization of the 2-D `update`: a new bf16 matrix of its shape.
pub fn newton_schulz(update: &Tensor, steps: usize) -> anyhow::Result<Tensor> {
    let (a, b, c) = NS_COEFFICIENTS;
    let mut out: *mut C_tensor = std::ptr::null_mut();
    // SAFETY: `update` is a live tch handle for the call; on success the shim stores a new
    // `at::Tensor*` in `out` that this function then owns; it catches every C++ exception.
    crate::sys::ffi::call(|err| unsafe {
        lockstep_newton_schulz(
            update.as_ptr() as *mut C_tensor,
            a,
            b,
            c,
            steps as i64,
            NS_EPS,
            &mut out,
            err,
        )
    })
    .map_err(|e| anyhow::anyhow!("Muon's Newton-Schulz iteration failed: {e}"))?;
    // SAFETY: the shim succeeded, so `out` is a fresh `at::Tensor*` that nothing else owns.
    Ok(unsafe { Tensor::from_ptr(out) })
}

/// `W ← W·(1 − lr·wd) − adjusted_lr·O` on `param` (a matrix, or any piece of one, fp32) with
/// `update` (the same elements of O, bf16).
pub fn apply(
    param: &Tensor,
    update: &Tensor,
    lr: f64,
    adjusted_lr: f64,
    hp: &MuonParams,
) -> anyhow::Result<()> {
    let decay = 1.0 - lr * hp.weight_decay;
    // SAFETY: live tch handles for the call; the shim catches every C++ exception.
    crate::sys::ffi::call(|err| unsafe {
        lockstep_muon_apply(
            param.as_ptr() as *mut C_tensor,
            update.as_ptr() as *mut C_tensor,
            decay,
            -adjusted_lr,
            err,
        )
    })
    .map_err(|e| anyhow::anyhow!("Muon's update failed: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hp(adjust: MuonAdjust) -> MuonParams {
        MuonParams {
            momentum: 0.95,
            ns_steps: 5,
            adjust,
            weight_decay: 0.1,
            all_gather: false,
        }
    }

    #[test]
    fn the_learning_rate_is_adjusted_as_torch_does() {
        let m = hp(MuonAdjust::MatchRmsAdamw);
        assert_eq!(m.adjusted_lr(1e-3, [256, 64]), 1e-3 * 0.2 * 16.0);
        let o = hp(MuonAdjust::Original);
        assert_eq!(o.adjusted_lr(1e-3, [256, 64]), 1e-3 * 2.0);
        assert_eq!(o.adjusted_lr(1e-3, [64, 256]), 1e-3, "max(1, A/B)");
    }

    /// The iteration orthogonalizes: a random 48 × 16 matrix (tall: run transposed) comes out
    /// with singular values in torch's band (~0.5 to 1.5, not exactly 1), in bf16, of its
    /// shape; a zero matrix stays zero (the norm's floor).
    #[test]
    fn newton_schulz_gives_singular_values_near_one() {
        tch::manual_seed(3);
        let g = Tensor::randn([48, 16], (Kind::Float, tch::Device::Cpu));
        let o = newton_schulz(&g, 5).unwrap();
        assert_eq!((o.size(), o.kind()), (vec![48, 16], Kind::BFloat16));
        // Singular values: the square roots of OᵀO's eigenvalues.
        let o64 = o.to_kind(Kind::Double);
        let s = o64.tr().matmul(&o64).linalg_eigvalsh("L").sqrt();
        let (lo, hi) = (s.min().double_value(&[]), s.max().double_value(&[]));
        assert!(lo > 0.5 && hi < 1.3, "singular values {lo}..{hi}");
        let zero = newton_schulz(&g.zeros_like(), 5).unwrap();
        assert_eq!(zero.abs().max().double_value(&[]), 0.0);
        assert!(g.equal(&g.copy()), "the input is left alone");
    }

    /// The iteration in fp64, as torch writes it (for the check below).
    fn newton_schulz_fp64(update: &Tensor, steps: usize) -> Tensor {
        let (a, b, c) = NS_COEFFICIENTS;
        let tall = update.size()[0] > update.size()[1];
        let mut x = update.to_kind(Kind::Double);
        if tall {
            x = x.tr();
        }
        x = &x / x.norm().clamp_min(NS_EPS);
        for _ in 0..steps {
            let gram = x.matmul(&x.tr());
            let update = &gram * b + gram.matmul(&gram) * c;
            x = &x * a + update.matmul(&x);
        }
        if tall {
            x.tr()
        } else {
            x
        }
    }

    /// Why layouts whose gradients differ in their last bits end apart by more than fp32
    /// rounding: Newton–Schulz rounds its input to bf16, and an update scaled by
    /// (1 + 1e-6 · a normal draw) crosses a few bf16 rounding boundaries (of 65,536 elements),
    /// after which the bf16 iteration lands ~0.9% away (relative L2): about as far as either
    /// result is from the same iteration in fp64 (~1.1%, the bf16 iteration's own error).
    /// Neither is the more right one; torch's iteration does the same (BENCHMARKS.md §22).
    #[test]
    fn last_bits_move_the_bf16_iteration_less_than_its_own_error() {
        tch::manual_seed(11);
        let cpu = (Kind::Float, tch::Device::Cpu);
        let u = Tensor::randn([256, 256], cpu);
        let nudged = &u * (Tensor::randn([256, 256], cpu) * 1e-6 + 1.0);
        let rel = |a: &Tensor, b: &Tensor| {
            let a = a.to_kind(Kind::Double);
            (&a - b).norm().double_value(&[]) / b.norm().double_value(&[])
        };
        let (o, o2) = (
            newton_schulz(&u, 5).unwrap(),
            newton_schulz(&nudged, 5).unwrap(),
        );
        let exact = newton_schulz_fp64(&u, 5);
        let apart = rel(&o, &o2.to_kind(Kind::Double));
        let (err, err2) = (rel(&o, &exact), rel(&o2, &exact));
        assert!(apart > 1e-3, "the nudge crossed bf16 boundaries: {apart:e}");
        assert!(
            apart < err && apart < err2,
            "{apart:e} vs {err:e}, {err2:e}"
        );
        assert!(
            (err2 / err - 1.0).abs() < 0.1,
            "equally right: {err:e}, {err2:e}"
        );
    }

    /// Momentum on pieces equals momentum on the whole (it is elementwise), and the apply is
    /// the decay then the step.
    #[test]
    fn momentum_and_update_are_elementwise() {
        tch::manual_seed(4);
        let cpu = (Kind::Float, tch::Device::Cpu);
        let g = Tensor::randn([6, 4], cpu);
        let whole = Tensor::randn([6, 4], cpu);
        let pieces = whole.copy();
        let u = nesterov(&whole, Some(&g), 0.95);
        let flat = pieces.view(-1);
        let gf = g.view(-1);
        let a = nesterov(&flat.narrow(0, 0, 10), Some(&gf.narrow(0, 0, 10)), 0.95);
        let b = nesterov(&flat.narrow(0, 10, 14), Some(&gf.narrow(0, 10, 14)), 0.95);
        assert!(whole.equal(&pieces));
        assert!(u.view(-1).equal(&Tensor::cat(&[a, b], 0)));
        let p = Tensor::ones([2, 2], cpu);
        let o = Tensor::full([2, 2], 0.5, (Kind::BFloat16, tch::Device::Cpu));
        apply(&p, &o, 0.1, 2.0, &hp(MuonAdjust::Original)).unwrap();
        // 1·(1 − 0.1·0.1) − 2·0.5
        let want = (1.0f32 - 0.1 * 0.1) - 2.0 * 0.5;
        assert!((p.double_value(&[0, 0]) - f64::from(want)).abs() < 1e-7);
    }
}
