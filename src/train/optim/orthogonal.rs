//! Muon's Newton–Schulz iteration needs each matrix whole; the ranks hold pieces of it. Here
//! each matrix is assembled on one owner rank, orthogonalized there, and its pieces sent back,
//! in two levels:
//!
//! 1. Over the data-parallel ranks that hold the optimizer state (the shard group with hybrid
//!    sharding, else the data ranks): a sharded rank holds a contiguous piece of a matrix
//!    (its flat slice, `dist::flat_layout`), a replicated one (zero stage 0) the whole. The
//!    owner (`dist::owners`) is the rank holding most of the matrix, so that a matrix inside one
//!    rank's slice does not move, unless that rank already has its share of the work: then
//!    the least loaded rank, so that the work is shared (a slice of embeddings holds no Muon
//!    matrix; at stage 0 every rank holds every one). Every other holder sends the owner its
//!    piece of the update; the owner sends each holder its piece of the result.
//! 2. With tensor parallelism each data rank holds a part of a whole matrix (`model::Split`),
//!    laid out alike on every rank of its tensor group: the ranks of the tensor group at the
//!    level-1 owner's data index send their parts to one of them (balanced as above), which
//!    assembles the whole Hugging Face matrix, orthogonalizes it and sends each its part back.
//!
//! Each exchange is one all-to-all of bf16 values (the update is rounded to bf16 where
//! Newton–Schulz would round it first, and its result is bf16: nothing is lost on the way), so
//! the result is bitwise one rank's from the same update. A matrix that moves costs 2 × its
//! elements × 2 bytes per step (there and back); with tensor parallelism another 2 × (T − 1)/T
//! of it within the tensor group; at stage 0 each rank receives the results of the matrices it
//! does not own (an all-gather's volume). Every rank of a group calls each exchange, or none
//! does: which pieces move is known to all of them from the layout alone.
//!
//! The all-gather variant (`debug.muon_all_gather`): every holder of a matrix gathers the
//! whole update from the other holders and orthogonalizes it itself, so nothing comes back,
//! but each straddling matrix is orthogonalized on each of its holders, and at stage 0 every
//! rank orthogonalizes every matrix. BENCHMARKS.md §22 measures both.

use std::collections::VecDeque;
use std::ops::Range;

use anyhow::Result;
use tch::{Device, Kind, Tensor};

use super::muon::{newton_schulz, MuonParams};
use crate::dist::owners::owners;
use crate::dist::{on_group, ProcessGroup, SharedGroup, SingleProcess};
use crate::model::Split;
use crate::plan::muon::ns_flops;

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
    /// By matrix, the ranks of level 1 that orthogonalize it, its owner first ([`computers`]).
    computers: Vec<Vec<usize>>,
    /// Tensor parallelism: the tensor group, and by matrix the ranks there that orthogonalize
    /// it, where this rank's data index does at level 1 (else none).
    tensor: Option<(Level, Vec<Vec<usize>>)>,
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
            (self.hp.ns_steps, self.hp.all_gather),
            self.device,
            self.data,
            self.tensor,
        )
    }
}

/// Which ranks orthogonalize each matrix: its owner ([`owners`]; the other holders receive
/// their pieces of the result from it), or with the all-gather variant every holder (each
/// gathers the whole update from the other holders and orthogonalizes it itself: no result
/// travels).
fn computers(
    costs: &[f64],
    held: &[Vec<(usize, usize)>],
    world: usize,
    all_gather: bool,
) -> Vec<Vec<usize>> {
    match all_gather {
        true => held
            .iter()
            .map(|h| h.iter().map(|&(r, _)| r).collect())
            .collect(),
        false => owners(costs, held, world)
            .into_iter()
            .map(|o| vec![o])
            .collect(),
    }
}

impl Orthogonalizer {
    /// `matrices` (in the same order on every rank of `data`) orthogonalized in `steps`
    /// Newton–Schulz iterations on `device`, over `data` and, with tensor parallelism, over
    /// `tensor`; by owners, or by every holder with `all_gather`.
    pub fn new(
        matrices: Vec<Matrix>,
        (steps, all_gather): (usize, bool),
        device: Device,
        data: Level,
        tensor: Option<Level>,
    ) -> Orthogonalizer {
        let costs: Vec<f64> = matrices.iter().map(|m| ns_flops(m.whole, steps)).collect();
        let held: Vec<Vec<(usize, usize)>> = matrices
            .iter()
            .map(|m| m.holders.iter().map(|(r, e)| (*r, e.len())).collect())
            .collect();
        let first = computers(&costs, &held, data.size, all_gather);
        let tensor = tensor.filter(|t| t.size > 1).map(|t| {
            // The matrices this data index orthogonalizes: the same list on every rank of the
            // tensor group (whose ranks hold parts alike), each part held by every rank there.
            let mine: Vec<usize> = (0..matrices.len())
                .filter(|&i| first[i].contains(&data.rank))
                .collect();
            let every: Vec<(usize, usize)> = (0..t.size).map(|r| (r, 1)).collect();
            let cost: Vec<f64> = mine.iter().map(|&i| costs[i]).collect();
            let second = computers(&cost, &vec![every; mine.len()], t.size, all_gather);
            let mut by_matrix = vec![Vec::new(); matrices.len()];
            for (&i, c) in mine.iter().zip(second) {
                by_matrix[i] = c;
            }
            (t, by_matrix)
        });
        Orthogonalizer {
            matrices,
            steps,
            device,
            data,
            computers: first,
            tensor,
        }
    }

    pub fn matrices(&self) -> &[Matrix] {
        &self.matrices
    }

    /// The Newton–Schulz results of this rank's pieces: `mine[i]` is its piece of matrix i's
    /// update (bf16, 1-D, the elements the matrix's `holders` give this rank) where it holds
    /// one; the result the same pieces of the orthogonalized matrices, in order. A collective
    /// of the level-1 group (and the tensor group).
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

    /// Whether rank `r` holds all of matrix i.
    fn holds_all(&self, i: usize, r: usize) -> bool {
        self.matrices[i].held_by(r).len() == self.matrices[i].numel()
    }

    /// Level 1, inward: each matrix this rank orthogonalizes, assembled from its holders'
    /// pieces, as its part's [rows, columns] (None for the others).
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
            for &c in self.computers[i].iter().filter(|&&c| !self.holds_all(i, c)) {
                for (q, r) in m.holders.iter().filter(|(q, _)| *q != c) {
                    moves = true;
                    if *q == me {
                        out[c].push(piece(mine, i)?);
                    }
                    if c == me {
                        sizes[*q].push(r.len());
                    }
                }
            }
        }
        let mut received = match moves {
            true => exchange(&self.data, pg, out, &sizes, self.device)?,
            false => queues(self.data.size),
        };
        let mut parts = Vec::with_capacity(self.matrices.len());
        for (i, m) in self.matrices.iter().enumerate() {
            if !self.computers[i].contains(&me) {
                parts.push(None);
                continue;
            }
            let part = if self.holds_all(i, me) {
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

    /// Level 2: the parts this data index orthogonalizes, made whole on the ranks of the tensor
    /// group that orthogonalize them (`second`), and each rank's part of the result (flattened).
    fn across_tensor(
        &self,
        tensor: &Level,
        second: &[Vec<usize>],
        parts: Vec<Option<Tensor>>,
    ) -> Result<Vec<Option<Tensor>>> {
        let (me, size) = (tensor.rank, tensor.size);
        let mut unused = SingleProcess;
        let owned: Vec<usize> = (0..second.len())
            .filter(|&i| !second[i].is_empty())
            .collect();
        let part_of = |i: usize| -> Result<Tensor> {
            parts[i]
                .as_ref()
                .map(|p| p.reshape(-1))
                .ok_or_else(|| anyhow::anyhow!("internal: no part of Muon matrix {i}"))
        };
        // Inward: every part to each rank that orthogonalizes the matrix.
        let mut out = lists(size);
        let mut sizes: Vec<Vec<usize>> = vec![Vec::new(); size];
        for &i in &owned {
            for &c in &second[i] {
                for q in (0..size).filter(|&q| q != c) {
                    if q == me {
                        out[c].push(part_of(i)?);
                    }
                    if c == me {
                        sizes[q].push(self.matrices[i].numel());
                    }
                }
            }
        }
        let mut received = match owned.is_empty() {
            true => queues(size),
            false => exchange(tensor, &mut unused, out, &sizes, self.device)?,
        };
        // Orthogonalize; the owner sends each rank that did not its part of the result.
        let mut out = lists(size);
        let mut sizes: Vec<Vec<usize>> = vec![Vec::new(); size];
        let mut done: Vec<Option<Tensor>> = (0..second.len()).map(|_| None).collect();
        for &i in &owned {
            let m = &self.matrices[i];
            let owner = second[i][0];
            if !second[i].contains(&me) {
                sizes[owner].push(m.numel());
                continue;
            }
            let mut all = Vec::with_capacity(size);
            for (q, from) in received.iter_mut().enumerate() {
                let flat = match q == me {
                    true => part_of(i)?,
                    false => next(from)?,
                };
                all.push(flat.view(m.part));
            }
            let result = newton_schulz(&m.split.unshard(&all, &m.whole), self.steps)?;
            done[i] = Some(m.split.shard(&result, me, size).reshape(-1));
            if owner == me {
                for q in (0..size).filter(|q| !second[i].contains(q)) {
                    out[q].push(m.split.shard(&result, q, size).reshape(-1));
                }
            }
        }
        let moves = owned.iter().any(|&i| second[i].len() < size);
        let mut received = match moves {
            true => exchange(tensor, &mut unused, out, &sizes, self.device)?,
            false => queues(size),
        };
        for &i in &owned {
            if done[i].is_none() {
                done[i] = Some(next(&mut received[second[i][0]])?);
            }
        }
        Ok(done)
    }

    /// Level 1, outward: the pieces of the results of the matrices this rank owns (`done`:
    /// [rows, columns] or flattened) to their holders that did not orthogonalize them, and
    /// this rank's pieces of every matrix it holds.
    fn scatter_parts(
        &self,
        pg: &mut dyn ProcessGroup,
        done: Vec<Option<Tensor>>,
    ) -> Result<Vec<Tensor>> {
        let me = self.data.rank;
        let done: Vec<Option<Tensor>> = done.into_iter().map(|d| d.map(flat)).collect();
        let result = |i: usize| done[i].as_ref().expect("orthogonalized here");
        let mut out = lists(self.data.size);
        let mut sizes: Vec<Vec<usize>> = vec![Vec::new(); self.data.size];
        let mut moves = false;
        for (i, m) in self.matrices.iter().enumerate() {
            let owner = self.computers[i][0];
            for (q, r) in &m.holders {
                if self.computers[i].contains(q) {
                    continue;
                }
                moves = true;
                if owner == me {
                    out[*q].push(result(i).narrow(0, r.start as i64, r.len() as i64));
                }
                if *q == me {
                    sizes[owner].push(r.len());
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
            mine.push(match self.computers[i].contains(&me) {
                true => result(i).narrow(0, r.start as i64, r.len() as i64),
                false => next(&mut received[self.computers[i][0]])?,
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

    #[test]
    fn the_all_gather_variant_has_every_holder_orthogonalize() {
        let held = vec![vec![(0, 3), (1, 7)], vec![(1, 5), (2, 5)]];
        assert_eq!(
            computers(&[1.0, 1.0], &held, 3, true),
            [vec![0, 1], vec![1, 2]]
        );
        assert_eq!(computers(&[1.0, 1.0], &held, 3, false), [vec![1], vec![2]]);
    }
}
