//! Deterministic, resumable sample order.
//!
//! A sample is `context_length + 1` consecutive tokens starting at
//! `k * context_length`. Epoch `e` visits the windows in a pseudo-random order
//! given by a keyed bijection of `0..n_windows`, so the whole data order is a
//! pure function of (seed, global sample index): resuming needs only the number
//! of samples consumed, and nothing proportional to the dataset is stored.

use anyhow::{bail, Result};

use super::tokfile::TokenFile;

const FEISTEL_ROUNDS: usize = 4;

/// Maps global sample indices to window starts.
#[derive(Debug, Clone)]
pub struct Sampler {
    num_tokens: u64,
    context_length: u64,
    n_windows: u64,
    /// Bits per Feistel half; the permuted domain is `0..4^half_bits`.
    half_bits: u32,
    seed: u64,
}

/// splitmix64 finalizer: a fast, well-mixing 64-bit bijection.
pub(crate) fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl Sampler {
    /// A sampler over a token stream of `num_tokens` tokens.
    pub fn new(num_tokens: u64, context_length: usize, seed: u64) -> Result<Self> {
        if context_length == 0 {
            bail!("training.context_length must be at least 1");
        }
        let ctx = context_length as u64;
        if num_tokens < ctx + 1 {
            bail!(
                "the dataset has {num_tokens} tokens but one training sample needs \
                 context_length + 1 = {} tokens; lower training.context_length or add data",
                ctx + 1
            );
        }
        let n_windows = (num_tokens - 1) / ctx;
        // Smallest even bit width covering n_windows, so cycle-walking takes
        // fewer than 4 steps on average.
        let bits = 64 - (n_windows - 1).leading_zeros();
        let half_bits = bits.div_ceil(2).max(1);
        Ok(Sampler {
            num_tokens,
            context_length: ctx,
            n_windows,
            half_bits,
            seed,
        })
    }

    /// Windows per epoch.
    pub fn num_windows(&self) -> u64 {
        self.n_windows
    }

    /// Tokens in the underlying stream.
    pub fn num_tokens(&self) -> u64 {
        self.num_tokens
    }

    /// First token of the sample with this global index (any epoch).
    pub fn window_start(&self, global_index: u64) -> u64 {
        let epoch = global_index / self.n_windows;
        let pos = global_index % self.n_windows;
        self.permute(pos, epoch) * self.context_length
    }

    fn round_keys(&self, epoch: u64) -> [u64; FEISTEL_ROUNDS] {
        let mut state = splitmix64(self.seed ^ splitmix64(epoch.wrapping_add(0x5EED)));
        let mut keys = [0; FEISTEL_ROUNDS];
        for k in &mut keys {
            state = splitmix64(state);
            *k = state;
        }
        keys
    }

    /// The position-`pos` window of `epoch`'s order: a Feistel network on
    /// `2 * half_bits` bits, cycle-walked until it lands inside `0..n_windows`.
    /// A bijection on the padded domain restricted this way stays a bijection.
    fn permute(&self, pos: u64, epoch: u64) -> u64 {
        if self.n_windows == 1 {
            return 0;
        }
        let keys = self.round_keys(epoch);
        let h = self.half_bits;
        let mask = (1u64 << h) - 1;
        let mut x = pos;
        loop {
            let (mut l, mut r) = (x >> h, x & mask);
            for k in keys {
                let f = splitmix64(r ^ k) & mask;
                (l, r) = (r, l ^ f);
            }
            x = (l << h) | r;
            if x < self.n_windows {
                return x;
            }
        }
    }
}

/// The global sample indices this rank trains on in the batch that starts
/// after `consumed` samples: those `i` in `consumed..consumed + global_batch`
/// with `i % world == rank`, increasing. `global_batch` must be a multiple of
/// `world` so every rank gets the same count.
pub fn rank_indices(
    consumed: u64,
    global_batch: u64,
    rank: u64,
    world: u64,
) -> impl Iterator<Item = u64> {
    debug_assert!(world > 0 && rank < world && global_batch.is_multiple_of(world));
    let first = consumed + (rank + world - consumed % world) % world;
    (first..consumed + global_batch).step_by(world as usize)
}

/// Writes one row of `context_length + 1` tokens per index into `out`
/// (row-major, replacing its contents): inputs are `row[..ctx]`, targets
/// `row[1..]`.
pub fn fill_batch(
    tokens: &TokenFile,
    sampler: &Sampler,
    indices: &[u64],
    context_length: usize,
    out: &mut Vec<i64>,
) {
    assert_eq!(
        sampler.context_length, context_length as u64,
        "sampler built for another context length"
    );
    let row = context_length + 1;
    out.clear();
    out.resize(indices.len() * row, 0);
    for (&i, chunk) in indices.iter().zip(out.chunks_exact_mut(row)) {
        tokens.copy_window(sampler.window_start(i), row, chunk);
    }
}

#[cfg(test)]
mod tests {
    use super::super::tokfile::TokFileWriter;
    use super::*;

    #[test]
    fn each_epoch_is_a_permutation() {
        for n in [1u64, 2, 3, 5, 16, 17, 100, 1000, 4097] {
            let ctx = 4;
            let s = Sampler::new(n * ctx as u64 + 1, ctx, 42).unwrap();
            assert_eq!(s.num_windows(), n);
            for epoch in 0..3 {
                let mut seen = vec![false; n as usize];
                for pos in 0..n {
                    let start = s.window_start(epoch * n + pos);
                    assert_eq!(start % ctx as u64, 0);
                    let k = (start / ctx as u64) as usize;
                    assert!(!seen[k], "n={n} epoch={epoch}: window {k} twice");
                    seen[k] = true;
                }
                assert!(seen.iter().all(|&b| b));
            }
        }
    }

    fn order(s: &Sampler, epoch: u64) -> Vec<u64> {
        let n = s.num_windows();
        (0..n).map(|p| s.window_start(epoch * n + p)).collect()
    }

    #[test]
    fn epochs_and_seeds_change_the_order() {
        let a = Sampler::new(1001, 10, 1).unwrap();
        let b = Sampler::new(1001, 10, 1).unwrap();
        let c = Sampler::new(1001, 10, 2).unwrap();
        assert_eq!(order(&a, 0), order(&b, 0));
        assert_eq!(order(&a, 3), order(&b, 3));
        assert_ne!(order(&a, 0), order(&a, 1));
        assert_ne!(order(&a, 0), order(&c, 0));
        let identity: Vec<u64> = (0..100).map(|k| k * 10).collect();
        assert_ne!(order(&a, 0), identity);
    }

    #[test]
    fn windows_always_fit() {
        for (tokens, ctx) in [(11u64, 10usize), (20, 10), (21, 10), (1000, 7), (65, 64)] {
            let s = Sampler::new(tokens, ctx, 9).unwrap();
            assert_eq!(s.num_windows(), (tokens - 1) / ctx as u64);
            for i in 0..3 * s.num_windows() {
                assert!(s.window_start(i) + (ctx as u64) < tokens);
            }
        }
    }

    #[test]
    fn too_few_tokens_is_explained() {
        let err = Sampler::new(64, 64, 0).unwrap_err().to_string();
        assert!(err.contains("64 tokens") && err.contains("65"), "{err}");
        assert!(err.contains("training.context_length"), "{err}");
    }

    #[test]
    fn ranks_partition_the_batch() {
        for (consumed, batch, world) in [(0u64, 8u64, 4u64), (13, 12, 3), (5, 1, 1), (7, 16, 8)] {
            let mut all: Vec<u64> = (0..world)
                .flat_map(|r| {
                    let idx: Vec<u64> = rank_indices(consumed, batch, r, world).collect();
                    assert_eq!(idx.len() as u64, batch / world);
                    assert!(idx.windows(2).all(|w| w[0] < w[1]));
                    assert!(idx.iter().all(|i| i % world == r));
                    idx
                })
                .collect();
            all.sort();
            assert_eq!(all, (consumed..consumed + batch).collect::<Vec<_>>());
        }
    }

    #[test]
    fn fill_batch_copies_rows() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.tok");
        let mut w = TokFileWriter::create(&path, 2, [0; 32]).unwrap();
        w.push_document(&(0..25).collect::<Vec<u32>>()).unwrap();
        w.finish().unwrap();
        let tf = TokenFile::open(&path).unwrap();
        let s = Sampler::new(tf.num_tokens(), 4, 3).unwrap();
        let mut out = vec![99; 3];
        fill_batch(&tf, &s, &[0, 5], 4, &mut out);
        assert_eq!(out.len(), 10);
        for (row, &i) in out.chunks(5).zip(&[0u64, 5]) {
            let start = s.window_start(i) as i64;
            assert_eq!(row, (start..start + 5).collect::<Vec<i64>>().as_slice());
        }
    }
}
