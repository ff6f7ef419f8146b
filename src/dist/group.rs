//! The collective-communication interface the trainer programs against.

use anyhow::Result;
use tch::{Device, Kind, Tensor};

/// Collectives over a fixed set of ranks. Every rank must call the same collectives in the same
/// order with the same buffer lengths (and the same `root`); implementations detect violations
/// where they cheaply can, but the contract is the caller's.
///
/// Methods take `&mut self` because a group owns stateful connections: one collective at a
/// time per group.
pub trait ProcessGroup: Send {
    /// This process's rank, `0..world_size()`.
    fn rank(&self) -> usize;

    /// Number of ranks.
    fn world_size(&self) -> usize;

    /// In-place element-wise sum across ranks. Every rank ends with bitwise identical contents,
    /// and the summation order depends only on the world size, so results are reproducible.
    fn all_reduce_sum_f32(&mut self, buf: &mut [f32]) -> Result<()>;

    /// In-place element-wise mean across ranks: the sum divided by the world size (a division,
    /// not a multiplication by the reciprocal, so a world of 1 is exact and identical ranks
    /// average to themselves whenever the sum is exact).
    fn all_reduce_avg_f32(&mut self, buf: &mut [f32]) -> Result<()> {
        self.all_reduce_sum_f32(buf)?;
        let w = self.world_size();
        if w > 1 {
            let w = w as f32;
            for x in buf.iter_mut() {
                *x /= w;
            }
        }
        Ok(())
    }

    /// Overwrites `buf` on every rank with `root`'s contents.
    fn broadcast_f32(&mut self, buf: &mut [f32], root: usize) -> Result<()>;

    /// Maximum of one scalar across ranks, for small agreements such as "did any rank see a
    /// non-finite loss". NaN wins: if any rank passes NaN, every rank gets NaN.
    fn all_reduce_max_f64(&mut self, x: f64) -> Result<f64>;

    /// Returns once every rank has entered the barrier.
    fn barrier(&mut self) -> Result<()>;

    /// Payload bytes this rank has sent so far, where the backend counts them (the ring);
    /// None where it does not (NCCL moves device buffers it does not report).
    fn bytes_sent(&self) -> Option<u64> {
        None
    }

    /// In-place mean of a contiguous tensor across ranks. Backends that reduce on the device
    /// (NCCL) override this; the default goes through host memory in fp32. NCCL's average
    /// (ncclAvg) and its summation order depend on its algorithm and topology, so the exactness
    /// promised by `all_reduce_avg_f32` holds for the ring only.
    fn all_reduce_avg_tensor(&mut self, t: &Tensor) -> Result<()> {
        through_host(t, |buf| self.all_reduce_avg_f32(buf))
    }

    /// Overwrites a contiguous tensor on every rank with `root`'s. Default as above.
    fn broadcast_tensor(&mut self, t: &Tensor, root: usize) -> Result<()> {
        through_host(t, |buf| self.broadcast_f32(buf, root))
    }

    /// In-place reduce-scatter with mean: `buf` is cut into consecutive pieces of `splits[r]`
    /// elements, one per rank in rank order (pieces may differ in length or be empty);
    /// afterwards this rank's piece holds the mean of every rank's piece, and the other pieces
    /// are unspecified. The default all-reduces the whole buffer (right, but N× the traffic);
    /// the ring and NCCL send each rank only its piece.
    fn reduce_scatter_avg_f32(&mut self, buf: &mut [f32], splits: &[usize]) -> Result<()> {
        self.reduce_scatter_sum_f32(buf, splits)?;
        let w = self.world_size();
        if w > 1 {
            let w = w as f32;
            for x in &mut buf[piece(splits, self.rank())] {
                *x /= w;
            }
        }
        Ok(())
    }

    /// [`ProcessGroup::reduce_scatter_avg_f32`] with the sum instead of the mean (tensor
    /// parallelism adds partial products). The default all-reduces the whole buffer.
    fn reduce_scatter_sum_f32(&mut self, buf: &mut [f32], splits: &[usize]) -> Result<()> {
        check_splits(buf.len(), splits, self.world_size())?;
        self.all_reduce_sum_f32(buf)
    }

    /// In-place sum of a contiguous tensor across ranks. Default through host memory in fp32;
    /// NCCL overrides it.
    fn all_reduce_sum_tensor(&mut self, t: &Tensor) -> Result<()> {
        through_host(t, |buf| self.all_reduce_sum_f32(buf))
    }

    /// [`ProcessGroup::reduce_scatter_sum_f32`] on a contiguous 1-D tensor. Default through
    /// host memory in fp32; NCCL overrides it.
    fn reduce_scatter_sum_tensor(&mut self, t: &Tensor, splits: &[usize]) -> Result<()> {
        through_host(t, |buf| self.reduce_scatter_sum_f32(buf, splits))
    }

    /// In-place all-gather: on entry this rank's piece of `buf` (cut as in
    /// [`ProcessGroup::reduce_scatter_avg_f32`]) holds its data; afterwards every piece holds
    /// its owner's, bit for bit. The default zeroes the other pieces and all-reduces.
    fn all_gather_f32(&mut self, buf: &mut [f32], splits: &[usize]) -> Result<()> {
        check_splits(buf.len(), splits, self.world_size())?;
        let mine = piece(splits, self.rank());
        for (i, x) in buf.iter_mut().enumerate() {
            if !mine.contains(&i) {
                *x = 0.0;
            }
        }
        self.all_reduce_sum_f32(buf)
    }

    /// Every rank's `x`, in rank order, bit for bit: each value travels as four 16-bit pieces,
    /// each an exact fp32 integer, through [`ProcessGroup::all_gather_f32`]. For sums that must
    /// not depend on the world size's summation order (the global gradient norm).
    fn all_gather_f64(&mut self, x: f64) -> Result<Vec<f64>> {
        let (world, rank) = (self.world_size(), self.rank());
        let mut buf = vec![0f32; 4 * world];
        let bits = x.to_bits();
        for k in 0..4 {
            buf[4 * rank + k] = ((bits >> (16 * k)) & 0xffff) as f32;
        }
        self.all_gather_f32(&mut buf, &vec![4; world])?;
        Ok(buf
            .chunks(4)
            .map(|q| {
                let bits = (0..4).fold(0u64, |acc, k| acc | ((q[k] as u64) << (16 * k)));
                f64::from_bits(bits)
            })
            .collect())
    }

    /// In-place element-wise sum of counts across ranks, exact and the same on every rank:
    /// each value travels as three 12-bit pieces, exact fp32 integers whose sums over up to
    /// 4,096 ranks stay below 2^24, through [`ProcessGroup::all_reduce_sum_f32`]. Values must
    /// be below 2^36 (68.7 billion); larger ones, or more ranks, are refused before anything
    /// is sent.
    fn all_reduce_sum_u64(&mut self, buf: &mut [u64]) -> Result<()> {
        const BITS: usize = 12;
        const PIECES: usize = 3;
        let world = self.world_size();
        anyhow::ensure!(
            world <= 1 << BITS,
            "internal: exact count sums reach {} ranks, not {world}",
            1 << BITS
        );
        if let Some(v) = buf.iter().find(|&&v| v >> (BITS * PIECES) != 0) {
            anyhow::bail!("internal: a count of {v} is above the 2^36 an exact sum carries");
        }
        let mask = (1u64 << BITS) - 1;
        let mut pieces: Vec<f32> = buf
            .iter()
            .flat_map(|&v| (0..PIECES).map(move |k| ((v >> (BITS * k)) & mask) as f32))
            .collect();
        self.all_reduce_sum_f32(&mut pieces)?;
        for (v, p) in buf.iter_mut().zip(pieces.chunks(PIECES)) {
            *v = p
                .iter()
                .enumerate()
                .map(|(k, &x)| (x as u64) << (BITS * k))
                .sum();
        }
        Ok(())
    }

    /// [`ProcessGroup::reduce_scatter_avg_f32`] on a contiguous 1-D tensor. Default through
    /// host memory in fp32; NCCL overrides it.
    fn reduce_scatter_avg_tensor(&mut self, t: &Tensor, splits: &[usize]) -> Result<()> {
        through_host(t, |buf| self.reduce_scatter_avg_f32(buf, splits))
    }

    /// [`ProcessGroup::all_gather_f32`] on a contiguous 1-D tensor. Default through host
    /// memory in fp32; NCCL overrides it.
    fn all_gather_tensor(&mut self, t: &Tensor, splits: &[usize]) -> Result<()> {
        through_host(t, |buf| self.all_gather_f32(buf, splits))
    }

    /// All-to-all of uneven pieces of bytes: `send` is cut into consecutive pieces of
    /// `send_splits[r]` bytes, piece r going to rank r; `recv` into pieces of `recv_splits[s]`
    /// bytes, piece s arriving from rank s (what rank s sends this rank: the caller's
    /// bookkeeping, e.g. counts exchanged before). Pure copies, bit for bit. Backends without
    /// it refuse.
    fn all_to_all_bytes(
        &mut self,
        send: &[u8],
        send_splits: &[usize],
        recv: &mut [u8],
        recv_splits: &[usize],
    ) -> Result<()> {
        let _ = (send, send_splits, recv, recv_splits);
        anyhow::bail!("this process group has no all-to-all")
    }

    /// All-to-all of rows (torch's `all_to_all_single` with split sizes): `send` [Σ
    /// send_rows, ...] (any dtype, contiguous or not), rows `piece(send_rows, r)` to rank r;
    /// returns [Σ recv_rows, ...] of `send`'s dtype and device, rows `piece(recv_rows, s)` from
    /// rank s. Default through host memory ([`ProcessGroup::all_to_all_bytes`]); NCCL
    /// overrides it for CUDA tensors.
    fn all_to_all_tensor(
        &mut self,
        send: &Tensor,
        send_rows: &[usize],
        recv_rows: &[usize],
    ) -> Result<Tensor> {
        all_to_all_through_host(self, send, send_rows, recv_rows)
    }

    /// A group of some of this group's ranks: `members` (ranks of this group, ascending, this
    /// rank among them; its rank there is its position). Formed collectively: every rank calls
    /// it the same number of times in the same order, each naming its own subgroup's members
    /// and a `tag` that no other subgroup shares (hybrid sharding's "shard1", "replica0").
    fn subgroup(&mut self, members: &[usize], tag: &str) -> Result<Box<dyn ProcessGroup>> {
        let _ = (members, tag);
        anyhow::bail!("this process group cannot form subgroups")
    }

    /// The rendezvous store and a key prefix private to this group and this attempt of the
    /// job, for work beside the collectives (the background checkpoint writer's reports, which
    /// must not run on the training group). None where there is no store (one process).
    fn side_store(&self) -> Option<(std::sync::Arc<super::store::Store>, String)> {
        None
    }
}

/// A subgroup that collectives of the communication thread and of the caller share (one at a
/// time: the lock is uncontended, the thread runs one job after another).
pub type SharedGroup = std::sync::Arc<std::sync::Mutex<Box<dyn ProcessGroup>>>;

/// Runs `f` on `sub` where there is one, else on `pg`.
pub fn on_group<T>(
    sub: Option<&SharedGroup>,
    pg: &mut dyn ProcessGroup,
    f: impl FnOnce(&mut dyn ProcessGroup) -> Result<T>,
) -> Result<T> {
    match sub {
        Some(g) => {
            let mut g = g
                .lock()
                .map_err(|_| anyhow::anyhow!("a subgroup's collective panicked earlier"))?;
            f(&mut **g)
        }
        None => f(pg),
    }
}

/// This rank's position among `members`, checked.
pub(crate) fn position_in(members: &[usize], rank: usize, tag: &str) -> Result<usize> {
    anyhow::ensure!(
        members.windows(2).all(|w| w[0] < w[1]),
        "internal: subgroup {tag}: members {members:?} not ascending"
    );
    members.iter().position(|&r| r == rank).ok_or_else(|| {
        anyhow::anyhow!("internal: rank {rank} is not in subgroup {tag} {members:?}")
    })
}

/// Rank `r`'s range of a buffer cut into `splits`.
pub fn piece(splits: &[usize], r: usize) -> std::ops::Range<usize> {
    let start: usize = splits[..r].iter().sum();
    start..start + splits[r]
}

/// Every rank must pass one piece per rank, covering the buffer exactly.
pub(crate) fn check_splits(len: usize, splits: &[usize], world: usize) -> Result<()> {
    anyhow::ensure!(
        splits.len() == world && splits.iter().sum::<usize>() == len,
        "internal: {} pieces of {} elements in all for a buffer of {len} elements in a world of {world}",
        splits.len(),
        splits.iter().sum::<usize>()
    );
    Ok(())
}

/// [`ProcessGroup::all_to_all_tensor`] through host memory: the rows copied out as bytes,
/// exchanged by [`ProcessGroup::all_to_all_bytes`], and moved back to `send`'s device.
pub(crate) fn all_to_all_through_host<G: ProcessGroup + ?Sized>(
    g: &mut G,
    send: &Tensor,
    send_rows: &[usize],
    recv_rows: &[usize],
) -> Result<Tensor> {
    let (row, out) = all_to_all_output(g.world_size(), send, send_rows, recv_rows)?;
    let host = send.detach().to_device(Device::Cpu).contiguous();
    let recv = Tensor::empty(out.as_slice(), (send.kind(), Device::Cpu));
    let bytes = |rows: &[usize]| rows.iter().map(|r| r * row).collect::<Vec<_>>();
    let (send_bytes, recv_bytes) = (bytes(send_rows), bytes(recv_rows));
    let (n_send, n_recv) = (send_bytes.iter().sum(), recv_bytes.iter().sum());
    // SAFETY: `host` and `recv` are contiguous CPU tensors of exactly these many bytes
    // (all_to_all_output checked the splits against the rows), alive for the call; `recv` is
    // fresh, so nothing else reads it while the collective writes it, and any bit pattern is
    // valid for plain dtypes. An empty tensor may have no allocation: an empty slice then.
    let (src, dst): (&[u8], &mut [u8]) = unsafe {
        (
            match n_send {
                0 => &[],
                n => std::slice::from_raw_parts(host.data_ptr() as *const u8, n),
            },
            match n_recv {
                0 => &mut [],
                n => std::slice::from_raw_parts_mut(recv.data_ptr() as *mut u8, n),
            },
        )
    };
    g.all_to_all_bytes(src, &send_bytes, dst, &recv_bytes)?;
    Ok(recv.to_device(send.device()))
}

/// Checks an all-to-all of rows of `send` over `world` ranks (one split per rank, the send
/// splits covering its rows) and returns the bytes of one row and the received tensor's shape.
pub(crate) fn all_to_all_output(
    world: usize,
    send: &Tensor,
    send_rows: &[usize],
    recv_rows: &[usize],
) -> Result<(usize, Vec<i64>)> {
    let mut shape = send.size();
    anyhow::ensure!(!shape.is_empty(), "internal: all-to-all of a 0-dim tensor");
    check_splits(shape[0] as usize, send_rows, world)?;
    anyhow::ensure!(
        recv_rows.len() == world,
        "internal: {} receive pieces in a world of {world}",
        recv_rows.len()
    );
    let row = shape[1..].iter().product::<i64>() as usize * send.kind().elt_size_in_bytes();
    shape[0] = recv_rows.iter().sum::<usize>() as i64;
    Ok((row, shape))
}

/// The pieces of bytes of an all-to-all checked against the buffers, one per rank.
pub(crate) fn check_all_to_all(
    send: &[u8],
    send_splits: &[usize],
    recv: &[u8],
    recv_splits: &[usize],
    world: usize,
) -> Result<()> {
    check_splits(send.len(), send_splits, world)?;
    check_splits(recv.len(), recv_splits, world)
}

/// Every rank's `t` (the same shape on each) in rank order, as one flat buffer of
/// `world · numel` elements: an all-gather of equal pieces on `g`.
pub fn gather_equal(g: &mut dyn ProcessGroup, t: &Tensor) -> Result<Tensor> {
    let (rank, world, n) = (g.rank(), g.world_size(), t.numel());
    let buffer = Tensor::zeros([(n * world) as i64], (t.kind(), t.device()));
    tch::no_grad(|| {
        buffer
            .narrow(0, (n * rank) as i64, n as i64)
            .copy_(&t.reshape(-1))
    });
    g.all_gather_tensor(&buffer, &vec![n; world])?;
    Ok(buffer)
}

/// Runs a host-slice collective on a tensor: copy out as fp32, `op`, copy back in place.
pub(crate) fn through_host(t: &Tensor, op: impl FnOnce(&mut [f32]) -> Result<()>) -> Result<()> {
    let n = t.numel();
    // In place where the layout allows. Writing through data_ptr skips autograd's version
    // counter, so tensors that take part in autograd go the copying way.
    let in_place = t.device() == Device::Cpu
        && t.kind() == Kind::Float
        && t.is_contiguous()
        && !t.requires_grad()
        && n > 0;
    if in_place {
        // SAFETY: a contiguous fp32 CPU tensor of `n` elements owns `n` f32s at data_ptr; no
        // other reference to them is used while `op` runs (the caller hands us the tensor for
        // this collective only).
        let buf = unsafe { std::slice::from_raw_parts_mut(t.data_ptr() as *mut f32, n) };
        return op(buf);
    }
    let mut host = vec![0f32; n];
    t.to_device(Device::Cpu)
        .to_kind(Kind::Float)
        .contiguous()
        .view(-1)
        .copy_data(&mut host, n);
    op(&mut host)?;
    let back = Tensor::from_slice(&host)
        .view(t.size().as_slice())
        .to_device(t.device())
        .to_kind(t.kind());
    tch::no_grad(|| t.shallow_clone().copy_(&back));
    Ok(())
}

/// NaN-propagating, order-independent maximum (the result does not depend on which rank's value
/// came first, even for -0.0 vs +0.0, so every rank agrees bitwise).
pub(crate) fn max_f64(a: f64, b: f64) -> f64 {
    if a.is_nan() || b.is_nan() {
        f64::NAN
    } else if a.total_cmp(&b).is_ge() {
        a
    } else {
        b
    }
}

/// The trivial group of a single-process run: every collective is the identity.
#[derive(Debug, Default, Clone, Copy)]
pub struct SingleProcess;

impl ProcessGroup for SingleProcess {
    fn rank(&self) -> usize {
        0
    }

    fn bytes_sent(&self) -> Option<u64> {
        Some(0)
    }

    fn world_size(&self) -> usize {
        1
    }

    fn all_reduce_sum_f32(&mut self, _buf: &mut [f32]) -> Result<()> {
        Ok(())
    }

    fn broadcast_f32(&mut self, _buf: &mut [f32], root: usize) -> Result<()> {
        anyhow::ensure!(
            root == 0,
            "broadcast root {root} out of range for a world of 1"
        );
        Ok(())
    }

    fn all_reduce_max_f64(&mut self, x: f64) -> Result<f64> {
        // Canonicalise NaN payloads like the multi-rank path does.
        Ok(max_f64(x, x))
    }

    fn barrier(&mut self) -> Result<()> {
        Ok(())
    }

    fn reduce_scatter_sum_f32(&mut self, buf: &mut [f32], splits: &[usize]) -> Result<()> {
        check_splits(buf.len(), splits, 1)
    }

    fn reduce_scatter_avg_f32(&mut self, buf: &mut [f32], splits: &[usize]) -> Result<()> {
        check_splits(buf.len(), splits, 1)
    }

    fn all_reduce_sum_tensor(&mut self, _t: &Tensor) -> Result<()> {
        Ok(())
    }

    fn reduce_scatter_sum_tensor(&mut self, t: &Tensor, splits: &[usize]) -> Result<()> {
        check_splits(t.numel(), splits, 1)
    }

    fn all_gather_f32(&mut self, buf: &mut [f32], splits: &[usize]) -> Result<()> {
        check_splits(buf.len(), splits, 1)
    }

    fn reduce_scatter_avg_tensor(&mut self, t: &Tensor, splits: &[usize]) -> Result<()> {
        check_splits(t.numel(), splits, 1)
    }

    fn all_gather_tensor(&mut self, t: &Tensor, splits: &[usize]) -> Result<()> {
        check_splits(t.numel(), splits, 1)
    }

    fn all_to_all_bytes(
        &mut self,
        send: &[u8],
        send_splits: &[usize],
        recv: &mut [u8],
        recv_splits: &[usize],
    ) -> Result<()> {
        check_all_to_all(send, send_splits, recv, recv_splits, 1)?;
        recv.copy_from_slice(send);
        Ok(())
    }

    fn all_to_all_tensor(
        &mut self,
        send: &Tensor,
        send_rows: &[usize],
        recv_rows: &[usize],
    ) -> Result<Tensor> {
        all_to_all_output(1, send, send_rows, recv_rows)?;
        anyhow::ensure!(
            send_rows == recv_rows,
            "internal: a world of 1 receives {recv_rows:?} rows of the {send_rows:?} it sends"
        );
        Ok(send.copy())
    }

    fn subgroup(&mut self, members: &[usize], tag: &str) -> Result<Box<dyn ProcessGroup>> {
        position_in(members, 0, tag)?;
        Ok(Box::new(SingleProcess))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn single_process_is_identity() -> Result<()> {
        let mut g = SingleProcess;
        let mut b = vec![1.5f32, -2.0, 3.25];
        g.all_reduce_sum_f32(&mut b)?;
        g.all_reduce_avg_f32(&mut b)?;
        g.broadcast_f32(&mut b, 0)?;
        assert_eq!(b, [1.5, -2.0, 3.25]);
        assert!(g.broadcast_f32(&mut b, 1).is_err());
        assert_eq!(g.all_reduce_max_f64(2.5)?, 2.5);
        assert!(g.all_reduce_max_f64(f64::NAN)?.is_nan());
        g.barrier()?;
        assert_eq!((g.rank(), g.world_size()), (0, 1));
        for x in [0.1f64, -3.5e300, f64::MIN_POSITIVE, 1.0 / 3.0] {
            assert_eq!(g.all_gather_f64(x)?[0].to_bits(), x.to_bits());
        }
        let mut counts = [0, 1, 4095, 4096, (1 << 36) - 1];
        g.all_reduce_sum_u64(&mut counts)?;
        assert_eq!(counts, [0, 1, 4095, 4096, (1 << 36) - 1]);
        assert!(g.all_reduce_sum_u64(&mut [1 << 36]).is_err());
        Ok(())
    }

    #[test]
    fn through_host_round_trips_any_layout_and_dtype() -> Result<()> {
        let double = |b: &mut [f32]| {
            b.iter_mut().for_each(|x| *x *= 2.0);
            Ok(())
        };
        let dense = Tensor::arange(6, (Kind::Float, Device::Cpu));
        through_host(&dense, double)?;
        assert_eq!(Vec::<f32>::try_from(&dense)?, [0., 2., 4., 6., 8., 10.]);
        let bf16 = Tensor::arange(6, (Kind::BFloat16, Device::Cpu)).view([2, 3]);
        let strided = bf16.transpose(0, 1);
        through_host(&strided, double)?;
        assert_eq!(strided.kind(), Kind::BFloat16);
        let back = Vec::<f32>::try_from(&bf16.to_kind(Kind::Float).view(-1))?;
        assert_eq!(back, [0., 2., 4., 6., 8., 10.]);
        Ok(())
    }

    #[test]
    fn max_is_nan_propagating_and_symmetric() {
        assert!(max_f64(f64::NAN, 1.0).is_nan());
        assert!(max_f64(1.0, f64::NAN).is_nan());
        assert_eq!(max_f64(1.0, 2.0), 2.0);
        assert_eq!(max_f64(-0.0, 0.0).to_bits(), max_f64(0.0, -0.0).to_bits());
        assert_eq!(max_f64(f64::NEG_INFINITY, -1.0), -1.0);
    }
}
