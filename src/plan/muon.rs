//! Muon's costs per rank (`training.optimizer = muon`; `train/optim/muon.rs` and
//! `train/optim/orthogonal.rs`), counted on the same flat layout and by the same owner rule
//! (`dist::owners`) the optimizer uses, for the busiest rank:
//!
//! - State: one fp32 momentum buffer per element of the decoder layers' matrices, where AdamW
//!   keeps two moments. Replicated (stage 0) a rank keeps 8·A + 4·M bytes of what it holds (A
//!   AdamW elements, M Muon ones). Sharded (stages 1 to 3), a slice holds Muon's matrices first
//!   and AdamW's parameters after them, so the ranks whose slices hold the embeddings keep two
//!   moments per element and the others one: the busiest rank is the one with the most AdamW
//!   elements.
//! - Newton–Schulz: [`ns_flops`] per matrix, on its owner among the state's ranks, and with
//!   tensor parallelism shared out over the owner's tensor group.
//! - Exchange (bf16, 2 B per element): a matrix whose owner holds all of it moves nowhere
//!   (inside one slice; sharded, that is most of a large model's); otherwise each other holder
//!   sends the owner its piece and receives the result's piece back, and at stage 0 the owner
//!   sends the whole result to every other rank. With tensor parallelism (T) the parts of a
//!   matrix travel to its owner in the tensor group and back: 2 × 2 B × (T − 1)/T of the part per
//!   rank of that group.
//!
//! None of it overlaps: the optimizer step runs after the reductions, so the seconds are on
//! the critical path of every step. Expert parallelism: the experts' optimizer is its own, over
//! their holders; the busiest rank's costs of both are added.

use serde::Serialize;

use super::setting::Setting;
use crate::config::ZeroStage;
use crate::dist::flat_layout::FlatLayout;
use crate::dist::owners::owners;
use crate::model::Parameter;

/// FLOPs of one Newton–Schulz orthogonalization of an `a` × `b` matrix in `steps` iterations
/// (n = min(a, b), m = max(a, b)): per iteration the Gram matrix X·Xᵀ (2·n²·m), its square
/// (2·n³) and the product with X (2·n²·m). The owners' balance (`train/optim/orthogonal.rs`)
/// counts it too.
pub fn ns_flops([a, b]: [i64; 2], steps: usize) -> f64 {
    let (n, m) = (a.min(b) as f64, a.max(b) as f64);
    steps as f64 * (4.0 * n * n * m + 2.0 * n * n * n)
}

/// What Muon costs the busiest rank per step.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct MuonCost {
    /// Elements of the matrices Muon updates (the whole model's), and their Newton–Schulz FLOPs
    /// per step, all of them.
    pub matrices: f64,
    pub total_flops: f64,
    /// The optimizer's moments (bytes): AdamW's two fp32 moments per element of the other
    /// parameters, one fp32 momentum buffer per element of the matrices.
    pub moments: f64,
    /// Newton–Schulz FLOPs per step.
    pub flops: f64,
    /// bf16 bytes sent per step assembling matrices and returning results, among the state's
    /// ranks and within the tensor group.
    pub bytes: f64,
    pub tensor_bytes: f64,
    /// Seconds per step: the FLOPs at the assumed utilisation, the bytes over their links.
    pub seconds: f64,
}

/// One rank's share of a layout's costs.
#[derive(Debug, Clone, Copy, Default)]
struct RankCost {
    moments: f64,
    flops: f64,
    bytes: f64,
    tensor_bytes: f64,
}

/// Muon's costs at zero `stage` on `world` ranks; None without Muon.
pub fn cost(s: &Setting, stage: ZeroStage, world: usize) -> Option<MuonCost> {
    let steps = s.muon?;
    let group = if stage.shards_optimizer() {
        s.shard_ranks(world)
    } else {
        s.replica_ranks(world)
    };
    let ep = s.expert_parallel.max(1);
    // With expert parallelism the rank's experts are position 0's (each position's alike).
    let per = s.shape.moe.as_ref().map_or(0, |m| m.num_experts / ep);
    let (dense, experts): (Vec<&Parameter>, Vec<&Parameter>) = s
        .parameters
        .iter()
        .filter(|p| ep == 1 || p.expert.is_none_or(|e| e < per))
        .partition(|p| ep == 1 || p.expert.is_none());
    let mut most = busiest(s, &dense, stage, group, steps);
    if !experts.is_empty() {
        let e = busiest(s, &experts, stage, (group / ep).max(1), steps);
        most.moments += e.moments;
        most.flops += e.flops;
        most.bytes += e.bytes;
        most.tensor_bytes += e.tensor_bytes;
    }
    let seconds = most.flops / (s.peak_flops * s.mfu)
        + most.bytes / super::comm::data_parallel_bandwidth(s, group)
        + most.tensor_bytes / super::tensor::bandwidth(s);
    Some(MuonCost {
        matrices: matrix_elements(s, 1),
        total_flops: s
            .parameters
            .iter()
            .filter(|p| p.is_layer_matrix())
            .map(|p| ns_flops(whole(p), steps))
            .sum(),
        moments: most.moments,
        flops: most.flops,
        bytes: most.bytes,
        tensor_bytes: most.tensor_bytes,
        seconds,
    })
}

/// Elements of the matrices Muon updates on a rank of a tensor group of `t` (its parts; the
/// whole model's at 1).
pub fn matrix_elements(s: &Setting, t: usize) -> f64 {
    s.parameters
        .iter()
        .filter(|p| p.is_layer_matrix())
        .map(|p| local(p, t) as f64)
        .sum()
}

fn whole(p: &Parameter) -> [i64; 2] {
    [p.shape[0], p.shape[1]]
}

/// Elements of `p` on a rank of a tensor group of `t`.
fn local(p: &Parameter, t: usize) -> usize {
    p.split.local_shape(&p.shape, t).iter().product::<i64>() as usize
}

/// The busiest rank's costs of a layout of `params` over a level-1 group of `group` ranks:
/// each quantity's maximum over the ranks (the rank with the most AdamW elements holds the
/// most moments; the owners' balance makes the others alike).
fn busiest(
    s: &Setting,
    params: &[&Parameter],
    stage: ZeroStage,
    group: usize,
    steps: usize,
) -> RankCost {
    let t = s.tensor_parallel;
    let moment_bytes = |p: &Parameter| if p.is_layer_matrix() { 4.0 } else { 8.0 };
    let mut ranks = vec![RankCost::default(); group];
    // The matrices (in the order the optimizer lists them) and who holds what of their parts:
    // by rank (sharded), or none listed where every rank holds all of each (replicated).
    let mut matrices: Vec<(&Parameter, Vec<(usize, usize)>)> = Vec::new();
    if stage.shards_optimizer() {
        let layout = FlatLayout::new(
            params.iter().map(|p| {
                let rule = match (p.is_layer_matrix(), p.shape.len() >= 2) {
                    (true, _) => 0,
                    (false, true) => 1,
                    (false, false) => 2,
                };
                (p.name.as_str(), local(p, t), rule)
            }),
            group,
        );
        for (r, rank) in ranks.iter_mut().enumerate() {
            for piece in layout.pieces(layout.owned(r)) {
                let p = params[layout.params[piece.param].index];
                rank.moments += moment_bytes(p) * piece.local.len() as f64;
            }
        }
        for f in layout.params.iter().filter(|f| f.group == 0) {
            let held = layout
                .holders(f)
                .into_iter()
                .map(|(r, e)| (r, e.len()))
                .collect();
            matrices.push((params[f.index], held));
        }
    } else {
        let state: f64 = params
            .iter()
            .map(|p| moment_bytes(p) * local(p, t) as f64)
            .sum();
        for rank in &mut ranks {
            rank.moments = state;
        }
        for p in params.iter().filter(|p| p.is_layer_matrix()) {
            matrices.push((p, Vec::new()));
        }
    }
    let costs: Vec<f64> = matrices
        .iter()
        .map(|(p, _)| ns_flops(whole(p), steps))
        .collect();
    let held: Vec<Vec<(usize, usize)>> = matrices.iter().map(|(_, h)| h.clone()).collect();
    for (i, o) in owners(&costs, &held, group).into_iter().enumerate() {
        let (p, holders) = &matrices[i];
        let part = local(p, t) as f64;
        // Level 2: shared out over the owner's tensor group; each of its ranks sends (T − 1)/T
        // of the part to the matrix's owner there and back.
        ranks[o].flops += costs[i] / t as f64;
        ranks[o].tensor_bytes += 2.0 * 2.0 * part * (t - 1) as f64 / t as f64;
        // Replicated: the owner sends the result to every other rank.
        if holders.is_empty() {
            ranks[o].bytes += 2.0 * part * (group - 1) as f64;
        }
        let owner_holds = holders.iter().any(|&(r, n)| r == o && n as f64 == part);
        for &(q, n) in holders.iter().filter(|&&(q, _)| q != o) {
            let piece = 2.0 * n as f64;
            if !owner_holds {
                ranks[q].bytes += piece;
            }
            ranks[o].bytes += piece;
        }
    }
    let max = |f: fn(&RankCost) -> f64| ranks.iter().map(f).fold(0.0, f64::max);
    RankCost {
        moments: max(|r| r.moments),
        flops: max(|r| r.flops),
        bytes: max(|r| r.bytes),
        tensor_bytes: max(|r| r.tensor_bytes),
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_setting;
    use super::*;

    /// Llama-3.1-8B's shape on 8 ranks: replicated, every rank keeps one momentum buffer per
    /// matrix element (4 B) and AdamW's two moments (8 B) for the embedding, head and norms,
    /// and orthogonalizes an eighth of the work give or take a matrix, receiving the other
    /// results; sharded at stage 1, the ranks whose slices hold the embeddings keep 8 B per
    /// element of their slice, and few matrices move.
    #[test]
    fn the_state_halves_for_the_matrices_and_the_work_is_shared() {
        let (mut s, _) = test_setting(&["model.vocab_size=128256", "model.num_layers=8"], 8);
        s.muon = Some(5);
        let p = s.parameters.count() as f64;
        let m = matrix_elements(&s, 1);
        assert!(m > 0.6 * p && m < p, "{m} of {p}");
        let zero = cost(&s, ZeroStage::Replicated, 8).unwrap();
        assert!((zero.moments - (8.0 * (p - m) + 4.0 * m)).abs() < 1.0);
        let eighth = zero.total_flops / 8.0;
        assert!(
            zero.flops >= 0.999 * eighth && zero.flops < 1.2 * eighth,
            "{zero:?}"
        );
        // Each rank receives the results it did not compute: 7/8 of the matrices, once.
        assert!(
            (zero.bytes / (2.0 * m) - 7.0 / 8.0).abs() < 0.15,
            "{}",
            zero.bytes
        );
        let one = cost(&s, ZeroStage::Optimizer, 8).unwrap();
        let slice = p / 8.0;
        assert!(one.moments <= 8.0 * slice + 8.0 && one.moments > 4.0 * slice);
        assert!(
            one.bytes < 0.5 * zero.bytes,
            "{} vs {}",
            one.bytes,
            zero.bytes
        );
        // One layer's matrix: 5 × (4·n²·m + 2·n³).
        assert_eq!(
            ns_flops([4096, 14336], 5),
            5.0 * (4.0 * 4096f64.powi(2) * 14336.0 + 2.0 * 4096f64.powi(3))
        );
        s.muon = None;
        assert!(cost(&s, ZeroStage::Replicated, 8).is_none());
    }
}
