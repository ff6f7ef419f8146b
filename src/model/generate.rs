//! Autoregressive decoding for one prompt: KV-cached (the prompt in one forward, then one token
//! per step at its RoPE position), greedy at temperature 0, else temperature + nucleus (top-p)
//! sampling from a seeded generator, stopping at an end-of-sequence id or after
//! `max_new_tokens`. `generate_uncached` recomputes the whole sequence every step; it is the
//! reference the cached path is tested against.

use std::time::Instant;

use anyhow::{ensure, Result};
use tch::{Device, Kind, Tensor};

use super::llama::{KvCache, Llama};

#[derive(Debug, Clone)]
pub struct GenerateOptions {
    pub max_new_tokens: usize,
    /// 0 = greedy (argmax).
    pub temperature: f64,
    /// Nucleus sampling: keep the most likely tokens whose probabilities sum to at least
    /// `top_p` (at least one). 1 = the whole vocabulary.
    pub top_p: f64,
    pub seed: u64,
    /// Generation stops after emitting one of these (it is included in the output).
    pub eos: Vec<i64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopReason {
    Eos,
    MaxNewTokens,
}

impl StopReason {
    pub fn as_str(self) -> &'static str {
        match self {
            StopReason::Eos => "eos",
            StopReason::MaxNewTokens => "max_new_tokens",
        }
    }
}

#[derive(Debug, Clone)]
pub struct Generated {
    /// The new tokens only (the EOS that stopped generation included).
    pub tokens: Vec<i64>,
    pub stop: StopReason,
    /// Seconds for the prompt's forward pass (time to the first new token).
    pub prefill_s: f64,
    /// Seconds for the remaining tokens.
    pub decode_s: f64,
}

impl GenerateOptions {
    /// Usage errors (exit 2) for a temperature or top-p out of range.
    pub fn validate(&self) -> std::result::Result<(), crate::config::ConfigError> {
        use crate::config::ConfigError;
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return Err(ConfigError(format!(
                "--temperature {} must be a finite number >= 0 (0 = greedy decoding, 1 = the \
                 model's own distribution)",
                self.temperature
            )));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(ConfigError(format!(
                "--top-p {} must be in (0, 1] (1 = no nucleus cut; 0.95 is the default)",
                self.top_p
            )));
        }
        Ok(())
    }
}

/// splitmix64: a tiny seeded generator, so a seed gives the same tokens on every device and
/// libtorch version.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// The next token from the logits [vocab] of the last position.
pub fn pick(logits: &Tensor, opts: &GenerateOptions, rng: &mut Rng) -> i64 {
    if opts.temperature == 0.0 {
        return logits.argmax(0, false).int64_value(&[]);
    }
    let logits = logits.to_kind(Kind::Double).to_device(Device::Cpu);
    let values = Vec::<f64>::try_from(&logits).expect("logits are a 1-d tensor");
    sample(&values, opts.temperature, opts.top_p, rng.uniform())
}

/// Temperature + top-p sampling from `logits` with the uniform draw `u`: softmax(logits / T),
/// the most likely tokens kept until their mass reaches `top_p`, renormalised, then the token
/// where the cumulative mass passes `u`.
pub fn sample(logits: &[f64], temperature: f64, top_p: f64, u: f64) -> i64 {
    let max = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let mut probs: Vec<(usize, f64)> = logits
        .iter()
        .enumerate()
        .map(|(i, &l)| (i, ((l - max) / temperature).exp()))
        .collect();
    let z: f64 = probs.iter().map(|p| p.1).sum();
    // Descending probability; ties keep the lower id first.
    probs.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    let mut kept = 0;
    let mut mass = 0.0;
    for &(_, p) in &probs {
        kept += 1;
        mass += p / z;
        if mass >= top_p {
            break;
        }
    }
    let kept = &probs[..kept];
    let total: f64 = kept.iter().map(|p| p.1).sum();
    let target = u * total;
    let mut acc = 0.0;
    for &(i, p) in kept {
        acc += p;
        if acc > target {
            return i as i64;
        }
    }
    kept.last().map_or(0, |p| p.0 as i64)
}

fn check_prompt(model: &Llama, prompt: &[i64], opts: &GenerateOptions) -> Result<()> {
    ensure!(!prompt.is_empty(), "the prompt has no tokens");
    let vocab = model.shape.vocab_size as i64;
    if let Some(bad) = prompt.iter().find(|&&t| t < 0 || t >= vocab) {
        anyhow::bail!("prompt token {bad} is outside the model's vocabulary (0..{vocab})");
    }
    Ok(opts.validate()?)
}

/// KV-cached generation. `capacity` (positions) must hold the prompt and every new token.
pub fn generate(
    model: &Llama,
    prompt: &[i64],
    opts: &GenerateOptions,
    device: Device,
) -> Result<Generated> {
    check_prompt(model, prompt, opts)?;
    let mut rng = Rng::new(opts.seed);
    let mut cache = KvCache::new(model, 1, prompt.len() + opts.max_new_tokens);
    let mut out = Vec::with_capacity(opts.max_new_tokens);
    let start = Instant::now();
    let mut prefill_s = 0.0;
    let stop = tch::no_grad(|| {
        let mut input = Tensor::from_slice(prompt).view([1, -1]).to_device(device);
        for i in 0..opts.max_new_tokens {
            let logits = model.forward_with_cache(&input, &mut cache);
            let last = logits.get(0).get(-1).to_kind(Kind::Float);
            let next = pick(&last, opts, &mut rng);
            if i == 0 {
                prefill_s = start.elapsed().as_secs_f64();
            }
            out.push(next);
            if opts.eos.contains(&next) {
                return StopReason::Eos;
            }
            input = Tensor::from_slice(&[next]).view([1, 1]).to_device(device);
        }
        StopReason::MaxNewTokens
    });
    Ok(Generated {
        tokens: out,
        stop,
        prefill_s,
        decode_s: start.elapsed().as_secs_f64() - prefill_s,
    })
}

/// The same decoding without a cache: the full sequence through `Llama::forward` every step.
pub fn generate_uncached(
    model: &Llama,
    prompt: &[i64],
    opts: &GenerateOptions,
    device: Device,
) -> Result<Generated> {
    check_prompt(model, prompt, opts)?;
    let mut rng = Rng::new(opts.seed);
    let mut seq = prompt.to_vec();
    let start = Instant::now();
    let mut prefill_s = 0.0;
    let stop = tch::no_grad(|| {
        for i in 0..opts.max_new_tokens {
            let input = Tensor::from_slice(&seq).view([1, -1]).to_device(device);
            let logits = model.forward(&input);
            let last = logits.get(0).get(-1).to_kind(Kind::Float);
            let next = pick(&last, opts, &mut rng);
            if i == 0 {
                prefill_s = start.elapsed().as_secs_f64();
            }
            seq.push(next);
            if opts.eos.contains(&next) {
                return StopReason::Eos;
            }
        }
        StopReason::MaxNewTokens
    });
    Ok(Generated {
        tokens: seq[prompt.len()..].to_vec(),
        stop,
        prefill_s,
        decode_s: start.elapsed().as_secs_f64() - prefill_s,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_p_keeps_the_smallest_set_reaching_p() {
        // probabilities ~ [0.6, 0.3, 0.1] at temperature 1
        let logits = [0.6f64.ln(), 0.3f64.ln(), 0.1f64.ln()];
        // top_p 0.5: only the first token survives, whatever u is.
        for u in [0.0, 0.5, 0.999] {
            assert_eq!(sample(&logits, 1.0, 0.5, u), 0);
        }
        // top_p 0.85: the first two, renormalised to [2/3, 1/3].
        assert_eq!(sample(&logits, 1.0, 0.85, 0.6), 0);
        assert_eq!(sample(&logits, 1.0, 0.85, 0.7), 1);
        // top_p 1: all three; u = 0.95 lands on the last.
        assert_eq!(sample(&logits, 1.0, 1.0, 0.95), 2);
    }

    #[test]
    fn low_temperature_approaches_greedy() {
        let logits = [1.0, 3.0, 2.9];
        assert_eq!(sample(&logits, 1e-3, 1.0, 0.99), 1);
    }

    #[test]
    fn rng_is_seeded_and_uniform() {
        let a: Vec<f64> = (0..4)
            .map({
                let mut r = Rng::new(7);
                move |_| r.uniform()
            })
            .collect();
        let mut r = Rng::new(7);
        assert!(a.iter().all(|&x| x == r.uniform()));
        let mut r = Rng::new(1);
        let mean = (0..10_000).map(|_| r.uniform()).sum::<f64>() / 10_000.0;
        assert!((mean - 0.5).abs() < 0.02 && a.iter().all(|x| (0.0..1.0).contains(x)));
    }
}
