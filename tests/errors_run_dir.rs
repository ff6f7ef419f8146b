//! A run directory is written only inside itself (reliability round 5, issue 45, finding 2): a
//! symbolic link planted at one of its files, or at its checkpoint directory's lock, made
//! lockstep write through it and overwrite the file it pointed at. The run is refused now,
//! naming the link, and the target is untouched. This test stays in the suite for good.

mod common;

use std::fs;
use std::os::unix::fs::symlink;

use common::{cmd, fails, ok, run, small, tmp_leftovers, with, write_corpus};

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
