//! The collectives' algorithms over the ring (the [`ProcessGroup`] implementation): a ring
//! all-reduce (reduce-scatter, then all-gather), a pipelined chain broadcast, the scalar
//! maximum and barrier as `world - 1` ring steps, and an all-to-all relayed along the ring.
//!
//! Every collective is a sequence of *steps*; in each step a rank sends one message to its
//! successor and receives one from its predecessor, concurrently (a scoped thread does the send
//! when the payload could fill the socket buffers, so two ranks blocked in `write` on each
//! other cannot deadlock).

use std::net::Shutdown;
use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{ensure, Result};

use super::diagnose::{Fail, FailKind, Side};
use super::wire::{
    f32_bytes, f32_bytes_mut, recv_msg, send_msg, Header, INLINE_SEND, OP_ALL_GATHER,
    OP_ALL_TO_ALL, OP_BARRIER, OP_BROADCAST, OP_MAX, OP_REDUCE_SCATTER,
};
use super::RingGroup;
use crate::dist::group::{check_all_to_all, check_splits, max_f64, piece, ProcessGroup};
use crate::dist::store::Store;

/// Broadcast pipelines the buffer in segments of this many elements (4 MiB) so ranks down the
/// chain forward early segments while later ones are still arriving.
pub(super) const BCAST_SEGMENT: usize = 1 << 20;

/// Chunk `i` of `n` elements split `w` ways; sizes differ by at most one.
fn chunk(n: usize, w: usize, i: usize) -> Range<usize> {
    // u128 so n * i cannot overflow even for absurd buffers.
    let at = |k: usize| ((n as u128 * k as u128) / w as u128) as usize;
    at(i)..at(i + 1)
}

/// Disjoint views: `a` to read, `b` to write.
fn split_pair(buf: &mut [f32], a: Range<usize>, b: Range<usize>) -> (&[f32], &mut [f32]) {
    if b.is_empty() {
        return (&buf[a], &mut []);
    }
    if a.is_empty() {
        return (&[], &mut buf[b]);
    }
    if a.end <= b.start {
        let (lo, hi) = buf.split_at_mut(b.start);
        (&lo[a], &mut hi[..b.len()])
    } else {
        assert!(b.end <= a.start, "overlapping ring chunks {a:?} and {b:?}");
        let (lo, hi) = buf.split_at_mut(a.start);
        (&hi[..a.len()], &mut lo[b])
    }
}

impl RingGroup {
    /// One ring step: send `send` (with header `out`) to the successor while receiving a
    /// message with header `expect` from the predecessor into `recv`.
    fn exchange(
        &mut self,
        out: Header,
        send: &[u8],
        expect: Header,
        recv: &mut [u8],
    ) -> Result<(), Fail> {
        self.sent += send.len() as u64;
        let next = self
            .next
            .as_ref()
            .expect("ring sockets exist when world > 1");
        let prev = self
            .prev
            .as_ref()
            .expect("ring sockets exist when world > 1");
        if send.len() <= INLINE_SEND {
            send_msg(next, out, send)?;
            return recv_msg(prev, expect, recv);
        }
        std::thread::scope(|s| {
            let sender = s.spawn(|| send_msg(next, out, send));
            let r = recv_msg(prev, expect, recv);
            if r.is_err() {
                // Unblock the sender now instead of waiting out its write timeout; the group is
                // poisoned by the caller anyway.
                let _ = next.shutdown(Shutdown::Both);
            }
            let w = sender.join().unwrap_or_else(|_| {
                Err(Fail {
                    side: Side::Send,
                    kind: FailKind::Io,
                    detail: "sender thread panicked".to_owned(),
                })
            });
            // The receive error is the informative one when both fail (we caused the send's).
            r.and(w)
        })
    }

    /// One reduce-scatter step: send `sc`, receive into scratch and add into `rc`.
    fn reduce_step(
        &mut self,
        buf: &mut [f32],
        sc: Range<usize>,
        rc: Range<usize>,
        aux: u64,
    ) -> Result<(), Fail> {
        let mut scratch = std::mem::take(&mut self.scratch);
        scratch.resize(scratch.len().max(rc.len()), 0.0);
        let (send, dst) = split_pair(buf, sc, rc);
        let tmp = &mut scratch[..dst.len()];
        let out = self.header(OP_REDUCE_SCATTER, send.len() * 4, aux);
        let exp = self.header(OP_REDUCE_SCATTER, dst.len() * 4, aux);
        let r = self.exchange(out, f32_bytes(send), exp, f32_bytes_mut(tmp));
        if r.is_ok() {
            for (d, x) in dst.iter_mut().zip(tmp.iter()) {
                *d += *x;
            }
        }
        self.scratch = scratch;
        r
    }

    fn header(&self, op: u32, nbytes: usize, aux: u64) -> Header {
        Header {
            op,
            seq: self.seq,
            nbytes: nbytes as u64,
            aux,
        }
    }
}

impl ProcessGroup for RingGroup {
    fn side_store(&self) -> Option<(Arc<Store>, String)> {
        Some(RingGroup::side_store(self))
    }

    fn rank(&self) -> usize {
        self.rank
    }

    fn subgroup(&mut self, members: &[usize], tag: &str) -> Result<Box<dyn ProcessGroup>> {
        Ok(Box::new(self.split(members, tag)?))
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn bytes_sent(&self) -> Option<u64> {
        Some(self.sent)
    }

    /// Reduce-scatter then all-gather over `world` chunks. Chunk `c` is summed in ring order
    /// starting at rank `c` (((x_c + x_{c+1}) + x_{c+2}) ...), fixed for a world size, and the
    /// all-gather copies the owner's bits to everyone, so all ranks agree bitwise.
    fn all_reduce_sum_f32(&mut self, buf: &mut [f32]) -> Result<()> {
        const WHAT: &str = "all-reduce";
        self.begin(WHAT)?;
        let (r, w, n) = (self.rank, self.world, buf.len());
        if w == 1 {
            return Ok(());
        }
        let started = Instant::now();
        let mut scratch = std::mem::take(&mut self.scratch);
        scratch.resize(n.div_ceil(w), 0.0);
        let total = n as u64;
        // Reduce-scatter: after step s, chunk (r-s-1) holds the sum of s+2 ranks' values.
        for s in 0..w - 1 {
            let sc = chunk(n, w, (r + w - s) % w);
            let rc = chunk(n, w, (r + w - s - 1) % w);
            let (send, dst) = split_pair(buf, sc, rc);
            let tmp = &mut scratch[..dst.len()];
            let out = self.header(OP_REDUCE_SCATTER, send.len() * 4, total);
            let exp = self.header(OP_REDUCE_SCATTER, dst.len() * 4, total);
            if let Err(f) = self.exchange(out, f32_bytes(send), exp, f32_bytes_mut(tmp)) {
                self.scratch = scratch;
                return Err(self.fail(WHAT, started, f));
            }
            for (d, x) in dst.iter_mut().zip(tmp.iter()) {
                *d += *x;
            }
        }
        self.scratch = scratch;
        // All-gather: rank r now owns the reduced chunk r+1; pass owned chunks around.
        for s in 0..w - 1 {
            let sc = chunk(n, w, (r + 1 + w - s) % w);
            let rc = chunk(n, w, (r + w - s) % w);
            let (send, dst) = split_pair(buf, sc, rc);
            let out = self.header(OP_ALL_GATHER, send.len() * 4, total);
            let exp = self.header(OP_ALL_GATHER, dst.len() * 4, total);
            if let Err(f) = self.exchange(out, f32_bytes(send), exp, f32_bytes_mut(dst)) {
                return Err(self.fail(WHAT, started, f));
            }
        }
        Ok(())
    }

    /// Reduce-scatter over uneven pieces: in step s a rank sends piece (r-s-1), which it
    /// finished accumulating in step s-1, and adds the received piece (r-s-2) into place; the
    /// piece received last is its own. Piece c is summed in ring order starting at rank c+1, so
    /// the result depends only on the world size and the splits, and every element crosses
    /// the network once per step at most: each rank sends (N-1)/N of the buffer. (The mean is
    /// the trait's: this sum, then this rank's piece divided by N.)
    fn reduce_scatter_sum_f32(&mut self, buf: &mut [f32], splits: &[usize]) -> Result<()> {
        const WHAT: &str = "reduce-scatter";
        check_splits(buf.len(), splits, self.world)?;
        self.begin(WHAT)?;
        let (r, w) = (self.rank, self.world);
        if w == 1 {
            return Ok(());
        }
        let started = Instant::now();
        let aux = splits_tag(splits);
        for s in 0..w - 1 {
            let sc = piece(splits, (r + 2 * w - s - 1) % w);
            let rc = piece(splits, (r + 2 * w - s - 2) % w);
            if let Err(f) = self.reduce_step(buf, sc, rc, aux) {
                return Err(self.fail(WHAT, started, f));
            }
        }
        Ok(())
    }

    /// All-gather over uneven pieces: in step s a rank forwards piece (r-s) and receives piece
    /// (r-s-1) in place. Pure copies, so every rank ends with its owners' bits.
    fn all_gather_f32(&mut self, buf: &mut [f32], splits: &[usize]) -> Result<()> {
        const WHAT: &str = "all-gather";
        check_splits(buf.len(), splits, self.world)?;
        self.begin(WHAT)?;
        let (r, w) = (self.rank, self.world);
        if w == 1 {
            return Ok(());
        }
        let started = Instant::now();
        let aux = splits_tag(splits);
        for s in 0..w - 1 {
            let sc = piece(splits, (r + w - s) % w);
            let rc = piece(splits, (r + 2 * w - s - 1) % w);
            let (send, dst) = split_pair(buf, sc, rc);
            let out = self.header(OP_ALL_GATHER, send.len() * 4, aux);
            let exp = self.header(OP_ALL_GATHER, dst.len() * 4, aux);
            if let Err(f) = self.exchange(out, f32_bytes(send), exp, f32_bytes_mut(dst)) {
                return Err(self.fail(WHAT, started, f));
            }
        }
        Ok(())
    }

    /// All-to-all relayed along the ring (each rank is connected to its neighbours only):
    /// in step 1 a rank sends its successor the pieces for every other rank, in order of
    /// distance; in step s it receives from its predecessor the bundle that left rank r−s,
    /// keeps the first piece (its own) and forwards the rest. After `world − 1` steps every
    /// piece has arrived. Each step is two messages: the bundle's piece lengths (which the
    /// receiver checks against what it expects of its own piece), then the bundle. A piece
    /// travels as many hops as its distance, so a rank sends (w − 1)/2 times its payload on
    /// average (NCCL, on GPUs, sends each piece once, directly).
    fn all_to_all_bytes(
        &mut self,
        send: &[u8],
        send_splits: &[usize],
        recv: &mut [u8],
        recv_splits: &[usize],
    ) -> Result<()> {
        const WHAT: &str = "all-to-all";
        check_all_to_all(send, send_splits, recv, recv_splits, self.world)?;
        self.begin(WHAT)?;
        let (r, w) = (self.rank, self.world);
        recv[piece(recv_splits, r)].copy_from_slice(&send[piece(send_splits, r)]);
        if w == 1 {
            return Ok(());
        }
        let started = Instant::now();
        // The bundle to forward: its pieces' lengths, for ranks r+s, r+s+1, … (in step s).
        let mut lens: Vec<u64> = (1..w).map(|d| send_splits[(r + d) % w] as u64).collect();
        let mut bundle: Vec<u8> = (1..w)
            .flat_map(|d| send[piece(send_splits, (r + d) % w)].iter().copied())
            .collect();
        for s in 1..w {
            let origin = (r + w - s) % w;
            let count = w - s;
            let head = self.header(OP_ALL_TO_ALL, 8 * count, s as u64);
            let out: Vec<u8> = lens.iter().flat_map(|l| l.to_le_bytes()).collect();
            let mut got = vec![0u8; 8 * count];
            if let Err(f) = self.exchange(head, &out, head, &mut got) {
                return Err(self.fail(WHAT, started, f));
            }
            let incoming: Vec<u64> = got
                .chunks(8)
                .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")))
                .collect();
            let want = recv_splits[origin] as u64;
            if incoming[0] != want {
                let m = format!(
                    "{WHAT} #{}{}: rank {} sends rank {} {} bytes, which expects {want} from it \
                     (the ranks disagree on the pieces)",
                    self.seq,
                    self.where_(),
                    self.global(origin),
                    self.global(r),
                    incoming[0]
                );
                self.poison(&m);
                anyhow::bail!(m);
            }
            let total: u64 = incoming.iter().sum();
            let mut next = vec![0u8; total as usize];
            let out = self.header(OP_ALL_TO_ALL, bundle.len(), s as u64);
            let exp = self.header(OP_ALL_TO_ALL, next.len(), s as u64);
            if let Err(f) = self.exchange(out, &bundle, exp, &mut next) {
                return Err(self.fail(WHAT, started, f));
            }
            let mine = incoming[0] as usize;
            recv[piece(recv_splits, origin)].copy_from_slice(&next[..mine]);
            next.drain(..mine);
            bundle = next;
            lens = incoming[1..].to_vec();
        }
        Ok(())
    }

    /// A pipelined chain root → root+1 → … → root-1, in segments of 4 MiB. The chain is not a
    /// cycle, so blocking writes always drain and no helper thread is needed.
    fn broadcast_f32(&mut self, buf: &mut [f32], root: usize) -> Result<()> {
        const WHAT: &str = "broadcast";
        ensure!(
            root < self.world,
            "broadcast root {root} out of range for a world of {}",
            self.world
        );
        self.begin(WHAT)?;
        let (r, w, n) = (self.rank, self.world, buf.len());
        if w == 1 {
            return Ok(());
        }
        let started = Instant::now();
        let pos = (r + w - root) % w; // distance from the root along the chain
        let op = OP_BROADCAST | ((root as u32) << 8);
        // At least one (possibly empty) segment, so an empty broadcast still synchronises and
        // checks that all ranks agree on root and length.
        let segments = n.div_ceil(BCAST_SEGMENT).max(1);
        for k in 0..segments {
            let seg = (k * BCAST_SEGMENT).min(n)..((k + 1) * BCAST_SEGMENT).min(n);
            let h = self.header(op, seg.len() * 4, n as u64);
            if pos > 0 {
                let prev = self
                    .prev
                    .as_ref()
                    .expect("ring sockets exist when world > 1");
                if let Err(f) = recv_msg(prev, h, f32_bytes_mut(&mut buf[seg.clone()])) {
                    return Err(self.fail(WHAT, started, f));
                }
            }
            if pos < w - 1 {
                let next = self
                    .next
                    .as_ref()
                    .expect("ring sockets exist when world > 1");
                self.sent += (seg.len() * 4) as u64;
                if let Err(f) = send_msg(next, h, f32_bytes(&buf[seg])) {
                    return Err(self.fail(WHAT, started, f));
                }
            }
        }
        Ok(())
    }

    /// `world - 1` steps of passing the running maximum to the successor: after step s a rank
    /// has seen the values of the s+1 ranks before it.
    fn all_reduce_max_f64(&mut self, x: f64) -> Result<f64> {
        const WHAT: &str = "all-reduce-max";
        self.begin(WHAT)?;
        let mut acc = max_f64(x, x);
        let started = Instant::now();
        for s in 0..self.world.saturating_sub(1) {
            let h = self.header(OP_MAX, 8, s as u64);
            let mut got = [0u8; 8];
            if let Err(f) = self.exchange(h, &acc.to_ne_bytes(), h, &mut got) {
                return Err(self.fail(WHAT, started, f));
            }
            acc = max_f64(acc, f64::from_ne_bytes(got));
        }
        Ok(acc)
    }

    /// `world - 1` empty ring steps: the message a rank receives in step s was sent only after
    /// its sender received step s-1, so after the last step every rank has entered.
    fn barrier(&mut self) -> Result<()> {
        const WHAT: &str = "barrier";
        self.begin(WHAT)?;
        let started = Instant::now();
        for s in 0..self.world.saturating_sub(1) {
            let h = self.header(OP_BARRIER, 0, s as u64);
            if let Err(f) = self.exchange(h, &[], h, &mut []) {
                return Err(self.fail(WHAT, started, f));
            }
        }
        Ok(())
    }
}

/// A fingerprint of the pieces, carried in every message of an uneven collective, so ranks that
/// disagree on them fail with a header mismatch instead of mixing data.
fn splits_tag(splits: &[usize]) -> u64 {
    splits.iter().fold(0xcbf2_9ce4_8422_2325, |h, &x| {
        (h ^ x as u64).wrapping_mul(0x0000_0100_0000_01b3)
    })
}
