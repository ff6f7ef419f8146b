//! Muon's Newton–Schulz iteration needs each matrix whole; the ranks hold pieces of it. Here
//! each matrix is assembled on one owner rank, orthogonalized there, and its pieces sent back,
//! in two levels:
//!
//! 1. Over the data-parallel ranks that hold the optimizer state (the shard group with hybrid
//!    sharding, else the data ranks): a sharded rank holds a contiguous piece of a matrix
//!    (its flat slice, `dist::flat_layout`), a replicated one (zero stage 0) the whole. The
//!    owner is the rank holding most of the matrix, so a matrix inside one rank's slice moves
//!    nowhere and only the matrices that straddle two slices travel; among equal holders
//!    (replicated: all of them) the one with the least Newton–Schulz work so far, the costliest
//!    matrices placed first, so that the work is shared. Every other holder sends the owner its
//!    piece of the update; the owner sends each holder its piece of the result.
//! 2. With tensor parallelism each data rank holds a part of a whole matrix (`model::Split`),
//!    laid out alike on every rank of its tensor group: the ranks of the tensor group at the
//!    level-1 owner's data index send their parts to one of them (balanced as above), which
//!    assembles the whole Hugging Face matrix, orthogonalizes it and sends each its part back.
//!
//! Each exchange is one all-to-all of bf16 values (the update is rounded to bf16 where
//! Newton–Schulz would round it first, and its result is bf16: nothing is lost on the way), so
//! the result is bitwise the one rank's from the same update. Per matrix that does move, ≈ 2 ×
//! its elements × 2 bytes cross the network per step; with tensor parallelism another 2 ×
//! (T − 1)/T of it within the tensor group. Replicated ranks receive every matrix they do not
//! own (the all-gather of the results). Every rank of a group calls each exchange, or none
//! does: which matrices move is known to all of them from the layout alone.
//!
//! The all-gather variant (every rank gathering the whole update of every matrix it holds a
//! piece of and orthogonalizing it itself) moves a rank's share of all matrices rather than
//! the straddling ones and repeats the work of each straddling matrix on each holder;
//! BENCHMARKS.md §22 measures both.

use std::collections::VecDeque;
use std::ops::Range;

use anyhow::Result;
use tch::{Device, Kind, Tensor};

use super::muon::{newton_schulz, ns_flops, MuonParams};
use crate::dist::{on_group, ProcessGroup, SharedGroup, SingleProcess};
use crate::model::Split;

/// One Muon matrix as a rank's optimizer sees it.
#[derive(Debug, Clone)]
pub struct Matrix {
    /// This rank's part, [rows, columns] (the whole matrix without tensor parallelism).
    pub part: [i64; 2],
    /// The whole Hugging Face matrix, and how tensor parallelism cuts it into parts.
    pub whole: [i64; 2],
    pub split: Split,
    /// The elements of the part (flattened) that each rank of the level-1 group holds, by
    /// ascending rank; a rank holding none is absent. Either the pieces are disjoint (sharded)
    /// or every rank holds all of them (replicated).
    pub holders: Vec<(usize, Range<usize>)>,
}

impl Matrix {
    fn numel(&self) -> usize {
        (self.part[0] * self.part[1]) as usize
    }

    /// The elements rank `r` holds (empty where none).
    fn held_by(&self, r: usize) -> Range<usize> {
        self.holders
            .iter()
            .find(|(q, _)| *q == r)
            .map_or(0..0, |(_, range)| range.clone())
    }
}

/// A group of ranks with this rank's place in it.
#[derive(Clone)]
pub struct Level {
    /// None: the caller's group.
    pub group: Option<SharedGroup>,
    pub rank: usize,
    pub size: usize,
}

/// The two levels' owners of a set of Muon matrices, and the exchanges that assemble them.
pub struct Orthogonalizer {
    matrices: Vec<Matrix>,
    steps: usize,
    device: Device,
    data: Level,
    /// Each matrix's level-1 owner.
    owner: Vec<usize>,
    /// Tensor parallelism: the tensor group, and by matrix its owner there where this rank's
    /// data index owns the matrix at level 1.
    tensor: Option<(Level, Vec<Option<usize>>)>,
}

/// What a layout builds its [`Orthogonalizer`] from: Muon's settings, by the optimizer's
/// parameter index each parameter's whole shape and split, and the levels' groups.
pub struct Setup {
    pub hp: MuonParams,
    pub device: Device,
    pub whole: Vec<(Vec<i64>, Split)>,
    /// The ranks that hold the optimizer state (level 1).
    pub data: Level,
    /// Tensor parallelism's group (level 2).
    pub tensor: Option<Level>,
}

impl Setup {
    /// Parameter `i` (of this rank's `part` shape) as a Muon matrix, held as `holders` says
    /// (given the part's elements).
    pub fn matrix(
        &self,
        i: usize,
        part: &[i64],
        holders: impl FnOnce(usize) -> Vec<(usize, Range<usize>)>,
    ) -> Matrix {
        let (whole, split) = &self.whole[i];
        let two = |s: &[i64]| [s[0], s[1]];
        Matrix {
            part: two(part),
            whole: two(whole),
            split: *split,
            holders: holders(part.iter().product::<i64>() as usize),
        }
    }

    /// The orthogonalizer of `matrices`, listed in the same order on every rank of the group.
    pub fn build(self, matrices: Vec<Matrix>) -> Orthogonalizer {
        Orthogonalizer::new(
            matrices,
            self.hp.ns_steps,
            self.device,
            self.data,
            self.tensor,
        )
    }
}

/// For each matrix (its Newton–Schulz cost, and by rank the elements held), the rank that
/// assembles it: the one holding most of it; among equal holders, the one with the least work
/// so far, the costliest matrices placed first (ties: the lower rank, the earlier matrix).
pub fn owners(costs: &[f64], held: &[Vec<(usize, usize)>], world: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..costs.len()).collect();
    order.sort_by(|&a, &b| costs[b].total_cmp(&costs[a]).then(a.cmp(&b)));
    let mut load = vec![0.0f64; world];
    let mut owner = vec![0; costs.len()];
    for i in order {
        let most = held[i].iter().map(|&(_, n)| n).max().unwrap_or(0);
        let pick = held[i]
            .iter()
            .filter(|&&(_, n)| n == most)
            .map(|&(r, _)| r)
            .min_by(|&a, &b| load[a].total_cmp(&load[b]).then(a.cmp(&b)))
            .expect("internal: a Muon matrix that no rank holds");
        load[pick] += costs[i];
        owner[i] = pick;
    }
    owner
}

impl Orthogonalizer {
    /// `matrices` (in the same order on every rank of `data`) orthogonalized in `steps`
    /// Newton–Schulz iterations on `device`, over `data` and, with tensor parallelism, over
    /// `tensor`.
    pub fn new(
        matrices: Vec<Matrix>,
        steps: usize,
        device: Device,
        data: Level,
        tensor: Option<Level>,
    ) -> Orthogonalizer {
        let costs: Vec<f64> = matrices.iter().map(|m| ns_flops(m.whole, steps)).collect();
        let held: Vec<Vec<(usize, usize)>> = matrices
            .iter()
            .map(|m| m.holders.iter().map(|(r, e)| (*r, e.len())).collect())
            .collect();
        let owner = owners(&costs, &held, data.size);
        let tensor = tensor.filter(|t| t.size > 1).map(|t| {
            // The matrices this data index owns, the same list on every rank of the group.
            let mine: Vec<usize> = (0..matrices.len())
                .filter(|&i| owner[i] == data.rank)
                .collect();
            let every: Vec<(usize, usize)> = (0..t.size).map(|r| (r, 1)).collect();
            let cost: Vec<f64> = mine.iter().map(|&i| costs[i]).collect();
            let second = owners(&cost, &vec![every; mine.len()], t.size);
            let mut by_matrix = vec![None; matrices.len()];
            for (&i, o) in mine.iter().zip(second) {
                by_matrix[i] = Some(o);
            }
            (t, by_matrix)
        });
        Orthogonalizer {
            matrices,
            steps,
            device,
            data,
            owner,
            tensor,
        }
    }

    pub fn matrices(&self) -> &[Matrix] {
        &self.matrices
    }

    /// The elements of each matrix's part this rank holds (empty where none).
    pub fn held(&self, i: usize) -> Range<usize> {
        self.matrices[i].held_by(self.data.rank)
    }

    /// The Newton–Schulz results of this rank's pieces: `mine[i]` is its piece of matrix i's
    /// update (bf16, 1-D, the elements [`Orthogonalizer::held`]) where it holds one; the
    /// result the same piece of the orthogonalized matrix. A collective of the level-1 group
    /// (and the tensor group).
    pub fn run(&self, pg: &mut dyn ProcessGroup, mine: &[Option<Tensor>]) -> Result<Vec<Tensor>> {
        anyhow::ensure!(
            mine.len() == self.matrices.len(),
            "internal: {} Muon updates for {} matrices",
            mine.len(),
            self.matrices.len()
        );
        let parts = self.gather_parts(pg, mine)?;
        let done = match &self.tensor {
            None => parts
                .into_iter()
                .map(|p| p.map(|p| newton_schulz(&p, self.steps)).transpose())
                .collect::<Result<Vec<_>>>()?,
            Some((tensor, second)) => self.across_tensor(tensor, second, parts)?,
        };
        self.scatter_parts(pg, done)
    }

    /// Whether matrix i's level-1 owner holds all of it (replicated: nothing to gather).
    fn owner_holds_all(&self, i: usize) -> bool {
        self.matrices[i].held_by(self.owner[i]).len() == self.matrices[i].numel()
    }

    /// Level 1, inward: each matrix this rank owns, assembled from its holders' pieces, as its
    /// part's [rows, columns] (None for the others).
    fn gather_parts(
        &self,
        pg: &mut dyn ProcessGroup,
        mine: &[Option<Tensor>],
    ) -> Result<Vec<Option<Tensor>>> {
        let me = self.data.rank;
        let mut out = lists(self.data.size);
        let mut sizes: Vec<Vec<usize>> = vec![Vec::new(); self.data.size];
        let mut moves = false;
        for (i, m) in self.matrices.iter().enumerate() {
            let o = self.owner[i];
            if self.owner_holds_all(i) {
                continue;
            }
            for (q, r) in m.holders.iter().filter(|(q, _)| *q != o) {
                moves = true;
                if *q == me {
                    out[o].push(piece(mine, i)?);
                }
                if o == me {
                    sizes[*q].push(r.len());
                }
            }
        }
        let mut received = match moves {
            true => exchange(&self.data, pg, out, &sizes, self.device)?,
            false => queues(self.data.size),
        };
        let mut parts = Vec::with_capacity(self.matrices.len());
        for (i, m) in self.matrices.iter().enumerate() {
            if self.owner[i] != me {
                parts.push(None);
                continue;
            }
            let part = if self.owner_holds_all(i) {
                piece(mine, i)?
            } else {
                let buffer = Tensor::zeros([m.numel() as i64], (Kind::BFloat16, self.device));
                for (q, r) in &m.holders {
                    let values = match *q == me {
                        true => piece(mine, i)?,
                        false => next(&mut received[*q])?,
                    };
                    tch::no_grad(|| {
                        buffer
                            .narrow(0, r.start as i64, r.len() as i64)
                            .copy_(&values)
                    });
                }
                buffer
            };
            parts.push(Some(part.view(m.part)));
        }
        Ok(parts)
    }

    /// Level 2: the parts this data index owns, made whole on their owner in the tensor group,
    /// orthogonalized there, and each rank's part of the result back (flattened).
    fn across_tensor(
        &self,
        tensor: &Level,
        second: &[Option<usize>],
        parts: Vec<Option<Tensor>>,
    ) -> Result<Vec<Option<Tensor>>> {
        let (me, size) = (tensor.rank, tensor.size);
        let mut unused = SingleProcess;
        let owned: Vec<usize> = (0..second.len()).filter(|&i| second[i].is_some()).collect();
        let part_of = |i: usize| -> Result<Tensor> {
            parts[i]
                .as_ref()
                .map(|p| p.reshape(-1))
                .ok_or_else(|| anyhow::anyhow!("internal: no part of Muon matrix {i}"))
        };
        // Inward: every part to the matrix's owner in the tensor group.
        let mut out = lists(size);
        let mut sizes: Vec<Vec<usize>> = vec![Vec::new(); size];
        for &i in &owned {
            let o = second[i].expect("owned");
            if o == me {
                for (q, s) in sizes.iter_mut().enumerate() {
                    if q != me {
                        s.push(self.matrices[i].numel());
                    }
                }
            } else {
                out[o].push(part_of(i)?);
            }
        }
        let mut received = match owned.is_empty() {
            true => queues(size),
            false => exchange(tensor, &mut unused, out, &sizes, self.device)?,
        };
        // Orthogonalize the matrices owned here, and send each rank its part of the result.
        let mut out = lists(size);
        let mut sizes: Vec<Vec<usize>> = vec![Vec::new(); size];
        let mut done: Vec<Option<Tensor>> = (0..second.len()).map(|_| None).collect();
        for &i in &owned {
            let m = &self.matrices[i];
            let o = second[i].expect("owned");
            if o != me {
                sizes[o].push(m.numel());
                continue;
            }
            let mut all = Vec::with_capacity(size);
            for q in 0..size {
                let flat = match q == me {
                    true => part_of(i)?,
                    false => next(&mut received[q])?,
                };
                all.push(flat.view(m.part));
            }
            let whole = m.split.unshard(&all, &m.whole);
            let result = newton_schulz(&whole, self.steps)?;
            for (q, to) in out.iter_mut().enumerate() {
                let part = m.split.shard(&result, q, size).reshape(-1);
                match q == me {
                    true => done[i] = Some(part),
                    false => to.push(part),
                }
            }
        }
        let mut received = match owned.is_empty() {
            true => queues(size),
            false => exchange(tensor, &mut unused, out, &sizes, self.device)?,
        };
        for &i in &owned {
            if done[i].is_none() {
                let o = second[i].expect("owned");
                done[i] = Some(next(&mut received[o])?);
            }
        }
        Ok(done)
    }

    /// Level 1, outward: each holder's piece of the results of the matrices this rank owns
    /// (`done`: [rows, columns] or flattened), and this rank's pieces of every matrix it holds.
    fn scatter_parts(
        &self,
        pg: &mut dyn ProcessGroup,
        done: Vec<Option<Tensor>>,
    ) -> Result<Vec<Tensor>> {
        let me = self.data.rank;
        let done: Vec<Option<Tensor>> = done.into_iter().map(|d| d.map(flat)).collect();
        let mut out = lists(self.data.size);
        let mut sizes: Vec<Vec<usize>> = vec![Vec::new(); self.data.size];
        let mut moves = false;
        for (i, m) in self.matrices.iter().enumerate() {
            let o = self.owner[i];
            for (q, r) in m.holders.iter().filter(|(q, _)| *q != o) {
                moves = true;
                if o == me {
                    let result = done[i].as_ref().expect("orthogonalized by its owner");
                    out[*q].push(result.narrow(0, r.start as i64, r.len() as i64));
                }
                if *q == me {
                    sizes[o].push(r.len());
                }
            }
        }
        let mut received = match moves {
            true => exchange(&self.data, pg, out, &sizes, self.device)?,
            false => queues(self.data.size),
        };
        let mut mine = Vec::new();
        for (i, m) in self.matrices.iter().enumerate() {
            let r = m.held_by(me);
            if r.is_empty() {
                continue;
            }
            let o = self.owner[i];
            mine.push(match o == me {
                true => done[i]
                    .as_ref()
                    .expect("orthogonalized by its owner")
                    .narrow(0, r.start as i64, r.len() as i64),
                false => next(&mut received[o])?,
            });
        }
        Ok(mine)
    }
}

/// `n` empty lists (tensors are not `Clone`, so no `vec![...; n]`).
fn lists(n: usize) -> Vec<Vec<Tensor>> {
    (0..n).map(|_| Vec::new()).collect()
}

fn queues(n: usize) -> Vec<VecDeque<Tensor>> {
    (0..n).map(|_| VecDeque::new()).collect()
}

/// `mine[i]`, which this rank must hold.
fn piece(mine: &[Option<Tensor>], i: usize) -> Result<Tensor> {
    mine[i]
        .as_ref()
        .map(Tensor::shallow_clone)
        .ok_or_else(|| anyhow::anyhow!("internal: no update for Muon matrix {i} on its holder"))
}

fn next(from: &mut VecDeque<Tensor>) -> Result<Tensor> {
    from.pop_front()
        .ok_or_else(|| anyhow::anyhow!("internal: a Muon exchange delivered fewer pieces"))
}

/// A result flattened (contiguous).
fn flat(t: Tensor) -> Tensor {
    t.contiguous().view(-1)
}

/// One all-to-all of bf16 pieces over `level`'s group (else `pg`): `out[r]` the pieces for
/// rank r in order, `sizes[s]` the elements of each piece rank s sends here; the pieces that
/// arrive, by sender.
fn exchange(
    level: &Level,
    pg: &mut dyn ProcessGroup,
    out: Vec<Vec<Tensor>>,
    sizes: &[Vec<usize>],
    device: Device,
) -> Result<Vec<VecDeque<Tensor>>> {
    let send_rows: Vec<usize> = out
        .iter()
        .map(|p| p.iter().map(|t| t.numel()).sum())
        .collect();
    let recv_rows: Vec<usize> = sizes.iter().map(|s| s.iter().sum()).collect();
    let pieces: Vec<Tensor> = out
        .into_iter()
        .flatten()
        .map(|t| t.to_kind(Kind::BFloat16).reshape(-1))
        .collect();
    let send = match pieces.is_empty() {
        true => Tensor::zeros([0], (Kind::BFloat16, device)),
        false => Tensor::cat(&pieces, 0),
    };
    let recv = on_group(level.group.as_ref(), pg, |g| {
        g.all_to_all_tensor(&send, &send_rows, &recv_rows)
    })?;
    let mut at = 0;
    Ok(sizes
        .iter()
        .map(|from| {
            from.iter()
                .map(|&n| {
                    let t = recv.narrow(0, at, n as i64);
                    at += n as i64;
                    t
                })
                .collect()
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A matrix inside one rank's slice stays there; a straddling one goes to the larger
    /// holder; replicated matrices are shared out by cost, the costliest first.
    #[test]
    fn owners_keep_matrices_local_and_share_the_work() {
        let held = vec![vec![(0, 10)], vec![(0, 3), (1, 7)], vec![(1, 5), (2, 5)]];
        assert_eq!(owners(&[1.0, 1.0, 1.0], &held, 3), [0, 1, 2]);
        let everywhere = vec![vec![(0, 4), (1, 4)]; 4];
        assert_eq!(owners(&[1.0, 8.0, 2.0, 3.0], &everywhere, 2), [1, 0, 1, 1]);
    }
}
