//! Tests of preparing a dataset through the entry points: cache hits and misses, the split,
//! large and `.jsonl` inputs, token files used in place, leftovers of killed builds.

use super::*;
use crate::data::sources::list_files;
use std::time::UNIX_EPOCH;

fn spec(path: &Path, cache: &Path) -> PrepareSpec {
    PrepareSpec {
        tokenizer: "gpt2".into(),
        path: path.to_path_buf(),
        text_field: "text".into(),
        val_fraction: 0.1,
        num_samples: None,
        cache_dir: cache.to_path_buf(),
        num_threads: 2,
        progress: false,
    }
}

fn corpus(dir: &Path) -> PathBuf {
    let data = dir.join("corpus");
    fs::create_dir_all(data.join("more")).unwrap();
    for i in 0..6 {
        let text = format!("Document {i}. ").repeat(40 + i * 7);
        fs::write(data.join(format!("d{i}.txt")), text).unwrap();
    }
    fs::write(data.join("more/e.txt"), "Last one, short.").unwrap();
    data
}

fn all_tokens(path: &Path) -> Vec<u32> {
    let f = TokenFile::open(path).unwrap();
    (0..f.num_tokens()).map(|i| f.get(i)).collect()
}

fn docs_end_with_eos(path: &Path, eos: u32) {
    let f = TokenFile::open(path).unwrap();
    assert!(f.num_docs() > 0);
    for d in 0..f.num_docs() {
        let end = if d + 1 < f.num_docs() {
            f.doc_offset(d + 1)
        } else {
            f.num_tokens()
        };
        assert_eq!(f.get(end - 1), eos, "document {d} of {}", path.display());
    }
}

#[test]
fn second_run_is_a_cache_hit() {
    let dir = tempfile::tempdir().unwrap();
    let data = corpus(dir.path());
    let s = spec(&data, &dir.path().join("cache"));
    let a = prepare(&s).unwrap();
    assert!(!a.cache_hit);
    assert_eq!(a.eos_id, 50256);
    let train = fs::read(&a.train[0].path).unwrap();
    let val = fs::read(a.val.as_ref().unwrap()).unwrap();
    assert!(a.dir.join("meta.json").is_file());

    let b = prepare(&s).unwrap();
    assert!(b.cache_hit);
    assert_eq!(b.dir, a.dir);
    assert_eq!(
        (b.train_tokens, b.val_tokens),
        (a.train_tokens, a.val_tokens)
    );
    assert_eq!(fs::read(&b.train[0].path).unwrap(), train);
    assert_eq!(fs::read(b.val.unwrap()).unwrap(), val);
    // Only the entry itself is left in the cache, no temporary builds.
    assert_eq!(fs::read_dir(dir.path().join("cache")).unwrap().count(), 1);
}

#[test]
fn changed_file_is_a_miss() {
    let dir = tempfile::tempdir().unwrap();
    let data = corpus(dir.path());
    let s = spec(&data, &dir.path().join("cache"));
    let a = prepare(&s).unwrap();
    fs::write(data.join("d0.txt"), "Document changed. ".repeat(40)).unwrap();
    let b = prepare(&s).unwrap();
    assert!(!b.cache_hit);
    assert_ne!(a.dir, b.dir);
    assert_ne!(all_tokens(&a.train[0].path), all_tokens(&b.train[0].path));
    // Same size, new mtime only.
    let f = fs::File::options()
        .write(true)
        .open(data.join("d0.txt"))
        .unwrap();
    f.set_modified(UNIX_EPOCH + std::time::Duration::from_secs(12345))
        .unwrap();
    assert!(!prepare(&s).unwrap().cache_hit);
}

#[test]
fn split_adds_up_and_documents_end_with_eos() {
    let dir = tempfile::tempdir().unwrap();
    let data = corpus(dir.path());
    let tok = Tokenizer::load("gpt2").unwrap();
    let mut expected = Vec::new();
    for f in list_files(&data).unwrap() {
        expected.extend(tok.encode(&fs::read_to_string(f).unwrap()));
        expected.push(50256);
    }
    let s = spec(&data, &dir.path().join("cache"));
    let p = prepare(&s).unwrap();
    let (train, val) = (
        all_tokens(&p.train[0].path),
        all_tokens(p.val.as_ref().unwrap()),
    );
    docs_end_with_eos(&p.train[0].path, 50256);
    docs_end_with_eos(p.val.as_ref().unwrap(), 50256);
    let total = expected.len() as u64;
    let meta: Value = serde_json::from_slice(&fs::read(p.dir.join("meta.json")).unwrap()).unwrap();
    if meta["split_at_document_boundary"].as_bool().unwrap() {
        assert_eq!(p.train_tokens + p.val_tokens, total);
        assert_eq!([train, val].concat(), expected);
    } else {
        assert_eq!(p.train_tokens + p.val_tokens, total + 1);
    }
    let share = p.val_tokens as f64 / total as f64;
    assert!((0.05..=0.15).contains(&share), "val share {share}");
}

#[test]
fn one_document_is_split_inside() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("one.txt");
    fs::write(&file, "word ".repeat(1000)).unwrap();
    let p = prepare(&spec(&file, &dir.path().join("cache"))).unwrap();
    let whole = Tokenizer::load("gpt2")
        .unwrap()
        .encode(&"word ".repeat(1000));
    let total = whole.len() as u64 + 1;
    // One extra EOS closes the train half of the split document.
    assert_eq!(p.train_tokens + p.val_tokens, total + 1);
    assert_eq!(p.val_tokens, (total as f64 * 0.1).round() as u64);
    let train = all_tokens(&p.train[0].path);
    let val = all_tokens(p.val.as_ref().unwrap());
    assert_eq!(
        [&train[..train.len() - 1], &val[..]].concat(),
        [whole, vec![50256]].concat()
    );
    docs_end_with_eos(&p.train[0].path, 50256);
}

#[test]
fn a_large_text_file_streams_in_pieces_with_the_same_tokens() {
    // Larger than the unit tests' 64 KiB .txt piece: read, cut and encoded in pieces, with
    // characters of 2, 3 and 4 bytes across piece boundaries, long lines without a break,
    // and a byte-order mark in front.
    let dir = tempfile::tempdir().unwrap();
    let mut text = String::new();
    for i in 0..6000 {
        text.push_str(&format!("word{i} café 日本 🦀 and more words "));
        if i % 500 == 0 {
            text.push_str("end of a line.\n");
        }
    }
    let file = dir.path().join("big.txt");
    fs::write(&file, format!("\u{feff}{text}")).unwrap();
    assert!(fs::metadata(&file).unwrap().len() > 3 * (1 << 16));
    for tokenizer in ["gpt2", "o200k_base"] {
        let mut s = spec(&file, &dir.path().join(format!("cache-{tokenizer}")));
        s.val_fraction = 0.0;
        s.tokenizer = tokenizer.into();
        let p = prepare(&s).unwrap();
        let tok = Tokenizer::load(tokenizer).unwrap();
        let mut expected = tok.encode(&text);
        expected.push(tok.eos_id());
        assert_eq!(all_tokens(&p.train[0].path), expected, "{tokenizer}");
        assert_eq!(TokenFile::open(&p.train[0].path).unwrap().num_docs(), 1);
    }
}

#[test]
fn jsonl_text_field_and_sample_limit() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("d.jsonl");
    let lines: Vec<String> = (0..50)
        .map(|i| format!("{{\"id\": {i}, \"content\": \"row {i} says hello\"}}"))
        .collect();
    fs::write(&file, lines.join("\n")).unwrap();
    let mut s = spec(&file, &dir.path().join("cache"));
    s.text_field = "content".into();
    s.val_fraction = 0.0;
    s.num_samples = Some(3);
    let p = prepare(&s).unwrap();
    assert!(p.val.is_none());
    let tok = Tokenizer::load("gpt2").unwrap();
    let mut expected = Vec::new();
    for i in 0..3 {
        expected.extend(tok.encode(&format!("row {i} says hello")));
        expected.push(50256);
    }
    assert_eq!(all_tokens(&p.train[0].path), expected);
    assert_eq!(TokenFile::open(&p.train[0].path).unwrap().num_docs(), 3);

    s.text_field = "text".into();
    s.num_samples = None;
    let err = prepare(&s).unwrap_err().to_string();
    assert!(
        err.contains("d.jsonl:1") && err.contains("content"),
        "{err}"
    );
}

#[test]
fn token_file_is_used_directly() {
    let dir = tempfile::tempdir().unwrap();
    let data = corpus(dir.path());
    let p = prepare(&spec(&data, &dir.path().join("cache"))).unwrap();
    let direct = prepare(&spec(&p.train[0].path, &dir.path().join("other"))).unwrap();
    assert!(direct.cache_hit && direct.val.is_none());
    assert_eq!(
        (direct.train.clone(), direct.train_tokens),
        (p.train.clone(), p.train_tokens)
    );
    assert!(!dir.path().join("other").exists());

    let mut s = spec(&p.train[0].path, &dir.path().join("other"));
    s.tokenizer = "cl100k_base".into();
    let err = prepare(&s).unwrap_err().to_string();
    assert!(
        err.contains("different tokenizer") && err.contains("set data.tokenizer=gpt2"),
        "{err}"
    );
}

#[test]
fn stale_builds_are_removed() {
    let dir = tempfile::tempdir().unwrap();
    let data = corpus(dir.path());
    let cache = dir.path().join("cache");
    let first = prepare(&spec(&data, &cache)).unwrap();
    let short = first.dir.file_name().unwrap().to_str().unwrap().to_string();
    fs::remove_dir_all(&first.dir).unwrap();
    // pid 0 is never a live user process.
    let stale = cache.join(format!("{short}.tmp-0"));
    fs::create_dir_all(&stale).unwrap();
    let again = prepare(&spec(&data, &cache)).unwrap();
    assert!(!again.cache_hit && !stale.exists());
}
