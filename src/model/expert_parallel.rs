//! Expert parallelism (`system.expert_parallel` = P): every MoE layer's E experts are split
//! among the P ranks of an expert-parallel group (consecutive replicas of the mesh, carved
//! out of the data dimension as torchtitan's dp2ep does), rank p holding experts
//! [p·E/P, (p+1)·E/P) — its "local" experts. Attention, the router and the dense layers stay
//! whole on every rank; each rank routes its own tokens and the tokens travel to their
//! experts' ranks and back by all-to-all (dropless: no capacity, no token dropped).
//!
//! ## One MoE layer's forward on n tokens [n, hidden] with k choices each
//! - route locally (moe.rs): weights [n, k] fp32, choices [n, k], counts [E] (host).
//! - the n·k slots sorted by expert (a stable sort): `send` [n·k, hidden], the tokens in that
//!   order, so the rows for rank q are one contiguous block (q's experts are contiguous).
//! - counts first: an all-to-all of the counts [E] int64 (each rank sends rank q the counts
//!   of q's experts, [E/P]) gives `from` [P, E/P] (host): the rows each source sends each
//!   local expert. Then the payload: `received` [R, hidden], R = Σ from, by source and,
//!   within a source, by expert.
//! - `grouped` [R, hidden]: `received` reordered by local expert (then source), so that each
//!   local expert's rows are one block multiplied by its matrices at once; its outputs back in
//!   `received`'s order (`out` [R, hidden], compute dtype).
//! - the reverse all-to-all: `returned` [n·k, hidden], in `send`'s order; scaled by the slots'
//!   weights and summed into their tokens (`index_add`, fp32) as on one rank.
//!
//! ## Backward (explicit, outside libtorch's autograd engine, like tensor and context
//! parallelism)
//! The MoE half's graph is cut at two leaves, `returned` and `received`: the half's backward
//! ends at them (and at the router, through the weights), and what the rest needs waits in
//! `pending` until [`ExpertParallel::finish`]: dReturned goes to the experts' ranks by the
//! dispatch's all-to-all, back through the experts (their gradients accumulate: a local
//! expert's gradient covers every token the group routed to it), dReceived returns by the
//! reverse all-to-all, and the graph of `send` carries it into the layer's input.
//!
//! Per MoE layer and micro-batch: 3 all-to-alls forward (counts, tokens, outputs) and 2
//! backward, each of n·k rows of hidden values (P−1)/P of which leave the rank on average;
//! full recomputation (`activation_checkpointing = full` or `selective`) runs the forward's
//! again.
//!
//! ## With tensor parallelism
//! The group is P replicas of one tensor index, and each local expert is this rank's width
//! part of it (moe.rs): the ranks of a tensor group route the same tokens, each exchanges them
//! within its own tensor index's group and computes its part of the experts on what arrives,
//! so `returned` is a partial output that the tensor group sums with the half's (its `g`).
//! Nothing here changes: the exchange moves whole hidden rows either way.
//!
//! ## Gradients
//! A local expert's gradient on rank p sums over the tokens of the whole group, each scaled
//! as its own rank's loss is; the trainer averages it over the ranks that hold the same
//! experts (the same position in every expert-parallel group) and divides by P, so that,
//! as for every other parameter, the step's gradient is the mean over all replicas' losses.

use std::sync::Mutex;

use anyhow::{Context, Result};
use tch::{Kind, Tensor};

use super::autograd::{backward_from, leaf};
use super::split::TpComm;
use super::swiglu::{Linear, SwiGlu};

/// This rank's place in its expert-parallel group, and the group's collectives.
pub struct ExpertParallel {
    pub rank: usize,
    pub size: usize,
    comm: Mutex<Box<dyn TpComm>>,
    /// Dispatches whose backward is still to run, the last layer's last.
    pending: Mutex<Vec<Dispatch>>,
}

/// One MoE layer's exchange between its forward and its backward.
struct Dispatch {
    /// [n·k, hidden]: the tokens sent, with the graph from the layer's input.
    send: Tensor,
    /// [R, hidden]: what arrived, a leaf (the start of the experts' graph).
    received: Tensor,
    /// [R, hidden]: the local experts' outputs in `received`'s order, with their graph.
    out: Tensor,
    /// [n·k, hidden]: the outputs back in `send`'s order, a leaf (the combine's input).
    returned: Tensor,
    /// Rows sent to each rank and received from each rank.
    send_rows: Vec<usize>,
    recv_rows: Vec<usize>,
}

impl ExpertParallel {
    pub fn new(rank: usize, size: usize, comm: Box<dyn TpComm>) -> Self {
        assert!(rank < size, "internal: EP rank {rank} of {size}");
        ExpertParallel {
            rank,
            size,
            comm: Mutex::new(comm),
            pending: Mutex::new(Vec::new()),
        }
    }

    fn comm<T>(&self, f: impl FnOnce(&mut dyn TpComm) -> Result<T>) -> Result<T> {
        let mut c = self
            .comm
            .lock()
            .map_err(|_| anyhow::anyhow!("an expert-parallel collective panicked earlier"))?;
        f(&mut **c)
    }

    fn lock_pending(&self) -> Result<std::sync::MutexGuard<'_, Vec<Dispatch>>> {
        self.pending
            .lock()
            .map_err(|_| anyhow::anyhow!("expert-parallel state poisoned by an earlier panic"))
    }

    /// The experts this rank holds of `experts`: the first one's index, and how many.
    pub fn local_experts(&self, experts: usize) -> (usize, usize) {
        let per = experts / self.size;
        (self.rank * per, per)
    }

    /// The experts' part of a MoE layer (after routing): for tokens `h` [n, hidden] whose n·k
    /// slots, sorted by expert (`token` [n·k]: each slot's token), go to the experts `counts`
    /// [E] says, the experts' outputs [n·k, hidden] in that order (compute dtype). `local` are
    /// this rank's experts. With a graph behind `h`, what the backward needs waits for
    /// [`ExpertParallel::finish`].
    pub(super) fn experts(
        &self,
        h: &Tensor,
        token: &Tensor,
        counts: &[i64],
        local: &[SwiGlu],
        linear: Linear,
        compute: Kind,
    ) -> Result<Tensor> {
        let (p, per) = (self.size, local.len());
        anyhow::ensure!(
            counts.len() == p * per,
            "internal: {} experts' counts for {p} ranks of {per} experts",
            counts.len()
        );
        // Counts first: rank q gets the counts of its experts from every rank.
        let mine = Tensor::from_slice(counts);
        let from = self.comm(|c| c.all_to_all(&mine, &vec![per; p], &vec![per; p]))?;
        let from = Vec::<i64>::try_from(&from).context("int64 counts")?;
        let rows = |c: &[i64]| c.iter().sum::<i64>() as usize;
        let send_rows: Vec<usize> = counts.chunks(per).map(rows).collect();
        let recv_rows: Vec<usize> = from.chunks(per).map(rows).collect();

        let send = h.index_select(0, token);
        let received = self.comm(|c| c.all_to_all(&send.detach(), &send_rows, &recv_rows))?;
        let received = if send.requires_grad() {
            leaf(&received)
        } else {
            received
        };
        let out = grouped(&received, &from, per, local, linear, compute);
        let returned = self.comm(|c| c.all_to_all(&out.detach(), &recv_rows, &send_rows))?;
        if !send.requires_grad() {
            return Ok(returned);
        }
        let returned = leaf(&returned);
        self.lock_pending()?.push(Dispatch {
            send,
            received,
            out,
            returned: returned.shallow_clone(),
            send_rows,
            recv_rows,
        });
        Ok(returned)
    }

    /// The backward of the last MoE layer whose forward kept a dispatch, once the layer's
    /// half has back-propagated to the outputs' leaf: the gradients to the experts' ranks,
    /// through the experts, back, and into the graph of the tokens sent.
    pub(super) fn finish(&self) -> Result<()> {
        let Some(x) = self.lock_pending()?.pop() else {
            anyhow::bail!("internal: an expert-parallel backward without its forward");
        };
        let d_returned = match x.returned.grad() {
            g if g.defined() => g,
            _ => x.returned.zeros_like(),
        };
        let d_out = self.comm(|c| c.all_to_all(&d_returned, &x.send_rows, &x.recv_rows))?;
        backward_from(&x.out, &d_out.to_kind(x.out.kind()))?;
        let d_received = match x.received.grad() {
            g if g.defined() => g,
            _ => x.received.zeros_like(),
        };
        let d_send = self.comm(|c| c.all_to_all(&d_received, &x.recv_rows, &x.send_rows))?;
        backward_from(&x.send, &d_send.to_kind(x.send.kind()))
    }

    /// Ends a training pass: every dispatch's backward has run.
    pub(super) fn end(&self) -> Result<()> {
        let left = self.lock_pending()?.len();
        anyhow::ensure!(
            left == 0,
            "internal: {left} expert-parallel backward(s) never ran"
        );
        Ok(())
    }
}

/// The local experts on the rows that arrived, `received` [R, hidden] (by source, then
/// expert; `from` [P, E/P] the rows each source sent each local expert): each expert's rows
/// gathered into one block, its SwiGLU on it, and the outputs [R, hidden] (compute dtype)
/// put back in `received`'s order.
fn grouped(
    received: &Tensor,
    from: &[i64],
    per: usize,
    local: &[SwiGlu],
    linear: Linear,
    compute: Kind,
) -> Tensor {
    let total: usize = from.iter().sum::<i64>() as usize;
    let device = received.device();
    // Where each (source, expert) block starts in `received`.
    let mut start = vec![0i64; from.len()];
    let mut at = 0;
    for (s, c) in start.iter_mut().zip(from) {
        *s = at;
        at += c;
    }
    let sources = from.len() / per;
    let mut perm = Vec::with_capacity(total);
    let mut outputs = Vec::with_capacity(per);
    let mut blocks = Vec::with_capacity(per);
    for e in 0..per {
        let first = perm.len() as i64;
        for s in 0..sources {
            let b = s * per + e;
            perm.extend(start[b]..start[b] + from[b]);
        }
        blocks.push((first, perm.len() as i64 - first));
    }
    let perm = Tensor::from_slice(&perm).to_device(device);
    let by_expert = received.index_select(0, &perm);
    // An expert without rows runs on an empty block, so that its gradient is a defined zero
    // (as on one rank, moe.rs) and a rank that received nothing still has its experts'.
    for (expert, &(first, count)) in local.iter().zip(&blocks) {
        outputs.push(expert.forward(&by_expert.narrow(0, first, count), linear));
    }
    let out = Tensor::cat(&outputs, 0).to_kind(compute);
    // Back in `received`'s order: row perm[i] of it is row i of `out`.
    out.zeros_like().index_copy(0, &perm, &out)
}
