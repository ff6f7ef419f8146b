//! Naming the rank responsible when a collective fails.
//!
//! Before each collective a rank records its sequence number under `<prefix>seq/<rank>` (a
//! fire-and-forget TCPStore `set`: one small socket write, no reply; see `RingGroup::begin`).
//! When a collective times out or a socket breaks, the rank reads everybody's sequence number
//! and names the ranks that never reached the collective; if the store itself is unreachable it
//! names the store host. A rank that gives up records why under `<prefix>fail/<rank>`, so the
//! neighbours that see its connection drop can report the cause.

use std::io;
use std::time::{Duration, Instant};

use anyhow::{anyhow, Result};

use super::{fmt_secs, RingGroup};
use crate::dist::store::{StoreError, StoreErrorKind};

/// Which of our two sockets failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Side {
    Send,
    Recv,
}

/// How a step failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum FailKind {
    Timeout,
    Closed,
    /// The peer sent a header we did not expect: mismatched collectives.
    Protocol,
    Io,
}

/// A failed ring step as this rank saw it; [`RingGroup::fail`] turns it into the error.
#[derive(Debug)]
pub(super) struct Fail {
    pub(super) side: Side,
    pub(super) kind: FailKind,
    pub(super) detail: String,
}

impl Fail {
    pub(super) fn io(side: Side, e: &io::Error) -> Fail {
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

impl RingGroup {
    /// When `e` says the store is unreachable: the message naming the store and who hosts it.
    pub(super) fn store_gone(&self, e: &anyhow::Error) -> Option<String> {
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
                rank: self.global(q),
                last,
                failure,
            });
        }
        Ok(out)
    }

    /// Turns a failed step into an error naming the responsible rank(s), and poisons the group.
    pub(super) fn fail(&mut self, what: &str, started: Instant, f: Fail) -> anyhow::Error {
        let seq = self.seq;
        // Global rank numbers, as every message names ranks.
        let next_rank = self.global((self.rank + 1) % self.world);
        let prev_rank = self.global((self.rank + self.world - 1) % self.world);
        let me = self.global(self.rank);
        let within = self.where_();
        let head = match f.kind {
            FailKind::Timeout => {
                format!(
                    "{what} #{seq}{within} timed out after {}",
                    fmt_secs(self.timeout)
                )
            }
            _ => format!(
                "{what} #{seq}{within} failed after {}",
                fmt_secs(started.elapsed())
            ),
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
        let msg = format!("{head}: {culprit} [rank {me}, {side}: {}]", f.detail);
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
}
