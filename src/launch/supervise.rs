//! Waiting for the workers and stopping them together.
//!
//! The loop polls every [`POLL`]: signals first, then each worker with a non-blocking
//! `waitid`. The first worker that fails on its own decides the exit code and makes the
//! launcher SIGTERM the others; a SIGINT/SIGTERM to the launcher does the same; anything
//! still running `grace` later, or at a second signal, is SIGKILLed.

use std::fmt;
use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;
use std::time::{Duration, Instant};

use super::output;
use super::signals::Watch;
use super::spawn::{kill_group, Worker};
use super::Sinks;

/// How often children and signals are checked; short enough that a stop feels immediate.
const POLL: Duration = Duration::from_millis(50);
/// How long a failure report waits for the failed rank's last lines to arrive.
const TAIL_WAIT: Duration = Duration::from_secs(1);

/// How a worker ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExitKind {
    /// Exited with this status code.
    Code(i32),
    /// Killed by this signal.
    Signal(i32),
}

impl ExitKind {
    fn from_status(status: ExitStatus) -> Self {
        match (status.code(), status.signal()) {
            (Some(code), _) => ExitKind::Code(code),
            (None, Some(sig)) => ExitKind::Signal(sig),
            // Stopped/continued statuses never reach here: we only wait for exits.
            (None, None) => ExitKind::Code(1),
        }
    }

    /// The shell convention: the code itself, or 128 + the signal number.
    pub fn exit_code(self) -> i32 {
        match self {
            ExitKind::Code(c) => c,
            ExitKind::Signal(s) => 128 + s,
        }
    }

    fn success(self) -> bool {
        self == ExitKind::Code(0)
    }
}

impl fmt::Display for ExitKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ExitKind::Code(c) => write!(f, "exit code {c}"),
            ExitKind::Signal(s) => write!(f, "killed by signal {} ({s})", signal_name(*s)),
        }
    }
}

/// The worker whose failure stopped the run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankFailure {
    /// Global rank.
    pub rank: usize,
    /// "GPU 3" or "CPU".
    pub device: String,
    /// How it ended.
    pub exit: ExitKind,
}

/// Result of [`supervise`].
pub(super) struct Supervision {
    pub(super) exit_code: i32,
    pub(super) failure: Option<RankFailure>,
    pub(super) interrupted_by: Option<i32>,
}

/// A stop in progress: SIGTERM has been sent.
struct Stopping {
    kill_at: Instant,
    killed: bool,
}

/// Runs until every worker has exited and been reaped.
pub(super) fn supervise(
    workers: &mut [Worker],
    grace: Duration,
    sinks: &Sinks,
    signals: &Watch,
) -> Supervision {
    let mut exits: Vec<Option<ExitKind>> = vec![None; workers.len()];
    let mut failure: Option<RankFailure> = None;
    let mut interrupted_by = None;
    let mut stop: Option<Stopping> = None;

    loop {
        if let Some((count, sig)) = signals.take() {
            let mut repeats = count;
            if stop.is_none() {
                interrupted_by = Some(sig);
                note(
                    sinks,
                    &format!(
                        "got {}; asking the workers to stop (send it again to kill them now)",
                        signal_name(sig)
                    ),
                );
                signal_running(workers, &exits, libc::SIGTERM);
                stop = Some(Stopping {
                    kill_at: Instant::now() + grace,
                    killed: false,
                });
                repeats -= 1;
            }
            // Any signal during a stop (ours or a failure's) means "now".
            let stopping = stop.as_mut().expect("a stop is in progress");
            if repeats > 0 && !stopping.killed {
                note(
                    sinks,
                    &format!("got {}; killing the workers", signal_name(sig)),
                );
                signal_running(workers, &exits, libc::SIGKILL);
                stopping.killed = true;
            }
        }

        for i in 0..workers.len() {
            if exits[i].is_some() {
                continue;
            }
            let Some(exit) = reap(&mut workers[i]) else {
                continue;
            };
            exits[i] = Some(exit);
            if exit.success() || stop.is_some() {
                // Exits after a stop began are consequences of the stop, not failures.
                continue;
            }
            let w = &workers[i];
            failure = Some(RankFailure {
                rank: w.rank,
                device: w.device(),
                exit,
            });
            // Stop the others first so they start shutting down while we report.
            signal_running(workers, &exits, libc::SIGTERM);
            stop = Some(Stopping {
                kill_at: Instant::now() + grace,
                killed: false,
            });
            report_failure(&workers[i], exit, sinks);
        }

        if exits.iter().all(Option::is_some) {
            break;
        }
        if let Some(s) = stop.as_mut() {
            if !s.killed && Instant::now() >= s.kill_at {
                let left: Vec<String> = workers
                    .iter()
                    .zip(&exits)
                    .filter(|(_, e)| e.is_none())
                    .map(|(w, _)| w.rank.to_string())
                    .collect();
                note(
                    sinks,
                    &format!(
                        "rank(s) {} still running {:.1}s after SIGTERM; sending SIGKILL",
                        left.join(","),
                        grace.as_secs_f64()
                    ),
                );
                signal_running(workers, &exits, libc::SIGKILL);
                s.killed = true;
            }
        }
        std::thread::sleep(POLL);
    }

    let exit_code = match (&failure, interrupted_by) {
        (Some(f), _) => f.exit.exit_code(),
        (None, Some(sig)) => 128 + sig,
        (None, None) => 0,
    };
    Supervision {
        exit_code,
        failure,
        interrupted_by,
    }
}

/// Reaps `w` if it has exited. Before reaping, its process group is swept with SIGKILL:
/// while the worker is an unreaped zombie its pid (= the group id) cannot be reused, so
/// the sweep can only hit what the worker itself left behind.
fn reap(w: &mut Worker) -> Option<ExitKind> {
    // SAFETY: waitid fills `info`, a zeroed siginfo_t we own; WNOWAIT leaves the child
    // waitable, so std's Child can still reap it below.
    let exited = unsafe {
        let mut info: libc::siginfo_t = std::mem::zeroed();
        let rc = libc::waitid(
            libc::P_PID,
            w.pid() as libc::id_t,
            &mut info,
            libc::WEXITED | libc::WNOHANG | libc::WNOWAIT,
        );
        // On error (cannot happen for our own child) let try_wait below decide.
        rc != 0 || info.si_pid() != 0
    };
    if !exited {
        return None;
    }
    kill_group(w.pid(), libc::SIGKILL);
    match w.child.try_wait() {
        Ok(Some(status)) => Some(ExitKind::from_status(status)),
        Ok(None) => None,
        // Already reaped elsewhere: nothing to wait for, report it as failed.
        Err(_) => Some(ExitKind::Code(1)),
    }
}

/// Sends `sig` to the process group of every worker not yet reaped.
fn signal_running(workers: &[Worker], exits: &[Option<ExitKind>], sig: libc::c_int) {
    for (w, e) in workers.iter().zip(exits) {
        if e.is_none() {
            kill_group(w.pid(), sig);
        }
    }
}

/// "lockstep run: rank R (DEV) failed: ..." and the rank's last lines, as one write so
/// concurrent launcher messages cannot split it.
fn report_failure(w: &Worker, exit: ExitKind, sinks: &Sinks) {
    w.output.wait_closed(TAIL_WAIT);
    let tail = w.output.tail();
    let mut msg = format!(
        "lockstep run: rank {} ({}) failed: {exit}\n",
        w.rank,
        w.device()
    );
    if tail.is_empty() {
        msg += &format!(
            "lockstep run: rank {} printed nothing (log: {})",
            w.rank,
            w.log_path.display()
        );
    } else {
        msg += &format!(
            "lockstep run: last {} line(s) of {}:",
            tail.len(),
            w.log_path.display()
        );
        for line in &tail {
            msg += "\n    ";
            msg += line;
        }
    }
    output::write_line(&sinks.diag, &msg);
}

fn note(sinks: &Sinks, msg: &str) {
    output::write_line(&sinks.diag, &format!("lockstep run: {msg}"));
}

/// Conventional name of a signal, for messages.
pub(super) fn signal_name(sig: i32) -> String {
    let name = match sig {
        libc::SIGHUP => "SIGHUP",
        libc::SIGINT => "SIGINT",
        libc::SIGQUIT => "SIGQUIT",
        libc::SIGILL => "SIGILL",
        libc::SIGTRAP => "SIGTRAP",
        libc::SIGABRT => "SIGABRT",
        libc::SIGBUS => "SIGBUS",
        libc::SIGFPE => "SIGFPE",
        libc::SIGKILL => "SIGKILL",
        libc::SIGUSR1 => "SIGUSR1",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGUSR2 => "SIGUSR2",
        libc::SIGPIPE => "SIGPIPE",
        libc::SIGALRM => "SIGALRM",
        libc::SIGTERM => "SIGTERM",
        libc::SIGXCPU => "SIGXCPU",
        libc::SIGXFSZ => "SIGXFSZ",
        _ => return format!("signal {sig}"),
    };
    name.to_string()
}
