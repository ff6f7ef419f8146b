//! Data-parallel synchronisation of tensors through a `ProcessGroup`: gradients are averaged and
//! initial parameters broadcast in flat fp32 buckets of `bucket_mb`, so a model of hundreds of
//! tensors costs a handful of collectives rather than one per tensor.

use anyhow::Result;
use tch::{Device, Kind, Tensor};

use super::group::ProcessGroup;

/// Packs tensors into flat buckets, runs `op` on each bucket's host slice, and unpacks.
fn bucketed(
    tensors: &[Tensor],
    bucket_mb: f64,
    mut op: impl FnMut(&mut [f32]) -> Result<()>,
) -> Result<()> {
    let cap = ((bucket_mb * 1024.0 * 1024.0 / 4.0) as usize).max(1);
    let mut start = 0;
    while start < tensors.len() {
        // A bucket holds whole tensors; one larger than the cap gets a bucket of its own.
        let mut end = start;
        let mut numel = 0;
        while end < tensors.len() && (end == start || numel + tensors[end].numel() <= cap) {
            numel += tensors[end].numel();
            end += 1;
        }
        let group = &tensors[start..end];
        let mut flat = vec![0f32; numel];
        let mut off = 0;
        for t in group {
            let n = t.numel();
            t.to_device(Device::Cpu)
                .to_kind(Kind::Float)
                .contiguous()
                .view(-1)
                .copy_data(&mut flat[off..off + n], n);
            off += n;
        }
        op(&mut flat)?;
        let mut off = 0;
        tch::no_grad(|| {
            for t in group {
                let n = t.numel();
                let src = Tensor::from_slice(&flat[off..off + n])
                    .view(t.size().as_slice())
                    .to_device(t.device())
                    .to_kind(t.kind());
                t.shallow_clone().copy_(&src);
                off += n;
            }
        });
        start = end;
    }
    Ok(())
}

/// Averages gradients across ranks (every rank ends with the same mean gradient).
pub fn all_reduce_gradients(
    pg: &mut dyn ProcessGroup,
    grads: &[Tensor],
    bucket_mb: f64,
) -> Result<()> {
    if pg.world_size() == 1 {
        return Ok(());
    }
    bucketed(grads, bucket_mb, |b| pg.all_reduce_avg_f32(b))
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
    bucketed(params, bucket_mb, |b| pg.broadcast_f32(b, 0))
}
