//! Reads the rank layout torchrun, lockstep's own launcher or srun passes through the
//! environment. torchrun's variables (RANK, WORLD_SIZE, ...) win; without them, srun's
//! (SLURM_PROCID, SLURM_NTASKS, ...; see [`super::slurm`]).

use anyhow::{bail, Context, Result};

use super::place::Place;

/// Where this process sits in the job and where the rendezvous store lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DistEnv {
    pub place: Place,
    /// Host of the rendezvous store (`MASTER_ADDR`).
    pub master_addr: String,
    /// Port of the rendezvous store (`MASTER_PORT`).
    pub master_port: u16,
    /// `TORCHELASTIC_USE_AGENT_STORE=True`: torchrun's agent already hosts the store, so every
    /// rank, rank 0 included, connects as a client.
    pub agent_store: bool,
    /// `TORCHELASTIC_RESTART_COUNT` (0 when absent). The agent's store outlives worker
    /// restarts, so the ring namespaces its keys by this to ignore a dead attempt's keys.
    pub restart_count: u64,
    /// Started by `lockstep run` (`LOCKSTEP_LAUNCHER`), whose launcher hosts the store.
    pub lockstep_launcher: bool,
    /// A task started by srun (the layout from the SLURM_* variables).
    pub slurm: bool,
    /// How the layout was derived when that is worth a log line (Slurm: the master address
    /// from the node list, the port from the job id).
    pub note: Option<String>,
}

impl DistEnv {
    /// What to check when ranks never arrive at the rendezvous, for how this job was started.
    pub fn missing_ranks_hint(&self) -> String {
        if self.slurm {
            format!(
                "Slurm tasks start with srun: put `srun lockstep train …` in the batch script, \
                 which starts all SLURM_NTASKS={} of them (run directly from the script, only \
                 task 0 starts)",
                self.place.world
            )
        } else {
            format!(
                "start every rank, each with its RANK, WORLD_SIZE={} and the same \
                 MASTER_ADDR={} and MASTER_PORT={}",
                self.place.world, self.master_addr, self.master_port
            )
        }
    }

    /// Reads the process environment. `Ok(None)` when neither `RANK` nor `WORLD_SIZE` is set
    /// (a plain single-process run); an error naming the variable when they are inconsistent.
    pub fn from_env() -> Result<Option<DistEnv>> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// Same as [`DistEnv::from_env`] with an injectable lookup, so tests need not touch the
    /// (process-global, racy) environment.
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Option<DistEnv>> {
        let rank_s = get("RANK");
        let world_s = get("WORLD_SIZE");
        let (rank_s, world_s) = match (rank_s, world_s) {
            (None, None) => return Self::from_slurm(&get),
            (Some(_), None) => bail!("RANK is set but WORLD_SIZE is not; set both or neither"),
            (None, Some(_)) => bail!("WORLD_SIZE is set but RANK is not; set both or neither"),
            (Some(r), Some(w)) => (r, w),
        };
        let rank: usize = parse_num("RANK", &rank_s)?;
        let world_size: usize = parse_num("WORLD_SIZE", &world_s)?;
        if world_size == 0 {
            bail!("WORLD_SIZE=0: a job needs at least one rank");
        }
        if rank >= world_size {
            bail!("RANK={rank} is out of range for WORLD_SIZE={world_size} (ranks are 0..{world_size})");
        }

        let local_world_size = match get("LOCAL_WORLD_SIZE") {
            Some(s) => parse_num("LOCAL_WORLD_SIZE", &s)?,
            None => world_size,
        };
        if local_world_size == 0 || local_world_size > world_size {
            bail!(
                "LOCAL_WORLD_SIZE={local_world_size} must be between 1 and WORLD_SIZE={world_size}"
            );
        }
        let local_rank = match get("LOCAL_RANK") {
            Some(s) => parse_num("LOCAL_RANK", &s)?,
            None => rank % local_world_size,
        };
        if local_rank >= local_world_size {
            bail!(
                "LOCAL_RANK={local_rank} is out of range for LOCAL_WORLD_SIZE={local_world_size}"
            );
        }
        if local_rank > rank {
            bail!("LOCAL_RANK={local_rank} exceeds RANK={rank}; a local rank cannot be larger than the global one");
        }

        // With one rank nobody connects anywhere, so the address is optional.
        let needs_addr = world_size > 1;
        let master_addr = match get("MASTER_ADDR").map(|s| s.trim().to_owned()) {
            Some(a) if !a.is_empty() => a,
            Some(_) if needs_addr => bail!("MASTER_ADDR is empty (WORLD_SIZE={world_size})"),
            None if needs_addr => bail!(
                "MASTER_ADDR is not set but WORLD_SIZE={world_size}: every rank needs the host \
                 of the rendezvous store"
            ),
            _ => super::single_rank::SINGLE_RANK_ADDR.to_owned(),
        };
        let master_port = match get("MASTER_PORT") {
            Some(s) => {
                let p: u16 = parse_num("MASTER_PORT", &s)?;
                if p == 0 && needs_addr {
                    bail!(
                        "MASTER_PORT=0: ranks cannot find a store on port 0; the launcher must \
                         resolve a free port before starting the ranks"
                    );
                }
                p
            }
            None if needs_addr => bail!(
                "MASTER_PORT is not set but WORLD_SIZE={world_size}: every rank needs the port \
                 of the rendezvous store"
            ),
            None => super::single_rank::SINGLE_RANK_PORT,
        };
        let agent_store = match get("TORCHELASTIC_USE_AGENT_STORE") {
            None => false,
            Some(s) => match s.trim().to_ascii_lowercase().as_str() {
                "true" | "1" => true,
                "false" | "0" | "" => false,
                _ => bail!("TORCHELASTIC_USE_AGENT_STORE={s:?} is not a boolean (True/False)"),
            },
        };
        let restart_count = match get("TORCHELASTIC_RESTART_COUNT") {
            Some(s) => parse_num("TORCHELASTIC_RESTART_COUNT", &s)?,
            None => 0,
        };
        Ok(Some(DistEnv {
            place: Place {
                rank,
                world: world_size,
                local_rank,
                local_world: local_world_size,
            },
            master_addr,
            master_port,
            agent_store,
            restart_count,
            lockstep_launcher: get("LOCKSTEP_LAUNCHER").is_some(),
            slurm: false,
            note: None,
        }))
    }

    /// A task started by srun: the layout from the SLURM_* variables (`Ok(None)` outside srun).
    fn from_slurm(get: &impl Fn(&str) -> Option<String>) -> Result<Option<DistEnv>> {
        let Some(t) = super::slurm::task_layout(get)? else {
            return Ok(None);
        };
        Ok(Some(DistEnv {
            place: t.place,
            master_addr: t.master_addr,
            master_port: t.master_port,
            agent_store: false,
            restart_count: 0,
            lockstep_launcher: false,
            slurm: true,
            note: Some(t.note),
        }))
    }
}

fn parse_num<T: std::str::FromStr>(var: &str, s: &str) -> Result<T>
where
    T::Err: std::error::Error + Send + Sync + 'static,
{
    s.trim()
        .parse()
        .with_context(|| format!("{var}={s:?} is not a valid non-negative integer"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn parse(vars: &[(&str, &str)]) -> Result<Option<DistEnv>> {
        let m: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        DistEnv::from_lookup(|k| m.get(k).cloned())
    }

    fn err(vars: &[(&str, &str)]) -> String {
        format!("{:#}", parse(vars).unwrap_err())
    }

    const FULL: &[(&str, &str)] = &[
        ("RANK", "3"),
        ("WORLD_SIZE", "8"),
        ("LOCAL_RANK", "3"),
        ("LOCAL_WORLD_SIZE", "4"),
        ("MASTER_ADDR", "node0"),
        ("MASTER_PORT", "29400"),
    ];

    #[test]
    fn absent_means_single_process() {
        assert_eq!(parse(&[]).unwrap(), None);
        assert_eq!(parse(&[("LOCAL_RANK", "0")]).unwrap(), None);
    }

    #[test]
    fn torchrun_layout() {
        let e = parse(FULL).unwrap().unwrap();
        assert_eq!(
            e,
            DistEnv {
                place: Place {
                    rank: 3,
                    world: 8,
                    local_rank: 3,
                    local_world: 4,
                },
                master_addr: "node0".into(),
                master_port: 29400,
                agent_store: false,
                restart_count: 0,
                lockstep_launcher: false,
                slurm: false,
                note: None,
            }
        );
        let mut v = FULL.to_vec();
        v.push(("TORCHELASTIC_USE_AGENT_STORE", "True"));
        v.push(("TORCHELASTIC_RESTART_COUNT", "2"));
        let e = parse(&v).unwrap().unwrap();
        assert!(e.agent_store);
        assert_eq!(e.restart_count, 2);
        v.push(("TORCHELASTIC_USE_AGENT_STORE", "False"));
        let m: HashMap<_, _> = v.into_iter().collect();
        let e = DistEnv::from_lookup(|k| m.get(k).map(|s| s.to_string()))
            .unwrap()
            .unwrap();
        assert!(!e.agent_store);
    }

    #[test]
    fn srun_variables_give_the_layout_unless_torchrun_s_are_set() {
        let slurm = [
            ("SLURM_PROCID", "1"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_NTASKS_PER_NODE", "2"),
            ("SLURM_JOB_NODELIST", "localhost"),
            ("SLURM_JOB_ID", "123"),
        ];
        let e = parse(&slurm).unwrap().unwrap();
        assert_eq!(
            (
                e.place.rank,
                e.place.world,
                e.place.local_rank,
                e.place.local_world
            ),
            (1, 2, 1, 2)
        );
        assert_eq!(
            (e.master_addr.as_str(), e.master_port),
            ("localhost", 15123)
        );
        assert!(e.note.unwrap().contains("SLURM_JOB_ID=123"));
        let mut both = slurm.to_vec();
        both.extend(FULL);
        let e = parse(&both).unwrap().unwrap();
        assert_eq!((e.place.rank, e.place.world, e.note), (3, 8, None));
    }

    #[test]
    fn defaults() {
        let e = parse(&[("RANK", "0"), ("WORLD_SIZE", "1")])
            .unwrap()
            .unwrap();
        assert_eq!((e.place.local_rank, e.place.local_world), (0, 1));
        assert_eq!(
            (e.master_addr.as_str(), e.master_port),
            ("127.0.0.1", 29500)
        );
        let e = parse(&[
            ("RANK", "5"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_WORLD_SIZE", "4"),
            ("MASTER_ADDR", "h"),
            ("MASTER_PORT", "1"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(e.place.local_rank, 1);
    }

    #[test]
    fn inconsistent_settings_name_the_variable() {
        assert!(err(&[("RANK", "0")]).contains("WORLD_SIZE"));
        assert!(err(&[("WORLD_SIZE", "2")]).contains("RANK"));
        let e = err(&[("RANK", "x"), ("WORLD_SIZE", "2")]);
        assert!(e.contains("RANK=\"x\""), "{e}");
        let e = err(&[("RANK", "-1"), ("WORLD_SIZE", "2")]);
        assert!(e.contains("RANK"), "{e}");
        let e = err(&[("RANK", "2"), ("WORLD_SIZE", "2")]);
        assert!(e.contains("RANK=2") && e.contains("WORLD_SIZE=2"), "{e}");
        assert!(err(&[("RANK", "0"), ("WORLD_SIZE", "0")]).contains("WORLD_SIZE=0"));
        let e = err(&[("RANK", "1"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "1")]);
        assert!(e.contains("MASTER_ADDR"), "{e}");
        let e = err(&[("RANK", "1"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "h")]);
        assert!(e.contains("MASTER_PORT"), "{e}");
        let e = err(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "h"),
            ("MASTER_PORT", "70000"),
        ]);
        assert!(e.contains("MASTER_PORT=\"70000\""), "{e}");
        let e = err(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "h"),
            ("MASTER_PORT", "0"),
        ]);
        assert!(e.contains("MASTER_PORT=0"), "{e}");

        let with = |k: &'static str, v: &'static str| {
            let mut f = FULL.to_vec();
            f.retain(|(kk, _)| *kk != k);
            f.push((k, v));
            err(&f)
        };
        assert!(with("LOCAL_RANK", "4").contains("LOCAL_RANK=4"));
        assert!(with("LOCAL_WORLD_SIZE", "9").contains("LOCAL_WORLD_SIZE=9"));
        assert!(with("LOCAL_WORLD_SIZE", "0").contains("LOCAL_WORLD_SIZE=0"));
        assert!(
            with("TORCHELASTIC_USE_AGENT_STORE", "maybe").contains("TORCHELASTIC_USE_AGENT_STORE")
        );
        assert!(with("MASTER_ADDR", " ").contains("MASTER_ADDR"));
    }
}
