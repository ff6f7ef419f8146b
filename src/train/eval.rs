//! Batches from the memory-mapped token file, and the validation loss.

use anyhow::Result;
use tch::{Device, Tensor};

use crate::config::Config;
use crate::data::sampler::{fill_batch, Sampler};
use crate::data::tokfile::TokenFile;
use crate::dist::ProcessGroup;
use crate::model::Llama;

/// One batch of `indices` windows as (inputs, targets), each [len, context] on `device`.
pub fn batch(
    tokens: &TokenFile,
    sampler: &Sampler,
    indices: &[u64],
    ctx: usize,
    buf: &mut Vec<i64>,
    device: Device,
) -> (Tensor, Tensor) {
    fill_batch(tokens, sampler, indices, ctx, buf);
    let rows = Tensor::from_slice(buf)
        .view([indices.len() as i64, ctx as i64 + 1])
        .to_device(device);
    (rows.narrow(1, 0, ctx as i64), rows.narrow(1, 1, ctx as i64))
}

/// Mean loss over the first `eval_batches` × batch_size windows of the validation file, in a
/// fixed order; each rank evaluates its share (window i → rank i mod world) and the sums meet
/// in one all-reduce.
pub fn evaluate(
    model: &Llama,
    val: &TokenFile,
    cfg: &Config,
    device: Device,
    pg: &mut dyn ProcessGroup,
) -> Result<Option<f64>> {
    let (ctx, bs) = (cfg.training.context_length, cfg.training.batch_size);
    if cfg.training.eval_batches == 0 || val.num_tokens() < ctx as u64 + 1 {
        return Ok(None);
    }
    let sampler = Sampler::new(val.num_tokens(), ctx, cfg.system.seed)?;
    let n = (cfg.training.eval_batches * bs).min(sampler.num_windows() as usize) as u64;
    let mut buf = Vec::new();
    let mut total = 0.0;
    let (rank, world) = (pg.rank() as u64, pg.world_size() as u64);
    let all: Vec<u64> = (0..n).filter(|i| i % world == rank).collect();
    let chunks: Vec<&[u64]> = all.chunks(bs).collect();
    tch::no_grad(|| {
        for idx in &chunks {
            let (x, y) = batch(val, &sampler, idx, ctx, &mut buf, device);
            total += model.loss(&x, &y).double_value(&[]) * idx.len() as f64;
        }
    });
    let mut sum = [total as f32];
    pg.all_reduce_sum_f32(&mut sum)?;
    Ok(Some(sum[0] as f64 / n as f64))
}
