//! Checkpoints that a command picks, and checkpoints that are damaged, unverified or not
//! checkpoints at all (issue 45, items 1, 7, 8, 9, 15, 16): each test failed before its fix.
//! A command naming a run reads that run's checkpoints from anywhere; a checkpoint a reader
//! holds survives rotation; a damaged one `--resume auto` skips is kept as evidence; one
//! without checksums is said to be loaded unverified; what is ignored is said with its cause.

mod common;

use std::fs;
use std::os::fd::AsRawFd;
use std::path::Path;

use common::{cmd, fails, ok, output_text, run, small, snapshot, with, write_corpus};

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
