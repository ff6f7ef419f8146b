//! The command line: argument types and dispatch. `main.rs` only maps errors to exit codes.

use std::path::PathBuf;

use anyhow::Result;
use clap::{Args, Parser, Subcommand};

use crate::config::{self, schema, Resolved, Sources};
use crate::train::{self, Resume, RunOptions, Topology};

#[derive(Parser, Debug)]
#[command(
    name = "lockstep",
    version,
    about = "LLaMA pretraining on libtorch: prepare data, train, launch ranks"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Tokenize the corpus once into a memory-mapped token file in the cache.
    Prepare(ConfigArgs),
    /// Train one rank (a single process, or one rank under torchrun/Slurm variables).
    Train {
        #[command(flatten)]
        config: ConfigArgs,
        /// `auto` = the latest complete checkpoint (fresh start if none), or a checkpoint directory.
        #[arg(long, value_name = "auto|DIR")]
        resume: Option<Resume>,
        /// Save a checkpoint and exit 0 after step N (the LR schedule still spans max_steps).
        #[arg(long, value_name = "N")]
        stop_at_step: Option<usize>,
    },
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

#[derive(Args, Debug, Clone, Default)]
pub struct ConfigArgs {
    /// Preset to start from: production (default), debug, tiny.
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

impl ConfigArgs {
    pub fn resolve(&self) -> Result<Resolved, config::ConfigError> {
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
}

pub fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Prepare(args) => {
            let resolved = args.resolve()?;
            train::trainer::prepare_data(&resolved.config, "[CPU0]")?;
            Ok(())
        }
        Command::Train {
            config,
            resume,
            stop_at_step,
        } => {
            let resolved = config.resolve()?;
            let opts = RunOptions {
                resume,
                stop_at_step,
            };
            train::train(&resolved, &opts, Topology { rank: 0, world: 1 })?;
            Ok(())
        }
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
