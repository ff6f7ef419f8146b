//! `.jsonl` files: one JSON object per line whose text field is the document. A line is parsed
//! whole, or, when longer than [`PIECE`], as it is read, its text handed on in pieces.

use std::fs::File;
use std::io::{BufRead, BufReader, Seek, SeekFrom};
use std::ops::Range;
use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};

use super::text::{not_utf8, read_pieces, PIECE};

pub(super) fn read_jsonl(
    file: &Path,
    text_field: &str,
    bytes: Range<u64>,
    mut f: impl FnMut(String, bool) -> Result<()>,
) -> Result<()> {
    let p = file.display();
    let mut handle = File::open(file).with_context(|| format!("{p}: cannot open"))?;
    // A line belongs to the range its first byte is in: from inside the file, skip to the
    // start of the first line that begins at or after `bytes.start`.
    let mut offset = bytes.start.saturating_sub(1);
    handle
        .seek(SeekFrom::Start(offset))
        .with_context(|| format!("{p}: cannot seek to byte {offset}"))?;
    let mut reader = BufReader::with_capacity(1 << 20, handle);
    let mut line = Vec::new();
    if bytes.start > 0 {
        offset +=
            skip_line(&mut reader).with_context(|| format!("{p}: read error at byte {offset}"))?;
    }
    // Line numbers are counted from the start of the file only when reading from there;
    // otherwise errors name the byte offset of the line.
    let from_start = bytes.start == 0;
    let mut line_no = 0u64;
    loop {
        if offset >= bytes.end {
            return Ok(());
        }
        line.clear();
        let (n, whole) = read_line_upto(&mut reader, &mut line, PIECE)
            .with_context(|| format!("{p}: read error after line {line_no}"))?;
        if n == 0 {
            return Ok(());
        }
        line_no += 1;
        let start = offset;
        let p = || {
            if from_start {
                format!("{p}:{line_no}")
            } else {
                format!("{p}: line at byte {start}")
            }
        };
        if !whole {
            offset += read_long_line(&mut reader, &line, text_field, &p(), &mut f)?;
            continue;
        }
        let text = std::str::from_utf8(&line).map_err(|e| {
            let head = (start == 0).then_some(line.as_slice());
            not_utf8(&p(), offset + e.valid_up_to() as u64, head)
        })?;
        offset += n as u64;
        if text.trim().is_empty() {
            continue;
        }
        let value: serde_json::Value =
            serde_json::from_str(text).map_err(|e| line_error::not_json(&p(), e))?;
        let serde_json::Value::Object(mut obj) = value else {
            return Err(line_error::not_an_object(
                &p(),
                text_field,
                json_type(&value),
            ));
        };
        match obj.remove(text_field) {
            Some(serde_json::Value::String(s)) => f(s, true)?,
            other => {
                let keys: Vec<&str> = obj.keys().map(String::as_str).collect();
                let found = other.as_ref().map(json_type);
                return Err(line_error::no_text(&p(), text_field, found, &keys));
            }
        }
    }
}

/// The errors of a `.jsonl` line (named `at`), parsed whole or as it is read.
mod line_error {
    use anyhow::anyhow;

    pub fn not_json(at: &str, why: impl std::fmt::Display) -> anyhow::Error {
        anyhow!("{at}: not valid JSON ({why}); each line of a .jsonl file must be one JSON object")
    }

    /// The line is a JSON value of type `found`, not an object.
    pub fn not_an_object(at: &str, text_field: &str, found: &str) -> anyhow::Error {
        let article = if found.starts_with(['a', 'o']) {
            "an"
        } else {
            "a"
        };
        anyhow!(
            "{at}: expected a JSON object with a \"{text_field}\" string field, found {article} \
             {found}"
        )
    }

    /// The object has no `text_field` (`found` None) or one of type `found`; `keys` are its
    /// other keys.
    pub fn no_text(
        at: &str,
        text_field: &str,
        found: Option<&str>,
        keys: &[impl AsRef<str>],
    ) -> anyhow::Error {
        let problem = match found {
            None => "has no".to_string(),
            Some(t) => format!("has a non-string ({t})"),
        };
        let keys: Vec<&str> = keys.iter().map(AsRef::as_ref).collect();
        anyhow!(
            "{at}: line {problem} field \"{text_field}\" (its other keys: [{}]); set \
             `data.text_field` to the key holding the text",
            keys.join(", ")
        )
    }
}

/// Reads `r` into `line` up to and including the next `\n`, or `limit` bytes if the line is
/// longer: the bytes read and whether the line is whole (its `\n` or the end of the file read).
fn read_line_upto(
    r: &mut impl BufRead,
    line: &mut Vec<u8>,
    limit: usize,
) -> std::io::Result<(usize, bool)> {
    let mut n = 0;
    loop {
        let buf = match r.fill_buf() {
            Ok(buf) => buf,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if buf.is_empty() {
            return Ok((n, true));
        }
        let room = limit.saturating_sub(line.len());
        if let Some(i) = memchr::memchr(b'\n', &buf[..buf.len().min(room)]) {
            line.extend_from_slice(&buf[..=i]);
            r.consume(i + 1);
            return Ok((n + i + 1, true));
        }
        let k = buf.len().min(room);
        line.extend_from_slice(&buf[..k]);
        r.consume(k);
        n += k;
        if line.len() >= limit {
            return Ok((n, false));
        }
    }
}

/// Skips `r` past the next `\n` (or to the end): the bytes skipped.
fn skip_line(r: &mut impl BufRead) -> std::io::Result<u64> {
    let mut rest = LineRest {
        r,
        read: 0,
        done: false,
    };
    std::io::copy(&mut rest, &mut std::io::sink())?;
    Ok(rest.read)
}

/// The rest of the line `r` is in, as a reader: its bytes up to the next `\n` (consumed with
/// the line, not returned) or the end of the file.
struct LineRest<'a, R> {
    r: &'a mut R,
    /// Bytes consumed from `r`, the `\n` included.
    read: u64,
    done: bool,
}

impl<R: BufRead> std::io::Read for LineRest<'_, R> {
    fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
        if self.done || out.is_empty() {
            return Ok(0);
        }
        let buf = self.r.fill_buf()?;
        let (k, used) = match memchr::memchr(b'\n', buf) {
            Some(i) if i <= out.len() => {
                self.done = true;
                (i, i + 1)
            }
            _ => {
                let k = buf.len().min(out.len());
                self.done = k == 0;
                (k, k)
            }
        };
        out[..k].copy_from_slice(&buf[..k]);
        self.r.consume(used);
        self.read += used as u64;
        Ok(k)
    }
}

/// One `.jsonl` line too long to hold whole: `head`, its first bytes, then the rest of the line
/// in `r`. The line is parsed as it is read (`struson`'s streaming reader): its `text_field`
/// string goes to `f(text, ends_document)` in pieces of about [`PIECE`] bytes, every other
/// value is checked and skipped. `at` names the line in errors. The bytes read from `r`.
///
/// Unlike a line parsed whole, where the last of repeated keys wins, a repeated `text_field`
/// is refused: its first value has been handed on already.
fn read_long_line(
    r: &mut impl BufRead,
    head: &[u8],
    text_field: &str,
    at: &str,
    f: &mut impl FnMut(String, bool) -> Result<()>,
) -> Result<u64> {
    use std::io::Read;
    use struson::reader::{JsonReader, JsonStreamReader, ReaderSettings, ValueType};
    let bad = |e: &(dyn std::error::Error + 'static)| long_line_error(at, e);
    let mut rest = LineRest {
        r,
        read: 0,
        done: false,
    };
    let settings = ReaderSettings {
        track_path: false,
        ..Default::default()
    };
    let mut json = JsonStreamReader::new_custom(head.chain(&mut rest), settings);
    match json.peek().map_err(|e| bad(&e))? {
        ValueType::Object => {}
        other => return Err(line_error::not_an_object(at, text_field, value_kind(other))),
    }
    json.begin_object().map_err(|e| bad(&e))?;
    // The other keys (for the error naming them) and the text's last piece, or the type of
    // a text field that is not a string.
    let mut keys: Vec<String> = Vec::new();
    let mut text: Option<std::result::Result<String, &str>> = None;
    while json.has_next().map_err(|e| bad(&e))? {
        let name = json.next_name_owned().map_err(|e| bad(&e))?;
        if name != text_field {
            keys.push(name);
            json.skip_value().map_err(|e| bad(&e))?;
            continue;
        }
        if text.is_some() {
            bail!(
                "{at}: the field \"{text_field}\" appears twice in this line, which is parsed as \
                 it is read (longer than {PIECE} bytes); keep one"
            );
        }
        let t = json.peek().map_err(|e| bad(&e))?;
        if t != ValueType::String {
            text = Some(Err(value_kind(t)));
            json.skip_value().map_err(|e| bad(&e))?;
            continue;
        }
        let mut reader = json.next_string_reader().map_err(|e| bad(&e))?;
        // The string reader's bytes are valid UTF-8: its pieces are whole characters. The
        // last is handed on once the rest of the line has been checked.
        let mut last_piece = String::new();
        read_pieces(
            &mut reader,
            |e| bad(&e),
            |piece, last| {
                let piece = String::from_utf8(piece).expect("struson checks UTF-8");
                if last {
                    last_piece = piece;
                    return Ok(());
                }
                f(piece, false)
            },
        )?;
        text = Some(Ok(last_piece));
    }
    json.end_object().map_err(|e| bad(&e))?;
    json.consume_trailing_whitespace().map_err(|e| bad(&e))?;
    match text {
        Some(Ok(last)) => f(last, true)?,
        Some(Err(t)) => return Err(line_error::no_text(at, text_field, Some(t), &keys)),
        None => return Err(line_error::no_text(at, text_field, None, &keys)),
    }
    Ok(head.len() as u64 + rest.read)
}

/// A streaming parse error of the long line `at`: invalid UTF-8, or not valid JSON.
fn long_line_error(at: &str, e: &(dyn std::error::Error + 'static)) -> anyhow::Error {
    let what = describe(e);
    if what.contains("invalid UTF-8") {
        anyhow!("{at}: {what}; convert the file to UTF-8")
    } else {
        line_error::not_json(at, what)
    }
}

/// struson's errors, found inside the string reader's io::Error too, with the position in
/// the line.
fn describe(e: &(dyn std::error::Error + 'static)) -> String {
    use struson::reader::{JsonSyntaxError, ReaderError};
    let at = |what: String, pos: Option<u64>| match pos {
        Some(pos) => format!("{what} at byte {pos} of the line"),
        None => what,
    };
    if let Some(e) = e.downcast_ref::<JsonSyntaxError>() {
        return at(e.kind.to_string(), e.location.data_pos);
    }
    match e.downcast_ref::<ReaderError>() {
        Some(ReaderError::SyntaxError(e)) => describe(e),
        Some(ReaderError::IoError { error, location }) => match error.get_ref() {
            Some(inner) => describe(inner),
            None => at(error.to_string(), location.data_pos),
        },
        _ => match e.downcast_ref::<std::io::Error>().and_then(|e| e.get_ref()) {
            Some(inner) => describe(inner),
            None => e.to_string(),
        },
    }
}

/// A JSON value type's name, as [`json_type`] gives it for a parsed value.
fn value_kind(t: struson::reader::ValueType) -> &'static str {
    use struson::reader::ValueType;
    match t {
        ValueType::Array => "array",
        ValueType::Object => "object",
        ValueType::String => "string",
        ValueType::Number => "number",
        ValueType::Boolean => "boolean",
        ValueType::Null => "null",
    }
}

pub(crate) fn json_type(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "boolean",
        serde_json::Value::Number(_) => "number",
        serde_json::Value::String(_) => "string",
        serde_json::Value::Array(_) => "array",
        serde_json::Value::Object(_) => "object",
    }
}
