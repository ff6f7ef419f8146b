//! The flat parameter space of sharded data parallelism (`system.zero_stage` ≥ 1): which rank
//! owns which elements of which parameter.
//!
//! Every trainable parameter gets a range of one flat index space, group by group in the order
//! of the optimizer's groups (its update rules: with AdamW the weight-decayed parameters,
//! matrices and embeddings, then the 1-D ones, norm weights; with Muon its matrices before
//! those), each group in the order it is given (Hugging Face order), so any contiguous slice
//! meets each group in one contiguous range. The
//! space is padded to a multiple of the world size N, and rank r owns the contiguous slice
//! `[r·S, (r+1)·S)` with `S = padded / N`: its fp32 master weights, AdamW moments and (stage 2)
//! gradient shard are exactly that slice. A checkpoint records each parameter's piece by its
//! element range, so any layout can be re-cut into any other (another world size or stage).
//!
//! Pure index arithmetic: no tensors here.

use std::ops::Range;

/// One parameter's place in the flat space.
#[derive(Debug, Clone, PartialEq)]
pub struct FlatParam {
    pub name: String,
    pub numel: usize,
    /// First element in the flat space.
    pub start: usize,
    /// The optimizer's group (the space holds group 0's parameters first, then group 1's, ...).
    pub group: usize,
    /// Index in the caller's parameter list.
    pub index: usize,
}

impl FlatParam {
    pub fn range(&self) -> Range<usize> {
        self.start..self.start + self.numel
    }
}

/// The part of one parameter that falls into a flat range.
#[derive(Debug, Clone, PartialEq)]
pub struct Piece {
    /// Position in [`FlatLayout::params`].
    pub param: usize,
    /// Element range within the parameter (flattened).
    pub local: Range<usize>,
    /// The same elements in the flat space.
    pub flat: Range<usize>,
}

#[derive(Debug, Clone)]
pub struct FlatLayout {
    /// In flat order: group by group.
    pub params: Vec<FlatParam>,
    /// Elements of all parameters (before padding).
    pub total: usize,
    /// Ranks the space is cut for.
    pub world: usize,
    /// Elements each rank owns (`padded / world`).
    pub shard: usize,
}

impl FlatLayout {
    /// `params`: (name, number of elements, the optimizer's group) in the caller's order.
    pub fn new<'a>(
        params: impl IntoIterator<Item = (&'a str, usize, usize)>,
        world: usize,
    ) -> Self {
        let given: Vec<(&str, usize, usize)> = params.into_iter().collect();
        let mut out = Vec::with_capacity(given.len());
        let mut at = 0;
        let groups = given.iter().map(|&(_, _, g)| g + 1).max().unwrap_or(0);
        for group in 0..groups {
            for (index, &(name, numel, g)) in given.iter().enumerate() {
                if g == group {
                    out.push(FlatParam {
                        name: name.to_string(),
                        numel,
                        start: at,
                        group,
                        index,
                    });
                    at += numel;
                }
            }
        }
        let world = world.max(1);
        FlatLayout {
            params: out,
            total: at,
            world,
            shard: at.div_ceil(world),
        }
    }

    /// The padded size of the space.
    pub fn padded(&self) -> usize {
        self.shard * self.world
    }

    /// The slice rank `r` owns.
    pub fn owned(&self, r: usize) -> Range<usize> {
        r * self.shard..(r + 1) * self.shard
    }

    /// Each rank's share of a flat range (the pieces of an uneven reduce-scatter/all-gather).
    pub fn splits(&self, range: &Range<usize>) -> Vec<usize> {
        (0..self.world)
            .map(|r| intersect(range, &self.owned(r)).len())
            .collect()
    }

    /// The flat range of group `group`'s parameters (empty where it has none).
    pub fn group_range(&self, group: usize) -> Range<usize> {
        let from = |g: usize| {
            let at = self.params.partition_point(|p| p.group < g);
            self.params.get(at).map_or(self.total, |p| p.start)
        };
        from(group)..from(group + 1)
    }

    /// The parameter pieces inside a flat range, in flat order (padding has none).
    pub fn pieces(&self, range: Range<usize>) -> Vec<Piece> {
        // Parameters are sorted by start; find the first that ends after range.start.
        let first = self
            .params
            .partition_point(|p| p.start + p.numel <= range.start);
        self.params[first..]
            .iter()
            .enumerate()
            .take_while(|(_, p)| p.start < range.end)
            .filter_map(|(i, p)| {
                let flat = intersect(&range, &p.range());
                (!flat.is_empty()).then(|| Piece {
                    param: first + i,
                    local: flat.start - p.start..flat.end - p.start,
                    flat,
                })
            })
            .collect()
    }

    /// Consecutive ranges of at most `cap` elements covering the padded space: the buckets the
    /// gradients are reduce-scattered and the parameters all-gathered in.
    pub fn buckets(&self, cap: usize) -> Vec<Range<usize>> {
        super::buckets::ranges(self.padded(), cap)
    }

    /// The ranks whose slices hold part of `p`, ascending, each with the elements of `p`
    /// (flattened) it holds.
    pub fn holders(&self, p: &FlatParam) -> Vec<(usize, Range<usize>)> {
        if p.numel == 0 {
            return Vec::new();
        }
        let shard = self.shard.max(1);
        (p.start / shard..=(p.start + p.numel - 1) / shard)
            .map(|r| {
                let flat = intersect(&p.range(), &self.owned(r));
                (r, flat.start - p.start..flat.end - p.start)
            })
            .collect()
    }

    /// The rank whose slice holds a parameter's first element: the one that writes the
    /// parameter into a checkpoint.
    pub fn writer(&self, p: &FlatParam) -> usize {
        (p.start / self.shard.max(1)).min(self.world - 1)
    }
}

/// One piece of a [`Span`]: part of a parameter, where it sits in the span's buffer.
#[derive(Debug, Clone, PartialEq)]
pub struct SpanPiece {
    /// Position in [`FlatLayout::params`].
    pub param: usize,
    /// Element range within the parameter (flattened).
    pub local: Range<usize>,
    /// The same elements in the span's buffer.
    pub buf: Range<usize>,
    /// The same elements in the flat space.
    pub flat: Range<usize>,
}

/// Some parameters (a model unit's) in one buffer laid out rank by rank: rank 0's pieces of
/// them, then rank 1's, ... (each rank's in flat order), so that a reduce-scatter or an
/// all-gather over the buffer with [`Span::splits`] leaves each rank its own pieces, and those
/// pieces are the unit's elements of its slice. Built once per unit.
#[derive(Debug, Clone, PartialEq)]
pub struct Span {
    pub pieces: Vec<SpanPiece>,
    /// Elements of each rank in the buffer, in rank order.
    pub splits: Vec<usize>,
}

impl Span {
    /// Elements in the buffer.
    pub fn len(&self) -> usize {
        self.splits.iter().sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Where each parameter of the span lies whole in the buffer, in order: (position in
    /// [`FlatLayout::params`], its first element there). A parameter cut between ranks r and
    /// r+1 is the last piece of rank r's (it runs to the end of r's slice) and the first of
    /// rank r+1's, so its pieces are adjacent and in order: the buffer holds every parameter
    /// contiguously, and a view of it can stand for the parameter.
    pub fn placements(&self) -> Vec<(usize, usize)> {
        let mut at: Vec<(usize, usize)> = Vec::new();
        for p in &self.pieces {
            let start = p.buf.start - p.local.start;
            match at.iter().find(|(param, _)| *param == p.param) {
                Some(&(_, s)) => {
                    assert_eq!(s, start, "internal: a parameter cut apart in its span")
                }
                None => at.push((p.param, start)),
            }
        }
        at
    }

    /// The pieces rank `r` owns, with the offset of each in that rank's slice.
    pub fn owned_by<'a>(
        &'a self,
        layout: &'a FlatLayout,
        r: usize,
    ) -> impl Iterator<Item = (&'a SpanPiece, usize)> + 'a {
        let owned = layout.owned(r);
        let start = owned.start;
        self.pieces
            .iter()
            .filter(move |p| owned.contains(&p.flat.start))
            .map(move |p| (p, p.flat.start - start))
    }
}

impl FlatLayout {
    /// The [`Span`] of the parameters at these positions in [`FlatLayout::params`].
    pub fn span(&self, members: &[usize]) -> Span {
        let mut ranges: Vec<(usize, Range<usize>)> = members
            .iter()
            .map(|&i| (i, self.params[i].range()))
            .collect();
        ranges.sort_by_key(|(_, r)| r.start);
        let mut pieces = Vec::new();
        let mut splits = vec![0; self.world];
        let mut at = 0;
        for (r, split) in splits.iter_mut().enumerate() {
            for (i, range) in &ranges {
                let flat = intersect(range, &self.owned(r));
                if flat.is_empty() {
                    continue;
                }
                let start = self.params[*i].start;
                let flat_len = flat.len();
                pieces.push(SpanPiece {
                    param: *i,
                    local: flat.start - start..flat.end - start,
                    buf: at..at + flat_len,
                    flat,
                });
                at += flat_len;
                *split += flat_len;
            }
        }
        Span { pieces, splits }
    }

    /// Position in [`FlatLayout::params`] of each parameter, by the caller's index.
    pub fn positions(&self) -> Vec<usize> {
        let mut at = vec![0; self.params.len()];
        for (pos, p) in self.params.iter().enumerate() {
            at[p.index] = pos;
        }
        at
    }
}

/// The overlap of two ranges (empty when they do not meet).
pub fn intersect(a: &Range<usize>, b: &Range<usize>) -> Range<usize> {
    let (s, e) = (a.start.max(b.start), a.end.min(b.end));
    if s < e {
        s..e
    } else {
        s..s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(world: usize) -> FlatLayout {
        // HF order: embedding (group 0), a norm (group 1), a matrix (group 0), the final norm.
        FlatLayout::new(
            [
                ("embed", 12, 0),
                ("norm1", 4, 1),
                ("w", 6, 0),
                ("norm", 4, 1),
            ],
            world,
        )
    }

    #[test]
    fn groups_come_in_order_and_the_space_is_padded() {
        let l = layout(3);
        let order: Vec<(&str, usize)> = l
            .params
            .iter()
            .map(|p| (p.name.as_str(), p.start))
            .collect();
        assert_eq!(
            order,
            [("embed", 0), ("w", 12), ("norm1", 18), ("norm", 22)]
        );
        assert_eq!((l.total, l.shard, l.padded()), (26, 9, 27));
        assert_eq!(l.owned(2), 18..27);
        assert_eq!(l.params[1].index, 2, "w is the caller's third parameter");
        assert_eq!([l.group_range(0), l.group_range(1)], [0..18, 18..26]);
        assert_eq!(l.group_range(2), 26..26, "a group without parameters");
    }

    #[test]
    fn pieces_and_splits_cover_a_range_exactly() {
        let l = layout(3);
        let p = l.pieces(10..20);
        let names: Vec<(&str, Range<usize>)> = p
            .iter()
            .map(|x| (l.params[x.param].name.as_str(), x.local.clone()))
            .collect();
        assert_eq!(names, [("embed", 10..12), ("w", 0..6), ("norm1", 0..2)]);
        assert_eq!(l.splits(&(10..20)), [0, 8, 2]);
        assert_eq!(l.splits(&(0..27)), [9, 9, 9]);
        assert!(l.pieces(26..27).is_empty(), "padding holds no parameter");
        let covered: usize = l.buckets(5).iter().map(|b| b.len()).sum();
        assert_eq!(covered, 27);
        assert_eq!(l.buckets(5).last(), Some(&(25..27)));
    }

    #[test]
    fn a_parameter_is_written_by_the_owner_of_its_first_element() {
        let l = layout(2);
        assert_eq!(l.writer(&l.params[1]), 0, "w starts at 12 < 13");
        // w is 12..18 of slices of 13: 1 element on rank 0, 5 on rank 1.
        assert_eq!(l.holders(&l.params[1]), [(0, 0..1), (1, 1..6)]);
        assert_eq!(l.holders(&l.params[0]), [(0, 0..12)]);
        assert_eq!(l.writer(&l.params[2]), 1, "norm1 starts at 18");
    }

    #[test]
    fn a_span_is_laid_out_rank_by_rank_and_covers_its_parameters_once() {
        let l = layout(3); // embed 0..12, w 12..18, norm1 18..22, norm 22..26; slices of 9
        let span = l.span(&[1, 2]); // w and norm1: flat 12..22
        assert_eq!(span.splits, [0, 6, 4]);
        let got: Vec<(usize, Range<usize>, Range<usize>)> = span
            .pieces
            .iter()
            .map(|p| (p.param, p.local.clone(), p.buf.clone()))
            .collect();
        assert_eq!(got, [(1, 0..6, 0..6), (2, 0..4, 6..10)]);
        let mine: Vec<usize> = span.owned_by(&l, 2).map(|(_, at)| at).collect();
        assert_eq!(mine, [0], "norm1 starts rank 2's slice");
        assert_eq!(l.positions(), [0, 2, 1, 3]);
    }

    #[test]
    fn every_parameter_lies_whole_in_its_span_buffer() {
        for world in 1..=7 {
            let l = layout(world);
            for members in [vec![0], vec![1, 2], vec![0, 1, 2, 3], vec![0, 3], vec![2]] {
                let span = l.span(&members);
                let placed = span.placements(); // asserts adjacency of a parameter's pieces
                assert_eq!(placed.len(), members.len(), "world {world}, {members:?}");
                for (param, start) in placed {
                    let numel = l.params[param].numel;
                    let pieces: usize = span
                        .pieces
                        .iter()
                        .filter(|p| p.param == param)
                        .map(|p| p.local.len())
                        .sum();
                    assert_eq!(pieces, numel, "world {world}: all of parameter {param}");
                    assert!(start + numel <= span.len());
                }
            }
        }
    }

    #[test]
    fn one_rank_owns_everything() {
        let l = layout(1);
        assert_eq!((l.shard, l.owned(0)), (26, 0..26));
        assert_eq!(l.splits(&(0..26)), [26]);
    }
}
