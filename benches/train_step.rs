//! One training step (forward, backward, clip, AdamW) of the tiny benchmark shape on CPU:
//! vocab 4096, d 256, 4 layers, 8 heads / 4 kv heads, FFN 688, batch 8 × seq 256, fp32.
//! Prints the median tokens/s and CPU seconds per step; `benches/compare.sh` runs it interleaved
//! with `benches/train_step.py` (PyTorch on the same shape) and prints the ratio.
//!
//! usage: cargo bench --bench train_step -- [--steps N] [--threads T]

use std::time::Instant;

use lockstep::model::{AttentionBackend, Llama, LlamaShape};
use lockstep::train::optim::{clip_grad_norm, AdamW, AdamWParams};
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
    let shape = LlamaShape {
        vocab_size: 4096,
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
    };
    tch::manual_seed(0);
    let vs = VarStore::new(Device::Cpu);
    let model = Llama::new(&vs.root(), &shape, seq as usize, Kind::Float);
    let hp = AdamWParams {
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
    };
    let mut opt = AdamW::new(Llama::named_parameters(&vs), hp);
    let tokens = Tensor::randint(4096, [batch, seq + 1], (Kind::Int64, Device::Cpu));
    let (x, y) = (tokens.narrow(1, 0, seq), tokens.narrow(1, 1, seq));

    // Seconds in forward, backward, and clip + AdamW, per step.
    let phases = std::cell::RefCell::new(Vec::<[f64; 3]>::new());
    let step = |opt: &mut AdamW| {
        let t0 = Instant::now();
        let loss = model.loss(&x, &y);
        let value = loss.double_value(&[]);
        let t1 = Instant::now();
        loss.backward();
        let t2 = Instant::now();
        let norm = clip_grad_norm(&opt.gradients(), 1.0).double_value(&[]);
        opt.step(1e-3).expect("AdamW step");
        opt.zero_grad();
        let t3 = Instant::now();
        phases.borrow_mut().push([
            (t1 - t0).as_secs_f64(),
            (t2 - t1).as_secs_f64(),
            (t3 - t2).as_secs_f64(),
        ]);
        (value, norm)
    };
    let (first_loss, _) = step(&mut opt);
    step(&mut opt);
    let mut tok_s = Vec::new();
    let mut cpu = Vec::new();
    for _ in 0..steps {
        let (t0, c0) = (Instant::now(), cpu_seconds());
        step(&mut opt);
        tok_s.push((batch * seq) as f64 / t0.elapsed().as_secs_f64());
        cpu.push(cpu_seconds() - c0);
    }
    let median = |i: usize| {
        let mut v: Vec<f64> = phases.borrow().iter().skip(2).map(|p| p[i]).collect();
        v.sort_by(f64::total_cmp);
        1e3 * v[v.len() / 2]
    };
    let split = format!(
        "forward {:.0} ms, backward {:.0} ms, clip+AdamW {:.0} ms",
        median(0),
        median(1),
        median(2)
    );
    tok_s.sort_by(f64::total_cmp);
    cpu.sort_by(f64::total_cmp);
    println!(
        "lockstep tiny step: median {:.0} tok/s over {steps} steps (min {:.0}, max {:.0}); CPU {:.3} s/step; threads {}; first loss {first_loss:.4}; {split}",
        tok_s[steps / 2],
        tok_s[0],
        tok_s[steps - 1],
        cpu[steps / 2],
        tch::get_num_threads()
    );
}
