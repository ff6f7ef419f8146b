//! Buckets: every collective that moves many tensors moves them packed into flat buffers of at
//! most `system.bucket_mb`, so a model of hundreds of tensors costs a handful of collectives
//! rather than one per tensor. The packing rule is written here once and used by the initial
//! parameter broadcast ([`broadcast_parameters`]), the gradient all-reduce
//! (`train::optim::reduce`) and the all-gathers over the flat layout
//! ([`super::flat_layout::FlatLayout::buckets`]). Buffers are built on the tensors' own device,
//! so NCCL moves them where they are; the CPU ring copies them to host.

use std::ops::Range;

use anyhow::Result;
use tch::Tensor;

use super::group::ProcessGroup;

/// `system.bucket_mb` in bytes (at least 1).
pub fn cap_bytes(bucket_mb: f64) -> usize {
    ((bucket_mb * 1024.0 * 1024.0) as usize).max(1)
}

/// Cuts items of the given byte `sizes`, in order, into consecutive groups of at most `cap`
/// bytes; an item larger than `cap` gets a group of its own, and `joinable(a, b)` = false (say,
/// another dtype or device) starts a new group at `b`. Returns the groups as index ranges.
pub fn pack(
    sizes: &[usize],
    cap: usize,
    joinable: impl Fn(usize, usize) -> bool,
) -> Vec<Range<usize>> {
    let mut groups: Vec<Range<usize>> = Vec::new();
    let mut bytes = 0;
    for (i, &size) in sizes.iter().enumerate() {
        match groups.last_mut() {
            Some(g) if bytes + size <= cap && joinable(g.start, i) => {
                g.end = i + 1;
                bytes += size;
            }
            _ => {
                groups.push(i..i + 1);
                bytes = size;
            }
        }
    }
    groups
}

/// Consecutive ranges of at most `cap` elements covering `0..n`.
pub fn ranges(n: usize, cap: usize) -> Vec<Range<usize>> {
    let cap = cap.max(1);
    (0..n).step_by(cap).map(|s| s..(s + cap).min(n)).collect()
}

/// The tensors (one dtype and device) as one flat buffer, in order.
pub fn flatten(tensors: &[Tensor]) -> Tensor {
    let views: Vec<Tensor> = tensors.iter().map(|t| t.detach().reshape(-1)).collect();
    Tensor::cat(&views, 0)
}

/// Copies a buffer made by [`flatten`] back into the tensors, in place.
pub fn unflatten(flat: &Tensor, into: &[Tensor]) {
    let mut at = 0;
    tch::no_grad(|| {
        for t in into {
            let n = t.numel() as i64;
            t.shallow_clone()
                .copy_(&flat.narrow(0, at, n).view(t.size().as_slice()));
            at += n;
        }
    });
}

/// Copies rank 0's parameters to every rank, so all start from the same weights.
pub fn broadcast_parameters(
    pg: &mut dyn ProcessGroup,
    params: &[Tensor],
    bucket_mb: f64,
) -> Result<()> {
    if pg.world_size() == 1 {
        return Ok(());
    }
    let sizes: Vec<usize> = params
        .iter()
        .map(|t| t.numel() * t.kind().elt_size_in_bytes())
        .collect();
    let same = |a: usize, b: usize| {
        params[a].kind() == params[b].kind() && params[a].device() == params[b].device()
    };
    for group in pack(&sizes, cap_bytes(bucket_mb), same) {
        let members = &params[group];
        let flat = flatten(members);
        pg.broadcast_tensor(&flat, 0)?;
        unflatten(&flat, members);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind};

    /// Records every bucket it is handed and doubles it, standing in for a collective.
    struct Recorder(Vec<(Kind, i64)>);

    impl ProcessGroup for Recorder {
        fn rank(&self) -> usize {
            0
        }
        fn world_size(&self) -> usize {
            2
        }
        fn all_reduce_sum_f32(&mut self, _: &mut [f32]) -> Result<()> {
            unreachable!()
        }
        fn broadcast_f32(&mut self, _: &mut [f32], _: usize) -> Result<()> {
            unreachable!()
        }
        fn all_reduce_max_f64(&mut self, x: f64) -> Result<f64> {
            Ok(x)
        }
        fn barrier(&mut self) -> Result<()> {
            Ok(())
        }
        fn broadcast_tensor(&mut self, t: &Tensor, _root: usize) -> Result<()> {
            self.0.push((t.kind(), t.numel() as i64));
            tch::no_grad(|| t.shallow_clone().copy_(&(t * 2)));
            Ok(())
        }
    }

    #[test]
    fn buckets_respect_the_cap_and_dtype_and_write_back() -> Result<()> {
        let opts = (Kind::Float, Device::Cpu);
        // 1 MB cap = 262,144 fp32 elements.
        let ts = [
            Tensor::ones([100_000], opts),
            Tensor::ones([100, 1000], opts),
            Tensor::ones([70_000], opts),
            Tensor::ones([300_000], opts),
            Tensor::ones([10], (Kind::Double, Device::Cpu)),
            Tensor::ones([5], opts),
        ];
        let mut pg = Recorder(Vec::new());
        broadcast_parameters(&mut pg, &ts, 1.0)?;
        assert_eq!(
            pg.0,
            [
                (Kind::Float, 200_000),
                (Kind::Float, 70_000),
                (Kind::Float, 300_000),
                (Kind::Double, 10),
                (Kind::Float, 5),
            ]
        );
        for t in &ts {
            assert_eq!(t.min().double_value(&[]), 2.0);
            assert_eq!(t.max().double_value(&[]), 2.0);
        }
        assert_eq!(ts[1].size(), [100, 1000]);
        Ok(())
    }

    #[test]
    fn pack_closes_a_group_at_the_cap_or_where_items_cannot_join() {
        let all = |_: usize, _: usize| true;
        assert_eq!(pack(&[4, 4, 4, 9, 1], 8, all), [0..2, 2..3, 3..4, 4..5]);
        assert_eq!(pack(&[1, 1, 1], 8, |_, b| b != 2), [0..2, 2..3]);
        assert!(pack(&[], 8, all).is_empty());
        assert_eq!(ranges(10, 4), [0..4, 4..8, 8..10]);
    }
}
