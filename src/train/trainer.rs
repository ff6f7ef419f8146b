//! The trainer: built once from its components, then the loop, which reads top to bottom —
//! each step asks the data loader for its micro-batches, `train_step` does the step, and the
//! validator, recorder and checkpointer are asked whether they are due.
//!
//! Components (each in its own module): `Loader` (this rank's batches), `train_step` (one
//! optimizer step), `Guard` (NaN/Inf and loss spikes), `Validator`, `TaskEval` (downstream
//! multiple-choice tasks), `Recorder` (step line,
//! metrics, TensorBoard, memory), `Checkpointer`, `Faults` (the `debug.*` hooks), and the
//! `TrainerState` that a checkpoint carries.

use std::path::PathBuf;

use anyhow::{Context, Result};
use tch::nn::VarStore;
use tch::Tensor;

use super::build::{build, Built};
use super::checkpoint::{self, Checkpointer};
use super::device;
use super::eval::Validator;
use super::faults::Faults;
use super::fit;
use super::guard::{self, Event, Guard, NanAbort};
use super::loader::{Loader, SourceTokens};
use super::optim::{Optimizer, Schedule};
use super::place::Rank;
use super::preempt;
use super::recorder::{About, Recorder};
use super::step::{train_step, StepConfig, StepOutcome, StepPlan};
use super::stragglers::Stragglers;
use super::tasks::TaskEval;
use crate::config::{Config, GuardPolicy, Resolved};
use crate::data::tokfile::TokenFile;
use crate::dist::forensics;
use crate::dist::ProcessGroup;
use crate::model::{Llama, LlamaShape};
use crate::run::checkpoints::{self, TrainerState};
use crate::run::data::DataSource;
use crate::run::{self, RunDir, RunOptions};
use crate::sys::machine::{gb, peak_rss_bytes};
use crate::sys::phase::{self, Phase};
use crate::telemetry::tracker::RunStatus;

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

pub struct Trainer<'a> {
    cfg: &'a Config,
    rank: Rank,
    pg: &'a mut dyn ProcessGroup,
    /// Owns the parameters; `params` and the model hold shallow clones of them.
    _vs: VarStore,
    /// Every parameter under its Hugging Face name, in HF order: what checkpoints hold.
    params: Vec<(String, Tensor)>,
    model: Llama,
    opt: Optimizer,
    schedule: Schedule,
    step_cfg: StepConfig,
    loader: Loader,
    validator: Option<Validator>,
    /// `training.eval_tasks`: downstream evaluation.
    tasks: Option<TaskEval>,
    guard: Guard,
    recorder: Recorder,
    checkpointer: Checkpointer,
    faults: Faults,
    stragglers: Stragglers,
    state: TrainerState,
    run_dir: PathBuf,
    /// Rank 0's locks on the run directory and the checkpoint directory, held for the whole
    /// run.
    _claim: Option<RunDir>,
    _claim_checkpoints: Option<RunDir>,
    /// The run's sources (one without `data.sources`).
    data: Vec<DataSource>,
    /// The loop stops after this step (`--stop-at-step`, else `training.max_steps`).
    last_step: usize,
}

impl<'a> Trainer<'a> {
    /// Sets a run up: claims the run directory, prepares the data, builds the model and AdamW,
    /// resumes, and brings every rank to rank 0's weights.
    pub fn new(
        resolved: &'a Resolved,
        opts: &RunOptions,
        rank: Rank,
        pg: &'a mut dyn ProcessGroup,
    ) -> Result<Trainer<'a>> {
        let cfg = &resolved.config;
        let t = &cfg.training;
        set_threads(cfg, &rank);
        // Before anything else, so a second process on this run directory stops at once.
        let run_dir = resolved.run_dir();
        let mut claim = rank.lead().then(|| RunDir::claim(&run_dir)).transpose()?;
        let checkpoints = run::checkpoint_dir(resolved);
        let mut claim_checkpoints = rank
            .lead()
            .then(|| RunDir::claim_checkpoints(&checkpoints, &run_dir))
            .transpose()?;
        let checkpointer = Checkpointer::new(checkpoints, &cfg.checkpoint, &rank.tag, &*pg)?
            .delay_reports(cfg.debug.save_report_delay_ms);
        let resume_dir = run::resume_target(resolved, opts.resume.as_ref(), &rank.tag, pg)?;
        // Before the data is prepared: a bad task file stops the run at once.
        let tasks = TaskEval::new(cfg, &rank)?;
        // Before anything of the model's size is allocated, and without `model.model_path`
        // (whose config.json comes with its download) before the data is prepared too.
        if cfg.model.model_path.is_none() {
            fit::check(cfg, &crate::plan::shape(cfg)?, &rank)?;
        }
        let data = prepare_on_node(cfg, &rank, pg)?;
        let shape = run::data::model_shape(cfg, &data)?;
        if cfg.model.model_path.is_some() {
            fit::check(cfg, &shape, &rank)?;
        }
        if rank.lead() {
            let cuda = rank.device.is_cuda();
            for note in crate::config::world_notes(cfg, rank.place.world, cuda, shape.num_layers) {
                println!("{} Warning: {note}", rank.tag);
            }
        }
        let (train, val) = open_sources(&data)?.into_iter().unzip();
        let loader = Loader::new(train, cfg, &rank)?;
        let validator = Validator::new(val, cfg, rank.device)?;

        let compute = device::compute_kind(cfg, rank.device);
        let vs = VarStore::new(rank.device);
        let Built {
            model,
            params,
            mut opt,
        } = build(cfg, &shape, &vs, compute, &rank, pg)?;
        let faults = Faults::new(cfg, &rank, &shape)?;
        let identity = run::data::data_identity(&data, t.context_length)?;
        let mut state = fresh_state(resolved, &shape, rank.place.world, identity.clone());
        if let Some(dir) = &resume_dir {
            state = resume(dir, &shape, &mut opt, resolved, &rank, identity)?;
        }

        // The start is accepted (data found, checkpoint compatible): only now write into the
        // run directory, so a refused start leaves an earlier run's files as they were.
        if let (Some(claim), Some(checkpoints)) = (claim.as_mut(), claim_checkpoints.as_mut()) {
            claim.accept();
            checkpoints.accept();
            write_config(&run_dir, resolved)?;
            run::dir::record_checkpoint_dir(&run_dir, checkpointer.root())?;
            // An unwritable checkpoint.dir should fail now, not after checkpoint.interval steps.
            checkpoints::check_writable(checkpointer.root())?;
            print_summary(
                resolved,
                &rank,
                (&shape, model.parameters().count()),
                compute,
                &run_dir,
                checkpointer.root(),
            );
        }

        let mfu_basis = match rank.device {
            tch::Device::Cuda(i) => crate::sys::machine::device_peak(i)
                .map(|peak| (shape.flops_per_token(t.context_length), peak)),
            _ => None,
        };
        let about = About {
            parameters: model.parameters().count(),
            data: state.data.as_ref(),
        };
        let recorder = Recorder::new(resolved, &rank, &run_dir, &about, mfu_basis, state.step)?;
        let stragglers = Stragglers::new(cfg, &rank, state.step);
        forensics::resumed_at(state.step);
        let mut step_cfg = StepConfig::from_config(cfg);
        // The overlap runs the ring from a second thread; NCCL's from a second thread is not
        // verified on GPUs yet, so ranks on NCCL reduce after backward.
        step_cfg.overlap &= device::dist_backend(cfg, rank.device)? == crate::dist::Backend::Ring;
        let last_step = opts
            .stop_at_step
            .map_or(t.max_steps, |s| s.min(t.max_steps));
        Ok(Trainer {
            cfg,
            pg,
            _vs: vs,
            params,
            model,
            opt,
            schedule: Schedule::from_config(t),
            step_cfg,
            loader,
            validator,
            tasks,
            guard: Guard::new(t),
            recorder,
            checkpointer,
            faults,
            stragglers,
            state,
            run_dir,
            _claim: claim,
            _claim_checkpoints: claim_checkpoints,
            data,
            last_step,
            rank,
        })
    }

    /// The loop.
    pub fn run(mut self) -> Result<Summary> {
        let mut summary = Summary {
            losses: Vec::new(),
            final_step: self.state.step,
            run_dir: self.run_dir.clone(),
            last_checkpoint: None,
            val_loss: None,
            preempted: false,
        };
        preempt::install(self.rank.lead(), &self.rank.tag);
        // A resumed run's last complete checkpoint, until this run saves one.
        let resumed = (self.state.step > 0).then_some(self.state.step);
        while self.state.step < self.last_step {
            let step = self.state.step + 1; // 1-based: the step being taken
            phase::enter(Phase::Data);
            if self.faults.exits_after_save(step) && self.checkpointer.wait_written() {
                self.faults.exit_after_save(step);
            }
            self.faults.at_step_start(step);
            let plan = StepPlan {
                lr: self.schedule.lr(self.state.step) * self.state.lr_scale,
                inject: self.faults.nan_injection(step),
                save_failed: self.checkpointer.poll(),
            };
            preempt::progress(step, self.checkpointer.last_saved_step().or(resumed));
            let batches = self.loader.micro_batches(self.state.samples_consumed);
            let out = train_step(
                &self.model,
                &mut self.opt,
                &mut *self.pg,
                &mut self.guard,
                &self.step_cfg,
                &plan,
                batches,
            )?;
            self.state.samples_consumed += self.loader.global_batch;
            if out.save_failed {
                return Err(self.checkpointer.failure());
            }
            if let Some(event) = out.event {
                self.on_guard_event(event, step, &out)?;
                continue;
            }
            self.state.step = step;
            forensics::step_done(step);
            self.state.adam_step = self.opt.steps();
            self.state.loss = out.loss;
            summary.losses.push(out.loss);
            self.recorder.add(&out.timing);

            let last = step == self.last_step || out.stop_requested;
            let val = match &self.validator {
                Some(v) if v.due(step, last) => {
                    phase::enter(Phase::Eval);
                    let started = std::time::Instant::now();
                    let val = v.run(&self.model, &self.opt, &mut *self.pg, &self.rank.mesh)?;
                    self.recorder.pause(started.elapsed());
                    val
                }
                _ => None,
            };
            let tasks = match &self.tasks {
                Some(t) if t.due(step, step == self.last_step) => {
                    phase::enter(Phase::Eval);
                    let r = t.run(&self.model, &self.opt, &mut *self.pg, &self.rank.mesh)?;
                    self.recorder
                        .pause(std::time::Duration::from_secs_f64(r.seconds));
                    Some(r)
                }
                _ => None,
            };
            summary.val_loss = val.as_ref().map(|v| v.loss).or(summary.val_loss);
            if self
                .recorder
                .due(step, last, val.is_some() || tasks.is_some())
            {
                let by_source = self.loader.tokens_by_source(self.state.samples_consumed);
                let evals = (val.as_ref(), tasks.as_ref());
                let router = self.model.take_router_log();
                let router =
                    super::recorder::router_over_ranks(router, &mut *self.pg, &self.rank.mesh)?;
                self.recorder
                    .log(&self.state, plan.lr, &out, evals, &by_source, &router)?;
            }
            if self.recorder.memory_due(step) {
                self.recorder.memory(&self.opt.state_bytes());
            }
            self.stragglers.check(step, &mut *self.pg)?;
            if self.checkpointer.due(step, last) {
                phase::enter(Phase::Checkpoint);
                let started = std::time::Instant::now();
                let paused = self
                    .checkpointer
                    .save(&self.opt, &self.state, &mut *self.pg)?;
                if paused {
                    // The step line's tokens/s is about steps, not about a synchronous save.
                    self.recorder.pause(started.elapsed());
                }
            }
            if out.stop_requested {
                // The checkpoint of this step is complete before the process exits 0.
                self.checkpointer.settle(&mut *self.pg)?;
                println!(
                    "{} Stopped by signal at step {step}: checkpoint saved; continue with --resume auto",
                    self.rank.tag
                );
                summary.preempted = true;
                break;
            }
        }
        self.finish(summary)
    }

    /// After the loop: wait for the last save and for every rank (rank 0 hosts the store),
    /// then say what was done and what to do with the result.
    fn finish(mut self, mut summary: Summary) -> Result<Summary> {
        phase::enter(Phase::Finish);
        summary.final_step = self.state.step;
        self.checkpointer.settle(&mut *self.pg)?;
        summary.last_checkpoint = self.checkpointer.last_saved().map(PathBuf::from);
        self.pg.barrier()?;
        if !self.rank.lead() {
            return Ok(summary);
        }
        let tag = &self.rank.tag;
        if summary.losses.is_empty() && self.state.step >= self.last_step {
            println!("{tag} {}", self.nothing_to_do());
        }
        println!("{tag} Peak memory: RSS {:.2} GB", gb(peak_rss_bytes()));
        preempt::finishing(crate::telemetry::tracker::FINISH_WAIT);
        self.recorder.finish(if summary.preempted {
            RunStatus::Killed
        } else {
            RunStatus::Finished
        });
        if let Some(ckpt) = &summary.last_checkpoint {
            print_next_steps(tag, ckpt, &self.data[0].prepared);
        }
        Ok(summary)
    }

    /// Why a run trained no step: the resumed checkpoint is already at (or past) the last step
    /// asked for, and what to pass to train further.
    fn nothing_to_do(&self) -> String {
        let (step, max) = (self.state.step, self.cfg.training.max_steps);
        if step > max {
            format!(
                "Nothing to do: the checkpoint is at step {step}, past training.max_steps = {max}; \
                 to train further, pass --max-steps (or training.max_steps) above {step}"
            )
        } else if step == max {
            format!(
                "Nothing to do: the checkpoint is already at step {step} = training.max_steps; to \
                 train further, pass --max-steps (or training.max_steps) above {step}"
            )
        } else {
            format!(
                "Nothing to do: --stop-at-step {} is not after the resumed step {step}; pass a \
                 step between {} and {max}",
                self.last_step,
                step + 1
            )
        }
    }

    /// A step the guard stopped: report it and keep the evidence (rank 0), then follow the
    /// policy — abort (exit code 3), skip the update, or roll back to the latest checkpoint.
    fn on_guard_event(&mut self, event: Event, step: usize, out: &StepOutcome) -> Result<()> {
        let tag = self.rank.tag.clone();
        let (loss, norm) = (out.loss, out.grad_norm);
        // Every rank sees the event at this step (it is judged on agreed values): a save in
        // flight completes first, so the evidence and a rollback see committed checkpoints.
        self.checkpointer.settle(&mut *self.pg)?;
        match event {
            Event::NonFinite => {
                // Every rank takes part: the gradients may be sharded, the experts on other
                // ranks, and so may the save.
                let (params, grads) = self.opt.evidence(&self.params, &mut *self.pg)?;
                let name = format!("nan_step_{step}");
                let evidence = TrainerState {
                    step,
                    loss,
                    ..self.state.clone()
                };
                let dir =
                    self.checkpointer
                        .save_named(&name, &self.opt, &evidence, &mut *self.pg)?;
                if let Some(dir) = dir {
                    let ev = guard::Evidence {
                        params: &params,
                        grads: &grads,
                    };
                    let mut text = guard::report_text(&tag, step, loss, norm, &ev);
                    let dump = self
                        .run_dir
                        .join("debug")
                        .join(format!("{name}.safetensors"));
                    guard::dump(&dump, &ev)?;
                    text.push_str(&format!(
                        "\nCheckpoint saved: {}\nDebug tensors saved: {}",
                        dir.display(),
                        dump.display()
                    ));
                    eprintln!("{text}");
                }
            }
            Event::Spike { z } => eprintln!("{}", self.guard.spike_warning(&tag, step, loss, z)),
        }
        self.pg.barrier()?;
        let kind = match event {
            Event::NonFinite => "nonfinite",
            Event::Spike { .. } => "spike",
        };
        self.recorder
            .guard_event(step, kind, self.state.guard_events + 1);
        let what = event.describe();
        let policy = self.guard.policy(event);
        if policy == GuardPolicy::Abort {
            return Err(NanAbort(format!(
                "{tag} {what} at step {step}; stopping (training.nan_policy / spike_policy = abort)"
            ))
            .into());
        }
        self.state.guard_events += 1;
        if self.state.guard_events > self.guard.max_events {
            return Err(NanAbort(format!(
                "{tag} {what} at step {step}: {} guard events exceed training.max_nan_skips = {}; stopping",
                self.state.guard_events, self.guard.max_events
            ))
            .into());
        }
        let rollback_to = match policy {
            GuardPolicy::Rollback => Some(self.checkpointer.latest().ok_or_else(|| {
                NanAbort(format!(
                    "{tag} {what} at step {step}: rollback needs a complete checkpoint in {} and there is none yet; set checkpoint.interval",
                    self.checkpointer.root().display()
                ))
            })?),
            _ => None,
        };
        if self.rank.lead() {
            let verb = if rollback_to.is_some() {
                "rolling back"
            } else {
                "skipping the update"
            };
            println!(
                "{tag} Guard: {what} at step {step}; {verb} ({} of {} allowed)",
                self.state.guard_events, self.guard.max_events
            );
        }
        self.opt.zero_grad();
        match rollback_to {
            Some(dir) => self.roll_back(&dir),
            None => {
                self.state.step += 1;
                Ok(())
            }
        }
    }

    /// Back to a checkpoint's weights, moments and step, with the LR scaled down by
    /// `training.rollback_lr_factor`. The data position is kept (samples_consumed goes on), so
    /// the replayed steps see new data rather than the batches that went bad.
    fn roll_back(&mut self, dir: &std::path::Path) -> Result<()> {
        let fresh = fresh_optimizer(&checkpoints::read_state(dir)?, self.cfg, dir)?;
        let saved = checkpoint::load(dir, &self.model.shape, &mut self.opt, fresh)?;
        self.state.step = saved.step;
        self.state.adam_step = self.opt.steps();
        self.state.lr_scale *= self.cfg.training.rollback_lr_factor;
        self.recorder.rewind(saved.step)?;
        println!(
            "{} Rolled back to {} (step {}); LR scale now {}",
            self.rank.tag,
            dir.display(),
            saved.step,
            self.state.lr_scale
        );
        Ok(())
    }
}

/// The data every rank maps. Local rank 0 prepares it (or finds the launcher's cache) first, so
/// ranks of one node never tokenize the same corpus at once; the others then find it cached.
fn prepare_on_node(
    cfg: &Config,
    rank: &Rank,
    pg: &mut dyn ProcessGroup,
) -> Result<Vec<DataSource>> {
    let prepared = if rank.place.local_rank == 0 {
        Some(run::data::prepare_data(cfg, &rank.tag)?)
    } else {
        None
    };
    pg.barrier()?;
    match prepared {
        Some(p) => Ok(p),
        None => run::data::prepare_quietly(cfg),
    }
}

/// Every source's training tokens, and its validation tokens where it has a split.
fn open_sources(data: &[DataSource]) -> Result<Vec<(SourceTokens, Option<SourceTokens>)>> {
    let named = |s: &DataSource, tokens: TokenFile| SourceTokens {
        name: s.name.clone(),
        weight: s.weight,
        tokens,
    };
    data.iter()
        .map(|s| {
            let val = s.prepared.val.as_deref().map(TokenFile::open).transpose()?;
            let train = TokenFile::open_prefixes(&s.prepared.train)?;
            Ok((named(s, train), val.map(|v| named(s, v))))
        })
        .collect()
}

/// `system.num_threads` for libtorch, with a warning when it exceeds the CPUs this process may
/// use. Unset (0), and without OMP_NUM_THREADS (which `lockstep run` and torchrun set for their
/// workers), a Slurm task takes SLURM_CPUS_PER_TASK (`srun --cpus-per-task`), and a CPU rank
/// the cores of this node divided among its ranks, as `lockstep run` divides them: libtorch
/// would otherwise give every rank every core.
fn set_threads(cfg: &Config, rank: &Rank) {
    let cpus = std::thread::available_parallelism().map_or(1, |c| c.get());
    let n = match cfg.system.num_threads {
        0 => match default_threads(rank, cpus, &|k| std::env::var(k).ok()) {
            Some(n) => n,
            None => return,
        },
        n => n,
    };
    if n > cpus && rank.lead() {
        println!(
            "{} Warning: system.num_threads = {n} is more than the {cpus} CPUs this process may \
             use; the extra threads only wait for each other. Set it to at most {cpus} per rank \
             on this host (0 = libtorch's default)",
            rank.tag
        );
    }
    tch::set_num_threads(n as i32);
}

/// The threads of a rank that sets none (`system.num_threads = 0`; `cpus` usable here, `var`
/// reads the environment); None: libtorch's own choice (OMP_NUM_THREADS, else every core).
fn default_threads(
    rank: &Rank,
    cpus: usize,
    var: &dyn Fn(&str) -> Option<String>,
) -> Option<usize> {
    if var("OMP_NUM_THREADS").is_some_and(|v| !v.trim().is_empty()) {
        return None;
    }
    let slurm = var("SLURM_PROCID")
        .and_then(|_| var("SLURM_CPUS_PER_TASK"))
        .and_then(|v| v.trim().parse::<usize>().ok())
        .filter(|&n| n > 0);
    match (slurm, rank.device.is_cuda(), rank.place.local_world) {
        (Some(n), _, _) => Some(n.min(cpus)),
        (None, false, local @ 2..) => Some((cpus / local).max(1)),
        _ => None,
    }
}

fn fresh_state(
    resolved: &Resolved,
    shape: &LlamaShape,
    world: usize,
    data: serde_json::Value,
) -> TrainerState {
    TrainerState {
        format: checkpoints::FORMAT_VERSION,
        step: 0,
        samples_consumed: 0,
        seed: resolved.config.system.seed,
        adam_step: 0,
        optimizer: resolved.config.training.optimizer,
        loss: f64::NAN,
        world_size: world,
        lr_scale: 1.0,
        guard_events: 0,
        model_shape: shape.clone(),
        zero_stage: resolved.config.system.zero_stage,
        config: resolved.to_json(),
        versions: checkpoints::versions(),
        data: Some(data),
    }
}

/// Loads a checkpoint into the parameters and moments and returns the state to continue from.
/// The checkpoint's seed and data (`data`, [`run::data::data_identity`]) must be this run's: either
/// changing would change the data order without a word (`data.allow_new_data_on_resume`
/// continues on new data, its order starting anew).
fn resume(
    dir: &std::path::Path,
    shape: &LlamaShape,
    opt: &mut Optimizer,
    resolved: &Resolved,
    rank: &Rank,
    data: serde_json::Value,
) -> Result<TrainerState> {
    let cfg = &resolved.config;
    let seed = cfg.system.seed;
    let started = std::time::Instant::now();
    // The data first: another tokenizer would otherwise show as another model shape.
    let saved = checkpoints::read_state(dir)?;
    anyhow::ensure!(
        saved.seed == seed,
        "{}: checkpoint was trained with system.seed = {}, config has {seed}; the data order would change. Set system.seed={}",
        dir.display(), saved.seed, saved.seed
    );
    let changed = saved
        .data
        .as_ref()
        .and_then(|then| run::data::data_difference(then, &data));
    if let Some(diff) = &changed {
        anyhow::ensure!(
            cfg.data.allow_new_data_on_resume,
            "{}: the checkpoint was trained on other data ({diff}); resuming would change what \
             the model sees next without a word. Resume with the data it was trained on (its \
             config is in {}), or set data.allow_new_data_on_resume=true to continue the model \
             on the new data, its order starting anew",
            dir.display(),
            dir.join("trainer.json").display()
        );
    }
    let fresh = fresh_optimizer(&saved, cfg, dir)?;
    checkpoint::load(dir, shape, opt, fresh)?;
    println!(
        "{} Resumed from {} at step {} ({} samples consumed; loaded in {:.2} s)",
        rank.tag,
        dir.display(),
        saved.step,
        saved.samples_consumed,
        started.elapsed().as_secs_f64()
    );
    if fresh {
        println!(
            "{} training.reset_optimizer: the weights of step {} with a fresh {} optimizer \
             (the checkpoint's state was {}'s); its step count starts at 0",
            rank.tag, saved.step, cfg.training.optimizer, saved.optimizer
        );
    }
    let samples_consumed = match &changed {
        Some(diff) => {
            println!(
                "{} New data ({diff}): data.allow_new_data_on_resume is set, so the data order \
                 starts anew at the first sample of the new data",
                rank.tag
            );
            0
        }
        None => saved.samples_consumed,
    };
    Ok(TrainerState {
        world_size: rank.place.world,
        zero_stage: cfg.system.zero_stage,
        optimizer: cfg.training.optimizer,
        adam_step: opt.steps(),
        config: resolved.to_json(),
        data: Some(data),
        samples_consumed,
        ..saved
    })
}

/// Whether a checkpoint's weights alone are to be loaded, the optimizer starting afresh
/// (`training.reset_optimizer`): its moments are another optimizer's (refused without the
/// key), or the key asks for a reset that the checkpoint's run had not made. The reset happens
/// once: the checkpoints of a run that made it (their config has the key) resume with their
/// own state, so its restarts and rollbacks stay exact.
fn fresh_optimizer(saved: &TrainerState, cfg: &Config, dir: &std::path::Path) -> Result<bool> {
    let (then, now) = (saved.optimizer, cfg.training.optimizer);
    let reset = cfg.training.reset_optimizer;
    anyhow::ensure!(
        then == now || reset,
        "{}: the checkpoint's optimizer state is {then}'s and training.optimizer = {now}; \
         resume with training.optimizer={then}, or set training.reset_optimizer=true to \
         continue its weights with a fresh {now} optimizer",
        dir.display()
    );
    let made = saved.config["training"]["reset_optimizer"].as_bool() == Some(true);
    Ok(then != now || (reset && !made))
}

/// The full resolved config, beside the run's records (and in every checkpoint's trainer.json).
fn write_config(run_dir: &std::path::Path, resolved: &Resolved) -> Result<()> {
    let path = run_dir.join("config.json");
    // Written beside and renamed over: a link at config.json is replaced, never written through.
    crate::sys::durable::write_atomic(&path, resolved.to_json_text().as_bytes())
        .with_context(|| format!("{}: cannot write; is logging.dir writable?", path.display()))
}

/// A few lines on what this run is; the full config is in the run directory (and printed here
/// with `logging.verbose`).
fn print_summary(
    resolved: &Resolved,
    rank: &Rank,
    (shape, parameters): (&LlamaShape, usize),
    compute: tch::Kind,
    run_dir: &std::path::Path,
    checkpoints: &std::path::Path,
) {
    let (cfg, tag) = (&resolved.config, &rank.tag);
    let t = &cfg.training;
    let world = rank.place.world;
    if cfg.logging.verbose {
        let json = serde_json::to_string_pretty(&resolved.to_json()).unwrap_or_default();
        println!(
            "{tag} Resolved config (preset {}):\n{json}",
            resolved.preset
        );
    }
    let device = match rank.device {
        tch::Device::Cuda(i) => format!("cuda:{i}"),
        _ => match tch::get_num_threads() {
            1 => "CPU, 1 thread".to_string(),
            n => format!("CPU, {n} threads"),
        },
    };
    let dtype = if compute == tch::Kind::BFloat16 {
        "bf16"
    } else {
        "fp32"
    };
    // With tensor or context parallelism: the mesh, and the data ranks that share out the
    // batch.
    let mesh = &rank.mesh;
    let (ranks, data) = if mesh.tensor > 1 || mesh.context > 1 {
        let mut dims = vec![format!("{} data", mesh.data())];
        if mesh.context > 1 {
            dims.push(format!("{} context-parallel", mesh.context));
        }
        if mesh.tensor > 1 {
            let sp = if cfg.system.sequence_parallel {
                "with"
            } else {
                "without"
            };
            dims.push(format!(
                "{} tensor-parallel ({sp} sequence parallelism)",
                mesh.tensor
            ));
        }
        (format!("{world} ranks = {}", dims.join(" × ")), mesh.data())
    } else {
        let s = if world == 1 { "" } else { "s" };
        (format!("{world} rank{s}"), world)
    };
    println!(
        "{tag} Run: {} (preset {}; full config in {}) | {ranks} | {device} | {dtype} compute",
        run_dir.display(),
        resolved.preset,
        run_dir.join("config.json").display(),
    );
    // A mixture of experts: what one token uses of it.
    let experts = shape.moe.as_ref().map_or(String::new(), |m| {
        let active = parameters - shape.inactive_expert_params();
        format!(
            " ({:.2}M active: {} of {} experts of width {})",
            active as f64 / 1e6,
            m.top_k,
            m.num_experts,
            m.expert_size
        )
    });
    println!(
        "{tag} Model: {} {:.2}M parameters{experts} | {} layers, d {}, {} heads of {} / {} kv heads, FFN {}, vocab {}",
        shape.family.name(),
        parameters as f64 / 1e6,
        shape.num_layers,
        shape.hidden_size,
        shape.num_heads,
        shape.head_dim(),
        shape.num_kv_heads,
        shape.intermediate_size,
        shape.vocab_size
    );
    println!(
        "{tag} Batch: {} × {} tokens × {} accumulation × {data} {}rank{} = {} tokens per step | {} steps, LR {} (warmup {}, cosine to {}) | {}",
        t.batch_size,
        t.context_length,
        t.grad_accum_nums,
        if mesh.tensor > 1 || mesh.context > 1 {
            "data "
        } else {
            ""
        },
        if data == 1 { "" } else { "s" },
        t.batch_size * t.context_length * t.grad_accum_nums * data,
        t.max_steps,
        crate::telemetry::sci(t.learning_rate),
        t.warmup_steps,
        crate::telemetry::sci(t.min_lr),
        match t.optimizer {
            crate::config::OptimizerChoice::AdamW => "AdamW".to_string(),
            crate::config::OptimizerChoice::Muon => format!(
                "Muon on the decoder layers' matrices ({}, {} Newton-Schulz steps), AdamW on the rest",
                t.muon_adjust_lr, t.muon_ns_steps
            ),
        },
    );
    let every = match cfg.checkpoint.interval {
        0 => "at the end".to_string(),
        n => format!("every {n} steps and at the end"),
    };
    println!(
        "{tag} Checkpoints: {} ({every}, keeping {})",
        checkpoints.display(),
        cfg.checkpoint.keep_last
    );
}

/// What to do with the final checkpoint: the export, eval and generate commands for it.
fn print_next_steps(tag: &str, ckpt: &std::path::Path, prepared: &crate::data::Prepared) {
    let exe = std::env::args()
        .next()
        .filter(|a| a.contains('/'))
        .unwrap_or_else(|| "lockstep".into());
    let name = ckpt
        .parent()
        .and_then(|p| p.parent())
        .and_then(|p| p.file_name())
        .map_or_else(|| "model".into(), |n| n.to_string_lossy().into_owned());
    // The held-out tokens, else the training tokens when they are one file.
    let data = match (&prepared.val, prepared.train.as_slice()) {
        (Some(val), _) => val.as_path(),
        (None, [one]) => one.path.as_path(),
        (None, _) => prepared.dir.as_path(),
    };
    // Quoted for a shell: a run name or directory with a space or `$` pastes as one word.
    let q = |s: &str| shlex::try_quote(s).map_or_else(|_| s.to_string(), |q| q.into_owned());
    let exe = q(&exe);
    let ckpt = q(&ckpt.to_string_lossy());
    let out = q(&format!("exports/{name}"));
    let data = q(&data.to_string_lossy());
    println!("{tag} Next: a Hugging Face directory, the loss on held-out data, a sample:");
    println!("{tag}   {exe} export --hf {out} --checkpoint {ckpt}");
    println!("{tag}   {exe} eval --model {ckpt} --data {data}");
    println!("{tag}   {exe} generate --model {ckpt} --prompt \"The\" --max-new-tokens 64");
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dist::Place;

    fn rank(local_world: usize, cuda: bool) -> Rank {
        Rank {
            place: Place {
                rank: 0,
                world: local_world,
                local_rank: 0,
                local_world,
            },
            mesh: crate::dist::Mesh::new(0, local_world, 1, 1, 0),
            device: if cuda {
                tch::Device::Cuda(0)
            } else {
                tch::Device::Cpu
            },
            tag: "[CPU0]".into(),
        }
    }

    /// Finding 29: each of 2 srun tasks on 2 cores ran 2 threads.
    #[test]
    fn an_unset_thread_count_shares_the_node_among_its_ranks() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| {
                pairs
                    .iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| v.to_string())
            }
        };
        let slurm = env(&[("SLURM_PROCID", "1"), ("SLURM_CPUS_PER_TASK", "3")]);
        assert_eq!(default_threads(&rank(2, false), 16, &slurm), Some(3));
        assert_eq!(default_threads(&rank(2, true), 16, &slurm), Some(3));
        assert_eq!(default_threads(&rank(4, false), 16, &env(&[])), Some(4));
        assert_eq!(default_threads(&rank(4, false), 2, &env(&[])), Some(1));
        assert_eq!(default_threads(&rank(1, false), 16, &env(&[])), None);
        assert_eq!(default_threads(&rank(8, true), 16, &env(&[])), None);
        let omp = env(&[
            ("OMP_NUM_THREADS", "2"),
            ("SLURM_PROCID", "0"),
            ("SLURM_CPUS_PER_TASK", "3"),
        ]);
        assert_eq!(default_threads(&rank(2, false), 16, &omp), None);
    }
}
