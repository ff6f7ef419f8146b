//! TensorBoard event files without TensorFlow: `events.out.tfevents.<secs>.<host>.<pid>` holds
//! TFRecord-framed `Event` protobufs, encoded by hand (only the fields scalars need).
//!
//! Framing of each record: `u64 LE length`, `u32 LE masked CRC32C of those 8 bytes`, the data,
//! `u32 LE masked CRC32C of the data`. The first record is an `Event` with
//! `file_version = "brain.Event:2"`; each scalar is an `Event { wall_time, step, summary {
//! value { tag, simple_value } } }`, so TensorBoard (and its `EventAccumulator`) reads it as a
//! scalar series stored as float32.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result};

/// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), the checksum TFRecord uses.
pub fn crc32c(data: &[u8]) -> u32 {
    static TABLE: std::sync::OnceLock<[u32; 256]> = std::sync::OnceLock::new();
    let table = TABLE.get_or_init(|| {
        let mut t = [0u32; 256];
        for (i, slot) in t.iter_mut().enumerate() {
            let mut c = i as u32;
            for _ in 0..8 {
                c = if c & 1 != 0 {
                    (c >> 1) ^ 0x82F6_3B78
                } else {
                    c >> 1
                };
            }
            *slot = c;
        }
        t
    });
    let mut crc = !0u32;
    for &b in data {
        crc = table[((crc ^ b as u32) & 0xff) as usize] ^ (crc >> 8);
    }
    !crc
}

/// TFRecord's masked CRC: rotate right by 15 and add a constant.
pub fn masked_crc32c(data: &[u8]) -> u32 {
    let crc = crc32c(data);
    (crc.rotate_right(15)).wrapping_add(0xa282_ead8)
}

/// One TFRecord: length, its masked CRC, the data, the data's masked CRC.
pub fn tfrecord(data: &[u8]) -> Vec<u8> {
    let len = (data.len() as u64).to_le_bytes();
    let mut out = Vec::with_capacity(data.len() + 16);
    out.extend_from_slice(&len);
    out.extend_from_slice(&masked_crc32c(&len).to_le_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(&masked_crc32c(data).to_le_bytes());
    out
}

fn varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// A length-delimited field (wire type 2): strings and embedded messages.
fn bytes_field(out: &mut Vec<u8>, field: u32, data: &[u8]) {
    varint(out, u64::from(field << 3 | 2));
    varint(out, data.len() as u64);
    out.extend_from_slice(data);
}

/// `Event { wall_time = 1 (double), step = 2 (int64), file_version = 3 | summary = 5 |
/// session_log = 7 }`.
fn event(wall_time: f64, step: i64, file_version: Option<&str>, summary: Option<&[u8]>) -> Vec<u8> {
    let mut out = Vec::with_capacity(64);
    out.push(1 << 3 | 1); // wall_time, 64-bit
    out.extend_from_slice(&wall_time.to_le_bytes());
    if step != 0 {
        out.push(2 << 3); // step, varint (negative int64 takes ten bytes, as protobuf does)
        varint(&mut out, step as u64);
    }
    if let Some(v) = file_version {
        bytes_field(&mut out, 3, v.as_bytes());
    }
    if let Some(s) = summary {
        bytes_field(&mut out, 5, s);
    }
    out
}

/// `SessionLog { status = 1: START (1) }`.
const SESSION_START: &[u8] = &[1 << 3, 1];

/// `Summary { value = 1: Value { tag = 1 (string), simple_value = 2 (float) } }`.
fn scalar_summary(tag: &str, value: f32) -> Vec<u8> {
    let mut v = Vec::with_capacity(tag.len() + 8);
    bytes_field(&mut v, 1, tag.as_bytes());
    v.push(2 << 3 | 5); // simple_value, 32-bit
    v.extend_from_slice(&value.to_le_bytes());
    let mut summary = Vec::with_capacity(v.len() + 2);
    bytes_field(&mut summary, 1, &v);
    summary
}

fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// Appends scalar events to a new TensorBoard event file; `tensorboard --logdir <dir>` shows them.
/// Buffered: call [`EventWriter::flush`] after each batch of scalars (dropping also flushes).
pub struct EventWriter {
    out: BufWriter<File>,
    path: PathBuf,
}

impl EventWriter {
    /// Creates `dir` if needed and a new `events.out.tfevents.<secs>.<host>.<pid>` in it (never
    /// overwriting: a second writer in the same second gets a `.N` suffix), starting with the
    /// `brain.Event:2` version record.
    pub fn create(dir: &Path) -> Result<EventWriter> {
        std::fs::create_dir_all(dir).with_context(|| {
            format!(
                "{}: cannot create the TensorBoard directory; is logging.dir writable?",
                dir.display()
            )
        })?;
        let wall = now();
        let base = format!(
            "events.out.tfevents.{}.{}.{}",
            wall as u64,
            crate::sys::hostname(),
            std::process::id()
        );
        let mut n = 0;
        let (file, path) = loop {
            let name = if n == 0 {
                base.clone()
            } else {
                format!("{base}.{n}")
            };
            let path = dir.join(name);
            match File::options().write(true).create_new(true).open(&path) {
                Ok(f) => break (f, path),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && n < 1000 => n += 1,
                Err(e) => {
                    return Err(e).with_context(|| {
                        format!(
                            "{}: cannot create the TensorBoard event file",
                            path.display()
                        )
                    })
                }
            }
        };
        let mut w = EventWriter {
            out: BufWriter::new(file),
            path,
        };
        w.record(&event(wall, 0, Some("brain.Event:2"), None))?;
        w.flush()?;
        Ok(w)
    }

    /// The event file being written.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// One scalar point of series `tag` (stored as float32, as TensorBoard keeps scalars).
    pub fn scalar(&mut self, tag: &str, step: i64, value: f64) -> Result<()> {
        let summary = scalar_summary(tag, value as f32);
        self.record(&event(now(), step, None, Some(&summary)))
    }

    /// A fresh start in `dir`: moves the event files an earlier run left there into
    /// `dir/previous-<secs>/`, which TensorBoard shows as a run of its own rather than mixed
    /// into this one. The folder, when anything was moved.
    pub fn set_aside(dir: &Path) -> Result<Option<std::path::PathBuf>> {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return Ok(None);
        };
        let old: Vec<_> = entries
            .flatten()
            .map(|e| e.path())
            .filter(|p| {
                p.is_file()
                    && p.file_name()
                        .and_then(|n| n.to_str())
                        .is_some_and(|n| n.starts_with("events.out.tfevents."))
            })
            .collect();
        if old.is_empty() {
            return Ok(None);
        }
        let secs = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let aside = dir.join(format!("previous-{secs}"));
        std::fs::create_dir_all(&aside)
            .with_context(|| format!("{}: cannot create", aside.display()))?;
        for f in old {
            let to = aside.join(f.file_name().unwrap_or_default());
            std::fs::rename(&f, &to)
                .with_context(|| format!("{}: cannot move to {}", f.display(), to.display()))?;
        }
        Ok(Some(aside))
    }

    /// Marks a (re)start at `step` (a resumed or rolled-back run): readers that honour
    /// `SessionLog.START`, such as `EventAccumulator`, drop points at `step` and later that
    /// earlier files hold, so replayed steps are not shown twice.
    pub fn session_start(&mut self, step: i64) -> Result<()> {
        let mut e = event(now(), step, None, None);
        bytes_field(&mut e, 7, SESSION_START);
        self.record(&e)
    }

    fn record(&mut self, data: &[u8]) -> Result<()> {
        self.out
            .write_all(&tfrecord(data))
            .with_context(|| format!("{}: cannot write", self.path.display()))
    }

    /// Pushes buffered events to the file so a running TensorBoard sees them.
    pub fn flush(&mut self) -> Result<()> {
        self.out
            .flush()
            .with_context(|| format!("{}: cannot write", self.path.display()))
    }
}

impl Drop for EventWriter {
    fn drop(&mut self) {
        let _ = self.out.flush();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32c_matches_the_standard_check_values() {
        // The CRC-32C check value (RFC 3720 B.4 and every CRC catalogue).
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
        assert_eq!(crc32c(&[0u8; 32]), 0x8A91_36AA);
        assert_eq!(crc32c(&[0xffu8; 32]), 0x62A8_AB43);
        assert_eq!(crc32c(b""), 0);
    }

    #[test]
    fn records_frame_and_check() {
        let rec = tfrecord(b"hello");
        assert_eq!(rec.len(), 8 + 4 + 5 + 4);
        assert_eq!(u64::from_le_bytes(rec[..8].try_into().unwrap()), 5);
        let len_crc = u32::from_le_bytes(rec[8..12].try_into().unwrap());
        assert_eq!(len_crc, masked_crc32c(&rec[..8]));
        assert_eq!(&rec[12..17], b"hello");
        let mask = |c: u32| c.rotate_right(15).wrapping_add(0xa282_ead8);
        assert_eq!(
            u32::from_le_bytes(rec[17..].try_into().unwrap()),
            mask(crc32c(b"hello"))
        );
    }

    #[test]
    fn event_encoding_is_protobuf() {
        // step 300 = varint ac 02; tag "a"; simple_value 1.5f32.
        let s = scalar_summary("a", 1.5);
        assert_eq!(s, [0x0a, 8, 0x0a, 1, b'a', 0x15, 0x00, 0x00, 0xc0, 0x3f]);
        let e = event(2.0, 300, None, Some(&s));
        let mut want = vec![0x09];
        want.extend_from_slice(&2.0f64.to_le_bytes());
        want.extend_from_slice(&[0x10, 0xac, 0x02, 0x2a, s.len() as u8]);
        want.extend_from_slice(&s);
        assert_eq!(e, want);
        let v = event(1.0, 0, Some("brain.Event:2"), None);
        assert_eq!(&v[9..11], &[0x1a, 13]);
        assert_eq!(&v[11..], b"brain.Event:2");
    }

    #[test]
    fn writer_creates_distinct_files() {
        let dir = tempfile::tempdir().unwrap();
        let sub = dir.path().join("tb");
        let mut a = EventWriter::create(&sub).unwrap();
        let b = EventWriter::create(&sub).unwrap();
        assert_ne!(a.path(), b.path());
        let name = a.path().file_name().unwrap().to_str().unwrap().to_string();
        assert!(name.starts_with("events.out.tfevents."), "{name}");
        a.scalar("loss", 1, 2.5).unwrap();
        drop(a);
        let bytes = std::fs::read(sub.join(&name)).unwrap();
        // Version record (8 + 4 + 9 + 2 + 13 + 4) then one scalar record.
        assert_eq!(u64::from_le_bytes(bytes[..8].try_into().unwrap()), 24);
        assert!(bytes.len() > 40);
    }
}
