//! `lockstep prepare --shard I/N`: parts prepared separately (in any order) complete one cache
//! entry that holds exactly the tokens, documents and validation split of a preparation in one
//! go, and trains bitwise the same; a killed part leaves no part behind and a rerun finishes.

use crate::common;

use std::fs;
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::{ok, run, small, with};
use lockstep::data::tokfile::{TokenFile, TokenPrefix};

/// Text files and .jsonl files of several documents each, so parts cut files by file and
/// inside a file.
fn corpus(dir: &Path, scale: usize) -> PathBuf {
    let corpus = dir.join("corpus");
    fs::create_dir_all(&corpus).unwrap();
    let src = fs::read_to_string(common::root().join("data/shakespeare/hamlet_gut.txt")).unwrap();
    let chars: Vec<char> = src.chars().collect();
    let docs: Vec<String> = chars.chunks(1500).map(|c| c.iter().collect()).collect();
    for f in 0..3 {
        let mut lines = String::new();
        for r in 0..scale {
            for (i, d) in docs.iter().enumerate().skip(f).step_by(3) {
                let text = format!("{r}.{i} {d}");
                lines.push_str(&(serde_json::json!({ "text": text }).to_string() + "\n"));
            }
        }
        fs::write(corpus.join(format!("part{f}.jsonl")), lines).unwrap();
        fs::write(corpus.join(format!("note{f}.txt")), &docs[f * 7]).unwrap();
    }
    corpus
}

/// The only complete entry under `cache` and its meta.json.
fn entry(cache: &Path) -> (PathBuf, serde_json::Value) {
    let dirs: Vec<PathBuf> = fs::read_dir(cache)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.join("meta.json").is_file())
        .collect();
    assert_eq!(dirs.len(), 1, "{dirs:?}");
    let meta = serde_json::from_slice(&fs::read(dirs[0].join("meta.json")).unwrap()).unwrap();
    (dirs[0].clone(), meta)
}

/// An entry's training stream and validation file, as (tokens, document starts) each.
type Stream = (Vec<u32>, Vec<u64>);

fn read(f: &TokenFile) -> Stream {
    (
        (0..f.num_tokens()).map(|i| f.get(i)).collect(),
        (0..f.num_docs()).map(|i| f.doc_offset(i)).collect(),
    )
}

fn streams(dir: &Path, meta: &serde_json::Value) -> (Stream, Stream) {
    let train: Vec<TokenPrefix> = match meta["train"]["prefixes"].as_array() {
        Some(ps) => ps
            .iter()
            .map(|p| TokenPrefix {
                path: dir.join(p["file"].as_str().unwrap()),
                tokens: p["tokens"].as_u64().unwrap(),
                eos: p["eos"].as_u64().map(|e| e as u32),
            })
            .collect(),
        None => vec![TokenPrefix::whole(
            dir.join("train.tok"),
            meta["train"]["tokens"].as_u64().unwrap(),
        )],
    };
    (
        read(&TokenFile::open_prefixes(&train).unwrap()),
        read(&TokenFile::open(&dir.join("val.tok")).unwrap()),
    )
}

fn cache_args(base: &[String], cache: &Path) -> Vec<String> {
    with(
        base,
        &[],
        &["--set", &format!("data.cache_dir={}", cache.display())],
    )
}

fn prepare_parts(dir: &Path, base: &[String], order: &[u64], n: u64) -> Vec<String> {
    order
        .iter()
        .map(|i| {
            ok(
                dir,
                &with(base, &["prepare", "--shard", &format!("{i}/{n}")], &[]),
            )
        })
        .collect()
}

#[test]
fn three_parts_hold_the_tokens_of_one_go_and_train_the_same() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let corpus = corpus(dir, 2);
    let (one, parts) = (dir.join("one-go"), dir.join("parts"));
    let base = small(&corpus);
    ok(dir, &with(&cache_args(&base, &one), &["prepare"], &[]));
    let outs = prepare_parts(dir, &cache_args(&base, &parts), &[2, 0, 1], 3);
    assert!(
        outs[0].contains("part 2/3 written") && outs[0].contains("parts 0, 1 of 3"),
        "{}",
        outs[0]
    );
    assert!(outs[1].contains("parts 1 of 3"), "{}", outs[1]);
    assert!(outs[2].contains("the entry is complete"), "{}", outs[2]);

    let (a_dir, a_meta) = entry(&one);
    let (b_dir, b_meta) = entry(&parts);
    assert_eq!(a_dir.file_name(), b_dir.file_name(), "one cache key");
    assert_eq!(b_meta["parts"].as_array().unwrap().len(), 3);
    // Every part holds documents: files were cut by file and inside files.
    for i in 0..3 {
        let rec = &b_meta[format!("part-0000{i}-of-00003")];
        assert!(rec["documents"].as_u64().unwrap() > 0, "{rec}");
    }
    let (a, b) = (streams(&a_dir, &a_meta), streams(&b_dir, &b_meta));
    assert_eq!(a.0, b.0, "training tokens and documents");
    assert_eq!(a.1, b.1, "validation tokens and documents");
    assert_eq!(a_meta["documents"], b_meta["documents"]);
    assert_eq!(
        fs::read(a_dir.join("val.tok")).unwrap(),
        fs::read(b_dir.join("val.tok")).unwrap()
    );

    // Training on either entry: the same losses, bitwise (the parts entry is a cache hit).
    let train = |cache: &Path, name: &str| {
        let args = with(
            &cache_args(&base, cache),
            &["train"],
            &[
                "--max-steps",
                "5",
                "--set",
                &format!("logging.run_name={name}"),
            ],
        );
        let out = ok(dir, &args);
        assert!(out.contains("cache hit"), "{out}");
        common::losses(&dir.join(format!("runs/{name}/metrics.jsonl")))
    };
    let (la, lb) = (train(&one, "one"), train(&parts, "parts"));
    assert_eq!(la.len(), 5);
    assert_eq!(la, lb, "per-step losses must be bitwise equal");
}

#[test]
fn a_document_split_between_train_and_validation_matches_one_go() {
    // One text file is one document: part 0 gets it, the others none, and the validation
    // split falls inside it.
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let file = dir.join("one.txt");
    let src = fs::read_to_string(common::root().join("data/shakespeare/hamlet_gut.txt")).unwrap();
    fs::write(&file, &src[..60_000]).unwrap();
    let base = small(&file);
    let (one, parts) = (dir.join("one-go"), dir.join("parts"));
    ok(dir, &with(&cache_args(&base, &one), &["prepare"], &[]));
    prepare_parts(dir, &cache_args(&base, &parts), &[1, 0], 2);
    let (a_dir, a_meta) = entry(&one);
    let (b_dir, b_meta) = entry(&parts);
    assert_eq!(b_meta["split_at_document_boundary"], false);
    assert!(b_meta["train"]["prefixes"][0]["eos"].is_u64(), "{b_meta}");
    assert_eq!(streams(&a_dir, &a_meta), streams(&b_dir, &b_meta));
}

#[test]
fn a_killed_part_leaves_nothing_and_the_rest_can_be_prepared_later() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let corpus = corpus(dir, 40);
    let cache = dir.join("cache");
    let base = with(
        &cache_args(&small(&corpus), &cache),
        &[],
        &["--set", "training.num_workers=1"],
    );
    prepare_parts(dir, &base, &[0], 3);
    // Kill part 1 while it writes its token file.
    let mut child = common::lockstep(dir)
        .args(with(&base, &["prepare", "--shard", "1/3"], &[]))
        .spawn()
        .unwrap();
    let started = std::time::Instant::now();
    let writing = loop {
        let tmp_file = fs::read_dir(&cache)
            .ok()
            .into_iter()
            .flatten()
            .flatten()
            .any(|e| {
                fs::read_dir(e.path())
                    .ok()
                    .into_iter()
                    .flatten()
                    .flatten()
                    .any(|f| {
                        let n = f.file_name().to_string_lossy().into_owned();
                        n.starts_with("part-00001-of-00003.tok.tmp-")
                    })
            });
        if tmp_file || started.elapsed() > Duration::from_secs(60) {
            break tmp_file;
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    let _ = child.kill();
    let _ = child.wait();
    assert!(writing, "part 1 never started writing");
    let part_dir = fs::read_dir(&cache)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .find(|p| p.is_dir())
        .unwrap();
    assert!(
        !part_dir.join("part-00001-of-00003.tok").exists()
            && !part_dir.join("part-00001-of-00003.json").exists(),
        "a killed part looks complete"
    );
    // Training (or preparing in one go) now says which parts are missing.
    let out = run(dir, &with(&base, &["prepare"], &[]));
    let text = common::fails(
        &out,
        1,
        &["being prepared in 3 parts", "parts 1, 2 are missing"],
    );
    assert!(text.contains("--shard I/3"), "{text}");
    // Another part count is refused while these parts are there.
    let out = run(dir, &with(&base, &["prepare", "--shard", "0/2"], &[]));
    common::fails(&out, 1, &["in 3 parts, not 2", "--shard I/3"]);
    // The missing parts, in any order, finish the entry; part 0 is not tokenized again; the
    // killed writer's temporary files are gone.
    let outs = prepare_parts(dir, &base, &[2, 1, 0], 3);
    let left: Vec<String> = fs::read_dir(&part_dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(".tmp"))
        .collect();
    assert!(left.is_empty(), "{left:?}");
    assert!(outs[1].contains("the entry is complete"), "{}", outs[1]);
    assert!(outs[2].contains("part 0/3 there"), "{}", outs[2]);
    let one = dir.join("one-go");
    ok(dir, &with(&cache_args(&base, &one), &["prepare"], &[]));
    let (a_dir, a_meta) = entry(&one);
    let (b_dir, b_meta) = entry(&cache);
    assert_eq!(streams(&a_dir, &a_meta), streams(&b_dir, &b_meta));
}

#[test]
fn bad_shards_are_refused_with_the_fix() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let base = small(&corpus(dir, 1));
    for (shard, want) in [
        ("3/3", "0 <= I < N"),
        ("1-3", "expected I/N"),
        ("a/b", "0 <= I < N"),
        ("slurm", "SLURM_PROCID is not set"),
    ] {
        let out = common::lockstep(dir)
            .args(with(&base, &["prepare", "--shard", shard], &[]))
            .env_remove("SLURM_PROCID")
            .output()
            .unwrap();
        common::fails(&out, 1, &[want]);
    }
    let out = run(
        dir,
        &with(
            &base,
            &["prepare", "--shard", "0/2"],
            &["--set", "data.num_samples=5"],
        ),
    );
    common::fails(
        &out,
        1,
        &["data.num_samples = 5", "unset it to prepare in parts"],
    );
    // Under srun: SLURM_PROCID/SLURM_NTASKS name the part.
    let out = common::lockstep(dir)
        .args(with(&base, &["prepare", "--shard", "slurm"], &[]))
        .env("SLURM_PROCID", "1")
        .env("SLURM_NTASKS", "2")
        .output()
        .unwrap();
    let text = common::output_text(&out);
    assert!(
        out.status.success() && text.contains("part 1/2 written"),
        "{text}"
    );
}
