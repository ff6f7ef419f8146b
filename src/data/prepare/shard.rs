//! A part of a preparation spread over machines, and the names of the parts' files.

use anyhow::{anyhow, bail, Result};

/// Part `index` of `count` of a preparation spread over machines (`prepare --shard I/N`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shard {
    /// From 0 to `count - 1`.
    pub index: u64,
    /// How many parts the corpus is cut into.
    pub count: u64,
}

impl Shard {
    /// `I/N` (I from 0 to N−1, like RANK), or `slurm` for SLURM_PROCID/SLURM_NTASKS (one
    /// part per task of `srun lockstep prepare --shard slurm`).
    pub fn parse(text: &str) -> Result<Shard> {
        let (index, count) = if text == "slurm" {
            let var = |name: &str| -> Result<String> {
                std::env::var(name).map_err(|_| {
                    anyhow!(
                        "--shard slurm: {name} is not set; run it as `srun lockstep prepare \
                         --shard slurm`, or give the part as --shard I/N"
                    )
                })
            };
            (var("SLURM_PROCID")?, var("SLURM_NTASKS")?)
        } else {
            let (i, n) = text.split_once('/').ok_or_else(|| {
                anyhow!("--shard {text}: expected I/N (e.g. 0/8: the first of 8 parts) or slurm")
            })?;
            (i.to_string(), n.to_string())
        };
        let num = |v: &str| v.trim().parse::<u64>().ok();
        match (num(&index), num(&count)) {
            (Some(index), Some(count)) if index < count && count <= 99_999 => {
                Ok(Shard { index, count })
            }
            _ => bail!(
                "--shard {text}: the part must be I/N with 0 <= I < N <= 99999 (got {index}/{count})"
            ),
        }
    }

    /// `part-IIIII-of-NNNNN`: the name of its token file (`.tok`) and record (`.json`).
    pub(super) fn name(&self) -> String {
        part_name(self.index, self.count)
    }
}

pub(super) fn part_name(index: u64, count: u64) -> String {
    format!("part-{index:05}-of-{count:05}")
}
