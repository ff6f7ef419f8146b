//! Context parallelism (`system.context_parallel` = C): the C ranks of a group split every
//! sequence between them, so that a context whose activations do not fit on one rank trains.
//!
//! ## The split (Megatron's and PyTorch's load-balanced layout)
//! A sequence of s tokens is cut into 2C chunks of m = s / 2C tokens; rank i holds chunks i and
//! 2C−1−i, in that order: its 2m tokens (a rank's "local" tokens below). Under the causal
//! mask chunk j attends to j + 1 chunks' keys, so every rank gets (i + 1) + (2C − i) = 2C + 1
//! chunk-blocks of work: the same share. Everything but attention — the embedding, the norms,
//! the MLP, the LM head and the loss — runs on the local tokens alone, unchanged. RoPE rotates
//! each token for its position in the whole sequence (or in its document, with
//! `data.reset_position_ids`). The loss is the mean over the whole sequence's targets: each
//! rank divides its tokens' sum by the group's count, and the group adds the parts.
//!
//! ## Attention
//! Forward: the group all-gathers K and V ([2, batch, kv_heads, 2m, head_dim] per rank; kept
//! in the ranks' order, each chunk read where it lies), and each local query chunk j attends to
//! each key chunk 0..=j in one call of a fused attention kernel that also returns the
//! log-sum-exp of its rows (libtorch's flash attention on CPU, memory-efficient attention on
//! CUDA): the earlier chunks all visible (or within the same documents), its own causally. The
//! blocks are merged exactly as they come: lse = log(e^lse₁ + e^lse₂), out = Σ e^(lseᵢ −
//! lse)·outᵢ. A block is one chunk of keys, so what a call needs beyond the gathered K/V (on
//! CUDA, K and V repeated to the query heads with GQA) is chunk-sized, not sequence-sized.
//!
//! Backward: each block's kernel backward is called with the merged output and log-sum-exp,
//! which makes its dQ, dK and dV that block's exact share of the whole gradient (what ring
//! attention's backward does). dK and dV of the whole sequence are summed into one fp32 buffer
//! in the ranks' order and reduce-scattered to the ranks that hold those tokens; K and V are
//! gathered again rather than kept (a layer's graph then holds its local 2m tokens only, not the
//! group's s).
//!
//! Per layer and micro-batch: one all-gather forward, one all-gather and one reduce-scatter
//! backward, each (C − 1)/C · 2 · kv_heads · head_dim values per token; full recomputation
//! (`activation_checkpointing = full`) runs the forward's again.
//!
//! ## All-gather, not a ring
//! A ring passes K/V blocks to the next rank while computing on the current one, so the
//! exchange hides behind compute; the all-gather waits for it. With GQA the exchanged K/V are
//! small next to a layer's attention at long context — Llama-3.1-8B at 131,072 tokens, C = 8:
//! a rank receives 7 × 64 MiB of bf16 K/V per layer (~1.5 ms over NVLink at ~300 GB/s) for
//! ~18 TFLOP of attention forward (~45 ms at 400 TFLOP/s) — the all-gather is one NCCL call
//! instead of 2(C − 1) point-to-point ones, and it is the layout torchtitan uses today. The
//! block merge is the ring's, so a ring is a change of who sends what, not of the arithmetic.
//!
//! ## Where the explicit backward runs
//! The training pass (backward.rs, tensor_parallel.rs) goes backward a decoder layer (half) at
//! a time and runs no collective inside libtorch's autograd engine. Attention here is cut out of
//! the graph: its output is a leaf (so the graph above ends there), and what its backward needs
//! waits in `pending` until the layer's backward reaches it ([`ContextParallel::finish`]), which
//! then sends dQ, dK and dV on into the graph below (the projections, RoPE, the norm).

use std::sync::Mutex;

use anyhow::{Context, Result};
use tch::{Kind, Tensor};

use super::autograd::{backward_from_many, grad_of, leaf};
use super::documents::DocumentMask;
use super::split::TpComm;

/// This rank's place in its context-parallel group, and the group's collectives.
pub struct ContextParallel {
    pub rank: usize,
    pub size: usize,
    comm: Mutex<Box<dyn TpComm>>,
    /// The micro-batch in flight, as this rank holds it (set by [`ContextParallel::begin`]).
    batch: Mutex<Option<Chunks>>,
    /// Attention whose backward is still to run, the last layer's last.
    pending: Mutex<Vec<Segment>>,
}

/// The micro-batch in flight as this rank holds it.
struct Chunks {
    /// RoPE positions of this rank's tokens: [batch, 2m] int64.
    positions: Tensor,
    /// For each of this rank's two query chunks, what it sees of each key chunk: made once
    /// per micro-batch (with documents, its masks), read by every layer's forward and backward.
    visible: [Vec<(i64, Visible)>; 2],
}

/// One layer's attention between its forward and its backward.
struct Segment {
    /// Rotated queries [b, heads, 2m, hd], keys and values [b, kv_heads, 2m, hd]: the roots of
    /// the graph below attention.
    q: Tensor,
    k: Tensor,
    v: Tensor,
    /// The attention output [b, heads, 2m, hd] (compute dtype): a leaf, the end of the graph
    /// above.
    out: Tensor,
    /// Its rows' log-sum-exp [b, heads, 2m] fp32 (natural log, scores scaled by 1/√hd).
    lse: Tensor,
}

/// Which keys a block of queries sees.
pub(super) enum Visible {
    /// Every key (an earlier chunk, no documents).
    All,
    /// Query i sees keys 0..=i (a chunk against itself).
    Causal,
    /// [b, 1, m, n] bool, true where a query may see a key (documents).
    Mask(Tensor),
}

impl Visible {
    fn shallow_clone(&self) -> Visible {
        match self {
            Visible::All => Visible::All,
            Visible::Causal => Visible::Causal,
            Visible::Mask(m) => Visible::Mask(m.shallow_clone()),
        }
    }

    /// What query chunk `chunk` (m tokens) sees of each key chunk `0..=chunk`: every key of an
    /// earlier chunk, its own causally, and with documents (`doc_ids` [b, s], the document
    /// number of every token of the whole rows) only its documents' keys.
    pub(super) fn blocks(chunk: i64, m: i64, doc_ids: Option<&Tensor>) -> Vec<(i64, Visible)> {
        (0..=chunk)
            .map(|j| {
                let causal = j == chunk;
                match doc_ids {
                    None if causal => (j, Visible::Causal),
                    None => (j, Visible::All),
                    Some(ids) => {
                        let q = ids.narrow(1, chunk * m, m).unsqueeze(2);
                        let k = ids.narrow(1, j * m, m).unsqueeze(1);
                        let mut same = q.eq_tensor(&k);
                        if causal {
                            let tril = Tensor::ones([m, m], (Kind::Bool, ids.device())).tril(0);
                            same = same.logical_and(&tril);
                        }
                        (j, Visible::Mask(same.unsqueeze(1)))
                    }
                }
            })
            .collect()
    }
}

impl ContextParallel {
    pub fn new(rank: usize, size: usize, comm: Box<dyn TpComm>) -> Self {
        assert!(rank < size, "internal: CP rank {rank} of {size}");
        ContextParallel {
            rank,
            size,
            comm: Mutex::new(comm),
            batch: Mutex::new(None),
            pending: Mutex::new(Vec::new()),
        }
    }

    fn comm<T>(&self, f: impl FnOnce(&mut dyn TpComm) -> Result<T>) -> Result<T> {
        let mut c = self
            .comm
            .lock()
            .map_err(|_| anyhow::anyhow!("a context-parallel collective panicked earlier"))?;
        f(&mut **c)
    }

    /// The chunk of the sequence this rank's `half` (0 or 1) of its tokens is.
    fn chunk_of(&self, half: usize) -> i64 {
        if half == 0 {
            self.rank as i64
        } else {
            (2 * self.size - 1 - self.rank) as i64
        }
    }

    /// Where this rank's 2m tokens sit in a sequence of `seq`: [2m] int64.
    pub fn local_positions(&self, seq: i64) -> Tensor {
        let m = seq / (2 * self.size as i64);
        let starts = [self.chunk_of(0) * m, self.chunk_of(1) * m];
        let idx: Vec<i64> = starts.iter().flat_map(|&s| s..s + m).collect();
        Tensor::from_slice(&idx)
    }

    /// Starts a micro-batch: rows `inputs` and `targets` [b, s] (the group's same samples),
    /// `docs` their documents. Returns this rank's tokens of both, [b, 2m].
    pub(super) fn begin(
        &self,
        inputs: &Tensor,
        targets: &Tensor,
        docs: Option<&DocumentMask>,
    ) -> Result<(Tensor, Tensor)> {
        let seq = inputs.size()[1];
        let parts = 2 * self.size as i64;
        anyhow::ensure!(
            seq % parts == 0,
            "context parallelism over {} ranks cuts a sequence into {parts} chunks, and this \
             batch's rows have {seq} tokens (training.context_length must be a multiple of \
             {parts})",
            self.size
        );
        let device = inputs.device();
        let idx = self.local_positions(seq).to_device(device);
        let local = |t: &Tensor| t.index_select(1, &idx);
        let b = inputs.size()[0];
        let positions = match docs.and_then(DocumentMask::positions) {
            Some(p) => local(p),
            None => idx.unsqueeze(0).expand([b, -1], false).contiguous(),
        };
        let doc_ids = docs
            .filter(|d| d.masks_attention())
            .map(DocumentMask::doc_ids);
        let visible = [0, 1].map(|half| Visible::blocks(self.chunk_of(half), seq / parts, doc_ids));
        *self.lock_batch()? = Some(Chunks { positions, visible });
        self.lock_pending()?.clear();
        Ok((local(inputs), local(targets)))
    }

    /// Ends a training pass: every attention's backward has run.
    pub(super) fn end(&self) -> Result<()> {
        let left = self.lock_pending()?.len();
        anyhow::ensure!(
            left == 0,
            "internal: {left} context-parallel attention backward(s) never ran"
        );
        Ok(())
    }

    fn lock_batch(&self) -> Result<std::sync::MutexGuard<'_, Option<Chunks>>> {
        self.batch
            .lock()
            .map_err(|_| anyhow::anyhow!("context-parallel state poisoned by an earlier panic"))
    }

    fn lock_pending(&self) -> Result<std::sync::MutexGuard<'_, Vec<Segment>>> {
        self.pending
            .lock()
            .map_err(|_| anyhow::anyhow!("context-parallel state poisoned by an earlier panic"))
    }

    /// RoPE positions of this rank's tokens in the micro-batch in flight: [b, 2m] int64.
    pub(super) fn positions(&self) -> Result<Tensor> {
        let batch = self.lock_batch()?;
        let chunks = batch
            .as_ref()
            .context("internal: context-parallel attention outside a pass")?;
        Ok(chunks.positions.shallow_clone())
    }

    /// The group's sum of `t` (a per-rank count or partial loss), in place.
    pub(super) fn sum(&self, t: &Tensor) -> Result<Tensor> {
        let t = t.contiguous();
        self.comm(|c| c.all_reduce_sum(&t))?;
        Ok(t)
    }

    /// Attention of this rank's rotated queries `q` [b, heads, 2m, hd] over the group's keys and
    /// values (this rank's: `k`, `v` [b, kv_heads, 2m, hd]): [b, heads, 2m, hd] in q's dtype.
    /// When `q` has a graph the result is a leaf and the backward waits for [`Self::finish`].
    pub(super) fn attend(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
        let graph = q.requires_grad() || k.requires_grad() || v.requires_grad();
        let (out, lse) =
            tch::no_grad(|| self.attend_forward(&q.detach(), &k.detach(), &v.detach()))?;
        if !graph {
            return Ok(out);
        }
        let out = leaf(&out);
        self.lock_pending()?.push(Segment {
            q: q.shallow_clone(),
            k: k.shallow_clone(),
            v: v.shallow_clone(),
            out: out.shallow_clone(),
            lse,
        });
        Ok(out)
    }

    /// The group's K and V: [C, 2, b, kv_heads, 2m, hd], rank r's (k, v) at r (its chunks r and
    /// 2C−1−r), from this rank's `k`, `v` [b, kv_heads, 2m, hd].
    fn gather(&self, k: &Tensor, v: &Tensor) -> Result<Tensor> {
        let local = Tensor::stack(&[k, v], 0).contiguous();
        let all = self.comm(|c| c.all_gather(&local))?;
        let mut shape = vec![self.size as i64];
        shape.extend(local.size());
        Ok(all.view(shape.as_slice()))
    }

    /// Where chunk `j` of the sequence sits in the group's layout: its rank and which of the
    /// rank's two halves.
    fn owner(&self, j: i64) -> (i64, i64) {
        let c = self.size as i64;
        if j < c {
            (j, 0)
        } else {
            (2 * c - 1 - j, 1)
        }
    }

    /// Chunk `j`'s (k, v) [b, kv_heads, m, hd] each in the group's layout `kv` ([C, 2, b,
    /// kv_heads, 2m, hd]: the gathered K/V, or their gradients' buffer): views, no copies.
    fn chunk(&self, kv: &Tensor, j: i64, m: i64) -> (Tensor, Tensor) {
        let (rank, half) = self.owner(j);
        let at = kv.get(rank).narrow(3, half * m, m);
        (at.get(0), at.get(1))
    }

    /// What this rank's query chunk `half` (0 or 1) sees of each key chunk, as
    /// [`ContextParallel::begin`] made it for the micro-batch in flight.
    fn visible(&self, half: usize) -> Result<Vec<(i64, Visible)>> {
        let batch = self.lock_batch()?;
        let b = batch
            .as_ref()
            .context("internal: context-parallel attention outside a pass")?;
        Ok(b.visible[half]
            .iter()
            .map(|(j, v)| (*j, v.shallow_clone()))
            .collect())
    }

    /// The forward without a graph: the output [b, heads, 2m, hd] and its log-sum-exp
    /// [b, heads, 2m] fp32. Each local query chunk attends to each key chunk it sees in one
    /// kernel call, the calls merged as they come.
    fn attend_forward(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        let kv = self.gather(k, v)?;
        let m = q.size()[2] / 2;
        let (mut outs, mut lses) = (Vec::new(), Vec::new());
        for half in 0..2 {
            let qc = q.narrow(2, half as i64 * m, m);
            let mut merged: Option<(Tensor, Tensor)> = None;
            for (j, visible) in self.visible(half)? {
                let (kb, vb) = self.chunk(&kv, j, m);
                let (o, l) = kernel::forward(&qc, &kb, &vb, &visible)?;
                let o = o.to_kind(Kind::Float);
                merged = Some(match merged {
                    None => (o, l),
                    Some((o0, l0)) => merge(&o0, &l0, &o, &l),
                });
            }
            let (o, l) = merged.expect("a chunk sees at least itself");
            outs.push(o.to_kind(q.kind()));
            lses.push(l);
        }
        Ok((Tensor::cat(&outs, 2), Tensor::cat(&lses, 2)))
    }

    /// The backward of the latest attention whose forward kept a graph: its output's gradient
    /// (in the leaf) sent on into the graph below as dQ, dK, dV. Call it where that layer's
    /// backward has passed its attention output (after the graph above it).
    pub(super) fn finish(&self) -> Result<()> {
        let seg = self
            .lock_pending()?
            .pop()
            .context("internal: a context-parallel backward without its forward")?;
        let d_out = grad_of(&seg.out)?;
        let (q, k, v) = (seg.q.detach(), seg.k.detach(), seg.v.detach());
        let (dq, dk, dv) = tch::no_grad(|| self.attend_backward(&d_out, &q, &k, &v, &seg))?;
        backward_from_many(&[&seg.q, &seg.k, &seg.v], &[&dq, &dk, &dv])
    }

    fn attend_backward(
        &self,
        d_out: &Tensor,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        seg: &Segment,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let kv = self.gather(k, v)?;
        let m = q.size()[2] / 2;
        let out = seg.out.detach();
        // dK and dV of the whole sequence in the group's layout ([C, 2, b, kv_heads, 2m, hd]
        // fp32), so that the reduce-scatter hands each rank its own chunks' sums.
        let dkv = Tensor::zeros(kv.size(), (Kind::Float, q.device()));
        let mut dqs = Vec::with_capacity(2);
        for half in 0..2 {
            let at = half as i64 * m;
            let (qc, oc) = (q.narrow(2, at, m), out.narrow(2, at, m));
            let (gc, lc) = (d_out.narrow(2, at, m), seg.lse.narrow(2, at, m));
            let mut dq = Tensor::zeros(qc.size(), (Kind::Float, q.device()));
            for (j, visible) in self.visible(half)? {
                let (kb, vb) = self.chunk(&kv, j, m);
                let (dqb, dkb, dvb) = kernel::backward(&gc, &qc, &kb, &vb, &oc, &lc, &visible)?;
                dq += dqb.to_kind(Kind::Float);
                let (mut dk, mut dv) = self.chunk(&dkv, j, m);
                dk += dkb.to_kind(Kind::Float);
                dv += dvb.to_kind(Kind::Float);
            }
            dqs.push(dq);
        }
        let size = dkv.size();
        let flat: Vec<i64> = [size[0] * size[1]]
            .into_iter()
            .chain(size[2..].iter().copied())
            .collect();
        let mine = self.comm(|c| c.reduce_scatter(&dkv.view(flat.as_slice())))?;
        let dq = Tensor::cat(&dqs, 2).to_kind(q.kind());
        Ok((
            dq,
            mine.get(0).to_kind(k.kind()),
            mine.get(1).to_kind(v.kind()),
        ))
    }
}

/// Two blocks' outputs (fp32) and log-sum-exps merged into those of their union of keys. A
/// row that saw no key of a block has lse −∞ there and weighs 0 (its output, whatever the
/// kernel left, is not read); a row that saw no key of either stays at lse −∞, output 0.
pub(super) fn merge(o1: &Tensor, l1: &Tensor, o2: &Tensor, l2: &Tensor) -> (Tensor, Tensor) {
    let lse = l1.logaddexp(l2);
    let unseen = lse.isneginf();
    let shift = lse.masked_fill(&unseen, 0.0);
    let part = |o: &Tensor, l: &Tensor| {
        let w = (l - &shift).exp().unsqueeze(-1);
        o.masked_fill(&l.isneginf().unsqueeze(-1), 0.0) * w
    };
    (part(o1, l1) + part(o2, l2), lse)
}

/// One block's fused attention, forward (with the rows' log-sum-exp) and backward (given the
/// merged output and log-sum-exp), on the device's kernel: libtorch's flash attention on CPU
/// (which reads KV head h / group itself), memory-efficient attention on CUDA (whose keys and
/// values are repeated to the query heads, one chunk at a time, and their gradients summed
/// back).
pub(super) mod kernel {
    use anyhow::Result;
    use tch::{Kind, Tensor};

    use super::Visible;

    /// How many times each KV head is repeated for the kernel: the query heads per KV head on
    /// CUDA, 1 on CPU (whose kernel reads KV head h / group itself).
    fn gqa_repeat(q: &Tensor, k: &Tensor) -> i64 {
        if q.device().is_cuda() {
            q.size()[1] / k.size()[1]
        } else {
            1
        }
    }

    fn repeat(x: &Tensor, group: i64) -> Tensor {
        if group > 1 {
            x.repeat_interleave_self_int(group, 1, None)
        } else {
            x.shallow_clone()
        }
    }

    /// [b, heads, n, hd] → [b, kv_heads, n, hd]: the repeated heads' gradients summed.
    fn fold(x: &Tensor, group: i64) -> Tensor {
        if group == 1 {
            return x.shallow_clone();
        }
        let s = x.size();
        x.view([s[0], s[1] / group, group, s[2], s[3]])
            .sum_dim_intlist([2].as_slice(), false, x.kind())
    }

    /// What the kernels take for `visible` with queries `q` [b, heads, m, hd]: whether the block
    /// is causal, and a mask's additive bias in q's dtype (0 where visible, −∞ elsewhere),
    /// [b, 1, m, n] on CPU, expanded to [b, heads, m, n] on CUDA.
    fn causal_and_bias(visible: &Visible, q: &Tensor) -> (bool, Option<Tensor>) {
        match visible {
            Visible::All => (false, None),
            Visible::Causal => (true, None),
            Visible::Mask(mask) => {
                let bias = Tensor::zeros(mask.size(), (q.kind(), mask.device()))
                    .masked_fill(&mask.logical_not(), f64::NEG_INFINITY);
                let bias = if q.device().is_cuda() {
                    bias.expand([-1, q.size()[1], -1, -1], false)
                } else {
                    bias
                };
                (false, Some(bias))
            }
        }
    }

    fn failed(e: tch::TchError) -> anyhow::Error {
        anyhow::anyhow!("context-parallel attention kernel failed: {e}")
    }

    /// The output [b, heads, m, hd] (q's dtype) and log-sum-exp [b, heads, m] fp32 of `q` over
    /// the block `k`, `v` [b, kv_heads, n, hd].
    pub(in crate::model) fn forward(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        visible: &Visible,
    ) -> Result<(Tensor, Tensor)> {
        let group = gqa_repeat(q, k);
        let (k, v) = (repeat(k, group), repeat(v, group));
        let (causal, bias) = causal_and_bias(visible, q);
        let m = q.size()[2];
        let (out, lse) = if q.device().is_cuda() {
            let (out, lse, _, _) = Tensor::f_internal_scaled_dot_product_efficient_attention(
                q,
                &k,
                &v,
                bias.as_ref(),
                true,
                0.0,
                causal,
                None,
            )
            .map_err(failed)?;
            // The kernel pads the rows of its log-sum-exp to a multiple of 32.
            (out, lse.narrow(2, 0, m))
        } else {
            Tensor::f_internal_scaled_dot_product_flash_attention_for_cpu(
                q,
                &k,
                &v,
                0.0,
                causal,
                bias.as_ref(),
                None,
            )
            .map_err(failed)?
        };
        let mut lse = lse.to_kind(Kind::Float);
        if let Visible::Mask(m) = visible {
            // A row that sees no key of the block: the kernels give lse 0 and output 0; it
            // must weigh nothing in the merge.
            let seen = m.any_dim(-1, false);
            lse = lse.masked_fill(&seen.logical_not(), f64::NEG_INFINITY);
        }
        Ok((out, lse))
    }

    /// dQ [b, heads, m, hd], dK and dV [b, kv_heads, n, hd] of the block, from the gradient
    /// `d_out` of the merged output `out` [b, heads, m, hd] and its log-sum-exp `lse` [b, heads,
    /// m] fp32.
    pub(in crate::model) fn backward(
        d_out: &Tensor,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        out: &Tensor,
        lse: &Tensor,
        visible: &Visible,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let group = gqa_repeat(q, k);
        let (ke, ve) = (repeat(k, group), repeat(v, group));
        let (causal, bias) = causal_and_bias(visible, q);
        let d_out = d_out.to_kind(q.kind()).contiguous();
        let (dq, dk, dv) = if q.device().is_cuda() {
            let heads = q.size()[1];
            // [b, h, n, d] → [b, n, h, d], the kernel's layout; its log-sum-exp rows padded to
            // a multiple of 32 as its forward gives them.
            let t = |x: &Tensor| x.transpose(1, 2);
            let (m, n) = (q.size()[2], ke.size()[2]);
            let padded = (m + 31) / 32 * 32;
            let lse_p = Tensor::zeros([lse.size()[0], heads, padded], (Kind::Float, q.device()));
            lse_p.narrow(2, 0, m).copy_(lse);
            let seed = Tensor::zeros([], (Kind::Int64, q.device()));
            // The output must be [b, n, h, d] in memory, as the kernel's forward wrote it: its
            // fp16/bf16 kernels compute rowsum(dO ∘ O) themselves and read O with the row
            // stride h·d (`o_strideM()` is derived, not passed), whatever the tensor's strides
            // say. The merged output is [b, h, m, d]-contiguous, so its transpose alone was read
            // at the wrong rows: bf16 dq off by 0.78 on an H200 (fp32, where ATen computes that
            // sum from the real strides, was right).
            let out_t = t(out).contiguous();
            let (dq, dk, dv, _) = Tensor::f_internal_efficient_attention_backward(
                &t(&d_out),
                &t(q),
                &t(&ke),
                &t(&ve),
                bias.as_ref(),
                &out_t,
                None::<&Tensor>,
                None::<&Tensor>,
                m,
                n,
                &lse_p,
                0.0,
                &seed,
                &seed,
                i64::from(causal),
                false,
                None,
                None,
                None,
                false,
            )
            .map_err(failed)?;
            (t(&dq), t(&dk), t(&dv))
        } else {
            Tensor::f_internal_scaled_dot_product_flash_attention_for_cpu_backward(
                &d_out,
                q,
                &ke,
                &ve,
                out,
                lse,
                0.0,
                causal,
                bias.as_ref(),
                None,
            )
            .map_err(failed)?
        };
        Ok((dq, fold(&dk, group), fold(&dv, group)))
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tch::{Device, Kind, Tensor};

    use super::*;
    use crate::dist::{self, Backend, DistEnv, Place};
    use crate::train::tensor_parallel::GroupComm;

    const B: i64 = 2;
    const HEADS: i64 = 4;
    const KV: i64 = 2;
    const SEQ: i64 = 64;
    const HD: i64 = 16;

    /// q [B, HEADS, SEQ, HD], k, v [B, KV, SEQ, HD], the output's gradient, from a seeded
    /// generator of this test's own (not libtorch's global one).
    fn inputs() -> Vec<Vec<f32>> {
        let mut state = 42u64;
        let mut draw = |n: i64| -> Vec<f32> {
            (0..n)
                .map(|_| {
                    state = state
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    ((state >> 33) as f64 / (1u64 << 31) as f64 * 2.0 - 1.0) as f32
                })
                .collect()
        };
        let q = B * HEADS * SEQ * HD;
        let kv = B * KV * SEQ * HD;
        vec![draw(q), draw(kv), draw(kv), draw(q)]
    }

    fn tensor(v: &[f32], dims: [i64; 4]) -> Tensor {
        Tensor::from_slice(v).view(dims)
    }

    /// SDPA on the whole sequence (GQA, causal or within documents): the output and the
    /// gradients of q, k, v.
    fn whole(docs: Option<&DocumentMask>) -> [Tensor; 4] {
        let d = inputs();
        let q = tensor(&d[0], [B, HEADS, SEQ, HD]).set_requires_grad(true);
        let k = tensor(&d[1], [B, KV, SEQ, HD]).set_requires_grad(true);
        let v = tensor(&d[2], [B, KV, SEQ, HD]).set_requires_grad(true);
        let mask = docs.map(|d| d.attention_mask().shallow_clone());
        let out = Tensor::scaled_dot_product_attention(
            &q,
            &k,
            &v,
            mask.as_ref(),
            0.0,
            docs.is_none(),
            None,
            true,
        );
        (&out * tensor(&d[3], [B, HEADS, SEQ, HD]))
            .sum(Kind::Float)
            .backward();
        [out.detach(), q.grad(), k.grad(), v.grad()]
    }

    /// The same on C ranks: each rank's output and q, k, v gradients of its tokens.
    fn split(c: usize, pieces: Option<&[Vec<usize>]>) -> Vec<[Vec<f64>; 4]> {
        let port = dist::free_port();
        std::thread::scope(|s| {
            let handles: Vec<_> = (0..c)
                .map(|rank| {
                    s.spawn(move || {
                        let env = DistEnv {
                            place: Place {
                                rank,
                                world: c,
                                local_rank: rank,
                                local_world: c,
                            },
                            master_addr: "127.0.0.1".into(),
                            master_port: port,
                            agent_store: false,
                            restart_count: 0,
                            lockstep_launcher: false,
                            slurm: false,
                            note: None,
                        };
                        let mut pg =
                            dist::init(&env, Duration::from_secs(60), Backend::Ring).unwrap();
                        let members: Vec<usize> = (0..c).collect();
                        let group = pg.subgroup(&members, "cp").unwrap();
                        let comm =
                            GroupComm::new(std::sync::Arc::new(std::sync::Mutex::new(group)))
                                .unwrap();
                        let cp = ContextParallel::new(rank, c, Box::new(comm));
                        let docs = pieces.map(|p| DocumentMask::new(p, true, false, Device::Cpu));
                        let ids = Tensor::zeros([B, SEQ], (Kind::Int64, Device::Cpu));
                        let _local = cp.begin(&ids, &ids, docs.as_ref()).unwrap();
                        let idx = cp.local_positions(SEQ);
                        let d = inputs();
                        let local = |v: &[f32], h: i64| {
                            tensor(v, [B, h, SEQ, HD])
                                .index_select(2, &idx)
                                .set_requires_grad(true)
                        };
                        let (q, k, v) = (local(&d[0], HEADS), local(&d[1], KV), local(&d[2], KV));
                        let out = cp.attend(&q, &k, &v).unwrap();
                        let g = tensor(&d[3], [B, HEADS, SEQ, HD]).index_select(2, &idx);
                        (&out * g).sum(Kind::Float).backward();
                        cp.finish().unwrap();
                        cp.end().unwrap();
                        let plain = |t: &Tensor| {
                            Vec::<f64>::try_from(t.to_kind(Kind::Double).reshape(-1)).unwrap()
                        };
                        let result = [
                            plain(&out.detach()),
                            plain(&q.grad()),
                            plain(&k.grad()),
                            plain(&v.grad()),
                        ];
                        pg.barrier().unwrap();
                        result
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    fn check(c: usize, pieces: Option<&[Vec<usize>]>) {
        let docs = pieces.map(|p| DocumentMask::new(p, true, false, Device::Cpu));
        let want = whole(docs.as_ref());
        let runs = split(c, pieces);
        let names = ["output", "dq", "dk", "dv"];
        for (rank, run) in runs.iter().enumerate() {
            let cp = ContextParallel {
                rank,
                size: c,
                comm: Mutex::new(Box::new(NoComm)),
                batch: Mutex::new(None),
                pending: Mutex::new(Vec::new()),
            };
            let idx = cp.local_positions(SEQ);
            for (i, name) in names.iter().enumerate() {
                let w = want[i].index_select(2, &idx).to_kind(Kind::Double);
                let got = Tensor::from_slice(&run[i]).view(w.size().as_slice());
                let e = (&got - &w).norm().double_value(&[]) / w.norm().double_value(&[]);
                assert!(
                    e < 1e-6,
                    "C = {c}, rank {rank}, documents {}: {name} off by {e:e}",
                    pieces.is_some()
                );
            }
        }
    }

    /// No collectives: only for a rank's layout.
    struct NoComm;

    impl TpComm for NoComm {
        fn all_reduce_sum(&mut self, _: &Tensor) -> Result<()> {
            unreachable!()
        }
        fn all_gather(&mut self, _: &Tensor) -> Result<Tensor> {
            unreachable!()
        }
        fn reduce_scatter(&mut self, _: &Tensor) -> Result<Tensor> {
            unreachable!()
        }
    }

    #[test]
    fn zigzag_chunks_cover_the_sequence_once() {
        let c = 4;
        let mut seen = Vec::new();
        for rank in 0..c {
            let cp = ContextParallel::new(rank, c, Box::new(NoComm));
            let idx = Vec::<i64>::try_from(cp.local_positions(16)).unwrap();
            // Rank 1 of 4 holds chunks 1 and 6 of 8 (2 tokens each).
            if rank == 1 {
                assert_eq!(idx, [2, 3, 12, 13]);
            }
            seen.extend(idx);
        }
        seen.sort();
        assert_eq!(seen, (0..16).collect::<Vec<_>>());
    }

    /// Forward and backward of attention alone against SDPA on the whole sequence: every chunk
    /// edge, GQA, documents with boundaries on chunk edges (16 and 32 at C = 2, 8 and 40 at
    /// C = 4) and inside chunks, a document across several chunks.
    #[test]
    fn attention_over_the_group_equals_sdpa_on_the_whole_sequence() {
        let pieces = [vec![8, 8, 16, 8, 24], vec![3, 37, 24]];
        for c in [2, 4] {
            check(c, None);
            check(c, Some(&pieces));
        }
    }
}
