//! Weighted mixtures (`data.sources`): which source, and which of that source's samples, the
//! global sample `i` is.
//!
//! The schedule deals samples in blocks of `block_len` samples. Every block holds the same
//! number of samples of each source, its quota (the largest-remainder rounding of
//! `block_len × share`), in the order of a shuffle seeded by (seed, block index). So the shares
//! hold exactly at every block end and closely in between, and the whole schedule is a pure
//! function of (seed, global index): resuming needs only the number of samples consumed, on any
//! world size, as with one source. Source `s`'s `k`-th sample in this order is the `k`-th
//! sample of its own [`super::Sampler`], whose epochs each visit every window once in a new
//! order.

use anyhow::{bail, Result};

use super::sampler::splitmix64;
use crate::config::MIN_SOURCE_SHARE;

/// The shortest block; longer when a small share needs it (see [`Mixture::new`]).
const MIN_BLOCK: u64 = 1000;
/// Samples of its smallest source every block holds at least.
const MIN_QUOTA: f64 = 10.0;

/// The global sample schedule of a mixture.
#[derive(Debug, Clone)]
pub struct Mixture {
    /// Samples of each source per block; they sum to `block_len`.
    quotas: Vec<u64>,
    block_len: u64,
    seed: u64,
    /// The last block dealt (the trainer reads consecutive samples).
    cache: Option<Block>,
}

/// One block's order: the source of each position, and how many samples of that source come
/// before it within the block.
#[derive(Debug, Clone)]
struct Block {
    index: u64,
    source: Vec<u32>,
    rank: Vec<u32>,
}

impl Mixture {
    /// A schedule for sources with these (relative, positive) weights. The block is long enough
    /// that the smallest source gets at least 10 samples per block, so rounding moves no share
    /// by more than a twentieth of itself (and by at most 1/2000 absolute at the shortest block).
    pub fn new(weights: &[f64], seed: u64) -> Result<Mixture> {
        if weights.is_empty() {
            bail!("a mixture needs at least one source");
        }
        if let Some((i, w)) = weights
            .iter()
            .enumerate()
            .find(|(_, w)| !(w.is_finite() && **w > 0.0))
        {
            bail!("data.sources[{i}].weight = {w}: must be > 0");
        }
        let total: f64 = weights.iter().sum();
        let min_share = weights.iter().fold(f64::INFINITY, |m, w| m.min(w / total));
        if min_share < MIN_SOURCE_SHARE {
            bail!(
                "a data.sources weight is {min_share:.1e} of the total; every source needs a share of at least {MIN_SOURCE_SHARE:e}"
            );
        }
        let block_len = MIN_BLOCK.max((MIN_QUOTA / min_share).ceil() as u64);
        Ok(Mixture {
            quotas: largest_remainder(weights, block_len),
            block_len,
            seed: splitmix64(seed ^ 0x4D49_5854_5552_4530),
            cache: None,
        })
    }

    pub fn num_sources(&self) -> usize {
        self.quotas.len()
    }

    /// Samples per block.
    pub fn block_len(&self) -> u64 {
        self.block_len
    }

    /// Samples of each source in every block.
    pub fn quotas(&self) -> &[u64] {
        &self.quotas
    }

    /// (source, index among that source's samples) of global sample `i`.
    pub fn locate(&mut self, i: u64) -> (usize, u64) {
        if self.quotas.len() == 1 {
            return (0, i);
        }
        let (b, pos) = (i / self.block_len, (i % self.block_len) as usize);
        let block = self.block(b);
        let s = block.source[pos] as usize;
        let rank = block.rank[pos] as u64;
        (s, b * self.quotas[s] + rank)
    }

    /// How many of the first `n` global samples each source supplied.
    pub fn drawn(&mut self, n: u64) -> Vec<u64> {
        if self.quotas.len() == 1 {
            return vec![n];
        }
        let (b, pos) = (n / self.block_len, (n % self.block_len) as usize);
        let mut counts: Vec<u64> = self.quotas.iter().map(|q| b * q).collect();
        if pos > 0 {
            for &s in &self.block(b).source[..pos] {
                counts[s as usize] += 1;
            }
        }
        counts
    }

    fn block(&mut self, index: u64) -> &Block {
        if self.cache.as_ref().is_none_or(|c| c.index != index) {
            self.cache = Some(self.deal(index));
        }
        self.cache.as_ref().expect("just dealt")
    }

    /// Block `index`: every source's quota, shuffled (Fisher–Yates on a splitmix64 stream).
    fn deal(&self, index: u64) -> Block {
        let mut source: Vec<u32> = Vec::with_capacity(self.block_len as usize);
        for (s, &q) in self.quotas.iter().enumerate() {
            source.extend(std::iter::repeat_n(s as u32, q as usize));
        }
        let mut state = splitmix64(self.seed ^ splitmix64(index.wrapping_add(0xB10C)));
        for j in (1..source.len()).rev() {
            state = splitmix64(state);
            // A uniform pick in 0..=j by multiply-shift (bias below 2^-40 for these lengths).
            let k = ((state as u128 * (j as u128 + 1)) >> 64) as usize;
            source.swap(j, k);
        }
        let mut seen = vec![0u32; self.quotas.len()];
        let rank = source
            .iter()
            .map(|&s| {
                let r = seen[s as usize];
                seen[s as usize] += 1;
                r
            })
            .collect();
        Block {
            index,
            source,
            rank,
        }
    }
}

/// `total` split in proportion to `weights`: floors, then one more for the largest fractional
/// parts (ties to the earlier source).
fn largest_remainder(weights: &[f64], total: u64) -> Vec<u64> {
    let sum: f64 = weights.iter().sum();
    let exact: Vec<f64> = weights.iter().map(|w| w / sum * total as f64).collect();
    let mut quotas: Vec<u64> = exact.iter().map(|e| e.floor() as u64).collect();
    let short = total.saturating_sub(quotas.iter().sum());
    let mut order: Vec<usize> = (0..weights.len()).collect();
    order.sort_by(|&a, &b| {
        let (fa, fb) = (exact[a] - exact[a].floor(), exact[b] - exact[b].floor());
        fb.total_cmp(&fa).then(a.cmp(&b))
    });
    for &s in order.iter().take(short as usize) {
        quotas[s] += 1;
    }
    quotas
}

/// The seed of source `s`'s own sample order. Source 0 keeps the run's seed, so a mixture of
/// one source is exactly the `data.path` run; the others get independent orders.
pub fn source_seed(seed: u64, s: usize) -> u64 {
    if s == 0 {
        seed
    } else {
        splitmix64(seed ^ splitmix64(s as u64 ^ 0x50_55_52_43_45))
    }
}

/// A short name for a source in logs, metrics and TensorBoard tags: the explicit `name`, else
/// the last path component that is not a glob pattern, without its extension
/// (`builtin:shakespeare` → `shakespeare`, `data/web/*.jsonl` → `web`, `code.jsonl` → `code`).
/// Names that would repeat get `_2`, `_3`, … in list order.
pub fn source_names(sources: &[(Option<&str>, &str)]) -> Vec<String> {
    let base: Vec<String> = sources
        .iter()
        .map(|(name, path)| match name {
            Some(n) => n.to_string(),
            None => name_from_path(path),
        })
        .collect();
    let mut out: Vec<String> = Vec::with_capacity(base.len());
    for b in &base {
        let mut name = b.clone();
        let mut n = 1;
        while out.contains(&name) {
            n += 1;
            name = format!("{b}_{n}");
        }
        out.push(name);
    }
    out
}

fn name_from_path(path: &str) -> String {
    if let Some(builtin) = path.strip_prefix("builtin:") {
        return builtin.to_string();
    }
    let part = path
        .split('/')
        .rev()
        .find(|c| !c.is_empty() && !c.contains(['*', '?', '[']))
        .unwrap_or(path);
    let stem = std::path::Path::new(part)
        .file_stem()
        .map_or(part.to_string(), |s| s.to_string_lossy().into_owned());
    if stem.is_empty() {
        "source".into()
    } else {
        stem
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shares(m: &mut Mixture, n: u64) -> Vec<f64> {
        let mut counts = vec![0u64; m.num_sources()];
        for i in 0..n {
            counts[m.locate(i).0] += 1;
        }
        assert_eq!(counts, m.drawn(n), "drawn() agrees with locate()");
        counts.iter().map(|&c| c as f64 / n as f64).collect()
    }

    #[test]
    fn shares_follow_the_weights_within_one_percent() {
        for (weights, seed) in [
            (vec![0.5, 0.3, 0.2], 1337u64),
            (vec![7.0, 2.0, 1.0], 1),
            (vec![1.0, 1.0, 1.0], 99),
            (vec![0.6, 0.35, 0.05], 5),
        ] {
            let mut m = Mixture::new(&weights, seed).unwrap();
            let total: f64 = weights.iter().sum();
            let got = shares(&mut m, 10_000);
            for (s, (g, w)) in got.iter().zip(&weights).enumerate() {
                let want = w / total;
                assert!(
                    (g - want).abs() < 0.01,
                    "weights {weights:?} seed {seed}: source {s} has share {g}, weight {want}"
                );
            }
        }
    }

    #[test]
    fn each_source_index_is_drawn_once_in_order() {
        let mut m = Mixture::new(&[0.5, 0.3, 0.2], 7).unwrap();
        let n = 3 * m.block_len() + 123;
        let mut next = vec![0u64; 3];
        for i in 0..n {
            let (s, k) = m.locate(i);
            assert_eq!(k, next[s], "sample {i}: source {s} index {k}");
            next[s] += 1;
        }
        assert_eq!(next, m.drawn(n));
        // Random access (a resumed loader) gives the same answers as the sequential walk.
        let mut fresh = Mixture::new(&[0.5, 0.3, 0.2], 7).unwrap();
        let probe: Vec<u64> = vec![2500, 17, 2999, 1000, 0, 3122];
        let seq: Vec<(usize, u64)> = probe.iter().map(|&i| m.locate(i)).collect();
        let rnd: Vec<(usize, u64)> = probe.iter().map(|&i| fresh.locate(i)).collect();
        assert_eq!(seq, rnd);
    }

    #[test]
    fn blocks_are_shuffled_and_seeded() {
        let order = |seed: u64| -> Vec<usize> {
            let mut m = Mixture::new(&[1.0, 1.0], seed).unwrap();
            (0..2000).map(|i| m.locate(i).0).collect()
        };
        assert_eq!(order(3), order(3));
        assert_ne!(order(3), order(4));
        let o = order(3);
        assert_ne!(o[..1000], o[1000..], "each block has its own order");
        // Not sorted by source: runs are short.
        let switches = o.windows(2).filter(|w| w[0] != w[1]).count();
        assert!(switches > 800, "{switches} switches in 2000 samples");
    }

    #[test]
    fn one_source_is_the_identity() {
        let mut m = Mixture::new(&[3.0], 1).unwrap();
        for i in [0u64, 1, 999, 1000, 123_456_789] {
            assert_eq!(m.locate(i), (0, i));
        }
        assert_eq!(m.drawn(12345), vec![12345]);
        assert_eq!(source_seed(42, 0), 42);
        assert_ne!(source_seed(42, 1), source_seed(42, 2));
    }

    #[test]
    fn small_shares_lengthen_the_block() {
        let m = Mixture::new(&[0.999, 0.001], 0).unwrap();
        assert_eq!(m.block_len(), 10_000);
        assert_eq!(m.quotas(), &[9990, 10]);
        let m = Mixture::new(&[1.0, 1.0, 1.0], 0).unwrap();
        assert_eq!((m.block_len(), m.quotas()), (1000, &[334, 333, 333][..]));
        let e = Mixture::new(&[1.0, 0.0], 0).unwrap_err().to_string();
        assert!(e.contains("data.sources[1].weight = 0"), "{e}");
        let e = Mixture::new(&[1.0, 1e-6], 0).unwrap_err().to_string();
        assert!(e.contains("at least 1e-4"), "{e}");
    }

    #[test]
    fn names_come_from_paths_and_stay_unique() {
        let names = source_names(&[
            (None, "builtin:shakespeare"),
            (None, "data/web/*.jsonl"),
            (None, "corpora/code.jsonl"),
            (None, "books/"),
            (Some("mine"), "x.txt"),
            (None, "other/code.txt"),
            (None, "third/code"),
        ]);
        assert_eq!(
            names,
            [
                "shakespeare",
                "web",
                "code",
                "books",
                "mine",
                "code_2",
                "code_3"
            ]
        );
    }
}
