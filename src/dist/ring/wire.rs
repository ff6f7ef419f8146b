//! The ring's wire format: the handshake on a fresh connection ([`Hello`]) and the framing of
//! every collective message ([`Header`] + payload).
//!
//! Every message carries a header `(magic, op, seq, nbytes, aux)`; the receiver checks it
//! against what it expects, so ranks that call collectives in different orders or with
//! different sizes get an error instead of silently mixing data.
//!
//! Headers are little-endian. Payloads are native-endian `f32`/`f64`: all ranks must share
//! endianness (every platform libtorch supports for training is little-endian).

use std::io::{self, Read, Write};
use std::net::TcpStream;

use super::diagnose::{Fail, FailKind, Side};

/// Handshake magic; also separates lockstep rings from anything else that dials the port.
const HELLO_MAGIC: [u8; 8] = *b"LKSTRNG1";
/// Per-message magic.
const MSG_MAGIC: u32 = 0x4c4b_5352; // "LKSR"
const HEADER_LEN: usize = 32;
/// Payloads up to this size are written before reading, without a helper thread: they fit in
/// any socket send buffer, so the write cannot block on the peer.
pub(super) const INLINE_SEND: usize = 8 << 10;

pub(super) const OP_REDUCE_SCATTER: u32 = 1;
pub(super) const OP_ALL_GATHER: u32 = 2;
pub(super) const OP_BROADCAST: u32 = 3;
pub(super) const OP_MAX: u32 = 4;
pub(super) const OP_BARRIER: u32 = 5;
pub(super) const OP_ALL_TO_ALL: u32 = 6;

/// Message header. `aux` is op-specific (total length for broadcast, step for the others).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Header {
    pub(super) op: u32,
    pub(super) seq: u64,
    pub(super) nbytes: u64,
    pub(super) aux: u64,
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
        OP_ALL_TO_ALL => "all-to-all".to_owned(),
        _ => format!("unknown op {op}"),
    }
}

/// Handshake on a fresh connection, sent both ways: connector → acceptor ("I am rank r of this
/// run"), then acceptor → connector as the acknowledgement.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Hello {
    pub(super) nonce: u64,
    pub(super) rank: u32,
    pub(super) world: u32,
}

impl Hello {
    const LEN: usize = 24;

    pub(super) fn encode(&self) -> [u8; Self::LEN] {
        let mut b = [0u8; Self::LEN];
        b[0..8].copy_from_slice(&HELLO_MAGIC);
        b[8..16].copy_from_slice(&self.nonce.to_le_bytes());
        b[16..20].copy_from_slice(&self.rank.to_le_bytes());
        b[20..24].copy_from_slice(&self.world.to_le_bytes());
        b
    }

    pub(super) fn read(s: &mut TcpStream) -> io::Result<Option<Hello>> {
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

pub(super) fn f32_bytes(s: &[f32]) -> &[u8] {
    // SAFETY: f32 has no padding, u8 has alignment 1, and the byte length covers exactly the
    // same allocation; the borrow keeps `s` alive and immutable.
    unsafe { std::slice::from_raw_parts(s.as_ptr().cast(), std::mem::size_of_val(s)) }
}

pub(super) fn f32_bytes_mut(s: &mut [f32]) -> &mut [u8] {
    // SAFETY: as in `f32_bytes`, and every bit pattern is a valid f32, so arbitrary bytes
    // written through the view keep the slice valid.
    unsafe { std::slice::from_raw_parts_mut(s.as_mut_ptr().cast(), std::mem::size_of_val(s)) }
}

pub(super) fn send_msg(mut s: &TcpStream, h: Header, payload: &[u8]) -> Result<(), Fail> {
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

pub(super) fn recv_msg(mut s: &TcpStream, expect: Header, buf: &mut [u8]) -> Result<(), Fail> {
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
