//! Hub names: a repo id (`owner/name` or `owner/name@revision`), and what may name a Hub
//! dataset.

use std::path::Path;

/// A repo name segment as the Hub allows it: letters, digits, `-`, `_`, `.`, not starting or
/// ending with `.`/`-`, no `..`.
fn valid_segment(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 96
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        && !s.starts_with(['.', '-'])
        && !s.ends_with(['.', '-'])
        && !s.contains("..")
}

/// `owner/name` or `owner/name@revision`, split.
pub(super) fn parse_repo_id(id: &str) -> Option<(&str, &str, Option<&str>)> {
    let (repo, revision) = match id.split_once('@') {
        Some((r, rev)) if !rev.is_empty() && !rev.contains(['/', '\\']) => (r, Some(rev)),
        Some(_) => return None,
        None => (id, None),
    };
    let (owner, name) = repo.split_once('/')?;
    (valid_segment(owner) && valid_segment(name)).then_some((owner, name, revision))
}

/// True for `owner/name[@revision]` that is not an existing local path: a Hub model id.
pub fn is_hub_model_id(s: &str) -> bool {
    !Path::new(s).exists() && parse_repo_id(s).is_some()
}

/// True when a `data.path` that does not exist could name a Hub dataset: one to a few relative
/// `/`-separated segments, no file extension on the first two (so a mistyped `corpus.txt` still
/// gets the ordinary file-not-found error).
pub fn looks_like_dataset_name(s: &str) -> bool {
    let parts: Vec<&str> = s.split('/').collect();
    (1..=4).contains(&parts.len())
        && parts.iter().all(|p| valid_segment(p))
        && parts.iter().take(2).all(|p| {
            !p.rsplit_once('.').is_some_and(|(_, ext)| {
                ["txt", "jsonl", "json", "parquet", "tok", "bin", "csv"].contains(&ext)
            })
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repo_ids_and_dataset_names() {
        assert_eq!(
            parse_repo_id("meta-llama/Llama-3.1-8B"),
            Some(("meta-llama", "Llama-3.1-8B", None))
        );
        assert_eq!(parse_repo_id("a/b@v1.0"), Some(("a", "b", Some("v1.0"))));
        for bad in [
            "a", "a/b/c", "/abs/x", "./x/y", "a/..", "a/b@", "a/.b", "a b/c",
        ] {
            assert_eq!(parse_repo_id(bad), None, "{bad}");
        }
        for ok in [
            "wikitext-103-raw-v1",
            "Salesforce/wikitext",
            "HuggingFaceFW/fineweb/sample/10BT",
        ] {
            assert!(looks_like_dataset_name(ok), "{ok}");
        }
        for bad in [
            "corpus.txt",
            "data/x.jsonl",
            "/abs/data",
            "../x",
            "a/b/c/d/e",
            "",
        ] {
            assert!(!looks_like_dataset_name(bad), "{bad}");
        }
    }
}
