//! CPU collectives as a ring over plain TCP, bootstrapped through the [`Store`].
//!
//! Topology: rank `r` holds one connection to `r+1` (it only writes to it) and one from `r-1`
//! (it only reads from it). Every collective is a sequence of *steps*; in each step a rank sends
//! one message to its successor and receives one from its predecessor, concurrently (a scoped
//! thread does the send when the payload could fill the socket buffers, so two ranks blocked in
//! `write` on each other cannot deadlock).
//!
//! Every message carries a header `(magic, op, seq, nbytes, aux)`; the receiver checks it
//! against what it expects, so ranks that call collectives in different orders or with
//! different sizes get an error instead of silently mixing data.
//!
//! Failure naming: before each collective a rank records its sequence number under
//! `<prefix>seq/<rank>` (a fire-and-forget TCPStore `set`: one small socket write, no reply).
//! When a collective times out or a socket breaks, the rank reads everybody's sequence number
//! and names the ranks that never reached the collective; if the store itself is unreachable it
//! names the store host. After any failure the group is poisoned: the byte streams may be out of
//! step, so every later call fails with the original message.
//!
//! The wire format is native-endian `f32`/`f64`: all ranks must share endianness (every
//! platform libtorch supports for training is little-endian).

use std::io::{self, Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs, UdpSocket};
use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, ensure, Context, Result};

use super::group::{max_f64, ProcessGroup};
use super::store::{Store, StoreError, StoreErrorKind};

/// Handshake magic; also separates lockstep rings from anything else that dials the port.
const HELLO_MAGIC: [u8; 8] = *b"LKSTRNG1";
/// Per-message magic.
const MSG_MAGIC: u32 = 0x4c4b_5352; // "LKSR"
const HEADER_LEN: usize = 32;
/// Payloads up to this size are written before reading, without a helper thread: they fit in
/// any socket send buffer, so the write cannot block on the peer.
const INLINE_SEND: usize = 8 << 10;
/// Broadcast pipelines the buffer in segments of this many elements (4 MiB) so ranks down the
/// chain forward early segments while later ones are still arriving.
const BCAST_SEGMENT: usize = 1 << 20;

const OP_REDUCE_SCATTER: u32 = 1;
const OP_ALL_GATHER: u32 = 2;
const OP_BROADCAST: u32 = 3;
const OP_MAX: u32 = 4;
const OP_BARRIER: u32 = 5;

/// Settings beyond the basics of [`RingGroup::new`].
#[derive(Debug, Clone)]
pub struct RingConfig {
    /// Namespace of this group's store keys. Must differ between groups sharing a store, and
    /// between restarts that reuse a store (torchrun's agent store survives worker restarts).
    pub key_prefix: String,
    /// Who hosts the store, for error messages ("rank 0", "the torchrun agent on node0").
    pub store_owner: String,
}

impl Default for RingConfig {
    fn default() -> Self {
        RingConfig {
            key_prefix: "ring/".to_owned(),
            store_owner: "rank 0".to_owned(),
        }
    }
}

/// A process group whose collectives run over a TCP ring. See the module docs.
pub struct RingGroup {
    store: Arc<Store>,
    rank: usize,
    world: usize,
    timeout: Duration,
    cfg: RingConfig,
    /// Connection to `rank + 1`, write-only. `None` in a world of one.
    next: Option<TcpStream>,
    /// Connection from `rank - 1`, read-only. `None` in a world of one.
    prev: Option<TcpStream>,
    /// Number of the collective in progress (or last finished); the first is #1.
    seq: u64,
    /// Receive buffer for reduce-scatter, kept to avoid reallocating per call.
    scratch: Vec<f32>,
    /// Set after a failure: the message every later call returns.
    broken: Option<String>,
}

/// Which of our two sockets failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Side {
    Send,
    Recv,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum FailKind {
    Timeout,
    Closed,
    /// The peer sent a header we did not expect: mismatched collectives.
    Protocol,
    Io,
}

#[derive(Debug)]
struct Fail {
    side: Side,
    kind: FailKind,
    detail: String,
}

impl Fail {
    fn io(side: Side, e: &io::Error) -> Fail {
        let kind = match e.kind() {
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => FailKind::Timeout,
            io::ErrorKind::UnexpectedEof
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::BrokenPipe
            | io::ErrorKind::NotConnected => FailKind::Closed,
            _ => FailKind::Io,
        };
        // EAGAIN's text ("Resource temporarily unavailable") is how a socket timeout surfaces;
        // say what it means.
        let detail = match kind {
            FailKind::Timeout => "socket timed out".to_owned(),
            _ => e.to_string(),
        };
        Fail { side, kind, detail }
    }
}

/// What the store says about another rank, read when a collective fails.
#[derive(Debug)]
struct PeerState {
    rank: usize,
    /// Last collective it entered.
    last: Option<u64>,
    /// Its failure report for the collective in question.
    failure: Option<String>,
}

/// Message header. `aux` is op-specific (total length for broadcast, step for the others).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Header {
    op: u32,
    seq: u64,
    nbytes: u64,
    aux: u64,
}

impl Header {
    fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..4].copy_from_slice(&MSG_MAGIC.to_le_bytes());
        b[4..8].copy_from_slice(&self.op.to_le_bytes());
        b[8..16].copy_from_slice(&self.seq.to_le_bytes());
        b[16..24].copy_from_slice(&self.nbytes.to_le_bytes());
        b[24..32].copy_from_slice(&self.aux.to_le_bytes());
        b
    }

    fn decode(b: &[u8; HEADER_LEN]) -> Option<Header> {
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().unwrap());
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap());
        (u32_at(0) == MSG_MAGIC).then(|| Header {
            op: u32_at(4),
            seq: u64_at(8),
            nbytes: u64_at(16),
            aux: u64_at(24),
        })
    }
}

fn op_name(op: u32) -> String {
    match op & 0xff {
        OP_REDUCE_SCATTER => "all-reduce (reduce-scatter)".to_owned(),
        OP_ALL_GATHER => "all-reduce (all-gather)".to_owned(),
        OP_BROADCAST => format!("broadcast from rank {}", op >> 8),
        OP_MAX => "all-reduce-max".to_owned(),
        OP_BARRIER => "barrier".to_owned(),
        _ => format!("unknown op {op}"),
    }
}

/// Handshake on a fresh connection, sent both ways: connector → acceptor ("I am rank r of this
/// run"), then acceptor → connector as the acknowledgement.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Hello {
    nonce: u64,
    rank: u32,
    world: u32,
}

impl Hello {
    const LEN: usize = 24;

    fn encode(&self) -> [u8; Self::LEN] {
        let mut b = [0u8; Self::LEN];
        b[0..8].copy_from_slice(&HELLO_MAGIC);
        b[8..16].copy_from_slice(&self.nonce.to_le_bytes());
        b[16..20].copy_from_slice(&self.rank.to_le_bytes());
        b[20..24].copy_from_slice(&self.world.to_le_bytes());
        b
    }

    fn read(s: &mut TcpStream) -> io::Result<Option<Hello>> {
        let mut b = [0u8; Self::LEN];
        s.read_exact(&mut b)?;
        if b[0..8] != HELLO_MAGIC {
            return Ok(None);
        }
        Ok(Some(Hello {
            nonce: u64::from_le_bytes(b[8..16].try_into().unwrap()),
            rank: u32::from_le_bytes(b[16..20].try_into().unwrap()),
            world: u32::from_le_bytes(b[20..24].try_into().unwrap()),
        }))
    }
}

fn f32_bytes(s: &[f32]) -> &[u8] {
    // SAFETY: f32 has no padding, u8 has alignment 1, and the byte length covers exactly the
    // same allocation; the borrow keeps `s` alive and immutable.
    unsafe { std::slice::from_raw_parts(s.as_ptr().cast(), std::mem::size_of_val(s)) }
}

fn f32_bytes_mut(s: &mut [f32]) -> &mut [u8] {
    // SAFETY: as in `f32_bytes`, and every bit pattern is a valid f32, so arbitrary bytes
    // written through the view keep the slice valid.
    unsafe { std::slice::from_raw_parts_mut(s.as_mut_ptr().cast(), std::mem::size_of_val(s)) }
}

/// Chunk `i` of `n` elements split `w` ways; sizes differ by at most one.
fn chunk(n: usize, w: usize, i: usize) -> Range<usize> {
    // u128 so n * i cannot overflow even for absurd buffers.
    let at = |k: usize| ((n as u128 * k as u128) / w as u128) as usize;
    at(i)..at(i + 1)
}

/// Disjoint views: `a` to read, `b` to write.
fn split_pair(buf: &mut [f32], a: Range<usize>, b: Range<usize>) -> (&[f32], &mut [f32]) {
    if a.end <= b.start {
        let (lo, hi) = buf.split_at_mut(b.start);
        (&lo[a], &mut hi[..b.len()])
    } else {
        assert!(b.end <= a.start, "overlapping ring chunks {a:?} and {b:?}");
        let (lo, hi) = buf.split_at_mut(a.start);
        (&hi[..a.len()], &mut lo[b])
    }
}

fn fmt_secs(d: Duration) -> String {
    let s = d.as_secs_f64();
    if (s - s.round()).abs() < 1e-9 {
        format!("{s:.0} s")
    } else {
        format!("{s:.1} s")
    }
}

/// The local address whose route leads to `host:port`, so peers on other nodes can dial us.
/// A connected UDP socket makes the kernel pick the route; no packet is sent.
fn route_ip(host: &str, port: u16) -> Result<IpAddr> {
    let target = (host, port)
        .to_socket_addrs()
        .with_context(|| format!("cannot resolve the store host {host:?}"))?
        .next()
        .ok_or_else(|| anyhow!("the store host {host:?} resolves to no address"))?;
    let any: SocketAddr = if target.is_ipv4() {
        "0.0.0.0:0".parse().unwrap()
    } else {
        "[::]:0".parse().unwrap()
    };
    let udp = UdpSocket::bind(any)?;
    udp.connect(target)
        .with_context(|| format!("no route to the store host {target}"))?;
    Ok(udp.local_addr()?.ip())
}

fn gen_nonce() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    // RandomState is seeded from the OS RNG; time and pid make collisions across runs moot.
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0),
    );
    h.write_u32(std::process::id());
    h.finish()
}

impl RingGroup {
    /// Joins the ring of `world` ranks as `rank`, with default [`RingConfig`]. Every rank must
    /// call this (on its own `Store` handle or a shared one) within `timeout` of the others.
    /// `timeout` also bounds how long any collective waits without progress.
    pub fn new(
        store: Arc<Store>,
        rank: usize,
        world: usize,
        timeout: Duration,
    ) -> Result<RingGroup> {
        Self::with_config(store, rank, world, timeout, RingConfig::default())
    }

    /// [`RingGroup::new`] with explicit key prefix and store-owner description.
    pub fn with_config(
        store: Arc<Store>,
        rank: usize,
        world: usize,
        timeout: Duration,
        cfg: RingConfig,
    ) -> Result<RingGroup> {
        ensure!(world >= 1, "a ring needs at least one rank");
        ensure!(
            rank < world,
            "rank {rank} out of range for a world of {world}"
        );
        ensure!(
            world <= u32::MAX as usize,
            "world of {world} ranks is too large"
        );
        let mut g = RingGroup {
            store,
            rank,
            world,
            timeout,
            cfg,
            next: None,
            prev: None,
            seq: 0,
            scratch: Vec::new(),
            broken: None,
        };
        if world > 1 {
            g.bootstrap()
                .with_context(|| format!("rank {rank} could not join the ring of {world} ranks"))?;
        }
        Ok(g)
    }

    fn key(&self, what: &str) -> String {
        format!("{}{what}", self.cfg.key_prefix)
    }

    fn store_gone(&self, e: &anyhow::Error) -> Option<String> {
        match e.downcast_ref::<StoreError>() {
            Some(se) if se.kind == StoreErrorKind::Unreachable => Some(format!(
                "the rendezvous store at {}:{} is unreachable: {} (which hosts it) or its host is gone",
                self.store.host(),
                self.store.port(),
                self.cfg.store_owner
            )),
            _ => None,
        }
    }

    /// Waits for `key` and reads it; `who` explains a timeout ("rank 3 did not publish ...").
    fn await_key(
        &self,
        key: &str,
        deadline: Instant,
        who: impl FnOnce() -> String,
    ) -> Result<Vec<u8>> {
        let left = deadline.saturating_duration_since(Instant::now());
        if let Err(e) = self.store.wait(&[key], left) {
            if let Some(m) = self.store_gone(&e) {
                bail!("{m}");
            }
            return Err(e.context(who()));
        }
        self.store.get(key)
    }

    fn bootstrap(&mut self) -> Result<()> {
        let deadline = Instant::now() + self.timeout;
        let (rank, world) = (self.rank, self.world);
        let next_rank = (rank + 1) % world;
        let prev_rank = (rank + world - 1) % world;

        // Listen before publishing so a peer that reads our address can connect at once (the
        // kernel completes the TCP handshake from the backlog before we call accept).
        let ip = route_ip(self.store.host(), self.store.port())?;
        let listener = TcpListener::bind((ip, 0))
            .with_context(|| format!("cannot listen for the ring on {ip}"))?;
        let my_addr = listener.local_addr()?;
        self.store.set(
            &self.key(&format!("addr/{rank}")),
            my_addr.to_string().as_bytes(),
        )?;

        let nonce_key = self.key("nonce");
        let nonce = if rank == 0 {
            let n = gen_nonce();
            self.store.set(&nonce_key, &n.to_le_bytes())?;
            n
        } else {
            let b = self.await_key(&nonce_key, deadline, || {
                format!(
                    "rank 0 did not publish the run nonce within {}: it did not start or crashed",
                    fmt_secs(self.timeout)
                )
            })?;
            u64::from_le_bytes(
                b.as_slice()
                    .try_into()
                    .map_err(|_| anyhow!("malformed ring nonce in the store"))?,
            )
        };
        let me = Hello {
            nonce,
            rank: rank as u32,
            world: world as u32,
        };

        // 1. Dial the successor and introduce ourselves (a small write: never blocks).
        let addr_b = self.await_key(&self.key(&format!("addr/{next_rank}")), deadline, || {
            format!(
                "rank {next_rank} did not publish its ring address within {}: it did not start \
                 or crashed during startup",
                fmt_secs(self.timeout)
            )
        })?;
        let next_addr: SocketAddr = String::from_utf8_lossy(&addr_b)
            .parse()
            .with_context(|| format!("malformed ring address of rank {next_rank}"))?;
        let mut next = connect_until(next_addr, deadline).with_context(|| {
            format!("cannot connect to rank {next_rank} at {next_addr} (firewall, or it died?)")
        })?;
        next.set_nodelay(true)?;
        next.write_all(&me.encode())?;

        // 2. Accept the predecessor, skipping connections that are not it.
        let mut prev = accept_peer(&listener, deadline, |h| {
            h.nonce == nonce && h.rank as usize == prev_rank && h.world as usize == world
        })
        .with_context(|| {
            format!(
                "rank {prev_rank} did not connect to this rank ({my_addr}) within {}: it did not \
                 start, crashed, or cannot reach this host",
                fmt_secs(self.timeout)
            )
        })?;
        prev.set_nodelay(true)?;
        prev.write_all(&me.encode())?;

        // 3. The successor's acknowledgement proves we reached the right process, not whatever
        //    now owns a recycled port.
        next.set_read_timeout(Some(
            deadline
                .saturating_duration_since(Instant::now())
                .max(Duration::from_millis(1)),
        ))?;
        let ack = Hello::read(&mut next)
            .with_context(|| format!("rank {next_rank} did not acknowledge the ring handshake"))?;
        let want = Hello {
            nonce,
            rank: next_rank as u32,
            world: world as u32,
        };
        ensure!(
            ack == Some(want),
            "the process at {next_addr} is not rank {next_rank} of this run (got {ack:?})"
        );

        for s in [&next, &prev] {
            s.set_read_timeout(Some(self.timeout))?;
            s.set_write_timeout(Some(self.timeout))?;
        }
        self.next = Some(next);
        self.prev = Some(prev);
        Ok(())
    }

    /// Starts collective `what`: refuses on a broken group, bumps and records the sequence number.
    fn begin(&mut self, what: &str) -> Result<()> {
        if let Some(m) = &self.broken {
            bail!("the process group is unusable after an earlier failure: {m}");
        }
        self.seq += 1;
        if self.world == 1 {
            return Ok(());
        }
        let key = self.key(&format!("seq/{}", self.rank));
        if let Err(e) = self.store.set(&key, self.seq.to_string().as_bytes()) {
            let why = self.store_gone(&e).unwrap_or_else(|| format!("{e:#}"));
            let m = format!("{what} #{} could not start: {why}", self.seq);
            self.poison(&m);
            bail!(m);
        }
        Ok(())
    }

    fn poison(&mut self, msg: &str) {
        self.broken = Some(msg.to_owned());
        // Wake neighbours blocked on us now rather than after their timeout.
        for s in [&self.next, &self.prev].into_iter().flatten() {
            let _ = s.shutdown(Shutdown::Both);
        }
    }

    /// Reads `key` if it exists, without blocking.
    fn peek(&self, key: &str) -> Result<Option<String>> {
        if !self.store.check(&[key])? {
            return Ok(None);
        }
        Ok(Some(
            String::from_utf8_lossy(&self.store.get(key)?).into_owned(),
        ))
    }

    /// Every other rank's last recorded collective number (`None` = never recorded) and its
    /// failure report for collective `seq`, if it gave up on it.
    fn peer_states(&self, seq: u64) -> Result<Vec<PeerState>> {
        let mut out = Vec::with_capacity(self.world);
        for q in (0..self.world).filter(|&q| q != self.rank) {
            let last = self
                .peek(&self.key(&format!("seq/{q}")))?
                .and_then(|s| s.parse::<u64>().ok());
            let failure = self.peek(&self.key(&format!("fail/{q}")))?.and_then(|s| {
                let (n, msg) = s.split_once('\n')?;
                (n.parse::<u64>().ok()? == seq).then(|| msg.to_owned())
            });
            out.push(PeerState {
                rank: q,
                last,
                failure,
            });
        }
        Ok(out)
    }

    /// Turns a failed step into an error naming the responsible rank(s), and poisons the group.
    fn fail(&mut self, what: &str, started: Instant, f: Fail) -> anyhow::Error {
        let seq = self.seq;
        let next_rank = (self.rank + 1) % self.world;
        let prev_rank = (self.rank + self.world - 1) % self.world;
        let head = match f.kind {
            FailKind::Timeout => {
                format!("{what} #{seq} timed out after {}", fmt_secs(self.timeout))
            }
            _ => format!("{what} #{seq} failed after {}", fmt_secs(started.elapsed())),
        };
        let lagging = |p: &PeerState| p.last.is_none_or(|s| s < seq);
        let mut states = self.peer_states(seq);
        if f.kind != FailKind::Timeout {
            // Sequence records are fire-and-forget, so right after a fast failure a peer's
            // record may still be in flight; re-read briefly before calling it behind.
            for _ in 0..6 {
                match &states {
                    Ok(p) if p.iter().any(lagging) => {
                        std::thread::sleep(Duration::from_millis(50));
                        states = self.peer_states(seq);
                    }
                    _ => break,
                }
            }
        }
        let culprit = match states {
            Err(e) => self.store_gone(&e).unwrap_or_else(|| {
                format!("(could not read the ranks' progress from the store: {e:#})")
            }),
            Ok(peers) => {
                let behind: Vec<String> = peers
                    .iter()
                    .filter(|p| lagging(p))
                    .map(|p| match p.last {
                        Some(s) => format!(
                            "rank {} has not reached it (its last collective was #{s})",
                            p.rank
                        ),
                        None => format!(
                            "rank {} has not reached it (it has not entered any collective)",
                            p.rank
                        ),
                    })
                    .collect();
                let aborted = peers
                    .iter()
                    .find_map(|p| Some((p.rank, p.failure.as_ref()?)));
                if f.kind == FailKind::Protocol {
                    format!(
                        "rank {prev_rank} is in a different collective: the ranks called \
                         collectives in different orders or with different sizes"
                    )
                } else if !behind.is_empty() {
                    let verb = if behind.len() == 1 {
                        "it is"
                    } else {
                        "they are"
                    };
                    format!("{}; {verb} dead or stalled", behind.join(", "))
                } else if let Some((q, why)) = aborted {
                    // A neighbour closing on us is usually that rank giving up for a reason it
                    // recorded; that reason is the real diagnosis.
                    format!("rank {q} gave up on it first: <{why}>")
                } else {
                    // Everyone reached this collective, so the peer whose socket failed died or
                    // stalled inside it.
                    let (q, role) = match f.side {
                        Side::Recv => (prev_rank, "sends to this rank"),
                        Side::Send => (next_rank, "receives from this rank"),
                    };
                    match f.kind {
                        FailKind::Timeout => format!(
                            "rank {q} (which {role}) entered it but stopped making progress; it is \
                             stalled or its host is unreachable"
                        ),
                        _ => format!(
                            "rank {q} (which {role}) closed its connection; it crashed or exited"
                        ),
                    }
                }
            }
        };
        let side = match f.side {
            Side::Recv => format!("receiving from rank {prev_rank}"),
            Side::Send => format!("sending to rank {next_rank}"),
        };
        let msg = format!(
            "{head}: {culprit} [rank {}, {side}: {}]",
            self.rank, f.detail
        );
        // Record why we give up before closing the sockets, so the neighbours that see the
        // connection drop can report the cause. `check` after the fire-and-forget `set` is a
        // round trip on the same connection: the record is stored before we hang up.
        let key = self.key(&format!("fail/{}", self.rank));
        if self
            .store
            .set(&key, format!("{seq}\n{msg}").as_bytes())
            .is_ok()
        {
            let _ = self.store.check(&[key.as_str()]);
        }
        self.poison(&msg);
        anyhow!(msg)
    }

    /// One ring step: send `send` (with header `out`) to the successor while receiving a
    /// message with header `expect` from the predecessor into `recv`.
    fn exchange(
        &self,
        out: Header,
        send: &[u8],
        expect: Header,
        recv: &mut [u8],
    ) -> Result<(), Fail> {
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

    fn header(&self, op: u32, nbytes: usize, aux: u64) -> Header {
        Header {
            op,
            seq: self.seq,
            nbytes: nbytes as u64,
            aux,
        }
    }
}

fn send_msg(mut s: &TcpStream, h: Header, payload: &[u8]) -> Result<(), Fail> {
    let res = if payload.len() <= INLINE_SEND {
        // One write for header and payload: small messages are latency-bound.
        let mut b = Vec::with_capacity(HEADER_LEN + payload.len());
        b.extend_from_slice(&h.encode());
        b.extend_from_slice(payload);
        s.write_all(&b)
    } else {
        s.write_all(&h.encode()).and_then(|_| s.write_all(payload))
    };
    res.map_err(|e| Fail::io(Side::Send, &e))
}

fn recv_msg(mut s: &TcpStream, expect: Header, buf: &mut [u8]) -> Result<(), Fail> {
    let mut hb = [0u8; HEADER_LEN];
    s.read_exact(&mut hb)
        .map_err(|e| Fail::io(Side::Recv, &e))?;
    match Header::decode(&hb) {
        Some(h) if h == expect => {}
        got => {
            let got = match got {
                Some(h) => format!(
                    "{} #{} with {} bytes (aux {})",
                    op_name(h.op),
                    h.seq,
                    h.nbytes,
                    h.aux
                ),
                None => "bytes that are not a ring message".to_owned(),
            };
            return Err(Fail {
                side: Side::Recv,
                kind: FailKind::Protocol,
                detail: format!(
                    "got {got}, expected {} #{} with {} bytes (aux {})",
                    op_name(expect.op),
                    expect.seq,
                    expect.nbytes,
                    expect.aux
                ),
            });
        }
    }
    s.read_exact(buf).map_err(|e| Fail::io(Side::Recv, &e))
}

fn connect_until(addr: SocketAddr, deadline: Instant) -> io::Result<TcpStream> {
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match TcpStream::connect_timeout(&addr, left.max(Duration::from_millis(1))) {
            Ok(s) => return Ok(s),
            // The listener exists before the address is published, so a refusal is transient
            // only in odd cases (backlog overflow); retry until the deadline.
            Err(e) if Instant::now() < deadline && e.kind() == io::ErrorKind::ConnectionRefused => {
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) => return Err(e),
        }
    }
}

/// Accepts connections until one presents a hello that `ok` accepts; others are dropped.
fn accept_peer(
    listener: &TcpListener,
    deadline: Instant,
    ok: impl Fn(&Hello) -> bool,
) -> Result<TcpStream> {
    // Non-blocking accept + short sleeps: std has no accept timeout.
    listener.set_nonblocking(true)?;
    let mut rejected = Vec::new();
    loop {
        match listener.accept() {
            Ok((mut s, peer)) => {
                s.set_nonblocking(false)?;
                // A genuine peer sends its hello right after connecting; cap the wait so a
                // silent stray connection cannot eat the whole bootstrap timeout.
                let left = deadline.saturating_duration_since(Instant::now());
                let cap = left.clamp(Duration::from_millis(1), Duration::from_secs(5));
                s.set_read_timeout(Some(cap))?;
                match Hello::read(&mut s) {
                    Ok(Some(h)) if ok(&h) => return Ok(s),
                    Ok(h) => rejected.push(format!("{peer} sent {h:?}")),
                    Err(e) => rejected.push(format!("{peer}: {e}")),
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    if rejected.is_empty() {
                        bail!("no connection arrived");
                    }
                    bail!(
                        "rejected {} connection(s) that were not the expected rank of this run \
                         (last: {})",
                        rejected.len(),
                        rejected.last().unwrap()
                    );
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => return Err(e.into()),
        }
    }
}

impl ProcessGroup for RingGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
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

impl std::fmt::Debug for RingGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RingGroup")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("seq", &self.seq)
            .field("broken", &self.broken.is_some())
            .finish()
    }
}

#[cfg(test)]
#[path = "ring_tests.rs"]
mod tests;
