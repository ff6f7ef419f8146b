//! How a model is split among the T ranks of a tensor-parallel group (`system.tensor_parallel`):
//! the kinds of [`Split`] a parameter has (each parameter's is in its model's table,
//! params.rs), the group's collectives as the model sees them ([`TpComm`], implemented over a
//! process group by the trainer), and the four operators between a decoder half's matmuls and
//! the residual stream ([`TensorParallel`]: f and g in Megatron's terms, with and without
//! sequence parallelism). The layout is described in tensor_parallel.rs; the training pass,
//! one for every T, is backward.rs.

use std::ops::Range;
use std::sync::Mutex;

use anyhow::Result;
use tch::{Kind, Tensor};

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
    /// Rows `piece(send_rows, r)` of `t` to rank r; the rows every rank sent this one, in
    /// rank order (expert parallelism's dispatch, `ProcessGroup::all_to_all_tensor`).
    fn all_to_all(
        &mut self,
        t: &Tensor,
        send_rows: &[usize],
        recv_rows: &[usize],
    ) -> Result<Tensor> {
        let _ = (t, send_rows, recv_rows);
        anyhow::bail!("internal: this group's collectives have no all-to-all")
    }
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

    pub(super) fn comm<T>(&self, f: impl FnOnce(&mut dyn TpComm) -> Result<T>) -> Result<T> {
        let mut c = self
            .comm
            .lock()
            .map_err(|_| anyhow::anyhow!("a tensor-parallel collective panicked earlier"))?;
        f(&mut **c)
    }

    /// f forward: the normed tokens a half's matmuls read (all of the micro-batch's).
    pub(super) fn enter(&self, normed: &Tensor) -> Result<Tensor> {
        if self.sequence_parallel {
            self.comm(|c| c.all_gather(normed))
        } else {
            Ok(normed.shallow_clone())
        }
    }

    /// f backward: the gradient of this rank's normed tokens from that of all of them.
    pub(super) fn enter_grad(&self, grad: &Tensor) -> Result<Tensor> {
        if self.sequence_parallel {
            self.comm(|c| c.reduce_scatter(grad))
        } else {
            self.comm(|c| c.all_reduce_sum(grad))?;
            Ok(grad.shallow_clone())
        }
    }

    /// g forward: this rank's tokens of the sum of the ranks' partial outputs.
    pub(super) fn leave(&self, partial: &Tensor) -> Result<Tensor> {
        if self.sequence_parallel {
            self.comm(|c| c.reduce_scatter(partial))
        } else {
            let sum = partial.contiguous();
            self.comm(|c| c.all_reduce_sum(&sum))?;
            Ok(sum)
        }
    }

    /// g backward: the gradient of the partial output from that of this rank's tokens.
    pub(super) fn leave_grad(&self, grad: &Tensor) -> Result<Tensor> {
        if self.sequence_parallel {
            self.comm(|c| c.all_gather(grad))
        } else {
            Ok(grad.shallow_clone())
        }
    }
}

/// How one parameter is split among the ranks of a tensor-parallel group (each parameter's is
/// in its model's table, `params.rs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Split {
    /// Whole on every rank, read by every rank for all its tokens (the RMSNorm weights of the
    /// residual stream): its gradients are equal across the group, or with sequence
    /// parallelism partial sums over each rank's tokens.
    Replicated,
    /// Whole on every rank, read by each rank for its own heads (Qwen3's q_norm and k_norm, an
    /// RMSNorm of one head): each rank's gradient is its heads' part, summed over the group.
    Shared,
    /// Column-parallel linear: dim 0 (output features) cut in T.
    Rows,
    /// Row-parallel linear: dim 1 (input features) cut in T.
    Columns,
    /// Embedding and LM head: dim 0 (the vocabulary) padded to a multiple of T and cut.
    Vocab,
}

impl Split {
    /// Whether every rank holds the whole parameter.
    pub fn is_whole(self) -> bool {
        self.dim().is_none()
    }

    /// The dimension cut, if any.
    pub fn dim(self) -> Option<usize> {
        match self {
            Split::Replicated | Split::Shared => None,
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
            Split::Replicated | Split::Shared => read(range.clone()),
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
            Split::Replicated | Split::Shared => {
                vec![(range.clone(), parts[0].1.shallow_clone())]
            }
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

#[cfg(test)]
mod tests {
    use super::*;

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
