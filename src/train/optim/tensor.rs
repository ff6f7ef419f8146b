//! The state of a tensor-parallel rank seen whole. Checkpoints hold whole Hugging Face tensors
//! and the optimizer's moments as pieces of the whole parameters (flattened), whatever layout
//! wrote them, so that any mesh resumes any other: here a rank's parts (`model::Split`) become
//! whole weights and pieces of the whole when it saves ([`TensorGroups::whole_state`]), and a
//! checkpoint is read in its parts' coordinates when it loads ([`TensorGroups::source`]). The
//! layouts (replicated, sharded) never see the difference.
//!
//! Saving: each split weight a rank writes is gathered over its tensor group and written whole
//! by the group's rank 0. Moments: a row- or vocabulary-split weight's part is one contiguous
//! piece of the whole, written by the rank that holds it; a column-split weight's rows
//! interleave the parts, so its moments are gathered and rank 0 writes them (whole rows in one
//! piece, the first and last rows of a range in a piece per part); whole parameters (the norms)
//! are rank 0's.

use std::ops::Range;

use anyhow::Result;
use tch::Tensor;

use super::{MomentPiece, RankState, StateSource, TensorGroups};
use crate::dist::group::gather_equal;
use crate::dist::on_group;
use crate::model::Split;

impl TensorGroups {
    /// This rank's position in its tensor group and the group's size.
    pub fn place(&self) -> Result<(usize, usize)> {
        let g = self
            .tensor
            .lock()
            .map_err(|_| anyhow::anyhow!("a tensor-parallel collective panicked earlier"))?;
        Ok((g.rank(), g.world_size()))
    }

    /// The tensor group as Muon's second level (`orthogonal.rs`).
    pub fn level(&self) -> Result<super::orthogonal::Level> {
        let (rank, size) = self.place()?;
        Ok(super::orthogonal::Level {
            group: Some(self.tensor.clone()),
            rank,
            size,
        })
    }

    fn whole_shape(&self, name: &str) -> Result<&[i64]> {
        Ok(&self.parameters.get(name)?.shape)
    }

    /// How the parameter `name` is split (from the model's table).
    pub fn split(&self, name: &str) -> Result<Split> {
        self.parameters.split(name)
    }

    /// Whether the parameter `name` is whole on every rank of the group (the optimizer checked
    /// at its construction that the table holds every parameter it was given).
    pub fn replicated(&self, name: &str) -> bool {
        self.parameters.split(name).is_ok_and(Split::is_whole)
    }

    /// Whether each rank's gradient of the whole parameter `name` is a part of the step's, to
    /// be summed over the group: a head's norm always, the residual stream's norms with
    /// sequence parallelism (each rank saw its tokens).
    pub fn partial(&self, name: &str) -> bool {
        match self.parameters.split(name) {
            Ok(Split::Shared) => true,
            Ok(Split::Replicated) => self.sequence_parallel,
            _ => false,
        }
    }

    /// Every rank's `t` (the same shape on each), in rank order: a collective of the group.
    fn gather(&self, t: &Tensor) -> Result<Vec<Tensor>> {
        let mut unused = crate::dist::SingleProcess;
        let (buffer, size) = on_group(Some(&self.tensor), &mut unused, |g| {
            Ok((gather_equal(g, t)?, g.world_size()))
        })?;
        let (n, shape) = (t.numel(), t.size());
        Ok((0..size)
            .map(|r| {
                buffer
                    .narrow(0, (n * r) as i64, n as i64)
                    .view(shape.as_slice())
            })
            .collect())
    }

    /// Whole tensors of `parts` (each rank's values of its parts, in the caller's order, the
    /// same names on every rank of the group), on every rank: a collective of the group.
    pub fn whole(&self, parts: &[(String, Tensor)]) -> Result<Vec<Tensor>> {
        parts
            .iter()
            .map(|(name, value)| match self.split(name)? {
                Split::Replicated | Split::Shared => Ok(value.shallow_clone()),
                split => {
                    let all = self.gather(&value.contiguous())?;
                    Ok(split.unshard(&all, self.whole_shape(name)?))
                }
            })
            .collect()
    }

    /// `local` (what the layout would write: its parts' values and moments) as whole weights
    /// and pieces of the whole parameters: a collective of the group (every rank of it passes
    /// the same names and ranges, which holds because its parts are laid out alike).
    pub fn whole_state(&self, local: RankState) -> Result<RankState> {
        let (rank, size) = self.place()?;
        let lead = rank == 0;
        let whole = self.whole(&local.weights)?;
        let weights = if lead {
            local
                .weights
                .into_iter()
                .map(|(n, _)| n)
                .zip(whole)
                .collect()
        } else {
            Vec::new()
        };
        let mut moments = Vec::new();
        for piece in local.moments {
            let split = self.split(&piece.name)?;
            let full = self.whole_shape(&piece.name)?;
            // Each moment as (rank, its values) of the parts this rank writes pieces of.
            let mut parts: Vec<Vec<(usize, Tensor)>> = Vec::new();
            for (_, t) in &piece.moments {
                let t = t.reshape(-1);
                parts.push(match split {
                    Split::Replicated | Split::Shared if lead => vec![(rank, t)],
                    Split::Replicated | Split::Shared => Vec::new(),
                    Split::Rows | Split::Vocab => vec![(rank, t)],
                    Split::Columns => {
                        let all = self.gather(&t)?;
                        match lead {
                            true => all.into_iter().enumerate().collect(),
                            false => Vec::new(),
                        }
                    }
                });
            }
            if parts.iter().any(Vec::is_empty) {
                continue;
            }
            // The same ranges for every moment: one piece of the whole per range.
            let mut each: Vec<_> = parts
                .iter()
                .map(|p| split.whole_pieces(full, size, &piece.range, p).into_iter())
                .collect();
            while let Some((range, first)) = each.first_mut().and_then(Iterator::next) {
                let mut values = vec![(piece.moments[0].0, first)];
                for (k, rest) in each.iter_mut().enumerate().skip(1) {
                    let (_, t) = rest.next().expect("the same pieces for every moment");
                    values.push((piece.moments[k].0, t));
                }
                moments.push(MomentPiece {
                    name: piece.name.clone(),
                    range,
                    moments: values,
                });
            }
        }
        Ok(RankState { weights, moments })
    }

    /// `whole` (a checkpoint) read in this rank's parts' coordinates.
    pub fn source<'a>(&'a self, whole: &'a dyn StateSource) -> Result<PartSource<'a>> {
        Ok(PartSource {
            groups: self,
            whole,
            place: self.place()?,
        })
    }
}

/// A checkpoint as one rank of a tensor group reads it: its parts of the parameters.
pub struct PartSource<'a> {
    groups: &'a TensorGroups,
    whole: &'a dyn StateSource,
    place: (usize, usize),
}

impl StateSource for PartSource<'_> {
    /// The part, read as its elements: a row- or vocabulary-split weight reads only its rows.
    fn weight(&self, name: &str, part: &[i64]) -> Result<Tensor> {
        let numel = part.iter().product::<i64>() as usize;
        Ok(self.weight_range(name, part, &(0..numel))?.view(part))
    }

    fn weight_range(&self, name: &str, _part: &[i64], range: &Range<usize>) -> Result<Tensor> {
        let full = self.groups.whole_shape(name)?;
        self.groups
            .split(name)?
            .read_part(full, self.place, range, |r| {
                self.whole.weight_range(name, full, &r)
            })
    }

    fn moment(&self, name: &str, key: &str, range: &Range<usize>) -> Result<Tensor> {
        let full = self.groups.whole_shape(name)?;
        self.groups
            .split(name)?
            .read_part(full, self.place, range, |r| {
                self.whole.moment(name, key, &r)
            })
    }
}
