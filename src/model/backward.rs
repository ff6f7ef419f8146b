//! Forward and backward of one micro-batch, a decoder layer at a time: activation
//! checkpointing, the chunked LM head + cross-entropy, and a callback when a unit's gradients
//! are final.
//!
//! ## Design note: why layer by layer in Rust, not a C++ checkpoint function
//! libtorch's C++ API has no activation checkpointing (`torch.utils.checkpoint` is Python; the
//! 2.11 headers hold only the engine's `CheckpointValidGuard`), and tch exposes none. The two
//! ways to get it were:
//! (a) run the layers forward without a graph where activations are not to be kept, keep each
//!     layer's input, and go backward one layer at a time: recompute the layer from its input
//!     with a graph and back-propagate the gradient that came from the layer above (a
//!     vector-Jacobian product seeded with that gradient), the parameters' `.grad`
//!     accumulating as in one whole backward;
//! (b) a `torch::autograd::Function` in a C++ shim whose backward recomputes the layer.
//! (b) needs the recomputation — the model, written in Rust — to be called back from inside
//! libtorch's autograd engine: on CUDA from the engine's device thread, with a Rust panic
//! unable to cross the C++ frames, and a nested backward inside a backward. (a) needs one small
//! shim, `csrc/autograd.cpp`: `torch::autograd::backward(roots, grads)` (tch's `backward`
//! always seeds with ones). Everything else stays ordinary tch code on the calling thread, and
//! (a) gives the step what the overlap of gradient reductions needs for free: the backward is
//! an explicit loop, so "layer i's gradients are final" is a point in the code.
//! The evidence that (a) loses nothing: gradients are bitwise equal to one whole backward in
//! every mode on CPU (recomputation is deterministic there: same kernels, same shapes, same
//! threads; tests in tests/activation_memory.rs, fp32 and bf16, GQA, tied and untied), and
//! the time it costs is the recomputation itself (BENCHMARKS.md, section 6).
//!
//! ## What each mode keeps (per decoder layer, between the forward and its backward)
//! - `none`: the graph autograd builds — every tensor the layer's ops save.
//! - `full`: the layer's input, [batch, seq, hidden] fp32. The layer runs forward without a
//!   graph and again, with one, during backward.
//! - `selective`: the attention half's graph (input RMSNorm's input and output, q/k/v after
//!   RoPE, the attention output and its log-sum-exp, the o_proj input) and the residual
//!   stream after it. The MLP half (post-attention RMSNorm, gate/up projections, SiLU, their
//!   product, the down projection) runs without a graph and again, with one, during backward.
//!   It keeps about a third of `none`'s tensors and recomputes no attention.
//!
//! ## The chunked LM head
//! The final RMSNorm's output is kept once ([tokens, hidden] fp32). The LM head and the
//! cross-entropy run on `loss_chunk_tokens` tokens at a time, without an autograd graph: a
//! chunk's logits are computed, reduced to its summed loss and turned into their gradient in
//! the same buffer (softmax − one-hot, what log-softmax + NLL's backward gives), the gradient
//! for its rows of the hidden states is written into a [tokens, hidden] buffer and the head
//! weight's gradient added in place; then the backward continues from that buffer into the
//! final norm and the decoder. The loss is the sum over chunks divided by the number of targets
//! (not -100), the same mean as one cross-entropy over all tokens (within 1e-6 in fp32; with
//! bf16 the head weight's gradient differs at bf16 resolution).
//!
//! ## Order of the units whose gradients become final ([`GradUnit`])
//! `LmHead` (untied only) → `FinalNorm` → `Layer(L-1)` → … → `Layer(0)` → `Embedding`. With
//! tied embeddings there is no `LmHead` unit: the LM head's gradient lands in
//! `model.embed_tokens.weight`, which is final only at `Embedding`.

use anyhow::Result;
use tch::{Kind, Tensor};

use super::autograd::{backward_from, grad_of, leaf};
use super::documents::DocumentMask;
use super::llama::Llama;
use super::units::{chunks, wide, GradUnit, UnitEvents};
pub use crate::config::ActivationCheckpointing;
use crate::sys::phase::{self, Phase};

/// What a decoder layer keeps between its forward and its backward.
enum Kept {
    /// `none`: the layer's graph, from its input (a leaf) to its output.
    Graph { input: Tensor, output: Tensor },
    /// `full`: the layer's input, without a graph.
    Input(Tensor),
    /// `selective`: the attention half's graph, from the input (a leaf) to the residual after
    /// attention.
    Attention { input: Tensor, middle: Tensor },
}

impl Llama {
    /// Forward and backward of one micro-batch: inputs and targets [batch, seq] (int64). The
    /// gradients of `loss_scale` × the mean cross-entropy accumulate into the parameters'
    /// `.grad`, as `(loss(inputs, targets) * loss_scale).backward()` would, with the activation
    /// memory of [`Llama::activation_memory`]. `units.grads_final(unit)` is called as soon as a unit's
    /// gradients for this micro-batch are complete, in the order of the module docs; an error
    /// from it stops the pass; `units.before`/`after` bracket every use of a unit's parameters.
    /// Returns the unscaled mean loss (0-dim fp32, no graph).
    ///
    /// With context parallelism every rank of the group passes the same rows and computes on
    /// its chunks of them: the loss is the whole sequence's mean, and each rank's gradients are
    /// C times its tokens' part of that mean's, so that the group's mean is the gradient (as
    /// for data-parallel ranks, which the optimizer averages over together with them).
    pub fn forward_backward(
        &self,
        inputs: &Tensor,
        targets: &Tensor,
        docs: Option<&DocumentMask>,
        loss_scale: f64,
        units: &mut dyn UnitEvents,
    ) -> Result<Tensor> {
        if let Some(cp) = &self.cp {
            let (inputs, targets) = cp.begin(inputs, targets, docs)?;
            let loss = self.forward_backward_local(&inputs, &targets, None, loss_scale, units)?;
            cp.end()?;
            return Ok(loss);
        }
        self.forward_backward_local(inputs, targets, docs, loss_scale, units)
    }

    /// [`Llama::forward_backward`] of the tokens this rank holds.
    fn forward_backward_local(
        &self,
        inputs: &Tensor,
        targets: &Tensor,
        docs: Option<&DocumentMask>,
        loss_scale: f64,
        units: &mut dyn UnitEvents,
    ) -> Result<Tensor> {
        if self.tp.is_some() {
            return self.forward_backward_split(inputs, targets, docs, loss_scale, units);
        }
        phase::enter(Phase::Forward);
        units.before(GradUnit::Embedding)?;
        let embedded = self.embed(inputs);
        units.after(GradUnit::Embedding)?;
        let mut x = embedded.detach();
        let mut kept = Vec::with_capacity(self.num_layers());
        for i in 0..self.num_layers() {
            units.before(GradUnit::Layer(i))?;
            let (k, out) = self.layer_forward(&x, i, docs)?;
            units.after(GradUnit::Layer(i))?;
            kept.push(k);
            x = out;
        }

        let (loss, mut grad) = self.head_forward_backward(&x, targets, loss_scale, units)?;

        for (i, k) in kept.into_iter().enumerate().rev() {
            phase::enter(Phase::Backward);
            units.before(GradUnit::Layer(i))?;
            grad = self.layer_backward(k, i, &grad, docs)?;
            units.grads_final(GradUnit::Layer(i))?;
            units.after(GradUnit::Layer(i))?;
        }
        phase::enter(Phase::Backward);
        // The embedding's backward reads no weight, but its gradient must meet a parameter of
        // its full shape.
        units.before(GradUnit::Embedding)?;
        backward_from(&embedded, &grad)?;
        units.grads_final(GradUnit::Embedding)?;
        units.after(GradUnit::Embedding)?;
        Ok(loss)
    }

    /// The unit whose weight the LM head reads: its own, or the embedding when tied.
    pub fn head_unit(&self) -> GradUnit {
        if self.tied() {
            GradUnit::Embedding
        } else {
            GradUnit::LmHead
        }
    }

    /// The units in the order a pass calls [`UnitEvents::before`] on them: the forward
    /// (embedding, layers, final norm, head), then with `backward` the layers from the last
    /// and the embedding.
    pub fn unit_order(&self, backward: bool) -> Vec<GradUnit> {
        let layers = self.num_layers();
        let mut order = vec![GradUnit::Embedding];
        order.extend((0..layers).map(GradUnit::Layer));
        order.extend([GradUnit::FinalNorm, self.head_unit()]);
        if backward {
            order.extend((0..layers).rev().map(GradUnit::Layer));
            order.push(GradUnit::Embedding);
        }
        order
    }

    /// Layer `i`'s forward on the residual stream `x` (no history): what it keeps for its
    /// backward, and its output (no history).
    fn layer_forward(
        &self,
        x: &Tensor,
        i: usize,
        docs: Option<&DocumentMask>,
    ) -> Result<(Kept, Tensor)> {
        Ok(match self.activation_memory().checkpointing {
            ActivationCheckpointing::None => {
                let input = leaf(x);
                let output = self.decoder_layer(&input, i, docs)?;
                let next = output.detach();
                (Kept::Graph { input, output }, next)
            }
            ActivationCheckpointing::Full => {
                let next = tch::no_grad(|| self.decoder_layer(x, i, docs))?;
                (Kept::Input(x.shallow_clone()), next)
            }
            ActivationCheckpointing::Selective => {
                let input = leaf(x);
                let middle = self.attention_block(&input, i, docs)?;
                let next = tch::no_grad(|| self.mlp_block(&middle, i));
                (Kept::Attention { input, middle }, next)
            }
        })
    }

    /// Layer `i`'s backward: the gradient w.r.t. its output in, w.r.t. its input out; its
    /// parameters' gradients accumulate on the way (recomputing what was not kept). With
    /// context parallelism the graph from the input ends at the attention output and the
    /// attention's own backward (`finish_attention`) continues it from there; the input's
    /// gradient is complete after both.
    fn layer_backward(
        &self,
        kept: Kept,
        i: usize,
        grad: &Tensor,
        docs: Option<&DocumentMask>,
    ) -> Result<Tensor> {
        match kept {
            Kept::Graph { input, output } => {
                backward_from(&output, grad)?;
                self.finish_attention()?;
                grad_of(&input)
            }
            Kept::Input(x) => {
                let input = leaf(&x);
                let output = self.decoder_layer(&input, i, docs)?;
                backward_from(&output, grad)?;
                self.finish_attention()?;
                grad_of(&input)
            }
            Kept::Attention { input, middle } => {
                let mid = leaf(&middle);
                let output = self.mlp_block(&mid, i);
                backward_from(&output, grad)?;
                backward_from(&middle, &grad_of(&mid)?)?;
                self.finish_attention()?;
                grad_of(&input)
            }
        }
    }

    /// Final norm, LM head and cross-entropy on the decoder's output `x` (no history), forward
    /// and backward, chunk by chunk. Returns the mean loss and the gradient w.r.t. `x`.
    ///
    /// No autograd graph is built for the head: a chunk's logits are turned into their
    /// cross-entropy and, in the same buffer, its gradient (`cross_entropy_in_place`), and the
    /// head's two matmuls are done here — the weight cast to the compute dtype once per
    /// micro-batch, not per chunk, and each chunk's weight gradient added into the parameter's
    /// gradient in place (`addmm_` in fp32) rather than materialised as a [vocab, hidden]
    /// tensor per chunk. A chunk then needs one [tokens, vocab] fp32 buffer (plus its compute
    /// dtype copy with bf16) where autograd's log-softmax and its two gradients needed three.
    fn head_forward_backward(
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
        let hidden = normed.detach().view([-1, normed.size()[2]]);
        let targets = targets.reshape([-1]);
        let count = self.counted_targets(&targets)?;
        // d(loss_scale · Σ chunk sums / count) / d(chunk sum).
        let compute = self.compute();
        let kind = wide(compute);
        let grad_scale = (loss_scale * self.gradient_share() / &count).to_kind(kind);
        let weight = self.head_weight();
        let grad_hidden = hidden.empty_like();
        let mut head_grad = HeadGradient::new(weight, kind);
        let mut loss_sum = Tensor::zeros([], (kind, x.device()));
        tch::no_grad(|| -> Result<()> {
            let w = weight.to_kind(compute);
            for (start, len) in chunks(hidden.size()[0], self.activation_memory().loss_chunk_tokens)
            {
                phase::enter(Phase::Forward);
                let rows = hidden.narrow(0, start, len).to_kind(compute);
                let logits = rows.matmul(&w.tr()).to_kind(kind);
                let (sum, d_logits) =
                    cross_entropy_in_place(logits, &targets.narrow(0, start, len), &grad_scale);
                loss_sum += sum / &count;
                phase::enter(Phase::Backward);
                let d_logits = d_logits.to_kind(compute);
                grad_hidden
                    .narrow(0, start, len)
                    .copy_(&d_logits.matmul(&w));
                head_grad.add(&d_logits, &rows);
            }
            Ok(())
        })?;
        head_grad.finish()?;
        if !self.tied() {
            units.grads_final(GradUnit::LmHead)?;
        }
        units.after(self.head_unit())?;
        backward_from(&normed, &grad_hidden.view_as(&normed))?;
        units.grads_final(GradUnit::FinalNorm)?;
        units.after(GradUnit::FinalNorm)?;
        Ok((self.sequence_loss(loss_sum)?, grad_of(&top)?))
    }
}

/// The LM head weight's gradient over a micro-batch's chunks, added chunk by chunk without an
/// autograd graph: in place into the parameter's `.grad` (`addmm_` when the chunks are in the
/// gradient's dtype), or, before the parameter has one, into this micro-batch's own sum, which
/// autograd turns into `.grad` at the end. No [vocab, hidden] tensor per chunk.
pub(super) struct HeadGradient<'w> {
    weight: &'w Tensor,
    /// The gradient's dtype (fp32; fp64 for an fp64 model).
    kind: Kind,
    /// This micro-batch's sum, when the parameter had no gradient yet.
    fresh: Option<Tensor>,
}

impl<'w> HeadGradient<'w> {
    pub(super) fn new(weight: &'w Tensor, kind: Kind) -> Self {
        HeadGradient {
            weight,
            kind,
            fresh: None,
        }
    }

    /// Adds d_logitsᵀ · rows of one chunk (both in the compute dtype). Under `no_grad`.
    pub(super) fn add(&mut self, d_logits: &Tensor, rows: &Tensor) {
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
    pub(super) fn finish(self) -> Result<()> {
        match self.fresh {
            Some(g) => backward_from(&self.weight.view_as(self.weight), &g),
            None => Ok(()),
        }
    }
}

/// Cross-entropy of fp32 `logits` [n, vocab] against `targets` [n] (-100 = ignored), summed
/// over the rows, and its gradient times `grad_scale` (0-dim), computed in the logits' own
/// buffer: with m the row maximum and s = Σ exp(x − m), the loss of a row is m + ln s − x_t and
/// its gradient exp(x − m)/s − onehot(t) — what log-softmax + NLL and their backward compute,
/// without their two extra [n, vocab] tensors.
fn cross_entropy_in_place(
    logits: Tensor,
    targets: &Tensor,
    grad_scale: &Tensor,
) -> (Tensor, Tensor) {
    let kind = logits.kind();
    let valid = targets.ne(-100).to_kind(kind).unsqueeze(1);
    let target = targets.clamp_min(0).unsqueeze(1);
    let picked = logits.gather(1, &target, false);
    let max = logits.amax([1].as_slice(), true);
    let mut e = logits;
    let _ = e.g_sub_(&max).exp_();
    let sum = e.sum_dim_intlist([1].as_slice(), true, kind);
    let loss = ((&max + sum.log() - picked) * &valid).sum(kind);
    let _ = e.g_div_(&sum);
    let _ = e.scatter_add_(1, &target, &(-&valid));
    let _ = e.g_mul_(&(valid * grad_scale));
    (loss, e)
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

    #[test]
    fn every_parameter_name_has_a_unit() {
        assert_eq!(
            GradUnit::of_parameter("model.layers.12.mlp.up_proj.weight"),
            Some(GradUnit::Layer(12))
        );
        assert_eq!(
            GradUnit::of_parameter("lm_head.weight"),
            Some(GradUnit::LmHead)
        );
        assert_eq!(
            GradUnit::of_parameter("model.norm.weight"),
            Some(GradUnit::FinalNorm)
        );
        assert_eq!(
            GradUnit::of_parameter("model.embed_tokens.weight"),
            Some(GradUnit::Embedding)
        );
        assert_eq!(GradUnit::of_parameter("model.other"), None);
    }
}
