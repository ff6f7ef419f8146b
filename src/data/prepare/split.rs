//! Where the validation tokens start: the cut near the last `val_fraction` of the tokens,
//! at a document boundary when one is near enough, and the check that there is something to
//! split.

use anyhow::{bail, Result};

use super::super::tokfile::partition_point;
use super::spec::PrepareSpec;

/// Where the validation part starts in a stream of `total` tokens whose `count` documents
/// start at `start(i)`, and whether that is a document boundary.
///
/// The target is the last `val_fraction` of tokens, at least one token on each side. The
/// nearest document start is used if it moves the validation size by at most half; otherwise
/// the cut falls inside a document, so a corpus of one big file still gets a split. It depends
/// on the tokens alone, not on the context length: a change of `training.context_length`
/// finds the same cache entry, and training checks each split against its windows.
pub(super) fn choose_cut(
    count: u64,
    start: impl Fn(u64) -> u64,
    total: u64,
    val_fraction: f64,
) -> (u64, bool) {
    let wanted = (total as f64 * val_fraction).round() as u64;
    let val = wanted.clamp(1, total - 1);
    let target = total - val;
    let tolerance = val / 2;
    let ok = |b: u64| b >= 1 && total - b >= 1 && b.abs_diff(target) <= tolerance;
    // The first document starting at or after the target.
    let lo = partition_point(count, |i| start(i) < target);
    let below = lo.checked_sub(1).map(&start);
    let above = (lo < count).then(|| start(lo));
    let best = [below, above]
        .into_iter()
        .flatten()
        .filter(|&b| ok(b))
        .min_by_key(|&b| b.abs_diff(target));
    match best {
        Some(b) => (b, true),
        None => (target, false),
    }
}

/// Fails unless the corpus has documents and, with a validation split, tokens for both sides.
pub(super) fn check_splittable(spec: &PrepareSpec, documents: u64, tokens: u64) -> Result<()> {
    if documents == 0 {
        bail!(
            "{}: the dataset has no documents (all .jsonl/.parquet files are empty); add text",
            spec.path.display()
        );
    }
    if spec.val_fraction > 0.0 && tokens < 2 {
        bail!(
            "{}: the dataset has only {tokens} token(s), too few to split off validation data; \
             set data.val_fraction to 0 or add text",
            spec.path.display()
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cut_rules() {
        let cut = |starts: &[u64], total, fraction| {
            choose_cut(starts.len() as u64, |i| starts[i as usize], total, fraction)
        };
        // Boundary close to the 10% target is taken.
        assert_eq!(cut(&[0, 50, 88, 95], 100, 0.1), (88, true));
        // Far boundaries are not: the cut falls inside the document.
        assert_eq!(cut(&[0, 50], 100, 0.1), (90, false));
        // A small fraction still leaves a token on each side.
        assert_eq!(cut(&[0], 100, 0.001), (99, false));
        // Tiny corpora still split.
        assert_eq!(cut(&[0], 2, 0.5), (1, false));
    }
}
