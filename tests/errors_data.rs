//! Data that cannot be read as asked: a corpus, a tokenizer, a token file, a `data.sources` entry,
//! a multiple-choice task file or a cache entry that is missing, damaged or of another kind, and a
//! resume on other data than the checkpoint's (other files, tokenizer or context length). Each is
//! named with the file and the fix (exit 1, or 2 for a config error), nothing half-written is
//! cached, a damaged cache entry is rebuilt, and the token cache is keyed on what changes tokens
//! only. From the reliability rounds (issue 20; round 4, issue 32) and the rows of
//! docs/FAILURES.md; each finding's test failed before its fix.

use crate::common;

use std::fs;
use std::path::Path;

use common::{
    cmd, fails, ok, run, small, small_gpt2, snapshot, tmp_leftovers, tree, with, write_corpus,
};

#[test]
fn truncated_token_file_is_named_with_the_fix_and_a_truncated_cache_entry_is_rebuilt() {
    let tmp = tempfile::tempdir().unwrap();
    let corpus = write_corpus(tmp.path());
    let base = small(&corpus);
    ok(tmp.path(), &cmd("prepare", &base, &[]));
    let cache = tmp.path().join(".lockstep/cache");
    let entry = fs::read_dir(&cache)
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    let good = fs::read(entry.join("train.tok")).unwrap();

    // A .tok given as data.path is used in place: a truncated one is an error naming it.
    let cut = tmp.path().join("cut.tok");
    fs::write(&cut, &good[..1000]).unwrap();
    let out = run(
        tmp.path(),
        &cmd(
            "train",
            &base,
            &["--set", "data.path=cut.tok", "--max-steps", "1"],
        ),
    );
    fails(
        &out,
        1,
        &[
            "cut.tok: file is 1000 bytes but its header says",
            "the file is truncated, delete it and run `lockstep prepare` again",
        ],
    );
    assert_eq!(fs::read(&cut).unwrap(), &good[..1000], "left as it was");
    assert!(!tmp.path().join("runs/tiny/checkpoints").exists());

    // A truncated file inside the cache is not a valid entry: it is tokenized again.
    fs::write(entry.join("train.tok"), &good[..good.len() / 2]).unwrap();
    let text = ok(tmp.path(), &cmd("prepare", &base, &[]));
    assert!(text.contains("Data: prepared"), "{text}");
    assert!(fs::read(entry.join("train.tok")).unwrap() == good);
    assert!(
        tmp_leftovers(&cache).is_empty(),
        "{:?}",
        tmp_leftovers(&cache)
    );
}

#[test]
fn token_file_of_another_tokenizer_names_the_one_that_wrote_it() {
    let tmp = tempfile::tempdir().unwrap();
    let corpus = write_corpus(tmp.path());
    let base = small_gpt2(&corpus);
    ok(tmp.path(), &cmd("prepare", &base, &[]));
    let cache = tmp.path().join(".lockstep/cache");
    let entry = fs::read_dir(&cache)
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    let tok = entry.join("train.tok");
    let before = snapshot(&cache);
    let out = run(
        tmp.path(),
        &cmd(
            "train",
            &base,
            &[
                "--set",
                &format!("data.path={}", tok.display()),
                "--set",
                "data.tokenizer=cl100k_base",
                "--max-steps",
                "1",
            ],
        ),
    );
    fails(
        &out,
        1,
        &[&format!(
            "{}: was tokenized with a different tokenizer (`gpt2`) than data.tokenizer = \
                 `cl100k_base`; set data.tokenizer=gpt2, or point data.path at the text",
            tok.display()
        )],
    );
    assert_eq!(snapshot(&cache), before, "the cache is untouched");
}

#[test]
fn missing_data_path_exits_1_naming_the_path_and_the_key() {
    let tmp = tempfile::tempdir().unwrap();
    let cwd = tmp.path().canonicalize().unwrap();
    // `missing/dir` could also be a Hub dataset id (owner/name): both are named.
    let out = run(
        &cwd,
        &cmd(
            "train",
            &small(Path::new("missing/dir")),
            &["--max-steps", "1"],
        ),
    );
    let text = fails(
        &out,
        1,
        &[
            &format!(
                "data.path = \"missing/dir\": no such file or directory: {}",
                cwd.join("missing/dir").display()
            ),
            &format!(
                "a relative data.path is taken from the working directory, {}",
                cwd.display()
            ),
            "builtin:shakespeare",
            "If \"missing/dir\" is meant as a Hugging Face dataset: it is not in the local cache",
        ],
    );
    assert!(!text.contains("panicked"), "{text}");
    assert!(!cwd.join("runs/tiny/checkpoints").exists());
    assert!(!cwd.join("runs/tiny/metrics.jsonl").exists());
    assert!(tmp_leftovers(&cwd).is_empty());

    // Under an existing local directory it can only be a local path: no Hub text.
    fs::create_dir(cwd.join("data")).unwrap();
    let out = run(
        &cwd,
        &cmd("prepare", &small(Path::new("data/shakespeare")), &[]),
    );
    let text = fails(
        &out,
        1,
        &[&format!(
            "data.path = \"data/shakespeare\": no such file or directory: {}",
            cwd.join("data/shakespeare").display()
        )],
    );
    assert!(!text.contains("Hugging Face"), "{text}");
}

/// 100 KB of random bytes named `.bin` reads as a nanoGPT token file whose ids reach past the
/// vocabulary: refused before training (libtorch would abort in the embedding lookup), and
/// `eval` refuses it the same way.
#[test]
fn token_file_with_ids_past_the_vocabulary_is_refused_before_training() {
    let tmp = tempfile::tempdir().unwrap();
    let corpus = write_corpus(tmp.path());
    let base = small_gpt2(&corpus);
    // A fixed pseudo-random stream (xorshift), so the largest id is known.
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    let bytes: Vec<u8> = (0..100_000)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 56) as u8
        })
        .collect();
    let max = bytes
        .chunks_exact(2)
        .map(|c| u16::from_le_bytes([c[0], c[1]]))
        .max()
        .unwrap();
    assert!(max >= 50_257);
    fs::write(tmp.path().join("x.bin"), &bytes).unwrap();

    let out = run(
        tmp.path(),
        &cmd(
            "train",
            &base,
            &["--set", "data.path=x.bin", "--max-steps", "1"],
        ),
    );
    let text = fails(
        &out,
        1,
        &[
            &format!("x.bin: holds token id {max}, but the model's vocabulary has 50257 ids"),
            "Set data.tokenizer to the tokenizer that wrote the file, or point data.path at the \
             text",
            &format!("set model.vocab_size to at least {}", max as u32 + 1),
        ],
    );
    assert!(
        !text.contains("panicked") && !text.contains("Step ["),
        "{text}"
    );
    assert!(!tmp.path().join("runs/tiny/checkpoints").exists());
    assert_eq!(fs::read(tmp.path().join("x.bin")).unwrap(), bytes);

    // A model vocabulary that covers the ids accepts the file (the check is against the
    // embedding rows, not the tokenizer).
    let wide = format!("model.vocab_size={}", max as u32 + 1);
    ok(
        tmp.path(),
        &cmd(
            "train",
            &base,
            &[
                "--set",
                "data.path=x.bin",
                "--set",
                &wide,
                "--set",
                "training.context_length=16",
                "--set",
                "logging.run_name=wide",
                "--max-steps",
                "1",
            ],
        ),
    );

    // eval takes token files too.
    ok(tmp.path(), &cmd("train", &base, &["--max-steps", "1"]));
    let model = tmp.path().join("runs/tiny/checkpoints/step_1");
    let out = run(
        tmp.path(),
        &[
            "eval".to_string(),
            "--model".into(),
            model.display().to_string(),
            "--data".into(),
            "x.bin".into(),
        ],
    );
    fails(
        &out,
        1,
        &[
            &format!("--data x.bin: holds token id {max}, but the model's vocabulary has 50257"),
            "Evaluate the text instead",
        ],
    );
}

/// `data.document_masking` on a nanoGPT `.bin` (no document offsets): refused before training,
/// naming the file and both ways out.
#[test]
fn document_masking_on_a_token_file_without_offsets_exits_1_naming_the_fix() {
    let tmp = tempfile::tempdir().unwrap();
    let corpus = write_corpus(tmp.path());
    let ids: Vec<u8> = (0..20_000u32)
        .flat_map(|i| ((i * 7919 % 50_000) as u16).to_le_bytes())
        .collect();
    fs::write(tmp.path().join("x.bin"), &ids).unwrap();
    let out = run(
        tmp.path(),
        &cmd(
            "train",
            &small_gpt2(&corpus),
            &[
                "--set",
                "data.path=x.bin",
                "--set",
                "data.document_masking=true",
                "--max-steps",
                "1",
            ],
        ),
    );
    let text = fails(
        &out,
        1,
        &[
            "data.path is a nanoGPT .bin (raw u16) without document offsets, so data.document_masking / data.reset_position_ids cannot find its documents",
            "point the source at the text so `lockstep prepare` writes a .tok with them, or set data.document_masking=false",
        ],
    );
    assert!(
        !text.contains("panicked") && !text.contains("Step ["),
        "{text}"
    );
    assert!(!tmp.path().join("runs/tiny/checkpoints").exists());
    assert!(!tmp.path().join("runs/tiny/metrics.jsonl").exists());
    assert_eq!(fs::read(tmp.path().join("x.bin")).unwrap(), ids);
}

/// A `data.sources` entry that is wrong: a misspelt field is a config error naming the entry
/// and the nearest field; a path that does not exist names the entry and the path, after the
/// sources before it were prepared (and stay cached).
#[test]
fn a_bad_data_sources_entry_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let corpus = write_corpus(tmp.path());
    let mut base = small(&corpus);
    base.truncate(base.len() - 2); // no data.path beside data.sources
    let sources = |second: &str| {
        format!(
            r#"data.sources=[{{"path":"{}","weight":0.8}},{second}]"#,
            corpus.display()
        )
    };
    let typo = sources(r#"{"path":"web","wieght":0.2}"#);
    let out = run(tmp.path(), &cmd("train", &base, &["--set", &typo]));
    fails(
        &out,
        2,
        &["data.sources[1] has an unknown field \"wieght\" (did you mean \"weight\"?); fields are path, weight, text_field, name"],
    );
    assert!(!tmp.path().join("runs").exists() && !tmp.path().join(".lockstep").exists());

    let missing = sources(r#"{"path":"missing/web.jsonl","weight":0.2}"#);
    let out = run(
        tmp.path(),
        &cmd("train", &base, &["--set", &missing, "--max-steps", "1"]),
    );
    let text = fails(
        &out,
        1,
        &[
            "Data corpus (weight 0.8): prepared",
            "data.sources[1] (web): data.path = \"missing/web.jsonl\": no such file or directory",
        ],
    );
    assert!(!text.contains("panicked"), "{text}");
    assert!(!tmp.path().join("runs/tiny/checkpoints").exists());
    assert!(tmp_leftovers(tmp.path()).is_empty());
}

/// A `.jsonl` corpus with a bad line: `prepare` exits 1 naming the file, the line and the
/// problem (a line of 17 MB, parsed as it is read, as well as a short one), and caches nothing.
#[test]
fn a_bad_jsonl_line_is_named_and_nothing_is_cached() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("d.jsonl");
    let long = "word ".repeat(17 << 20 >> 2);
    let ok_line = r#"{"text": "a first document"}"#;
    for (line, says) in [
        (
            r#"{"body": "x", "id": 2}"#.to_string(),
            r#"d.jsonl:2: line has no field "text" (its other keys: [body, id]); set `data.text_field` to the key holding the text"#,
        ),
        (
            format!(r#"{{"id": 2, "body": "{long}"}}"#),
            r#"d.jsonl:2: line has no field "text" (its other keys: [id, body])"#,
        ),
        (
            format!(r#"{{"text": "{long}\q"}}"#),
            &format!(
                "d.jsonl:2: not valid JSON (UnknownEscapeSequence at byte {} of the line); each \
                 line of a .jsonl file must be one JSON object",
                10 + long.len()
            ),
        ),
        (
            format!(r#"{{"text": "{long}", "text": "again"}}"#),
            r#"d.jsonl:2: the field "text" appears twice in this line, which is parsed as it is read (longer than 16777216 bytes); keep one"#,
        ),
    ] {
        fs::write(&data, format!("{ok_line}\n{line}\n{ok_line}\n")).unwrap();
        let out = run(
            tmp.path(),
            &cmd(
                "prepare",
                &[],
                &["--preset", "tiny", "--set", "data.path=d.jsonl"],
            ),
        );
        let text = fails(&out, 1, &[says]);
        assert!(!text.contains("panicked"), "{text}");
        let cache = tmp.path().join(".lockstep/cache");
        let entries = fs::read_dir(&cache).map(|d| d.count()).unwrap_or(0);
        assert_eq!(entries, 0, "nothing cached under {}", cache.display());
    }
}

/// Issue 20, finding 8: a full disk during `prepare` printed the bare OS error; it names the cache,
/// the bytes needed and the key, and leaves no partial entry.
#[test]
fn prepare_on_a_full_disk_names_the_cache_the_size_and_the_key() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let corpus = write_corpus(dir);
    let cache = dir.join("small-cache");
    let Some(_mount) = common::Tmpfs::mount(&cache, "size=16k") else {
        return;
    };
    let out = run(
        dir,
        &with(
            &small(&corpus),
            &["prepare"],
            &["--set", &format!("data.cache_dir={}", cache.display())],
        ),
    );
    let text = fails(
        &out,
        1,
        &[
            &format!("data.cache_dir {}: the token files need", cache.display()),
            "MB free; free space there, or set data.cache_dir to a disk with room",
        ],
    );
    assert!(!text.contains("panicked"), "{text}");
    assert_eq!(
        tree(&cache),
        Vec::<String>::new(),
        "a partial entry was left"
    );
}

/// Issue 20, finding 6: a resume on other data was accepted without a word (a changed seed was
/// refused "because the data order would change"); now it is refused the same way, or continued on
/// the new data with the order starting anew where the user says so.
#[test]
fn resuming_on_other_data_is_refused_unless_asked_for() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let corpus = write_corpus(dir);
    let other = dir.join("other.txt");
    let text: String = fs::read_to_string(corpus.join("doc1.txt")).unwrap();
    fs::write(&other, text.repeat(2)).unwrap();
    let base = with(&small(&corpus), &["train"], &[]);
    ok(dir, &with(&base, &[], &["--max-steps", "2"]));
    let moved = ["--set", "data.path=other.txt"];
    let out = run(
        dir,
        &with(
            &base,
            &[],
            &[&moved[..], &["--max-steps", "3", "--resume", "auto"]].concat(),
        ),
    );
    let text = fails(
        &out,
        1,
        &[
            "the checkpoint was trained on other data (source",
            "set data.allow_new_data_on_resume=true",
        ],
    );
    assert!(!text.contains("Step [3/3]"), "{text}");
    // Asked for: the model continues, the data order starts at the new data's first sample.
    let text = ok(
        dir,
        &with(
            &base,
            &[],
            &[
                &moved[..],
                &[
                    "--set",
                    "data.allow_new_data_on_resume=true",
                    "--max-steps",
                    "3",
                    "--resume",
                    "auto",
                ],
            ]
            .concat(),
        ),
    );
    assert!(
        text.contains("Resumed from")
            && text.contains("data.allow_new_data_on_resume is set, so the data order starts anew"),
        "{text}"
    );
    // The same data again, prepared anew (cache removed): the same identity, accepted.
    fs::remove_dir_all(dir.join(".lockstep/cache")).unwrap();
    let again = with(
        &base,
        &[],
        &[&moved[..], &["--max-steps", "4", "--resume", "auto"]].concat(),
    );
    let text = ok(dir, &again);
    assert!(!text.contains("New data"), "{text}");
}

/// Issue 20, finding 9: a cache entry whose token file was overwritten in place (2000 bytes) was
/// blamed on the tokenizer ("set model.vocab_size"); it is found damaged by its checksum and
/// rebuilt, while a copied cache (new stamps, same bytes) is used as it is.
#[test]
fn a_damaged_cache_entry_is_rebuilt_and_a_copied_one_is_used() {
    use std::io::{Seek, SeekFrom, Write};
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let corpus = write_corpus(dir);
    let base = with(&small(&corpus), &["train"], &["--max-steps", "1"]);
    ok(dir, &with(&base[1..], &["prepare"], &[]));
    let cache = dir.join(".lockstep/cache");
    let entry = fs::read_dir(&cache)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.join("train.tok").is_file())
        .expect("a cache entry");
    let train = entry.join("train.tok");
    let original = fs::read(&train).unwrap();
    // A copy of the whole cache elsewhere: other inodes and times, the same bytes.
    let copied = dir.join("copied-cache");
    let status = std::process::Command::new("cp")
        .args(["-r"])
        .arg(&cache)
        .arg(&copied)
        .status()
        .unwrap();
    assert!(status.success());
    let set_copied = format!("data.cache_dir={}", copied.display());
    let text = ok(dir, &with(&base, &[], &["--set", &set_copied]));
    assert!(
        text.contains("Data: cache hit") && !text.contains("damaged"),
        "{text}"
    );

    let mut f = fs::File::options().write(true).open(&train).unwrap();
    f.seek(SeekFrom::Start(original.len() as u64 / 2)).unwrap();
    f.write_all(&[0xFF; 2000]).unwrap();
    drop(f);
    let text = ok(dir, &with(&base, &[], &["--set", "logging.run_name=after"]));
    assert!(
        text.contains(&format!(
            "cache entry .lockstep/cache/{} is damaged (train.tok's bytes no longer match the \
             BLAKE3 recorded in meta.json when it was written); tokenizing it again",
            entry.file_name().unwrap().to_str().unwrap()
        )) && !text.contains("model.vocab_size"),
        "{text}"
    );
    assert!(
        fs::read(&train).unwrap() == original,
        "not rebuilt as it was"
    );
}

/// Round 4 (issue 32), findings 8, 9, 14 and 15: a dangling symlink in a corpus directory was
/// skipped without a word (part of the data missing, exit 0); a tokenizer.json whose vocabulary is
/// only `<|endoftext|>` turned 590 KB into 4 tokens; a UTF-16 file was "invalid UTF-8 at byte 0"
/// with `iconv -f latin1` as the fix; a FIFO as data.path was "cannot list directory: Not a
/// directory". Each is named with its fix, and nothing is cached.
#[test]
fn bad_corpus_inputs_are_named_with_the_fix() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let corpus = write_corpus(dir);
    let prepare = |path: &str, extra: &[&str]| {
        let data = format!("data.path={path}");
        let args = with(
            &small(&corpus),
            &["prepare"],
            &[&["--set", &data][..], extra].concat(),
        );
        run(dir, &args)
    };
    let cache_entries = || {
        fs::read_dir(dir.join(".lockstep/cache"))
            .map(|d| d.count())
            .unwrap_or(0)
    };

    std::os::unix::fs::symlink("/nonexistent/lost.txt", corpus.join("lost.txt")).unwrap();
    fails(
        &prepare("corpus", &[]),
        1,
        &["corpus/lost.txt: a symbolic link to /nonexistent/lost.txt, which does not exist; part of the corpus would be missing"],
    );
    fs::remove_file(corpus.join("lost.txt")).unwrap();

    let utf16: Vec<u8> = [0xFF, 0xFE]
        .into_iter()
        .chain(
            "To be, or not to be\n"
                .encode_utf16()
                .flat_map(u16::to_le_bytes),
        )
        .collect();
    fs::create_dir(dir.join("u16")).unwrap();
    fs::write(dir.join("u16/play.txt"), &utf16).unwrap();
    fs::write(dir.join("lines.jsonl"), &utf16).unwrap();
    for (path, name) in [("u16", "u16/play.txt"), ("lines.jsonl", "lines.jsonl:1")] {
        fails(
            &prepare(path, &[]),
            1,
            &[&format!("{name}: UTF-16 text (little-endian: it starts with that byte-order mark), not UTF-8; convert it with `iconv -f UTF-16 -t UTF-8 FILE > FILE.utf8`")],
        );
    }

    let fifo = dir.join("pipe.txt");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0);
    fails(
        &prepare("pipe.txt", &[]),
        1,
        &["pipe.txt: a FIFO (named pipe), not a file or a directory; lockstep reads data files more than once"],
    );

    let tokenizer = r#"{"version": "1.0", "added_tokens": [{"id": 0, "content": "<|endoftext|>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}], "normalizer": null, "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true}, "post_processor": null, "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true}, "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": "", "end_of_word_suffix": "", "fuse_unk": false, "vocab": {"<|endoftext|>": 0}, "merges": []}}"#;
    fs::write(dir.join("eos-only.json"), tokenizer).unwrap();
    fails(
        &prepare("corpus", &["--set", "data.tokenizer=eos-only.json"]),
        1,
        &["eos-only.json: a byte-level BPE needs a token for each of the 256 bytes, and its vocabulary (1 tokens) lacks 256 of them"],
    );
    assert_eq!(cache_entries(), 0, "nothing is cached");

    // Round 4, finding 13: a negative part was clap's "unexpected argument '-1'".
    fails(
        &run(
            dir,
            &with(&small(&corpus), &["prepare", "--shard", "-1/2"], &[]),
        ),
        1,
        &["--shard -1/2: the part must be I/N with 0 <= I < N <= 99999 (got -1/2)"],
    );
}

/// Round 4 (issue 32), findings 12, 12b, 12c, 18 and 19: changing `training.context_length`
/// tokenized the whole corpus again (it was part of the cache key, though it only sized the
/// validation split); a resume with another context length was accepted silently;
/// `checkpoint.keep_every` that is not a multiple of `checkpoint.interval` kept nothing; a resume
/// with another tokenizer was "another model shape" and pointed at the HF config.json for the data;
/// `keep_last=-1` said ">= 0" though 0 is refused too. The token cache is keyed on what changes
/// tokens, each split is checked against the windows when training starts, and the rest are named.
#[test]
fn context_length_and_checkpoint_settings_are_named_and_never_retokenize() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let base = with(
        &small_gpt2(&write_corpus(dir)),
        &["train"],
        &["--set", "checkpoint.interval=2"],
    );
    let first = ok(dir, &with(&base, &[], &["--max-steps", "2"]));
    assert!(first.contains("Data: prepared"), "{first}");
    // Another context length: the same tokens from the cache, and a resume says what moves.
    let ctx32 = with(&base, &[], &["--set", "training.context_length=32"]);
    let text = fails(
        &run(dir, &with(&ctx32, &[], &["--max-steps", "3", "--resume", "auto"])),
        1,
        &[
            "the checkpoint was trained on other data (training.context_length 64 then, 32 now: every sample's window and the data order move)",
            "its config is in runs/tiny/checkpoints/step_2/trainer.json",
            "data.allow_new_data_on_resume=true",
        ],
    );
    assert!(
        text.contains("Data: cache hit"),
        "not tokenized again: {text}"
    );
    let text = ok(
        dir,
        &with(
            &ctx32,
            &[],
            &[
                "--max-steps",
                "3",
                "--resume",
                "auto",
                "--set",
                "data.allow_new_data_on_resume=true",
            ],
        ),
    );
    assert!(
        text.contains("data.allow_new_data_on_resume is set, so the data order starts anew"),
        "{text}"
    );
    // Another tokenizer is named as such, not as another model shape.
    let text = fails(
        &run(
            dir,
            &with(&base, &[], &["--max-steps", "4", "--resume", "auto", "--set", "data.tokenizer=p50k_base"]),
        ),
        1,
        &["tokenizer \"tiktoken:r50k_base\" then, \"tiktoken:p50k_base\" now: its ids stand for other text; set data.tokenizer back"],
    );
    assert!(!text.contains("model shape"), "{text}");
    // A validation split shorter than a window is named when training starts.
    fails(
        &run(
            dir,
            &with(
                &base,
                &[],
                &["--max-steps", "2", "--set", "data.val_fraction=0.001", "--set", "logging.run_name=short"],
            ),
        ),
        1,
        &["the validation split of corpus holds 36 tokens, fewer than one window of training.context_length + 1 = 65; raise data.val_fraction (now 0.001)"],
    );
    // Checkpoint settings that would keep nothing, or a count of 0.
    for (sets, says) in [
        (
            ["checkpoint.keep_every=3", "checkpoint.interval=2"],
            "checkpoint.keep_every = 3 is not a multiple of checkpoint.interval = 2: saves happen every 2 steps, so only multiples of 6 would be kept",
        ),
        (
            ["checkpoint.keep_every=3", "checkpoint.interval=0"],
            "checkpoint.interval = 0 saves only at the end, so it keeps nothing",
        ),
        (
            ["checkpoint.keep_last=-1", "checkpoint.interval=2"],
            "--set checkpoint.keep_last=-1: expected integer >= 1",
        ),
    ] {
        let text = fails(
            &run(dir, &with(&base, &[], &["--set", sets[0], "--set", sets[1]])),
            2,
            &[says],
        );
        assert_eq!(text.matches("error").count(), 1, "said once: {text}");
        assert!(text.matches("checkpoint.keep_last").count() <= 1, "named once: {text}");
    }
}

/// A bad multiple-choice task file (`training.eval_tasks`, `eval --task`) is named by file, line
/// and field with exit code 2 before anything runs: `train` prepares no data and writes no run
/// records, `lockstep run` starts no worker, `eval` opens no model; an item whose choice cannot
/// fit the context is named too.
#[test]
fn a_bad_task_file_is_named_before_anything_runs() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let base = small(&write_corpus(dir));
    let good = r#"{"query": "To be, or not", "choices": ["to be", "a fish"], "gold": 0}"#;
    let cases: &[(&str, &[u8], &str)] = &[
        (
            "missing.jsonl",
            b"{\"query\": \"q\", \"gold\": 0}\n",
            "missing.jsonl:2: has no \"choices\"",
        ),
        (
            "label.jsonl",
            b"{\"ctx\": \"c\", \"endings\": [\"a\", \"b\"], \"label\": 5}\n",
            "label.jsonl:2: \"label\" = 5 is out of range: the item has 2 choices (indices 0..1)",
        ),
        (
            "empty.jsonl",
            b"{\"query\": \"q\", \"choices\": [], \"gold\": 0}\n",
            "empty.jsonl:2: \"choices\" is an empty list",
        ),
        (
            "latin1.jsonl",
            b"{\"query\": \"caf\xe9\", \"choices\": [\"x\"], \"gold\": 0}\n",
            "latin1.jsonl:2: invalid UTF-8 at byte offset 84",
        ),
        (
            "csv.jsonl",
            b"query,choices,gold\n",
            "csv.jsonl:2: not valid JSON",
        ),
    ];
    for (name, second, says) in cases {
        let mut text = format!("{good}\n").into_bytes();
        text.extend_from_slice(second);
        fs::write(dir.join(name), text).unwrap();
        let tasks = format!("training.eval_tasks={name}");
        let run_name = format!("logging.run_name=bad-{name}");
        let train = ["--max-steps", "2", "--set", &tasks, "--set", &run_name];
        fails(&run(dir, &with(&base, &["train"], &train)), 2, &[says]);
        assert!(
            !dir.join(".lockstep/cache").exists(),
            "{name}: data prepared"
        );
        assert!(
            !dir.join(format!("runs/bad-{name}/metrics.jsonl")).exists(),
            "{name}: a run started"
        );
        let launched = fails(
            &run(dir, &with(&base, &["run", "--nproc", "2", "--cpu"], &train)),
            2,
            &[says],
        );
        assert!(
            !launched.contains("[CPU1]"),
            "{name}: workers started:\n{launched}"
        );
        let eval = ["eval", "--model", "nowhere", "--task", name];
        fails(&run(dir, &eval.map(String::from)), 2, &[says]);
    }
    // A choice longer than the model's context (64 tokens) cannot be scored.
    let long = "word ".repeat(200);
    let item = serde_json::json!({"query": "q", "choices": ["a", long], "gold": 0});
    fs::write(dir.join("long.jsonl"), format!("{good}\n{item}\n")).unwrap();
    fails(
        &run(
            dir,
            &with(
                &base,
                &["train"],
                &["--set", "training.eval_tasks=long.jsonl"],
            ),
        ),
        2,
        &[
            "long.jsonl:2: choice 1 is",
            "tokens, more than the model's context of 64",
        ],
    );
    // Flags of `eval` that cannot work.
    for (args, says) in [
        (
            &["--limit", "0", "--task", "long.jsonl"][..],
            "--limit 0 scores nothing",
        ),
        (
            &["--data", "x.txt", "--limit", "3"],
            "--limit applies to --task",
        ),
        (
            &["--task", "long.jsonl", "--max-batches", "1"],
            "--max-batches applies to --data",
        ),
        (
            &[],
            "nothing to evaluate: pass --data FILE (loss and perplexity) and/or --task FILE",
        ),
    ] {
        let mut eval = vec!["eval".to_string(), "--model".into(), "nowhere".into()];
        eval.extend(args.iter().map(|a| a.to_string()));
        fails(&run(dir, &eval), 2, &[says]);
    }
}
