//! The failure table of docs/FAILURES.md, row by row: each bad input gives its exit code
//! (2 = config, 1 = runtime), a message naming the file/key/value and the fix, and loses or
//! half-writes nothing.

mod common;

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

use common::{cmd, fails, ok, output_text, run, small, write_corpus};

/// Every file under `dir` with its bytes, by relative path (directories as empty entries).
/// Every path under `dir` with its bytes, but the lock a run holds on its checkpoint directory
/// (which names the latest holder).
fn snapshot(dir: &Path) -> BTreeMap<PathBuf, Option<Vec<u8>>> {
    fn walk(root: &Path, dir: &Path, out: &mut BTreeMap<PathBuf, Option<Vec<u8>>>) {
        for e in fs::read_dir(dir).unwrap() {
            let path = e.unwrap().path();
            if path.file_name().is_some_and(|n| n == "checkpoints.lock") {
                continue;
            }
            let rel = path.strip_prefix(root).unwrap().to_path_buf();
            if path.is_dir() {
                out.insert(rel, None);
                walk(root, &path, out);
            } else {
                out.insert(rel, Some(fs::read(&path).unwrap()));
            }
        }
    }
    let mut out = BTreeMap::new();
    if dir.exists() {
        walk(dir, dir, &mut out);
    }
    out
}

/// Paths under `dir` whose name contains `.tmp` (a half-written file or directory).
fn tmp_leftovers(dir: &Path) -> Vec<PathBuf> {
    snapshot(dir)
        .into_keys()
        .filter(|p| p.to_string_lossy().contains(".tmp"))
        .collect()
}

#[test]
fn malformed_json_config_exits_2_and_creates_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    fs::write(
        tmp.path().join("bad.json"),
        "{\"training\": {\"learning_rate\": 1e-3,}}\n",
    )
    .unwrap();
    let before = snapshot(tmp.path());
    let out = run(
        tmp.path(),
        &cmd("train", &[], &["--preset", "tiny", "--config", "bad.json"]),
    );
    fails(
        &out,
        2,
        &[
            "bad.json: not valid JSON at line 1, column 37",
            "trailing comma",
            "fix the syntax (JSON allows no comments or trailing commas)",
        ],
    );
    assert_eq!(snapshot(tmp.path()), before, "no run directory, no cache");
}

#[test]
fn unknown_key_in_a_config_file_exits_2_with_a_suggestion() {
    let tmp = tempfile::tempdir().unwrap();
    fs::write(
        tmp.path().join("typo.json"),
        "{\"training\": {\"lerning_rate\": 1e-3}}",
    )
    .unwrap();
    let before = snapshot(tmp.path());
    let out = run(
        tmp.path(),
        &cmd("train", &[], &["--preset", "tiny", "--config", "typo.json"]),
    );
    fails(
        &out,
        2,
        &[
            "typo.json: unknown config key \"training.lerning_rate\"",
            "(did you mean \"training.learning_rate\"?)",
            "`lockstep config --keys` lists all keys",
        ],
    );
    assert_eq!(snapshot(tmp.path()), before, "no run directory, no cache");
}

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
    let base = small(&corpus);
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
fn resuming_a_checkpoint_of_another_shape_names_the_difference_and_keeps_it() {
    let tmp = tempfile::tempdir().unwrap();
    let corpus = write_corpus(tmp.path());
    let base = small(&corpus);
    ok(tmp.path(), &cmd("train", &base, &["--max-steps", "2"]));
    let ckpts = tmp.path().join("runs/tiny/checkpoints");
    let before = snapshot(&ckpts);
    let metrics = fs::read(tmp.path().join("runs/tiny/metrics.jsonl")).unwrap();
    let out = run(
        tmp.path(),
        &cmd(
            "train",
            &base,
            &[
                "--set",
                "model.hidden_size=128",
                "--max-steps",
                "4",
                "--resume",
                "auto",
            ],
        ),
    );
    fails(
        &out,
        1,
        &[
            "runs/tiny/checkpoints/step_2: the checkpoint is of another model shape",
            "hidden_size: checkpoint 64 vs config 128",
            "resume with the config it was trained with",
        ],
    );
    assert!(snapshot(&ckpts) == before, "the checkpoints are unchanged");
    assert!(fs::read(tmp.path().join("runs/tiny/metrics.jsonl")).unwrap() == metrics);
}

/// A resume refused on the shape check leaves the run's `config.json` as it was: the trainer
/// writes into the run directory only once the start is accepted.
#[test]
fn failed_resume_keeps_the_runs_config_json() {
    let tmp = tempfile::tempdir().unwrap();
    let corpus = write_corpus(tmp.path());
    let base = small(&corpus);
    ok(tmp.path(), &cmd("train", &base, &["--max-steps", "2"]));
    let config = tmp.path().join("runs/tiny/config.json");
    let before = fs::read(&config).unwrap();
    let out = run(
        tmp.path(),
        &cmd(
            "train",
            &base,
            &["--set", "model.hidden_size=128", "--resume", "auto"],
        ),
    );
    assert_eq!(out.status.code(), Some(1), "{}", output_text(&out));
    assert!(
        fs::read(&config).unwrap() == before,
        "config.json was replaced"
    );
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
    let base = small(&corpus);
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

#[test]
fn log_dir_under_a_regular_file_exits_1_naming_the_key() {
    // Root ignores permission bits, so the unwritable directory is one under a regular file.
    let tmp = tempfile::tempdir().unwrap();
    let corpus = write_corpus(tmp.path());
    fs::write(tmp.path().join("afile"), "x").unwrap();
    let out = run(
        tmp.path(),
        &cmd(
            "train",
            &small(&corpus),
            &["--set", "logging.dir=afile/runs", "--max-steps", "1"],
        ),
    );
    fails(
        &out,
        1,
        &[
            "logging.dir: cannot create run directory afile/runs/tiny",
            "choose a writable logging.dir",
            "Not a directory",
        ],
    );
    assert_eq!(fs::read_to_string(tmp.path().join("afile")).unwrap(), "x");
    assert!(tmp_leftovers(tmp.path()).is_empty());
}

#[test]
fn master_port_in_use_exits_1_before_any_worker_starts() {
    let tmp = tempfile::tempdir().unwrap();
    let corpus = write_corpus(tmp.path());
    let busy = std::net::TcpListener::bind(("0.0.0.0", 0)).unwrap();
    let port = busy.local_addr().unwrap().port().to_string();
    let out = run(
        tmp.path(),
        &cmd(
            "run",
            &small(&corpus),
            &[
                "--cpu",
                "--nproc",
                "1",
                "--master-port",
                &port,
                "--max-steps",
                "1",
            ],
        ),
    );
    fails(
        &out,
        1,
        &[
            &format!("--master-port {port}: address 127.0.0.1:{port} is already in use"),
            "choose another port or 0 for a free one",
        ],
    );
    // No worker ran: no per-rank logs, no run directory.
    assert!(!tmp.path().join("logs").exists());
    assert!(!tmp.path().join("runs").exists());
    drop(busy);
}

#[test]
fn nccl_for_cpu_workers_exits_2_before_any_worker_starts() {
    let tmp = tempfile::tempdir().unwrap();
    let corpus = write_corpus(tmp.path());
    let out = run(
        tmp.path(),
        &cmd(
            "run",
            &small(&corpus),
            &[
                "--cpu",
                "--nproc",
                "2",
                "--set",
                "system.dist_backend=nccl",
                "--max-steps",
                "1",
            ],
        ),
    );
    fails(
        &out,
        2,
        &[
            "system.dist_backend = nccl needs CUDA ranks, but lockstep run starts CPU workers",
            "use system.dist_backend=auto or ring",
        ],
    );
    assert!(!tmp.path().join("logs").exists());
    assert!(!tmp.path().join("runs").exists());
}

#[test]
fn gpus_on_a_machine_without_a_gpu_are_refused_before_any_worker_starts() {
    if !lockstep::launch::detect_gpus().is_empty() {
        eprintln!("SKIPPED: this machine has a GPU");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let corpus = write_corpus(tmp.path());
    let out = run(
        tmp.path(),
        &cmd("run", &small(&corpus), &["--gpus", "0", "--max-steps", "1"]),
    );
    let text = fails(
        &out,
        1,
        &[
            "--gpus 0: no NVIDIA GPU found on this machine",
            "run CPU workers with --cpu --nproc N",
        ],
    );
    assert!(!text.contains("[GPU0]"), "no line may claim a GPU:\n{text}");
    assert!(!tmp.path().join("logs").exists());
    assert!(!tmp.path().join("runs").exists());
    // Asking for CUDA on CPU workers is a config error, also before anything starts.
    let out = run(
        tmp.path(),
        &cmd(
            "run",
            &small(&corpus),
            &["--cpu", "--set", "system.device=cuda", "--max-steps", "1"],
        ),
    );
    fails(
        &out,
        2,
        &["system.device = cuda, but lockstep run starts CPU workers"],
    );
    assert!(!tmp.path().join("runs").exists());
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
            &small(&corpus),
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

/// `system.shard_degree` that does not divide the ranks, or hybrid sharding at zero stage 0:
/// every rank refuses at start-up with exit code 2, naming the key, before a run directory is
/// written.
#[test]
fn a_shard_degree_that_does_not_fit_the_ranks_exits_2_naming_the_key() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let base = small(&write_corpus(dir));
    for (sets, says) in [
        (
            ["system.zero_stage=3", "system.shard_degree=3"],
            "system.shard_degree = 3: must divide the number of ranks, 2",
        ),
        (
            ["system.zero_stage=0", "system.shard_degree=1"],
            "system.shard_degree = 1 shards the training state at zero_stage >= 1",
        ),
    ] {
        let out = run(
            dir,
            &cmd(
                "run",
                &base,
                &[
                    "--cpu",
                    "--nproc",
                    "2",
                    "--max-steps",
                    "1",
                    "--set",
                    sets[0],
                    "--set",
                    sets[1],
                ],
            ),
        );
        fails(&out, 2, &[says]);
        assert!(
            !dir.join("runs/tiny/config.json").exists(),
            "nothing written into the run directory"
        );
    }
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
