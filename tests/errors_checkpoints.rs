//! Checkpoints that a command picks, and checkpoints that are damaged, unverified, of another
//! shape or not checkpoints at all. A command naming a run reads that run's newest complete
//! checkpoint from anywhere (the README's demo does); a checkpoint a reader holds survives
//! rotation; a damaged one (its checksums, a missing or mixed file) is named and never loaded,
//! and `--resume auto` falls back over it and keeps it as evidence; one without checksums is said
//! to be loaded unverified; what is ignored is said with its cause; a checkpoint directory in use
//! by another run is refused; a resume with nothing to do says why; a refused resume keeps
//! everything. From the reliability rounds (issue 20; round 4, issue 32; round 5, issue 45: a bare
//! "Item N" is issue 45's) and the rows of docs/FAILURES.md; each finding's test failed before
//! its fix.

use crate::common;

use std::fs;
use std::io::{Seek, SeekFrom, Write};
use std::os::fd::AsRawFd;
use std::path::Path;
use std::time::Duration;

use common::{cmd, fails, ok, output_text, run, small, snapshot, with, write_corpus, Launcher};

/// The directories under `root`, sorted.
fn names(root: &Path) -> Vec<String> {
    let mut v: Vec<String> = fs::read_dir(root)
        .unwrap()
        .filter_map(|e| {
            let e = e.unwrap();
            e.path()
                .is_dir()
                .then(|| e.file_name().to_string_lossy().into_owned())
        })
        .collect();
    v.sort();
    v
}

/// Copies the files of the directory `from` into a new directory `to`.
fn copy_dir(from: &Path, to: &Path) {
    fs::create_dir_all(to).unwrap();
    for e in fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

/// Item 1: `eval`/`generate`/`export` naming a run trained with a relative checkpoint.dir,
/// run from another directory, read that run's checkpoints, never a decoy at the same relative
/// path under the current directory. A run that does not record its checkpoint directory (an
/// older lockstep) is refused, naming both the relative setting and where it would point here.
#[test]
fn a_command_naming_a_run_reads_its_checkpoints_not_those_under_the_current_directory() {
    let tmp = tempfile::tempdir().unwrap();
    let (x, y) = (tmp.path().join("x"), tmp.path().join("y"));
    fs::create_dir_all(&x).unwrap();
    fs::create_dir_all(&y).unwrap();
    let base = small(&write_corpus(tmp.path()));
    ok(
        &x,
        &with(
            &base,
            &["train"],
            &["--max-steps", "2", "--set", "checkpoint.dir=ckpts"],
        ),
    );
    let mine = x.join("ckpts/step_2");
    assert!(mine.join("trainer.json").is_file());
    // The decoy: a complete checkpoint at the same relative path under y, and newer.
    copy_dir(&mine, &y.join("ckpts/step_9"));
    let run_dir = x.join("runs/tiny");
    let model = run_dir.to_str().unwrap();
    let picked = format!("its newest complete checkpoint, {}", mine.display());

    let generate = [
        "generate",
        "--model",
        model,
        "--prompt-ids",
        "1,2",
        "--max-new-tokens",
        "2",
    ];
    let text = ok(&y, &with(&[], &generate, &["--device", "cpu"]));
    assert!(text.contains(&picked) && !text.contains("step_9"), "{text}");
    let eval = [
        "eval",
        "--model",
        model,
        "--device",
        "cpu",
        "--max-batches",
        "1",
    ];
    let corpus = tmp.path().join("corpus/doc0.txt");
    let text = ok(&y, &with(&[], &eval, &["--data", corpus.to_str().unwrap()]));
    assert!(text.contains(&picked) && !text.contains("step_9"), "{text}");
    let text = ok(
        &y,
        &with(&base, &["export"], &["--checkpoint", model, "--hf", "out"]),
    );
    assert!(text.contains(&picked) && !text.contains("step_9"), "{text}");

    // A run that did not record where its relative checkpoint.dir was: refused, both named.
    fs::remove_file(run_dir.join("checkpoint_dir.txt")).unwrap();
    let text = fails(
        &run(&y, &with(&[], &generate, &["--device", "cpu"])),
        1,
        &[
            "checkpoint.dir `ckpts` is relative",
            "checkpoint_dir.txt is missing",
        ],
    );
    assert!(
        text.contains(&format!("{}", y.join("ckpts").display())),
        "{text}"
    );
}

/// Item 9: rotation (`checkpoint.keep_last=1`) of a run that is still training leaves the
/// checkpoint a reader holds (`generate --model RUN_DIR` takes a shared flock on its
/// trainer.json, the protocol this test follows) and deletes the others.
#[test]
fn rotation_keeps_a_checkpoint_that_a_reader_holds() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let base = with(
        &small(&write_corpus(dir)),
        &["train"],
        &[
            "--set",
            "checkpoint.interval=1",
            "--set",
            "checkpoint.keep_last=1",
        ],
    );
    ok(dir, &with(&base, &[], &["--max-steps", "1"]));
    let root = dir.join("runs/tiny/checkpoints");
    assert_eq!(names(&root), ["step_1"]);
    let reader = fs::File::open(root.join("step_1/trainer.json")).unwrap();
    // SAFETY: flock on a descriptor the test owns.
    assert_eq!(unsafe { libc::flock(reader.as_raw_fd(), libc::LOCK_SH) }, 0);
    ok(
        dir,
        &with(&base, &[], &["--max-steps", "3", "--resume", "auto"]),
    );
    assert_eq!(
        names(&root),
        ["step_1", "step_3"],
        "the held step_1 must outlive rotation, step_2 must not"
    );
    drop(reader);
    // Released, it goes at the next save.
    ok(
        dir,
        &with(&base, &[], &["--max-steps", "4", "--resume", "auto"]),
    );
    assert_eq!(names(&root), ["step_4"]);
}

/// Item 8: the damaged newest checkpoint that `--resume auto` skips is renamed
/// `step_N.damaged` (said), so the run's next save of step N does not overwrite it; rotation
/// never deletes it, later resumes and the commands never pick it, and resumes say it is there.
#[test]
fn a_damaged_checkpoint_skipped_by_resume_auto_is_kept_as_step_n_damaged() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let base = with(
        &small(&write_corpus(dir)),
        &["train"],
        &["--set", "checkpoint.interval=2"],
    );
    ok(dir, &with(&base, &[], &["--max-steps", "4"]));
    let root = dir.join("runs/tiny/checkpoints");
    let weights = root.join("step_4/model.safetensors");
    let len = fs::metadata(&weights).unwrap().len();
    fs::File::options()
        .write(true)
        .open(&weights)
        .unwrap()
        .set_len(len - 1000)
        .unwrap();
    let text = ok(
        dir,
        &with(
            &base,
            &[],
            &[
                "--max-steps",
                "6",
                "--resume",
                "auto",
                "--set",
                "checkpoint.keep_last=1",
            ],
        ),
    );
    assert!(
        text.contains(
            "renamed the damaged runs/tiny/checkpoints/step_4 to \
             runs/tiny/checkpoints/step_4.damaged"
        ) && text.contains("resuming from runs/tiny/checkpoints/step_2 instead"),
        "{text}"
    );
    // The evidence as it was; the new step_4 and step_2 rotated away (keep_last=1).
    assert_eq!(names(&root), ["step_4.damaged", "step_6"]);
    assert_eq!(
        fs::metadata(root.join("step_4.damaged/model.safetensors"))
            .unwrap()
            .len(),
        len - 1000
    );
    let text = ok(
        dir,
        &with(&base, &[], &["--max-steps", "7", "--resume", "auto"]),
    );
    assert!(
        text.contains("Ignoring runs/tiny/checkpoints/step_4.damaged: a damaged checkpoint")
            && text.contains("Resumed from runs/tiny/checkpoints/step_6"),
        "{text}"
    );
    let only = dir.join("only");
    fs::create_dir_all(&only).unwrap();
    fs::rename(root.join("step_4.damaged"), only.join("step_4.damaged")).unwrap();
    fails(
        &run(
            dir,
            &["generate", "--model", "only", "--prompt-ids", "1"].map(String::from),
        ),
        1,
        &[
            "no complete checkpoint in only (not checkpoints: only/step_4.damaged: a damaged \
           checkpoint that --resume auto set aside",
        ],
    );
}

/// `train` with `checkpoint.dir=shared` for two steps in `dir`; the arguments of that run.
fn train_into_shared(dir: &Path) -> Vec<String> {
    let base = with(
        &small(&write_corpus(dir)),
        &["train"],
        &[
            "--set",
            "checkpoint.interval=2",
            "--set",
            "checkpoint.dir=shared",
        ],
    );
    ok(dir, &with(&base, &[], &["--max-steps", "2"]));
    base
}

/// Item 16: a second run (a run name of its own) into an explicit checkpoint.dir that holds
/// another run's checkpoints is told to pass --resume auto or give it a checkpoint.dir of its
/// own; "set logging.run_name" would not help.
#[test]
fn a_second_run_into_an_explicit_checkpoint_dir_is_told_about_checkpoint_dir() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let base = train_into_shared(dir);
    let second = with(
        &base,
        &[],
        &["--max-steps", "2", "--set", "logging.run_name=b"],
    );
    let text = fails(
        &run(dir, &second),
        1,
        &[
            "checkpoint.dir shared already holds checkpoints (latest shared/step_2)",
            "pass --resume auto",
            "--set checkpoint.dir=DIR",
        ],
    );
    assert!(!text.contains("logging.run_name"), "{text}");
}

/// Items 7 and 15. A checkpoint whose trainer.json has no checksums is resumed (and read by
/// `generate`) with a warning that it was loaded unverified; `step_N` without trainer.json and
/// names that are not `step_<number>` are ignored with what is wrong with them, not "a save
/// was interrupted", there and in the "no complete checkpoint" message of the commands.
#[test]
fn unverified_and_stray_checkpoints_are_named_with_the_cause() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let base = train_into_shared(dir);
    // Item 7: trainer.json without its "files" list.
    let trainer = dir.join("shared/step_2/trainer.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(&trainer).unwrap()).unwrap();
    v.as_object_mut().unwrap().remove("files").unwrap();
    fs::write(&trainer, serde_json::to_vec_pretty(&v).unwrap()).unwrap();
    // Item 15: directories named like checkpoints that are not.
    for stray in ["step_7", "step_abc", "step_-1"] {
        fs::create_dir_all(dir.join("shared").join(stray)).unwrap();
    }
    let text = ok(
        dir,
        &with(&base, &[], &["--max-steps", "3", "--resume", "auto"]),
    );
    let generate = |model: &str| {
        [
            "generate",
            "--model",
            model,
            "--prompt-ids",
            "1",
            "--max-new-tokens",
            "1",
        ]
        .map(String::from)
    };
    let read = ok(dir, &generate("shared/step_2"));
    // Only strays: the "no complete checkpoint" message names them and why.
    fs::create_dir_all(dir.join("strays/step_5")).unwrap();
    let none = fails(&run(dir, &generate("strays")), 1, &[]);
    let missing: Vec<&str> = [
        (
            &text,
            "Warning: shared/step_2/trainer.json has no checksums",
        ),
        (&text, "it was loaded unverified"),
        (&text, "Resumed from shared/step_2"),
        (&text, "Ignoring shared/step_7: step_7 has no trainer.json"),
        (
            &text,
            "Ignoring shared/step_abc: step_abc is not a checkpoint name (step_<number>); move \
             it out of checkpoint.dir",
        ),
        (
            &text,
            "Ignoring shared/step_-1: step_-1 is not a checkpoint name",
        ),
        (&read, "shared/step_2/trainer.json has no checksums"),
        (
            &none,
            "no complete checkpoint in strays (not checkpoints: strays/step_5: step_5 has no \
             trainer.json",
        ),
    ]
    .into_iter()
    .filter(|(out, part)| !out.contains(part))
    .map(|(_, part)| part)
    .collect();
    assert!(
        missing.is_empty(),
        "missing {missing:#?} in:\n{text}\n{read}\n{none}"
    );
    assert!(!text.contains("a save was interrupted"), "{text}");
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

/// Issue 20, finding 7: a damaged newest checkpoint no longer stops `--resume auto`: it falls back
/// to the newest one that loads and says what is trained again.
#[test]
fn resume_auto_skips_a_damaged_newest_checkpoint_and_says_what_is_redone() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let corpus = write_corpus(dir);
    let base = with(
        &small(&corpus),
        &["train"],
        &[
            "--set",
            "checkpoint.interval=2",
            "--set",
            "checkpoint.keep_last=3",
        ],
    );
    ok(dir, &with(&base, &[], &["--max-steps", "4"]));
    let root = dir.join("runs/tiny/checkpoints");
    for damage in ["weights", "trainer.json"] {
        match damage {
            "weights" => {
                let f = root.join("step_4/model.safetensors");
                let len = fs::metadata(&f).unwrap().len();
                fs::File::options()
                    .write(true)
                    .open(&f)
                    .unwrap()
                    .set_len(len - 1000)
                    .unwrap();
            }
            _ => {
                let f = root.join("step_4/trainer.json");
                let text = fs::read_to_string(&f).unwrap();
                fs::write(&f, &text[..text.len() / 2]).unwrap();
            }
        }
        let text = ok(
            dir,
            &with(&base, &[], &["--max-steps", "4", "--resume", "auto"]),
        );
        assert!(
            text.contains("skipping damaged checkpoint runs/tiny/checkpoints/step_4 (")
                && text.contains(
                    "resuming from runs/tiny/checkpoints/step_2 instead; steps 3..=4 will be \
                     trained again"
                )
                && text.contains("Resumed from")
                && text.contains("at step 2 "),
            "{damage}: {text}"
        );
        // The damaged one was set aside (step_4.damaged…) and step 4 saved anew.
        assert!(text.contains("Checkpoint saved"), "{text}");
    }
    fails(
        &run(dir, &with(&base, &[], &["--resume", "runs/none/step_1"])),
        2,
        &["--resume runs/none/step_1: no such directory"],
    );
}

/// Issue 20, finding 14: a resumed checkpoint already past `--max-steps` or `--stop-at-step` says
/// so.
#[test]
fn nothing_to_do_says_why_and_what_to_pass() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let corpus = write_corpus(dir);
    let base = with(&small(&corpus), &["train"], &[]);
    ok(dir, &with(&base, &[], &["--max-steps", "4"]));
    let text = ok(
        dir,
        &with(&base, &[], &["--max-steps", "2", "--resume", "auto"]),
    );
    assert!(
        text.contains("Nothing to do: the checkpoint is at step 4, past training.max_steps = 2")
            && text.contains("pass --max-steps (or training.max_steps) above 4"),
        "{text}"
    );
    let text = ok(
        dir,
        &with(
            &base,
            &[],
            &[
                "--max-steps",
                "8",
                "--stop-at-step",
                "3",
                "--resume",
                "auto",
            ],
        ),
    );
    assert!(
        text.contains("Nothing to do: --stop-at-step 3 is not after the resumed step 4")
            && text.contains("pass a step between 5 and 8"),
        "{text}"
    );
}

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

/// Round 4 (issue 32), finding 3: 4 KB of 0xFF written into a checkpoint's model file (same size)
/// was resumed silently, 1024 NaNs and all, and `generate` printed `!!!!` from it. Now the checksum
/// that trainer.json records for every file catches it: `--resume DIR` names the file, `--resume
/// auto` falls back to the checkpoint before, `generate` refuses it; and weights that are not
/// finite are refused by name wherever they are read (a file whose record agrees with it, as if
/// saved so; an HF directory without a record).
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

/// Round 4 (issue 32), finding 5: a missing `optimizer-00002-of-00002.safetensors` or index was
/// fatal under `--resume auto` (the index blamed `model.model_path`, never set), and finding 6: a
/// file of another save mixed into a checkpoint was resumed without a word. One check covers every
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

/// Round 4 (issue 32), finding 6: two runs of different names sharing one `checkpoint.dir` wrote
/// into the same `step_2.tmp` and left a checkpoint of mixed files. The checkpoint directory is
/// locked like the run directory: the second run stops at once, naming the holder and its run.
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

/// Round 4 (issue 32), finding 4: the README's first command trained and then failed ("--model
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
