//! Plain text: a `.txt` file's one document, read in pieces of whole characters when it is
//! large ([`read_pieces`], which the `.jsonl` reader uses for a long line's text too), and the
//! UTF-8 checks that locate a bad byte or name a UTF-16/32 file's encoding.

use std::fs::File;
use std::path::Path;

use anyhow::{anyhow, Context, Result};

/// A document larger than this (a `.txt` file, a `.jsonl` line) is read and handed on in pieces
/// of about this size, so one huge document is never held whole.
pub(super) const PIECE: usize = if cfg!(test) { 1 << 16 } else { 16 << 20 };

/// A `.txt` file's one document, in pieces of about [`PIECE`] bytes cut at character
/// boundaries (one piece for a smaller file), the last with `ends_document`.
pub(super) fn read_txt(file: &Path, mut f: impl FnMut(String, bool) -> Result<()>) -> Result<()> {
    use std::io::Read;
    let what = file.display().to_string();
    let mut handle = File::open(file).with_context(|| format!("{what}: cannot open"))?;
    let len = handle.metadata().map(|m| m.len()).unwrap_or(0);
    if len <= PIECE as u64 {
        let mut bytes = Vec::new();
        handle
            .read_to_end(&mut bytes)
            .with_context(|| format!("{what}: cannot read"))?;
        return f(txt_document(bytes, &what)?, true);
    }
    let mut offset = 0u64;
    let read_error = |e: std::io::Error| anyhow!(e).context(format!("{what}: cannot read"));
    read_pieces(&mut handle, read_error, |bytes, last| {
        let n = bytes.len() as u64;
        let text = txt_piece(bytes, &what, offset)?;
        offset += n;
        f(text, last)
    })
}

/// Reads `r` to its end in pieces of at most [`PIECE`] bytes that end on whole characters
/// (one the next bytes may complete is held back for the next piece): `f(piece, last)`, the
/// last piece possibly empty. A read error goes through `read_error`; invalid UTF-8 is left
/// to `f` to report.
pub(super) fn read_pieces<R: std::io::Read>(
    r: &mut R,
    read_error: impl Fn(std::io::Error) -> anyhow::Error,
    mut f: impl FnMut(Vec<u8>, bool) -> Result<()>,
) -> Result<()> {
    let mut carry = Vec::new();
    loop {
        let mut buf = carry;
        let have = buf.len();
        buf.resize(PIECE, 0);
        let n = read_full(r, &mut buf[have..]).map_err(&read_error)?;
        buf.truncate(have + n);
        // `read_full` stops short only at the end.
        let last = buf.len() < PIECE;
        carry = if last {
            Vec::new()
        } else {
            split_incomplete_char(&mut buf)
        };
        f(buf, last)?;
        if last {
            return Ok(());
        }
    }
}

/// Splits off the end of `buf` a character the next bytes may complete (its first 1 to 3
/// bytes), returned for the next piece; invalid UTF-8 elsewhere is left for the caller's
/// check to report.
fn split_incomplete_char(buf: &mut Vec<u8>) -> Vec<u8> {
    let keep = match std::str::from_utf8(buf) {
        Err(e) if e.error_len().is_none() => e.valid_up_to(),
        _ => buf.len(),
    };
    buf.split_off(keep)
}

/// Reads until `buf` is full or the file ends; the bytes read.
fn read_full(r: &mut impl std::io::Read, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match r.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

/// A `.txt` file's bytes (`what` names it in errors) as its one document: UTF-8, a leading
/// byte-order mark dropped.
pub fn txt_document(bytes: Vec<u8>, what: &str) -> Result<String> {
    txt_piece(bytes, what, 0)
}

/// The bytes of a `.txt` file (named `what`) from byte `offset` on as text, without the
/// byte-order mark a file may start with.
fn txt_piece(bytes: Vec<u8>, what: &str, offset: u64) -> Result<String> {
    let text = String::from_utf8(bytes).map_err(|e| {
        let head = (offset == 0).then_some(e.as_bytes());
        not_utf8(what, offset + e.utf8_error().valid_up_to() as u64, head)
    })?;
    Ok(match text.strip_prefix('\u{feff}') {
        Some(rest) if offset == 0 => rest.to_string(),
        _ => text,
    })
}

/// Text that is not UTF-8 at byte `at` of `what`; `head` is the file's first bytes when they
/// are at hand, so a UTF-16 or UTF-32 file (named by its byte-order mark) gets the conversion
/// that fits it rather than a guess.
pub(crate) fn not_utf8(what: &str, at: u64, head: Option<&[u8]>) -> anyhow::Error {
    let marked = head.and_then(|h| {
        [
            (&[0xFF, 0xFE, 0, 0][..], "UTF-32", "little"),
            (&[0, 0, 0xFE, 0xFF][..], "UTF-32", "big"),
            (&[0xFF, 0xFE][..], "UTF-16", "little"),
            (&[0xFE, 0xFF][..], "UTF-16", "big"),
        ]
        .into_iter()
        .find(|(mark, ..)| h.starts_with(mark))
    });
    match marked {
        Some((_, enc, endian)) => anyhow!(
            "{what}: {enc} text ({endian}-endian: it starts with that byte-order mark), not \
             UTF-8; convert it with `iconv -f {enc} -t UTF-8 FILE > FILE.utf8` and use the new \
             file"
        ),
        None => anyhow!(
            "{what}: invalid UTF-8 at byte offset {at}; convert the file to UTF-8 (e.g. \
             `iconv -f latin1 -t utf-8` if it is Latin-1; `file FILE` tells its encoding)"
        ),
    }
}
