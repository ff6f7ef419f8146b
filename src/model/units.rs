//! What the model and its training pass (`backward`) share: the memory trade-off of a pass
//! ([`ActivationMemory`]), the units whose gradients become final together ([`GradUnit`]) and
//! the events a pass reports about them ([`UnitEvents`]), and the LM head's chunking. Below both
//! `llama` and `backward`, so neither depends on the other for them.

use anyhow::Result;
use tch::{Kind, Tensor};

use crate::config::ActivationCheckpointing;

/// How a training pass trades memory for compute (`training.activation_checkpointing`,
/// `training.loss_chunk_tokens`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ActivationMemory {
    pub checkpointing: ActivationCheckpointing,
    /// Tokens per LM-head chunk; 0 = the whole micro-batch in one chunk.
    pub loss_chunk_tokens: usize,
}

impl Default for ActivationMemory {
    /// Everything kept, one chunk: what a plain forward + backward does.
    fn default() -> Self {
        ActivationMemory {
            checkpointing: ActivationCheckpointing::None,
            loss_chunk_tokens: 0,
        }
    }
}

impl ActivationMemory {
    pub fn from_config(t: &crate::config::TrainingConfig) -> ActivationMemory {
        ActivationMemory {
            checkpointing: t.activation_checkpointing,
            loss_chunk_tokens: t.loss_chunk_tokens,
        }
    }
}

/// A group of parameters whose gradients become final together during the backward of a
/// micro-batch, in the order listed in the module docs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GradUnit {
    /// The LM head (untied models only; Llama's `lm_head.weight`).
    LmHead,
    /// The final norm (`model.norm.weight`).
    FinalNorm,
    /// Decoder layer i: every `model.layers.{i}.*` parameter.
    Layer(usize),
    /// The token embedding (`model.embed_tokens.weight`; with tied embeddings, also the LM
    /// head).
    Embedding,
}

/// What a pass tells its caller about the model's units, so that the caller can make a unit's
/// parameters present just before they are read and let them go after (zero stage 3 gathers
/// and frees them), and reduce a unit's gradients as soon as they are final.
pub trait UnitEvents {
    /// `unit`'s parameters are about to be read: its forward, its recomputation, its backward.
    fn before(&mut self, _unit: GradUnit) -> Result<()> {
        Ok(())
    }
    /// `unit`'s parameters are not read again until the next `before`.
    fn after(&mut self, _unit: GradUnit) -> Result<()> {
        Ok(())
    }
    /// `unit`'s gradients for this micro-batch are complete.
    fn grads_final(&mut self, _unit: GradUnit) -> Result<()> {
        Ok(())
    }
}

/// A pass whose caller needs no events: every parameter is always present.
pub struct NoEvents;

impl UnitEvents for NoEvents {}

impl GradUnit {
    /// The parameters whose units are `units` (one per parameter, from the model's table)
    /// grouped by unit, units in the order backward finishes them.
    pub fn group_in_backward_order(units: &[GradUnit]) -> Vec<(GradUnit, Vec<usize>)> {
        let rank_of = |u: GradUnit| match u {
            GradUnit::LmHead => (0, 0),
            GradUnit::FinalNorm => (1, 0),
            GradUnit::Layer(i) => (2, usize::MAX - i),
            GradUnit::Embedding => (3, 0),
        };
        let mut groups: Vec<(GradUnit, Vec<usize>)> = Vec::new();
        for (i, &unit) in units.iter().enumerate() {
            match groups.iter_mut().find(|(u, _)| *u == unit) {
                Some((_, list)) => list.push(i),
                None => groups.push((unit, vec![i])),
            }
        }
        groups.sort_by_key(|(u, _)| rank_of(*u));
        groups
    }
}

/// The dtype of the residual stream, the norms' statistics and the loss for matmuls in
/// `compute`: fp32, or fp64 for an fp64 model (the reference numerics are checked against).
pub(super) fn wide(compute: Kind) -> Kind {
    if compute == Kind::Double {
        Kind::Double
    } else {
        Kind::Float
    }
}

/// (start, length) of the chunks of `n` rows, `chunk` rows each (0 = one chunk).
pub(super) fn chunks(n: i64, chunk: usize) -> impl Iterator<Item = (i64, i64)> {
    let step = if chunk == 0 { n.max(1) } else { chunk as i64 };
    (0..n)
        .step_by(step as usize)
        .map(move |s| (s, step.min(n - s)))
}

/// The chunks' per-token results end to end (fp32 [0] for no chunk).
pub(super) fn concat(parts: Vec<Tensor>, device: tch::Device) -> Tensor {
    match parts.is_empty() {
        true => Tensor::zeros([0], (Kind::Float, device)),
        false => Tensor::cat(&parts, 0),
    }
}

/// The number of targets that count (not -100), as an fp32 tensor: the mean's divisor, kept on
/// the device so that no host sync is needed.
pub(super) fn counted_targets(targets: &Tensor) -> Tensor {
    targets.ne(-100).sum(Kind::Float)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cover_every_row_once() {
        let c: Vec<_> = chunks(10, 4).collect();
        assert_eq!(c, [(0, 4), (4, 4), (8, 2)]);
        assert_eq!(chunks(10, 0).collect::<Vec<_>>(), [(0, 10)]);
        assert_eq!(chunks(10, 64).collect::<Vec<_>>(), [(0, 10)]);
    }
}
