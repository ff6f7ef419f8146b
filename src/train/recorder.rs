//! What a run tells the world about its steps: the console step line (and, with
//! `logging.verbose`, the per-phase timing line), `metrics.jsonl`, TensorBoard event files, the
//! experiment trackers (W&B, MLflow), and the memory line. Rank 0 writes the records; every rank
//! watches its own memory. TensorBoard and the trackers show the same named series
//! (`MetricsRecord::series`) of each metrics.jsonl record, whose schema telemetry owns
//! (`telemetry::record`); the trackers themselves are built there too (`telemetry::trackers`).

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::Result;
use serde_json::json;
use tch::Device;

use super::eval::Validation;
use super::optim::StateBytes;
use super::place::Rank;
use super::step::{StepOutcome, StepTiming};
use super::tasks::TaskResults;
use crate::config::Resolved;
use crate::dist::{Mesh, ProcessGroup};
use crate::model::RouterLog;
use crate::run::checkpoints::TrainerState;
use crate::sys::machine::{gb, peak_rss_bytes, rss_bytes};
use crate::telemetry::record::TaskMetrics;
use crate::telemetry::tensorboard::EventWriter;
use crate::telemetry::tracker::{self, Record, RunStatus, Tracker};
use crate::telemetry::{self, Earlier, Metrics, MetricsRecord, StepLine};

/// Rank 0's records: metrics.jsonl, with `logging.tensorboard` event files, and the trackers
/// that are on.
struct Records {
    metrics: Metrics,
    tensorboard: Option<EventWriter>,
    trackers: Vec<Tracker>,
    /// Guard events since the last record: (step, kind, events so far). The next record
    /// carries them (`"guard": {kind: count}`), so that the step trained again after a skip or
    /// a rollback is not shadowed by an event of its own at the same step.
    guard: Vec<(usize, String, usize)>,
    /// The last step handed to the trackers in this process.
    tracked: Option<usize>,
    /// Guard values of records not handed over (steps trained again), for the next one.
    carried: Vec<(String, f64)>,
}

/// Step timings summed since the last logged step, for Tok/s, the ETA and the timing line.
struct Window {
    start: Instant,
    /// Time in the window that was not training (validation, a synchronous save).
    paused: Duration,
    steps: usize,
    timing: StepTiming,
}

impl Window {
    fn new() -> Window {
        Window {
            start: Instant::now(),
            paused: Duration::ZERO,
            steps: 0,
            timing: StepTiming::default(),
        }
    }

    /// Seconds of training in the window.
    fn training_s(&self) -> f64 {
        self.start
            .elapsed()
            .saturating_sub(self.paused)
            .as_secs_f64()
    }
}

/// What a run is, for the trackers' run config beside the resolved config: the model's size
/// and the data (each source's name, weight, tokenizer and token counts).
pub struct About<'a> {
    /// The model's parameters (its table's count).
    pub parameters: usize,
    pub data: Option<&'a serde_json::Value>,
}

impl About<'_> {
    /// The trackers' `lockstep` config entry (and MLflow's `lockstep.*` tags).
    fn describe(
        &self,
        resolved: &Resolved,
        rank: &Rank,
        run_dir: &Path,
        tokens_per_step: usize,
    ) -> serde_json::Value {
        json!({
            "version": env!("CARGO_PKG_VERSION"),
            "world_size": rank.place.world,
            "preset": resolved.preset,
            "parameters": self.parameters,
            "tokens_per_step": tokens_per_step,
            "device": format!("{:?}", rank.device),
            "data": self.data,
            "run_dir": std::path::absolute(run_dir).unwrap_or_else(|_| run_dir.to_path_buf()),
        })
    }
}

pub struct Recorder {
    tag: String,
    device: Device,
    /// `logging.interval`: a step line every N steps (and at the last one).
    interval: usize,
    /// `logging.memory_interval`; 0 = only the peak at the end.
    memory_interval: usize,
    /// `system.max_memory_gb`: warn above it (0 = never).
    memory_limit_gb: f64,
    verbose: bool,
    /// Ranks of the run.
    world: usize,
    max_steps: usize,
    /// Tokens of one optimizer step over all ranks.
    tokens_per_step: f64,
    /// (training FLOPs per token, summed dense peak of all ranks' devices): MFU is shown only
    /// where the device's peak is known (CUDA, a GPU NVML names).
    mfu_basis: Option<(f64, f64)>,
    /// `system.expert_parallel`: E (1 without expert parallelism), for the busiest
    /// expert-parallel rank's load.
    expert_parallel: usize,
    /// None on ranks other than 0.
    records: Option<Records>,
    window: Window,
}

impl Recorder {
    /// Opens rank 0's records in `run_dir`: a resumed run continues them from `resumed_at`
    /// (metrics.jsonl loses the records after it; TensorBoard marks a session start there,
    /// which hides the later points), a fresh start begins a new metrics.jsonl.
    pub fn new(
        resolved: &Resolved,
        rank: &Rank,
        run_dir: &Path,
        about: &About,
        mfu_basis: Option<(f64, f64)>,
        resumed_at: usize,
    ) -> Result<Recorder> {
        let cfg = &resolved.config;
        let t = &cfg.training;
        // Tokens per step: the data ranks' (a tensor-parallel group shares its micro-batches).
        let tokens_per_step =
            t.batch_size * t.grad_accum_nums * rank.mesh.data() * t.context_length;
        let records = if rank.lead() {
            let tensorboard = if cfg.logging.tensorboard {
                let tb_dir = run_dir.join("tensorboard");
                if resumed_at == 0 {
                    if let Some(aside) = EventWriter::set_aside(&tb_dir)? {
                        println!(
                            "{} TensorBoard: a fresh start; the earlier run's events are kept \
                             in {}",
                            rank.tag,
                            aside.display()
                        );
                    }
                }
                let mut tb = EventWriter::create(&tb_dir)?;
                if resumed_at > 0 {
                    tb.session_start(resumed_at as i64 + 1)?;
                }
                Some(tb)
            } else {
                None
            };
            let (metrics, earlier) = Metrics::open(&run_dir.join("metrics.jsonl"), resumed_at)?;
            match earlier {
                Earlier::Truncated { dropped } if dropped > 0 => println!(
                    "{} metrics.jsonl: removed {dropped} records after step {resumed_at} (steps \
                     trained after the checkpoint, trained again now)",
                    rank.tag
                ),
                Earlier::MovedTo(old) => println!(
                    "{} metrics.jsonl: a fresh start; the earlier record is kept as {}",
                    rank.tag,
                    old.display()
                ),
                _ => {}
            }
            let trackers = telemetry::trackers::start(
                resolved,
                &rank.tag,
                run_dir,
                about.describe(resolved, rank, run_dir, tokens_per_step),
                resumed_at > 0,
            );
            Some(Records {
                metrics,
                tensorboard,
                trackers,
                guard: Vec::new(),
                tracked: None,
                carried: Vec::new(),
            })
        } else {
            None
        };
        let world = rank.place.world;
        Ok(Recorder {
            tag: rank.tag.clone(),
            device: rank.device,
            interval: cfg.logging.interval,
            memory_interval: cfg.logging.memory_interval,
            memory_limit_gb: cfg.system.max_memory_gb,
            verbose: cfg.logging.verbose,
            world,
            max_steps: t.max_steps,
            tokens_per_step: tokens_per_step as f64,
            mfu_basis: mfu_basis.map(|(flops, peak)| (flops, peak * world as f64)),
            expert_parallel: cfg.system.expert_parallel.max(1),
            records,
            window: Window::new(),
        })
    }

    /// Adds a finished step's phase times to the window.
    pub fn add(&mut self, timing: &StepTiming) {
        self.window.steps += 1;
        self.window.timing.add(timing);
    }

    /// Whether step `step` gets a step line: every `logging.interval` steps, at the last step,
    /// and whenever a validation loss or downstream scores are to be shown (`evaluated`).
    pub fn due(&self, step: usize, last: bool, evaluated: bool) -> bool {
        step.is_multiple_of(self.interval) || last || evaluated
    }

    /// Prints the step line (and validation, downstream scores, timing, a mixture's tokens per
    /// source), appends the metrics record and the TensorBoard points, and starts a new timing
    /// window. `evals` are this step's validation and downstream evaluation, where they ran;
    /// `by_source` holds the tokens each source has supplied so far (empty without
    /// `data.sources`).
    pub fn log(
        &mut self,
        state: &TrainerState,
        lr: f64,
        out: &StepOutcome,
        (val, tasks): (Option<&Validation>, Option<&TaskResults>),
        by_source: &[(String, u64)],
        router: &RouterLog,
    ) -> Result<()> {
        let w = &self.window;
        let n = w.steps.max(1) as f64;
        let step_time = w.training_s() / n;
        let tok_s = self.tokens_per_step / step_time.max(1e-9);
        let mfu = self
            .mfu_basis
            .map(|(flops_per_token, peak)| tok_s * flops_per_token / peak);
        let tag = &self.tag;
        if let Some(records) = self.records.as_mut() {
            let line = StepLine {
                tag,
                step: state.step,
                max_steps: self.max_steps,
                loss: state.loss,
                lr,
                grad_norm: out.grad_norm,
                tokens_per_s: tok_s,
                eta_s: step_time * self.max_steps.saturating_sub(state.step) as f64,
                mfu,
                aux_loss: (router.micro_batches > 0).then(|| router.aux()),
            };
            println!("{line}");
            if router.micro_batches > 0 {
                println!("{tag} {}", expert_line(router, self.expert_parallel));
            }
            if let Some(v) = val {
                // A mixture's sources each have their own held-out loss.
                let per_source: String = match v.by_source.as_slice() {
                    [] | [_] => String::new(),
                    all => all
                        .iter()
                        .map(|(name, l)| format!(" | {name} {l:.4}"))
                        .collect(),
                };
                println!(
                    "{tag} Validation | Step [{}/{}] | Val Loss: {:.4} | Val PPL: {:.2}{per_source} | {:.2} s",
                    state.step,
                    self.max_steps,
                    v.loss,
                    v.loss.exp(),
                    v.seconds
                );
            }
            if let Some(r) = tasks {
                println!(
                    "{tag} Downstream | Step [{}/{}] | {}",
                    state.step,
                    self.max_steps,
                    downstream_line(r)
                );
            }
            if self.verbose {
                let t = &w.timing;
                // One rank reduces nothing: its share is the global norm alone.
                let reduce = if self.world > 1 {
                    "all-reduce + norm"
                } else {
                    "grad norm"
                };
                println!(
                    "{tag} Timing per step: data {:.1} ms | forward+backward {:.1} ms | {reduce} {:.1} ms | optimizer {:.1} ms{}",
                    1e3 * t.data_s / n, 1e3 * t.compute_s / n, 1e3 * t.comm_s / n, 1e3 * t.optimizer_s / n,
                    // The ring counts what it sends (a sharded optimizer's all-gather is in the
                    // optimizer's time); NCCL does not report it.
                    t.sent_bytes
                        .filter(|&b| b > 0)
                        .map_or(String::new(), |b| format!(" | sent {:.1} MB", b as f64 / n / 1e6))
                );
                if !by_source.is_empty() {
                    println!("{tag} {}", source_line(by_source));
                }
            }
            let gpu_used_gb = match self.device {
                Device::Cuda(i) => crate::sys::machine::visible_gpu(i).map(|g| gb(g.memory_used)),
                _ => None,
            };
            let point = Point {
                gpu_used_gb,
                lr,
                grad_norm: out.grad_norm,
                tokens_per_s: tok_s,
                mfu,
                val,
                tasks,
                by_source,
                router,
                expert_parallel: self.expert_parallel,
            };
            records.write(state, &point)?;
        }
        self.restart_window();
        Ok(())
    }

    /// Starts a new timing window, after a log line.
    fn restart_window(&mut self) {
        self.window = Window::new();
    }

    /// Time that was not training (validation, a synchronous save): Tok/s, MFU and the ETA
    /// leave it out.
    pub fn pause(&mut self, d: Duration) {
        self.window.paused += d;
    }

    /// After a rollback to `step`: the steps trained again replace the later records in
    /// metrics.jsonl and TensorBoard (a session start hides the later points). The trackers keep
    /// what they have (their steps only go forward) and get the steps after it.
    pub fn rewind(&mut self, step: usize) -> Result<()> {
        let Some(records) = self.records.as_mut() else {
            return Ok(());
        };
        let dropped = records.metrics.rewind(step)?;
        if dropped > 0 {
            println!(
                "{} metrics.jsonl: removed {dropped} records after step {step} (trained again \
                 after the rollback)",
                self.tag
            );
        }
        if let Some(tb) = records.tensorboard.as_mut() {
            tb.session_start(step as i64 + 1)?;
        }
        Ok(())
    }

    /// A guard event at `step` (`kind`: nonfinite or spike; `events` counts them so far): the
    /// next record carries it, or, when the run ends first (an abort), a record of its own.
    pub fn guard_event(&mut self, step: usize, kind: &str, events: usize) {
        if let Some(records) = self.records.as_mut() {
            records.guard.push((step, kind.to_string(), events));
        }
    }

    /// Ends the trackers' runs with `status`, waiting a bounded time for what they still hold.
    pub fn finish(&mut self, status: RunStatus) {
        if let Some(records) = self.records.as_mut() {
            records.flush_guard();
            // One wait for all the trackers together.
            let deadline = Instant::now() + tracker::FINISH_WAIT;
            for t in records.trackers.drain(..) {
                t.finish(status, deadline.saturating_duration_since(Instant::now()));
            }
        }
    }

    /// Whether `step` prints the memory line (every `logging.memory_interval` steps).
    pub fn memory_due(&self, step: usize) -> bool {
        self.memory_interval > 0 && step.is_multiple_of(self.memory_interval)
    }

    /// The memory line (RSS, its peak, this rank's training state by kind, and NVML's view of
    /// a CUDA rank's GPU); a warning on any rank above `system.max_memory_gb`.
    pub fn memory(&self, state: &StateBytes) {
        let tag = &self.tag;
        let rss = gb(rss_bytes());
        // What the caching allocator reserved plus the CUDA context (libtorch's allocator
        // statistics are not reachable through tch).
        let gpu = match self.device {
            Device::Cuda(i) => crate::sys::machine::visible_gpu(i)
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
            "{tag} Memory | RSS {rss:.2} GB | peak {:.2} GB | state: params {:.3} GB, master {:.3} GB, moments {:.3} GB, grads {:.3} GB{gpu}",
            gb(peak_rss_bytes()),
            gb(state.params),
            gb(state.master),
            gb(state.moments),
            gb(state.grads),
        );
        let limit = self.memory_limit_gb;
        if limit > 0.0 && rss > limit {
            eprintln!(
                "{tag} WARNING: resident memory {rss:.2} GB exceeds system.max_memory_gb = {limit}"
            );
        }
    }
}

/// `router` with each MoE layer's expert counts summed over every rank of `pg` (the world),
/// each token counted once: a tensor-parallel group routes the same tokens, so only its first
/// rank adds them; context-parallel ranks route their own chunks. The auxiliary losses stay
/// this rank's. A collective: every rank logs at the same steps. Nothing is sent for a dense
/// model or on one rank.
pub fn router_over_ranks(
    mut router: RouterLog,
    pg: &mut dyn ProcessGroup,
    mesh: &Mesh,
) -> Result<RouterLog> {
    if pg.world_size() == 1 || router.counts.is_empty() {
        return Ok(router);
    }
    let counts_here = mesh.tensor_rank() == 0;
    let mut flat: Vec<u64> = router
        .counts
        .iter()
        .flat_map(|(_, c)| c.iter().map(|&n| if counts_here { n as u64 } else { 0 }))
        .collect();
    pg.all_reduce_sum_u64(&mut flat)?;
    let mut summed = flat.into_iter();
    for n in router.counts.iter_mut().flat_map(|(_, c)| c.iter_mut()) {
        *n = summed.next().expect("one sum per count") as i64;
    }
    Ok(router)
}

/// The experts' load since the previous line: each MoE layer's busiest expert over the mean
/// (1.00 = even), the worst layer named; with expert parallelism (`ep` > 1) the busiest
/// rank's share of a layer's tokens, the worst layer's, against the even 1/ep.
fn expert_line(router: &RouterLog, ep: usize) -> String {
    let layers = router.imbalance();
    let mean = layers.iter().map(|l| l.1).sum::<f64>() / layers.len().max(1) as f64;
    let worst = layers.iter().max_by(|a, b| a.1.total_cmp(&b.1));
    let worst = worst.map_or(String::new(), |(layer, r, expert)| {
        format!(" | worst: layer {layer} {r:.2} (expert {expert})")
    });
    let z = if router.z_sum != 0.0 {
        format!(" | z-loss {:.4}", router.z())
    } else {
        String::new()
    };
    let ranks = router.rank_imbalance(ep);
    let ranks = match ranks.iter().max_by(|a, b| a.1.total_cmp(&b.1)) {
        Some((layer, r, at)) if ep > 1 => format!(
            " | busiest EP rank: {:.1}% of layer {layer}'s tokens (position {at} of {ep}; even \
             {:.1}%)",
            100.0 * r / ep as f64,
            100.0 / ep as f64
        ),
        _ => String::new(),
    };
    format!(
        "Experts | busiest over mean load: {mean:.2} over {} MoE layers{worst}{ranks} | aux \
         {:.4}{z} | {} micro-batches",
        layers.len(),
        router.aux(),
        router.micro_batches
    )
}

/// `Data: web 1.23M tokens (50.1%) | code 615.2k tokens (24.9%) | …`: what each source of a
/// mixture has supplied so far.
fn source_line(by_source: &[(String, u64)]) -> String {
    let total: u64 = by_source.iter().map(|(_, n)| n).sum();
    let parts: Vec<String> = by_source
        .iter()
        .map(|(name, n)| {
            format!(
                "{name} {} tokens ({:.1}%)",
                crate::sys::count(*n),
                100.0 * *n as f64 / total.max(1) as f64
            )
        })
        .collect();
    format!("Data: {}", parts.join(" | "))
}

/// `hellaswag acc 0.2500 ± 0.0433, acc_norm 0.2700 ± 0.0446 (n 100) | … | 3.21 s`: each
/// task's scores (lm-eval's standard errors; none for a single item) and the time.
fn downstream_line(r: &TaskResults) -> String {
    let parts: Vec<String> = r
        .scores
        .iter()
        .map(|s| format!("{} {}", s.task, s.summary()))
        .collect();
    format!("{} | {:.2} s", parts.join(" | "), r.seconds)
}

/// What a logged step records beside the trainer's state.
struct Point<'a> {
    /// What NVML says the GPU has in use (CUDA ranks).
    gpu_used_gb: Option<f64>,
    lr: f64,
    grad_norm: f64,
    tokens_per_s: f64,
    mfu: Option<f64>,
    val: Option<&'a Validation>,
    tasks: Option<&'a TaskResults>,
    /// Tokens per source so far (a mixture only).
    by_source: &'a [(String, u64)],
    /// A mixture of experts' router figures since the previous record: the load every
    /// rank's ([`router_over_ranks`]), the auxiliary losses rank 0's.
    router: &'a RouterLog,
    /// `system.expert_parallel`.
    expert_parallel: usize,
}

impl Drop for Recorder {
    /// An error ends the run: the guard event that caused it (an abort) still reaches the
    /// trackers, before they end their runs as failed.
    fn drop(&mut self) {
        if let Some(records) = self.records.as_mut() {
            records.flush_guard();
        }
    }
}

impl Records {
    /// Guard events no record carried, each as a record of its own.
    fn flush_guard(&mut self) {
        for (step, kind, events) in std::mem::take(&mut self.guard) {
            let record = MetricsRecord {
                step: step as u64,
                guard_events: Some(events as u64),
                guard: [(kind, 1)].into_iter().collect(),
                ..MetricsRecord::default()
            };
            self.track(step, record.series());
        }
    }

    fn write(&mut self, state: &TrainerState, p: &Point) -> Result<()> {
        let Point {
            gpu_used_gb,
            lr,
            grad_norm: norm,
            tokens_per_s: tok_s,
            mfu,
            val,
            tasks,
            by_source,
            router,
            expert_parallel,
        } = *p;
        let routed = router.micro_batches > 0;
        let mut guard = indexmap::IndexMap::new();
        for (_, kind, _) in self.guard.drain(..) {
            *guard.entry(kind).or_insert(0) += 1;
        }
        let record = MetricsRecord {
            step: state.step as u64,
            loss: Some(state.loss),
            lr: Some(lr),
            grad_norm: Some(norm),
            tokens_per_s: Some(tok_s),
            samples_consumed: Some(state.samples_consumed),
            val_loss: val.map(|v| v.loss),
            rss_gb: Some(gb(rss_bytes())),
            guard_events: Some(state.guard_events as u64),
            mfu,
            val_time_s: val.map(|v| v.seconds),
            gpu_used_gb,
            guard,
            // A mixture's records also hold each source's tokens so far and validation loss.
            tokens_by_source: by_source.iter().cloned().collect(),
            val_loss_by_source: val
                .filter(|_| !by_source.is_empty())
                .map(|v| {
                    v.by_source
                        .iter()
                        .map(|(n, l)| (n.clone(), Some(*l)))
                        .collect()
                })
                .unwrap_or_default(),
            eval: tasks
                .map(|r| {
                    r.scores
                        .iter()
                        .map(|s| {
                            let m = TaskMetrics {
                                acc: s.acc,
                                acc_norm: s.acc_norm,
                                acc_stderr: s.acc_stderr,
                                acc_norm_stderr: s.acc_norm_stderr,
                                n: s.n as u64,
                            };
                            (s.task.clone(), m)
                        })
                        .collect()
                })
                .unwrap_or_default(),
            eval_time_s: tasks.map(|r| r.seconds),
            aux_loss: routed.then(|| router.aux()),
            z_loss: (routed && router.z_sum != 0.0).then(|| router.z()),
            expert_load: router
                .counts
                .iter()
                .map(|(layer, c)| (layer.to_string(), c.iter().map(|&n| n as u64).collect()))
                .collect(),
            expert_rank_load: match expert_parallel {
                1 => Default::default(),
                ep => router
                    .rank_load(ep)
                    .iter()
                    .map(|(layer, c)| (layer.to_string(), c.iter().map(|&n| n as u64).collect()))
                    .collect(),
            },
        };
        self.metrics.record(&record)?;
        let series = record.series();
        let s = state.step as i64;
        if let Some(tb) = self.tensorboard.as_mut() {
            for (name, v) in &series {
                tb.scalar(name, s, *v)?;
            }
            tb.flush()?;
        }
        self.track(state.step, series);
        Ok(())
    }

    /// Hands a record to every tracker (never blocks). A step at or before one already handed
    /// over (trained again after a rollback) is not: the trackers keep their first pass; its
    /// guard values go with the next new step.
    fn track(&mut self, step: usize, mut values: Vec<(String, f64)>) {
        if self.trackers.is_empty() {
            return;
        }
        if self.tracked.is_some_and(|last| step <= last) {
            self.carried
                .extend(values.into_iter().filter(|(n, _)| n.starts_with("guard/")));
            return;
        }
        for (name, v) in self.carried.drain(..) {
            match values.iter_mut().find(|(n, _)| *n == name) {
                Some(slot) => slot.1 = slot.1.max(v),
                None => values.push((name, v)),
            }
        }
        self.tracked = Some(step);
        for t in &self.trackers {
            t.send(Record {
                step: step as u64,
                values: values.clone(),
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn source_line_shows_counts_and_shares() {
        let line = source_line(&[
            ("web".into(), 1_230_000),
            ("code".into(), 615_200),
            ("math".into(), 950),
        ]);
        assert_eq!(
            line,
            "Data: web 1.23M tokens (66.6%) | code 615.2k tokens (33.3%) | math 950 tokens (0.1%)"
        );
        assert_eq!(crate::sys::count(7_890_000_000), "7.89B");
    }

    /// 8 experts on EP 4 (positions hold experts 0-1, 2-3, 4-5, 6-7): the busiest position's
    /// share of each layer's slots, the worst layer named.
    #[test]
    fn the_expert_line_names_the_busiest_expert_and_expert_parallel_rank() {
        let router = RouterLog {
            micro_batches: 2,
            aux_sum: 2.5,
            z_sum: 0.0,
            counts: vec![
                (0, vec![10, 10, 10, 10, 10, 10, 10, 10]),
                (1, vec![30, 20, 0, 0, 10, 10, 5, 5]),
            ],
        };
        assert_eq!(
            router.rank_load(4),
            vec![(0, vec![20, 20, 20, 20]), (1, vec![50, 0, 20, 10])]
        );
        assert_eq!(router.rank_imbalance(4), vec![(0, 1.0, 3), (1, 2.5, 0)]);
        assert_eq!(
            expert_line(&router, 4),
            "Experts | busiest over mean load: 2.00 over 2 MoE layers | worst: layer 1 3.00 \
             (expert 0) | busiest EP rank: 62.5% of layer 1's tokens (position 0 of 4; even \
             25.0%) | aux 1.2500 | 2 micro-batches"
        );
        assert!(!expert_line(&router, 1).contains("EP rank"));
    }
}
