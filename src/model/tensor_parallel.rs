//! Tensor parallelism (`system.tensor_parallel` = T): how every parameter is split among the T
//! ranks of a group ([`Split`]), and the training pass of a split model (Megatron's layout, as
//! torchtitan applies it).
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

use std::ops::Range;
use std::sync::Mutex;

use anyhow::Result;
use tch::{Kind, Tensor};

use super::backward::{backward_from, grad_of, leaf};
use super::documents::DocumentMask;
use super::llama::{Layer, Llama};
use super::units::{chunks, counted_targets, GradUnit, UnitEvents};
use crate::sys::phase::{self, Phase};

/// The collectives a tensor-parallel group runs for the model (implemented over a process
/// group by the trainer). Tensors are dense; every rank calls the same operations in the same
/// order with the same shapes.
pub trait TpComm: Send {
    /// In-place sum across the group.
    fn all_reduce_sum(&mut self, t: &Tensor) -> Result<()>;
    /// The group's tensors (each `t`'s shape) concatenated along dim 0 in rank order.
    fn all_gather(&mut self, t: &Tensor) -> Result<Tensor>;
    /// The sum across the group of `t` [T·m, ...], of which this rank keeps rows
    /// [rank·m, (rank+1)·m).
    fn reduce_scatter(&mut self, t: &Tensor) -> Result<Tensor>;
}

/// This rank's place in its tensor-parallel group, and the group's collectives.
pub struct TensorParallel {
    pub rank: usize,
    pub size: usize,
    /// `system.sequence_parallel`.
    pub sequence_parallel: bool,
    comm: Mutex<Box<dyn TpComm>>,
}

impl TensorParallel {
    pub fn new(rank: usize, size: usize, sequence_parallel: bool, comm: Box<dyn TpComm>) -> Self {
        assert!(rank < size, "internal: TP rank {rank} of {size}");
        TensorParallel {
            rank,
            size,
            sequence_parallel,
            comm: Mutex::new(comm),
        }
    }

    fn comm<T>(&self, f: impl FnOnce(&mut dyn TpComm) -> Result<T>) -> Result<T> {
        let mut c = self
            .comm
            .lock()
            .map_err(|_| anyhow::anyhow!("a tensor-parallel collective panicked earlier"))?;
        f(&mut **c)
    }

    /// f forward: the normed tokens a half's matmuls read (all of the micro-batch's).
    fn enter(&self, normed: &Tensor) -> Result<Tensor> {
        if self.sequence_parallel {
            self.comm(|c| c.all_gather(normed))
        } else {
            Ok(normed.shallow_clone())
        }
    }

    /// f backward: the gradient of this rank's normed tokens from that of all of them.
    fn enter_grad(&self, grad: &Tensor) -> Result<Tensor> {
        if self.sequence_parallel {
            self.comm(|c| c.reduce_scatter(grad))
        } else {
            self.comm(|c| c.all_reduce_sum(grad))?;
            Ok(grad.shallow_clone())
        }
    }

    /// g forward: this rank's tokens of the sum of the ranks' partial outputs.
    fn leave(&self, partial: &Tensor) -> Result<Tensor> {
        if self.sequence_parallel {
            self.comm(|c| c.reduce_scatter(partial))
        } else {
            let sum = partial.contiguous();
            self.comm(|c| c.all_reduce_sum(&sum))?;
            Ok(sum)
        }
    }

    /// g backward: the gradient of the partial output from that of this rank's tokens.
    fn leave_grad(&self, grad: &Tensor) -> Result<Tensor> {
        if self.sequence_parallel {
            self.comm(|c| c.all_gather(grad))
        } else {
            Ok(grad.shallow_clone())
        }
    }

    /// The rows of the micro-batch's `n` flattened tokens this rank holds between halves.
    pub fn tokens(&self, n: i64) -> Range<i64> {
        if self.sequence_parallel {
            let part = n / self.size as i64;
            self.rank as i64 * part..(self.rank as i64 + 1) * part
        } else {
            0..n
        }
    }
}

/// How one parameter is split among the ranks of a tensor-parallel group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Split {
    /// Whole on every rank (the RMSNorm weights).
    Replicated,
    /// Column-parallel linear: dim 0 (output features) cut in T.
    Rows,
    /// Row-parallel linear: dim 1 (input features) cut in T.
    Columns,
    /// Embedding and LM head: dim 0 (the vocabulary) padded to a multiple of T and cut.
    Vocab,
}

impl Split {
    /// The split of the parameter with this Hugging Face name.
    pub fn of(name: &str) -> Split {
        let leaf = name.trim_end_matches(".weight");
        let last = leaf.rsplit('.').next().unwrap_or(leaf);
        match last {
            "q_proj" | "k_proj" | "v_proj" | "gate_proj" | "up_proj" => Split::Rows,
            "o_proj" | "down_proj" => Split::Columns,
            "embed_tokens" | "lm_head" => Split::Vocab,
            _ => Split::Replicated,
        }
    }

    /// The dimension cut, if any.
    pub fn dim(self) -> Option<usize> {
        match self {
            Split::Replicated => None,
            Split::Rows | Split::Vocab => Some(0),
            Split::Columns => Some(1),
        }
    }

    /// A rank's shape of a parameter of shape `full` in a group of `size`.
    pub fn local_shape(self, full: &[i64], size: usize) -> Vec<i64> {
        let mut shape = full.to_vec();
        if let Some(d) = self.dim() {
            let n = if self == Split::Vocab {
                padded(full[d] as usize, size) as i64
            } else {
                full[d]
            };
            shape[d] = n / size as i64;
        }
        shape
    }

    /// Rank `rank`'s part of the whole parameter `full` (a copy; padding rows zero).
    pub fn shard(self, full: &Tensor, rank: usize, size: usize) -> Tensor {
        let Some(d) = self.dim() else {
            return full.copy();
        };
        let local = self.local_shape(&full.size(), size)[d];
        let start = rank as i64 * local;
        let have = (full.size()[d] - start).clamp(0, local);
        let out = Tensor::zeros(
            self.local_shape(&full.size(), size),
            (full.kind(), full.device()),
        );
        if have > 0 {
            tch::no_grad(|| {
                out.narrow(d as i64, 0, have)
                    .copy_(&full.narrow(d as i64, start, have))
            });
        }
        out
    }

    /// The whole parameter of shape `full` from every rank's part, in rank order (the
    /// vocabulary's padding dropped).
    pub fn unshard(self, parts: &[Tensor], full: &[i64]) -> Tensor {
        match self.dim() {
            None => parts[0].copy(),
            Some(d) => Tensor::cat(parts, d as i64).narrow(d as i64, 0, full[d]),
        }
    }
}

/// Between a part's elements and the whole parameter's (both flattened): what checkpoints,
/// which hold whole parameters, need from a tensor-parallel rank.
impl Split {
    /// Elements `range` of part `rank` of `size` of a parameter of shape `full`, read from the
    /// whole through `read` (a range of the whole's flattened elements, 1-D): one read of the
    /// contiguous elements that hold them (whole rows of a row-parallel weight), cut down.
    /// Elements of the vocabulary's padding are zero.
    pub fn read_part(
        self,
        full: &[i64],
        (rank, size): (usize, usize),
        range: &Range<usize>,
        read: impl FnOnce(Range<usize>) -> Result<Tensor>,
    ) -> Result<Tensor> {
        let numel = full.iter().product::<i64>() as usize;
        match self {
            Split::Replicated => read(range.clone()),
            Split::Rows | Split::Vocab => {
                let part = self.local_shape(full, size).iter().product::<i64>() as usize;
                let start = rank * part;
                let whole = (start + range.start).min(numel)..(start + range.end).min(numel);
                let have = whole.len();
                let values = if have > 0 {
                    read(whole)?
                } else {
                    Tensor::zeros([0], (Kind::Float, tch::Device::Cpu))
                };
                if have == range.len() {
                    return Ok(values);
                }
                let out = Tensor::zeros([range.len() as i64], (values.kind(), values.device()));
                if have > 0 {
                    tch::no_grad(|| out.narrow(0, 0, have as i64).copy_(&values));
                }
                Ok(out)
            }
            Split::Columns => {
                let (cols, width) = (full[1] as usize, full[1] as usize / size);
                let rows = range.start / width..range.end.div_ceil(width);
                let values = read(rows.start * cols..rows.end * cols)?;
                let mine = values
                    .view([rows.len() as i64, cols as i64])
                    .narrow(1, (rank * width) as i64, width as i64)
                    .reshape(-1);
                let at = (range.start - rows.start * width) as i64;
                Ok(mine.narrow(0, at, range.len() as i64))
            }
        }
    }

    /// Elements `range` of the parts of a parameter of shape `full` as pieces of the whole
    /// (flattened): (range of the whole, values). `parts` holds (rank, its elements `range`,
    /// 1-D) for one part of a row- or vocabulary-split weight or a whole one, and for every
    /// part of a column-split weight (whose rows interleave the parts). Padding is dropped;
    /// adjacent elements make one piece.
    pub fn whole_pieces(
        self,
        full: &[i64],
        size: usize,
        range: &Range<usize>,
        parts: &[(usize, Tensor)],
    ) -> Vec<(Range<usize>, Tensor)> {
        let numel = full.iter().product::<i64>() as usize;
        match self {
            Split::Replicated => vec![(range.clone(), parts[0].1.shallow_clone())],
            Split::Rows | Split::Vocab => {
                let part = self.local_shape(full, size).iter().product::<i64>() as usize;
                parts
                    .iter()
                    .filter_map(|(rank, values)| {
                        let start = rank * part;
                        let end = (start + range.end).min(numel);
                        let begin = (start + range.start).min(end);
                        (begin < end)
                            .then(|| (begin..end, values.narrow(0, 0, (end - begin) as i64)))
                    })
                    .collect()
            }
            Split::Columns => {
                assert_eq!(parts.len(), size, "internal: every part of a column split");
                let (cols, width) = (full[1] as usize, full[1] as usize / size);
                let rows = range.start / width..range.end.div_ceil(width);
                let n = rows.len();
                // [rows, size, width] = [rows, cols]: the whole rows the range touches.
                let whole = Tensor::zeros(
                    [n as i64, size as i64, width as i64],
                    (parts[0].1.kind(), parts[0].1.device()),
                );
                let at = (range.start - rows.start * width) as i64;
                tch::no_grad(|| {
                    for (rank, values) in parts {
                        let local =
                            Tensor::zeros([(n * width) as i64], (values.kind(), values.device()));
                        local.narrow(0, at, range.len() as i64).copy_(values);
                        whole
                            .select(1, *rank as i64)
                            .copy_(&local.view([n as i64, width as i64]));
                    }
                });
                let flat = whole.view([-1]);
                // Runs of covered elements: the first and last rows may be partly covered
                // (each part's columns from/to the range's offset), the rows between whole.
                let (first, last) = (range.start % width, (range.end - 1) % width + 1);
                let mut runs: Vec<Range<usize>> = Vec::new();
                for r in 0..n {
                    for rank in 0..size {
                        let from = if r == 0 { first } else { 0 };
                        let to = if r == n - 1 { last } else { width };
                        let s = r * cols + rank * width + from;
                        let e = r * cols + rank * width + to;
                        match runs.last_mut() {
                            Some(run) if run.end == s => run.end = e,
                            _ => runs.push(s..e),
                        }
                    }
                }
                let base = rows.start * cols;
                runs.into_iter()
                    .map(|run| {
                        let values = flat.narrow(0, run.start as i64, run.len() as i64);
                        (base + run.start..base + run.end, values)
                    })
                    .collect()
            }
        }
    }
}

/// The vocabulary (or any dim-0 size) padded up to a multiple of `size`.
pub fn padded(n: usize, size: usize) -> usize {
    n.div_ceil(size) * size
}

/// Which decoder half.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Half {
    Attention,
    Mlp,
}

/// A half's graph kept for its backward: its input (a leaf) and normed output, the gathered
/// input of its matmuls (a leaf) and their partial output.
struct HalfGraph {
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
    ) -> Tensor {
        let d = gathered.size()[1];
        match half {
            Half::Attention => {
                let h = gathered.view([rows.batch, rows.seq, d]);
                self.attention(&h, layer, docs).view([-1, d])
            }
            Half::Mlp => self.mlp(gathered, layer),
        }
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
                let partial = self.half_matmuls(half, &gathered, layer, docs, rows);
                Ok((None, x + tp.leave(&partial)?))
            });
        }
        let input = leaf(x);
        let normed = self
            .rms_norm(&input, self.half_norm(half, layer))
            .to_kind(compute);
        let gathered = leaf(&tp.enter(&normed.detach())?);
        let partial = self.half_matmuls(half, &gathered, layer, docs, rows);
        let out = x + tp.leave(&partial.detach())?;
        let kept = HalfGraph {
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
        let size = inputs.size();
        let rows = Rows {
            batch: size[0],
            seq: size[1],
        };
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
        let tp = self.split();
        let size = inputs.size();
        let rows = Rows {
            batch: size[0],
            seq: size[1],
        };
        let x = tch::no_grad(|| -> Result<Tensor> {
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
        })?;
        Ok(self.head_split(&x, targets, None, units)?.0)
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
        let count = counted_targets(&targets);
        let grad_scale = (loss_scale.unwrap_or(0.0) / &count).to_kind(Kind::Float);
        let weight = self.head_weight();
        let compute = self.compute();
        let (start, real) = self.vocab_rows();
        let grad_hidden = if train {
            hidden.zeros_like()
        } else {
            Tensor::empty([0], (Kind::Float, x.device()))
        };
        let mut fresh: Option<Tensor> = None;
        let mut loss_sum = Tensor::zeros([], (Kind::Float, x.device()));
        tch::no_grad(|| -> Result<()> {
            let w = weight.to_kind(compute);
            for (at, len) in chunks(hidden.size()[0], self.activation_memory().loss_chunk_tokens) {
                phase::enter(Phase::Forward);
                let rows = hidden.narrow(0, at, len).to_kind(compute);
                let mut logits = rows.matmul(&w.tr()).to_kind(Kind::Float);
                let local = logits.size()[1];
                if real < local {
                    let _ = logits
                        .narrow(1, real, local - real)
                        .fill_(f64::NEG_INFINITY);
                }
                let t = targets.narrow(0, at, len);
                let (sum, d_logits) =
                    self.cross_entropy_split(&mut logits, &t, start, &grad_scale, train)?;
                loss_sum += sum / &count;
                if !train {
                    continue;
                }
                phase::enter(Phase::Backward);
                let d_logits = d_logits.to_kind(compute);
                grad_hidden.narrow(0, at, len).copy_(&d_logits.matmul(&w));
                let accumulated = weight.grad();
                let into = if accumulated.defined() {
                    Some(accumulated)
                } else {
                    fresh.as_ref().map(Tensor::shallow_clone)
                };
                match into {
                    Some(mut g) if compute == Kind::Float => {
                        let _ = g.addmm_(&d_logits.tr(), &rows);
                    }
                    Some(mut g) => g += d_logits.tr().matmul(&rows),
                    None => fresh = Some(d_logits.tr().matmul(&rows).to_kind(Kind::Float)),
                }
            }
            Ok(())
        })?;
        if !train {
            units.after(self.head_unit())?;
            units.after(GradUnit::FinalNorm)?;
            return Ok((loss_sum, grad_hidden));
        }
        if let Some(g) = fresh {
            backward_from(&weight.view_as(weight), &g)?;
        }
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
    /// from vocabulary row `start`) against `targets` [c] (-100 ignored): the summed loss of
    /// the chunk, and with `train` its gradient times `grad_scale` in the logits' buffer.
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
        let loss = ((&max + sum.log() - picked) * &valid).sum(Kind::Float);
        if !train {
            return Ok((loss, logits.shallow_clone()));
        }
        let _ = logits.g_div_(&sum.unsqueeze(1));
        let _ = logits.scatter_add_(1, &column, &(-here.to_kind(Kind::Float)).unsqueeze(1));
        let _ = logits.g_mul_(&(valid * grad_scale).unsqueeze(1));
        Ok((loss, logits.shallow_clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_parameter_has_its_split() {
        for (name, split) in [
            ("model.layers.3.self_attn.q_proj.weight", Split::Rows),
            ("model.layers.3.self_attn.k_proj.weight", Split::Rows),
            ("model.layers.3.self_attn.v_proj.weight", Split::Rows),
            ("model.layers.3.self_attn.o_proj.weight", Split::Columns),
            ("model.layers.3.mlp.gate_proj.weight", Split::Rows),
            ("model.layers.3.mlp.up_proj.weight", Split::Rows),
            ("model.layers.3.mlp.down_proj.weight", Split::Columns),
            ("model.layers.3.input_layernorm.weight", Split::Replicated),
            ("model.norm.weight", Split::Replicated),
            ("model.embed_tokens.weight", Split::Vocab),
            ("lm_head.weight", Split::Vocab),
        ] {
            assert_eq!(Split::of(name), split, "{name}");
        }
    }

    /// Any range of any part, written as pieces of the whole and read back through the whole,
    /// is itself; a column split's pieces are few (whole rows merge) and cover only the range.
    #[test]
    fn parts_map_to_pieces_of_the_whole_and_back() {
        let opts = (Kind::Float, tch::Device::Cpu);
        for (split, full) in [
            (Split::Rows, vec![8i64, 6]),
            (Split::Vocab, vec![7, 6]),
            (Split::Columns, vec![5, 8]),
            (Split::Replicated, vec![6]),
        ] {
            let whole = Tensor::arange(full.iter().product::<i64>(), opts).view(full.as_slice());
            let size = 4;
            let parts: Vec<Tensor> = (0..size).map(|r| split.shard(&whole, r, size)).collect();
            let part_len = parts[0].numel();
            for range in [0..part_len, 1..part_len - 1, 3..5, 2..3] {
                let slices: Vec<(usize, Tensor)> = (0..size)
                    .map(|r| {
                        (
                            r,
                            parts[r]
                                .reshape(-1)
                                .narrow(0, range.start as i64, range.len() as i64),
                        )
                    })
                    .collect();
                let written = if split == Split::Columns {
                    split.whole_pieces(&full, size, &range, &slices)
                } else {
                    slices
                        .iter()
                        .flat_map(|s| {
                            split.whole_pieces(&full, size, &range, std::slice::from_ref(s))
                        })
                        .collect()
                };
                let flat = whole.reshape(-1);
                for (at, values) in &written {
                    let want = flat.narrow(0, at.start as i64, at.len() as i64);
                    assert!(values.equal(&want), "{split:?} {range:?}: piece {at:?}");
                }
                if split == Split::Columns {
                    assert!(
                        written.len() <= 2 * size + 1,
                        "{split:?} {range:?}: {}",
                        written.len()
                    );
                }
                for (r, slice) in slices.iter().enumerate() {
                    let read = split
                        .read_part(&full, (r, size), &range, |w| {
                            Ok(flat.narrow(0, w.start as i64, w.len() as i64))
                        })
                        .unwrap();
                    assert!(read.equal(&slice.1), "{split:?} part {r} {range:?}");
                }
            }
        }
    }

    #[test]
    fn shards_round_trip_and_the_vocabulary_is_padded_inside_only() {
        let full = Tensor::arange(7 * 3, (Kind::Float, tch::Device::Cpu)).view([7, 3]);
        for split in [Split::Vocab, Split::Rows, Split::Columns, Split::Replicated] {
            let full = if split == Split::Columns {
                full.tr().contiguous()
            } else {
                full.shallow_clone()
            };
            if split == Split::Rows || split == Split::Columns {
                // Rows and columns split evenly: a 7 does not divide, use 6 of them.
                let f = full.narrow(split.dim().unwrap() as i64, 0, 6);
                let parts: Vec<Tensor> = (0..3).map(|r| split.shard(&f, r, 3)).collect();
                assert_eq!(parts[1].size(), split.local_shape(&f.size(), 3));
                assert!(split.unshard(&parts, &f.size()).equal(&f), "{split:?}");
                continue;
            }
            let parts: Vec<Tensor> = (0..4).map(|r| split.shard(&full, r, 4)).collect();
            if split == Split::Vocab {
                assert_eq!(parts[0].size(), [2, 3], "7 rows padded to 8, 2 a rank");
                assert_eq!(
                    parts[3].get(1).abs().sum(Kind::Float).double_value(&[]),
                    0.0
                );
            }
            assert!(
                split.unshard(&parts, &full.size()).equal(&full),
                "{split:?}"
            );
        }
    }
}
