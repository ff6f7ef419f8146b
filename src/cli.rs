//! The command line: argument types and dispatch. `main.rs` only maps errors to exit codes.

use std::path::PathBuf;

use anyhow::Result;
use clap::{Args, Parser, Subcommand};

use crate::config::{self, schema, ConfigError, Resolved, Sources};
use crate::run::{self, Resume, RunOptions, WorkerSpec};
use crate::train;
use crate::{commands, launch};

#[derive(Parser, Debug)]
#[command(
    name = "lockstep",
    version = crate::sys::libtorch::LOCKSTEP_VERSION,
    about = "LLaMA pretraining on libtorch: prepare data, train, launch ranks, export, evaluate, generate"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Tokenize the corpus once into a memory-mapped token file in the cache.
    Prepare {
        #[command(flatten)]
        config: ConfigArgs,
        /// Tokenize only part I of N of the corpus (I from 0 to N-1, like RANK; `slurm` takes
        /// SLURM_PROCID/SLURM_NTASKS), one machine per part: the parts land in the same cache
        /// entry, which the last one written completes.
        #[arg(long, value_name = "I/N", allow_hyphen_values = true)]
        shard: Option<String>,
    },
    /// Train one rank (a single process, or one rank under torchrun/Slurm variables).
    Train {
        #[command(flatten)]
        config: ConfigArgs,
        #[command(flatten)]
        run: RunFlags,
        /// The config and options `lockstep run` resolved for its workers (internal).
        #[arg(long, value_name = "FILE.json", hide = true)]
        worker_spec: Option<PathBuf>,
    },
    /// Launch one `train` worker per GPU (or N CPU workers) and supervise them: prefixed logs,
    /// per-rank log files, teardown of all workers when one fails. Training flags may follow
    /// `--`, as with torchrun: `lockstep run --nproc 2 -- --preset tiny`.
    Run {
        #[command(flatten)]
        launch: launch::LaunchArgs,
        #[command(flatten)]
        config: ConfigArgs,
        #[command(flatten)]
        run: RunFlags,
        /// Training flags after `--` (the same as before it).
        #[arg(last = true, value_name = "TRAIN FLAGS")]
        train_flags: Vec<String>,
    },
    /// Write a checkpoint as a Hugging Face directory (config.json, generation_config.json,
    /// safetensors, sharded above --max-shard-mb; tokenizer files). The config flags locate
    /// the run, as for `train`.
    Export {
        #[command(flatten)]
        export: commands::export::ExportArgs,
        #[command(flatten)]
        config: ConfigArgs,
    },
    /// Mean loss and perplexity of a model directory on a text or token file, over consecutive
    /// non-overlapping windows from the start.
    Eval(commands::eval::EvalArgs),
    /// Continue a prompt with a model directory: KV-cached, greedy or temperature + top-p.
    Generate(commands::generate::GenerateArgs),
    /// What a config needs per rank before it runs: memory by buffer for each zero stage and
    /// activation checkpointing mode, FLOPs, step time, communication, scaling; whether it
    /// fits and the cheapest change that does; what a checkpoint save writes, stages in host
    /// memory and stalls. Takes `train`'s config flags.
    Plan {
        #[command(flatten)]
        plan: commands::plan::PlanArgs,
        #[command(flatten)]
        config: ConfigArgs,
    },
    /// Upload a run's metrics.jsonl into its W&B run afterwards (for nodes without internet,
    /// or a run whose tracker fell behind): the same run id and names as during training;
    /// steps W&B already has are not sent again.
    WandbSync(commands::wandb_sync::WandbSyncArgs),
    /// What a bug report needs: lockstep's version and commit, the libtorch it loaded (path,
    /// version, CUDA build), CUDA, cuDNN, NCCL and driver versions, the GPUs, the Python the
    /// W&B sidecar uses, CPUs and memory.
    Env,
    /// Print the resolved config, the table of keys, or the docs/CONFIG.md markdown.
    Config {
        #[command(flatten)]
        config: ConfigArgs,
        /// List every key with type, default and meaning.
        #[arg(long)]
        keys: bool,
        /// Print docs/CONFIG.md.
        #[arg(long, conflicts_with = "keys")]
        markdown: bool,
    },
}

/// The flags that shape the config (resolution order: preset < file < --set < named flags).
#[derive(Args, Debug, Clone, Default, PartialEq)]
pub struct ConfigArgs {
    /// Preset to start from: production (default), debug, tiny, qwen3-tiny, qwen3-0.6b,
    /// qwen3-1.7b, qwen3-4b, qwen3-8b, qwen3-moe-tiny, qwen3-30b-a3b, mixtral-8x7b.
    #[arg(long, value_name = "NAME")]
    pub preset: Option<String>,
    /// Same as --preset debug.
    #[arg(long, conflicts_with = "preset")]
    pub debug: bool,
    /// JSON file deep-merged over the preset.
    #[arg(long, value_name = "FILE.json")]
    pub config: Option<PathBuf>,
    /// Override one key, e.g. --set training.learning_rate=3e-4 (repeatable).
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    pub sets: Vec<String>,
    /// Optimizer steps (overrides training.max_steps).
    #[arg(long, value_name = "N")]
    pub max_steps: Option<usize>,
}

/// Per-invocation choices of `train` and `run` that are not part of the config.
#[derive(Args, Debug, Clone, Default, PartialEq)]
pub struct RunFlags {
    /// `auto` = the latest complete checkpoint (fresh start if none), or a checkpoint directory.
    #[arg(long, value_name = "auto|DIR")]
    pub resume: Option<Resume>,
    /// Save a checkpoint and exit 0 after step N (the LR schedule still spans max_steps).
    #[arg(long, value_name = "N")]
    pub stop_at_step: Option<usize>,
}

impl RunFlags {
    fn options(&self) -> RunOptions {
        RunOptions {
            resume: self.resume.clone(),
            stop_at_step: self.stop_at_step,
        }
    }
}

/// `lockstep run`'s training flags after `--`.
#[derive(Parser, Debug)]
#[command(no_binary_name = true)]
struct TrainFlags {
    #[command(flatten)]
    config: ConfigArgs,
    #[command(flatten)]
    run: RunFlags,
}

impl ConfigArgs {
    pub fn resolve(&self) -> Result<Resolved, ConfigError> {
        config::resolve(&Sources {
            preset: if self.debug {
                Some("debug".into())
            } else {
                self.preset.clone()
            },
            config_file: self.config.clone(),
            sets: self.sets.clone(),
            max_steps: self.max_steps,
        })
    }

    fn is_empty(&self) -> bool {
        *self == ConfigArgs::default()
    }
}

pub fn run(cli: Cli) -> Result<()> {
    // `env` reports a wrong libtorch instead of stopping at it. A wrong one is a setup error
    // (exit 2), as the pip launcher's own check is.
    if !matches!(cli.command, Command::Env) {
        crate::sys::libtorch::check().map_err(|e| ConfigError(format!("{e:#}")))?;
    }
    // The commands that only print end quietly when their reader goes (`lockstep config
    // --keys | head`), as a shell tool does. Training keeps Rust's default (a write to a closed
    // pipe is an error, not a signal), so a W&B sidecar that dies cannot kill a run.
    if matches!(
        cli.command,
        Command::Config { .. }
            | Command::Plan { .. }
            | Command::Env
            | Command::Eval(_)
            | Command::Generate(_)
    ) {
        crate::sys::die_on_closed_pipe();
    }
    match cli.command {
        Command::Prepare { config, shard } => {
            let resolved = config.resolve()?;
            match shard {
                Some(shard) => {
                    let shard = crate::data::prepare::Shard::parse(&shard)?;
                    run::data::prepare_parts(&resolved.config, "[CPU0]", shard)?;
                }
                None => {
                    run::data::prepare_data(&resolved.config, "[CPU0]")?;
                }
            }
            Ok(())
        }
        Command::Train {
            config,
            run,
            worker_spec: Some(spec),
        } => {
            if !config.is_empty() || run != RunFlags::default() {
                return Err(ConfigError(
                    "--worker-spec carries the whole config and options; give no other flags"
                        .into(),
                )
                .into());
            }
            let (resolved, opts) = WorkerSpec::read(&spec)?;
            train::train_rank(&resolved, &opts)?;
            Ok(())
        }
        Command::Train { config, run, .. } => {
            train::train_rank(&config.resolve()?, &run.options())?;
            Ok(())
        }
        Command::Run {
            launch,
            config,
            run,
            train_flags,
        } => {
            let (config, run) = with_trailing(config, run, &train_flags)?;
            let code = launch::run(&launch, &config.resolve()?, &run.options())?;
            std::process::exit(code);
        }
        Command::Export { export, config } => {
            let resolved = config.resolve()?;
            commands::export::run(&resolved, &export)
        }
        Command::Eval(args) => commands::eval::run(&args),
        Command::Generate(args) => commands::generate::run(&args),
        Command::Plan { plan, config } => commands::plan::run(&config.resolve()?, &plan),
        Command::WandbSync(args) => commands::wandb_sync::run(&args),
        Command::Env => commands::env::run(),
        Command::Config {
            config,
            keys,
            markdown,
        } => {
            if markdown {
                print!("{}", schema::markdown_table());
            } else if keys {
                for k in schema::KEYS {
                    println!(
                        "{:<34} {:<28} default {:<22} {}",
                        k.key,
                        k.kind.describe(),
                        k.default,
                        k.doc
                    );
                }
            } else {
                println!(
                    "{}",
                    serde_json::to_string_pretty(&config.resolve()?.to_json())?
                );
            }
            Ok(())
        }
    }
}

/// `lockstep run [launcher flags] -- [training flags]`: the flags after `--` join those before
/// it; a flag given on both sides with different values is an error rather than a silent pick.
fn with_trailing(
    mut config: ConfigArgs,
    mut run: RunFlags,
    trailing: &[String],
) -> Result<(ConfigArgs, RunFlags), ConfigError> {
    if trailing.is_empty() {
        return Ok((config, run));
    }
    let after = TrainFlags::try_parse_from(trailing).map_err(|e| {
        let first = e.to_string();
        let first = first.lines().next().unwrap_or_default().trim_start_matches("error: ");
        ConfigError(format!(
            "lockstep run -- {}: {first}; after `--` come `lockstep train`'s flags (--preset, --config, --set, --max-steps, --resume, --stop-at-step)",
            trailing.join(" ")
        ))
    })?;
    fn merge<T: PartialEq + std::fmt::Debug>(
        flag: &str,
        before: &mut Option<T>,
        after: Option<T>,
    ) -> Result<(), ConfigError> {
        match (before.as_ref(), after) {
            (Some(b), Some(a)) if *b != a => Err(ConfigError(format!(
                "{flag} is given before and after `--` with different values ({b:?} and {a:?}); give it once"
            ))),
            (_, Some(a)) => {
                *before = Some(a);
                Ok(())
            }
            (_, None) => Ok(()),
        }
    }
    let a = after.config;
    if config.debug && a.preset.is_some() || a.debug && config.preset.is_some() {
        return Err(ConfigError(
            "--debug and --preset are both given (one before `--`, one after); give one".into(),
        ));
    }
    config.debug |= a.debug;
    merge("--preset", &mut config.preset, a.preset)?;
    merge("--config", &mut config.config, a.config)?;
    merge("--max-steps", &mut config.max_steps, a.max_steps)?;
    config.sets.extend(a.sets);
    merge("--resume", &mut run.resume, after.run.resume)?;
    merge(
        "--stop-at-step",
        &mut run.stop_at_step,
        after.run.stop_at_step,
    )?;
    Ok((config, run))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run_args(argv: &[&str]) -> (ConfigArgs, RunFlags, Vec<String>) {
        let cli = Cli::try_parse_from(["lockstep", "run"].iter().chain(argv)).unwrap();
        match cli.command {
            Command::Run {
                config,
                run,
                train_flags,
                ..
            } => (config, run, train_flags),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn training_flags_may_follow_a_double_dash() {
        let (config, run, trailing) = run_args(&[
            "--nproc",
            "2",
            "--set",
            "training.batch_size=2",
            "--",
            "--preset",
            "tiny",
            "--set",
            "training.max_steps=3",
            "--resume",
            "auto",
        ]);
        let (config, run) = with_trailing(config, run, &trailing).unwrap();
        assert_eq!(config.preset.as_deref(), Some("tiny"));
        assert_eq!(
            config.sets,
            ["training.batch_size=2", "training.max_steps=3"],
            "--set from both sides, before first"
        );
        assert_eq!(run.resume, Some(Resume::Auto));
        let resolved = config.resolve().unwrap();
        assert_eq!(resolved.config.training.max_steps, 3);
    }

    #[test]
    fn conflicting_or_unknown_flags_after_the_dash_are_named() {
        let (config, run, trailing) = run_args(&["--preset", "debug", "--", "--preset", "tiny"]);
        let e = with_trailing(config, run, &trailing).unwrap_err().0;
        assert!(e.contains("--preset is given before and after `--`"), "{e}");
        let (config, run, trailing) = run_args(&["--", "--nproc", "2"]);
        let e = with_trailing(config, run, &trailing).unwrap_err().0;
        assert!(
            e.contains("lockstep run -- --nproc 2: unexpected argument"),
            "{e}"
        );
    }
}
