//! The lines a rank prints about its record, and the units they are written in.

use super::clock::clock;
use super::record::{Outcome, Record, Snapshot};

/// `0 B`, `4 B`, `1.25 MB`.
pub fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 4] = ["KB", "MB", "GB", "TB"];
    if n < 1000 {
        return format!("{n} B");
    }
    let mut x = n as f64;
    let mut unit = "B";
    for u in UNITS {
        if x < 1000.0 {
            break;
        }
        x /= 1000.0;
        unit = u;
    }
    format!("{x:.2} {unit}")
}

/// A duration in seconds as `3.1 ms` or `6.02 s`.
pub fn human_secs(s: f64) -> String {
    if s < 1.0 {
        format!("{:.1} ms", s * 1000.0)
    } else {
        format!("{s:.2} s")
    }
}

/// What a record's outcome column says.
pub fn describe(r: &Record, now_ms: u64) -> String {
    let took = r.dur_us as f64 / 1e6;
    match r.outcome {
        Outcome::Done => format!("took {}", human_secs(took)),
        Outcome::Failed => format!("failed after {}", human_secs(took)),
        Outcome::TimedOut => format!("timed out after {}", human_secs(took)),
        Outcome::Running => format!(
            "running for {}",
            human_secs(now_ms.saturating_sub(r.start_us / 1000) as f64 / 1000.0)
        ),
    }
}

/// The lines a rank prints about itself, each tagged.
pub fn render(snap: &Snapshot, tag: &str, headline: &str, now_ms: u64) -> String {
    let mut out = format!("{tag} {headline}\n");
    let since = now_ms.saturating_sub(snap.phase_since_ms) as f64 / 1000.0;
    out += &format!(
        "{tag}   phase {} for {} (since {}), after step {} ({} step{} done by this process)\n",
        snap.phase.name(),
        human_secs(since),
        clock(snap.phase_since_ms),
        snap.step,
        snap.steps_here,
        if snap.steps_here == 1 { "" } else { "s" }
    );
    if snap.records.is_empty() {
        out += &format!("{tag}   no collective yet\n");
        return out;
    }
    out += &format!(
        "{tag}   last {} collective{}, oldest first:\n",
        snap.records.len(),
        if snap.records.len() == 1 { "" } else { "s" }
    );
    for r in &snap.records {
        out += &format!(
            "{tag}     #{:<6} {:<24} {:>10}  started {}  {}\n",
            r.seq,
            r.op,
            human_bytes(r.bytes),
            clock(r.start_us / 1000),
            describe(r, now_ms)
        );
    }
    out
}
