use std::path::{Path, PathBuf};

use super::requests::is_python_space;
use super::*;
use crate::config::ConfigError;
use crate::data::tokenizer::Tokenizer;

fn write(dir: &Path, name: &str, text: &[u8]) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

/// The message of loading `text` as a task file, which must fail with exit code 2's error.
fn refused(text: &[u8]) -> String {
    let dir = tempfile::tempdir().unwrap();
    let path = write(dir.path(), "t.jsonl", text);
    let err = load_tasks(&[&path], "--task", None).unwrap_err();
    assert!(
        err.downcast_ref::<ConfigError>().is_some(),
        "not a config error: {err:#}"
    );
    format!("{err:#}").replace(&format!("{}", path.display()), "FILE")
}

#[test]
fn both_forms_and_every_kind_of_gold_are_read() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(
        dir.path(),
        "mixed set!.jsonl",
        br#"{"query": "Q1", "choices": ["a", "b"], "gold": 1, "extra": 5}

{"query": "Q2", "choices": ["a", "b", "c"], "gold": [0, 2]}
{"query": "Q3", "choices": ["yes", "no"], "gold": "no"}
{"ctx": "A man", "endings": ["runs", "sits"], "label": "1", "activity_label": "x"}
{"ctx": "A dog", "endings": ["barks"], "label": 0}
"#,
    );
    let tasks = load_tasks(&[&path], "--task", None).unwrap();
    let t = &tasks[0];
    assert_eq!(t.name, "mixed_set_");
    let golds: Vec<(usize, Gold)> = t.items.iter().map(|i| (i.line, i.gold.clone())).collect();
    assert_eq!(
        golds,
        [
            (1, Gold::One(1)),
            (3, Gold::AnyOf(vec![0, 2])),
            (4, Gold::One(1)),
            (5, Gold::One(1)),
            (6, Gold::One(0)),
        ]
    );
    assert_eq!(t.items[3].context, "A man");
    assert_eq!(t.items[3].choices, ["runs", "sits"]);
    // A directory is its .jsonl files by name; a limit keeps the first items.
    write(
        dir.path(),
        "b.jsonl",
        br#"{"query":"q","choices":["x"],"gold":0}"#,
    );
    write(dir.path(), "notes.txt", b"not a task");
    let all = load_tasks(&[dir.path()], "--task", Some(2)).unwrap();
    let names: Vec<(&str, usize)> = all
        .iter()
        .map(|t| (t.name.as_str(), t.items.len()))
        .collect();
    assert_eq!(names, [("b", 1), ("mixed_set_", 2)]);
    // The same file twice would be two tasks of one name.
    let twice = load_tasks(&[&path, &path], "training.eval_tasks", None).unwrap_err();
    assert!(
        format!("{twice}").contains("would both be the task `mixed_set_`"),
        "{twice}"
    );
}

#[test]
fn every_bad_line_is_named_by_file_line_and_field() {
    let cases: &[(&[u8], &str)] = &[
        (
            b"{\"query\": \"q\", \"choices\": [\"a\"]}\n",
            "FILE:1: has no \"gold\"; an item of this form needs \"query\", \"choices\" and \"gold\"",
        ),
        (
            b"{\"query\": \"q\", \"choices\": [\"a\", \"b\"], \"gold\": 0}\n{\"ctx\": \"c\", \"endings\": [\"a\", \"b\"], \"label\": 2}\n",
            "FILE:2: \"label\" = 2 is out of range: the item has 2 choices (indices 0..1)",
        ),
        (
            b"{\"query\": \"q\", \"choices\": [], \"gold\": 0}\n",
            "FILE:1: \"choices\" is an empty list; an item needs at least one choice",
        ),
        (
            b"{\"query\": \"q\", \"choices\": [\"a\", \"\"], \"gold\": 0}\n",
            "FILE:1: \"choices\"[1] is an empty string",
        ),
        (
            b"{\"query\": \"q\", \"choices\": [\"a\", 3], \"gold\": 0}\n",
            "FILE:1: \"choices[1]\" is a number (3), expected a string",
        ),
        (
            b"{\"query\": \"q\", \"choices\": \"a b\", \"gold\": 0}\n",
            "FILE:1: \"choices\" is a string (\"a b\"), expected a list of strings",
        ),
        (
            b"{\"query\": 7, \"choices\": [\"a\"], \"gold\": 0}\n",
            "FILE:1: \"query\" is a number (7), expected a string",
        ),
        (
            b"{\"query\": \"q\", \"choices\": [\"a\"], \"gold\": \"b\"}\n",
            "FILE:1: \"gold\" = \"b\" is none of the 1 choices",
        ),
        (
            b"{\"query\": \"q\", \"choices\": [\"a\"], \"gold\": -1}\n",
            "FILE:1: \"gold\" is a number (-1), expected a choice's index",
        ),
        (
            b"{\"ctx\": \"c\", \"endings\": [\"a\"], \"label\": \"\"}\n",
            "FILE:1: \"label\" = \"\" is not a choice's index; HellaSwag's test split has no labels",
        ),
        (
            b"{\"text\": \"hello\"}\n",
            "FILE:1: an item needs \"query\", \"choices\" and \"gold\" (or HellaSwag's \"ctx\", \"endings\" and \"label\"); this line has only text",
        ),
        (
            b"{\"query\": \"q\", \"choices\": [\"a\"], \"gold\": 0}\n[1, 2]\n",
            "FILE:2: expected a JSON object (an item: query, choices, gold; or HellaSwag's ctx, endings, label), found an array",
        ),
        (
            b"{\"query\": \"q\", \"choices\": [\"a\"], \"gold\": 0}\n{\"query\": \"q\",\n",
            "FILE:2: not valid JSON (EOF while parsing",
        ),
        (
            b"query,choices,gold\n",
            "FILE:1: not valid JSON",
        ),
        (
            b"{\"query\": \"q\", \"choices\": [\"a\"], \"gold\": 0}\n{\"query\": \"caf\xe9\"}\n",
            "FILE:2: invalid UTF-8 at byte offset 58",
        ),
        (
            b"\xff\xfe{\x00",
            "FILE:1: UTF-16 text (little-endian",
        ),
        (b"\n  \n", "FILE: holds no items"),
    ];
    for (text, want) in cases {
        let got = refused(text);
        assert!(got.contains(want), "want {want:?} in:\n{got}");
    }
    let missing = load_tasks(&["no/such.jsonl"], "--task", None).unwrap_err();
    assert!(
        format!("{missing}").contains("--task no/such.jsonl: no such file or directory"),
        "{missing}"
    );
    let empty = tempfile::tempdir().unwrap();
    let none = load_tasks(&[empty.path()], "training.eval_tasks", None).unwrap_err();
    assert!(
        format!("{none}").contains("the directory holds no .jsonl task files"),
        "{none}"
    );
}

fn task(items: &[(&str, &[&str], usize)]) -> Task {
    Task {
        name: "t".into(),
        path: "t.jsonl".into(),
        items: items
            .iter()
            .enumerate()
            .map(|(i, (context, choices, gold))| Item {
                line: i + 1,
                context: context.to_string(),
                choices: choices.iter().map(|c| c.to_string()).collect(),
                gold: Gold::One(*gold),
            })
            .collect(),
    }
}

fn ids(tok: &Tokenizer, text: &str) -> Vec<u32> {
    tok.try_encode(text).unwrap()
}

/// lm-eval's `_encode_pair`: trailing whitespace moves to the continuation, whose ids are the
/// whole string's after the context's; an empty context is the prefix token (EOS for GPT-2).
#[test]
fn rows_are_lm_evals_context_and_continuation() {
    let tok = Tokenizer::load("gpt2").unwrap();
    let t = task(&[
        ("The cat sat", &["on the mat", "down"], 0),
        ("Question: 2+2=\u{1c} \n", &["4"], 0),
        ("", &["Hello"], 0),
    ]);
    let r = Requests::build(std::slice::from_ref(&t), &tok, 64, 4).unwrap();
    let by = |item: usize, choice: usize| {
        r.list
            .iter()
            .find(|q| q.item == item && q.choice == choice)
            .unwrap()
            .clone()
    };
    let first = by(0, 0);
    let ctx = ids(&tok, "The cat sat");
    let whole = ids(&tok, "The cat sat on the mat");
    assert_eq!(first.tokens[..ctx.len()], ctx[..]);
    assert_eq!(first.tokens[ctx.len()..], whole[ctx.len()..]);
    assert_eq!(first.scored, whole.len() - ctx.len());
    // The separator and the spaces before it are the continuation's: "\x1c \n" + " " + "4".
    let moved = by(1, 0);
    let ctx = ids(&tok, "Question: 2+2=");
    let whole = ids(&tok, "Question: 2+2=\u{1c} \n 4");
    assert_eq!(moved.tokens[..ctx.len()], ctx[..]);
    assert_eq!(moved.tokens[ctx.len()..], whole[ctx.len()..]);
    assert!(moved.scored >= 2, "{moved:?}");
    let empty = by(2, 0);
    let mut want = vec![tok.eos_id()];
    want.extend(ids(&tok, " Hello"));
    assert_eq!(empty.tokens, want);
    assert_eq!(empty.scored, want.len() - 1);
    assert!(is_python_space('\u{1f}') && is_python_space('\u{3000}'));
    assert!(!is_python_space('\u{200b}') && !is_python_space('x'));
    // Only whitespace: no context token, as lm-eval refuses it.
    let blank = task(&[("  ", &["a"], 0)]);
    let err = Requests::build(&[blank], &tok, 64, 4).unwrap_err();
    assert!(
        format!("{err:#}").contains("t.jsonl:1: the context is only whitespace"),
        "{err:#}"
    );
}

/// A row longer than T + 1 loses tokens from the left (the continuation stays whole); a
/// continuation longer than T is refused, naming the item.
#[test]
fn long_items_are_truncated_from_the_left() {
    let tok = Tokenizer::load("gpt2").unwrap();
    let long = "word ".repeat(40);
    let t = task(&[(long.trim_end(), &["the end of it", "x"], 1)]);
    let r = Requests::build(std::slice::from_ref(&t), &tok, 16, 8).unwrap();
    let q = &r.list[0];
    let whole: Vec<u32> = {
        let mut w = ids(&tok, long.trim_end());
        let n = w.len();
        w.extend(&ids(&tok, &format!("{} the end of it", long.trim_end()))[n..]);
        w
    };
    assert!(q.truncated && q.tokens.len() == 17);
    assert_eq!(q.tokens[..], whole[whole.len() - 17..]);
    assert_eq!(r.truncated_items(), 1);
    let err = Requests::build(&[t], &tok, 3, 8).unwrap_err();
    assert!(
        format!("{err:#}")
            .contains("t.jsonl:1: choice 0 is 4 tokens, more than the model's context of 3"),
        "{err:#}"
    );
}

/// Batches: longest rows first, a fixed number of rows each, rows padded to a multiple of the
/// alignment, targets only at the continuation.
#[test]
fn batches_hold_the_longest_rows_first_padded_and_masked() {
    let tok = Tokenizer::load("gpt2").unwrap();
    let t = task(&[
        ("a", &["b"], 0),
        ("one two three four five", &["six", "seven eight"], 0),
        ("x y", &["z"], 0),
    ]);
    let r = Requests::build(&[t], &tok, 64, 2).unwrap();
    assert_eq!(r.num_batches(), 2);
    let b = r.batch(0, 4);
    assert_eq!(b.requests, [2, 1]);
    let longest = r.list[2].tokens.len() - 1;
    assert_eq!(b.seq, longest.div_ceil(4) * 4);
    for (row, &q) in b.requests.iter().enumerate() {
        let req = &r.list[q];
        let n = req.tokens.len() - 1;
        let x = &b.inputs[row * b.seq..(row + 1) * b.seq];
        let y = &b.targets[row * b.seq..(row + 1) * b.seq];
        let want_x: Vec<i64> = req.tokens[..n].iter().map(|&t| t as i64).collect();
        assert_eq!(x[..n], want_x[..]);
        assert!(x[n..].iter().all(|&t| t == 0));
        let counted: Vec<(usize, i64)> = y
            .iter()
            .enumerate()
            .filter(|(_, &t)| t != -100)
            .map(|(i, &t)| (i, t))
            .collect();
        let want: Vec<(usize, i64)> = (n - req.scored..n)
            .map(|i| (i, req.tokens[i + 1] as i64))
            .collect();
        assert_eq!(counted, want);
    }
    // T with sequence parallelism, 2C with context parallelism, both: s/C a multiple of T
    // (T = 4, C = 2: 8, where a row of 4 would leave 2 tokens a rank for 4 SP ranks).
    let aligns: Vec<usize> = [(1, 1), (2, 1), (1, 2), (2, 2), (4, 2), (3, 2), (4, 4)]
        .iter()
        .map(|&(t, c)| row_align(t, true, c))
        .collect();
    assert_eq!(aligns, [1, 2, 4, 4, 8, 12, 16]);
    // Without sequence parallelism T does not cut the tokens.
    assert_eq!([row_align(4, false, 1), row_align(4, false, 2)], [1, 4]);
    let last = r.batch(1, 1);
    assert_eq!(last.rows, 2);
    assert_eq!(
        last.seq,
        last.requests
            .iter()
            .map(|&q| r.list[q].tokens.len() - 1)
            .max()
            .unwrap()
    );
}

/// numpy's argmax (the first of ties), acc_norm by characters (not bytes), lm-eval's standard
/// error (sample deviation over √n; none for one item), several right answers.
#[test]
fn scores_are_lm_evals() {
    let tok = Tokenizer::load("gpt2").unwrap();
    let mut t = task(&[
        ("q", &["ab", "abcd"], 1),
        ("q", &["éé", "aaa"], 0),
        ("q", &["x", "y", "z"], 2),
        ("q", &["x", "y"], 0),
    ]);
    t.items[2].gold = Gold::AnyOf(vec![0, 2]);
    let r = Requests::build(std::slice::from_ref(&t), &tok, 64, 3).unwrap();
    let lls_by_item: [&[f32]; 4] = [
        &[-2.0, -3.0],
        &[-2.0, -2.9],
        &[-1.0, -1.0, -0.5],
        &[-1.0, -1.0],
    ];
    let lls: Vec<f32> = r
        .list
        .iter()
        .map(|q| lls_by_item[q.item][q.choice])
        .collect();
    let out = score(std::slice::from_ref(&t), &r, &lls);
    let (s, items) = &out[0];
    let preds: Vec<(usize, usize)> = items.iter().map(|i| (i.pred, i.pred_norm)).collect();
    // Item 0: -2/2 = -1 vs -3/4 = -0.75; item 1: "éé" is 2 characters (4 bytes): -1 vs -0.967.
    assert_eq!(preds, [(0, 1), (0, 1), (2, 2), (0, 0)]);
    let acc = [0.0, 1.0, 1.0, 1.0];
    let norm = [1.0, 0.0, 1.0, 1.0];
    assert_eq!((s.acc, s.acc_norm), (0.75, 0.75));
    let se = |x: &[f64]| {
        let m = x.iter().sum::<f64>() / 4.0;
        (x.iter().map(|v| (v - m).powi(2)).sum::<f64>() / 3.0).sqrt() / 2.0
    };
    assert_eq!(s.acc_stderr, Some(se(&acc)));
    assert_eq!(s.acc_norm_stderr, Some(se(&norm)));
    assert!((s.acc_stderr.unwrap() - 0.25).abs() < 1e-15);
    let one = task(&[("q", &["x", "y"], 1)]);
    let r = Requests::build(std::slice::from_ref(&one), &tok, 64, 3).unwrap();
    let (s, _) = &score(&[one], &r, &[-1.0, -0.5])[0];
    assert_eq!((s.n, s.acc, s.acc_stderr), (1, 1.0, None));
}
