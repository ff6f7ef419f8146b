//! Config values, config files and command-line flags that cannot work: a malformed or misspelt
//! config file, run names that are not one plain folder name, flag values out of range, shard
//! and parallelism settings that do not fit the ranks. Each is refused before anything is
//! created, exit 2, naming the key or flag and the fix, and `plan` refuses what a run refuses;
//! values that can work are taken as a user means them, and settings that buy nothing are said.
//! From the reliability rounds (issue 20; round 4, issue 32; round 5, issue 45: a bare "Finding
//! N" is round 5's) and the rows of docs/FAILURES.md; each finding's test failed before its fix.

use crate::common;

use std::fs;
use std::path::Path;

use common::{cmd, fails, ok, output_text, run, small, snapshot, tree, with, write_corpus};

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
        (
            "bell\u{7}",
            "contains the control character '\\u{7}' (U+0007)",
        ),
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
            &[
                "--config",
                cfg.to_str().unwrap(),
                "--set",
                "checkpoint.keep_last=2.0",
            ],
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
        (
            "--device",
            "tpu",
            "--device tpu: expected auto, cpu, cuda or cuda:N",
        ),
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
    assert!(
        generate.starts_with("'runs/my run $x/checkpoints/step_2'"),
        "{generate}"
    );
    let exe = env!("CARGO_BIN_EXE_lockstep");
    let line = format!("'{exe}' generate --model {generate}")
        .replace("--max-new-tokens 64", "--max-new-tokens 4 --device cpu");
    let out = std::process::Command::new("sh")
        .arg("-c")
        .arg(&line)
        .current_dir(dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{line}: {}",
        common::output_text(&out)
    );
}

/// `lockstep plan` for `base` on `gpus` ranks of `device` with `sets`.
fn plan(
    dir: &Path,
    base: &[String],
    device: &str,
    gpus: usize,
    sets: &[&str],
) -> std::process::Output {
    let mut tail = vec![
        "--device".to_string(),
        device.into(),
        "--gpus".into(),
        gpus.to_string(),
    ];
    for s in sets {
        tail.extend(["--set".to_string(), s.to_string()]);
    }
    let tail: Vec<&str> = tail.iter().map(String::as_str).collect();
    run(dir, &with(base, &["plan"], &tail))
}

/// Finding 3: `plan --device cpu … system.dist_backend=nccl` planned a ring where `run --cpu`
/// refuses it: plan makes the one check train and run make.
#[test]
fn plan_refuses_what_a_run_refuses() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let base = small(&write_corpus(dir));
    let nccl = ["system.dist_backend=nccl"];
    fails(
        &plan(dir, &base, "cpu", 2, &nccl),
        2,
        &["system.dist_backend = nccl needs CUDA ranks, but lockstep plan plans CPU ranks"],
    );
    fails(
        &run(
            dir,
            &with(
                &base,
                &["run", "--nproc", "2", "--cpu", "--"],
                &["--set", nccl[0]],
            ),
        ),
        2,
        &["system.dist_backend = nccl needs CUDA ranks, but lockstep run starts CPU workers"],
    );
    nothing_created(dir);
    // On CUDA ranks the plan is made.
    let out = plan(dir, &base, "cuda", 2, &nccl);
    assert_eq!(out.status.code(), Some(0), "{}", common::output_text(&out));
}

/// Finding 13: `run --nproc 2 … context_parallel=3` (context 64) first advised a context
/// parallelism whose double divides the context (2, 4, 8, 16, 32), and a second try with 4 was
/// refused by the next rule. The values offered now pass every rule at once.
#[test]
fn context_parallel_advice_passes_every_rule() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let base = small(&write_corpus(dir));
    fails(
        &plan(dir, &base, "cpu", 2, &["system.context_parallel=3"]),
        2,
        &["system.context_parallel = 3: must divide the number of ranks, 2; valid here: 1, 2"],
    );
    // 8 ranks at T 2 leave 4; a context of 36 cuts into 2C chunks for C = 1, 2, 3, 9, 18: of
    // those only 1 and 2 divide the 4 ranks.
    let mesh = |cp: &str| {
        vec![
            "system.tensor_parallel=2".to_string(),
            "training.context_length=36".into(),
            format!("system.context_parallel={cp}"),
        ]
    };
    let sets = mesh("4");
    let sets: Vec<&str> = sets.iter().map(String::as_str).collect();
    let text = fails(
        &plan(dir, &base, "cuda", 8, &sets),
        2,
        &[
            "system.context_parallel = 4 cuts every sequence into 2 × 4 = 8 chunks",
            "or another system.context_parallel (valid here: 1, 2)",
        ],
    );
    assert!(!text.contains(" 3,") && !text.contains("9"), "{text}");
    for cp in ["1", "2"] {
        let sets = mesh(cp);
        let sets: Vec<&str> = sets.iter().map(String::as_str).collect();
        let out = plan(dir, &base, "cuda", 8, &sets);
        assert_eq!(out.status.code(), Some(0), "{}", common::output_text(&out));
    }
}

/// Finding 25: with CP 4 and TP 2 on 16 ranks the error called the 8 ranks that shard the state
/// "the data-parallel ranks" while `plan --json` said `data_parallel_ranks: 2`. Both speak of
/// replicas (data × context) and data ranks alike now.
#[test]
fn the_shard_degree_error_and_the_plan_count_ranks_alike() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let base = small(&write_corpus(dir));
    let mesh = [
        "system.context_parallel=4",
        "system.tensor_parallel=2",
        "system.zero_stage=1",
    ];
    fails(
        &plan(dir, &base, "cuda", 16, &[&mesh[..], &["system.shard_degree=3"]].concat()),
        2,
        &["system.shard_degree = 3: must divide the 8 replicas (the ranks that hold the same parameters: 2 data × 4 context-parallel ranks, the 16 ranks over system.tensor_parallel = 2)", "valid here: 0, 1, 2, 4, 8"],
    );
    let mut args = with(
        &base,
        &["plan"],
        &["--device", "cuda", "--gpus", "16", "--json"],
    );
    for s in mesh {
        args.extend(["--set".to_string(), s.to_string()]);
    }
    let json: serde_json::Value = serde_json::from_str(&ok(dir, &args)).unwrap();
    assert_eq!(json["data_parallel_ranks"], 2, "{json}");
}

/// Finding 14: TP 2 on 2 ranks at zero_stage 3 (one replica: nothing to shard over) said
/// nothing, where a single rank is warned that it saves no memory.
#[test]
fn zero_stages_with_one_replica_are_warned_about() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let base = small(&write_corpus(dir));
    let out = plan(
        dir,
        &base,
        "cpu",
        2,
        &["system.tensor_parallel=2", "system.zero_stage=3"],
    );
    let text = common::output_text(&out);
    assert_eq!(out.status.code(), Some(0), "{text}");
    assert!(
        text.contains("Warning: system.zero_stage = 3 with one replica (the 2 ranks form one system.tensor_parallel = 2 group): there is no other rank holding the same parameters to shard the state over, so it saves no memory"),
        "{text}"
    );
    // Two replicas: no such warning.
    let out = plan(
        dir,
        &base,
        "cpu",
        4,
        &["system.tensor_parallel=2", "system.zero_stage=3"],
    );
    assert!(!common::output_text(&out).contains("saves no memory"));
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

/// Issue 20, finding 3: run names that are not one plain folder name wrote outside `logging.dir`,
/// into it, or into the working directory.
#[test]
fn run_names_that_are_not_one_folder_name_are_refused_and_create_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("work");
    fs::create_dir_all(&dir).unwrap();
    let corpus = write_corpus(tmp.path());
    let before = tree(tmp.path());
    for name in ["../../escape", "/abs/path", "..", ".", "", "a/b"] {
        let set = format!("logging.run_name={name}");
        for sub in [&["train"][..], &["run", "--cpu", "--nproc", "1", "--"][..]] {
            let out = run(
                &dir,
                &with(&small(&corpus), sub, &["--set", &set, "--max-steps", "1"]),
            );
            fails(
                &out,
                2,
                &[
                    &format!("logging.run_name = {name:?}"),
                    "one plain folder name (e.g. --set logging.run_name=exp1)",
                ],
            );
        }
    }
    assert_eq!(tree(tmp.path()), before, "something was created");
    assert!(!Path::new("/abs/path").exists());
}

fn args(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| s.to_string()).collect()
}

/// Issue 20, findings 13 and 15: usage errors found after parsing exit 2 like clap's, and a
/// negative number is a value, not a flag.
#[test]
fn usage_errors_exit_2_naming_the_flag_and_the_fix() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    for (list, parts) in [
        (
            &[
                "generate",
                "--model",
                "m",
                "--prompt",
                "hi",
                "--temperature",
                "-1",
            ][..],
            &["--temperature -1 must be a finite number >= 0"][..],
        ),
        (
            &["generate", "--model", "m", "--prompt", "hi", "--top-p", "2"],
            &["--top-p 2 must be in (0, 1]"],
        ),
        (
            &["run", "--cpu", "--nproc", "0", "--", "--preset", "tiny"],
            &["--nproc 0: must be at least 1"],
        ),
        (
            &[
                "train",
                "--preset",
                "tiny",
                "--resume",
                "/nonexistent/step_5",
            ],
            &[
                "--resume /nonexistent/step_5: no such directory",
                "--resume auto",
            ],
        ),
        (
            &["train", "--preset", "tiny", "--set", "model.vocab_size=0"],
            &["model.vocab_size = 0: must be at least the tokenizer's"],
        ),
    ] {
        fails(&run(dir, &args(list)), 2, parts);
    }
    assert!(!dir.join("runs").exists(), "a refused start left runs/");
    let help = output_text(&run(dir, &args(&["export", "--help"])));
    assert!(help.contains("fp32|bf16|fp16"), "{help}");
}

/// Round 4 (issue 32), finding 10: `plan --gpus 3 --set system.zero_stage=3 --set
/// system.shard_degree=2` answered (exit 0, "replicated across 1") what `train` refuses; and
/// finding 21: accepted without a note were bf16 reductions on CPU ranks, a sharding stage on one
/// rank, and a prefetch of a million units ("1000001 unit gathers in flight" for a 7-unit model).
/// `plan` and `train` run the same rules; each setting that buys nothing gets one warning line; the
/// prefetch is clamped to the model's units.
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
