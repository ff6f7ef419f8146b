//! [`Traced`]: a [`ProcessGroup`] that records every collective of the group it wraps.
//!
//! Every method of the trait is forwarded explicitly, defaults included: a backend may
//! override a default (NCCL reduces tensors on the GPU), and a forwarding left to the trait's
//! default would silently bypass that override. A test (`traced_forwards_every_method`) reads
//! the trait's source and fails naming any method added to the trait but not forwarded here;
//! a new collective is one more method in the shape of the others below.

use anyhow::Result;
use tch::Tensor;

use super::record::Outcome;
use super::recorder::Forensics;
use crate::dist::group::ProcessGroup;

/// Records each collective of `inner` in a [`Forensics`] (op, number, bytes, start, duration,
/// outcome); a failed one also prints the rank's history, once.
pub struct Traced {
    inner: Box<dyn ProcessGroup>,
    log: &'static Forensics,
    /// The subgroup's tag (its records read `op@tag`); None for the world group.
    group: Option<String>,
}

impl Traced {
    pub fn new(inner: Box<dyn ProcessGroup>, log: &'static Forensics) -> Traced {
        Traced {
            inner,
            log,
            group: None,
        }
    }

    fn run<T>(
        &mut self,
        op: &str,
        bytes: usize,
        f: impl FnOnce(&mut dyn ProcessGroup) -> Result<T>,
    ) -> Result<T> {
        let id = self.log.begin_in(self.group.as_deref(), op, bytes as u64);
        let result = f(&mut *self.inner);
        let outcome = match &result {
            Ok(_) => Outcome::Done,
            // The ring says "<op> #N timed out after ..." (dist/ring/diagnose.rs).
            Err(e) if format!("{e:#}").contains(" timed out after ") => Outcome::TimedOut,
            Err(_) => Outcome::Failed,
        };
        if let Some(history) = self.log.end(id, outcome) {
            eprint!("{history}");
        }
        result
    }
}

fn tensor_bytes(t: &Tensor) -> usize {
    t.numel() * t.kind().elt_size_in_bytes()
}

impl ProcessGroup for Traced {
    fn side_store(&self) -> Option<(std::sync::Arc<crate::dist::store::Store>, String)> {
        self.inner.side_store()
    }

    fn rank(&self) -> usize {
        self.inner.rank()
    }

    fn world_size(&self) -> usize {
        self.inner.world_size()
    }

    fn all_reduce_sum_f32(&mut self, buf: &mut [f32]) -> Result<()> {
        self.run("all-reduce", buf.len() * 4, |g| g.all_reduce_sum_f32(buf))
    }

    fn all_reduce_avg_f32(&mut self, buf: &mut [f32]) -> Result<()> {
        self.run("all-reduce", buf.len() * 4, |g| g.all_reduce_avg_f32(buf))
    }

    fn broadcast_f32(&mut self, buf: &mut [f32], root: usize) -> Result<()> {
        self.run("broadcast", buf.len() * 4, |g| g.broadcast_f32(buf, root))
    }

    fn all_reduce_max_f64(&mut self, x: f64) -> Result<f64> {
        self.run("all-reduce-max", 8, |g| g.all_reduce_max_f64(x))
    }

    fn barrier(&mut self) -> Result<()> {
        self.run("barrier", 0, |g| g.barrier())
    }

    fn bytes_sent(&self) -> Option<u64> {
        self.inner.bytes_sent()
    }

    fn all_reduce_avg_tensor(&mut self, t: &Tensor) -> Result<()> {
        self.run("all-reduce", tensor_bytes(t), |g| {
            g.all_reduce_avg_tensor(t)
        })
    }

    fn broadcast_tensor(&mut self, t: &Tensor, root: usize) -> Result<()> {
        self.run("broadcast", tensor_bytes(t), |g| {
            g.broadcast_tensor(t, root)
        })
    }

    fn reduce_scatter_avg_f32(&mut self, buf: &mut [f32], splits: &[usize]) -> Result<()> {
        self.run("reduce-scatter", buf.len() * 4, |g| {
            g.reduce_scatter_avg_f32(buf, splits)
        })
    }

    fn reduce_scatter_sum_f32(&mut self, buf: &mut [f32], splits: &[usize]) -> Result<()> {
        self.run("reduce-scatter", buf.len() * 4, |g| {
            g.reduce_scatter_sum_f32(buf, splits)
        })
    }

    fn all_reduce_sum_tensor(&mut self, t: &Tensor) -> Result<()> {
        self.run("all-reduce", tensor_bytes(t), |g| {
            g.all_reduce_sum_tensor(t)
        })
    }

    fn reduce_scatter_sum_tensor(&mut self, t: &Tensor, splits: &[usize]) -> Result<()> {
        self.run("reduce-scatter", tensor_bytes(t), |g| {
            g.reduce_scatter_sum_tensor(t, splits)
        })
    }

    fn all_gather_f32(&mut self, buf: &mut [f32], splits: &[usize]) -> Result<()> {
        self.run("all-gather", buf.len() * 4, |g| {
            g.all_gather_f32(buf, splits)
        })
    }

    fn all_to_all_bytes(
        &mut self,
        send: &[u8],
        send_splits: &[usize],
        recv: &mut [u8],
        recv_splits: &[usize],
    ) -> Result<()> {
        self.run("all-to-all", send.len(), |g| {
            g.all_to_all_bytes(send, send_splits, recv, recv_splits)
        })
    }

    fn all_to_all_tensor(
        &mut self,
        send: &Tensor,
        send_rows: &[usize],
        recv_rows: &[usize],
    ) -> Result<Tensor> {
        self.run("all-to-all", tensor_bytes(send), |g| {
            g.all_to_all_tensor(send, send_rows, recv_rows)
        })
    }

    /// Forming a subgroup is no collective of this group (its numbering stays the ring's); the
    /// subgroup's own collectives go into this rank's history too, numbered in the subgroup and
    /// named `op@tag`.
    fn subgroup(&mut self, members: &[usize], tag: &str) -> Result<Box<dyn ProcessGroup>> {
        let inner = self.inner.subgroup(members, tag)?;
        let group = match &self.group {
            Some(parent) => format!("{parent}/{tag}"),
            None => tag.to_string(),
        };
        Ok(Box::new(Traced {
            inner,
            log: self.log,
            group: Some(group),
        }))
    }

    fn all_gather_f64(&mut self, x: f64) -> Result<Vec<f64>> {
        self.run("all-gather", 8, |g| g.all_gather_f64(x))
    }

    fn all_reduce_sum_u64(&mut self, buf: &mut [u64]) -> Result<()> {
        self.run("all-reduce", 12 * buf.len(), |g| g.all_reduce_sum_u64(buf))
    }

    fn reduce_scatter_avg_tensor(&mut self, t: &Tensor, splits: &[usize]) -> Result<()> {
        self.run("reduce-scatter", tensor_bytes(t), |g| {
            g.reduce_scatter_avg_tensor(t, splits)
        })
    }

    fn all_gather_tensor(&mut self, t: &Tensor, splits: &[usize]) -> Result<()> {
        self.run("all-gather", tensor_bytes(t), |g| {
            g.all_gather_tensor(t, splits)
        })
    }
}
