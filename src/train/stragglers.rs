//! Stragglers. Every rank waits for the slowest at each collective, so all ranks show the same
//! step time and the slow one hides among them. What differs is the time a rank spends on its
//! own work (data, forward, backward, optimizer: the forensics' busy phases) as opposed to
//! waiting for the others. Every `logging.interval` steps the ranks share that time per step
//! (one all-reduce of a value per rank) and rank 0 names the slowest rank when it exceeds the
//! median by more than `logging.straggler_pct` percent.

use anyhow::Result;

use super::place::Rank;
use crate::config::Config;
use crate::dist::forensics;
use crate::dist::ProcessGroup;

pub struct Stragglers {
    interval: usize,
    pct: f64,
    rank: usize,
    world: usize,
    tag: String,
    /// Busy seconds and step at the previous check.
    last_busy: f64,
    last_step: usize,
}

/// The slowest rank of a check.
#[derive(Debug, Clone, PartialEq)]
pub struct Straggler {
    pub rank: usize,
    /// Its busy seconds per step.
    pub seconds: f64,
    /// The median over all ranks.
    pub median: f64,
    /// How far above the median, in percent.
    pub excess_pct: f64,
}

impl Stragglers {
    /// `first_step` is the step the run starts after (0, or the resumed one).
    pub fn new(cfg: &Config, rank: &Rank, first_step: usize) -> Stragglers {
        Stragglers {
            interval: cfg.logging.interval.max(1),
            pct: cfg.logging.straggler_pct,
            rank: rank.place.rank,
            world: rank.place.world,
            tag: rank.tag.clone(),
            last_busy: busy_seconds(),
            last_step: first_step,
        }
    }

    /// After step `step`: every `logging.interval` steps, compare the ranks (all ranks must
    /// call this after the same steps; they do, since they take the same steps).
    pub fn check(&mut self, step: usize, pg: &mut dyn ProcessGroup) -> Result<()> {
        if self.pct <= 0.0 || self.world < 2 || !step.is_multiple_of(self.interval) {
            return Ok(());
        }
        let busy = busy_seconds();
        let steps = step.saturating_sub(self.last_step).max(1);
        let mut per_step = vec![0f32; self.world];
        per_step[self.rank] = ((busy - self.last_busy) / steps as f64) as f32;
        let first = self.last_step + 1;
        (self.last_busy, self.last_step) = (busy, step);
        pg.all_reduce_sum_f32(&mut per_step)?;
        if self.rank != 0 {
            return Ok(());
        }
        let per_step: Vec<f64> = per_step.iter().map(|&x| f64::from(x)).collect();
        if let Some(s) = slowest(&per_step, self.pct) {
            let over = if first == step {
                format!("step {step}")
            } else {
                format!("steps {first}-{step}")
            };
            println!(
                "{} Straggler: rank {} spends {} per step on its own work (data, forward, \
                 backward, optimizer) vs a median of {} over {} ranks ({over}): +{:.0}%, above \
                 logging.straggler_pct = {}; the other ranks wait for it at every collective",
                self.tag,
                s.rank,
                forensics::human_secs(s.seconds),
                forensics::human_secs(s.median),
                self.world,
                s.excess_pct,
                self.pct
            );
        }
        Ok(())
    }
}

fn busy_seconds() -> f64 {
    forensics::global().map_or(0.0, |f| f.busy_seconds())
}

/// The slowest of `seconds` (one value per rank) when it exceeds their median by more than
/// `pct` percent.
pub fn slowest(seconds: &[f64], pct: f64) -> Option<Straggler> {
    let mut sorted = seconds.to_vec();
    sorted.sort_by(f64::total_cmp);
    let n = sorted.len();
    if n < 2 {
        return None;
    }
    let median = if n % 2 == 1 {
        sorted[n / 2]
    } else {
        (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0
    };
    let (rank, &max) = seconds
        .iter()
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(b.1))?;
    if median <= 0.0 || !max.is_finite() {
        return None;
    }
    let excess_pct = (max / median - 1.0) * 100.0;
    (excess_pct > pct).then_some(Straggler {
        rank,
        seconds: max,
        median,
        excess_pct,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_slowest_rank_is_named_only_past_the_threshold() {
        let s = slowest(&[1.0, 1.1, 3.0, 0.9, 1.0], 20.0).unwrap();
        assert_eq!((s.rank, s.seconds, s.median), (2, 3.0, 1.0));
        assert!((s.excess_pct - 200.0).abs() < 1e-9);
        assert_eq!(slowest(&[1.0, 1.1, 1.15, 0.9, 1.0], 20.0), None);
        // Two ranks: the median is their mean, so rank 1 at 10x is 82% above it.
        let s = slowest(&[0.1, 1.0], 20.0).unwrap();
        assert_eq!(s.rank, 1);
        assert!((s.excess_pct - 81.818).abs() < 1e-2, "{}", s.excess_pct);
        assert_eq!(slowest(&[0.0, 0.0], 20.0), None, "nothing measured");
        assert_eq!(slowest(&[2.0], 20.0), None);
    }
}
