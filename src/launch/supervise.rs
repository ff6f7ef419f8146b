//! Waiting for the workers and stopping them together.
//!
//! The loop polls every [`POLL`]: signals first, then each worker with a non-blocking
//! `waitid`, then (less often) whether another node's launcher asked everyone to stop. The
//! first worker that fails on its own decides the exit code and makes the launcher SIGTERM the
//! others; a SIGINT/SIGTERM to the launcher, or a failure on another node, does the same;
//! anything still running `grace` later, or at a second signal, is SIGKILLed. SIGUSR1 prints a
//! hang report and makes every worker print its own snapshot; nothing stops.

use std::time::{Duration, Instant};

use super::exit::signal_name;
use super::exit::ExitKind;
use super::hang;
use super::output;
use super::signals::Watch;
use super::sinks::Sinks;
use super::spawn::{kill_group, Worker};
use crate::dist::forensics::{self, trace};

/// How often children and signals are checked; short enough that a stop feels immediate.
const POLL: Duration = Duration::from_millis(50);
/// How long a failure report waits for the failed rank's last lines to arrive.
const TAIL_WAIT: Duration = Duration::from_secs(1);
/// Polls between two looks at the other nodes (a store round trip each).
const PEER_POLLS: u32 = 4;

/// The worker whose failure stopped the run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankFailure {
    /// Global rank.
    pub rank: usize,
    /// "GPU 3" or "CPU".
    pub device: String,
    /// How it ended.
    pub exit: ExitKind,
    /// It completed no optimizer step in this attempt (its trace says so, or it left none).
    pub before_first_step: bool,
    /// Its last collective had failed: it most likely exited because another rank did.
    pub collateral: bool,
    /// When the launcher found it exited (milliseconds since the Unix epoch).
    pub at_ms: u64,
}

impl RankFailure {
    fn of(w: &Worker, exit: ExitKind) -> RankFailure {
        let snap = trace::read(&w.trace).ok();
        RankFailure {
            rank: w.rank,
            device: w.device(),
            exit,
            before_first_step: snap.as_ref().is_none_or(|s| s.steps_here == 0),
            collateral: snap.is_some_and(|s| s.gave_up().is_some()),
            at_ms: forensics::now_ms(),
        }
    }
}

/// The other nodes, as the supervision loop sees them.
pub(super) trait Peers {
    /// Whether another node asked every node to stop its workers.
    fn stop_requested(&mut self) -> bool;
    /// Asks every other node to stop its workers (a worker of ours failed, or we got a signal).
    fn request_stop(&mut self);
    /// Tells the other nodes this launcher is alive, while it supervises (node 0 stops waiting
    /// for a node whose heartbeat stopped).
    fn alive(&mut self);
}

/// Result of [`supervise`].
pub(super) struct Supervision {
    pub(super) failure: Option<RankFailure>,
    pub(super) interrupted_by: Option<i32>,
    /// Every worker exited 0.
    pub(super) clean: bool,
}

/// A stop in progress: SIGTERM has been sent.
struct Stopping {
    kill_at: Instant,
    killed: bool,
}

/// The supervision loop's state.
struct Supervisor<'a> {
    workers: &'a mut [Worker],
    /// How each worker ended, once reaped.
    exits: Vec<Option<ExitKind>>,
    grace: Duration,
    sinks: &'a Sinks,
    failure: Option<RankFailure>,
    interrupted_by: Option<i32>,
    stop: Option<Stopping>,
    peers: &'a mut dyn Peers,
}

/// Runs until every worker has exited and been reaped.
pub(super) fn supervise(
    workers: &mut [Worker],
    grace: Duration,
    sinks: &Sinks,
    signals: &Watch,
    peers: &mut dyn Peers,
) -> Supervision {
    let mut s = Supervisor {
        exits: vec![None; workers.len()],
        workers,
        grace,
        sinks,
        failure: None,
        interrupted_by: None,
        stop: None,
        peers,
    };
    for round in 0u32.. {
        if let Some((count, sig)) = signals.take() {
            s.on_signals(count, sig);
        }
        if signals.take_usr1() {
            s.on_usr1();
        }
        s.reap_exited();
        if s.exits.iter().all(Option::is_some) {
            break;
        }
        if round % PEER_POLLS == 0 {
            s.peers.alive();
        }
        if s.stop.is_none() && round % PEER_POLLS == 0 && s.peers.stop_requested() {
            s.note("a worker on another node failed (or its launcher was stopped); stopping this node's workers");
            s.begin_stop();
        }
        s.kill_after_grace();
        std::thread::sleep(POLL);
    }
    Supervision {
        clean: s.exits.iter().all(|e| e.is_some_and(|e| e.success())),
        failure: s.failure,
        interrupted_by: s.interrupted_by,
    }
}

impl Supervisor<'_> {
    /// `count` SIGINT/SIGTERMs arrived, the last being `sig`: the first one starts a graceful
    /// stop; any further one (or one during a failure's stop) kills at once.
    fn on_signals(&mut self, count: usize, sig: i32) {
        let mut repeats = count;
        if self.stop.is_none() {
            self.interrupted_by = Some(sig);
            self.note(&format!(
                "got {}; asking the workers to stop (send it again to kill them now)",
                signal_name(sig)
            ));
            self.peers.request_stop();
            self.begin_stop();
            repeats -= 1;
        }
        let killed = self.stop.as_ref().is_some_and(|s| s.killed);
        if repeats > 0 && !killed {
            self.note(&format!("got {}; killing the workers", signal_name(sig)));
            self.kill_now();
        }
    }

    /// SIGUSR1: the hang report, and every worker that can take it prints its snapshot.
    fn on_usr1(&mut self) {
        let text = hang::report(self.workers, &self.exits, "on SIGUSR1; nothing is stopped");
        output::write_line(&self.sinks.diag, &text);
        for (w, e) in self.workers.iter().zip(&self.exits) {
            // Until a worker has installed its handler, SIGUSR1 would terminate it.
            let ready = trace::read(&w.trace).is_ok_and(|t| t.ready);
            if e.is_none() && ready {
                // SAFETY: plain kill(2) on our own unreaped child.
                unsafe { libc::kill(w.pid() as libc::pid_t, libc::SIGUSR1) };
            }
        }
    }

    /// Reaps whatever has exited. The first worker to fail before any stop began is the
    /// failure and makes everyone else stop; of several found failed in one round, one that
    /// did not just lose a peer (see [`RankFailure::collateral`]) is the better culprit.
    fn reap_exited(&mut self) {
        let mut failed: Vec<(usize, RankFailure)> = Vec::new();
        for i in 0..self.workers.len() {
            if self.exits[i].is_some() {
                continue;
            }
            let Some(exit) = reap(&mut self.workers[i]) else {
                continue;
            };
            self.exits[i] = Some(exit);
            if exit.success() || self.stop.is_some() {
                // Exits after a stop began are consequences of the stop, not failures.
                continue;
            }
            failed.push((i, RankFailure::of(&self.workers[i], exit)));
        }
        let Some((i, failure)) = failed.into_iter().min_by_key(|(_, f)| f.collateral) else {
            return;
        };
        let exit = failure.exit;
        self.failure = Some(failure);
        // Stop the others first so they start shutting down while we report.
        self.peers.request_stop();
        self.begin_stop();
        report_failure(&self.workers[i], exit, self.sinks);
        // A collective timed out somewhere: say who is stuck, while a stopped rank still is.
        let timed_out = self.workers.iter().any(|w| {
            trace::read(&w.trace).is_ok_and(|t| t.gave_up() == Some(forensics::Outcome::TimedOut))
        });
        if timed_out {
            let text = hang::report(self.workers, &self.exits, "a collective timed out");
            output::write_line(&self.sinks.diag, &text);
        }
    }

    /// SIGKILLs what is still running once the grace has passed.
    fn kill_after_grace(&mut self) {
        let due = self
            .stop
            .as_ref()
            .is_some_and(|s| !s.killed && Instant::now() >= s.kill_at);
        if !due {
            return;
        }
        let left: Vec<String> = self
            .workers
            .iter()
            .zip(&self.exits)
            .filter(|(_, e)| e.is_none())
            .map(|(w, _)| w.rank.to_string())
            .collect();
        self.note(&format!(
            "rank(s) {} still running {:.1}s after SIGTERM; sending SIGKILL",
            left.join(","),
            self.grace.as_secs_f64()
        ));
        self.kill_now();
    }

    fn begin_stop(&mut self) {
        self.signal_running(libc::SIGTERM);
        self.stop = Some(Stopping {
            kill_at: Instant::now() + self.grace,
            killed: false,
        });
    }

    fn kill_now(&mut self) {
        self.signal_running(libc::SIGKILL);
        if let Some(s) = self.stop.as_mut() {
            s.killed = true;
        }
    }

    /// Sends `sig` to the process group of every worker not yet reaped.
    fn signal_running(&self, sig: libc::c_int) {
        for (w, e) in self.workers.iter().zip(&self.exits) {
            if e.is_none() {
                kill_group(w.pid(), sig);
            }
        }
    }

    fn note(&self, msg: &str) {
        output::write_line(&self.sinks.diag, &format!("lockstep run: {msg}"));
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
    } else if tail.iter().all(|(_, shown)| *shown) {
        // Every line is on the console already: not again.
        msg += &format!(
            "lockstep run: its last lines are above (log: {})",
            w.log_path.display()
        );
    } else {
        msg += &format!(
            "lockstep run: last {} line(s) of {}:",
            tail.len(),
            w.log_path.display()
        );
        for (line, _) in &tail {
            msg += "\n    ";
            msg += line;
        }
    }
    output::write_line(&sinks.diag, &msg);
}
