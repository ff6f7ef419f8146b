//! The model's tensor-parallel collectives ([`TpComm`]) over a process group: the trainer's
//! side of `model::tensor_parallel`, which knows how a layer is split but not who splits it.
//! Each collective is counted by kind, so a test can assert how many a step runs.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use anyhow::Result;
use tch::Tensor;

use crate::dist::group::gather_equal;
use crate::dist::{on_group, SharedGroup};
use crate::model::TpComm;

/// Collectives run so far, by kind.
#[derive(Debug, Default)]
pub struct Counts {
    pub all_gather: AtomicUsize,
    pub reduce_scatter: AtomicUsize,
    pub all_reduce: AtomicUsize,
}

impl Counts {
    /// (all-gathers, reduce-scatters, all-reduces).
    pub fn get(&self) -> (usize, usize, usize) {
        (
            self.all_gather.load(Ordering::Relaxed),
            self.reduce_scatter.load(Ordering::Relaxed),
            self.all_reduce.load(Ordering::Relaxed),
        )
    }
}

/// [`TpComm`] on this rank's tensor-parallel group.
pub struct GroupComm {
    group: SharedGroup,
    size: usize,
    rank: usize,
    counts: Arc<Counts>,
}

impl GroupComm {
    pub fn new(group: SharedGroup) -> Result<GroupComm> {
        let (rank, size) = {
            let g = group
                .lock()
                .map_err(|_| anyhow::anyhow!("a tensor-parallel collective panicked earlier"))?;
            (g.rank(), g.world_size())
        };
        Ok(GroupComm {
            group,
            size,
            rank,
            counts: Arc::default(),
        })
    }

    /// The counts this comm adds to (shared: read them while the model holds the comm).
    pub fn counts(&self) -> Arc<Counts> {
        self.counts.clone()
    }

    fn run<T>(
        &self,
        count: &AtomicUsize,
        f: impl FnOnce(&mut dyn crate::dist::ProcessGroup) -> Result<T>,
    ) -> Result<T> {
        count.fetch_add(1, Ordering::Relaxed);
        let mut unused = crate::dist::SingleProcess;
        on_group(Some(&self.group), &mut unused, f)
    }
}

impl TpComm for GroupComm {
    fn all_reduce_sum(&mut self, t: &Tensor) -> Result<()> {
        anyhow::ensure!(
            t.is_contiguous(),
            "internal: tensor-parallel all-reduce of a strided tensor"
        );
        self.run(&self.counts.all_reduce, |g| g.all_reduce_sum_tensor(t))
    }

    fn all_gather(&mut self, t: &Tensor) -> Result<Tensor> {
        let buffer = self.run(&self.counts.all_gather, |g| gather_equal(g, t))?;
        let mut shape = t.size();
        shape[0] *= self.size as i64;
        Ok(buffer.view(shape.as_slice()))
    }

    fn reduce_scatter(&mut self, t: &Tensor) -> Result<Tensor> {
        let mut shape = t.size();
        anyhow::ensure!(
            shape[0] % self.size as i64 == 0,
            "internal: reduce-scatter of {} rows over {} ranks",
            shape[0],
            self.size
        );
        // A copy: the caller's tensor may be saved for its backward.
        let buffer = tch::no_grad(|| t.reshape(-1).copy());
        let n = buffer.numel() / self.size;
        let splits = vec![n; self.size];
        self.run(&self.counts.reduce_scatter, |g| {
            g.reduce_scatter_sum_tensor(&buffer, &splits)
        })?;
        shape[0] /= self.size as i64;
        Ok(buffer
            .narrow(0, (n * self.rank) as i64, n as i64)
            .view(shape.as_slice()))
    }
}
