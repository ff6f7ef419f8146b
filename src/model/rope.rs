//! Rotary position embedding exactly as transformers' Llama computes it: `rotate_half` pairs
//! dimension j with j + head_dim/2 (not interleaved pairs), and cos/sin are built in fp32 and cast
//! to the activation dtype at use.

use tch::{Device, Kind, Tensor};

use super::shape::Llama3RopeScaling;

pub struct Rope {
    /// [max_len, head_dim], fp32.
    cos: Tensor,
    sin: Tensor,
}

impl Rope {
    pub fn new(
        head_dim: usize,
        theta: f64,
        scaling: Option<Llama3RopeScaling>,
        max_len: usize,
        device: Device,
    ) -> Rope {
        let opts = (Kind::Float, device);
        // Same op sequence as transformers: theta ** (arange(0, d, 2) / d), then its reciprocal.
        let exponent = Tensor::arange_start_step(0, head_dim as i64, 2, (Kind::Int64, device))
            .to_kind(Kind::Float)
            / head_dim as f64;
        let mut inv_freq = Tensor::pow_scalar(theta, &exponent).reciprocal();
        if let Some(s) = scaling {
            inv_freq = llama3_scaled(&inv_freq, s);
        }
        let positions = Tensor::arange(max_len as i64, opts);
        let freqs = positions.unsqueeze(1) * inv_freq.unsqueeze(0);
        let emb = Tensor::cat(&[&freqs, &freqs], -1);
        Rope {
            cos: emb.cos(),
            sin: emb.sin(),
        }
    }

    /// Rotates `x` of shape [batch, heads, seq, head_dim] for positions start..start + seq (the
    /// new tokens of a KV-cached decoding step).
    pub fn apply_at(&self, x: &Tensor, start: usize) -> Tensor {
        let seq = x.size()[2];
        let cos = self.cos.narrow(0, start as i64, seq).to_kind(x.kind());
        let sin = self.sin.narrow(0, start as i64, seq).to_kind(x.kind());
        x * cos + rotate_half(x) * sin
    }

    /// Rotates `x` of shape [batch, heads, seq, head_dim] for per-token `positions` [batch, seq]
    /// (int64): documents packed into one window, each restarting at 0.
    pub fn apply_positions(&self, x: &Tensor, positions: &Tensor) -> Tensor {
        let (b, t) = (positions.size()[0], positions.size()[1]);
        let at = |table: &Tensor| {
            table
                .index_select(0, &positions.reshape([-1]))
                .view([b, 1, t, -1])
                .to_kind(x.kind())
        };
        x * at(&self.cos) + rotate_half(x) * at(&self.sin)
    }

    pub fn max_len(&self) -> usize {
        self.cos.size()[0] as usize
    }
}

fn rotate_half(x: &Tensor) -> Tensor {
    let half = x.size()[3] / 2;
    let x1 = x.narrow(3, 0, half);
    let x2 = x.narrow(3, half, half);
    Tensor::cat(&[&(-x2), &x1], -1)
}

/// transformers' `_compute_llama3_parameters`, op for op: wavelengths above
/// original_max / low_freq_factor get inv_freq / factor, those below original_max /
/// high_freq_factor keep it, and the band between is interpolated.
fn llama3_scaled(inv_freq: &Tensor, s: Llama3RopeScaling) -> Tensor {
    let old_len = s.original_max_position_embeddings as f64;
    let low_freq_wavelen = old_len / s.low_freq_factor;
    let high_freq_wavelen = old_len / s.high_freq_factor;
    let wavelen = inv_freq.reciprocal() * (2.0 * std::f64::consts::PI);
    let long = wavelen.gt(low_freq_wavelen);
    let scaled = inv_freq.where_self(&long.logical_not(), &(inv_freq / s.factor));
    let smooth: Tensor = (wavelen.reciprocal() * old_len - s.low_freq_factor)
        / (s.high_freq_factor - s.low_freq_factor);
    let one_minus: Tensor = smooth.neg() + 1.0;
    let smoothed: Tensor = one_minus * &scaled / s.factor + &smooth * &scaled;
    let medium = wavelen
        .lt(high_freq_wavelen)
        .logical_not()
        .logical_and(&long.logical_not());
    smoothed.where_self(&medium, &scaled)
}
