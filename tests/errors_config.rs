//! Config values and command-line flags that cannot work (reliability round 5, issue 45): each
//! is refused before anything is created, exit 2, naming the key or flag and the fix; values
//! that can work are taken as a user means them. Each test failed before its fix.

mod common;

use std::fs;
use std::path::Path;

use common::{fails, ok, run, small, with, write_corpus};

/// Nothing of a run exists: no run directory, no data cache.
fn nothing_created(dir: &Path) {
    for made in ["runs", "data_cache", "logs"] {
        assert!(!dir.join(made).exists(), "{made} was created");
    }
}

/// Finding 4: `train --max-steps 0` created a run directory and said "Nothing to do: the
/// checkpoint is already at step 0" with no checkpoint; `training.max_steps=0` was refused.
/// Both are refused the same way now.
#[test]
fn zero_steps_are_refused_by_flag_and_by_key_alike() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let base = small(&write_corpus(dir));
    fails(
        &run(dir, &with(&base, &["train"], &["--max-steps", "0"])),
        2,
        &["--max-steps 0: expected integer >= 1"],
    );
    nothing_created(dir);
    fails(
        &run(
            dir,
            &with(&base, &["train"], &["--set", "training.max_steps=0"]),
        ),
        2,
        &["--set training.max_steps=0: expected integer >= 1"],
    );
    nothing_created(dir);
    fails(
        &run(dir, &with(&base, &["plan"], &["--max-steps", "0"])),
        2,
        &["--max-steps 0: expected integer >= 1"],
    );
}

/// Findings 5 and 19: a run name with a newline made a directory named `a⏎b` (and broke log
/// lines); a 300-character one failed with "choose a writable logging.dir: File name too
/// long". Both name logging.run_name and what is wrong with it.
#[test]
fn run_names_with_control_characters_or_too_long_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let base = small(&write_corpus(dir));
    for (name, says) in [
        ("a\nb", "contains the control character '\\n' (U+000A)"),
        ("tab\there", "contains the control character '\\t' (U+0009)"),
        ("bell\u{7}", "contains the control character '\\u{7}' (U+0007)"),
    ] {
        fails(
            &run(
                dir,
                &with(
                    &base,
                    &["train"],
                    &["--set", &format!("logging.run_name={name}")],
                ),
            ),
            2,
            &["logging.run_name = ", says, "one plain folder name"],
        );
        nothing_created(dir);
    }
    let long = "r".repeat(300);
    fails(
        &run(
            dir,
            &with(
                &base,
                &["train"],
                &["--set", &format!("logging.run_name={long}")],
            ),
        ),
        2,
        &[
            "logging.run_name = ",
            "is 300 bytes long; a folder name holds at most 255 bytes",
        ],
    );
    nothing_created(dir);
}

/// Finding 12: `--set system.tensor_parallel=2.0` (or `8.0` from a JSON writer in a --config
/// file) ended in "internal: resolved config does not match its schema". An integral number is
/// the integer it spells, for every integer key and in `plan` too; a fraction names the key.
#[test]
fn integral_floats_are_integers_and_fractions_name_the_key() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let base = small(&write_corpus(dir));
    let cfg = dir.join("floats.json");
    fs::write(
        &cfg,
        r#"{"training": {"batch_size": 2.0, "max_steps": 2.0}, "system": {"tensor_parallel": 1.0}}"#,
    )
    .unwrap();
    let text = ok(
        dir,
        &with(
            &base,
            &["plan"],
            &[
                "--config",
                cfg.to_str().unwrap(),
                "--set",
                "system.zero_stage=1.0",
                "--json",
            ],
        ),
    );
    assert!(text.contains("\"zero_stage\": 1"), "{text}");
    let text = ok(
        dir,
        &with(
            &base,
            &["train"],
            &["--config", cfg.to_str().unwrap(), "--set", "checkpoint.keep_last=2.0"],
        ),
    );
    assert!(text.contains("Step [2/2]"), "{text}");
    fails(
        &run(
            dir,
            &with(&base, &["plan"], &["--set", "system.tensor_parallel=2.5"]),
        ),
        2,
        &["--set system.tensor_parallel=2.5: expected integer >= 1"],
    );
    fs::write(&cfg, r#"{"system": {"tensor_parallel": 1.5}}"#).unwrap();
    fails(
        &run(
            dir,
            &with(&base, &["train"], &["--config", cfg.to_str().unwrap()]),
        ),
        2,
        &["system.tensor_parallel = 1.5 is not allowed; expected integer >= 1"],
    );
}

/// Finding 24: a --config file saved with a UTF-8 byte-order mark (Windows editors) was "not
/// valid JSON at line 1, column 1".
#[test]
fn a_config_file_with_a_byte_order_mark_is_read() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let base = small(&write_corpus(dir));
    let cfg = dir.join("bom.json");
    fs::write(&cfg, "\u{feff}{\"training\": {\"max_steps\": 2}}\n").unwrap();
    let text = ok(
        dir,
        &with(&base, &["train"], &["--config", cfg.to_str().unwrap()]),
    );
    assert!(text.contains("Step [2/2]"), "{text}");
}

/// Finding 23: `system.collective_timeout_s=0` said "must be at least 1" while CONFIG.md and
/// `config --keys` said `integer >= 0`: the table and the check are one now.
#[test]
fn the_collective_timeout_schema_and_check_agree() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let base = small(&write_corpus(dir));
    fails(
        &run(
            dir,
            &with(
                &base,
                &["train"],
                &["--set", "system.collective_timeout_s=0"],
            ),
        ),
        2,
        &["--set system.collective_timeout_s=0: expected integer >= 1"],
    );
    let keys = ok(dir, &["config".into(), "--keys".into()]);
    let line = keys
        .lines()
        .find(|l| l.starts_with("system.collective_timeout_s"))
        .unwrap();
    assert!(line.contains("integer >= 1"), "{line}");
}

/// Finding 22: usage errors of `plan` and `eval` (`--gpus 0`, `--max-batches 0`) exited 1,
/// though the README documents 2 for them.
#[test]
fn flag_values_that_cannot_work_exit_2() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let base = small(&write_corpus(dir));
    fails(
        &run(dir, &with(&base, &["plan"], &["--gpus", "0"])),
        2,
        &["--gpus 0: plan for at least one rank"],
    );
    fails(
        &run(dir, &with(&base, &["plan"], &["--mfu", "1.5"])),
        2,
        &["--mfu 1.5: a fraction in (0, 1]"],
    );
    for (flag, value, says) in [
        (
            "--max-batches",
            "0",
            "--max-batches 0 evaluates nothing; leave it out",
        ),
        ("--batch-size", "0", "--batch-size 0: must be at least 1"),
        ("--device", "tpu", "--device tpu: expected auto, cpu, cuda or cuda:N"),
        ("--dtype", "fp8", "--dtype fp8: expected fp32 or bf16"),
    ] {
        fails(
            &run(
                dir,
                &[
                    "eval".into(),
                    "--model".into(),
                    "nowhere".into(),
                    "--data".into(),
                    "nothing.txt".into(),
                    flag.into(),
                    value.into(),
                ],
            ),
            2,
            &[says],
        );
    }
}

/// Finding 18: the "Next:" commands a finished run prints were not shell-quoted, so a run name
/// with a space broke the pasted command. Each printed command, run as printed by a shell, works.
#[test]
fn the_next_commands_paste_into_a_shell() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let base = small(&write_corpus(dir));
    let text = ok(
        dir,
        &with(
            &base,
            &["train"],
            &["--max-steps", "2", "--set", "logging.run_name=my run $x"],
        ),
    );
    let generate = text
        .lines()
        .find_map(|l| l.split_once(" generate --model ").map(|(_, rest)| rest))
        .unwrap_or_else(|| panic!("no generate line in:\n{text}"));
    assert!(generate.starts_with("'runs/my run $x/checkpoints/step_2'"), "{generate}");
    let exe = env!("CARGO_BIN_EXE_lockstep");
    let line = format!("'{exe}' generate --model {generate}")
        .replace("--max-new-tokens 64", "--max-new-tokens 4 --device cpu");
    let out = std::process::Command::new("sh")
        .arg("-c")
        .arg(&line)
        .current_dir(dir)
        .output()
        .unwrap();
    assert!(out.status.success(), "{line}: {}", common::output_text(&out));
}
