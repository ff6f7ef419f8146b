//! Worker output: one reader thread per worker (stdout and stderr share a pipe) turns bytes
//! into lines, tags them with the
//! rank's device, writes them to the console (filtered) and to the rank's log (unfiltered).
//!
//! Log files get the same tagged line as the console, so several logs can be concatenated or
//! grepped together without losing which rank said what.

use std::collections::VecDeque;
use std::fs::File;
use std::io::{BufRead, BufReader, Read, Write};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::sinks::SharedWriter;

/// Lines kept per rank for the failure report.
pub(super) const TAIL_LINES: usize = 20;
/// A "line" longer than this without a newline is emitted in pieces, so a worker that never
/// prints a newline cannot make the launcher buffer without bound.
const MAX_LINE: u64 = 64 * 1024;

/// Shared state of one rank's output, used by its two reader threads and the supervisor.
pub(super) struct RankOutput {
    /// `[GPU3]` / `[CPU1]`.
    tag: String,
    /// Whether every line goes to the console, or only important-looking ones.
    show_all: bool,
    console: SharedWriter,
    log: Mutex<File>,
    /// The last lines, each with whether it went to the console too.
    tail: Mutex<VecDeque<(String, bool)>>,
    /// Reader threads not yet at end-of-file, with a condvar to wait for 0.
    open: Mutex<usize>,
    closed: Condvar,
}

impl RankOutput {
    pub(super) fn new(tag: String, show_all: bool, console: SharedWriter, log: File) -> Self {
        RankOutput {
            tag,
            show_all,
            console,
            log: Mutex::new(log),
            tail: Mutex::new(VecDeque::with_capacity(TAIL_LINES)),
            open: Mutex::new(0),
            closed: Condvar::new(),
        }
    }

    /// Starts a thread that forwards `pipe` line by line until end-of-file.
    pub(super) fn follow(
        self: &Arc<Self>,
        pipe: impl Read + Send + 'static,
    ) -> std::io::Result<JoinHandle<()>> {
        *lock(&self.open) += 1;
        let me = Arc::clone(self);
        let spawned = std::thread::Builder::new()
            .name(format!("lockstep-run-out{}", self.tag))
            .spawn(move || {
                me.pump(pipe);
                *lock(&me.open) -= 1;
                me.closed.notify_all();
            });
        if spawned.is_err() {
            *lock(&self.open) -= 1;
        }
        spawned
    }

    fn pump(&self, pipe: impl Read) {
        let mut reader = BufReader::new(pipe);
        let mut buf = Vec::new();
        loop {
            buf.clear();
            match (&mut reader).take(MAX_LINE).read_until(b'\n', &mut buf) {
                Ok(0) => return,
                Ok(_) => self.line(&buf),
                // The worker is gone or the pipe broke; nothing more will come.
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(_) => return,
            }
        }
    }

    fn line(&self, raw: &[u8]) {
        let text = String::from_utf8_lossy(raw);
        let text = text.trim_end_matches(['\n', '\r']);
        let tagged = tag_line(&self.tag, text);
        // Log errors (disk full) must not take training down; the console still has the line.
        let _ = writeln!(lock(&self.log), "{tagged}");
        let shown = self.show_all || looks_important(text);
        if shown {
            write_line(&self.console, &tagged);
        }
        let mut tail = lock(&self.tail);
        if tail.len() == TAIL_LINES {
            tail.pop_front();
        }
        tail.push_back((tagged, shown));
    }

    /// Waits until the output pipe reached end-of-file, at most `limit`.
    pub(super) fn wait_closed(&self, limit: Duration) {
        let deadline = Instant::now() + limit;
        let mut open = lock(&self.open);
        while *open > 0 {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return;
            }
            open = self
                .closed
                .wait_timeout(open, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// The last [`TAIL_LINES`] lines this rank printed, each with whether the console
    /// showed it.
    pub(super) fn tail(&self) -> Vec<(String, bool)> {
        lock(&self.tail).iter().cloned().collect()
    }
}

/// Writes `line` and a newline under the writer's lock, so lines never interleave. Console
/// errors (a closed stdout pipe) are ignored: the logs still get everything.
pub(super) fn write_line(sink: &SharedWriter, line: &str) {
    let mut out = lock(sink);
    let _ = out.write_all(line.as_bytes());
    let _ = out.write_all(b"\n");
    let _ = out.flush();
}

/// Prefixes `line` with `tag` unless the worker already tagged it itself (`[GPU<n>]` or
/// `[CPU<n>]` at the very start; the number may differ from ours).
pub(super) fn tag_line(tag: &str, line: &str) -> String {
    if has_device_tag(line) {
        line.to_string()
    } else {
        format!("{tag} {line}")
    }
}

fn has_device_tag(line: &str) -> bool {
    let Some(rest) = line
        .strip_prefix("[GPU")
        .or_else(|| line.strip_prefix("[CPU"))
    else {
        return false;
    };
    let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
    digits > 0 && rest.as_bytes().get(digits) == Some(&b']')
}

/// Whether a non-zero rank's line is shown when only rank 0 is followed: anything that looks
/// like a warning or an error. "nan" must stand alone as a word (`Loss: NaN`), so words such
/// as "maintenance" do not count.
pub(super) fn looks_important(line: &str) -> bool {
    const KEYS: [&str; 6] = ["error", "warn", "panic", "fatal", "timed out", "traceback"];
    let lower = line.to_ascii_lowercase();
    KEYS.iter().any(|k| lower.contains(k)) || has_word(&lower, "nan")
}

fn has_word(haystack: &str, word: &str) -> bool {
    let bytes = haystack.as_bytes();
    haystack.match_indices(word).any(|(at, _)| {
        let before = at.checked_sub(1).map(|i| bytes[i]);
        let after = bytes.get(at + word.len()).copied();
        !before.is_some_and(|b| b.is_ascii_alphanumeric())
            && !after.is_some_and(|b| b.is_ascii_alphanumeric())
    })
}

/// Locks, ignoring poisoning: a panicking output thread must not silence the others.
fn lock<T: ?Sized>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_untagged_lines_only() {
        assert_eq!(tag_line("[CPU1]", "hello"), "[CPU1] hello");
        assert_eq!(tag_line("[CPU1]", "[CPU0] step"), "[CPU0] step");
        assert_eq!(tag_line("[GPU3]", "[GPU12] x"), "[GPU12] x");
        assert_eq!(tag_line("[GPU3]", "[GPU] x"), "[GPU3] [GPU] x");
        assert_eq!(tag_line("[GPU3]", "[GPUx] x"), "[GPU3] [GPUx] x");
        assert_eq!(tag_line("[GPU3]", " [GPU1] x"), "[GPU3]  [GPU1] x");
    }

    #[test]
    fn important_lines() {
        for l in [
            "WARNING: low memory",
            "Error: boom",
            "thread 'main' panicked at",
            "Loss: NaN",
            "loss=nan,",
            "FATAL",
            "collective timed out",
            "Traceback (most recent call last):",
        ] {
            assert!(looks_important(l), "{l}");
        }
        for l in [
            "Step [1/10] | Loss: 3.2",
            "maintenance window",
            "nanoGPT-style",
        ] {
            assert!(!looks_important(l), "{l}");
        }
    }
}
