//! Forward and backward of one micro-batch, a decoder half at a time, on one rank and on a
//! tensor-parallel one alike (the group's operators are identities on one rank,
//! tensor_parallel.rs): activation checkpointing, the chunked LM head + cross-entropy
//! (head.rs), and a callback when a unit's gradients are final.
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
//! ## A decoder half's graph
//! A layer is two halves, `x + B(f(norm(x)))` each (attention, then the MLP; `Llama::half`).
//! On one rank a half's graph is whole, from its input (a leaf) to its output, and its backward
//! is one `backward_from`. On a tensor-parallel rank it is cut around the group's collectives:
//! the norm's graph from the input (a leaf), the matmuls' from the gathered tokens (a leaf),
//! and the residual added outside both; the collectives run between the two `backward_from`s.
//! Cutting one rank's layer at the half costs nothing: the gradient that reaches the middle
//! leaf is the one autograd would have carried there, summed in the same order, so every mode
//! below gives bitwise the gradients of one whole backward through the layer.
//!
//! ## What each mode keeps (per decoder layer, between the forward and its backward)
//! - `none`: both halves' graphs — every tensor the layer's ops save.
//! - `full`: the layer's input, [batch, seq, hidden] fp32. The layer runs forward without a
//!   graph and again, with one, during backward.
//! - `selective`: the attention half's graph (input RMSNorm's input and output, q/k/v after
//!   RoPE, the attention output and its log-sum-exp, the o_proj input) and the residual
//!   stream after it. The MLP half (post-attention RMSNorm, gate/up projections, SiLU, their
//!   product, the down projection) runs without a graph and again, with one, during backward.
//!   It keeps about a third of `none`'s tensors and recomputes no attention.
//!
//! ## Order of the units whose gradients become final ([`GradUnit`])
//! `LmHead` (untied only) → `FinalNorm` → `Layer(L-1)` → … → `Layer(0)` → `Embedding`. With
//! tied embeddings there is no `LmHead` unit: the LM head's gradient lands in
//! `model.embed_tokens.weight`, which is final only at `Embedding`.

use anyhow::Result;
use tch::Tensor;

use super::autograd::{backward_from, backward_from_many, grad_of, leaf};
use super::documents::DocumentMask;
use super::llama::{Half, Llama, Rows};
use super::moe::{RouteSummary, RouterLoss, Routing};
use super::units::{GradUnit, UnitEvents};
pub use crate::config::ActivationCheckpointing;
use crate::sys::phase::{self, Phase};

/// A decoder half's graph, kept for its backward.
enum HalfGraph {
    /// One rank: the whole graph, from the half's input (a leaf) to its output.
    Whole {
        half: Half,
        input: Tensor,
        output: Tensor,
        routing: Option<Routing>,
    },
    /// A tensor-parallel rank: the norm's graph from the input (a leaf) to the normed tokens,
    /// and the matmuls' from the tokens they read (gathered, a leaf) to the rank's partial
    /// output; the collectives between them and the residual are outside both.
    Cut {
        half: Half,
        input: Tensor,
        normed: Tensor,
        gathered: Tensor,
        partial: Tensor,
        routing: Option<Routing>,
    },
}

impl HalfGraph {
    /// A MoE half's routing, with its graph.
    fn routing(&self) -> Option<&Routing> {
        match self {
            HalfGraph::Whole { routing, .. } | HalfGraph::Cut { routing, .. } => routing.as_ref(),
        }
    }
}

/// What a decoder layer keeps between its forward and its backward
/// (`training.activation_checkpointing`).
enum Kept {
    /// `none`: both halves' graphs.
    Graphs(HalfGraph, HalfGraph),
    /// `full`: the layer's input (this rank's tokens).
    Input(Tensor),
    /// `selective`: the attention half's graph and its output, the MLP half's input.
    Attention(HalfGraph, Tensor),
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
    /// A tensor-parallel rank's gradients are those of its parts (the norm weights' partial
    /// sums with sequence parallelism, tensor_parallel.rs), its loss the group's. With context
    /// parallelism every rank of the group passes the same rows and computes on its chunks of
    /// them: the loss is the whole sequence's mean, and each rank's gradients are C times its
    /// tokens' part of that mean's, so that the group's mean is the gradient (as for
    /// data-parallel ranks, which the optimizer averages over together with them).
    pub fn forward_backward(
        &self,
        inputs: &Tensor,
        targets: &Tensor,
        docs: Option<&DocumentMask>,
        loss_scale: f64,
        units: &mut dyn UnitEvents,
    ) -> Result<Tensor> {
        let (inputs, targets, docs) = self.local_rows(inputs, targets, docs)?;
        let loss = self.forward_backward_local(&inputs, &targets, docs, loss_scale, units)?;
        if let Some(cp) = &self.cp {
            cp.end()?;
        }
        if let Some(ep) = &self.ep {
            ep.end()?;
        }
        Ok(loss)
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
        let rows = Rows::of(inputs);
        phase::enter(Phase::Forward);
        units.before(GradUnit::Embedding)?;
        let embedded = self.embed_local(inputs);
        let mut x = self.leave(&embedded.detach())?;
        units.after(GradUnit::Embedding)?;
        let mut kept = Vec::with_capacity(self.num_layers());
        let mut routes = Vec::new();
        for i in 0..self.num_layers() {
            units.before(GradUnit::Layer(i))?;
            let (k, out, routing) = self.layer_forward(&x, i, docs, rows)?;
            units.after(GradUnit::Layer(i))?;
            routes.extend(routing.map(|r| (i, r)));
            kept.push(k);
            x = out;
        }
        let router = self.router_loss(routes, loss_scale)?;

        let (loss, mut grad) = self.head_forward_backward(&x, targets, loss_scale, units)?;

        for (i, k) in kept.into_iter().enumerate().rev() {
            phase::enter(Phase::Backward);
            units.before(GradUnit::Layer(i))?;
            grad = self.layer_backward(k, i, &grad, docs, rows, router.as_ref())?;
            units.grads_final(GradUnit::Layer(i))?;
            units.after(GradUnit::Layer(i))?;
        }
        phase::enter(Phase::Backward);
        // The embedding's backward reads no weight, but its gradient must meet a parameter of
        // its full shape.
        units.before(GradUnit::Embedding)?;
        backward_from(&embedded, &self.leave_grad(&grad)?)?;
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

    /// A mixture of experts' auxiliary losses of this micro-batch from its MoE layers'
    /// routing (None for a dense model), logged for the trainer. Their gradients are scaled
    /// like the cross-entropy's (`loss_scale`, the context-parallel share), and by 1/T on a
    /// tensor-parallel rank: every rank of the group routes the same tokens, and the router's
    /// gradient is summed over the group (moe.rs).
    fn router_loss(
        &self,
        routes: Vec<(usize, RouteSummary)>,
        loss_scale: f64,
    ) -> Result<Option<RouterLoss>> {
        let Some(moe) = self.shape.moe.as_ref().filter(|_| !routes.is_empty()) else {
            return Ok(None);
        };
        let tp = self.tp.as_ref().map_or(1, |t| t.size) as f64;
        let scale = loss_scale * self.gradient_share() / tp;
        let global = |t: &Tensor| match &self.cp {
            Some(cp) => cp.sum(t),
            None => Ok(t.shallow_clone()),
        };
        let loss = RouterLoss::new(&routes, moe, self.router_z_loss(), scale, global)?;
        self.router_log().with(|log| log.add(&loss, &routes));
        Ok(Some(loss))
    }

    /// Layer `i`'s forward on this rank's residual stream `x` (no history): what it keeps for
    /// its backward, its output (no history), and a MoE layer's routing in sums.
    fn layer_forward(
        &self,
        x: &Tensor,
        i: usize,
        docs: Option<&DocumentMask>,
        rows: Rows,
    ) -> Result<(Kept, Tensor, Option<RouteSummary>)> {
        Ok(match self.activation_memory().checkpointing {
            ActivationCheckpointing::None => {
                let (a, mid) = self.half_forward(Half::Attention, x, i, docs, rows)?;
                let (m, out) = self.half_forward(Half::Mlp, &mid, i, docs, rows)?;
                let route = m.routing().map(Routing::summary);
                (Kept::Graphs(a, m), out, route)
            }
            ActivationCheckpointing::Full => {
                let (out, routing) = tch::no_grad(|| self.layer(x, i, docs, rows))?;
                let route = routing.as_ref().map(Routing::summary);
                (Kept::Input(x.shallow_clone()), out, route)
            }
            ActivationCheckpointing::Selective => {
                let (a, mid) = self.half_forward(Half::Attention, x, i, docs, rows)?;
                let (out, routing) = tch::no_grad(|| self.half(Half::Mlp, &mid, i, docs, rows))?;
                let route = routing.as_ref().map(Routing::summary);
                (Kept::Attention(a, mid), out, route)
            }
        })
    }

    /// Layer `i`'s backward: the gradient w.r.t. its output in, w.r.t. its input out; its
    /// parameters' gradients accumulate on the way (recomputing what was not kept), a MoE
    /// layer's with its part of the `router` losses.
    fn layer_backward(
        &self,
        kept: Kept,
        i: usize,
        grad: &Tensor,
        docs: Option<&DocumentMask>,
        rows: Rows,
        router: Option<&RouterLoss>,
    ) -> Result<Tensor> {
        let (attention, mlp) = match kept {
            Kept::Graphs(a, m) => (a, m),
            Kept::Input(x) => {
                let (a, mid) = self.half_forward(Half::Attention, &x, i, docs, rows)?;
                (a, self.half_forward(Half::Mlp, &mid, i, docs, rows)?.0)
            }
            Kept::Attention(a, mid) => (a, self.half_forward(Half::Mlp, &mid, i, docs, rows)?.0),
        };
        let grad = self.half_backward(mlp, grad, router)?;
        self.half_backward(attention, &grad, None)
    }

    /// Half `half` of layer `i` on this rank's tokens `x` (no history), with the graph its
    /// backward needs: that graph, and the half's output (no history).
    fn half_forward(
        &self,
        half: Half,
        x: &Tensor,
        i: usize,
        docs: Option<&DocumentMask>,
        rows: Rows,
    ) -> Result<(HalfGraph, Tensor)> {
        let input = leaf(x);
        // Expert parallelism cuts a MoE half's graph like tensor parallelism's (at the tokens
        // its matmuls read), so that the dispatch's backward joins it there.
        let dispatches = self.ep.is_some() && half == Half::Mlp && self.layers[i].mlp.is_moe();
        if self.tp.is_none() && !dispatches {
            let (output, routing) = self.half(half, &input, i, docs, rows)?;
            let next = output.detach();
            let graph = HalfGraph::Whole {
                half,
                input,
                output,
                routing,
            };
            return Ok((graph, next));
        }
        let layer = &self.layers[i];
        let normed = self.rms_norm(&input, self.half_norm(half, layer));
        let gathered = leaf(&self.matmul_input(&normed.detach())?);
        let (partial, routing) = self.half_matmuls(half, &gathered, layer, docs, rows)?;
        let next = x + self.leave(&partial.detach())?;
        let graph = HalfGraph::Cut {
            half,
            input,
            normed,
            gathered,
            partial,
            routing,
        };
        Ok((graph, next))
    }

    /// A half's backward: the gradient w.r.t. its output in, w.r.t. its input out; a MoE
    /// half's with its layer's term of the `router` losses. With context parallelism the
    /// attention half's graph ends at the attention output, and the attention's own
    /// backward (`finish_attention`) continues it from there.
    fn half_backward(
        &self,
        graph: HalfGraph,
        grad: &Tensor,
        router: Option<&RouterLoss>,
    ) -> Result<Tensor> {
        let term = match (graph.routing(), router) {
            (Some(r), Some(loss)) => Some(loss.term(r)),
            _ => None,
        };
        // Back-propagates the half's output (with the term beside it, a gradient of 1).
        let back = |root: &Tensor, grad: &Tensor| match &term {
            Some(t) => backward_from_many(&[root, t], &[grad, &t.ones_like()]),
            None => backward_from(root, grad),
        };
        match graph {
            HalfGraph::Whole {
                half,
                input,
                output,
                ..
            } => {
                back(&output, grad)?;
                if half == Half::Attention {
                    self.finish_attention()?;
                }
                grad_of(&input)
            }
            HalfGraph::Cut {
                half,
                input,
                normed,
                gathered,
                partial,
                routing,
            } => {
                // In the partial output's dtype (the compute dtype): the cast one rank's
                // autograd makes too, before the gather rather than after it, so bf16 travels.
                let d_partial = self.leave_grad(&grad.to_kind(partial.kind()))?;
                back(&partial, &d_partial)?;
                if half == Half::Attention {
                    self.finish_attention()?;
                }
                if let (Some(ep), Some(_)) = (&self.ep, routing) {
                    ep.finish()?;
                }
                let d_normed = self.enter_grad(&grad_of(&gathered)?)?;
                backward_from(&normed, &d_normed.to_kind(normed.kind()))?;
                Ok(grad_of(&input)? + grad)
            }
        }
    }
}
