//! The launchers' rendezvous: node 0's launcher hosts the run's TCPStore (bound to the master
//! address only), the workers of every node and the other nodes' launchers join it. Because the
//! store lives in a launcher rather than in rank 0, it outlives the workers, which is what lets
//! the launchers agree on a restart after a worker died (torchrun's elastic-agent model).
//!
//! Per attempt `a` (0 for the first start, then one per restart), keys under
//! `lockstep/launch/<a>/`:
//! - `stop`: set by any launcher whose worker failed or who got SIGINT/SIGTERM; every launcher
//!   polls it and stops its own workers, so all nodes tear down together;
//! - `report/<node>`: how the attempt ended on that node (JSON [`NodeReport`]), once its
//!   workers are all gone;
//! - `decision`: node 0's verdict once every node reported (JSON [`Decision`]): restart (from
//!   where) or finish (with which code). A node that does not report in time is named;
//! - `ack/<node>`: a node read a final decision, so node 0 may take the store down.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

use super::exit::ExitKind;
use super::plan::{LaunchPlan, RestartPolicy};
use super::supervise::{Peers, RankFailure};
use crate::dist::{Store, StoreError, StoreErrorKind};
use crate::run::checkpoints;

/// How long node 0 gives the other nodes, after its own workers are down, to report theirs
/// (on top of `--grace-s`): noticing the stop takes a store poll, tearing down takes the grace.
const REPORT_SLACK: Duration = Duration::from_secs(30);
/// A node whose heartbeat ([`Rendezvous::heartbeat`], every few hundred ms while it supervises)
/// has not moved for this long, and that has not reported, is taken as gone: its launcher died
/// (or lost the store), so node 0 does not wait [`REPORT_SLACK`] for it.
const HEARTBEAT_LOST: Duration = Duration::from_secs(3);
/// How long node 0 keeps the store up for the other nodes to read a final decision.
const ACK_WAIT: Duration = Duration::from_secs(10);
/// Poll interval while waiting for keys (the store's `wait` cannot say which key is missing).
const KEY_POLL: Duration = Duration::from_millis(100);

/// A worker's failure as the launchers exchange it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FailureReport {
    pub rank: usize,
    pub node: usize,
    /// "GPU 3" / "CPU".
    pub device: String,
    /// The code it stands for (128 + signal for a signal).
    pub exit_code: i32,
    /// "exit code 7", "killed by signal 9 (SIGKILL)".
    pub how: String,
    pub before_first_step: bool,
    pub collateral: bool,
    pub at_ms: u64,
}

impl FailureReport {
    pub(super) fn of(f: &RankFailure, node: usize) -> FailureReport {
        FailureReport {
            rank: f.rank,
            node,
            device: f.device.clone(),
            exit_code: f.exit.exit_code(),
            how: describe_exit(f.exit),
            before_first_step: f.before_first_step,
            collateral: f.collateral,
            at_ms: f.at_ms,
        }
    }

    fn who(&self, nnodes: usize) -> String {
        if nnodes > 1 {
            format!("rank {} (node {}, {})", self.rank, self.node, self.device)
        } else {
            format!("rank {} ({})", self.rank, self.device)
        }
    }
}

fn describe_exit(e: ExitKind) -> String {
    match e {
        ExitKind::Code(c) => format!("exited with code {c}"),
        other => format!("was {other}"),
    }
}

/// How an attempt ended on one node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeReport {
    pub node: usize,
    /// The worker of this node whose failure stopped it, if one did.
    pub failure: Option<FailureReport>,
    /// SIGINT/SIGTERM the launcher of this node got.
    pub interrupted_by: Option<i32>,
    /// Every worker of this node exited 0 (after a signal: each saved its checkpoint).
    #[serde(default)]
    pub clean: bool,
}

/// The other nodes during attempt `attempt`, for the supervision loop.
pub(super) struct AttemptPeers<'a> {
    rdzv: &'a Rendezvous,
    attempt: usize,
    /// We asked already (the store is not asked twice).
    requested: bool,
}

impl<'a> AttemptPeers<'a> {
    pub(super) fn new(rdzv: &'a Rendezvous, attempt: usize) -> Self {
        AttemptPeers {
            rdzv,
            attempt,
            requested: false,
        }
    }
}

impl Peers for AttemptPeers<'_> {
    fn stop_requested(&mut self) -> bool {
        // A single node has nobody to hear from.
        self.rdzv.nnodes > 1 && self.rdzv.stop_requested(self.attempt)
    }

    fn request_stop(&mut self) {
        if self.rdzv.nnodes > 1 && !std::mem::replace(&mut self.requested, true) {
            self.rdzv.request_stop(self.attempt);
        }
    }

    fn alive(&mut self) {
        if self.rdzv.nnodes > 1 {
            self.rdzv.heartbeat();
        }
    }
}

/// Node 0's verdict on an attempt.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Decision {
    /// Every node exits with `exit_code`; `message` (if any) says why.
    Finish {
        exit_code: i32,
        message: Option<String>,
    },
    /// Every node starts its workers again, resuming from `resume` (None = the latest
    /// complete checkpoint, `--resume auto`).
    Restart {
        resume: Option<PathBuf>,
        message: String,
        /// The failure that caused it came before the failing rank's first step.
        before_first_step: bool,
    },
}

/// Decides what follows attempt `attempt` from every node's report (`missing`: nodes that did
/// not report). `prev_before_first_step`: the previous restart was caused by a rank that
/// failed before its first step.
pub fn decide(
    policy: &RestartPolicy,
    nnodes: usize,
    attempt: usize,
    reports: &[NodeReport],
    missing: &[usize],
    prev_before_first_step: bool,
) -> Decision {
    let root = culprit(reports);
    if let Some((node, sig)) = reports
        .iter()
        .find_map(|r| Some((r.node, r.interrupted_by?)))
    {
        let message = (nnodes > 1).then(|| {
            format!(
                "node {node}'s launcher got {}; every node stops",
                super::exit::signal_name(sig)
            )
        });
        // A stop every worker saved and exited 0 from is a success, as for `lockstep train`;
        // a worker killed (a second signal) or failing gives the shell's 128 + signal.
        let saved = reports.iter().all(|r| r.clean) && missing.is_empty();
        return Decision::Finish {
            exit_code: if saved { 0 } else { 128 + sig },
            message,
        };
    }
    if !missing.is_empty() {
        let list: Vec<String> = missing.iter().map(usize::to_string).collect();
        return Decision::Finish {
            exit_code: root.map_or(1, |f| f.exit_code),
            message: Some(format!(
                "node(s) {} did not report back after the workers were stopped (its launcher \
                 died, or cannot reach the rendezvous store); not restarting",
                list.join(", ")
            )),
        };
    }
    let Some(root) = root else {
        return Decision::Finish {
            exit_code: 0,
            message: None,
        };
    };
    let who = root.who(nnodes);
    if attempt >= policy.max_restarts {
        let message = (policy.max_restarts > 0).then(|| {
            format!(
                "giving up: {who} {} after {} restart{} (--max-restarts {}); exiting with its \
                 code {}",
                root.how,
                attempt,
                if attempt == 1 { "" } else { "s" },
                policy.max_restarts,
                root.exit_code
            )
        });
        return Decision::Finish {
            exit_code: root.exit_code,
            message,
        };
    }
    if root.before_first_step && prev_before_first_step {
        return Decision::Finish {
            exit_code: root.exit_code,
            message: Some(format!(
                "not restarting: {who} {} before its first step, as in the previous attempt; a \
                 failure at start-up (config, data, environment) will not heal by restarting. \
                 Exiting with its code {}",
                root.how, root.exit_code
            )),
        };
    }
    let (resume, from) = resume_target(policy);
    Decision::Restart {
        resume,
        message: format!(
            "restart {} of {}: {who} {}{}; all workers restart {from}",
            attempt + 1,
            policy.max_restarts,
            root.how,
            if root.before_first_step {
                " before its first step"
            } else {
                ""
            },
        ),
        before_first_step: root.before_first_step,
    }
}

/// The failure that explains the others: one that is not a rank losing its peer, else the
/// earliest.
fn culprit(reports: &[NodeReport]) -> Option<&FailureReport> {
    reports
        .iter()
        .filter_map(|r| r.failure.as_ref())
        .min_by_key(|f| (f.collateral, f.at_ms))
}

/// What a restart resumes from, and a phrase saying so.
fn resume_target(policy: &RestartPolicy) -> (Option<PathBuf>, String) {
    // A save every rank had reported when the workers stopped is complete: commit it first.
    let committed = policy
        .checkpoints
        .as_deref()
        .map(checkpoints::reported::commit_reported)
        .unwrap_or_default();
    let latest = policy
        .checkpoints
        .as_deref()
        .and_then(|root| checkpoints::list(root).pop());
    match (latest, &policy.resume_fallback) {
        (Some((step, dir)), _) => (
            None,
            format!(
                "from the latest complete checkpoint, {} (step {step}{})",
                dir.display(),
                match committed.contains(&dir) {
                    true => ", committed now: every rank had written and reported its files",
                    false => "",
                }
            ),
        ),
        (None, Some(dir)) => (
            Some(dir.clone()),
            format!(
                "from {} (--resume; the run has no checkpoint of its own yet)",
                dir.display()
            ),
        ),
        (None, None) if policy.checkpoints.is_some() => (
            None,
            "from the start (no complete checkpoint yet)".to_string(),
        ),
        (None, None) => (None, "with --resume auto".to_string()),
    }
}

/// This node's launcher's handle on the run's store.
pub struct Rendezvous {
    store: Store,
    node: usize,
    nnodes: usize,
    grace: Duration,
    /// How long to wait for node 0 (connecting, a decision).
    timeout: Duration,
    /// Heartbeats sent so far (the value of this node's `alive` key).
    beats: std::sync::atomic::AtomicU64,
}

impl Rendezvous {
    /// Node 0 hosts the store at `--master-addr:--master-port` (port 0 picks a free one);
    /// the other nodes connect to it, waiting up to the plan's rendezvous timeout.
    pub fn open(plan: &LaunchPlan) -> Result<Rendezvous> {
        let (addr, port) = (plan.node.master_addr.as_str(), plan.node.master_port);
        let store = if plan.node.node_rank == 0 {
            if plan.node.nnodes > 1 {
                crate::dist::store::check_reachable_name(addr)?;
            }
            Store::server(addr, port, 0, plan.rendezvous_timeout).map_err(|e| {
                match e.downcast_ref::<StoreError>() {
                    Some(se) if se.kind == StoreErrorKind::AddrInUse => anyhow::anyhow!(
                        "--master-port {port}: address {addr}:{port} is already in use; \
                         choose another port or 0 for a free one"
                    ),
                    _ => e,
                }
            })?
        } else {
            Store::client(addr, port, plan.rendezvous_timeout).with_context(|| {
                format!(
                    "node {}: cannot reach node 0's launcher at {addr}:{port} within {} s; is \
                     `lockstep run --node-rank 0` running there with the same --master-port?",
                    plan.node.node_rank,
                    plan.rendezvous_timeout.as_secs()
                )
            })?
        };
        Ok(Rendezvous {
            store,
            node: plan.node.node_rank,
            nnodes: plan.node.nnodes,
            grace: plan.grace,
            timeout: plan.rendezvous_timeout,
            beats: Default::default(),
        })
    }

    /// The store's port, exported to the workers as MASTER_PORT.
    pub fn port(&self) -> u16 {
        self.store.port()
    }

    fn key(attempt: usize, what: &str) -> String {
        format!("lockstep/launch/{attempt}/{what}")
    }

    fn alive_key(node: usize) -> String {
        format!("lockstep/launch/alive/{node}")
    }

    /// Moves this node's heartbeat on (best effort: a store that is gone is noticed elsewhere).
    pub(super) fn heartbeat(&self) {
        let beat = self
            .beats
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let _ = self
            .store
            .set(&Self::alive_key(self.node), beat.to_string().as_bytes());
    }

    /// Whether some launcher asked everyone to stop attempt `attempt`. A store that cannot be
    /// reached means node 0's launcher is gone: stop too.
    pub(super) fn stop_requested(&self, attempt: usize) -> bool {
        self.store
            .check(&[&Self::key(attempt, "stop")])
            .unwrap_or(true)
    }

    pub(super) fn request_stop(&self, attempt: usize) {
        let _ = self.store.set(
            &Self::key(attempt, "stop"),
            self.node.to_string().as_bytes(),
        );
    }

    /// Reports how attempt `attempt` ended here and returns node 0's decision (node 0 makes it).
    pub(super) fn agree(
        &self,
        attempt: usize,
        report: &NodeReport,
        policy: &RestartPolicy,
        prev_before_first_step: bool,
    ) -> Result<Decision> {
        let gone = |e: anyhow::Error| -> anyhow::Error {
            e.context(format!(
                "node {}: node 0's launcher, which hosts the rendezvous store at {}:{}, is gone",
                self.node,
                self.store.host(),
                self.store.port()
            ))
        };
        let me = Self::key(attempt, &format!("report/{}", self.node));
        self.store
            .set(&me, &serde_json::to_vec(report)?)
            .map_err(gone)?;
        let decision_key = Self::key(attempt, "decision");
        if self.node != 0 {
            let limit = self.grace * 2 + REPORT_SLACK * 3;
            self.store
                .wait(&[&decision_key], limit.max(self.timeout))
                .map_err(gone)?;
            let decision: Decision =
                serde_json::from_slice(&self.store.get(&decision_key).map_err(gone)?)?;
            let ack = Self::key(attempt, &format!("ack/{}", self.node));
            let _ = self.store.set(&ack, b"1");
            return Ok(decision);
        }
        let (reports, missing) = self.collect_reports(attempt)?;
        let decision = decide(
            policy,
            self.nnodes,
            attempt,
            &reports,
            &missing,
            prev_before_first_step,
        );
        self.store
            .set(&decision_key, &serde_json::to_vec(&decision)?)?;
        if matches!(decision, Decision::Finish { .. }) {
            // The store goes when this launcher exits: let the others read the verdict first.
            let acks: Vec<String> = (1..self.nnodes)
                .filter(|n| !missing.contains(n))
                .map(|n| Self::key(attempt, &format!("ack/{n}")))
                .collect();
            let keys: Vec<&str> = acks.iter().map(String::as_str).collect();
            if !keys.is_empty() {
                let _ = self.store.wait(&keys, ACK_WAIT);
            }
        }
        Ok(decision)
    }

    /// Node 0: every node's report, waiting up to the grace plus [`REPORT_SLACK`]; the nodes
    /// that did not report by then are returned as missing.
    fn collect_reports(&self, attempt: usize) -> Result<(Vec<NodeReport>, Vec<usize>)> {
        let deadline = Instant::now() + self.grace + REPORT_SLACK;
        let keys: Vec<String> = (0..self.nnodes)
            .map(|n| Self::key(attempt, &format!("report/{n}")))
            .collect();
        // node → (its last heartbeat seen, when it was first seen at that value)
        let mut beats: std::collections::HashMap<usize, (Vec<u8>, Instant)> = Default::default();
        loop {
            let mut reports = Vec::new();
            let mut missing = Vec::new();
            for (n, k) in keys.iter().enumerate() {
                if self.store.check(&[k])? {
                    reports.push(serde_json::from_slice(&self.store.get(k)?)?);
                } else {
                    missing.push(n);
                }
            }
            let now = Instant::now();
            let mut all_gone = !missing.is_empty();
            for &n in &missing {
                let alive = Self::alive_key(n);
                let beat = if self.store.check(&[&alive])? {
                    Some(self.store.get(&alive)?)
                } else {
                    None
                };
                let gone = match beat {
                    // Never heard from (still starting): only the deadline decides.
                    None => false,
                    Some(b) => {
                        let seen = beats.entry(n).or_insert_with(|| (b.clone(), now));
                        if seen.0 != b {
                            *seen = (b, now);
                        }
                        now.duration_since(seen.1) > HEARTBEAT_LOST
                    }
                };
                all_gone &= gone;
            }
            if missing.is_empty() || all_gone || now >= deadline {
                return Ok((reports, missing));
            }
            std::thread::sleep(KEY_POLL);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn failure(rank: usize, node: usize, code: i32, collateral: bool, at_ms: u64) -> FailureReport {
        FailureReport {
            rank,
            node,
            device: "CPU".into(),
            exit_code: code,
            how: format!("exited with code {code}"),
            before_first_step: false,
            collateral,
            at_ms,
        }
    }

    fn node(n: usize, failure: Option<FailureReport>) -> NodeReport {
        NodeReport {
            node: n,
            clean: failure.is_none(),
            failure,
            interrupted_by: None,
        }
    }

    fn policy(max: usize) -> RestartPolicy {
        RestartPolicy {
            max_restarts: max,
            ..Default::default()
        }
    }

    #[test]
    fn success_everywhere_finishes_with_0() {
        let d = decide(
            &policy(3),
            2,
            0,
            &[node(0, None), node(1, None)],
            &[],
            false,
        );
        assert_eq!(
            d,
            Decision::Finish {
                exit_code: 0,
                message: None
            }
        );
    }

    #[test]
    fn the_culprit_is_the_rank_that_did_not_just_lose_a_peer() {
        // Node 0's rank 0 noticed first (collateral), node 1's rank 1 was killed.
        let reports = [
            node(0, Some(failure(0, 0, 1, true, 100))),
            node(1, Some(failure(1, 1, 137, false, 200))),
        ];
        match decide(&policy(3), 2, 0, &reports, &[], false) {
            Decision::Restart {
                message, resume, ..
            } => {
                assert!(
                    message.starts_with("restart 1 of 3: rank 1 (node 1, CPU)"),
                    "{message}"
                );
                assert_eq!(resume, None);
            }
            d => panic!("{d:?}"),
        }
        // Out of restarts: the culprit's code.
        match decide(&policy(3), 2, 3, &reports, &[], false) {
            Decision::Finish { exit_code, message } => {
                assert_eq!(exit_code, 137);
                let m = message.unwrap();
                assert!(
                    m.contains("giving up") && m.contains("--max-restarts 3"),
                    "{m}"
                );
            }
            d => panic!("{d:?}"),
        }
        // --max-restarts 0: today's behaviour, no extra message.
        assert_eq!(
            decide(&policy(0), 2, 0, &reports, &[], false),
            Decision::Finish {
                exit_code: 137,
                message: None
            }
        );
    }

    #[test]
    fn failing_before_the_first_step_twice_stops_the_retries() {
        let mut f = failure(1, 0, 2, false, 0);
        f.before_first_step = true;
        let reports = [node(0, Some(f))];
        assert!(matches!(
            decide(&policy(5), 1, 0, &reports, &[], false),
            Decision::Restart {
                before_first_step: true,
                ..
            }
        ));
        match decide(&policy(5), 1, 1, &reports, &[], true) {
            Decision::Finish { exit_code, message } => {
                assert_eq!(exit_code, 2);
                assert!(message.unwrap().contains("before its first step"));
            }
            d => panic!("{d:?}"),
        }
    }

    #[test]
    fn a_missing_node_is_named_and_an_interrupt_stops_everyone() {
        let d = decide(
            &policy(5),
            3,
            0,
            &[node(0, Some(failure(0, 0, 1, true, 0)))],
            &[1, 2],
            false,
        );
        match d {
            Decision::Finish { message, .. } => {
                assert!(message
                    .unwrap()
                    .contains("node(s) 1, 2 did not report back"))
            }
            d => panic!("{d:?}"),
        }
        let mut r = node(1, None);
        r.interrupted_by = Some(libc::SIGINT);
        // Every worker saved and exited 0: a stop that saved exits 0; else 128 + SIGINT.
        for (clean, code) in [(true, 0), (false, 130)] {
            r.clean = clean;
            match decide(&policy(5), 2, 0, &[node(0, None), r.clone()], &[], false) {
                Decision::Finish { exit_code, message } => {
                    assert_eq!(exit_code, code);
                    assert!(message.unwrap().contains("node 1's launcher got SIGINT"));
                }
                d => panic!("{d:?}"),
            }
        }
    }

    #[test]
    fn a_restart_resumes_from_the_runs_checkpoint_else_the_given_one() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("ckpts");
        std::fs::create_dir_all(&root).unwrap();
        let mut p = policy(2);
        p.checkpoints = Some(root.clone());
        p.resume_fallback = Some(dir.path().join("other/step_40"));
        let reports = [node(0, Some(failure(0, 0, 1, false, 0)))];
        match decide(&p, 1, 0, &reports, &[], false) {
            Decision::Restart {
                resume, message, ..
            } => {
                assert_eq!(resume, p.resume_fallback);
                assert!(
                    message.contains("no checkpoint of its own yet"),
                    "{message}"
                );
            }
            d => panic!("{d:?}"),
        }
        let step = root.join("step_6");
        std::fs::create_dir_all(&step).unwrap();
        std::fs::write(step.join("trainer.json"), "{}").unwrap();
        match decide(&p, 1, 0, &reports, &[], false) {
            Decision::Restart {
                resume, message, ..
            } => {
                assert_eq!(resume, None);
                assert!(message.ends_with("(step 6)"), "{message}");
            }
            d => panic!("{d:?}"),
        }
    }
}
