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
