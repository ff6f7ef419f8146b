//! The initial parameters broadcast from rank 0 in flat buckets of `bucket_mb`, so a model of
//! hundreds of tensors costs a handful of collectives rather than one per tensor (gradients are
//! averaged as backward finishes them: `train::reduce`). Buckets are built on the
//! tensors' own device, so NCCL reduces them where they are; the CPU ring copies them to host.

use anyhow::Result;
use tch::Tensor;

use super::group::ProcessGroup;

/// Packs consecutive tensors of one dtype and device into flat buckets of at most `bucket_mb`
/// (a tensor larger than that gets a bucket of its own), runs `op` on each, and unpacks.
fn bucketed(
    tensors: &[Tensor],
    bucket_mb: f64,
    mut op: impl FnMut(&Tensor) -> Result<()>,
) -> Result<()> {
    let cap_bytes = ((bucket_mb * 1024.0 * 1024.0) as usize).max(1);
    let mut start = 0;
    while start < tensors.len() {
        let (kind, device) = (tensors[start].kind(), tensors[start].device());
        let mut end = start;
        let mut bytes = 0;
        while end < tensors.len() {
            let t = &tensors[end];
            let size = t.numel() * t.kind().elt_size_in_bytes();
            let fits = end == start
                || (t.kind() == kind && t.device() == device && bytes + size <= cap_bytes);
            if !fits {
                break;
            }
            bytes += size;
            end += 1;
        }
        let group = &tensors[start..end];
        let views: Vec<Tensor> = group.iter().map(|t| t.detach().reshape(-1)).collect();
        let flat = Tensor::cat(&views, 0);
        op(&flat)?;
        let mut off = 0;
        tch::no_grad(|| {
            for t in group {
                let n = t.numel() as i64;
                let part = flat.narrow(0, off, n).view(t.size().as_slice());
                t.shallow_clone().copy_(&part);
                off += n;
            }
        });
        start = end;
    }
    Ok(())
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
    bucketed(params, bucket_mb, |b| pg.broadcast_tensor(b, 0))
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
}
