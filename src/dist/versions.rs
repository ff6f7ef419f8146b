//! The ranks' versions agree before any collective starts.
//!
//! Mixed versions across nodes are a classic multi-node failure: NCCL rejects them with
//! "Mismatched NCCL version detected" deep inside communicator setup, or hangs; a different
//! libtorch or lockstep build misbehaves later. So every rank publishes what it runs on
//! (host, lockstep, libtorch, CUDA runtime, NCCL and the libnccl file, driver) through the
//! store, rank 0 compares, and every rank gets the same verdict: a difference in lockstep,
//! libtorch, CUDA or NCCL stops all of them at once with one message that names the ranks, the
//! hosts and the versions. Drivers may differ (a cluster mid-upgrade runs fine; NCCL does not
//! care), so a driver difference is only printed.

use std::collections::BTreeMap;

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

use super::store::Store;
use crate::sys::{self, cuda, libtorch};

/// What one rank runs on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Versions {
    pub rank: usize,
    pub host: String,
    /// lockstep's version and commit.
    pub lockstep: String,
    /// The loaded libtorch: version and CUDA build.
    pub torch: String,
    /// The CUDA runtime libtorch loaded; None on a CPU rank.
    pub cuda: Option<String>,
    /// NCCL's run-time version; None on a CPU rank.
    pub nccl: Option<String>,
    /// The libnccl file loaded (shown, not compared: venvs sit at different paths).
    pub nccl_library: Option<String>,
    /// The NVIDIA driver; None without one.
    pub driver: Option<String>,
}

impl Versions {
    /// This process's versions as rank `rank`. CUDA, NCCL and the driver are read only when
    /// `cuda` (the rank uses NCCL, so libtorch's CUDA backend is loaded).
    pub fn here(rank: usize, cuda: bool) -> Versions {
        let stack = if cuda {
            cuda::stack()
        } else {
            cuda::CudaStack::default()
        };
        Versions {
            rank,
            host: sys::hostname(),
            lockstep: libtorch::LOCKSTEP_VERSION.to_string(),
            torch: match libtorch::loaded() {
                Ok(t) => t.describe(),
                Err(e) => format!("unreadable ({e})"),
            },
            cuda: stack.runtime,
            nccl: stack.nccl,
            nccl_library: stack.nccl_library.map(|p| p.display().to_string()),
            driver: cuda.then(sys::nvml::driver_version).flatten(),
        }
    }
}

/// Publishes `mine` under `prefix` and returns once every rank's versions agree: rank 0 reads
/// all, compares them ([`compare`]) and publishes the verdict, which every rank reads (so all
/// fail together, with the same message). Waits are bounded by the store's timeout.
pub fn agree(store: &Store, prefix: &str, world: usize, mine: &Versions) -> Result<()> {
    let key = |r: usize| format!("{prefix}versions/{r}");
    let verdict_key = format!("{prefix}versions/verdict");
    store.set(&key(mine.rank), &serde_json::to_vec(mine)?)?;
    if mine.rank == 0 {
        let all = (0..world)
            .map(|r| {
                let bytes = store
                    .get(&key(r))
                    .with_context(|| format!("rank {r} did not publish its versions"))?;
                serde_json::from_slice(&bytes)
                    .with_context(|| format!("rank {r} published unreadable versions"))
            })
            .collect::<Result<Vec<Versions>>>()?;
        let verdict = match compare(&all) {
            Ok(notes) => Verdict::Agree(notes),
            Err(e) => Verdict::Differ(e),
        };
        store.set(&verdict_key, &serde_json::to_vec(&verdict)?)?;
    }
    let bytes = store
        .get(&verdict_key)
        .context("rank 0 did not say whether the ranks' versions agree")?;
    match serde_json::from_slice(&bytes).context("rank 0's verdict on the versions")? {
        Verdict::Agree(notes) => {
            if mine.rank == 0 {
                for note in notes {
                    eprintln!("WARNING: {note}");
                }
            }
            Ok(())
        }
        Verdict::Differ(e) => bail!("{e}"),
    }
}

#[derive(Serialize, Deserialize)]
enum Verdict {
    /// They agree; the notes are differences that do not matter (drivers).
    Agree(Vec<String>),
    Differ(String),
}

/// Compares the ranks' versions: `Err` names each difference that breaks a run (lockstep,
/// libtorch, CUDA runtime, NCCL) with the ranks and hosts on each side; `Ok` carries notes on
/// the differences that do not (the driver).
pub fn compare(all: &[Versions]) -> Result<Vec<String>, String> {
    /// A version the ranks must (or, not `breaks`, should) share: ranks are grouped by `key`,
    /// and each group is shown by its first rank's `shown`.
    struct Field {
        name: &'static str,
        key: fn(&Versions) -> Option<String>,
        shown: fn(&Versions) -> Option<String>,
        breaks: bool,
    }
    let same = |name, key, breaks| Field {
        name,
        key,
        shown: key,
        breaks,
    };
    let fields = [
        same("lockstep", |v| Some(v.lockstep.clone()), true),
        same("libtorch", |v| Some(v.torch.clone()), true),
        same("the CUDA runtime", |v| v.cuda.clone(), true),
        // The library path is shown, not compared: venvs sit at different paths.
        Field {
            name: "NCCL",
            key: |v| v.nccl.clone(),
            shown: |v| {
                v.nccl.as_ref().map(|n| match &v.nccl_library {
                    Some(lib) => format!("{n} ({lib})"),
                    None => n.clone(),
                })
            },
            breaks: true,
        },
        same("the NVIDIA driver", |v| v.driver.clone(), false),
    ];
    let (mut errors, mut notes) = (Vec::new(), Vec::new());
    for Field {
        name,
        key,
        shown,
        breaks,
    } in fields
    {
        let mut groups: BTreeMap<Option<String>, Vec<&Versions>> = BTreeMap::new();
        for v in all {
            groups.entry(key(v)).or_default().push(v);
        }
        if groups.len() < 2 {
            continue;
        }
        let sides: Vec<String> = groups
            .values()
            .map(|ranks| {
                let value = shown(ranks[0]).unwrap_or_else(|| "none".to_string());
                format!("{value} on {}", ranks_and_hosts(ranks))
            })
            .collect();
        let line = format!("ranks disagree on {name}: {}", sides.join("; "));
        if breaks {
            errors.push(line);
        } else {
            notes.push(line);
        }
    }
    if errors.is_empty() {
        return Ok(notes);
    }
    Err(format!(
        "{}; every rank must run the same build (NCCL rejects mixed versions with \"Mismatched \
         NCCL version\" or hangs): install the same lockstep and `torch==2.11.*` build (the same \
         CUDA variant, e.g. cu128 everywhere) on every node; `lockstep env` on each shows what it has",
        errors.join("; ")
    ))
}

/// `ranks 0-3 (gpu-a), 4 (gpu-b)`: consecutive ranks on one host folded into a range.
fn ranks_and_hosts(ranks: &[&Versions]) -> String {
    let mut runs: Vec<(usize, usize, &str)> = Vec::new();
    for v in ranks {
        match runs.last_mut() {
            Some((_, last, host)) if *last + 1 == v.rank && *host == v.host => *last = v.rank,
            _ => runs.push((v.rank, v.rank, &v.host)),
        }
    }
    let shown: Vec<String> = runs
        .iter()
        .map(|&(a, b, host)| match a == b {
            true => format!("{a} ({host})"),
            false => format!("{a}-{b} ({host})"),
        })
        .collect();
    format!(
        "rank{} {}",
        if ranks.len() > 1 { "s" } else { "" },
        shown.join(", ")
    )
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn gpu_rank(rank: usize, host: &str, nccl: &str, driver: &str) -> Versions {
        Versions {
            rank,
            host: host.to_string(),
            lockstep: "0.1.0 (commit abc)".to_string(),
            torch: "2.11.0 (CUDA 13.0 build)".to_string(),
            cuda: Some("13.0".to_string()),
            nccl: Some(nccl.to_string()),
            nccl_library: Some(format!("/{host}/venv/nvidia/nccl/lib/libnccl.so.2")),
            driver: Some(driver.to_string()),
        }
    }

    #[test]
    fn compare_names_ranks_hosts_and_versions() {
        let same: Vec<_> = (0..4)
            .map(|r| gpu_rank(r, if r < 2 { "a" } else { "b" }, "2.28.9", "580.65.06"))
            .collect();
        assert_eq!(
            compare(&same),
            Ok(vec![]),
            "library paths differ, versions do not"
        );
        let mut mixed = same.clone();
        mixed[3].nccl = Some("2.27.3".to_string());
        mixed[2].driver = Some("575.57.08".to_string());
        let e = compare(&mixed).unwrap_err();
        assert!(
            e.starts_with(
                "ranks disagree on NCCL: 2.27.3 (/b/venv/nvidia/nccl/lib/libnccl.so.2) on rank 3 (b); \
                 2.28.9 (/a/venv/nvidia/nccl/lib/libnccl.so.2) on ranks 0-1 (a), 2 (b);"
            ),
            "{e}"
        );
        assert!(e.contains("torch==2.11.*"), "{e}");
        assert!(
            !e.contains("driver"),
            "a driver difference is not an error: {e}"
        );
        // Drivers alone: a note, not an error.
        mixed[3].nccl = Some("2.28.9".to_string());
        let notes = compare(&mixed).unwrap();
        assert_eq!(
            notes,
            ["ranks disagree on the NVIDIA driver: 575.57.08 on rank 2 (b); 580.65.06 on ranks 0-1 (a), 3 (b)"]
        );
        // A CPU rank (no NCCL) among GPU ranks, and another libtorch.
        mixed[1].nccl = None;
        mixed[1].torch = "2.11.0 (CUDA 12.8 build)".to_string();
        let e = compare(&mixed).unwrap_err();
        assert!(e.contains("ranks disagree on libtorch: 2.11.0 (CUDA 12.8 build) on rank 1 (a); 2.11.0 (CUDA 13.0 build) on ranks 0 (a), 2-3 (b)"), "{e}");
        assert!(e.contains("none on rank 1 (a)"), "{e}");
    }

    /// Real ranks (threads) through a real store: a rank that reports another NCCL version
    /// stops every rank, each with the message naming it.
    #[test]
    fn ranks_agree_through_the_store_or_all_fail() {
        let run = |versions: Vec<Versions>| -> Vec<Result<()>> {
            let timeout = Duration::from_secs(20);
            let server = Store::server("127.0.0.1", 0, versions.len(), timeout).unwrap();
            let port = server.port();
            let server = &server;
            std::thread::scope(|s| {
                let handles: Vec<_> = versions
                    .iter()
                    .map(|v| {
                        s.spawn(move || {
                            if v.rank == 0 {
                                agree(server, "t/", 3, v)
                            } else {
                                let client = Store::client("127.0.0.1", port, timeout)?;
                                agree(&client, "t/", 3, v)
                            }
                        })
                    })
                    .collect();
                handles.into_iter().map(|h| h.join().unwrap()).collect()
            })
        };
        let ok: Vec<_> = (0..3).map(|r| gpu_rank(r, "n", "2.28.9", "580")).collect();
        assert!(run(ok.clone()).iter().all(Result::is_ok));
        let mut bad = ok;
        bad[1].nccl = Some("2.26.2".to_string());
        for r in run(bad) {
            let e = format!("{:#}", r.unwrap_err());
            assert!(
                e.contains(
                    "NCCL: 2.26.2 (/n/venv/nvidia/nccl/lib/libnccl.so.2) on rank 1 (n); 2.28.9"
                ),
                "{e}"
            );
            assert!(e.contains("ranks 0 (n), 2 (n)"), "{e}");
        }
    }

    #[test]
    fn here_reads_this_process() {
        let v = Versions::here(5, false);
        assert_eq!(v.rank, 5);
        assert!(v.torch.starts_with("2.11."), "{v:?}");
        assert_eq!(v.lockstep, libtorch::LOCKSTEP_VERSION);
        assert_eq!((v.cuda, v.nccl, v.driver), (None, None, None));
    }
}
