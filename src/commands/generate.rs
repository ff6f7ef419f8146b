//! `lockstep generate --model DIR --prompt "…"`: KV-cached decoding from a Hugging Face Llama
//! directory; greedy at `--temperature 0`, else temperature + top-p sampling seeded by `--seed`;
//! stops at the end-of-sequence id (generation_config.json, else the tokenizer's) or after
//! `--max-new-tokens`.

use anyhow::{bail, ensure, Result};
use clap::Args;
use serde_json::json;

use super::{Inference, ModelFlags};
use crate::config::{usage, ConfigError};
use crate::data::tokenizer::Tokenizer;
use crate::model::generate::{generate, generate_uncached, GenerateOptions};
use crate::model::hf;

#[derive(Args, Debug, Clone)]
pub struct GenerateArgs {
    #[command(flatten)]
    pub open: ModelFlags,
    /// Text to continue (tokenized with the model's tokenizer, no BOS added).
    #[arg(long, value_name = "TEXT", required_unless_present = "prompt_ids")]
    pub prompt: Option<String>,
    /// The prompt as comma-separated token ids instead of text.
    #[arg(
        long,
        value_name = "ID,ID,...",
        conflicts_with = "prompt",
        value_delimiter = ','
    )]
    pub prompt_ids: Option<Vec<i64>>,
    #[arg(long, value_name = "N", default_value_t = 128)]
    pub max_new_tokens: usize,
    /// 0 = greedy decoding.
    #[arg(
        long,
        value_name = "T",
        default_value_t = 0.8,
        allow_negative_numbers = true
    )]
    pub temperature: f64,
    /// Nucleus sampling: sample among the most likely tokens holding this much probability.
    #[arg(
        long,
        value_name = "P",
        default_value_t = 0.95,
        allow_negative_numbers = true
    )]
    pub top_p: f64,
    #[arg(long, value_name = "S", default_value_t = 0)]
    pub seed: u64,
    /// Keep going past end-of-sequence tokens.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Recompute the whole sequence every step instead of using the KV cache (slow; for checks).
    #[arg(long)]
    pub no_kv_cache: bool,
    /// Print one JSON object (prompt and new token ids, text, stop reason, timings).
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: &GenerateArgs) -> Result<()> {
    // Usage errors first, before a model is read.
    let mut opts = GenerateOptions {
        max_new_tokens: args.max_new_tokens,
        temperature: args.temperature,
        top_p: args.top_p,
        seed: args.seed,
        eos: Vec::new(),
    };
    opts.validate()?;
    let opened = Inference::open(&args.open)?;
    let Inference {
        dir,
        shape,
        tok,
        device,
        ..
    } = &opened;
    let device = *device;
    let prompt: Vec<i64> = match (&args.prompt_ids, &args.prompt) {
        (Some(ids), _) => ids.clone(),
        (None, Some(text)) => {
            let Some(t) = &tok else {
                bail!(
                    "{} names no tokenizer (no tokenizer.json, lockstep.json or trainer.json) to \
                     encode --prompt; pass --tokenizer NAME|PATH, or --prompt-ids",
                    args.open.model.display()
                );
            };
            let ids: Vec<i64> = t.try_encode(text)?.into_iter().map(i64::from).collect();
            // An empty prompt starts a fresh document: the context after an EOS.
            if ids.is_empty() {
                vec![t.eos_id() as i64]
            } else {
                ids
            }
        }
        (None, None) => Err(ConfigError("pass --prompt TEXT or --prompt-ids".into()))?,
    };
    usage(!prompt.is_empty(), || {
        "--prompt-ids is empty; pass at least one id".into()
    })?;
    let total = prompt.len() + args.max_new_tokens;
    ensure!(
        total <= shape.max_position_embeddings,
        "the prompt ({} tokens) plus --max-new-tokens {} exceed the model's \
         max_position_embeddings ({}); lower --max-new-tokens or shorten the prompt",
        prompt.len(),
        args.max_new_tokens,
        shape.max_position_embeddings
    );
    if !args.ignore_eos {
        opts.eos = match hf::eos_token_ids(dir)? {
            Some(ids) => ids,
            None => tok.iter().map(|t| t.eos_id() as i64).collect(),
        };
    }
    let (_vs, model) = opened.load(total)?;
    let out = if args.no_kv_cache {
        generate_uncached(&model, &prompt, &opts, device)?
    } else {
        generate(&model, &prompt, &opts, device)?
    };
    let text = tok.as_ref().map(|t| decode_lossy(t, &out.tokens));
    let decode_rate = if out.tokens.len() > 1 && out.decode_s > 0.0 {
        (out.tokens.len() - 1) as f64 / out.decode_s
    } else {
        0.0
    };
    if args.json {
        println!(
            "{}",
            json!({
                "prompt_ids": prompt,
                "new_ids": out.tokens,
                "text": text,
                "stop": out.stop.as_str(),
                "prefill_s": out.prefill_s,
                "decode_s": out.decode_s,
                "decode_tokens_per_s": decode_rate,
            })
        );
        return Ok(());
    }
    match (&text, &args.prompt) {
        (Some(t), Some(p)) if args.prompt_ids.is_none() => println!("{p}{t}"),
        (Some(t), _) => println!("{t}"),
        (None, _) => println!(
            "{}",
            out.tokens
                .iter()
                .map(i64::to_string)
                .collect::<Vec<_>>()
                .join(",")
        ),
    }
    eprintln!(
        "[generate] {} new tokens, stopped at {} | prompt {} tokens in {:.2}s | {:.1} tok/s",
        out.tokens.len(),
        out.stop.as_str(),
        prompt.len(),
        out.prefill_s,
        decode_rate
    );
    Ok(())
}

/// Text of `ids`, never failing: a byte-level BPE token may hold part of a UTF-8 character, so
/// tokens are decoded in the smallest groups (up to 4) that form valid text, and a token that
/// never does becomes U+FFFD.
pub fn decode_lossy(tok: &Tokenizer, ids: &[i64]) -> String {
    let ids: Vec<u32> = ids.iter().map(|&i| i as u32).collect();
    if let Ok(t) = tok.decode(&ids) {
        return t;
    }
    let mut text = String::new();
    let mut at = 0;
    while at < ids.len() {
        let group = (1..=4.min(ids.len() - at))
            .find_map(|n| tok.decode(&ids[at..at + n]).ok().map(|t| (n, t)));
        match group {
            Some((n, t)) => {
                text.push_str(&t);
                at += n;
            }
            None => {
                text.push('\u{FFFD}');
                at += 1;
            }
        }
    }
    text
}
