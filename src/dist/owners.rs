//! Which rank does the work of each of a set of items that ranks hold pieces of: Muon's
//! matrices, each orthogonalized by one owner (`train/optim/orthogonal.rs`); `lockstep plan`
//! runs the same rule to count each rank's share (`plan/muon.rs`). Pure arithmetic.

/// For each item (a matrix: its Newton–Schulz cost, and by rank the elements held; an empty
/// list where every rank holds all of it), the rank that
/// assembles and orthogonalizes it. The costliest matrices are placed first (ties: the earlier
/// matrix); each goes to the rank holding most of it (among equal holders the least loaded, then
/// the lower rank), so that it moves nowhere, unless that would take the rank's work past 1.1 ×
/// an equal share of the total while a rank with less work exists: then to the least loaded
/// rank. A flat slice holds about equal
/// elements on every rank, so a large model's matrices mostly stay where they are; a slice of
/// embeddings (AdamW's) holds none, and the matrices of the ranks that do are shared with it.
pub fn owners(costs: &[f64], held: &[Vec<(usize, usize)>], world: usize) -> Vec<usize> {
    let share = 1.1 * costs.iter().sum::<f64>() / world as f64;
    let mut order: Vec<usize> = (0..costs.len()).collect();
    order.sort_by(|&a, &b| costs[b].total_cmp(&costs[a]).then(a.cmp(&b)));
    let mut load = vec![0.0f64; world];
    let mut owner = vec![0; costs.len()];
    let least = |load: &[f64], among: &mut dyn Iterator<Item = usize>| {
        among
            .min_by(|&a, &b| load[a].total_cmp(&load[b]).then(a.cmp(&b)))
            .expect("internal: no rank to orthogonalize a Muon matrix")
    };
    for i in order {
        let most = held[i].iter().map(|&(_, n)| n).max().unwrap_or(0);
        let mut holders = held[i].iter().filter(|&&(_, n)| n == most).map(|&(r, _)| r);
        let local = match held[i].is_empty() {
            true => least(&load, &mut (0..world)),
            false => least(&load, &mut holders),
        };
        let pick = if load[local] + costs[i] <= share {
            local
        } else {
            let elsewhere = least(&load, &mut (0..world));
            if load[local] <= load[elsewhere] {
                local
            } else {
                elsewhere
            }
        };
        load[pick] += costs[i];
        owner[i] = pick;
    }
    owner
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A matrix inside one rank's slice stays there; a straddling one goes to the larger
    /// holder; replicated matrices are shared out by cost, the costliest first; a rank that
    /// holds more than its share keeps about its share, the rest going to the least loaded.
    #[test]
    fn owners_keep_matrices_local_and_share_the_work() {
        let held = vec![vec![(0, 10)], vec![(0, 3), (1, 7)], vec![(1, 5), (2, 5)]];
        assert_eq!(owners(&[1.0, 1.0, 1.0], &held, 3), [0, 1, 2]);
        let everywhere = vec![vec![(0, 4), (1, 4)]; 4];
        assert_eq!(owners(&[1.0, 8.0, 2.0, 3.0], &everywhere, 2), [1, 0, 1, 1]);
        let unlisted = vec![Vec::new(); 4];
        assert_eq!(owners(&[1.0, 8.0, 2.0, 3.0], &unlisted, 2), [1, 0, 1, 1]);
        // Rank 0 holds all of 12: it keeps 4 + 2 (≤ 1.1 × 6), rank 1 takes 3 + 3.
        let one = vec![vec![(0, 9)]; 4];
        assert_eq!(owners(&[4.0, 3.0, 3.0, 2.0], &one, 2), [0, 1, 1, 0]);
    }
}
