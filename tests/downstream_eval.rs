//! Downstream evaluation against lm-evaluation-harness itself: a small model trained a few
//! steps and exported is scored by lm-eval 0.4 (its Hugging Face backend, its samples) and by
//! `lockstep eval --task` on a multiple-choice task made here — contexts with trailing spaces,
//! tabs and newlines, an empty context, a context longer than the model's, choices of several
//! lengths and non-ASCII text — with its tokenizer and with one whose template puts a BOS
//! before every text. Every choice's log-likelihood agrees within 1e-4, and acc, acc_norm and
//! their standard errors are lm-eval's. In training, the scores logged at the
//! eval steps are `lockstep eval --task` on the checkpoints of those steps, 2 data ranks at
//! zero stage 3 log one rank's numbers, and a tensor- and a context-parallel pair theirs within
//! a near tie.

use crate::common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use common::{ok, with};
use serde_json::{json, Value};

/// The model's context (`common::small`'s training.context_length).
const CONTEXT: usize = 64;

/// One item: (context, choices, gold).
type Item = (String, Vec<String>, usize);

/// Items from the corpus's lines: the first half of a line, its own second half among three
/// others'; every fifth context ends in whitespace of another kind; one is empty, one is longer
/// than the model's context, one choice is not ASCII.
fn items(corpus: &Path) -> Vec<Item> {
    let text = std::fs::read_to_string(corpus.join("doc1.txt")).unwrap();
    let lines: Vec<&str> = text
        .lines()
        .map(str::trim)
        .filter(|l| l.split_whitespace().count() >= 6)
        .take(36)
        .collect();
    let half = |l: &str| {
        let words: Vec<&str> = l.split_whitespace().collect();
        let cut = words.len() / 2;
        (words[..cut].join(" "), words[cut..].join(" "))
    };
    let endings = ["", " ", "\n", " \t ", "  \n"];
    let mut out: Vec<Item> = lines
        .iter()
        .enumerate()
        .map(|(i, line)| {
            let (context, right) = half(line);
            let mut choices: Vec<String> = (1..4)
                .map(|k| half(lines[(i + 7 * k) % lines.len()]).1)
                .collect();
            let gold = i % 4;
            choices.insert(gold, right);
            (
                format!("{context}{}", endings[i % endings.len()]),
                choices,
                gold,
            )
        })
        .collect();
    let other = (out[2].2 + 1) % 4;
    out[2].1[other] = "naïve café — señor".into();
    let long: String = text.chars().skip(2000).take(600).collect();
    out.push((
        long,
        vec!["and so".into(), "to be".into(), "my lord".into()],
        1,
    ));
    out.push((
        String::new(),
        vec!["HAMLET.".into(), "the the the".into()],
        0,
    ));
    out
}

/// `items` as a task file of the general form, and of HellaSwag's.
fn write_tasks(dir: &Path, items: &[Item]) -> (PathBuf, PathBuf) {
    let lines = |f: &dyn Fn(&Item) -> Value| -> String {
        items.iter().map(|i| f(i).to_string() + "\n").collect()
    };
    let general = dir.join("mc.jsonl");
    let general_form = |(q, c, g): &Item| json!({"query": q, "choices": c, "gold": g});
    std::fs::write(&general, lines(&general_form)).unwrap();
    let hellaswag = dir.join("hs.jsonl");
    let hellaswag_form = |(q, c, g): &Item| json!({"ctx": q, "endings": c, "label": g.to_string()});
    std::fs::write(&hellaswag, lines(&hellaswag_form)).unwrap();
    (general, hellaswag)
}

/// lm-eval's task config for the general-form file.
fn lm_eval_task(dir: &Path, file: &Path) -> PathBuf {
    let tasks = dir.join("lm_tasks");
    std::fs::create_dir_all(&tasks).unwrap();
    let yaml = format!(
        "task: lockstep_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {}\n\
         test_split: test\noutput_type: multiple_choice\ndoc_to_text: query\n\
         doc_to_choice: choices\ndoc_to_target: gold\nmetric_list:\n\
         \x20 - {{metric: acc, aggregation: mean, higher_is_better: true}}\n\
         \x20 - {{metric: acc_norm, aggregation: mean, higher_is_better: true}}\n",
        file.display()
    );
    std::fs::write(tasks.join("lockstep_mc.yaml"), yaml).unwrap();
    tasks
}

/// lm-eval's scores of each model directory of `models` (tests/reference/lm_eval_mc.py, one
/// process): its results and its samples by doc_id.
fn lm_eval(dir: &Path, tasks: &Path, models: &[&Path]) -> Vec<(Value, HashMap<u64, Value>)> {
    let out = dir.join("lm_eval.json");
    let run = Command::new(common::python())
        .current_dir(dir)
        .env("HF_HOME", dir.join("hf_home"))
        .env("HF_HUB_OFFLINE", "1")
        .env("HF_DATASETS_OFFLINE", "1")
        .env("TOKENIZERS_PARALLELISM", "false")
        .arg(common::root().join("tests/reference/lm_eval_mc.py"))
        .arg(&out)
        .arg(tasks)
        .arg(CONTEXT.to_string())
        .args(models)
        .output()
        .expect("python runs");
    let text = common::output_text(&run);
    assert!(run.status.success(), "lm-eval failed:\n{text}");
    let all: Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    models
        .iter()
        .map(|m| {
            let r = &all[m.to_str().unwrap()];
            let samples = r["samples"]
                .as_array()
                .unwrap()
                .iter()
                .map(|s| (s["doc_id"].as_u64().unwrap(), s.clone()))
                .collect();
            (r["results"].clone(), samples)
        })
        .collect()
}

/// A copy of the export `from` whose tokenizer.json puts `<|endoftext|>` (id 0) before every
/// text it encodes with special tokens, as Llama's puts its BOS.
fn with_bos_template(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap().flatten() {
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
    let path = to.join("tokenizer.json");
    let mut tok: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let eos = json!({"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}});
    tok["post_processor"] = json!({
        "type": "TemplateProcessing",
        "single": [eos, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [eos, {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [0], "tokens": ["<|endoftext|>"]}},
    });
    std::fs::write(&path, tok.to_string()).unwrap();
}

/// `lockstep eval --model MODEL --task …` with one thread, as training's ranks run: its JSON
/// objects by task, and with `samples` its log-samples by (task, doc_id).
fn lockstep_eval(
    dir: &Path,
    model: &Path,
    tasks: &[&Path],
    samples: Option<&Path>,
) -> (HashMap<String, Value>, HashMap<(String, u64), Value>) {
    let mut args = vec![
        "eval".to_string(),
        "--model".into(),
        model.display().to_string(),
    ];
    for t in tasks {
        args.extend(["--task".into(), t.display().to_string()]);
    }
    args.push("--json".into());
    if let Some(s) = samples {
        args.extend(["--log-samples".into(), s.display().to_string()]);
    }
    let out = common::lockstep(dir)
        .env("OMP_NUM_THREADS", "1")
        .args(&args)
        .output()
        .unwrap();
    let text = common::output_text(&out);
    assert!(out.status.success(), "lockstep {args:?} failed:\n{text}");
    let by_task = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .map(|v| (v["task"].as_str().unwrap().to_string(), v))
        .collect();
    let logged = samples.map_or_else(HashMap::new, |s| {
        std::fs::read_to_string(s)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str::<Value>(l).unwrap())
            .map(|v| {
                let key = (
                    v["task"].as_str().unwrap().to_string(),
                    v["doc_id"].as_u64().unwrap(),
                );
                (key, v)
            })
            .collect()
    });
    (by_task, logged)
}

/// Each item's log-likelihoods of lockstep (`ours`, by (task, doc_id)) against lm-eval's
/// (`theirs`, by doc_id): the same predictions, and the HellaSwag form's the same as the general
/// form's. The largest difference of a log-likelihood.
fn compare_items(
    items: &[Item],
    ours: &HashMap<(String, u64), Value>,
    theirs: &HashMap<u64, Value>,
) -> f64 {
    assert_eq!(theirs.len(), items.len());
    let lls = |v: &Value| -> Vec<f64> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect()
    };
    let mut worst = 0f64;
    for doc in 0..items.len() as u64 {
        let (lm, mine) = (&theirs[&doc], &ours[&("mc".to_string(), doc)]);
        let (a, b) = (lls(&mine["loglikelihoods"]), lls(&lm["lls"]));
        assert_eq!(a.len(), b.len(), "doc {doc}");
        for (x, y) in a.iter().zip(&b) {
            worst = worst.max((x - y).abs());
        }
        assert_eq!(
            mine["acc"].as_f64(),
            lm["acc"].as_f64(),
            "doc {doc}: {mine} {lm}"
        );
        assert_eq!(
            mine["acc_norm"].as_f64(),
            lm["acc_norm"].as_f64(),
            "doc {doc}"
        );
        // The same items in HellaSwag's form: the same rows (in other batches, padded to other
        // lengths).
        let hs = &ours[&("hs".to_string(), doc)];
        for (x, y) in lls(&hs["loglikelihoods"]).iter().zip(&a) {
            assert!(common::rel(*x, *y) < 1e-6, "doc {doc}: {hs} {mine}");
        }
        assert_eq!(hs["acc"], mine["acc"], "doc {doc}");
    }
    worst
}

/// The scores of a metrics.jsonl record's task, as `eval --json` names them.
fn scores(v: &Value) -> [Value; 5] {
    ["acc", "acc_norm", "acc_stderr", "acc_norm_stderr", "n"].map(|k| v[k].clone())
}

/// metrics.jsonl's downstream scores by (step, task).
fn logged(metrics: &Path) -> HashMap<(u64, String), Value> {
    let mut out = HashMap::new();
    for r in common::records(metrics) {
        if let Some(tasks) = r["eval"].as_object() {
            assert!(r["eval_time_s"].as_f64().unwrap() > 0.0, "{r}");
            for (task, v) in tasks {
                out.insert((r["step"].as_u64().unwrap(), task.clone()), v.clone());
            }
        }
    }
    out
}

#[test]
fn lockstep_scores_multiple_choice_as_lm_evaluation_harness_does() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let corpus = common::write_corpus(dir);
    let items = items(&corpus);
    let (mc, hs) = write_tasks(dir, &items);
    let base = common::small(&corpus);
    let tasks = format!("training.eval_tasks={},{}", mc.display(), hs.display());
    let train = ok(
        dir,
        &with(
            &base,
            &["train"],
            &[
                "--max-steps",
                "6",
                "--set",
                "training.eval_interval=3",
                "--set",
                "checkpoint.interval=3",
                "--set",
                &tasks,
            ],
        ),
    );
    assert!(
        train.contains("Downstream eval: mc (38 items), hs (38 items) | 76 items")
            && train.contains("2 item(s) longer than training.context_length = 64 lose tokens"),
        "{train}"
    );
    assert!(
        train.contains("[CPU0] Downstream | Step [3/6] | mc acc "),
        "{train}"
    );

    // In training: the scores at steps 3 and 6 are `eval --task` on those checkpoints; the
    // HellaSwag form of the same items scores the same.
    let during = logged(&dir.join("runs/tiny/metrics.jsonl"));
    let mut keys: Vec<&(u64, String)> = during.keys().collect();
    keys.sort();
    assert_eq!(
        keys,
        [
            &(3, "hs".into()),
            &(3, "mc".into()),
            &(6, "hs".into()),
            &(6, "mc".into())
        ]
    );
    for step in [3u64, 6] {
        let ckpt = dir.join(format!("runs/tiny/checkpoints/step_{step}"));
        let (after, _) = lockstep_eval(dir, &ckpt, &[&mc, &hs], None);
        for task in ["mc", "hs"] {
            assert_eq!(
                scores(&during[&(step, task.to_string())]),
                scores(&after[task]),
                "step {step}, {task}"
            );
        }
        assert_eq!(scores(&after["mc"]), scores(&after["hs"]));
    }

    // After: the export scored by lm-eval and by lockstep, with the tokenizer it was trained
    // with and with one that puts a BOS before every text.
    ok(dir, &with(&base, &["export"], &["--hf", "exports/mc"]));
    let (export, bos) = (dir.join("exports/mc"), dir.join("exports/mc-bos"));
    with_bos_template(&export, &bos);
    let lm = lm_eval(dir, &lm_eval_task(dir, &mc), &[&export, &bos]);
    let mut accs = Vec::new();
    for ((model, (theirs, lm_items)), name) in [&export, &bos].iter().zip(lm).zip(["plain", "bos"])
    {
        let samples = dir.join(format!("samples-{name}.jsonl"));
        let (ours, per_item) = lockstep_eval(dir, model, &[&mc, &hs], Some(&samples));
        let worst = compare_items(&items, &per_item, &lm_items);
        assert!(
            worst < 1e-4,
            "{name}: largest log-likelihood difference {worst}"
        );
        let m = &ours["mc"];
        for (key, lm_key) in [
            ("acc", "acc,none"),
            ("acc_norm", "acc_norm,none"),
            ("acc_stderr", "acc_stderr,none"),
            ("acc_norm_stderr", "acc_norm_stderr,none"),
        ] {
            assert_eq!(
                m[key].as_f64(),
                theirs[lm_key].as_f64(),
                "{name} {key}: {m} vs {theirs}"
            );
        }
        assert_eq!(m["n"].as_u64(), Some(items.len() as u64));
        let long = items.len() as u64 - 2;
        assert_eq!(per_item[&("mc".to_string(), long)]["truncated"], true);
        assert_eq!(per_item[&("mc".to_string(), 0)]["truncated"], false);
        eprintln!(
            "{name}: lm-eval acc {} acc_norm {}; largest log-likelihood difference {worst:.2e}",
            theirs["acc,none"], theirs["acc_norm,none"]
        );
        accs.push(per_item);
    }
    // The BOS changes what the model sees: the same model scores other log-likelihoods.
    let key = ("mc".to_string(), 0);
    assert_ne!(
        accs[0][&key]["loglikelihoods"],
        accs[1][&key]["loglikelihoods"]
    );

    // Two data ranks at zero stage 3 (passes in lockstep, parameters gathered unit by unit)
    // and one rank, from the step-6 weights after a step that changes none of them (a learning
    // rate of 1e-30 moves no fp32 weight): both log the numbers `eval --task` gives them.
    let ckpt = dir.join("runs/tiny/checkpoints/step_6");
    let from = format!("model.model_path={}", ckpt.display());
    let (want, _) = lockstep_eval(dir, &ckpt, &[&mc, &hs], None);
    let two = ["run", "--nproc", "2", "--cpu"];
    for (launch, name, layout) in [
        (&["train"][..], "one", "system.zero_stage=0"),
        (&two, "two", "system.zero_stage=3"),
        (&two, "tp", "system.tensor_parallel=2"),
        (&two, "cp", "system.context_parallel=2"),
    ] {
        let text = ok(
            dir,
            &with(
                &base,
                launch,
                &[
                    "--max-steps",
                    "1",
                    "--set",
                    &from,
                    "--set",
                    "training.learning_rate=1e-30",
                    "--set",
                    "training.min_lr=0",
                    "--set",
                    layout,
                    "--set",
                    &format!("logging.run_name={name}"),
                    "--set",
                    &tasks,
                ],
            ),
        );
        assert_eq!(text.matches("Downstream | Step [1/1]").count(), 1, "{text}");
        let got = logged(&dir.join(format!("runs/{name}/metrics.jsonl")));
        for task in ["mc", "hs"] {
            let (got, want) = (&got[&(1, task.to_string())], &want[task]);
            if name == "one" || name == "two" {
                assert_eq!(scores(got), scores(want), "{name} {task}");
                continue;
            }
            // The split matmuls add in another order (1e-6 of a log-likelihood, checked
            // model by model in tests/context_parallel.rs): a near tie may go the other way.
            for key in ["acc", "acc_norm"] {
                let d = (got[key].as_f64().unwrap() - want[key].as_f64().unwrap()).abs();
                assert!(
                    d <= 1.0 / items.len() as f64 + 1e-12,
                    "{name} {task} {key}: {got} {want}"
                );
            }
        }
    }
}
