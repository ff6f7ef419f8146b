//! Run directories: where a run writes and what it leaves there. A run directory is written only
//! inside itself (a symbolic link planted in it is refused, the target untouched); a config file
//! given from it is never overwritten; a refused start leaves no empty `runs/`; a `logging.dir`
//! that cannot be created is named; metrics.jsonl reads as one run after a resume, and a fresh
//! start keeps the earlier record aside. From the reliability rounds (issue 20; round 5, issue
//! 45) and the rows of docs/FAILURES.md; each finding's test failed before its fix.

use crate::common;

use std::fs;
use std::os::unix::fs::symlink;
use std::path::Path;

use common::{cmd, fails, ok, output_text, run, small, tmp_leftovers, tree, with, write_corpus};

/// Round 5 (issue 45), finding 2: a symbolic link planted at one of a run directory's files, or
/// at its checkpoint directory's lock, made lockstep write through it and overwrite the file it
/// pointed at. The run is refused now, naming the link, and the target is untouched. This test
/// stays in the suite for good.
#[test]
fn links_out_of_a_run_directory_are_refused_and_never_written_through() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let base = small(&write_corpus(dir));
    let victim = dir.join("victim.txt");
    let precious = "a file outside the run that must survive\n";
    for (run_name, entry) in [
        ("a", "config.json"),
        ("b", "run.lock"),
        ("c", "checkpoints/checkpoints.lock"),
        ("d", "metrics.jsonl"),
        ("e", "checkpoints/step_2"),
    ] {
        fs::write(&victim, precious).unwrap();
        let link = dir.join("runs").join(run_name).join(entry);
        fs::create_dir_all(link.parent().unwrap()).unwrap();
        symlink(&victim, &link).unwrap();
        let args = with(
            &base,
            &["train"],
            &[
                "--max-steps",
                "2",
                "--set",
                &format!("logging.run_name={run_name}"),
            ],
        );
        fails(
            &run(dir, &args),
            1,
            &[
                &format!("runs/{run_name}/{entry} is a symbolic link to"),
                "victim.txt, outside the",
                "Remove the link",
            ],
        );
        assert_eq!(fs::read_to_string(&victim).unwrap(), precious, "{entry}");
        assert!(fs::symlink_metadata(&link).unwrap().is_symlink(), "{entry}");
    }
    // A link that stays inside the run directory is the user's business, and so is a run
    // directory that is itself a link (runs kept on another disk).
    let elsewhere = dir.join("big-disk/f");
    fs::create_dir_all(&elsewhere).unwrap();
    symlink(&elsewhere, dir.join("runs/f")).unwrap();
    symlink("checkpoints", elsewhere.join("ckpt")).unwrap();
    ok(
        dir,
        &with(
            &base,
            &["train"],
            &["--max-steps", "2", "--set", "logging.run_name=f"],
        ),
    );
    assert!(elsewhere.join("checkpoints/step_2/trainer.json").is_file());
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

/// Issue 20, finding 2: `--config experiments/exp1/config.json` with `logging.dir=experiments` and
/// `logging.run_name=exp1` replaced the user's file with the resolved config.
#[test]
fn a_config_file_in_the_run_directory_is_never_overwritten() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let corpus = write_corpus(dir);
    fs::create_dir_all(dir.join("experiments/exp1")).unwrap();
    let mine = r#"{"training": {"learning_rate": 0.002}}"#;
    let file = dir.join("experiments/exp1/config.json");
    fs::write(&file, mine).unwrap();
    let base = with(
        &small(&corpus),
        &["train"],
        &[
            "--config",
            "experiments/exp1/config.json",
            "--set",
            "logging.dir=experiments",
            "--set",
            "logging.run_name=exp1",
            "--max-steps",
            "1",
        ],
    );
    fails(
        &run(dir, &base),
        2,
        &[
            "--config experiments/exp1/config.json is the run directory's config.json",
            "logging.run_name = \"exp1\"",
            "Keep your config outside the run directory",
            "--set logging.run_name=NAME",
        ],
    );
    assert_eq!(
        fs::read_to_string(&file).unwrap(),
        mine,
        "the file was changed"
    );
    assert_eq!(tree(&dir.join("experiments")), ["exp1", "exp1/config.json"]);

    // The config.json lockstep wrote, given back unchanged, is fine (nothing would change).
    let plain = with(&small(&corpus), &["train"], &["--max-steps", "1"]);
    ok(dir, &plain);
    let written = dir.join("runs/tiny/config.json");
    let before = fs::read(&written).unwrap();
    ok(
        dir,
        &[
            "train",
            "--preset",
            "tiny",
            "--config",
            "runs/tiny/config.json",
            "--resume",
            "auto",
        ]
        .map(String::from),
    );
    assert_eq!(fs::read(&written).unwrap(), before);
}

/// Issue 20, finding 15: a start refused after the run directory was claimed (here: no such data)
/// leaves no empty `runs/`; more threads than CPUs are named.
#[test]
fn a_refused_start_leaves_no_empty_runs_and_too_many_threads_are_named() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let corpus = write_corpus(dir);
    let missing = with(
        &small(&corpus),
        &["train"],
        &["--set", "data.path=nowhere.txt", "--max-steps", "1"],
    );
    let out = run(dir, &missing);
    assert_eq!(out.status.code(), Some(1), "{}", output_text(&out));
    assert!(!dir.join("runs").exists(), "{:?}", tree(dir));

    let many = with(
        &small(&corpus),
        &["train"],
        &["--set", "system.num_threads=1000", "--max-steps", "1"],
    );
    let text = ok(dir, &many);
    assert!(
        text.contains("Warning: system.num_threads = 1000 is more than the")
            && text.contains("CPUs this process may use"),
        "{text}"
    );
}

/// Issue 20, finding 5: metrics.jsonl reads as one run after a resume from an earlier checkpoint,
/// and a fresh start begins a new record, keeping the old one under a name that says so.
#[test]
fn metrics_rewind_on_resume_and_start_anew_on_a_fresh_start() {
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
            "--set",
            "logging.tensorboard=true",
        ],
    );
    ok(dir, &with(&base, &[], &["--max-steps", "5"]));
    let run_dir = dir.join("runs/tiny");
    let steps = |p: &Path| -> Vec<u64> { common::losses(p).into_iter().map(|s| s.0).collect() };
    assert_eq!(steps(&run_dir.join("metrics.jsonl")), [1, 2, 3, 4, 5]);
    // As if killed after step 5 with step_4 the last checkpoint.
    fs::remove_dir_all(run_dir.join("checkpoints/step_5")).unwrap();
    let text = ok(
        dir,
        &with(&base, &[], &["--max-steps", "6", "--resume", "auto"]),
    );
    assert!(
        text.contains("metrics.jsonl: removed 1 records after step 4"),
        "{text}"
    );
    assert_eq!(steps(&run_dir.join("metrics.jsonl")), [1, 2, 3, 4, 5, 6]);

    // A fresh start in the same directory (checkpoints gone).
    fs::remove_dir_all(run_dir.join("checkpoints")).unwrap();
    let text = ok(
        dir,
        &with(&base, &[], &["--max-steps", "2", "--resume", "auto"]),
    );
    assert!(
        text.contains("metrics.jsonl: a fresh start; the earlier record is kept as")
            && text.contains("TensorBoard: a fresh start; the earlier run's events are kept in"),
        "{text}"
    );
    assert_eq!(steps(&run_dir.join("metrics.jsonl")), [1, 2]);
    let previous: Vec<_> = fs::read_dir(&run_dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("metrics.previous-") && n.ends_with(".jsonl"))
        .collect();
    assert_eq!(previous.len(), 1, "{previous:?}");
    assert_eq!(steps(&run_dir.join(&previous[0])), [1, 2, 3, 4, 5, 6]);
    let tb: Vec<String> = tree(&run_dir.join("tensorboard"));
    assert!(
        tb.iter()
            .any(|p| p.starts_with("previous-") && p.contains("events.out")),
        "{tb:?}"
    );
}
