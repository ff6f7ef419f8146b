//! Tensor parallelism (`system.tensor_parallel` = T) as the model sees it: the operators
//! between a decoder half's matmuls and the residual stream, the vocabulary-parallel embedding
//! and the group's reductions of the cross-entropy — each the identity on one rank, so that one
//! training pass (backward.rs) and one LM head (head.rs) serve T = 1 and T > 1 (Megatron's
//! layout, as torchtitan applies it; each parameter's split and the group's collectives are
//! `split.rs`).
//!
//! ## The split
//! - q, k, v, gate and up are column-parallel: rank r holds rows [r·O/T, (r+1)·O/T) of the
//!   [O, hidden] weight (its heads and KV heads, its part of the FFN), so it computes its part of
//!   the output from the whole input.
//! - o and down are row-parallel: rank r holds columns [r·I/T, (r+1)·I/T) of the [hidden, I]
//!   weight, so from its part of the input it computes a partial sum of the whole output; the
//!   group adds the parts.
//! - The embedding and the LM head are vocabulary-parallel: rank r holds rows
//!   [r·Vp/T, (r+1)·Vp/T) of the vocabulary padded to Vp, a multiple of T (rows past the real
//!   vocabulary are zero, are never looked up, and their logits are -inf, so they get no
//!   probability and no gradient; checkpoints never see them).
//! - The RMSNorm weights are whole on every rank.
//!
//! ## Between the matmuls (per decoder half: attention, then the MLP)
//! A half is `out = x + g(B(f(norm(x))))`, B the rank's column- then row-parallel matmuls.
//! - With sequence parallelism the residual stream `x` and the norms are split along the tokens
//!   (rank r holds tokens [r·n/T, (r+1)·n/T) of the micro-batch's n, flattened batch-major):
//!   f is an all-gather of the normed tokens, g a reduce-scatter (sum) of the partial outputs.
//!   In backward their transposes: the gradient of f's output is reduce-scattered, the
//!   gradient of g's output all-gathered. The norm weights' gradients are partial sums then
//!   (each rank saw its tokens): the optimizer adds them across the group.
//! - Without it every rank holds every token: f is the identity forward and an all-reduce of
//!   the gradient backward; g an all-reduce forward and the identity backward. The norm weights'
//!   gradients are then equal on every rank.
//!
//! Per layer and micro-batch that is 2 all-gathers and 2 reduce-scatters forward and as many
//! backward (or 2 all-reduces each way), the same bytes either way; the full recomputation of
//! `activation_checkpointing = full` runs the forward's again (selective: the MLP half's).
//!
//! The backward is explicit, half by half (backward.rs): a split half keeps the graph of its
//! norm (from its input, a leaf) and of its matmuls (from the gathered input, a leaf), and the
//! collectives run between `backward_from` calls on the calling thread. No collective runs
//! inside libtorch's autograd engine. On one rank f and g are identities and a half's graph is
//! whole.
//!
//! ## The vocabulary-parallel cross-entropy (head.rs)
//! Per chunk of tokens: the rank's logits [c, Vp/T] (fp32); the row maxima all-gathered ([T, c],
//! their maximum is every rank's shift, `group_max`); Σ exp(logit − max) and the target's logit
//! (on the rank that holds it, 0 elsewhere) all-reduced together ([2, c], `group_sum`). Loss and
//! gradient (softmax − one-hot) are then the one-rank formulas on the rank's columns: no rank
//! holds a token's whole row of logits.

use anyhow::Result;
use tch::Tensor;

use super::llama::Llama;
use super::split::padded;
use super::units::wide;

impl Llama {
    /// The rows of the (padded) vocabulary this rank holds: its first row, and how many of
    /// them are real (from the shape: at zero stage 3 the embedding may hold no elements right
    /// now). One rank: all of them.
    pub(super) fn vocab_rows(&self) -> (i64, i64) {
        let Some(tp) = &self.tp else {
            return (0, self.shape.vocab_size as i64);
        };
        let local = (padded(self.shape.vocab_size, tp.size) / tp.size) as i64;
        let start = tp.rank as i64 * local;
        let real = (self.shape.vocab_size as i64 - start).clamp(0, local);
        (start, real)
    }

    /// The embedding of `tokens` [batch, seq] as this rank holds it, with history (for the
    /// embedding's backward): one rank's [batch, seq, hidden]; a split rank's partial rows
    /// [n, hidden] (its vocabulary rows looked up, zero for the tokens another rank holds),
    /// which `leave` sums over the group.
    pub(super) fn embed_local(&self, tokens: &Tensor) -> Tensor {
        if self.tp.is_none() {
            return self.embed(tokens);
        }
        let (start, real) = self.vocab_rows();
        let ids = tokens.reshape([-1]);
        let mine = ids.ge(start).logical_and(&ids.lt(start + real));
        let local = (&ids - start).where_self(&mine, &ids.zeros_like());
        let rows = Tensor::embedding(&self.embed_tokens, &local, -1, false, false);
        let kind = wide(self.compute());
        rows.to_kind(kind) * mine.to_kind(kind).unsqueeze(1)
    }

    /// f forward: every token of the micro-batch from this rank's (all-gathered with sequence
    /// parallelism); `t` itself otherwise.
    pub(super) fn enter(&self, t: &Tensor) -> Result<Tensor> {
        match &self.tp {
            Some(tp) => tp.enter(t),
            None => Ok(t.shallow_clone()),
        }
    }

    /// What a half's matmuls read of the normed tokens `normed` (wide): one rank's own, each
    /// matmul casting its copy to the compute dtype (as autocast; their gradients meet in
    /// fp32); a split rank's cast once to the compute dtype, which is what travels, and then
    /// `enter`ed.
    pub(super) fn matmul_input(&self, normed: &Tensor) -> Result<Tensor> {
        match &self.tp {
            Some(tp) => tp.enter(&normed.to_kind(self.compute())),
            None => Ok(normed.shallow_clone()),
        }
    }

    /// f backward: the gradient of this rank's tokens from that of all of them (reduced over
    /// the group); `grad` itself on one rank.
    pub(super) fn enter_grad(&self, grad: &Tensor) -> Result<Tensor> {
        match &self.tp {
            Some(tp) => tp.enter_grad(grad),
            None => Ok(grad.shallow_clone()),
        }
    }

    /// g forward: this rank's tokens of the group's sum of the partial outputs; `partial`
    /// itself (graph kept) on one rank.
    pub(super) fn leave(&self, partial: &Tensor) -> Result<Tensor> {
        match &self.tp {
            Some(tp) => tp.leave(partial),
            None => Ok(partial.shallow_clone()),
        }
    }

    /// g backward: the gradient of the partial output from that of this rank's tokens.
    pub(super) fn leave_grad(&self, grad: &Tensor) -> Result<Tensor> {
        match &self.tp {
            Some(tp) => tp.leave_grad(grad),
            None => Ok(grad.shallow_clone()),
        }
    }

    /// The maximum over the group of each rank's per-token maxima `local` [c].
    pub(super) fn group_max(&self, local: Tensor) -> Result<Tensor> {
        match &self.tp {
            Some(tp) => Ok(tp
                .comm(|c| c.all_gather(&local.unsqueeze(0)))?
                .amax([0].as_slice(), false)),
            None => Ok(local),
        }
    }

    /// The sums over the group of each rank's per-token `parts` (each [c], fp32), in one
    /// all-reduce.
    pub(super) fn group_sum<const N: usize>(&self, parts: [Tensor; N]) -> Result<[Tensor; N]> {
        let Some(tp) = &self.tp else {
            return Ok(parts);
        };
        let stats = Tensor::stack(&parts, 0);
        tp.comm(|c| c.all_reduce_sum(&stats))?;
        Ok(std::array::from_fn(|i| stats.get(i as i64)))
    }

    /// This rank's logits [c, Vp/T] (wide) of `rows` [c, hidden] (compute dtype) with the head
    /// weight `w` (compute dtype): the padded vocabulary's rows past the real ones are -inf.
    pub(super) fn vocab_logits(&self, rows: &Tensor, w: &Tensor) -> Tensor {
        let logits = rows.matmul(&w.tr()).to_kind(wide(self.compute()));
        let local = logits.size()[1];
        let (_, real) = self.vocab_rows();
        if real < local {
            let _ = logits
                .narrow(1, real, local - real)
                .fill_(f64::NEG_INFINITY);
        }
        logits
    }
}
