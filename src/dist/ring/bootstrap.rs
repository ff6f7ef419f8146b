//! Forming the ring: each rank listens, publishes its address in the store, dials its successor
//! and accepts its predecessor. A run nonce (published by rank 0) and a handshake both ways make
//! sure each connection is the intended rank of this run, not a stray process or a previous
//! attempt that reused a port.

use std::io::{self, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs, UdpSocket};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, ensure, Context, Result};

use super::wire::Hello;
use super::{fmt_secs, RingGroup};

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

    pub(super) fn bootstrap(&mut self) -> Result<()> {
        let deadline = Instant::now() + self.timeout;
        let (rank, world) = (self.rank, self.world);
        let next_rank = (rank + 1) % world;
        let prev_rank = (rank + world - 1) % world;
        // Messages name global ranks (and the subgroup); the protocol uses positions.
        let (next_name, prev_name, within) = (
            self.global(next_rank),
            self.global(prev_rank),
            self.where_(),
        );

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
                    "rank {}{within} did not publish the run nonce within {}: it did not start or crashed",
                    self.global(0),
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
                "rank {next_name}{within} did not publish its ring address within {}: it did not start \
                 or crashed during startup",
                fmt_secs(self.timeout)
            )
        })?;
        let next_addr: SocketAddr = String::from_utf8_lossy(&addr_b)
            .parse()
            .with_context(|| format!("malformed ring address of rank {next_name}{within}"))?;
        let mut next = connect_until(next_addr, deadline).with_context(|| {
            format!(
                "cannot connect to rank {next_name}{within} at {next_addr} (firewall, or it died?)"
            )
        })?;
        next.set_nodelay(true)?;
        next.write_all(&me.encode())?;

        // 2. Accept the predecessor, skipping connections that are not it.
        let mut prev = accept_peer(&listener, deadline, |h| {
            h.nonce == nonce && h.rank as usize == prev_rank && h.world as usize == world
        })
        .with_context(|| {
            format!(
                "rank {prev_name}{within} did not connect to this rank ({my_addr}) within {}: it did not \
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
        let ack = Hello::read(&mut next).with_context(|| {
            format!("rank {next_name}{within} did not acknowledge the ring handshake")
        })?;
        let want = Hello {
            nonce,
            rank: next_rank as u32,
            world: world as u32,
        };
        ensure!(
            ack == Some(want),
            "the process at {next_addr} is not rank {next_name}{within} of this run (got {ack:?})"
        );

        for s in [&next, &prev] {
            s.set_read_timeout(Some(self.timeout))?;
            s.set_write_timeout(Some(self.timeout))?;
        }
        self.next = Some(next);
        self.prev = Some(prev);
        Ok(())
    }
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
