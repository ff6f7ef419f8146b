//! Findings of the 270-input probe of the fourth reliability round (issue 32): each test failed
//! before its fix. Checkpoints that are damaged, incomplete or mixed are named and never
//! resumed; bad inputs are named with the fix; what a run skips or waits for is said.

mod common;

use std::fs;
use std::io::{Seek, SeekFrom, Write};
use std::path::Path;
use std::time::Duration;

use common::{fails, ok, run, small, with, write_corpus, Launcher};

/// Overwrites `len` bytes at the middle of `file` with 0xFF (the size stays).
fn overwrite_middle(file: &Path, len: usize) {
    let size = fs::metadata(file).unwrap().len();
    let mut f = fs::File::options().write(true).open(file).unwrap();
    f.seek(SeekFrom::Start(size / 2)).unwrap();
    f.write_all(&vec![0xFF; len]).unwrap();
}

/// Makes trainer.json's record of `name` agree with the file as it is now, as if its writer had
/// saved these bytes.
fn rerecord(ckpt: &Path, name: &str) {
    let path = ckpt.join("trainer.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(&path).unwrap()).unwrap();
    let bytes = fs::read(ckpt.join(name)).unwrap();
    v["files"][name]["blake3"] = blake3::hash(&bytes).to_hex().to_string().into();
    fs::write(&path, serde_json::to_vec_pretty(&v).unwrap()).unwrap();
}

/// Finding 3: 4 KB of 0xFF written into a checkpoint's model file (same size) was resumed
/// silently, 1024 NaNs and all, and `generate` printed `!!!!` from it. Now the checksum that
/// trainer.json records for every file catches it: `--resume DIR` names the file, `--resume
/// auto` falls back to the checkpoint before, `generate` refuses it; and weights that are not
/// finite are refused by name wherever they are read (a file whose record agrees with it, as
/// if saved so; an HF directory without a record).
#[test]
fn a_damaged_checkpoint_is_named_and_never_loaded() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let base = with(
        &small(&write_corpus(dir)),
        &["train"],
        &[
            "--set",
            "checkpoint.interval=2",
            "--set",
            "checkpoint.keep_last=3",
        ],
    );
    ok(dir, &with(&base, &[], &["--max-steps", "4"]));
    let step4 = dir.join("runs/tiny/checkpoints/step_4");
    let weights = step4.join("model.safetensors");
    overwrite_middle(&weights, 4096);

    fails(
        &run(
            dir,
            &with(
                &base,
                &[],
                &[
                    "--max-steps",
                    "4",
                    "--resume",
                    "runs/tiny/checkpoints/step_4",
                ],
            ),
        ),
        1,
        &[
            "--resume runs/tiny/checkpoints/step_4: the checkpoint is damaged",
            "step_4/model.safetensors: damaged: its contents are not the bytes that were written",
            "--resume auto, which skips damaged checkpoints",
        ],
    );
    let sample = [
        "generate",
        "--model",
        "runs/tiny/checkpoints/step_4",
        "--prompt",
        "ROMEO:",
        "--max-new-tokens",
        "4",
    ];
    let sample: Vec<String> = sample.iter().map(|s| s.to_string()).collect();
    fails(
        &run(dir, &sample),
        1,
        &["step_4/model.safetensors: damaged"],
    );
    // An HF directory has no record: its non-finite weights are refused by name.
    let hf = dir.join("hf");
    fs::create_dir(&hf).unwrap();
    for f in ["model.safetensors", "config.json"] {
        fs::copy(step4.join(f), hf.join(f)).unwrap();
    }
    let mut plain = sample.clone();
    plain[2] = "hf".into();
    plain.extend(["--tokenizer".into(), "gpt2".into()]);
    fails(
        &run(dir, &plain),
        1,
        &[
            "hf/model.safetensors: ",
            " NaN and 0 infinite values of ",
            "use other weights",
        ],
    );
    let text = ok(
        dir,
        &with(&base, &[], &["--max-steps", "4", "--resume", "auto"]),
    );
    assert!(
        text.contains("skipping damaged checkpoint runs/tiny/checkpoints/step_4 (")
            && text.contains("Resumed from runs/tiny/checkpoints/step_2 at step 2"),
        "{text}"
    );
    // The same bytes with a record that agrees with them (as if saved so): the load refuses the
    // non-finite weights by name before a step is taken.
    overwrite_middle(&weights, 4096);
    rerecord(&step4, "model.safetensors");
    let text = fails(
        &run(
            dir,
            &with(
                &base,
                &[],
                &[
                    "--max-steps",
                    "4",
                    "--resume",
                    "runs/tiny/checkpoints/step_4",
                ],
            ),
        ),
        1,
        &[
            "step_4: model.",
            " NaN and 0 infinite values of ",
            "resume from an earlier one",
        ],
    );
    assert!(!text.contains("Step ["), "no step was taken: {text}");
}

/// Finding 5: a missing `optimizer-00002-of-00002.safetensors` or index was fatal under
/// `--resume auto` (the index blamed `model.model_path`, never set), and finding 6: a file of
/// another save mixed into a checkpoint was resumed without a word. One check covers every
/// file a checkpoint's layout needs and its checksum; `--resume auto` falls back.
#[test]
fn resume_auto_falls_back_over_a_missing_or_mixed_file_of_a_sharded_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let base = with(
        &small(&write_corpus(dir)),
        &["run", "--cpu", "--nproc", "2"],
        &[
            "--max-steps",
            "4",
            "--set",
            "checkpoint.interval=2",
            "--set",
            "checkpoint.keep_last=3",
        ],
    );
    ok(dir, &base);
    let root = dir.join("runs/tiny/checkpoints");
    let step4 = root.join("step_4");
    let cases: [(&str, &dyn Fn()); 3] = [
        (
            "step_4/optimizer-00002-of-00002.safetensors: missing (the checkpoint was written by 2 ranks",
            &|| fs::remove_file(step4.join("optimizer-00002-of-00002.safetensors")).unwrap(),
        ),
        (
            "step_4/model.safetensors.index.json: missing: the model is in shards",
            &|| fs::remove_file(step4.join("model.safetensors.index.json")).unwrap(),
        ),
        (
            "step_4/optimizer-00001-of-00002.safetensors: damaged: its contents are not the bytes",
            &|| {
                let f = "optimizer-00001-of-00002.safetensors";
                fs::copy(root.join("step_2").join(f), step4.join(f)).unwrap();
            },
        ),
    ];
    for (said, damage) in cases {
        damage();
        let text = ok(dir, &with(&base, &[], &["--resume", "auto"]));
        assert!(
            text.contains("skipping damaged checkpoint runs/tiny/checkpoints/step_4 (")
                && text.contains(said)
                && text.contains("resuming from runs/tiny/checkpoints/step_2 instead"),
            "{said}:\n{text}"
        );
        assert!(!text.contains("model.model_path"), "{text}");
    }
}

/// Finding 6: two runs of different names sharing one `checkpoint.dir` wrote into the same
/// `step_2.tmp` and left a checkpoint of mixed files. The checkpoint directory is locked like
/// the run directory: the second run stops at once, naming the holder and its run.
#[test]
fn a_checkpoint_dir_in_use_by_another_run_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let base = with(
        &small(&write_corpus(dir)),
        &["train"],
        &["--set", "checkpoint.dir=shared-ckpts", "--max-steps", "200"],
    );
    let slow = [
        "--set",
        "logging.run_name=a",
        "--set",
        "debug.fault=slow",
        "--set",
        "debug.fault_delay_ms=200",
    ];
    let a = Launcher::start(dir, &with(&base, &[], &slow));
    a.wait_for("Step [2/200]", Duration::from_secs(60));
    for launcher in [false, true] {
        let mut args = with(&base, &[], &["--set", "logging.run_name=b"]);
        if launcher {
            args[0] = "run".into();
            args.splice(1..1, ["--cpu".to_string()]);
        }
        fails(
            &run(dir, &args),
            1,
            &[
                "checkpoint.dir shared-ckpts is in use by another training process (pid ",
                ", run runs/a)",
                "Give this run its own checkpoint.dir",
            ],
        );
    }
    assert!(
        !dir.join("runs/b").exists(),
        "the refused run left its directory"
    );
    unsafe { libc::kill(a.pid() as i32, libc::SIGKILL) };
    let _ = a.finish(Duration::from_secs(30));
}

/// Finding 4: the README's first command trained and then failed ("--model
/// runs/demo-…/checkpoints/step_100 (written in the background in 0.66 s): no such directory":
/// it parsed the "Checkpoint saved:" line, which had changed). Scripts no longer parse logs:
/// `generate`, `eval` and `export` take a run directory (or its checkpoints/) for its newest
/// complete checkpoint, and demo.sh passes the run directory. It runs here as a user runs it,
/// from another directory.
#[test]
fn the_readme_demo_trains_and_prints_a_sample() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let out = std::process::Command::new("bash")
        .arg(common::root().join("scripts/demo.sh"))
        .args(["--max-steps", "2", "--set", "training.batch_size=2"])
        .args(["--set", "training.context_length=64"])
        .env("LOCKSTEP_BIN", env!("CARGO_BIN_EXE_lockstep"))
        .current_dir(dir)
        .output()
        .unwrap();
    let text = common::output_text(&out);
    assert!(out.status.success(), "{text}");
    let sample = text
        .lines()
        .find(|l| l.starts_with("ROMEO:"))
        .unwrap_or_else(|| panic!("no sample in:\n{text}"));
    assert!(sample.len() > "ROMEO:".len() + 10, "{sample}");
    assert!(text.contains("64 new tokens"), "{text}");
    assert!(!text.to_lowercase().contains("error"), "{text}");

    // The run directory, its checkpoints/ and a step directory all name the same checkpoint.
    let run_dir = std::fs::read_dir(dir.join("runs"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .find(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("demo-")
        })
        .unwrap();
    let run_dir = run_dir.strip_prefix(dir).unwrap().display().to_string();
    let val = std::fs::read_dir(dir.join(".lockstep/cache"))
        .unwrap()
        .flatten()
        .map(|e| e.path().join("val.tok"))
        .find(|p| p.is_file())
        .unwrap();
    let mut losses = Vec::new();
    for model in [
        run_dir.clone(),
        format!("{run_dir}/checkpoints"),
        format!("{run_dir}/checkpoints/step_2"),
    ] {
        let val = val.display().to_string();
        let eval = [
            "eval",
            "--model",
            &model,
            "--data",
            &val,
            "--max-batches",
            "2",
            "--json",
        ];
        let text = ok(dir, &eval.map(String::from));
        let json = text.lines().find(|l| l.starts_with('{')).unwrap();
        let v: serde_json::Value = serde_json::from_str(json).unwrap();
        losses.push(v["loss"].as_f64().unwrap());
        if !model.ends_with("step_2") {
            assert!(
                text.contains(&format!(
                    "its newest complete checkpoint, {run_dir}/checkpoints/step_2"
                )),
                "{text}"
            );
        }
    }
    assert!(losses.windows(2).all(|w| w[0] == w[1]), "{losses:?}");
    let export = [
        "export",
        "--hf",
        "out",
        "--checkpoint",
        &run_dir,
        "--preset",
        "tiny",
    ];
    ok(dir, &export.map(String::from));
    assert!(dir.join("out/model.safetensors").is_file());
    // A directory that holds no checkpoint says so.
    std::fs::create_dir_all(dir.join("runs/empty/checkpoints")).unwrap();
    std::fs::write(
        dir.join("runs/empty/config.json"),
        std::fs::read(dir.join(&run_dir).join("config.json")).unwrap(),
    )
    .unwrap();
    fails(
        &run(dir, &["generate", "--model", "runs/empty", "--prompt", "x"].map(String::from)),
        1,
        &["--model runs/empty: no complete checkpoint in runs/empty/checkpoints; train the run first"],
    );
}

/// Finding 7: with W&B unreachable, the run waited silently at its end (~47 s), and Ctrl-C
/// there said "saving a checkpoint after step 2", then "no checkpoint was completed, so every
/// step is lost" and exited 130, all false. The wait is said (what for, how long); a first
/// signal says training has ended and what is waited for, a second exits 0.
#[test]
fn stopping_while_the_run_waits_for_a_tracker_says_so_and_exits_0() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let closed = format!("http://127.0.0.1:{}", lockstep::dist::free_port());
    let args = with(
        &small(&write_corpus(dir)),
        &["train"],
        &[
            "--max-steps",
            "2",
            "--set",
            "logging.wandb.project=p",
            "--set",
            "logging.wandb.mode=online",
        ],
    );
    let mut cmd = common::lockstep(dir);
    cmd.args(&args)
        .env("WANDB_BASE_URL", &closed)
        .env("WANDB_API_KEY", "x".repeat(40))
        .env("WANDB_INIT_TIMEOUT", "3");
    let l = Launcher::spawn(cmd);
    l.wait_for("Waiting up to ", Duration::from_secs(120));
    unsafe { libc::kill(l.pid() as i32, libc::SIGINT) };
    l.wait_for(
        "training has ended and its last checkpoint is complete; waiting up to ",
        Duration::from_secs(10),
    );
    unsafe { libc::kill(l.pid() as i32, libc::SIGINT) };
    let (code, text) = l.finish(Duration::from_secs(30));
    assert_eq!(code, Some(0), "{text}");
    assert!(
        text.contains("Waiting up to ")
            && text.contains(
                "for W&B to take the last records and end its run (training has ended and is saved"
            )
            && text.contains("SIGINT again: exiting now; training has ended and is saved"),
        "{text}"
    );
    assert!(
        !text.contains("saving a checkpoint after") && !text.contains("every step is lost"),
        "{text}"
    );
    assert!(dir
        .join("runs/tiny/checkpoints/step_2/trainer.json")
        .is_file());
}

/// Findings 8, 9, 14 and 15: a dangling symlink in a corpus directory was skipped without a
/// word (part of the data missing, exit 0); a tokenizer.json whose vocabulary is only
/// `<|endoftext|>` turned 590 KB into 4 tokens; a UTF-16 file was "invalid UTF-8 at byte 0"
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

    // Finding 13: a negative part was clap's "unexpected argument '-1'".
    fails(
        &run(
            dir,
            &with(&small(&corpus), &["prepare", "--shard", "-1/2"], &[]),
        ),
        1,
        &["--shard -1/2: the part must be I/N with 0 <= I < N <= 99999 (got -1/2)"],
    );
}

/// Finding 10: `plan --gpus 3 --set system.zero_stage=3 --set system.shard_degree=2` answered
/// (exit 0, "replicated across 1") what `train` refuses; and finding 21: accepted without a
/// note were bf16 reductions on CPU ranks, a sharding stage on one rank, and a prefetch of a
/// million units ("1000001 unit gathers in flight" for a 7-unit model). `plan` and `train` run
/// the same rules; each setting that buys nothing gets one warning line; the prefetch is
/// clamped to the model's units.
#[test]
fn plan_refuses_what_train_refuses_and_settings_that_buy_nothing_are_said() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let plan = |sets: &[&str]| -> Vec<String> {
        let mut args = vec!["plan", "--preset", "tiny", "--device", "cpu"];
        for s in sets {
            args.extend(["--set", s]);
        }
        args.iter().map(|s| s.to_string()).collect()
    };
    let mut bad = plan(&["system.zero_stage=3", "system.shard_degree=2"]);
    bad.extend(["--gpus".into(), "3".into()]);
    fails(
        &run(dir, &bad),
        2,
        &["system.shard_degree = 2: must divide the number of ranks, 3"],
    );
    let mut odd = plan(&[
        "system.zero_stage=3",
        "system.prefetch_units=1000000",
        "system.reduce_dtype=bf16",
    ]);
    odd.extend(["--gpus".into(), "2".into()]);
    let text = ok(dir, &odd);
    assert!(
        text.contains("(1 + 6 prefetched = 7 unit gathers in flight)")
            && text.contains("Warning: system.prefetch_units = 1000000 is more than the 6 units this model has besides the one in use; 6 are gathered ahead")
            && text.contains("Warning: system.reduce_dtype = bf16 on CPU ranks rounds every gradient to bf16"),
        "{text}"
    );
    let base = with(
        &small(&write_corpus(dir)),
        &["train"],
        &["--max-steps", "1"],
    );
    let text = ok(dir, &with(&base, &[], &["--set", "system.zero_stage=3"]));
    assert!(
        text.contains("Warning: system.zero_stage = 3 on a single rank: there is no other rank holding the same parameters to shard the state over, so it saves no memory and gathers every unit for nothing"),
        "{text}"
    );
}

/// Finding 11: Tok/s, MFU and the ETA counted validation time (48 tok/s instead of ~380 on the
/// steps that validate), and the same numbers went to metrics.jsonl and the trackers. Training
/// throughput now leaves validation out; validation's own time is reported with its loss.
#[test]
fn throughput_leaves_validation_out_and_validation_says_its_time() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let args = with(
        &small(&write_corpus(dir)),
        &["train"],
        &[
            "--max-steps",
            "8",
            "--set",
            "logging.interval=1",
            "--set",
            "training.eval_interval=2",
            "--set",
            "training.eval_batches=50",
            "--set",
            "logging.verbose=true",
        ],
    );
    let text = ok(dir, &args);
    // Finding 23: one rank's timing line said "all-reduce 25.7 ms" (the global norm's time).
    assert!(
        text.contains("| grad norm ") && !text.contains("all-reduce"),
        "{text}"
    );
    let records = common::records(&dir.join("runs/tiny/metrics.jsonl"));
    let (mut validating, mut plain) = (Vec::new(), Vec::new());
    for r in &records {
        let tok_s = r["tokens_per_s"].as_f64().unwrap();
        match r["val_time_s"].as_f64() {
            Some(t) => {
                assert!(t > 0.0, "{r}");
                validating.push(tok_s);
            }
            None => plain.push(tok_s),
        }
    }
    assert_eq!(validating.len(), 4, "{records:?}");
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (v, p) = (median(&mut validating), median(&mut plain));
    // Validation takes several steps' time here: counted, it cut Tok/s by ~5x.
    assert!(
        v > 0.6 * p,
        "tok/s on validating steps {v} vs others {p}\n{text}"
    );
    assert!(
        text.lines()
            .any(|l| l.contains("Validation | Step [2/8] | Val Loss: ") && l.ends_with(" s")),
        "{text}"
    );
}

/// Findings 12, 12b, 12c, 18 and 19: changing `training.context_length` tokenized the whole
/// corpus again (it was part of the cache key, though it only sized the validation split); a
/// resume with another context length was accepted silently; `checkpoint.keep_every` that is
/// not a multiple of `checkpoint.interval` kept nothing; a resume with another tokenizer was
/// "another model shape" and pointed at the HF config.json for the data; `keep_last=-1` said
/// ">= 0" though 0 is refused too. The token cache is keyed on what changes tokens, each
/// split is checked against the windows when training starts, and the rest are named.
#[test]
fn context_length_and_checkpoint_settings_are_named_and_never_retokenize() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let base = with(
        &small(&write_corpus(dir)),
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

/// The `tmp*wandb-*` directories W&B leaves in /tmp, by name.
fn wandb_tmp_dirs() -> std::collections::BTreeSet<String> {
    fs::read_dir(std::env::temp_dir())
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("tmp") && n.contains("wandb"))
        .collect()
}

/// Findings 16, 17 and 23: `logging.wandb.python=notpython.txt` (a file in the working
/// directory) was looked up on PATH; `/bin/false` said "see sidecar.log", which was empty, and
/// was retried forever; WANDB_DIR was ignored; each failed online start left two empty
/// `/tmp/tmp*wandb-*` directories. The interpreter is a path like every path setting, one that
/// is not a Python running the sidecar is named once with what it printed (and not retried),
/// WANDB_DIR is honoured when logging.wandb.dir is unset, and W&B's temporary files stay under
/// the run's W&B directory.
#[test]
fn wandb_settings_are_resolved_and_a_bad_interpreter_is_named_once() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let tmp_before = wandb_tmp_dirs();
    let base = with(
        &small(&write_corpus(dir)),
        &["train"],
        &["--max-steps", "3", "--set", "logging.wandb.project=p"],
    );
    fs::write(dir.join("notpython.txt"), "not a program").unwrap();
    for (i, (python, says)) in [
        (
            "notpython.txt",
            format!("cannot run the W&B sidecar with {}", dir.join("notpython.txt").display()),
        ),
        (
            "/bin/false",
            "/bin/false exited (exit status: 1) before the sidecar started and printed nothing; it is not a Python that runs the sidecar".to_string(),
        ),
    ]
    .into_iter()
    .enumerate()
    {
        let name = format!("logging.run_name=py{i}");
        let py = format!("logging.wandb.python={python}");
        let started = std::time::Instant::now();
        let text = ok(dir, &with(&base, &[], &["--set", &py, "--set", &name]));
        let warnings: Vec<&str> = text.lines().filter(|l| l.contains("Warning")).collect();
        assert_eq!(warnings.len(), 1, "{text}");
        assert!(warnings[0].contains(&says) && warnings[0].contains("it is off for the rest of this run"), "{text}");
        assert!(started.elapsed() < Duration::from_secs(30), "no retries: {text}");
    }
    // WANDB_DIR, when logging.wandb.dir is unset; and an online start that fails (nothing
    // listening) leaves nothing in /tmp.
    let out = common::lockstep(dir)
        .args(with(
            &base,
            &[],
            &[
                "--set",
                "logging.wandb.mode=offline",
                "--set",
                "logging.run_name=wd",
            ],
        ))
        .env("WANDB_DIR", dir.join("wdir"))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", common::output_text(&out));
    let offline: Vec<_> = fs::read_dir(dir.join("wdir/wandb"))
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("offline-run-"))
        .collect();
    assert_eq!(offline.len(), 1);
    let closed = format!("http://127.0.0.1:{}", lockstep::dist::free_port());
    let out = common::lockstep(dir)
        .args(with(
            &base,
            &[],
            &[
                "--set",
                "logging.wandb.mode=online",
                "--set",
                "logging.run_name=on",
            ],
        ))
        .env("WANDB_BASE_URL", &closed)
        .env("WANDB_API_KEY", "x".repeat(40))
        .env("WANDB_INIT_TIMEOUT", "3")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", common::output_text(&out));
    let new: Vec<String> = wandb_tmp_dirs().difference(&tmp_before).cloned().collect();
    assert!(new.is_empty(), "W&B left {new:?} in /tmp");
}

/// Finding 20b: a 9000-character MLflow run name reached the server, which answered with a
/// confusing "Both 'run_name' argument and 'mlflow.runName' tag" error. MLflow's limits are
/// checked with the config (exit 2, before anything starts).
#[test]
fn mlflow_limits_are_checked_before_a_server_sees_them() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let long = format!("logging.mlflow.run_name={}", "r".repeat(9000));
    let long_experiment = format!("logging.mlflow.experiment={}", "e".repeat(300));
    let args = with(
        &small(&write_corpus(dir)),
        &["train"],
        &[
            "--set",
            "logging.mlflow.tracking_uri=http://127.0.0.1:9",
            "--set",
            &long,
            "--set",
            &long_experiment,
        ],
    );
    fails(
        &run(dir, &args),
        2,
        &[
            "logging.mlflow.run_name is 9000 characters long; MLflow keeps at most 250: shorten it",
            "logging.mlflow.experiment is 300 characters long; MLflow keeps at most 256",
        ],
    );
    assert!(!dir.join("runs").exists());
}

/// Finding 30: sourcing scripts/env.sh turned on `set -euo pipefail` in the caller's shell, so
/// a job script that sources it died at its first failing command. The caller's options stay
/// as they were.
#[test]
fn sourcing_env_sh_leaves_the_callers_shell_options() {
    let script = format!(
        "set +euo pipefail; source {}; false; echo \"survived $-\"; set -o | grep pipefail",
        common::root().join("scripts/env.sh").display()
    );
    let out = std::process::Command::new("bash")
        .args(["-c", &script])
        .output()
        .unwrap();
    let text = common::output_text(&out);
    let flags = text
        .lines()
        .find_map(|l| l.strip_prefix("survived "))
        .unwrap_or_else(|| panic!("the shell died after a failing command:\n{text}"));
    assert!(!flags.contains('e') && !flags.contains('u'), "{text}");
    assert!(text.contains("pipefail") && text.contains("off"), "{text}");
}

/// Finding 31: under srun, start-up errors carried no rank tag, so two tasks printed the same
/// error twice with nothing to tell them apart. Each rank of a job of several tags its error.
#[test]
fn the_errors_of_srun_tasks_say_which_task_they_come_from() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    for r in 0..2 {
        let mut c = common::lockstep(dir);
        for k in [
            "RANK",
            "WORLD_SIZE",
            "LOCAL_RANK",
            "LOCAL_WORLD_SIZE",
            "LOCKSTEP_TAG",
        ] {
            c.env_remove(k);
        }
        let out = c
            .args(["train", "--set", "training.lerning_rate=1"])
            .env("SLURM_PROCID", r.to_string())
            .env("SLURM_NTASKS", "2")
            .output()
            .unwrap();
        let text = common::output_text(&out);
        assert_eq!(out.status.code(), Some(2), "{text}");
        assert!(
            text.starts_with(&format!(
                "[rank {r}] error: --set training.lerning_rate=1: unknown config key"
            )),
            "{text}"
        );
    }
}
