//! The launcher's hang report: one screen naming the stuck rank, its phase, and the last
//! collective every rank of this node completed, from the workers' trace files
//! (`dist::forensics::trace`) and their process states. The trace files are readable while a
//! worker is stopped and after it died, which is exactly when a report is wanted.

use super::exit::{signal_name, ExitKind};
use super::spawn::Worker;
use crate::dist::forensics::{self, trace, Snapshot};

/// What the launcher knows about one local worker.
struct Row<'a> {
    w: &'a Worker,
    trace: Option<Snapshot>,
    /// `stopped (SIGSTOP)`, `running`, `exited with code 1`, ...
    state: String,
    stopped: bool,
}

/// The report, as one block of `lockstep run:` lines. `why` says what prompted it.
pub(super) fn report(workers: &[Worker], exits: &[Option<ExitKind>], why: &str) -> String {
    let now = forensics::now_ms();
    let rows: Vec<Row> = workers
        .iter()
        .zip(exits)
        .map(|(w, exit)| {
            let (state, stopped) = match exit {
                Some(ExitKind::Code(c)) => (format!("exited, code {c}"), false),
                Some(ExitKind::Signal(s)) => (format!("killed, {}", signal_name(*s)), false),
                None => match process_state(w.pid()) {
                    Some('T') | Some('t') => ("stopped (SIGSTOP)".to_string(), true),
                    Some('D') => ("in disk wait".to_string(), false),
                    Some('Z') | None => ("exited".to_string(), false),
                    Some(_) => ("running".to_string(), false),
                },
            };
            Row {
                w,
                trace: trace::read(&w.trace).ok(),
                state,
                stopped,
            }
        })
        .collect();

    let mut out = vec![format!("hang report ({why}):")];
    out.extend(stuck_lines(&rows, now));
    out.push(format!(
        "  {:>4}  {:<20} {:<24} {:>6}  {:<34} {}",
        "rank", "process", "phase", "step", "last completed collective", "unfinished collective"
    ));
    for r in &rows {
        let Some(t) = &r.trace else {
            out.push(format!(
                "  {:>4}  {:<20} (no trace: the worker did not get as far as starting its rank)",
                r.w.rank, r.state
            ));
            continue;
        };
        let phase = format!(
            "{} for {}",
            t.phase.name(),
            forensics::human_secs(now.saturating_sub(t.phase_since_ms) as f64 / 1000.0)
        );
        let done = t.last_completed().map_or("none".to_string(), |c| {
            format!("#{} {} {}", c.seq, c.op, forensics::human_bytes(c.bytes))
        });
        let open = t.unfinished().map_or("-".to_string(), |c| {
            format!("#{} {}, {}", c.seq, c.op, forensics::describe(c, now))
        });
        out.push(format!(
            "  {:>4}  {:<20} {:<24} {:>6}  {:<34} {}",
            r.w.rank, r.state, phase, t.step, done, open
        ));
    }
    out.push(
        "  a rank whose collective failed printed its last collectives to its log \
         (rank_N.log); SIGUSR1 to lockstep run makes every rank print them"
            .to_string(),
    );
    out.iter()
        .map(|l| format!("lockstep run: {l}"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Who is stuck, and why the launcher thinks so: a rank stopped by a signal, or a rank that
/// never entered the collective the others are in.
fn stuck_lines(rows: &[Row], now: u64) -> Vec<String> {
    let newest = rows
        .iter()
        .filter_map(|r| r.trace.as_ref())
        .map(Snapshot::entered)
        .max()
        .unwrap_or(0);
    // The collective the others wait in (or gave up on), for naming it.
    let waited = rows
        .iter()
        .filter_map(|r| r.trace.as_ref()?.unfinished())
        .find(|c| c.seq == newest);
    let waiters: Vec<String> = rows
        .iter()
        .filter(|r| {
            r.trace
                .as_ref()
                .and_then(Snapshot::unfinished)
                .is_some_and(|c| c.seq == newest)
        })
        .map(|r| r.w.rank.to_string())
        .collect();
    let mut lines = Vec::new();
    for r in rows {
        let behind = r
            .trace
            .as_ref()
            .filter(|t| waited.is_some() && t.entered() < newest && t.unfinished().is_none());
        if !r.stopped && behind.is_none() {
            continue;
        }
        let mut why = Vec::new();
        if r.stopped {
            why.push("its process is stopped (SIGSTOP; SIGCONT resumes it)".to_string());
        }
        if let (Some(_), Some(c)) = (behind, waited) {
            why.push(format!(
                "it has not entered collective #{} ({}) that rank{} {} in",
                c.seq,
                c.op,
                if waiters.len() == 1 { "" } else { "s" },
                waiters.join(", ") + if waiters.len() == 1 { " is" } else { " are" }
            ));
        }
        let phase = r
            .trace
            .as_ref()
            .map_or("unknown (no trace)".to_string(), |t| {
                format!(
                    "{} for {}, after step {}",
                    t.phase.name(),
                    forensics::human_secs(now.saturating_sub(t.phase_since_ms) as f64 / 1000.0),
                    t.step
                )
            });
        lines.push(format!(
            "  stuck: rank {} ({}, pid {}) in phase {phase}: {}",
            r.w.rank,
            r.w.device(),
            r.w.pid(),
            why.join("; ")
        ));
    }
    if lines.is_empty() {
        lines.push(match waited {
            Some(c) => format!(
                "  no local rank is behind: all that are waiting are in collective #{} ({}); the \
                 missing rank is on another node or inside it (see the ranks' errors)",
                c.seq, c.op
            ),
            None => "  no local rank is waiting in a collective".to_string(),
        });
    }
    lines
}

/// The state letter of `/proc/<pid>/stat` (R, S, D, T, Z, ...).
fn process_state(pid: u32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(") ")?.1.chars().next()
}
