//! Slurm without wrapper scripts: the rank layout of `srun lockstep train …` (one task per
//! rank) and the node layout of `srun --ntasks-per-node=1 lockstep run …` (one launcher per
//! node), read from the variables srun sets, and Slurm's compressed host lists
//! (`gpu[01-04,07],cpu3`), whose first host is the rendezvous host.
//!
//! torchrun's variables win where both are present (RANK/WORLD_SIZE select torchrun's layout
//! altogether; MASTER_ADDR/MASTER_PORT override the node list and the job id). Without
//! MASTER_PORT the port is derived from the job id as PyTorch Lightning's Slurm recipe does
//! (15000 + the id's last four digits), so every task of a job computes the same one.

use anyhow::{bail, ensure, Context, Result};

/// Expansions larger than this are refused: a typo such as `node[1-99999999]` should not
/// allocate a list of a hundred million names.
const MAX_HOSTS: usize = 1 << 20;

/// Expands a Slurm host list: `gpu[01-04,07],cpu3` → gpu01 gpu02 gpu03 gpu04 gpu07 cpu3.
/// Several bracket groups in one name multiply (`r[1-2]-n[1-2]` → r1-n1 r1-n2 r2-n1 r2-n2);
/// numbers keep the zero padding of the range's first bound.
pub fn expand_nodelist(list: &str) -> Result<Vec<String>> {
    let list = list.trim();
    ensure!(!list.is_empty(), "empty host list");
    let mut hosts = Vec::new();
    for item in split_top_level(list)? {
        ensure!(
            !item.is_empty(),
            "host list {list:?}: empty entry between commas"
        );
        hosts.extend(expand_one(item).with_context(|| format!("host list {list:?}"))?);
        ensure!(
            hosts.len() <= MAX_HOSTS,
            "host list {list:?} expands to more than {MAX_HOSTS} hosts"
        );
    }
    Ok(hosts)
}

/// Splits at the commas outside brackets.
fn split_top_level(list: &str) -> Result<Vec<&str>> {
    let mut out = Vec::new();
    let (mut depth, mut start) = (0usize, 0usize);
    for (i, c) in list.char_indices() {
        match c {
            '[' if depth == 0 => depth = 1,
            '[' => bail!("host list {list:?}: nested '['"),
            ']' if depth == 1 => depth = 0,
            ']' => bail!("host list {list:?}: ']' without '['"),
            ',' if depth == 0 => {
                out.push(list[start..i].trim());
                start = i + 1;
            }
            _ => {}
        }
    }
    ensure!(depth == 0, "host list {list:?}: '[' is never closed");
    out.push(list[start..].trim());
    Ok(out)
}

/// One name with any number of bracket groups.
fn expand_one(item: &str) -> Result<Vec<String>> {
    let mut names = vec![String::new()];
    let mut rest = item;
    while let Some(open) = rest.find('[') {
        let close = rest[open..]
            .find(']')
            .map(|c| open + c)
            .context("'[' is never closed")?;
        let prefix = &rest[..open];
        let choices = expand_ranges(&rest[open + 1..close])?;
        ensure!(
            names.len().saturating_mul(choices.len()) <= MAX_HOSTS,
            "{item:?} expands to more than {MAX_HOSTS} hosts"
        );
        names = names
            .iter()
            .flat_map(|n| choices.iter().map(move |c| format!("{n}{prefix}{c}")))
            .collect();
        rest = &rest[close + 1..];
    }
    for n in &mut names {
        n.push_str(rest);
    }
    Ok(names)
}

/// `01-04,07` → 01 02 03 04 07.
fn expand_ranges(spec: &str) -> Result<Vec<String>> {
    ensure!(!spec.trim().is_empty(), "empty brackets '[]'");
    let mut out = Vec::new();
    for part in spec.split(',') {
        let part = part.trim();
        let (lo, hi) = part.split_once('-').unwrap_or((part, part));
        let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
        ensure!(
            digits(lo) && digits(hi),
            "[{spec}]: {part:?} is not a number or a range N-M"
        );
        let width = lo.len();
        let (a, b): (u64, u64) = (lo.parse()?, hi.parse()?);
        ensure!(a <= b, "[{spec}]: range {part:?} runs backwards");
        ensure!(
            b - a < MAX_HOSTS as u64,
            "[{spec}]: range {part:?} is too large"
        );
        out.extend((a..=b).map(|n| format!("{n:0width$}")));
    }
    Ok(out)
}

/// Expands Slurm's tasks-per-node form `2(x3),1` → [2, 2, 2, 1].
fn expand_tasks_per_node(s: &str) -> Result<Vec<usize>> {
    let mut out = Vec::new();
    for part in s.split(',') {
        let part = part.trim();
        let (n, times) = match part.split_once("(x") {
            Some((n, rep)) => (n, rep.trim_end_matches(')')),
            None => (part, "1"),
        };
        let n: usize = n
            .parse()
            .with_context(|| format!("{s:?}: {part:?} is not a task count"))?;
        let times: usize = times
            .parse()
            .with_context(|| format!("{s:?}: {part:?} has a bad repeat count"))?;
        ensure!(
            out.len().saturating_add(times) <= MAX_HOSTS,
            "{s:?} lists more than {MAX_HOSTS} nodes"
        );
        out.extend(std::iter::repeat_n(n, times));
    }
    Ok(out)
}

/// The port every task of job `id` derives when MASTER_PORT is not set.
pub fn port_from_job_id(id: u64) -> u16 {
    15000 + (id % 10000) as u16
}

/// A variable's value, read through an injectable lookup (tests do not touch the environment).
struct Vars<'a, F: Fn(&str) -> Option<String>> {
    get: &'a F,
}

impl<F: Fn(&str) -> Option<String>> Vars<'_, F> {
    fn str(&self, name: &str) -> Option<String> {
        (self.get)(name)
            .map(|v| v.trim().to_owned())
            .filter(|v| !v.is_empty())
    }

    fn num<T: std::str::FromStr>(&self, name: &str) -> Result<Option<T>> {
        match self.str(name) {
            None => Ok(None),
            Some(v) => v
                .parse()
                .map(Some)
                .map_err(|_| anyhow::anyhow!("{name}={v:?} is not a valid non-negative integer")),
        }
    }

    fn need<T: std::str::FromStr>(&self, name: &str, why: &str) -> Result<T> {
        self.num(name)?
            .with_context(|| format!("{name} is not set ({why})"))
    }
}

/// Where the rendezvous store is: MASTER_ADDR/MASTER_PORT when set, else the first host of the
/// step's (or job's) node list and a port from the job id; with a line for the log saying so.
fn rendezvous<F: Fn(&str) -> Option<String>>(v: &Vars<'_, F>) -> Result<(String, u16, String)> {
    let (addr, addr_note) = match v.str("MASTER_ADDR") {
        Some(a) => (a, "MASTER_ADDR from the environment".to_string()),
        None => {
            let (var, list) = [
                "SLURM_STEP_NODELIST",
                "SLURM_JOB_NODELIST",
                "SLURM_NODELIST",
            ]
            .into_iter()
            .find_map(|k| v.str(k).map(|l| (k, l)))
            .context(
                "MASTER_ADDR is not set and neither is SLURM_JOB_NODELIST: cannot tell which \
                     host runs rank 0; set MASTER_ADDR",
            )?;
            let first = expand_nodelist(&list)
                .with_context(|| format!("{var}={list:?}"))?
                .swap_remove(0);
            let note = format!("MASTER_ADDR={first}, the first host of {var}={list}");
            (first, note)
        }
    };
    let (port, port_note) = match v.num::<u16>("MASTER_PORT")? {
        Some(0) => bail!("MASTER_PORT=0: every task must be given the same real port"),
        Some(p) => (p, "MASTER_PORT from the environment".to_string()),
        None => {
            let id: u64 = v
                .need(
                    "SLURM_JOB_ID",
                    "MASTER_PORT is not set either, so no port can be derived; set MASTER_PORT",
                )
                .map_err(|e| match v.str("SLURM_JOB_ID") {
                    Some(_) => anyhow::anyhow!(
                        "{e}: the rendezvous port is derived from it (15000 + its last four \
                         digits) when MASTER_PORT is not set; set MASTER_PORT (the same on every \
                         task) to bypass it"
                    ),
                    None => e,
                })?;
            let p = port_from_job_id(id);
            let note = format!(
                "MASTER_PORT={p} derived from SLURM_JOB_ID={id} (15000 + the job id's last four \
                 digits; set MASTER_PORT to choose another)"
            );
            (p, note)
        }
    };
    Ok((addr, port, format!("{addr_note}; {port_note}")))
}

/// The end of an error about Slurm variables that contradict each other.
const DISAGREE: &str = ": the Slurm variables disagree (edited by the job script, or left over \
     from another job?); start the tasks with srun, which sets them together, or unset the \
     SLURM_* variables to run one process";

/// One task's place in an `srun lockstep train` job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskLayout {
    pub place: super::place::Place,
    pub master_addr: String,
    pub master_port: u16,
    /// What was derived from what, for the log.
    pub note: String,
}

/// The layout of this task when srun started it (SLURM_PROCID and SLURM_NTASKS set), else
/// `None`. Errors name the variable that is missing or malformed.
pub fn task_layout(get: &impl Fn(&str) -> Option<String>) -> Result<Option<TaskLayout>> {
    let v = Vars { get };
    let (Some(rank), Some(world_size)) = (
        v.num::<usize>("SLURM_PROCID")?,
        v.num::<usize>("SLURM_NTASKS")?,
    ) else {
        return Ok(None);
    };
    ensure!(
        world_size > 0,
        "SLURM_NTASKS=0: a job needs at least one task"
    );
    ensure!(
        rank < world_size,
        "SLURM_PROCID={rank} is out of range for SLURM_NTASKS={world_size}{DISAGREE}"
    );
    let local_rank = v.num("SLURM_LOCALID")?.unwrap_or(0);
    let node = v.num::<usize>("SLURM_NODEID")?.unwrap_or(0);
    let nnodes = v.num::<usize>("SLURM_NNODES")?;
    if let Some(n) = nnodes {
        ensure!(
            node < n,
            "SLURM_NODEID={node} is out of range for SLURM_NNODES={n}{DISAGREE}"
        );
    }
    // The step's tasks-per-node list (srun's), else the job's; always there under srun.
    let per_node = match ["SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"]
        .into_iter()
        .find_map(|k| v.str(k).map(|s| (k, s)))
    {
        Some((k, s)) => {
            let counts = expand_tasks_per_node(&s).with_context(|| format!("{k}={s:?}"))?;
            let sum: usize = counts.iter().sum();
            ensure!(
                sum == world_size,
                "SLURM_NTASKS={world_size} but {k}={s:?} adds up to {sum} tasks{DISAGREE}"
            );
            if let Some(n) = nnodes.filter(|&n| n != counts.len()) {
                bail!(
                    "SLURM_NNODES={n} but {k}={s:?} lists {} nodes{DISAGREE}",
                    counts.len()
                );
            }
            let here = *counts
                .get(node)
                .with_context(|| format!("{k}={s:?} has no entry for SLURM_NODEID={node}"))?;
            Some(here)
        }
        None => None,
    };
    let local_world_size = match v.num("SLURM_NTASKS_PER_NODE") {
        Ok(Some(n)) => n,
        // SLURM_NTASKS_PER_NODE is only set when asked for (and may be "2(x3)").
        _ => per_node.unwrap_or(world_size),
    };
    ensure!(
        local_rank < local_world_size.max(1),
        "SLURM_LOCALID={local_rank} is out of range for {local_world_size} tasks on this node"
    );
    let (master_addr, master_port, rdzv) = if world_size > 1 {
        rendezvous(&v)?
    } else {
        (
            super::single_rank::SINGLE_RANK_ADDR.to_owned(),
            super::single_rank::SINGLE_RANK_PORT,
            "one task: no rendezvous".to_owned(),
        )
    };
    Ok(Some(TaskLayout {
        place: super::place::Place {
            rank,
            world: world_size,
            local_rank,
            local_world: local_world_size,
        },
        master_addr,
        master_port,
        note: format!(
            "Slurm: task {rank} of {world_size} (SLURM_PROCID, SLURM_NTASKS), local rank \
             {local_rank} of {local_world_size} on node {node}; {rdzv}"
        ),
    }))
}

/// This node's place in an `srun --ntasks-per-node=1 lockstep run` job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeLayout {
    pub place: super::place::NodePlace,
    /// SLURM_GPUS_ON_NODE: GPUs allocated on this node.
    pub gpus_on_node: Option<usize>,
    pub note: String,
}

/// The node layout when `lockstep run` itself was started by srun (SLURM_PROCID, SLURM_NNODES
/// and SLURM_NODEID set), else `None`. More than one task per node is an error: the launcher
/// starts the node's workers itself.
pub fn node_layout(get: &impl Fn(&str) -> Option<String>) -> Result<Option<NodeLayout>> {
    let v = Vars { get };
    if v.str("SLURM_PROCID").is_none() {
        return Ok(None);
    }
    let (Some(nnodes), Some(node_rank)) = (
        v.num::<usize>("SLURM_NNODES")?,
        v.num::<usize>("SLURM_NODEID")?,
    ) else {
        return Ok(None);
    };
    ensure!(nnodes > 0, "SLURM_NNODES=0");
    ensure!(
        node_rank < nnodes,
        "SLURM_NODEID={node_rank} is out of range for SLURM_NNODES={nnodes}"
    );
    if let Some(tasks) = v.num::<usize>("SLURM_NTASKS")? {
        ensure!(
            tasks == nnodes,
            "lockstep run under srun with SLURM_NTASKS={tasks} on SLURM_NNODES={nnodes}: the \
             launcher starts its node's workers itself, so run one task per node (srun \
             --ntasks-per-node=1 lockstep run …), or start one task per GPU with `srun lockstep \
             train …`"
        );
    }
    let (master_addr, master_port, rdzv) = rendezvous(&v)?;
    Ok(Some(NodeLayout {
        place: super::place::NodePlace {
            nnodes,
            node_rank,
            master_addr,
            master_port,
        },
        gpus_on_node: v.num("SLURM_GPUS_ON_NODE")?,
        note: format!("Slurm: node {node_rank} of {nnodes} (SLURM_NODEID, SLURM_NNODES); {rdzv}"),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn lookup(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| m.get(k).cloned()
    }

    /// Forms from real clusters' `scontrol show hostnames` input and their expansions.
    #[test]
    fn nodelists_of_real_clusters_expand() {
        let table: &[(&str, &[&str])] = &[
            ("node1", &["node1"]),
            ("node[1-3]", &["node1", "node2", "node3"]),
            (
                "gpu[01-04,07],cpu3",
                &["gpu01", "gpu02", "gpu03", "gpu04", "gpu07", "cpu3"],
            ),
            (
                "nid[00010-00012,00020]",
                &["nid00010", "nid00011", "nid00012", "nid00020"],
            ),
            ("node[9-11]", &["node9", "node10", "node11"]),
            (
                "node[098-101]",
                &["node098", "node099", "node100", "node101"],
            ),
            (
                "gpu-a100-[1,3-5]",
                &["gpu-a100-1", "gpu-a100-3", "gpu-a100-4", "gpu-a100-5"],
            ),
            ("node[1-2]-ib", &["node1-ib", "node2-ib"]),
            (
                "rack[1-2]-node[01-02]",
                &[
                    "rack1-node01",
                    "rack1-node02",
                    "rack2-node01",
                    "rack2-node02",
                ],
            ),
            ("a,b[1-2],c", &["a", "b1", "b2", "c"]),
            (
                "jwb[0001,0129],jwc00n[001-002]",
                &["jwb0001", "jwb0129", "jwc00n001", "jwc00n002"],
            ),
            ("10.0.0.7", &["10.0.0.7"]),
            ("  node[1] ", &["node1"]),
        ];
        for (list, want) in table {
            assert_eq!(expand_nodelist(list).unwrap(), *want, "{list}");
        }
    }

    #[test]
    fn malformed_nodelists_are_named() {
        for (list, says) in [
            ("", "empty host list"),
            ("node[1-", "never closed"),
            ("node1]", "without '['"),
            ("node[3-1]", "runs backwards"),
            ("node[a-b]", "not a number"),
            ("node[]", "empty brackets"),
            ("a,,b", "empty entry"),
            ("n[1-2000000]", "too large"),
        ] {
            let e = format!("{:#}", expand_nodelist(list).unwrap_err());
            assert!(e.contains(says), "{list:?}: {e}");
        }
    }

    #[test]
    fn tasks_per_node_forms() {
        assert_eq!(expand_tasks_per_node("2(x3),1").unwrap(), [2, 2, 2, 1]);
        assert_eq!(expand_tasks_per_node("4").unwrap(), [4]);
        assert!(expand_tasks_per_node("x").is_err());
    }

    const TASK: &[(&str, &str)] = &[
        ("SLURM_PROCID", "5"),
        ("SLURM_NTASKS", "8"),
        ("SLURM_LOCALID", "1"),
        ("SLURM_NODEID", "1"),
        ("SLURM_NNODES", "2"),
        ("SLURM_TASKS_PER_NODE", "4(x2)"),
        ("SLURM_JOB_NODELIST", "gpu[07-08]"),
        ("SLURM_JOB_ID", "4312345"),
    ];

    #[test]
    fn srun_task_layout() {
        let t = task_layout(&lookup(TASK)).unwrap().unwrap();
        assert_eq!(
            (
                t.place.rank,
                t.place.world,
                t.place.local_rank,
                t.place.local_world
            ),
            (5, 8, 1, 4)
        );
        assert_eq!((t.master_addr.as_str(), t.master_port), ("gpu07", 17345));
        assert!(
            t.note.contains("derived from SLURM_JOB_ID=4312345"),
            "{}",
            t.note
        );
        assert!(
            t.note
                .contains("first host of SLURM_JOB_NODELIST=gpu[07-08]"),
            "{}",
            t.note
        );

        // torchrun's variables, when present, win.
        let mut v = TASK.to_vec();
        v.extend([("MASTER_ADDR", "head"), ("MASTER_PORT", "29400")]);
        let t = task_layout(&lookup(&v)).unwrap().unwrap();
        assert_eq!((t.master_addr.as_str(), t.master_port), ("head", 29400));

        // The step's node list is the more precise one when srun ran on a subset of the job.
        let mut v = TASK.to_vec();
        v.push(("SLURM_STEP_NODELIST", "gpu08"));
        let t = task_layout(&lookup(&v)).unwrap().unwrap();
        assert_eq!(t.master_addr, "gpu08");

        assert_eq!(
            task_layout(&lookup(&[("SLURM_JOB_ID", "1")])).unwrap(),
            None
        );
    }

    #[test]
    fn bad_task_layouts_name_the_variable() {
        let with = |k: &'static str, val: &'static str| {
            let mut v: Vec<_> = TASK.iter().filter(|(kk, _)| *kk != k).copied().collect();
            if !val.is_empty() {
                v.push((k, val));
            }
            format!("{:#}", task_layout(&lookup(&v)).unwrap_err())
        };
        assert!(with("SLURM_PROCID", "8").contains("SLURM_PROCID=8"));
        assert!(with("SLURM_NTASKS", "x").contains("SLURM_NTASKS=\"x\""));
        assert!(with("SLURM_LOCALID", "4").contains("SLURM_LOCALID=4"));
        assert!(with("SLURM_JOB_ID", "").contains("SLURM_JOB_ID is not set"));
        assert!(with("SLURM_JOB_NODELIST", "").contains("SLURM_JOB_NODELIST"));
        assert!(with("SLURM_JOB_NODELIST", "gpu[1-").contains("never closed"));
    }

    /// Issue 45 items 20, 21: variables that contradict each other are refused by name and
    /// value, before anything is split by a task count that cannot be right.
    #[test]
    fn slurm_variables_that_disagree_are_refused_by_name() {
        let with = |set: &[(&'static str, &'static str)]| {
            let mut v: Vec<_> = TASK
                .iter()
                .filter(|(k, _)| set.iter().all(|(s, _)| s != k))
                .copied()
                .collect();
            v.extend(set.iter().filter(|(_, val)| !val.is_empty()));
            format!("{:#}", task_layout(&lookup(&v)).unwrap_err())
        };
        let e = with(&[
            ("SLURM_NTASKS", "1"),
            ("SLURM_PROCID", "0"),
            ("SLURM_LOCALID", "0"),
            ("SLURM_NODEID", "0"),
            ("SLURM_NNODES", ""),
            ("SLURM_TASKS_PER_NODE", "2(x3),1"),
        ]);
        assert!(
            e.contains("SLURM_NTASKS=1 but SLURM_TASKS_PER_NODE=\"2(x3),1\" adds up to 7 tasks")
                && e.contains("start the tasks with srun"),
            "{e}"
        );
        let e = with(&[("SLURM_NTASKS", "99999")]);
        assert!(
            e.contains("SLURM_NTASKS=99999 but SLURM_TASKS_PER_NODE=\"4(x2)\" adds up to 8"),
            "{e}"
        );
        let e = with(&[("SLURM_NNODES", "3")]);
        assert!(
            e.contains("SLURM_NNODES=3 but SLURM_TASKS_PER_NODE=\"4(x2)\" lists 2 nodes"),
            "{e}"
        );
        let e = with(&[("SLURM_NODEID", "2")]);
        assert!(
            e.contains("SLURM_NODEID=2 is out of range for SLURM_NNODES=2"),
            "{e}"
        );
        assert!(with(&[("SLURM_PROCID", "8")]).contains("start the tasks with srun"));
        assert!(with(&[("SLURM_TASKS_PER_NODE", "1(x99999999999)")]).contains("more than"));
        let e = with(&[("SLURM_JOB_ID", "abc")]);
        assert!(
            e.contains("SLURM_JOB_ID=\"abc\" is not a valid non-negative integer")
                && e.contains("set MASTER_PORT"),
            "{e}"
        );
    }

    #[test]
    fn srun_node_layout_for_the_launcher() {
        let vars = [
            ("SLURM_PROCID", "1"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_NNODES", "2"),
            ("SLURM_NODEID", "1"),
            ("SLURM_GPUS_ON_NODE", "4"),
            ("SLURM_JOB_NODELIST", "dgx[1-2]"),
            ("SLURM_JOB_ID", "77"),
        ];
        let n = node_layout(&lookup(&vars)).unwrap().unwrap();
        assert_eq!(
            n,
            NodeLayout {
                place: crate::dist::NodePlace {
                    nnodes: 2,
                    node_rank: 1,
                    master_addr: "dgx1".into(),
                    master_port: 15077,
                },
                gpus_on_node: Some(4),
                note: n.note.clone(),
            }
        );
        let mut two_per_node = vars.to_vec();
        two_per_node[1] = ("SLURM_NTASKS", "4");
        let e = format!("{:#}", node_layout(&lookup(&two_per_node)).unwrap_err());
        assert!(
            e.contains("--ntasks-per-node=1") && e.contains("srun lockstep"),
            "{e}"
        );
        assert_eq!(node_layout(&lookup(&[])).unwrap(), None);
    }
}
