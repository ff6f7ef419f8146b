//! One training step of the tiny benchmark shape on CPU — the trainer's own `train_step`
//! (forward, backward, gradient sync, norm, guard, clip, fused AdamW) on vocab 4096, d 256,
//! 4 layers, 8 heads / 4 kv heads, FFN 688, batch 8 × seq 256, fp32.
//! Prints the median tokens/s and CPU seconds per step; `benches/compare.sh` runs it interleaved
//! with `benches/train_step.py` (PyTorch on the same shape) and prints the ratio.
//!
//! With `--doc-len L` every row packs documents of L/2..3L/2 tokens (seeded) and the step runs
//! with `data.document_masking` + `data.reset_position_ids` (the block-diagonal mask through
//! SDPA); it also prints the median time to build one batch's mask and positions.
//!
//!
//! `--vocab`, `--checkpointing none|full|selective` and `--chunk` (LM-head chunk tokens, 0 =
//! one chunk) set the activation-memory variant (`benches/activation_memory.sh` runs them
//! interleaved); the defaults are the shape above with everything kept.
//!
//! With `--experts E` every MLP is a Qwen3-MoE mixture of E experts of width `--expert-size`
//! (default 344), top 2 (so a token's expert FLOPs are the dense FFN's), with the
//! load-balancing loss; `benches/moe_cpu.sh` runs it against transformers' Qwen3MoeForCausalLM.
//!
//! usage: cargo bench --bench train_step -- [--steps N] [--threads T] [--vocab V]
//!        [--checkpointing MODE] [--chunk TOKENS] [--doc-len L] [--experts E]
//!        [--expert-size F]

use std::time::Instant;

use lockstep::config::{self, AttentionBackend, Sources};
use lockstep::dist::SingleProcess;
use lockstep::model::{
    ActivationCheckpointing, ActivationMemory, DocumentMask, Family, Llama, LlamaShape, MoeShape,
};
use lockstep::train::guard::Guard;
use lockstep::train::optim::{AdamWParams, Optimizer};
use lockstep::train::{train_step, Batch, StepConfig, StepOutcome, StepPlan};
use tch::nn::VarStore;
use tch::{Device, Kind, Tensor};

fn arg(name: &str, default: usize) -> usize {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn arg_str(name: &str, default: &str) -> String {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .cloned()
        .unwrap_or_else(|| default.to_string())
}

fn cpu_seconds() -> f64 {
    // SAFETY: getrusage writes into the zeroed struct we own.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

fn main() {
    let steps = arg("--steps", 10);
    let threads = arg("--threads", 0);
    if threads > 0 {
        tch::set_num_threads(threads as i32);
    }
    let (batch, seq) = (8i64, 256i64);
    let vocab = arg("--vocab", 4096);
    let checkpointing: ActivationCheckpointing =
        serde_json::from_value(serde_json::json!(arg_str("--checkpointing", "none")))
            .expect("--checkpointing none|full|selective");
    let memory = ActivationMemory {
        checkpointing,
        loss_chunk_tokens: arg("--chunk", 0),
    };
    let experts = arg("--experts", 0);
    let moe = (experts > 0).then(|| MoeShape {
        num_experts: experts,
        top_k: 2,
        expert_size: arg("--expert-size", 344),
        sparse_step: 1,
        dense_layers: Vec::new(),
        norm_topk_prob: true,
        aux_loss_coef: 0.001,
    });
    let shape = LlamaShape {
        family: if moe.is_some() {
            Family::Qwen3Moe
        } else {
            Family::Llama
        },
        head_size: None,
        vocab_size: vocab,
        hidden_size: 256,
        num_layers: 4,
        num_heads: 8,
        num_kv_heads: 4,
        intermediate_size: 688,
        max_position_embeddings: 2048,
        rope_theta: 10000.0,
        rope_scaling: None,
        rms_norm_eps: 1e-5,
        tie_word_embeddings: false,
        init_std: 0.02,
        attention: AttentionBackend::Sdpa,
        moe,
    };
    tch::manual_seed(0);
    let vs = VarStore::new(Device::Cpu);
    let mut model = Llama::new(&vs.root(), &shape, seq as usize, Kind::Float);
    model.set_activation_memory(memory);
    let hp = AdamWParams {
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
    };
    let mut opt = Optimizer::new(
        &Llama::named_parameters(&vs),
        model.parameters(),
        hp.into(),
        lockstep::config::ZeroStage::Replicated,
        &SingleProcess,
        25.0,
        Kind::Float,
    )
    .expect("a replicated optimizer");
    let mut guard = Guard::new(
        &config::resolve(&Sources::default())
            .unwrap()
            .config
            .training,
    );
    let step_cfg = StepConfig {
        grad_accum: 1,
        max_grad_norm: 1.0,
        overlap: false,
    };
    let plan = StepPlan {
        save_failed: false,
        lr: 1e-3,
        ..Default::default()
    };
    let tokens = Tensor::randint(vocab as i64, [batch, seq + 1], (Kind::Int64, Device::Cpu));
    let (x, y) = (tokens.narrow(1, 0, seq), tokens.narrow(1, 1, seq));
    let doc_len = arg("--doc-len", 0);
    let pieces = packed_rows(batch as usize, seq as usize, doc_len);
    let documents = || {
        (doc_len > 0).then(|| {
            let d = DocumentMask::new(&pieces, true, true, Device::Cpu);
            d.attention_mask();
            d
        })
    };
    let mut step = || -> StepOutcome {
        let micro = std::iter::once(Batch {
            inputs: x.shallow_clone(),
            targets: y.shallow_clone(),
            documents: documents(),
        });
        train_step(
            &model,
            &mut opt,
            &mut SingleProcess,
            &mut guard,
            &step_cfg,
            &plan,
            micro,
        )
        .expect("training step")
    };
    let first_loss = step().loss;
    step();
    let mut tok_s = Vec::new();
    let mut cpu = Vec::new();
    let mut phases = Vec::new();
    for _ in 0..steps {
        let (t0, c0) = (Instant::now(), cpu_seconds());
        let out = step();
        tok_s.push((batch * seq) as f64 / t0.elapsed().as_secs_f64());
        cpu.push(cpu_seconds() - c0);
        let t = out.timing;
        phases.push([t.compute_s, t.comm_s, t.optimizer_s]);
    }
    let median = |i: usize| {
        let mut v: Vec<f64> = phases.iter().map(|p| p[i]).collect();
        v.sort_by(f64::total_cmp);
        1e3 * v[v.len() / 2]
    };
    let split = format!(
        "forward+backward {:.0} ms, norm {:.1} ms, clip+AdamW {:.0} ms",
        median(0),
        median(1),
        median(2)
    );
    tok_s.sort_by(f64::total_cmp);
    cpu.sort_by(f64::total_cmp);
    let masking = if doc_len > 0 {
        let mut build: Vec<f64> = (0..200)
            .map(|_| {
                let t = Instant::now();
                documents();
                t.elapsed().as_secs_f64()
            })
            .collect();
        build.sort_by(f64::total_cmp);
        let docs: usize = pieces.iter().map(Vec::len).sum();
        format!(
            "; document masking: {docs} documents in {batch} rows, mask + positions built in {:.0} µs (median)",
            1e6 * build[build.len() / 2]
        )
    } else {
        String::new()
    };
    println!(
        "lockstep tiny step (vocab {vocab}, checkpointing {checkpointing}, chunk {}, experts {experts}): median {:.0} tok/s over {steps} steps (min {:.0}, max {:.0}); CPU {:.3} s/step; threads {}; first loss {first_loss:.4}; {split}{masking}",
        memory.loss_chunk_tokens,
        tok_s[steps / 2],
        tok_s[0],
        tok_s[steps - 1],
        cpu[steps / 2],
        tch::get_num_threads()
    );
}

/// Each row's document lengths: seeded (xorshift) in doc_len/2..=3·doc_len/2, the last one cut
/// at the row's end. No documents (one piece per row) for doc_len 0.
fn packed_rows(rows: usize, seq: usize, doc_len: usize) -> Vec<Vec<usize>> {
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    (0..rows)
        .map(|_| {
            if doc_len == 0 {
                return vec![seq];
            }
            let mut row = Vec::new();
            let mut left = seq;
            while left > 0 {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let len = doc_len / 2 + (x % (doc_len as u64 + 1)) as usize;
                let len = len.clamp(1, left);
                row.push(len);
                left -= len;
            }
            row
        })
        .collect()
}
