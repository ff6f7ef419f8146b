//! Tensor parallelism (`system.tensor_parallel` = T): the training pass of a model split among
//! the T ranks of a group (Megatron's layout, as torchtitan applies it; each parameter's split
//! and the group's collectives are `split.rs`).
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
//! The backward is explicit, half by half, like the rest of the training pass (backward.rs): a
//! half keeps the graph of its norm (from its input, a leaf) and of its matmuls (from the
//! gathered input, a leaf), and the collectives run between `backward_from` calls on the
//! calling thread. No collective runs inside libtorch's autograd engine.
//!
//! ## The vocabulary-parallel cross-entropy
//! Per chunk of tokens: the rank's logits [c, Vp/T] (fp32); the row maxima all-gathered ([T, c],
//! their maximum is every rank's shift); Σ exp(logit − max) and the target's logit (on the rank
//! that holds it, 0 elsewhere) all-reduced together ([2, c]). Loss and gradient
//! (softmax − one-hot) are then the one-rank formulas on the rank's columns: no rank holds a
//! token's whole row of logits.

use anyhow::Result;
use tch::{Kind, Tensor};

use super::autograd::{backward_from, grad_of, leaf};
use super::backward::HeadGradient;
use super::documents::DocumentMask;
use super::llama::{Layer, Llama};
use super::split::{padded, TensorParallel};
use super::units::{chunks, concat, GradUnit, UnitEvents};
use crate::sys::phase::{self, Phase};

/// Which decoder half.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Half {
    Attention,
    Mlp,
}

/// A half's graph kept for its backward: its input (a leaf) and normed output, the gathered
/// input of its matmuls (a leaf) and their partial output.
struct HalfGraph {
    half: Half,
    input: Tensor,
    normed: Tensor,
    gathered: Tensor,
    partial: Tensor,
}

/// What a split decoder layer keeps between its forward and its backward (as `Kept` in
/// backward.rs, per mode of `training.activation_checkpointing`).
enum KeptSplit {
    /// `none`: both halves' graphs.
    Graphs(HalfGraph, HalfGraph),
    /// `full`: the layer's input (this rank's tokens).
    Input(Tensor),
    /// `selective`: the attention half's graph and its output, the MLP half's input.
    Attention(HalfGraph, Tensor),
}

/// The micro-batch's rows: batch and sequence length.
#[derive(Clone, Copy)]
struct Rows {
    batch: i64,
    seq: i64,
}

impl Rows {
    /// The rows of token ids [batch, seq].
    fn of(tokens: &Tensor) -> Rows {
        let size = tokens.size();
        Rows {
            batch: size[0],
            seq: size[1],
        }
    }
}

impl Llama {
    fn split(&self) -> &TensorParallel {
        self.tp
            .as_ref()
            .expect("internal: a split pass of a whole model")
    }

    /// The rows of the (padded) vocabulary this rank holds, and how many of them are real
    /// (from the shape: at zero stage 3 the embedding may hold no elements right now).
    fn vocab_rows(&self) -> (i64, i64) {
        let tp = self.split();
        let local = (padded(self.shape.vocab_size, tp.size) / tp.size) as i64;
        let start = tp.rank as i64 * local;
        let real = (self.shape.vocab_size as i64 - start).clamp(0, local);
        (start, real)
    }

    /// The embedding's partial rows [n, hidden] (fp32): this rank's vocabulary rows looked up,
    /// zero for the tokens another rank holds. With history (for the embedding's backward).
    fn embed_partial(&self, tokens: &Tensor) -> Tensor {
        let (start, real) = self.vocab_rows();
        let ids = tokens.reshape([-1]);
        let mine = ids.ge(start).logical_and(&ids.lt(start + real));
        let local = (&ids - start).where_self(&mine, &ids.zeros_like());
        let rows = Tensor::embedding(&self.embed_tokens, &local, -1, false, false);
        rows.to_kind(Kind::Float) * mine.to_kind(Kind::Float).unsqueeze(1)
    }

    /// A half's matmuls on all the micro-batch's normed tokens [n, hidden]: the rank's partial
    /// output [n, hidden].
    fn half_matmuls(
        &self,
        half: Half,
        gathered: &Tensor,
        layer: &Layer,
        docs: Option<&DocumentMask>,
        rows: Rows,
    ) -> Result<Tensor> {
        let d = gathered.size()[1];
        Ok(match half {
            Half::Attention => {
                let h = gathered.view([rows.batch, rows.seq, d]);
                self.attention(&h, layer, docs)?.view([-1, d])
            }
            Half::Mlp => self.mlp(gathered, layer),
        })
    }

    fn half_norm<'a>(&self, half: Half, layer: &'a Layer) -> &'a Tensor {
        match half {
            Half::Attention => &layer.input_layernorm,
            Half::Mlp => &layer.post_attention_layernorm,
        }
    }

    /// Half `half` of layer `i` on this rank's tokens `x` [n_local, hidden] (no history):
    /// its output (no history), and with `graph` what its backward needs.
    fn half_forward(
        &self,
        half: Half,
        x: &Tensor,
        i: usize,
        docs: Option<&DocumentMask>,
        rows: Rows,
        graph: bool,
    ) -> Result<(Option<HalfGraph>, Tensor)> {
        let tp = self.split();
        let layer = &self.layers[i];
        let compute = self.compute();
        if !graph {
            return tch::no_grad(|| {
                let normed = self.rms_norm(x, self.half_norm(half, layer));
                let gathered = tp.enter(&normed.to_kind(compute))?;
                let partial = self.half_matmuls(half, &gathered, layer, docs, rows)?;
                Ok((None, x + tp.leave(&partial)?))
            });
        }
        let input = leaf(x);
        let normed = self
            .rms_norm(&input, self.half_norm(half, layer))
            .to_kind(compute);
        let gathered = leaf(&tp.enter(&normed.detach())?);
        let partial = self.half_matmuls(half, &gathered, layer, docs, rows)?;
        let out = x + tp.leave(&partial.detach())?;
        let kept = HalfGraph {
            half,
            input,
            normed,
            gathered,
            partial,
        };
        Ok((Some(kept), out))
    }

    /// A half's backward: the gradient w.r.t. its output in, w.r.t. its input out.
    fn half_backward(&self, g: HalfGraph, grad: &Tensor) -> Result<Tensor> {
        let tp = self.split();
        // In the partial output's dtype (the compute dtype): the cast one rank's autograd
        // makes too, before the gather rather than after it, so bf16 travels.
        let d_partial = tp.leave_grad(&grad.to_kind(g.partial.kind()))?;
        backward_from(&g.partial, &d_partial)?;
        if g.half == Half::Attention {
            // Context parallelism: the graph above ended at the attention output.
            self.finish_attention()?;
        }
        let d_normed = tp.enter_grad(&grad_of(&g.gathered)?)?;
        backward_from(&g.normed, &d_normed.to_kind(g.normed.kind()))?;
        Ok(grad_of(&g.input)? + grad)
    }

    fn layer_forward_split(
        &self,
        x: &Tensor,
        i: usize,
        docs: Option<&DocumentMask>,
        rows: Rows,
    ) -> Result<(KeptSplit, Tensor)> {
        use super::ActivationCheckpointing as Ac;
        Ok(match self.activation_memory().checkpointing {
            Ac::None => {
                let (a, mid) = self.half_forward(Half::Attention, x, i, docs, rows, true)?;
                let (m, out) = self.half_forward(Half::Mlp, &mid, i, docs, rows, true)?;
                (KeptSplit::Graphs(a.expect("graph"), m.expect("graph")), out)
            }
            Ac::Full => {
                let (_, mid) = self.half_forward(Half::Attention, x, i, docs, rows, false)?;
                let (_, out) = self.half_forward(Half::Mlp, &mid, i, docs, rows, false)?;
                (KeptSplit::Input(x.shallow_clone()), out)
            }
            Ac::Selective => {
                let (a, mid) = self.half_forward(Half::Attention, x, i, docs, rows, true)?;
                let (_, out) = self.half_forward(Half::Mlp, &mid, i, docs, rows, false)?;
                (KeptSplit::Attention(a.expect("graph"), mid), out)
            }
        })
    }

    fn layer_backward_split(
        &self,
        kept: KeptSplit,
        i: usize,
        grad: &Tensor,
        docs: Option<&DocumentMask>,
        rows: Rows,
    ) -> Result<Tensor> {
        let (attention, mlp) = match kept {
            KeptSplit::Graphs(a, m) => (a, m),
            KeptSplit::Input(x) => {
                let (a, mid) = self.half_forward(Half::Attention, &x, i, docs, rows, true)?;
                let (m, _) = self.half_forward(Half::Mlp, &mid, i, docs, rows, true)?;
                (a.expect("graph"), m.expect("graph"))
            }
            KeptSplit::Attention(a, mid) => {
                let (m, _) = self.half_forward(Half::Mlp, &mid, i, docs, rows, true)?;
                (a, m.expect("graph"))
            }
        };
        let grad = self.half_backward(mlp, grad)?;
        self.half_backward(attention, &grad)
    }

    /// [`Llama::forward_backward`] of a tensor-parallel rank: the same events, gradients of
    /// this rank's parts (the norm weights' partial with sequence parallelism, see the module
    /// docs), and the same loss on every rank of the group.
    pub(super) fn forward_backward_split(
        &self,
        inputs: &Tensor,
        targets: &Tensor,
        docs: Option<&DocumentMask>,
        loss_scale: f64,
        units: &mut dyn UnitEvents,
    ) -> Result<Tensor> {
        let tp = self.split();
        let rows = Rows::of(inputs);
        phase::enter(Phase::Forward);
        units.before(GradUnit::Embedding)?;
        let embedded = self.embed_partial(inputs);
        let mut x = tp.leave(&embedded.detach())?;
        units.after(GradUnit::Embedding)?;
        let mut kept = Vec::with_capacity(self.num_layers());
        for i in 0..self.num_layers() {
            units.before(GradUnit::Layer(i))?;
            let (k, out) = self.layer_forward_split(&x, i, docs, rows)?;
            units.after(GradUnit::Layer(i))?;
            kept.push(k);
            x = out;
        }

        let (loss, mut grad) = self.head_split(&x, targets, Some(loss_scale), units)?;

        for (i, k) in kept.into_iter().enumerate().rev() {
            phase::enter(Phase::Backward);
            units.before(GradUnit::Layer(i))?;
            grad = self.layer_backward_split(k, i, &grad, docs, rows)?;
            units.grads_final(GradUnit::Layer(i))?;
            units.after(GradUnit::Layer(i))?;
        }
        phase::enter(Phase::Backward);
        units.before(GradUnit::Embedding)?;
        backward_from(&embedded, &tp.leave_grad(&grad)?)?;
        units.grads_final(GradUnit::Embedding)?;
        units.after(GradUnit::Embedding)?;
        Ok(loss)
    }

    /// The mean loss of a tensor-parallel rank without gradients (validation): the same on
    /// every rank of the group.
    pub(super) fn loss_split(
        &self,
        inputs: &Tensor,
        targets: &Tensor,
        docs: Option<&DocumentMask>,
        units: &mut dyn UnitEvents,
    ) -> Result<Tensor> {
        let x = self.forward_split(inputs, docs, units)?;
        Ok(self.head_split(&x, targets, None, units)?.0)
    }

    /// The decoder stack of a tensor-parallel rank without gradients: this rank's tokens of the
    /// last layer's output (before the final norm).
    fn forward_split(
        &self,
        inputs: &Tensor,
        docs: Option<&DocumentMask>,
        units: &mut dyn UnitEvents,
    ) -> Result<Tensor> {
        let tp = self.split();
        let rows = Rows::of(inputs);
        tch::no_grad(|| -> Result<Tensor> {
            units.before(GradUnit::Embedding)?;
            let mut x = tp.leave(&self.embed_partial(inputs))?;
            units.after(GradUnit::Embedding)?;
            for i in 0..self.num_layers() {
                units.before(GradUnit::Layer(i))?;
                x = self
                    .half_forward(Half::Attention, &x, i, docs, rows, false)?
                    .1;
                x = self.half_forward(Half::Mlp, &x, i, docs, rows, false)?.1;
                units.after(GradUnit::Layer(i))?;
            }
            Ok(x)
        })
    }

    /// The cross-entropy (fp32 [k]) of the tokens at flat positions `counted` [k] of a
    /// tensor-parallel rank's pass over `inputs`, against their targets `picked` [k], without
    /// gradients: the same on every rank of the group (`Llama::row_log_likelihoods`).
    pub(super) fn token_losses_split(
        &self,
        inputs: &Tensor,
        counted: &Tensor,
        picked: &Tensor,
        units: &mut dyn UnitEvents,
    ) -> Result<Tensor> {
        let x = self.forward_split(inputs, None, units)?;
        let tp = self.split();
        units.before(GradUnit::FinalNorm)?;
        units.before(self.head_unit())?;
        let losses = tch::no_grad(|| -> Result<Tensor> {
            // Every token of the micro-batch on every rank of the group, then the counted ones.
            let hidden = tp.enter(&self.final_norm(&x))?.index_select(0, counted);
            let w = self.head_weight().to_kind(self.compute());
            let (start, real) = self.vocab_rows();
            let unused = Tensor::zeros([], (Kind::Float, x.device()));
            let mut parts = Vec::new();
            for (at, len) in chunks(hidden.size()[0], self.activation_memory().loss_chunk_tokens) {
                let rows = hidden.narrow(0, at, len).to_kind(self.compute());
                let mut logits = self.vocab_logits(&rows, &w, real);
                let t = picked.narrow(0, at, len);
                parts.push(
                    self.cross_entropy_split(&mut logits, &t, start, &unused, false)?
                        .0,
                );
            }
            Ok(concat(parts, x.device()))
        })?;
        units.after(self.head_unit())?;
        units.after(GradUnit::FinalNorm)?;
        Ok(losses)
    }

    /// This rank's fp32 logits [c, Vp/T] of `rows` [c, hidden] (compute dtype) with the head
    /// weight `w` (compute dtype): the padded vocabulary's rows past `real` are -inf.
    fn vocab_logits(&self, rows: &Tensor, w: &Tensor, real: i64) -> Tensor {
        let logits = rows.matmul(&w.tr()).to_kind(Kind::Float);
        let local = logits.size()[1];
        if real < local {
            let _ = logits
                .narrow(1, real, local - real)
                .fill_(f64::NEG_INFINITY);
        }
        logits
    }

    /// Final norm, vocabulary-parallel LM head and cross-entropy on this rank's tokens `x`
    /// (no history), chunk by chunk: the mean loss, and with `loss_scale` the backward too
    /// (the head weight's gradient accumulated, the gradient w.r.t. `x` returned; else an
    /// empty tensor).
    fn head_split(
        &self,
        x: &Tensor,
        targets: &Tensor,
        loss_scale: Option<f64>,
        units: &mut dyn UnitEvents,
    ) -> Result<(Tensor, Tensor)> {
        let tp = self.split();
        let train = loss_scale.is_some();
        units.before(GradUnit::FinalNorm)?;
        units.before(self.head_unit())?;
        let top = leaf(x);
        let normed = if train {
            self.final_norm(&top)
        } else {
            tch::no_grad(|| self.final_norm(x))
        };
        // All the micro-batch's tokens [n, hidden] (fp32), on every rank of the group.
        let hidden = tp.enter(&normed.detach())?;
        let targets = targets.reshape([-1]);
        let count = self.counted_targets(&targets)?;
        let share = self.gradient_share();
        let grad_scale = (loss_scale.unwrap_or(0.0) * share / &count).to_kind(Kind::Float);
        let weight = self.head_weight();
        let compute = self.compute();
        let (start, real) = self.vocab_rows();
        let grad_hidden = if train {
            hidden.zeros_like()
        } else {
            Tensor::empty([0], (Kind::Float, x.device()))
        };
        let mut head_grad = HeadGradient::new(weight, Kind::Float);
        let mut loss_sum = Tensor::zeros([], (Kind::Float, x.device()));
        tch::no_grad(|| -> Result<()> {
            let w = weight.to_kind(compute);
            for (at, len) in chunks(hidden.size()[0], self.activation_memory().loss_chunk_tokens) {
                phase::enter(Phase::Forward);
                let rows = hidden.narrow(0, at, len).to_kind(compute);
                let mut logits = self.vocab_logits(&rows, &w, real);
                let t = targets.narrow(0, at, len);
                let (losses, d_logits) =
                    self.cross_entropy_split(&mut logits, &t, start, &grad_scale, train)?;
                loss_sum += losses.sum(Kind::Float) / &count;
                if !train {
                    continue;
                }
                phase::enter(Phase::Backward);
                let d_logits = d_logits.to_kind(compute);
                grad_hidden.narrow(0, at, len).copy_(&d_logits.matmul(&w));
                head_grad.add(&d_logits, &rows);
            }
            Ok(())
        })?;
        let loss_sum = self.sequence_loss(loss_sum)?;
        if !train {
            units.after(self.head_unit())?;
            units.after(GradUnit::FinalNorm)?;
            return Ok((loss_sum, grad_hidden));
        }
        head_grad.finish()?;
        if !self.tied() {
            units.grads_final(GradUnit::LmHead)?;
        }
        units.after(self.head_unit())?;
        backward_from(&normed, &tp.enter_grad(&grad_hidden)?)?;
        units.grads_final(GradUnit::FinalNorm)?;
        units.after(GradUnit::FinalNorm)?;
        Ok((loss_sum, grad_of(&top)?))
    }

    /// The vocabulary-parallel cross-entropy of this rank's fp32 `logits` [c, Vp/T] (columns
    /// from vocabulary row `start`) against `targets` [c] (-100 ignored): each token's loss
    /// ([c], 0 where ignored), and with `train` its gradient times `grad_scale` in the logits'
    /// buffer.
    fn cross_entropy_split(
        &self,
        logits: &mut Tensor,
        targets: &Tensor,
        start: i64,
        grad_scale: &Tensor,
        train: bool,
    ) -> Result<(Tensor, Tensor)> {
        let tp = self.split();
        let local = logits.size()[1];
        let valid = targets.ne(-100).to_kind(Kind::Float);
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
        let maxima = tp.comm(|c| c.all_gather(&logits.amax([1].as_slice(), false).unsqueeze(0)))?;
        let max = maxima.amax([0].as_slice(), false);
        let _ = logits.g_sub_(&max.unsqueeze(1)).exp_();
        let stats = Tensor::stack(
            &[
                logits.sum_dim_intlist([1].as_slice(), false, Kind::Float),
                picked,
            ],
            0,
        );
        tp.comm(|c| c.all_reduce_sum(&stats))?;
        let (sum, picked) = (stats.get(0), stats.get(1));
        let loss = (&max + sum.log() - picked) * &valid;
        if !train {
            return Ok((loss, logits.shallow_clone()));
        }
        let _ = logits.g_div_(&sum.unsqueeze(1));
        let _ = logits.scatter_add_(1, &column, &(-here.to_kind(Kind::Float)).unsqueeze(1));
        let _ = logits.g_mul_(&(valid * grad_scale).unsqueeze(1));
        Ok((loss, logits.shallow_clone()))
    }
}
