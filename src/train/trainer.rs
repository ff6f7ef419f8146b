//! The training loop, top to bottom: resolve the device and run directory, map the prepared
//! tokens, build the model and AdamW, resume if asked, then step: micro-batches → backward →
//! clip → guard → AdamW → log / validate / checkpoint.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use serde_json::json;
use tch::nn::VarStore;
use tch::{Device, Kind, Tensor};

use super::checkpoint::{self, TrainerState};
use super::guard;
use super::optim::{clip_grad_norm, AdamW, AdamWParams, Schedule};
use crate::config::{Config, Resolved};
use crate::data::prepare::{prepare, PrepareSpec, Prepared};
use crate::data::sampler::{fill_batch, rank_indices, Sampler};
use crate::data::tokfile::TokenFile;
use crate::dist::grads::{all_reduce_gradients, broadcast_parameters};
use crate::dist::ProcessGroup;
use crate::model::{hf, Llama, LlamaShape};
use crate::telemetry::{self, Metrics, StepLine};

/// Where to resume from.
#[derive(Debug, Clone, PartialEq)]
pub enum Resume {
    /// The latest complete checkpoint in the checkpoint directory, or a fresh start if none.
    Auto,
    Dir(PathBuf),
}

impl std::str::FromStr for Resume {
    type Err = std::convert::Infallible;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(if s == "auto" {
            Resume::Auto
        } else {
            Resume::Dir(PathBuf::from(s))
        })
    }
}

/// This process's place among the ranks.
#[derive(Debug, Clone, Copy)]
pub struct Topology {
    pub rank: usize,
    pub world: usize,
    /// Rank on this node: under torchrun it picks the CUDA device.
    pub local_rank: usize,
}

impl Topology {
    pub const SINGLE: Topology = Topology {
        rank: 0,
        world: 1,
        local_rank: 0,
    };
}

/// What a finished run reports back (tests read it).
#[derive(Debug, Clone)]
pub struct Summary {
    pub losses: Vec<f64>,
    pub final_step: usize,
    pub run_dir: PathBuf,
    pub last_checkpoint: Option<PathBuf>,
    pub val_loss: Option<f64>,
}

/// The CUDA index of this rank: `lockstep run` narrows CUDA_VISIBLE_DEVICES to one GPU per
/// worker (index 0); torchrun leaves all visible, so LOCAL_RANK picks one.
fn cuda_index(cfg: &Config, topo: Topology) -> usize {
    if topo.world == 1 {
        cfg.system.device_id
    } else if std::env::var_os("LOCKSTEP_LAUNCHER").is_some() {
        0
    } else {
        topo.local_rank
    }
}

pub fn resolve_device(cfg: &Config, topo: Topology) -> Result<Device> {
    let index = cuda_index(cfg, topo);
    Ok(match cfg.system.device.as_str() {
        "cpu" => Device::Cpu,
        "cuda" => {
            if !tch::Cuda::is_available() {
                bail!("system.device = cuda but no CUDA device is visible to libtorch; use system.device=cpu or auto");
            }
            Device::Cuda(index)
        }
        _ if tch::Cuda::is_available() => Device::Cuda(index),
        _ => Device::Cpu,
    })
}

pub fn compute_kind(cfg: &Config, device: Device) -> Kind {
    match (cfg.training.dtype.as_str(), device) {
        ("bf16", _) | ("auto", Device::Cuda(_)) => Kind::BFloat16,
        _ => Kind::Float,
    }
}

pub fn run_dir(resolved: &Resolved) -> PathBuf {
    let c = &resolved.config.logging;
    Path::new(&c.dir).join(c.run_name.as_deref().unwrap_or(&resolved.preset))
}

pub fn checkpoint_dir(resolved: &Resolved) -> PathBuf {
    match &resolved.config.checkpoint.dir {
        Some(d) => PathBuf::from(d),
        None => run_dir(resolved).join("checkpoints"),
    }
}

pub fn prepare_spec(cfg: &Config, progress: bool) -> PrepareSpec {
    PrepareSpec {
        tokenizer: cfg.data.tokenizer.clone(),
        path: PathBuf::from(&cfg.data.path),
        text_field: cfg.data.text_field.clone(),
        val_fraction: cfg.data.val_fraction,
        context_length: cfg.training.context_length,
        num_samples: cfg.data.num_samples,
        cache_dir: PathBuf::from(&cfg.data.cache_dir),
        num_threads: cfg.training.num_workers,
        progress,
    }
}

/// Prepares (or finds cached) token files and says which.
pub fn prepare_data(cfg: &Config, tag: &str) -> Result<Prepared> {
    let start = Instant::now();
    let p = prepare(&prepare_spec(cfg, true))?;
    let what = if p.cache_hit { "cache hit" } else { "prepared" };
    println!(
        "{tag} Data: {what} {} ({} train + {} val tokens, tokenizer {}, {:.1}s)",
        p.dir.display(),
        p.train_tokens,
        p.val_tokens,
        p.tokenizer_id,
        start.elapsed().as_secs_f64()
    );
    Ok(p)
}

fn model_shape(cfg: &Config, vocab: usize) -> Result<LlamaShape> {
    let shape = match &cfg.model.model_path {
        Some(dir) => hf::shape_from_dir(Path::new(dir), &cfg.model)?,
        None => LlamaShape::from_config(&cfg.model, vocab)?,
    };
    anyhow::ensure!(
        shape.vocab_size >= vocab,
        "the model's vocabulary ({}) is smaller than the tokenizer's ({vocab}); the tokenizer in data.tokenizer does not fit this model",
        shape.vocab_size
    );
    Ok(shape)
}

/// One batch of `indices` windows as (inputs, targets), each [len, context] on `device`.
fn batch(
    tokens: &TokenFile,
    sampler: &Sampler,
    indices: &[u64],
    ctx: usize,
    buf: &mut Vec<i64>,
    device: Device,
) -> (Tensor, Tensor) {
    fill_batch(tokens, sampler, indices, ctx, buf);
    let rows = Tensor::from_slice(buf)
        .view([indices.len() as i64, ctx as i64 + 1])
        .to_device(device);
    (rows.narrow(1, 0, ctx as i64), rows.narrow(1, 1, ctx as i64))
}

/// Mean loss over the first `eval_batches` × batch_size windows of the validation file, in a
/// fixed order; each rank evaluates its share (window i → rank i mod world) and the sums meet
/// in one all-reduce.
fn evaluate(
    model: &Llama,
    val: &TokenFile,
    cfg: &Config,
    device: Device,
    pg: &mut dyn ProcessGroup,
) -> Result<Option<f64>> {
    let (ctx, bs) = (cfg.training.context_length, cfg.training.batch_size);
    if cfg.training.eval_batches == 0 || val.num_tokens() < ctx as u64 + 1 {
        return Ok(None);
    }
    let sampler = Sampler::new(val.num_tokens(), ctx, cfg.system.seed)?;
    let n = (cfg.training.eval_batches * bs).min(sampler.num_windows() as usize) as u64;
    let mut buf = Vec::new();
    let mut total = 0.0;
    let (rank, world) = (pg.rank() as u64, pg.world_size() as u64);
    let all: Vec<u64> = (0..n).filter(|i| i % world == rank).collect();
    let chunks: Vec<&[u64]> = all.chunks(bs).collect();
    tch::no_grad(|| {
        for idx in &chunks {
            let (x, y) = batch(val, &sampler, idx, ctx, &mut buf, device);
            total += model.loss(&x, &y).double_value(&[]) * idx.len() as f64;
        }
    });
    let mut sum = [total as f32];
    pg.all_reduce_sum_f32(&mut sum)?;
    Ok(Some(sum[0] as f64 / n as f64))
}

/// Per-invocation choices that are not part of the run's config.
#[derive(Debug, Clone, Default)]
pub struct RunOptions {
    pub resume: Option<Resume>,
    /// Checkpoint and exit after this step (time-sliced jobs); the schedule still spans max_steps.
    pub stop_at_step: Option<usize>,
}

pub fn train(
    resolved: &Resolved,
    opts: &RunOptions,
    topo: Topology,
    pg: &mut dyn ProcessGroup,
) -> Result<Summary> {
    let cfg = &resolved.config;
    let t = &cfg.training;
    let lead = topo.rank == 0;
    if cfg.system.num_threads > 0 {
        tch::set_num_threads(cfg.system.num_threads as i32);
    }
    let device = resolve_device(cfg, topo)?;
    let tag = telemetry::rank_tag(device.is_cuda(), topo.rank);
    let run_dir = run_dir(resolved);
    let ckpt_root = checkpoint_dir(resolved);
    std::fs::create_dir_all(&run_dir).with_context(|| {
        format!(
            "logging.dir: cannot create run directory {}; choose a writable logging.dir",
            run_dir.display()
        )
    })?;
    let resume_dir = resume_target(&ckpt_root, opts.resume.as_ref(), &tag)?;

    if lead {
        let config_json = serde_json::to_string_pretty(&resolved.to_json())?;
        println!(
            "{tag} Resolved config (preset {}):\n{config_json}",
            resolved.preset
        );
        std::fs::write(run_dir.join("config.json"), &config_json)
            .with_context(|| format!("{}: cannot write", run_dir.join("config.json").display()))?;
    }

    // Data: every rank maps the same prepared file. Local rank 0 prepares (or finds the
    // launcher's cache) first, so ranks of one node never tokenize the same corpus at once.
    let prepared = if topo.local_rank == 0 {
        Some(prepare_data(cfg, &tag)?)
    } else {
        None
    };
    pg.barrier()?;
    let prepared = match prepared {
        Some(p) => p,
        None => prepare(&prepare_spec(cfg, false))?,
    };
    let tokens = TokenFile::open(&prepared.train)?;
    let val = prepared
        .val
        .as_ref()
        .map(|p| TokenFile::open(p))
        .transpose()?;
    let sampler = Sampler::new(tokens.num_tokens(), t.context_length, cfg.system.seed)?;

    // Model and optimizer.
    tch::manual_seed(cfg.system.seed as i64);
    let shape = model_shape(cfg, prepared.vocab_size)?;
    let vs = VarStore::new(device);
    let model = Llama::new(
        &vs.root(),
        &shape,
        t.context_length,
        compute_kind(cfg, device),
    );
    if let Some(dir) = &cfg.model.model_path {
        hf::load_weights(Path::new(dir), &vs)?;
        println!(
            "{tag} Loaded weights from {dir} ({} layers)",
            shape.num_layers
        );
    }
    let params = Llama::named_parameters(&vs);
    let hp = AdamWParams {
        beta1: t.beta1,
        beta2: t.beta2,
        eps: t.adam_eps,
        weight_decay: t.weight_decay,
    };
    let mut opt = AdamW::new(
        params
            .iter()
            .map(|(n, p)| (n.clone(), p.shallow_clone()))
            .collect(),
        hp,
    );
    let mut state = TrainerState {
        format: checkpoint::FORMAT_VERSION,
        step: 0,
        samples_consumed: 0,
        seed: cfg.system.seed,
        adam_step: 0,
        loss: f64::NAN,
        world_size: topo.world,
        model_shape: shape.clone(),
        config: resolved.to_json(),
        versions: checkpoint::versions(),
    };
    if let Some(dir) = &resume_dir {
        let saved = checkpoint::load(dir, &shape, &params, &mut opt)?;
        anyhow::ensure!(
            saved.seed == cfg.system.seed,
            "{}: checkpoint was trained with system.seed = {}, config has {}; the data order would change. Set system.seed={}",
            dir.display(), saved.seed, cfg.system.seed, saved.seed
        );
        state.step = saved.step;
        state.samples_consumed = saved.samples_consumed;
        state.adam_step = saved.adam_step;
        println!(
            "{tag} Resumed from {} at step {} ({} samples consumed)",
            dir.display(),
            saved.step,
            saved.samples_consumed
        );
    }
    // Every rank starts from rank 0's weights (fresh init, HF weights or checkpoint alike).
    let tensors: Vec<Tensor> = params.iter().map(|(_, p)| p.shallow_clone()).collect();
    broadcast_parameters(pg, &tensors, cfg.system.bucket_mb)?;

    let global_batch = (t.batch_size * t.grad_accum_nums * topo.world) as u64;
    let tokens_per_step = global_batch as f64 * t.context_length as f64;
    if lead {
        println!(
        "{tag} Model: {:.2}M parameters, {} layers, d {}, {} heads / {} kv heads, vocab {} | device {device:?}, {:?} compute | {} tokens per step",
        shape.num_parameters() as f64 / 1e6, shape.num_layers, shape.hidden_size, shape.num_heads,
        shape.num_kv_heads, shape.vocab_size, compute_kind(cfg, device), tokens_per_step
    );
    }

    let schedule = Schedule {
        peak: t.learning_rate,
        floor: t.min_lr,
        warmup: t.warmup_steps,
        total: t.max_steps,
    };
    let mut metrics = if lead {
        Some(Metrics::open(&run_dir.join("metrics.jsonl"))?)
    } else {
        None
    };
    let mut summary = Summary {
        losses: Vec::new(),
        final_step: state.step,
        run_dir: run_dir.clone(),
        last_checkpoint: None,
        val_loss: None,
    };
    let mut buf = Vec::new();
    let mut window_start = Instant::now();
    let mut window_steps = 0usize;
    let (mut data_s, mut compute_s, mut comm_s, mut opt_s) = (0.0, 0.0, 0.0, 0.0);

    let last_step = opts
        .stop_at_step
        .map_or(t.max_steps, |s| s.min(t.max_steps));
    for step in state.step..last_step {
        inject_fault(cfg, topo, step + 1, &tag);
        let lr = schedule.lr(step);
        // Forward/backward over the micro-batches; this rank's share of the global order.
        let phase = Instant::now();
        let mine: Vec<u64> = rank_indices(
            state.samples_consumed,
            global_batch,
            topo.rank as u64,
            topo.world as u64,
        )
        .collect();
        let mut loss_sum = Tensor::zeros([], (Kind::Float, device));
        let mut data_time = 0.0;
        for micro in mine.chunks(t.batch_size) {
            let d0 = Instant::now();
            let (x, y) = batch(&tokens, &sampler, micro, t.context_length, &mut buf, device);
            data_time += d0.elapsed().as_secs_f64();
            let loss = model.loss(&x, &y);
            (&loss / t.grad_accum_nums as f64).backward();
            loss_sum += loss.detach();
        }
        state.samples_consumed += global_batch;
        compute_s += phase.elapsed().as_secs_f64() - data_time;
        data_s += data_time;

        // Data parallelism: average gradients (once per step, after the last micro-batch) and
        // the loss across ranks, so clipping, the guard and the log see global values.
        let phase = Instant::now();
        let grads = opt.gradients();
        all_reduce_gradients(pg, &grads, cfg.system.bucket_mb)?;
        let mut global_loss = [(loss_sum.double_value(&[]) / t.grad_accum_nums as f64) as f32];
        pg.all_reduce_avg_f32(&mut global_loss)?;
        let loss = global_loss[0] as f64;
        comm_s += phase.elapsed().as_secs_f64();
        let norm = clip_grad_norm(&grads, t.max_grad_norm).double_value(&[]);
        if t.nan_check && !(loss.is_finite() && norm.is_finite()) {
            guard::report(&tag, step, loss, norm, &opt);
            bail!("{tag} non-finite loss or gradient norm at step {step}; stopping (see the report above)");
        }

        let phase = Instant::now();
        opt.step(lr);
        opt.zero_grad();
        opt_s += phase.elapsed().as_secs_f64();
        state.step = step + 1;
        state.adam_step = opt.step;
        state.loss = loss;
        summary.losses.push(loss);
        window_steps += 1;

        let done = state.step == last_step;
        let eval_now = val.is_some()
            && (done || (t.eval_interval > 0 && state.step.is_multiple_of(t.eval_interval)));
        let val_loss = if eval_now {
            evaluate(&model, val.as_ref().unwrap(), cfg, device, pg)?
        } else {
            None
        };
        if val_loss.is_some() {
            summary.val_loss = val_loss;
        }
        if state.step.is_multiple_of(cfg.logging.interval) || done || val_loss.is_some() {
            let elapsed = window_start.elapsed().as_secs_f64();
            let step_time = elapsed / window_steps as f64;
            let line = StepLine {
                tag: &tag,
                step: state.step,
                max_steps: t.max_steps,
                loss,
                lr,
                grad_norm: norm,
                tokens_per_s: tokens_per_step / step_time,
                eta_s: step_time * (t.max_steps - state.step) as f64,
                mfu: None,
            };
            if let Some(metrics) = metrics.as_mut() {
                println!("{line}");
                if let Some(v) = val_loss {
                    println!(
                        "{tag} Validation | Step [{}/{}] | Val Loss: {v:.4} | Val PPL: {:.2}",
                        state.step,
                        t.max_steps,
                        v.exp()
                    );
                }
                if cfg.logging.verbose {
                    let n = window_steps as f64;
                    println!(
                        "{tag} Timing per step: data {:.1} ms | forward+backward {:.1} ms | all-reduce {:.1} ms | optimizer {:.1} ms",
                        1e3 * data_s / n, 1e3 * compute_s / n, 1e3 * comm_s / n, 1e3 * opt_s / n
                    );
                }
                metrics.record(&json!({
                    "step": state.step, "loss": loss, "lr": lr, "grad_norm": norm,
                    "tokens_per_s": tokens_per_step / step_time, "samples_consumed": state.samples_consumed,
                    "val_loss": val_loss,
                }))?;
            }
            window_start = Instant::now();
            window_steps = 0;
            (data_s, compute_s, comm_s, opt_s) = (0.0, 0.0, 0.0, 0.0);
        }

        let interval = cfg.checkpoint.interval;
        if done || (interval > 0 && state.step.is_multiple_of(interval)) {
            // Every rank holds the same weights and moments: rank 0 writes, the others wait so
            // that no rank runs ahead of a checkpoint that might fail.
            if lead {
                let name = format!("step_{}", state.step);
                let dir = checkpoint::save(
                    &ckpt_root,
                    &name,
                    &params,
                    &opt,
                    &state,
                    cfg.checkpoint.keep_last,
                )?;
                println!("{tag} Checkpoint saved: {}", dir.display());
                summary.last_checkpoint = Some(dir);
            }
            pg.barrier()?;
            // Saving is slow and not training throughput.
            window_start = Instant::now();
        }
    }
    summary.final_step = state.step;
    // Rank 0 hosts the store: nobody may leave while others still use it.
    pg.barrier()?;
    if lead && state.step >= t.max_steps && summary.losses.is_empty() {
        println!(
            "{tag} Nothing to do: the checkpoint is already at step {} = training.max_steps",
            state.step
        );
    }
    Ok(summary)
}

/// The checkpoint to resume from. Without `--resume`, an existing checkpoint is an error rather
/// than something silently overwritten or ignored.
fn resume_target(root: &Path, resume: Option<&Resume>, tag: &str) -> Result<Option<PathBuf>> {
    for partial in checkpoint::incomplete(root) {
        println!(
            "{tag} Ignoring incomplete checkpoint {} (a save was interrupted)",
            partial.display()
        );
    }
    match resume {
        None => match checkpoint::latest(root) {
            Some(found) => bail!(
                "{} already holds checkpoints (latest {}); pass --resume auto to continue that run, or set logging.run_name / checkpoint.dir to start a new one",
                root.display(),
                found.display()
            ),
            None => Ok(None),
        },
        Some(Resume::Auto) => {
            let found = checkpoint::latest(root);
            if found.is_none() {
                println!("{tag} --resume auto: no complete checkpoint in {}; starting from scratch", root.display());
            }
            Ok(found)
        }
        Some(Resume::Dir(dir)) => {
            anyhow::ensure!(dir.join("trainer.json").is_file(), "--resume {}: not a complete checkpoint directory (no trainer.json)", dir.display());
            Ok(Some(dir.clone()))
        }
    }
}

/// `debug.fault`: a deliberate crash or hang of one rank, for the launcher and timeout tests.
fn inject_fault(cfg: &Config, topo: Topology, step: usize, tag: &str) {
    let d = &cfg.debug;
    if d.fault == "none" || d.fault_rank != topo.rank || d.fault_step != step {
        return;
    }
    eprintln!("{tag} debug.fault = {} injected at step {step}", d.fault);
    if d.fault == "exit" {
        std::process::exit(d.fault_exit_code as i32);
    }
    // SAFETY: raising a signal on ourselves has no memory-safety preconditions.
    unsafe { libc::raise(libc::SIGSTOP) };
}
