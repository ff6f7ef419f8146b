//! The final RMSNorm, the LM head and its cross-entropy, once for every use: the training pass
//! (forward and backward), validation's mean loss and the log-likelihood of chosen tokens that
//! multiple-choice evaluation (`data::tasks`) scores each choice by — on one rank and on a
//! tensor-parallel one (the vocabulary-parallel cross-entropy of tensor_parallel.rs, whose
//! reductions are identities on one rank).
//!
//! ## The chunked LM head
//! The final RMSNorm's output is kept once ([tokens, hidden] fp32). The LM head and the
//! cross-entropy run on `loss_chunk_tokens` tokens at a time, without an autograd graph: a
//! chunk's logits are computed, reduced to each token's loss and, when training, turned into
//! their gradient in the same buffer (softmax − one-hot, what log-softmax + NLL's backward
//! gives), the gradient for its rows of the hidden states written into a [tokens, hidden]
//! buffer and the head weight's gradient added in place; then the backward continues from that
//! buffer into the final norm and the decoder. The loss is the sum over chunks of their sums
//! divided by the number of targets (not -100), the same mean as one cross-entropy over all
//! tokens (within 1e-6 in fp32; with bf16 the head weight's gradient differs at bf16
//! resolution). Logits are in the compute dtype, the log-softmax in fp32 (fp64 for an fp64
//! model).
//!
//! A chunk needs one [tokens, vocab/T] fp32 buffer (plus its compute-dtype copy with bf16)
//! where autograd's log-softmax and its two gradients needed three. The head's two matmuls are
//! done here — the weight cast to the compute dtype once per micro-batch, not per chunk, and
//! each chunk's weight gradient added into the parameter's gradient in place (`addmm_`) rather
//! than materialised as a [vocab, hidden] tensor per chunk.

use anyhow::Result;
use tch::{Kind, Tensor};

use super::autograd::{backward_from, grad_of, leaf};
use super::documents::DocumentMask;
use super::llama::Llama;
use super::units::{chunks, concat, wide, GradUnit, UnitEvents};
use crate::sys::phase::{self, Phase};

/// What the backward of the head's chunks writes.
struct Backward<'a> {
    /// d(loss) / d(a chunk's summed loss), 0-dim (wide).
    grad_scale: Tensor,
    /// The gradient w.r.t. the hidden states [n, hidden] (wide), every row written.
    grad_hidden: &'a Tensor,
    head: HeadGradient<'a>,
}

impl Llama {
    /// Final norm, LM head and cross-entropy on the decoder's output `x` (this rank's tokens,
    /// no history), forward and backward, chunk by chunk: the mean loss (the same on every
    /// rank of a tensor- or context-parallel group) and the gradient w.r.t. `x`; the head
    /// weight's gradient accumulates into its `.grad`.
    pub(super) fn head_forward_backward(
        &self,
        x: &Tensor,
        targets: &Tensor,
        loss_scale: f64,
        units: &mut dyn UnitEvents,
    ) -> Result<(Tensor, Tensor)> {
        units.before(GradUnit::FinalNorm)?;
        units.before(self.head_unit())?;
        let top = leaf(x);
        let normed = self.final_norm(&top);
        let hidden = self.all_tokens(&normed.detach())?;
        let targets = targets.reshape([-1]);
        let count = self.counted_targets(&targets)?;
        let kind = wide(self.compute());
        // d(loss_scale · Σ chunk sums / count) / d(chunk sum).
        let grad_scale = (loss_scale * self.gradient_share() / &count).to_kind(kind);
        let grad_hidden = hidden.empty_like();
        let mut backward = Backward {
            grad_scale,
            grad_hidden: &grad_hidden,
            head: HeadGradient::new(self.head_weight(), kind),
        };
        let losses = self.head_chunks(&hidden, &targets, Some(&mut backward))?;
        backward.head.finish()?;
        if !self.tied() {
            units.grads_final(GradUnit::LmHead)?;
        }
        units.after(self.head_unit())?;
        let d_normed = self.enter_grad(&grad_hidden)?;
        backward_from(&normed, &d_normed.view_as(&normed))?;
        units.grads_final(GradUnit::FinalNorm)?;
        units.after(GradUnit::FinalNorm)?;
        Ok((self.mean_loss(losses, &count)?, grad_of(&top)?))
    }

    /// The mean next-token cross-entropy (fp32) of `inputs` [b, s] predicting `targets` [b, s]
    /// (-100 ignored), without gradients, on any layout (validation): the same on every rank
    /// of a tensor- or context-parallel group, which take the same rows. `units` hears of each
    /// unit's use as in `forward_backward` (zero stage 3 gathers).
    pub fn loss_units(
        &self,
        inputs: &Tensor,
        targets: &Tensor,
        docs: Option<&DocumentMask>,
        units: &mut dyn UnitEvents,
    ) -> Result<Tensor> {
        tch::no_grad(|| {
            // With CP this rank's chunks; the mean is still the whole sequence's.
            let (inputs, targets, docs) = self.local_rows(inputs, targets, docs)?;
            let x = self.stack(&inputs, docs, units)?;
            let targets = targets.reshape([-1]);
            let count = self.counted_targets(&targets)?;
            let losses = self.head_losses(&x, None, &targets, units)?;
            self.mean_loss(losses, &count)
        })
    }

    /// Each row's log-likelihood of its targets: Σ_t log p(targets[r, t] | inputs[r, ..=t])
    /// over the targets that count (not -100), fp32 [b] for `inputs` and `targets` [b, s]
    /// (int64). The same on every rank of a tensor- or context-parallel group, which take the
    /// same rows (context parallelism cuts s into 2C chunks: s must be a multiple of 2C; with
    /// sequence parallelism b·s a multiple of T). Without gradients; `units` hears of each
    /// unit's use as in `loss_units`.
    pub fn row_log_likelihoods(
        &self,
        inputs: &Tensor,
        targets: &Tensor,
        units: &mut dyn UnitEvents,
    ) -> Result<Tensor> {
        let b = inputs.size()[0];
        tch::no_grad(|| {
            let (inputs, targets, _) = self.local_rows(inputs, targets, None)?;
            let targets = targets.reshape([-1]);
            // Only the positions whose targets count go through the LM head: a continuation is
            // a few tokens of its row, and the head is most of a small model's work.
            let counted = targets.ne(-100).nonzero().squeeze_dim(1);
            let picked = targets.index_select(0, &counted);
            let x = self.stack(&inputs, None, units)?;
            let losses = concat(
                self.head_losses(&x, Some(&counted), &picked, units)?,
                x.device(),
            );
            let every = Tensor::zeros([targets.size()[0]], (Kind::Float, targets.device()))
                .index_copy(0, &counted, &losses.to_kind(Kind::Float));
            let mine = -every
                .view([b, -1])
                .sum_dim_intlist([1].as_slice(), false, Kind::Float);
            self.sequence_loss(mine)
        })
    }

    /// Final norm, LM head and cross-entropy of the decoder's output `x` (this rank's tokens),
    /// without gradients: each chunk's per-token losses of the micro-batch's tokens at flat
    /// positions `only` (all of them when None) against `targets` (one per such token).
    fn head_losses(
        &self,
        x: &Tensor,
        only: Option<&Tensor>,
        targets: &Tensor,
        units: &mut dyn UnitEvents,
    ) -> Result<Vec<Tensor>> {
        units.before(GradUnit::FinalNorm)?;
        units.before(self.head_unit())?;
        let hidden = self.all_tokens(&self.final_norm(x))?;
        let hidden = match only {
            Some(at) => hidden.index_select(0, at),
            None => hidden,
        };
        let losses = self.head_chunks(&hidden, targets, None)?;
        units.after(self.head_unit())?;
        units.after(GradUnit::FinalNorm)?;
        Ok(losses)
    }

    /// Every token of the micro-batch [n, hidden] from this rank's final-normed ones (gathered
    /// on a sequence-parallel rank): what the LM head reads.
    fn all_tokens(&self, normed: &Tensor) -> Result<Tensor> {
        let d = normed.size()[normed.dim() - 1];
        Ok(self.enter(normed)?.view([-1, d]))
    }

    /// Σ over the chunks of their summed losses / `count`: the mean loss of the whole sequence
    /// (the context-parallel group's sum of its ranks' parts).
    fn mean_loss(&self, losses: Vec<Tensor>, count: &Tensor) -> Result<Tensor> {
        let kind = wide(self.compute());
        let mut sum = Tensor::zeros([], (kind, count.device()));
        for chunk in losses {
            sum += chunk.sum(kind) / count;
        }
        self.sequence_loss(sum)
    }

    /// The LM head and the cross-entropy of `hidden` [n, hidden] (wide) against `targets` [n]
    /// (-100 ignored), `loss_chunk_tokens` rows at a time, without a graph: each chunk's
    /// per-token losses ([c], wide; 0 where ignored); with `backward`, each chunk's gradients
    /// too (its rows' into `grad_hidden`, the head weight's added to its gradient).
    fn head_chunks(
        &self,
        hidden: &Tensor,
        targets: &Tensor,
        mut backward: Option<&mut Backward>,
    ) -> Result<Vec<Tensor>> {
        let compute = self.compute();
        let (start, _) = self.vocab_rows();
        tch::no_grad(|| {
            let w = self.head_weight().to_kind(compute);
            let mut losses = Vec::new();
            for (at, len) in chunks(hidden.size()[0], self.activation_memory().loss_chunk_tokens) {
                phase::enter(Phase::Forward);
                let rows = hidden.narrow(0, at, len).to_kind(compute);
                let mut logits = self.vocab_logits(&rows, &w);
                let t = targets.narrow(0, at, len);
                let scale = backward.as_ref().map(|b| &b.grad_scale);
                losses.push(self.cross_entropy(&mut logits, &t, start, scale)?);
                let Some(b) = backward.as_deref_mut() else {
                    continue;
                };
                phase::enter(Phase::Backward);
                let d_logits = logits.to_kind(compute);
                b.grad_hidden.narrow(0, at, len).copy_(&d_logits.matmul(&w));
                b.head.add(&d_logits, &rows);
            }
            Ok(losses)
        })
    }

    /// The (vocabulary-parallel) cross-entropy of this rank's `logits` [c, Vp/T] (wide;
    /// columns from vocabulary row `start`) against `targets` [c] (-100 ignored): each token's
    /// loss ([c], 0 where ignored), and with `grad_scale` its gradient times that in the
    /// logits' own buffer. With m the row maximum and s = Σ exp(x − m) (both over the group),
    /// a token's loss is m + ln s − x_t and its gradient exp(x − m)/s − onehot(t): what
    /// log-softmax + NLL and their backward compute, without their two extra [c, vocab]
    /// tensors.
    fn cross_entropy(
        &self,
        logits: &mut Tensor,
        targets: &Tensor,
        start: i64,
        grad_scale: Option<&Tensor>,
    ) -> Result<Tensor> {
        let kind = logits.kind();
        let local = logits.size()[1];
        let valid = targets.ne(-100).to_kind(kind);
        let shifted = targets - start;
        let here = shifted
            .ge(0)
            .logical_and(&shifted.lt(local))
            .logical_and(&targets.ne(-100));
        let column = shifted.clamp(0, local - 1).unsqueeze(1);
        let picked = logits
            .gather(1, &column, false)
            .squeeze_dim(1)
            .where_self(&here, &valid.zeros_like());
        let max = self.group_max(logits.amax([1].as_slice(), false))?;
        let _ = logits.g_sub_(&max.unsqueeze(1)).exp_();
        let sum = logits.sum_dim_intlist([1].as_slice(), false, kind);
        let [sum, picked] = self.group_sum([sum, picked])?;
        let loss = (&max + sum.log() - picked) * &valid;
        if let Some(scale) = grad_scale {
            let _ = logits.g_div_(&sum.unsqueeze(1));
            let _ = logits.scatter_add_(1, &column, &(-here.to_kind(kind)).unsqueeze(1));
            let _ = logits.g_mul_(&(valid * scale).unsqueeze(1));
        }
        Ok(loss)
    }
}

/// The LM head weight's gradient over a micro-batch's chunks, added chunk by chunk without an
/// autograd graph: in place into the parameter's `.grad` (`addmm_` when the chunks are in the
/// gradient's dtype), or, before the parameter has one, into this micro-batch's own sum, which
/// autograd turns into `.grad` at the end. No [vocab, hidden] tensor per chunk.
struct HeadGradient<'w> {
    weight: &'w Tensor,
    /// The gradient's dtype (fp32; fp64 for an fp64 model).
    kind: Kind,
    /// This micro-batch's sum, when the parameter had no gradient yet.
    fresh: Option<Tensor>,
}

impl<'w> HeadGradient<'w> {
    fn new(weight: &'w Tensor, kind: Kind) -> Self {
        HeadGradient {
            weight,
            kind,
            fresh: None,
        }
    }

    /// Adds d_logitsᵀ · rows of one chunk (both in the compute dtype). Under `no_grad`.
    fn add(&mut self, d_logits: &Tensor, rows: &Tensor) {
        let accumulated = self.weight.grad();
        let into = if accumulated.defined() {
            Some(accumulated)
        } else {
            self.fresh.as_ref().map(Tensor::shallow_clone)
        };
        match into {
            Some(mut g) if d_logits.kind() == self.kind => {
                let _ = g.addmm_(&d_logits.tr(), rows);
            }
            Some(mut g) => g += d_logits.tr().matmul(rows),
            None => self.fresh = Some(d_logits.tr().matmul(rows).to_kind(self.kind)),
        }
    }

    /// After the last chunk: the parameter's first gradient, if this was it, handed to
    /// autograd, which creates `.grad` from it.
    fn finish(self) -> Result<()> {
        match self.fresh {
            Some(g) => backward_from(&self.weight.view_as(self.weight), &g),
            None => Ok(()),
        }
    }
}
