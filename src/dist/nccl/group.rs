//! [`NcclGroup`]: a CUDA rank's process group, NCCL (through the shim) for device tensors and
//! the CPU ring for everything else.

use std::ffi::{c_int, c_void};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Result};
use tch::Tensor;

use super::loader::{shim, PiecesFn, Shim};
use crate::dist::group::{self, ProcessGroup};
use crate::dist::ring::RingGroup;
use crate::dist::store::Store;
use crate::sys::ffi::{call, ShimError};

/// The key ProcessGroupNCCL's monitor polls at the store's root for a flight-recorder dump
/// signal from another rank (`kStoreDumpKey` in libtorch 2.11).
pub const DUMP_SIGNAL_KEY: &str = "exception_dump";

/// The watchdog's limit for one NCCL collective: longer than the ring's, so that a stalled
/// peer is reported by the ring (which names it) before the watchdog aborts the process.
pub fn watchdog_timeout(collective_timeout: Duration) -> Duration {
    collective_timeout + (collective_timeout / 10).max(Duration::from_secs(60))
}

/// A CUDA rank's process group: NCCL for device tensors, the CPU ring for the rest.
pub struct NcclGroup {
    shim: &'static Shim,
    handle: *mut c_void,
    cpu: RingGroup,
    /// Set by any failed collective: the drop then aborts the communicators instead of
    /// flushing them, since a collective may never finish.
    failed: bool,
    /// An NCCL collective was queued and no ring collective has succeeded since, so a peer may
    /// never have matched it: a drop now must abort too (shutdown would wait for it forever).
    pending: bool,
    // Keeps the store that ProcessGroupNCCL also references alive on the Rust side.
    store: Arc<Store>,
    /// What a subgroup is made with: this process's device, the key prefix, the timeout.
    cuda_device: usize,
    key_prefix: String,
    collective_timeout: Duration,
}

// SAFETY: ProcessGroupNCCL is thread-safe and the handle is only used through `&mut self`.
unsafe impl Send for NcclGroup {}

impl NcclGroup {
    /// Joins the NCCL group on CUDA device `cuda_device` (this process's index), with keys under
    /// `key_prefix` in `store`, and connects eagerly so a broken NCCL setup fails here rather
    /// than at the first all-reduce. `cpu` is the already-formed ring of the same ranks.
    pub fn new(
        store: Arc<Store>,
        cpu: RingGroup,
        cuda_device: usize,
        key_prefix: &str,
        collective_timeout: Duration,
    ) -> Result<NcclGroup> {
        let shim = shim()?;
        let (rank, world) = (cpu.rank(), cpu.world_size());
        let mut handle = std::ptr::null_mut();
        let timeout_ms =
            i64::try_from(watchdog_timeout(collective_timeout).as_millis()).unwrap_or(i64::MAX);
        // SAFETY: the store pointer is live (we hold `store`), the prefix is valid for its
        // length, and the out-pointers are valid.
        let created = call(|err| unsafe {
            (shim.new)(
                store.c10d_ptr(),
                key_prefix.as_ptr().cast(),
                key_prefix.len(),
                rank as c_int,
                world as c_int,
                cuda_device as c_int,
                timeout_ms,
                &mut handle,
                err,
            )
        });
        if let Err(e) = created {
            bail!("rank {rank}: cannot create the NCCL process group on cuda:{cuda_device}: {e}");
        }
        Ok(NcclGroup {
            shim,
            handle,
            cpu,
            failed: false,
            pending: false,
            store,
            cuda_device,
            key_prefix: key_prefix.to_string(),
            collective_timeout,
        })
    }

    /// Records the outcome of an NCCL collective `what` on `t`.
    fn check(&mut self, r: Result<(), ShimError>, what: &str, t: &Tensor) -> Result<()> {
        let Err(e) = r else {
            self.pending = true;
            return Ok(());
        };
        self.failed = true;
        bail!(
            "rank {}: NCCL {what} of {} {:?} elements on {:?} failed: {e}",
            self.rank(),
            t.numel(),
            t.kind(),
            t.device(),
        )
    }

    /// Ring collectives mark the group failed too (a missing peer also strands NCCL); a ring
    /// collective that succeeds shows every rank has queued the NCCL work that came before it,
    /// so that work will complete.
    fn on_cpu<T>(&mut self, f: impl FnOnce(&mut RingGroup) -> Result<T>) -> Result<T> {
        let r = f(&mut self.cpu);
        match r {
            Ok(_) => self.pending = false,
            Err(_) => self.failed = true,
        }
        r
    }
}

impl ProcessGroup for NcclGroup {
    fn side_store(&self) -> Option<(Arc<Store>, String)> {
        Some(self.cpu.side_store())
    }

    fn rank(&self) -> usize {
        self.cpu.rank()
    }

    fn world_size(&self) -> usize {
        self.cpu.world_size()
    }

    fn all_reduce_sum_f32(&mut self, buf: &mut [f32]) -> Result<()> {
        self.on_cpu(|c| c.all_reduce_sum_f32(buf))
    }

    fn broadcast_f32(&mut self, buf: &mut [f32], root: usize) -> Result<()> {
        self.on_cpu(|c| c.broadcast_f32(buf, root))
    }

    fn all_reduce_max_f64(&mut self, x: f64) -> Result<f64> {
        self.on_cpu(|c| c.all_reduce_max_f64(x))
    }

    fn barrier(&mut self) -> Result<()> {
        self.on_cpu(|c| c.barrier())
    }

    fn all_reduce_avg_tensor(&mut self, t: &Tensor) -> Result<()> {
        if !t.device().is_cuda() {
            return group::through_host(t, |b| self.all_reduce_avg_f32(b));
        }
        // SAFETY: `handle` is live; `t.as_ptr()` is tch's `at::Tensor*`, alive for the call.
        let r = call(|err| unsafe {
            (self.shim.all_reduce)(self.handle, t.as_ptr() as *mut c_void, 1, err)
        });
        self.check(r, "all-reduce", t)
    }

    fn broadcast_tensor(&mut self, t: &Tensor, root: usize) -> Result<()> {
        if !t.device().is_cuda() {
            return group::through_host(t, |b| self.broadcast_f32(b, root));
        }
        // SAFETY: as in `all_reduce_avg_tensor`.
        let r = call(|err| unsafe {
            (self.shim.broadcast)(self.handle, t.as_ptr() as *mut c_void, root as c_int, err)
        });
        self.check(r, "broadcast", t)
    }

    fn reduce_scatter_avg_f32(&mut self, buf: &mut [f32], splits: &[usize]) -> Result<()> {
        self.on_cpu(|c| c.reduce_scatter_avg_f32(buf, splits))
    }

    fn reduce_scatter_sum_f32(&mut self, buf: &mut [f32], splits: &[usize]) -> Result<()> {
        self.on_cpu(|c| c.reduce_scatter_sum_f32(buf, splits))
    }

    fn all_reduce_sum_tensor(&mut self, t: &Tensor) -> Result<()> {
        if !t.device().is_cuda() {
            return group::through_host(t, |b| self.all_reduce_sum_f32(b));
        }
        // SAFETY: as in `all_reduce_avg_tensor`.
        let r = call(|err| unsafe {
            (self.shim.all_reduce)(self.handle, t.as_ptr() as *mut c_void, 0, err)
        });
        self.check(r, "all-reduce", t)
    }

    fn reduce_scatter_sum_tensor(&mut self, t: &Tensor, splits: &[usize]) -> Result<()> {
        if !t.device().is_cuda() {
            return group::through_host(t, |b| self.reduce_scatter_sum_f32(b, splits));
        }
        self.scatter_op(t, splits, 0)
    }

    /// The ring of `members` and an NCCL communicator over it, through the same store under
    /// keys of its own (ProcessGroupNCCL's subgroups are groups of their own in c10d too).
    fn subgroup(&mut self, members: &[usize], tag: &str) -> Result<Box<dyn ProcessGroup>> {
        let ring = self.cpu.split(members, tag)?;
        Ok(Box::new(NcclGroup::new(
            self.store.clone(),
            ring,
            self.cuda_device,
            &format!("{}/{tag}", self.key_prefix),
            self.collective_timeout,
        )?))
    }

    fn all_gather_f32(&mut self, buf: &mut [f32], splits: &[usize]) -> Result<()> {
        self.on_cpu(|c| c.all_gather_f32(buf, splits))
    }

    fn reduce_scatter_avg_tensor(&mut self, t: &Tensor, splits: &[usize]) -> Result<()> {
        if !t.device().is_cuda() {
            return group::through_host(t, |b| self.reduce_scatter_avg_f32(b, splits));
        }
        self.scatter_op(t, splits, 1)
    }

    fn all_gather_tensor(&mut self, t: &Tensor, splits: &[usize]) -> Result<()> {
        if !t.device().is_cuda() {
            return group::through_host(t, |b| self.all_gather_f32(b, splits));
        }
        self.pieces_op(t, splits, self.shim.all_gather, "all-gather")
    }

    fn all_to_all_bytes(
        &mut self,
        send: &[u8],
        send_splits: &[usize],
        recv: &mut [u8],
        recv_splits: &[usize],
    ) -> Result<()> {
        self.on_cpu(|c| c.all_to_all_bytes(send, send_splits, recv, recv_splits))
    }

    /// NCCL's all-to-all (ProcessGroupNCCL's `alltoall_base`) for CUDA tensors: the rows in
    /// place on the device; host tensors through the ring.
    fn all_to_all_tensor(
        &mut self,
        send: &Tensor,
        send_rows: &[usize],
        recv_rows: &[usize],
    ) -> Result<Tensor> {
        if !send.device().is_cuda() {
            return group::all_to_all_through_host(self, send, send_rows, recv_rows);
        }
        let (_, shape) = group::all_to_all_output(self.world_size(), send, send_rows, recv_rows)?;
        let input = send.contiguous();
        let output = Tensor::empty(shape.as_slice(), (send.kind(), send.device()));
        let splits = |rows: &[usize]| rows.iter().map(|&r| r as i64).collect::<Vec<_>>();
        let (outs, ins) = (splits(recv_rows), splits(send_rows));
        // SAFETY: `handle` is live; both tensor handles and the splits outlive the call.
        let r = call(|err| unsafe {
            (self.shim.all_to_all)(
                self.handle,
                output.as_ptr() as *mut c_void,
                input.as_ptr() as *mut c_void,
                outs.as_ptr(),
                ins.as_ptr(),
                outs.len() as c_int,
                err,
            )
        });
        self.check(r, "all-to-all", send)?;
        Ok(output)
    }
}

impl NcclGroup {
    /// The reduce-scatter of the shim (op 0 = sum, 1 = mean) on a flat CUDA tensor.
    fn scatter_op(&mut self, t: &Tensor, splits: &[usize], op: c_int) -> Result<()> {
        group::check_splits(t.numel(), splits, self.world_size())?;
        let splits: Vec<i64> = splits.iter().map(|&s| s as i64).collect();
        // SAFETY: `handle` is live; the tensor handle and the splits outlive the call.
        let r = call(|err| unsafe {
            (self.shim.reduce_scatter)(
                self.handle,
                t.as_ptr() as *mut c_void,
                splits.as_ptr(),
                splits.len() as c_int,
                op,
                err,
            )
        });
        self.check(r, "reduce-scatter", t)
    }

    /// An uneven collective of the shim on a flat CUDA tensor.
    fn pieces_op(&mut self, t: &Tensor, splits: &[usize], op: PiecesFn, what: &str) -> Result<()> {
        group::check_splits(t.numel(), splits, self.world_size())?;
        let splits: Vec<i64> = splits.iter().map(|&s| s as i64).collect();
        // SAFETY: `handle` is live; the tensor handle and the splits outlive the call.
        let r = call(|err| unsafe {
            op(
                self.handle,
                t.as_ptr() as *mut c_void,
                splits.as_ptr(),
                splits.len() as c_int,
                err,
            )
        });
        self.check(r, what, t)
    }
}

impl Drop for NcclGroup {
    fn drop(&mut self) {
        let abort = self.failed || self.pending;
        // SAFETY: `handle` is live and never used after this.
        unsafe { (self.shim.free)(self.handle, c_int::from(abort)) };
    }
}
