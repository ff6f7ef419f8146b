//! The training data of one rank: the memory-mapped token files every rank shares (one per
//! source of a `data.sources` mixture), the seeded schedule that says which source and window
//! each global sample is, and this rank's share of each step's samples.

use anyhow::{bail, Context};
use tch::{Device, Tensor};

use super::place::Rank;
use crate::config::Config;
use crate::data::mixture::{source_seed, Mixture};
use crate::data::sampler::{rank_indices, Sampler};
use crate::data::tokfile::TokenFile;
use crate::model::DocumentMask;

/// One micro-batch as the model takes it.
pub struct Batch {
    /// Token ids [batch, context] int64 on the model's device.
    pub inputs: Tensor,
    /// The next token of each input [batch, context].
    pub targets: Tensor,
    /// The documents packed into each row, with `data.document_masking` or
    /// `data.reset_position_ids`; None = plain causal rows.
    pub documents: Option<DocumentMask>,
}

impl Batch {
    /// Plain causal rows.
    pub fn new(inputs: Tensor, targets: Tensor) -> Batch {
        Batch {
            inputs,
            targets,
            documents: None,
        }
    }
}

/// How packed documents are treated (`data.document_masking`, `data.reset_position_ids`).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Packing {
    pub masking: bool,
    pub reset_positions: bool,
}

impl Packing {
    pub fn from_config(cfg: &Config) -> Packing {
        Packing {
            masking: cfg.data.document_masking,
            reset_positions: cfg.data.reset_position_ids,
        }
    }

    /// Whether batches need their document boundaries.
    pub fn active(self) -> bool {
        self.masking || self.reset_positions
    }

    /// Fails for a token file without document offsets when boundaries are needed.
    pub fn check(self, tokens: &TokenFile, what: &str) -> anyhow::Result<()> {
        if self.active() && tokens.num_docs() == 0 && tokens.num_tokens() > 0 {
            bail!(
                "{what} is a {} without document offsets, so data.document_masking / data.reset_position_ids cannot find its documents; point the source at the text so `lockstep prepare` writes a .tok with them, or set data.document_masking=false and data.reset_position_ids=false",
                tokens.source_kind()
            );
        }
        Ok(())
    }
}

/// One source as the loader and the validator read it.
pub struct SourceTokens {
    pub name: String,
    /// Relative sampling weight (1 for the one source of `data.path`).
    pub weight: f64,
    pub tokens: TokenFile,
}

struct Source {
    name: String,
    tokens: TokenFile,
    sampler: Sampler,
}

pub struct Loader {
    sources: Vec<Source>,
    mixture: Mixture,
    /// `data.sources` is set: per-source token counts are reported.
    report_sources: bool,
    packing: Packing,
    context_length: usize,
    /// Samples per micro-batch (`training.batch_size`).
    batch_size: usize,
    /// Samples one optimizer step takes over all ranks: batch × accumulation × world.
    pub global_batch: u64,
    rank: u64,
    world: u64,
    device: Device,
    /// Rank 0 says when a source starts a new epoch.
    lead: bool,
    tag: String,
    /// The token ids of one micro-batch, [batch, context + 1], reused from step to step.
    buf: Vec<i64>,
}

impl Loader {
    /// Source `s` reads its windows in the order seeded by `source_seed(system.seed, s)`.
    pub fn new(sources: Vec<SourceTokens>, cfg: &Config, rank: &Rank) -> anyhow::Result<Loader> {
        let t = &cfg.training;
        let packing = Packing::from_config(cfg);
        let weights: Vec<f64> = sources.iter().map(|s| s.weight).collect();
        let several = sources.len() > 1;
        let sources = sources
            .into_iter()
            .enumerate()
            .map(|(i, s)| {
                let what = format!("data.sources[{i}] ({})", s.name);
                let sampler = Sampler::new(
                    s.tokens.num_tokens(),
                    t.context_length,
                    source_seed(cfg.system.seed, i),
                );
                let sampler = if several {
                    sampler.with_context(|| what.clone())?
                } else {
                    sampler?
                };
                let what = if several { what } else { "data.path".into() };
                packing.check(&s.tokens, &what)?;
                Ok(Source {
                    name: s.name,
                    tokens: s.tokens,
                    sampler,
                })
            })
            .collect::<anyhow::Result<Vec<Source>>>()?;
        Ok(Loader {
            mixture: Mixture::new(&weights, cfg.system.seed)?,
            sources,
            report_sources: !cfg.data.sources.is_empty(),
            packing,
            context_length: t.context_length,
            batch_size: t.batch_size,
            // The data ranks: a tensor- or context-parallel group trains on the same
            // micro-batches.
            global_batch: (t.batch_size * t.grad_accum_nums * rank.mesh.data()) as u64,
            rank: rank.mesh.data_rank() as u64,
            world: rank.mesh.data() as u64,
            device: rank.device,
            lead: rank.lead(),
            tag: rank.tag.clone(),
            buf: Vec::new(),
        })
    }

    /// This rank's micro-batches of the step that starts after `consumed` global samples:
    /// global sample i belongs to rank i mod world, so any world size reads the same order.
    pub fn micro_batches(&mut self, consumed: u64) -> impl Iterator<Item = Batch> + '_ {
        if self.lead {
            self.announce_epochs(consumed);
        }
        let mine: Vec<u64> =
            rank_indices(consumed, self.global_batch, self.rank, self.world).collect();
        let micro: Vec<Vec<u64>> = mine.chunks(self.batch_size).map(<[u64]>::to_vec).collect();
        micro.into_iter().map(move |indices| {
            let rows: Vec<(usize, u64)> = indices
                .iter()
                .map(|&i| {
                    let (s, k) = self.mixture.locate(i);
                    (s, self.sources[s].sampler.window_start(k))
                })
                .collect();
            let sources = &self.sources;
            batch(
                rows.iter().map(|&(s, start)| (&sources[s].tokens, start)),
                self.context_length,
                self.packing,
                &mut self.buf,
                self.device,
            )
        })
    }

    /// Tokens each source has supplied in the first `consumed` global samples, by name; empty
    /// unless `data.sources` is set.
    pub fn tokens_by_source(&mut self, consumed: u64) -> Vec<(String, u64)> {
        if !self.report_sources {
            return Vec::new();
        }
        let ctx = self.context_length as u64;
        let drawn = self.mixture.drawn(consumed);
        self.sources
            .iter()
            .zip(drawn)
            .map(|(s, n)| (s.name.clone(), n * ctx))
            .collect()
    }

    /// A line for each source whose next epoch (a new order of its windows) begins in the step
    /// that starts after `consumed` samples.
    fn announce_epochs(&mut self, consumed: u64) {
        let before = self.mixture.drawn(consumed);
        let after = self.mixture.drawn(consumed + self.global_batch);
        for ((source, b), a) in self.sources.iter().zip(before).zip(after) {
            let n = source.sampler.num_windows();
            // The last epoch start e·n (e >= 1) among this step's samples b..a of the source.
            let last = (a.max(1) - 1) / n;
            if last >= 1 && last * n >= b {
                println!(
                    "{} Data: {} starts epoch {} ({n} windows, in a new order)",
                    self.tag,
                    source.name,
                    last + 1
                );
            }
        }
    }
}

/// One batch of windows `(file, first token)`, each `ctx + 1` tokens, as a [`Batch`] of
/// [rows, ctx] on `device`, with the rows' document pieces when `packing` needs them.
pub fn batch<'a>(
    rows: impl ExactSizeIterator<Item = (&'a TokenFile, u64)> + Clone,
    ctx: usize,
    packing: Packing,
    buf: &mut Vec<i64>,
    device: Device,
) -> Batch {
    let n = rows.len();
    let row = ctx + 1;
    buf.clear();
    buf.resize(n * row, 0);
    for ((tokens, start), chunk) in rows.clone().zip(buf.chunks_exact_mut(row)) {
        tokens.copy_window(start, row, chunk);
    }
    let documents = packing.active().then(|| {
        let pieces: Vec<Vec<usize>> = rows
            .map(|(tokens, start)| tokens.document_pieces(start, ctx))
            .collect();
        DocumentMask::new(&pieces, packing.masking, packing.reset_positions, device)
    });
    let rows = Tensor::from_slice(buf)
        .view([n as i64, row as i64])
        .to_device(device);
    Batch {
        inputs: rows.narrow(1, 0, ctx as i64),
        targets: rows.narrow(1, 1, ctx as i64),
        documents,
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::config::{resolve, Sources};
    use crate::data::tokfile::TokFileWriter;
    use crate::dist::Place;

    /// Three sources whose token ids tell them apart (source s uses ids s·1000..), with
    /// documents of varied lengths so windows hold several.
    fn sources(dir: &std::path::Path) -> Vec<SourceTokens> {
        (0..3u32)
            .map(|s| {
                let path = dir.join(format!("s{s}.tok"));
                let mut w = TokFileWriter::create(&path, 2, [0; 32]).unwrap();
                let mut next = s * 1000;
                for d in 0..(40 + 30 * s) {
                    let len = 3 + (d * 7 + s) % 11;
                    let doc: Vec<u32> = (0..len).map(|i| next + i).collect();
                    next += len;
                    w.push_document(&doc).unwrap();
                }
                w.finish().unwrap();
                SourceTokens {
                    name: format!("s{s}"),
                    weight: [0.5, 0.3, 0.2][s as usize],
                    tokens: TokenFile::open(&path).unwrap(),
                }
            })
            .collect()
    }

    /// One drawn row: its inputs, targets and attention mask.
    type Row = (Vec<i64>, Vec<i64>, Vec<bool>);

    /// What each global sample of `steps` steps is, on `world` ranks from `consumed` on.
    fn draw(
        dir: &std::path::Path,
        world: usize,
        batch: usize,
        accum: usize,
        consumed: u64,
        steps: usize,
    ) -> BTreeMap<u64, Row> {
        let sets: Vec<String> = [
            format!("training.batch_size={batch}"),
            format!("training.grad_accum_nums={accum}"),
            "training.context_length=16".into(),
            "data.document_masking=true".into(),
            "data.reset_position_ids=true".into(),
            r#"data.sources=[{"path":"a","weight":0.5},{"path":"b","weight":0.3},{"path":"c","weight":0.2}]"#.into(),
        ]
        .into();
        let cfg = resolve(&Sources {
            sets,
            ..Default::default()
        })
        .unwrap()
        .config;
        let mut seen = BTreeMap::new();
        for r in 0..world {
            let rank = Rank {
                place: Place {
                    rank: r,
                    world,
                    local_rank: r,
                    local_world: world,
                },
                mesh: crate::dist::Mesh::new(r, world, 1, 1, 0),
                device: Device::Cpu,
                tag: format!("[CPU{r}]"),
            };
            let mut loader = Loader::new(sources(dir), &cfg, &rank).unwrap();
            for step in 0..steps as u64 {
                let at = consumed + step * loader.global_batch;
                let mine: Vec<u64> =
                    rank_indices(at, loader.global_batch, r as u64, world as u64).collect();
                let rows: Vec<Row> = loader
                    .micro_batches(at)
                    .flat_map(|b| {
                        let mask = b.documents.as_ref().unwrap().attention_mask();
                        (0..b.inputs.size()[0])
                            .map(|i| {
                                (
                                    Vec::try_from(b.inputs.get(i)).unwrap(),
                                    Vec::try_from(b.targets.get(i)).unwrap(),
                                    Vec::try_from(mask.get(i).reshape([-1])).unwrap(),
                                )
                            })
                            .collect::<Vec<_>>()
                    })
                    .collect();
                assert_eq!(rows.len(), mine.len());
                seen.extend(mine.into_iter().zip(rows));
            }
        }
        seen
    }

    #[test]
    fn stop_and_resume_on_any_world_size_draws_the_same_samples() {
        let dir = tempfile::tempdir().unwrap();
        // 12 samples a step: 1 rank × 12, or 3 ranks × 2 × 2 accumulation, or 2 ranks × 3 × 2.
        let straight = draw(dir.path(), 1, 12, 1, 0, 40);
        assert_eq!(straight.len(), 480);
        let mut split = draw(dir.path(), 3, 2, 2, 0, 17);
        split.extend(draw(dir.path(), 2, 3, 2, 17 * 12, 23));
        assert!(
            split == straight,
            "the resumed run on other world sizes drew other samples"
        );
        // Every source took part, and rows hold several documents each.
        let from = |s: i64| {
            straight
                .values()
                .filter(|(x, _, _)| x[0] / 1000 == s)
                .count()
        };
        assert!(from(0) > from(1) && from(1) > from(2) && from(2) > 0);
        let masked = straight
            .values()
            .filter(|(_, _, m)| m.iter().filter(|&&a| a).count() < 136);
        assert!(
            masked.count() > 400,
            "16·17/2 = 136 allowed pairs in a one-document row"
        );
    }

    #[test]
    fn tokens_by_source_count_the_drawn_windows() {
        let dir = tempfile::tempdir().unwrap();
        let straight = draw(dir.path(), 1, 12, 1, 0, 40);
        let cfg = resolve(&Sources {
            sets: vec![
                "training.context_length=16".into(),
                r#"data.sources=[{"path":"a","weight":0.5},{"path":"b","weight":0.3},{"path":"c","weight":0.2}]"#.into(),
            ],
            ..Default::default()
        })
        .unwrap()
        .config;
        let rank = Rank {
            place: Place::SINGLE,
            mesh: crate::dist::Mesh::new(0, 1, 1, 1, 0),
            device: Device::Cpu,
            tag: "[CPU0]".into(),
        };
        let mut loader = Loader::new(sources(dir.path()), &cfg, &rank).unwrap();
        let counted = loader.tokens_by_source(480);
        for (s, (name, tokens)) in counted.iter().enumerate() {
            let drawn = straight
                .values()
                .filter(|(x, _, _)| x[0] / 1000 == s as i64)
                .count();
            assert_eq!(
                (name.as_str(), *tokens),
                (format!("s{s}").as_str(), drawn as u64 * 16)
            );
        }
    }
}
