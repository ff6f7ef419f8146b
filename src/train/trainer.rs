//! The training loop, top to bottom: set up (device, data, model, AdamW, resume), then per step:
//! micro-batches → backward → all-reduce → clip → guard → AdamW → log / validate / checkpoint.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use serde_json::json;
use tch::nn::VarStore;
use tch::{Device, Kind, Tensor};

use super::checkpoint::{self, TrainerState};
use super::eval::{batch, evaluate};
use super::guard::{self, Action, Event, NanAbort, SpikeDetector};
use super::optim::{clip_to, grad_norm, AdamW, AdamWParams, Schedule};
use super::preempt;
use super::setup::{
    checkpoint_dir, compute_kind, model_shape, prepare_data, prepare_spec, resolve_device,
    resume_target, run_dir,
};
use crate::config::{Config, Resolved, TrainingConfig};
use crate::data::hub;
use crate::data::prepare::prepare;
use crate::data::sampler::{rank_indices, Sampler};
use crate::data::tokfile::TokenFile;
use crate::dist::grads::{all_reduce_gradients, broadcast_parameters};
use crate::dist::ProcessGroup;
use crate::model::{hf, Llama, LlamaShape};
use crate::telemetry::memory::{gb, peak_rss_bytes, rss_bytes};
use crate::telemetry::tensorboard::EventWriter;
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

/// Per-invocation choices that are not part of the run's config.
#[derive(Debug, Clone, Default)]
pub struct RunOptions {
    pub resume: Option<Resume>,
    /// Checkpoint and exit after this step (time-sliced jobs); the schedule still spans max_steps.
    pub stop_at_step: Option<usize>,
}

/// What a finished run reports back (tests read it).
#[derive(Debug, Clone)]
pub struct Summary {
    pub losses: Vec<f64>,
    pub final_step: usize,
    pub run_dir: PathBuf,
    pub last_checkpoint: Option<PathBuf>,
    pub val_loss: Option<f64>,
    /// Stopped early by SIGTERM/SIGINT after saving a checkpoint.
    pub preempted: bool,
}

/// Running sums for the per-phase timing line (`logging.verbose`) and Tok/s.
#[derive(Default)]
struct Window {
    start: Option<Instant>,
    steps: usize,
    data_s: f64,
    compute_s: f64,
    comm_s: f64,
    opt_s: f64,
}

impl Window {
    fn reset(&mut self) {
        *self = Window {
            start: Some(Instant::now()),
            ..Default::default()
        };
    }
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
    let resume_dir = resume_target(&ckpt_root, opts.resume.as_ref(), &tag)?;
    if lead {
        let config_json = serde_json::to_string_pretty(&resolved.to_json())?;
        println!(
            "{tag} Resolved config (preset {}):\n{config_json}",
            resolved.preset
        );
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
    let data = TrainData {
        sampler: Sampler::new(tokens.num_tokens(), t.context_length, cfg.system.seed)?,
        tokens,
        context_length: t.context_length,
        device,
    };

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
        let path = hub::resolve_model(dir)?;
        hf::load_weights(&path, &vs)?;
        println!(
            "{tag} Loaded weights from {dir} ({}, {} layers)",
            path.display(),
            shape.num_layers
        );
    }
    let params = Llama::named_parameters(&vs);
    check_injection_target(cfg, &params)?;
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
        lr_scale: 1.0,
        guard_events: 0,
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
        state = TrainerState {
            world_size: topo.world,
            config: resolved.to_json(),
            ..saved
        };
        println!(
            "{tag} Resumed from {} at step {} ({} samples consumed)",
            dir.display(),
            state.step,
            state.samples_consumed
        );
    }
    // The run is accepted (data found, checkpoint compatible): only now touch its directory,
    // so a rejected start leaves an earlier run's config.json and checkpoints as they were.
    std::fs::create_dir_all(&run_dir).with_context(|| {
        format!(
            "logging.dir: cannot create run directory {}; choose a writable logging.dir",
            run_dir.display()
        )
    })?;
    if lead {
        let config_path = run_dir.join("config.json");
        std::fs::write(
            &config_path,
            serde_json::to_string_pretty(&resolved.to_json())?,
        )
        .with_context(|| {
            format!(
                "{}: cannot write; is logging.dir writable?",
                config_path.display()
            )
        })?;
        // An unwritable checkpoint.dir should fail now, not after checkpoint.interval steps.
        checkpoint::check_writable(&ckpt_root)?;
    }
    // Every rank starts from rank 0's weights (fresh init, HF weights or checkpoint alike).
    let tensors: Vec<Tensor> = params.iter().map(|(_, p)| p.shallow_clone()).collect();
    broadcast_parameters(pg, &tensors, cfg.system.bucket_mb)?;
    // On NCCL the broadcast is only queued; a host-side barrier turns a peer that never joined
    // it into the ring's timeout naming that rank, rather than a hang at the first loss read.
    pg.barrier()?;

    let global_batch = (t.batch_size * t.grad_accum_nums * topo.world) as u64;
    let tokens_per_step = global_batch as f64 * t.context_length as f64;
    // MFU needs the achieved FLOPs per token and this device's peak (CUDA only, known GPUs).
    let mfu_basis = match device {
        tch::Device::Cuda(i) => telemetry::mfu::device_peak(i)
            .map(|peak| (shape.flops_per_token(t.context_length), peak)),
        _ => None,
    };
    if lead {
        println!(
            "{tag} Model: {:.2}M parameters, {} layers, d {}, {} heads / {} kv heads, vocab {} | {device:?}, {:?} compute | {} ranks, {} tokens per step",
            shape.num_parameters() as f64 / 1e6, shape.num_layers, shape.hidden_size, shape.num_heads,
            shape.num_kv_heads, shape.vocab_size, compute_kind(cfg, device), topo.world, tokens_per_step
        );
    }

    let schedule = Schedule {
        peak: t.learning_rate,
        floor: t.min_lr,
        warmup: t.warmup_steps,
        total: t.max_steps,
    };
    let mut spikes = SpikeDetector::new(t.spike_window, t.spike_zscore);
    let mut records = if lead {
        let tensorboard = if cfg.logging.tensorboard {
            let mut tb = EventWriter::create(&run_dir.join("tensorboard"))?;
            if state.step > 0 {
                // Resumed: points from here on replace any the earlier process wrote.
                tb.session_start(state.step as i64 + 1)?;
            }
            Some(tb)
        } else {
            None
        };
        Some(Records {
            metrics: Metrics::open(&run_dir.join("metrics.jsonl"))?,
            tensorboard,
        })
    } else {
        None
    };
    let mut summary = Summary {
        losses: Vec::new(),
        final_step: state.step,
        run_dir: run_dir.clone(),
        last_checkpoint: None,
        val_loss: None,
        preempted: false,
    };
    let mut buf = Vec::new();
    let mut window = Window::default();
    window.reset();
    let mut nan_injected = false;
    preempt::install();

    // The injected NaN fires once, also when a rollback replays its step.
    let mut inject_now = |step: usize| {
        cfg.debug.inject_nan_at_step == step && !std::mem::replace(&mut nan_injected, true)
    };
    let last_step = opts
        .stop_at_step
        .map_or(t.max_steps, |s| s.min(t.max_steps));
    while state.step < last_step {
        let step = state.step;
        inject_fault(cfg, topo, step + 1, &tag);
        let lr = schedule.lr(step) * state.lr_scale;
        let inject_nan = inject_now(step + 1);

        // Forward/backward over the micro-batches of this rank's share of the global order.
        let phase = Instant::now();
        let mine: Vec<u64> = rank_indices(
            state.samples_consumed,
            global_batch,
            topo.rank as u64,
            topo.world as u64,
        )
        .collect();
        let nan_loss = inject_nan && cfg.debug.inject_nan_param.is_none();
        let (local_loss, data_time) = forward_backward(&model, &data, &mine, t, &mut buf, nan_loss);
        state.samples_consumed += global_batch;
        window.compute_s += phase.elapsed().as_secs_f64() - data_time;
        window.data_s += data_time;

        // The all-reduce phase ends at the norm's read: on NCCL that is where the host waits
        // for the queued gradient all-reduce.
        let phase = Instant::now();
        let grads = opt.gradients();
        let (loss, stop_requested) = synchronize(pg, &grads, local_loss, cfg.system.bucket_mb)?;
        if inject_nan {
            inject_nan_gradient(cfg, &opt);
        }
        let norm_tensor = grad_norm(&grads);
        let norm = norm_tensor.double_value(&[]);
        window.comm_s += phase.elapsed().as_secs_f64();

        // The guard: NaN/Inf (always checked when nan_check is on) and loss spikes.
        let event = if t.nan_check && !(loss.is_finite() && norm.is_finite()) {
            Some(Event::NonFinite)
        } else {
            spikes
                .as_ref()
                .and_then(|s| s.spike(loss))
                .map(|z| Event::Spike { z })
        };
        if let Some(event) = event {
            let action = on_guard_event(
                event,
                step + 1,
                loss,
                norm,
                &opt,
                &mut state,
                cfg,
                &ckpt_root,
                &run_dir,
                &tag,
                lead,
                pg,
            )?;
            match action {
                Action::Abort => unreachable!("on_guard_event returns the abort as an error"),
                Action::Skip => {
                    opt.zero_grad();
                    state.step += 1;
                }
                Action::Rollback => {
                    let tb = records.as_mut().and_then(|r| r.tensorboard.as_mut());
                    roll_back(
                        &ckpt_root, &shape, &params, &mut opt, &mut state, t, tb, &tag,
                    )?;
                }
            }
            continue;
        }
        if let (Some(s), true) = (spikes.as_mut(), loss.is_finite()) {
            s.accept(loss);
        }
        clip_to(&grads, &norm_tensor, t.max_grad_norm);

        let phase = Instant::now();
        opt.step(lr)?;
        opt.zero_grad();
        window.opt_s += phase.elapsed().as_secs_f64();
        state.step = step + 1;
        state.adam_step = opt.step;
        state.loss = loss;
        summary.losses.push(loss);
        window.steps += 1;

        let done = state.step == last_step || stop_requested;
        let eval_now = val.is_some()
            && (done || (t.eval_interval > 0 && state.step.is_multiple_of(t.eval_interval)));
        let val_loss = if eval_now {
            evaluate(&model, val.as_ref().unwrap(), cfg, device, pg)?
        } else {
            None
        };
        summary.val_loss = val_loss.or(summary.val_loss);
        if state.step.is_multiple_of(cfg.logging.interval) || done || val_loss.is_some() {
            if let Some(records) = records.as_mut() {
                log_step(
                    &tag,
                    &state,
                    t.max_steps,
                    lr,
                    norm,
                    tokens_per_step,
                    val_loss,
                    &window,
                    cfg,
                    records,
                    mfu_basis.map(|(flops, peak)| (flops, peak * topo.world as f64)),
                )?;
            }
            window.reset();
        }
        report_memory(cfg, state.step, &tag, device);

        let interval = cfg.checkpoint.interval;
        if done || (interval > 0 && state.step.is_multiple_of(interval)) {
            // Every rank holds the same weights and moments: rank 0 writes, the others wait so
            // that no rank runs ahead of a checkpoint that might fail.
            if lead {
                let name = format!("step_{}", state.step);
                let keep = cfg.checkpoint.keep_last;
                let dir = checkpoint::save(&ckpt_root, &name, &params, &opt, &state, keep)?;
                println!("{tag} Checkpoint saved: {}", dir.display());
                summary.last_checkpoint = Some(dir);
            }
            pg.barrier()?;
            window.reset();
        }
        if stop_requested {
            println!(
                "{tag} Stopped by signal at step {}: checkpoint saved; continue with --resume auto",
                state.step
            );
            summary.preempted = true;
            break;
        }
    }
    summary.final_step = state.step;
    // Rank 0 hosts the store: nobody may leave while others still use it.
    pg.barrier()?;
    if lead {
        if state.step >= t.max_steps && summary.losses.is_empty() {
            println!(
                "{tag} Nothing to do: the checkpoint is already at step {} = training.max_steps",
                state.step
            );
        }
        println!("{tag} Peak memory: RSS {:.2} GB", gb(peak_rss_bytes()));
    }
    Ok(summary)
}

/// The token file and the order its windows are read in; every rank maps the same file.
struct TrainData {
    tokens: TokenFile,
    sampler: Sampler,
    context_length: usize,
    device: Device,
}

/// One step's forward and backward over this rank's `mine` samples in micro-batches of
/// `training.batch_size`. Each micro-batch's loss is scaled by 1/grad_accum_nums before backward,
/// so the accumulated gradient is the step's mean. Returns this rank's mean loss and the
/// seconds spent assembling batches. `nan_loss`: debug.inject_nan_at_step without a parameter.
fn forward_backward(
    model: &Llama,
    data: &TrainData,
    mine: &[u64],
    t: &TrainingConfig,
    buf: &mut Vec<i64>,
    nan_loss: bool,
) -> (f64, f64) {
    let mut loss_sum = Tensor::zeros([], (Kind::Float, data.device));
    let mut data_time = 0.0;
    for micro in mine.chunks(t.batch_size) {
        let d0 = Instant::now();
        let (x, y) = batch(
            &data.tokens,
            &data.sampler,
            micro,
            data.context_length,
            buf,
            data.device,
        );
        data_time += d0.elapsed().as_secs_f64();
        let mut loss = model.loss(&x, &y);
        if nan_loss {
            loss = &loss * f64::NAN;
        }
        (&loss / t.grad_accum_nums as f64).backward();
        loss_sum += loss.detach();
    }
    // Read before any collective is queued: on CUDA, reading it after an NCCL all-reduce was
    // queued would wait for that all-reduce, and a stalled peer would hang this rank here
    // instead of failing the host-side agreement below with the peer's rank named.
    let local_loss = loss_sum.double_value(&[]) / t.grad_accum_nums as f64;
    (local_loss, data_time)
}

/// Data parallelism, once per step after the last micro-batch: averages the gradients across
/// ranks, and sums the losses and stop requests so that every rank sees the same global loss
/// and takes the same branch afterwards. Returns (global mean loss, stop requested anywhere).
fn synchronize(
    pg: &mut dyn ProcessGroup,
    grads: &[Tensor],
    local_loss: f64,
    bucket_mb: f64,
) -> Result<(f64, bool)> {
    all_reduce_gradients(pg, grads, bucket_mb)?;
    let mut shared = [local_loss as f32, f32::from(u8::from(preempt::requested()))];
    pg.all_reduce_sum_f32(&mut shared)?;
    Ok((shared[0] as f64 / pg.world_size() as f64, shared[1] > 0.0))
}

/// training.nan_policy / spike_policy = rollback: back to the latest checkpoint's weights,
/// moments and step, with the LR scaled down. The data position is kept (samples_consumed goes
/// on), so the replayed steps see new data rather than the batches that went bad.
#[allow(clippy::too_many_arguments)]
fn roll_back(
    ckpt_root: &Path,
    shape: &LlamaShape,
    params: &[(String, Tensor)],
    opt: &mut AdamW,
    state: &mut TrainerState,
    t: &TrainingConfig,
    tensorboard: Option<&mut EventWriter>,
    tag: &str,
) -> Result<()> {
    let dir = checkpoint::latest(ckpt_root).context("rollback needs a checkpoint")?;
    let saved = checkpoint::load(&dir, shape, params, opt)?;
    opt.zero_grad();
    state.step = saved.step;
    state.adam_step = saved.adam_step;
    state.lr_scale *= t.rollback_lr_factor;
    if let Some(tb) = tensorboard {
        tb.session_start(saved.step as i64 + 1)?;
    }
    println!(
        "{tag} Rolled back to {} (step {}); LR scale now {}",
        dir.display(),
        saved.step,
        state.lr_scale
    );
    Ok(())
}

/// Prints the step line (and validation, timing) and appends the metrics record.
#[allow(clippy::too_many_arguments)]
fn log_step(
    tag: &str,
    state: &TrainerState,
    max_steps: usize,
    lr: f64,
    norm: f64,
    tokens_per_step: f64,
    val_loss: Option<f64>,
    window: &Window,
    cfg: &Config,
    records: &mut Records,
    mfu_basis: Option<(f64, f64)>,
) -> Result<()> {
    let n = window.steps.max(1) as f64;
    let step_time = window.start.map_or(0.0, |s| s.elapsed().as_secs_f64()) / n;
    let tok_s = tokens_per_step / step_time.max(1e-9);
    // (FLOPs per token, summed peak of all ranks' devices); Tok/s is global.
    let mfu = mfu_basis.map(|(flops_per_token, peak)| tok_s * flops_per_token / peak);
    let line = StepLine {
        tag,
        step: state.step,
        max_steps,
        loss: state.loss,
        lr,
        grad_norm: norm,
        tokens_per_s: tok_s,
        eta_s: step_time * (max_steps - state.step) as f64,
        mfu,
    };
    println!("{line}");
    if let Some(v) = val_loss {
        println!(
            "{tag} Validation | Step [{}/{max_steps}] | Val Loss: {v:.4} | Val PPL: {:.2}",
            state.step,
            v.exp()
        );
    }
    if cfg.logging.verbose {
        println!(
            "{tag} Timing per step: data {:.1} ms | forward+backward {:.1} ms | all-reduce {:.1} ms | optimizer {:.1} ms",
            1e3 * window.data_s / n, 1e3 * window.compute_s / n, 1e3 * window.comm_s / n, 1e3 * window.opt_s / n
        );
    }
    let rss = gb(rss_bytes());
    records.metrics.record(&json!({
        "step": state.step, "loss": state.loss, "lr": lr, "grad_norm": norm, "tokens_per_s": tok_s,
        "samples_consumed": state.samples_consumed, "val_loss": val_loss, "rss_gb": rss,
        "guard_events": state.guard_events, "mfu": mfu,
    }))?;
    if let Some(tb) = records.tensorboard.as_mut() {
        let s = state.step as i64;
        tb.scalar("train/loss", s, state.loss)?;
        tb.scalar("train/lr", s, lr)?;
        tb.scalar("train/grad_norm", s, norm)?;
        tb.scalar("train/tokens_per_s", s, tok_s)?;
        if let Some(m) = mfu {
            tb.scalar("train/mfu", s, m)?;
        }
        if let Some(v) = val_loss {
            tb.scalar("val/loss", s, v)?;
            tb.scalar("val/ppl", s, v.exp())?;
        }
        tb.scalar("memory/rss_gb", s, rss)?;
        tb.flush()?;
    }
    Ok(())
}

/// Rank 0's records of the run: metrics.jsonl and, with logging.tensorboard, event files.
struct Records {
    metrics: Metrics,
    tensorboard: Option<EventWriter>,
}

/// Every `logging.memory_interval` steps: RSS on rank 0; a warning on any rank above the limit.
fn report_memory(cfg: &Config, step: usize, tag: &str, device: tch::Device) {
    let every = cfg.logging.memory_interval;
    if every == 0 || !step.is_multiple_of(every) {
        return;
    }
    let rss = gb(rss_bytes());
    // On CUDA, NVML's view of this rank's GPU: what the caching allocator reserved plus the
    // CUDA context (libtorch's allocator statistics are not reachable through tch).
    let gpu = match device {
        tch::Device::Cuda(i) => telemetry::mfu::nvml_device(i)
            .map(|g| {
                format!(
                    " | GPU used {:.2} of {:.2} GB",
                    gb(g.memory_used),
                    gb(g.memory_total)
                )
            })
            .unwrap_or_default(),
        _ => String::new(),
    };
    println!(
        "{tag} Memory | RSS {rss:.2} GB | peak {:.2} GB{gpu}",
        gb(peak_rss_bytes())
    );
    let limit = cfg.system.max_memory_gb;
    if limit > 0.0 && rss > limit {
        eprintln!(
            "{tag} WARNING: resident memory {rss:.2} GB exceeds system.max_memory_gb = {limit}"
        );
    }
}

/// Reports a guard event, saves the evidence (rank 0), and decides what the loop does. The
/// abort comes back as a `NanAbort` error (exit code 3).
#[allow(clippy::too_many_arguments)]
fn on_guard_event(
    event: Event,
    step: usize,
    loss: f64,
    norm: f64,
    opt: &AdamW,
    state: &mut TrainerState,
    cfg: &Config,
    ckpt_root: &Path,
    run_dir: &Path,
    tag: &str,
    lead: bool,
    pg: &mut dyn ProcessGroup,
) -> Result<Action> {
    let t = &cfg.training;
    let action = match event {
        Event::NonFinite => {
            if lead {
                let mut text = guard::report_text(tag, step, loss, norm, opt);
                let name = format!("nan_step_{step}");
                let params: Vec<(String, Tensor)> = opt
                    .params
                    .iter()
                    .map(|p| (p.name.clone(), p.param.shallow_clone()))
                    .collect();
                let evidence = TrainerState {
                    step,
                    loss,
                    ..state.clone()
                };
                let dir = checkpoint::save(ckpt_root, &name, &params, opt, &evidence, usize::MAX)?;
                let dump = run_dir.join("debug").join(format!("{name}.safetensors"));
                guard::dump(&dump, opt)?;
                text.push_str(&format!(
                    "\nCheckpoint saved: {}\nDebug tensors saved: {}",
                    dir.display(),
                    dump.display()
                ));
                eprintln!("{text}");
            }
            Action::from_config(&t.nan_policy)
        }
        Event::Spike { z } => {
            eprintln!("{tag} WARNING: loss spike at step {step}: loss {loss:.4} is {z:.1} standard deviations above the last {} losses", t.spike_window);
            Action::from_config(&t.spike_policy)
        }
    };
    pg.barrier()?;
    let what = if event == Event::NonFinite {
        "non-finite loss or gradient norm"
    } else {
        "loss spike"
    };
    if action == Action::Abort {
        return Err(NanAbort(format!(
            "{tag} {what} at step {step}; stopping (training.nan_policy / spike_policy = abort)"
        ))
        .into());
    }
    state.guard_events += 1;
    if state.guard_events > t.max_nan_skips {
        return Err(NanAbort(format!(
            "{tag} {what} at step {step}: {} guard events exceed training.max_nan_skips = {}; stopping",
            state.guard_events, t.max_nan_skips
        ))
        .into());
    }
    if action == Action::Rollback && checkpoint::latest(ckpt_root).is_none() {
        return Err(NanAbort(format!(
            "{tag} {what} at step {step}: rollback needs a complete checkpoint in {} and there is none yet; set checkpoint.interval",
            ckpt_root.display()
        ))
        .into());
    }
    let verb = if action == Action::Skip {
        "skipping the update"
    } else {
        "rolling back"
    };
    if lead {
        println!(
            "{tag} Guard: {what} at step {step}; {verb} ({} of {} allowed)",
            state.guard_events, t.max_nan_skips
        );
    }
    Ok(action)
}

fn check_injection_target(cfg: &Config, params: &[(String, Tensor)]) -> Result<()> {
    if let Some(name) = &cfg.debug.inject_nan_param {
        if !params.iter().any(|(n, _)| n == name) {
            bail!("debug.inject_nan_param = {name:?} is not a parameter of this model (e.g. model.layers.0.mlp.up_proj.weight)");
        }
    }
    Ok(())
}

/// `debug.inject_nan_param`: a NaN in one gradient, after the all-reduce so every rank agrees.
fn inject_nan_gradient(cfg: &Config, opt: &AdamW) {
    let Some(name) = &cfg.debug.inject_nan_param else {
        return;
    };
    if let Some(p) = opt.params.iter().find(|p| &p.name == name) {
        let _ = p.param.grad().view(-1).get(0).fill_(f64::NAN);
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
