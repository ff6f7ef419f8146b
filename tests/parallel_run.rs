//! Tensor and context parallelism through real `lockstep run` workers on loopback: a TP or CP
//! run trains like one rank, TP or CP × data-parallel at stage 3 like data parallelism, their
//! checkpoints resume on other layouts (TP 2 → 1 rank, 1 rank → TP 4, TP 2 × data 2 → TP 4;
//! CP 2 → 1 rank, 1 rank → CP 4) with the same losses, their exports load in transformers with
//! the same loss, and bad layouts exit 2 naming the key.

use crate::common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use common::{fails, losses, ok, rel, run, small, with, write_corpus};
use lockstep::data::tokenizer::Tokenizer;
use lockstep::tensor_io;
use serde_json::{json, Value};
use tch::{Device, Kind, Tensor};

/// `small` with 4 KV heads, so that T = 4 divides them.
fn base(dir: &Path) -> Vec<String> {
    with(
        &small(&write_corpus(dir)),
        &[],
        &[
            "--set",
            "model.num_key_value_heads=4",
            "--set",
            "checkpoint.interval=3",
            "--set",
            "training.max_grad_norm=1.0",
        ],
    )
}

/// Trains run `name` to `steps` on `nproc` CPU workers (1: `train` in this process's way) with
/// `sets`, optionally resuming from `resume`; its run directory.
fn train(
    dir: &Path,
    base: &[String],
    (name, nproc, steps): (&str, usize, usize),
    sets: &[&str],
    resume: Option<&Path>,
) -> PathBuf {
    let mut args: Vec<String> = if nproc == 1 {
        vec!["train".into()]
    } else {
        vec![
            "run".into(),
            "--cpu".into(),
            "--nproc".into(),
            nproc.to_string(),
        ]
    };
    args.extend(base.iter().cloned());
    for s in sets
        .iter()
        .copied()
        .chain([format!("logging.run_name={name}").as_str()])
    {
        args.extend(["--set".to_string(), s.to_string()]);
    }
    args.extend(["--max-steps".to_string(), steps.to_string()]);
    if let Some(r) = resume {
        args.extend(["--resume".to_string(), r.display().to_string()]);
    }
    let out = ok(dir, &args);
    let dim = |key: &str| -> usize {
        sets.iter()
            .find_map(|s| s.strip_prefix(key))
            .map_or(1, |v| v.parse().unwrap())
    };
    let (tensor, context) = (
        dim("system.tensor_parallel="),
        dim("system.context_parallel="),
    );
    if tensor * context > 1 {
        let mut mesh = format!("{nproc} ranks = {} data", nproc / (tensor * context));
        if context > 1 {
            mesh += &format!(" × {context} context-parallel");
        }
        if tensor > 1 {
            mesh += &format!(" × {tensor} tensor-parallel");
        }
        assert!(out.contains(&mesh), "{name}: no `{mesh}` in:\n{out}");
    }
    dir.join("runs").join(name)
}

fn close(a: &[(u64, f64)], b: &[(u64, f64)], tol: f64, what: &str) {
    assert_eq!(
        a.iter().map(|x| x.0).collect::<Vec<_>>(),
        b.iter().map(|x| x.0).collect::<Vec<_>>(),
        "{what}"
    );
    for ((s, x), (_, y)) in a.iter().zip(b) {
        assert!(rel(*x, *y) < tol, "{what}: step {s} loss {x} vs {y}");
    }
}

fn weights(ckpt: &Path) -> HashMap<String, Tensor> {
    common::checkpoint_weights(ckpt)
}

fn worst(a: &HashMap<String, Tensor>, b: &HashMap<String, Tensor>) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .map(|(n, x)| {
            assert_eq!(
                x.size(),
                b[n].size(),
                "{n}: whole shapes in every checkpoint"
            );
            (x - &b[n]).norm().double_value(&[]) / b[n].norm().double_value(&[])
        })
        .fold(0.0, f64::max)
}

#[test]
fn tensor_parallel_runs_train_like_one_rank_and_resume_on_any_layout() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let base = base(dir);
    ok(dir, &with(&base, &["prepare"], &[]));

    // One rank, and TP 2 (sequence parallel), TP 2 without it: the same steps.
    let one = train(dir, &base, ("one", 1, 6), &[], None);
    let l1 = losses(&one.join("metrics.jsonl"));
    assert!(l1[0].1 - l1[5].1 > 0.05, "real training: {l1:?}");
    let tp2 = train(
        dir,
        &base,
        ("tp2", 2, 6),
        &["system.tensor_parallel=2"],
        None,
    );
    close(
        &losses(&tp2.join("metrics.jsonl")),
        &l1,
        1e-5,
        "TP 2 vs one rank",
    );
    let tp2n = train(
        dir,
        &base,
        ("tp2n", 2, 6),
        &["system.tensor_parallel=2", "system.sequence_parallel=false"],
        None,
    );
    close(
        &losses(&tp2n.join("metrics.jsonl")),
        &l1,
        1e-5,
        "TP 2 without SP",
    );
    // Whole HF tensors in every checkpoint, the same values (Adam's per-element steps let fp32
    // rounding of near-zero gradients show at ~1e-6: tests/tensor_parallel.rs).
    let w1 = weights(&one.join("checkpoints/step_6"));
    let err = worst(&weights(&tp2.join("checkpoints/step_6")), &w1);
    eprintln!("TP 2 vs one rank after 6 steps: weights within {err:e} per tensor");
    assert!(err < 2e-5, "TP 2 weights differ from one rank's by {err:e}");

    // TP 2 × data 2 at stage 3 against data 2 at stage 0.
    let dp2 = train(dir, &base, ("dp2", 2, 6), &[], None);
    let l2 = losses(&dp2.join("metrics.jsonl"));
    let mesh = train(
        dir,
        &base,
        ("tp2dp2", 4, 6),
        &["system.tensor_parallel=2", "system.zero_stage=3"],
        None,
    );
    close(
        &losses(&mesh.join("metrics.jsonl")),
        &l2,
        1e-5,
        "TP 2 × DP 2 stage 3",
    );

    // Resumes across layouts continue the same run: TP 2 → one rank, one rank → TP 4, and TP
    // 2 × data 2 (stage 3) → TP 4 (stage 0) against data 2's own steps 4-6.
    let from = |run: &Path| run.join("checkpoints/step_3");
    let tail = |l: &[(u64, f64)]| l[3..].to_vec();
    let r = train(dir, &base, ("tp2to1", 1, 6), &[], Some(&from(&tp2)));
    close(
        &losses(&r.join("metrics.jsonl")),
        &tail(&l1),
        1e-5,
        "TP 2 → 1",
    );
    let r = train(
        dir,
        &base,
        ("1totp4", 4, 6),
        &["system.tensor_parallel=4"],
        Some(&from(&one)),
    );
    close(
        &losses(&r.join("metrics.jsonl")),
        &tail(&l1),
        1e-5,
        "1 → TP 4",
    );
    let r = train(
        dir,
        &base,
        ("meshtotp4", 4, 6),
        &["system.tensor_parallel=4", "training.batch_size=8"],
        Some(&from(&mesh)),
    );
    close(
        &losses(&r.join("metrics.jsonl")),
        &tail(&l2),
        1e-5,
        "TP 2 × DP 2 → TP 4",
    );

    // The TP run's export loads in transformers, whose loss over a text is `lockstep eval`'s.
    export_loads_in_transformers(dir, &base, &tp2.join("checkpoints/step_6"));
}

/// The export of checkpoint `ckpt` loads in transformers, whose loss over a text is
/// `lockstep eval`'s of the checkpoint.
fn export_loads_in_transformers(dir: &Path, base: &[String], ckpt: &Path) {
    let hf = dir.join("hf");
    ok(
        dir,
        &with(
            base,
            &["export"],
            &["--hf", "hf", "--checkpoint", ckpt.to_str().unwrap()],
        ),
    );
    let text = dir.join("corpus/doc1.txt");
    let tok = Tokenizer::load(common::tokenizer().to_str().unwrap()).unwrap();
    let stream = lockstep::commands::eval::tokenize_text(&text, &tok, "text").unwrap();
    let stream: Vec<i64> = stream.iter().map(|&t| t as i64).collect();
    tensor_io::save(
        &dir.join("stream.safetensors"),
        &[("tokens".into(), Tensor::from_slice(&stream))],
        None,
    )
    .unwrap();
    let batch = Tensor::zeros([1, 8], (Kind::Int64, Device::Cpu));
    tensor_io::save(
        &dir.join("batch.safetensors"),
        &[("tokens".into(), batch)],
        None,
    )
    .unwrap();
    std::fs::write(
        dir.join("params.json"),
        json!({
            "dirs": [{"path": hf, "dtype": "float32", "shards": 1, "logits": false}],
            "eval": {"dir": hf, "context_length": 48},
        })
        .to_string(),
    )
    .unwrap();
    common::run_python(
        "tests/reference/hf_interop.py",
        &["check", dir.to_str().unwrap()],
    );
    let reference: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("result.json")).unwrap()).unwrap();
    let want = reference["eval"]["loss"].as_f64().unwrap();
    let out = ok(
        dir,
        &[
            "eval",
            "--model",
            ckpt.to_str().unwrap(),
            "--data",
            text.to_str().unwrap(),
            "--json",
            "--context-length",
            "48",
            "--device",
            "cpu",
        ]
        .map(String::from),
    );
    let got: Value =
        serde_json::from_str(out.lines().rev().find(|l| l.starts_with('{')).unwrap()).unwrap();
    let loss = got["loss"].as_f64().unwrap();
    assert!(
        rel(loss, want) < 1e-5,
        "eval of {} {loss} vs transformers on its export {want}",
        ckpt.display()
    );
}

#[test]
fn context_parallel_runs_train_like_one_rank_and_resume_at_another_c() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let base = base(dir);
    ok(dir, &with(&base, &["prepare"], &[]));
    let cp = |c: usize| format!("system.context_parallel={c}");

    // One rank and CP 2 (each rank 2 chunks of 16 of the 64 tokens): the same steps, the same
    // weights.
    let one = train(dir, &base, ("one", 1, 6), &[], None);
    let l1 = losses(&one.join("metrics.jsonl"));
    assert!(l1[0].1 - l1[5].1 > 0.05, "real training: {l1:?}");
    let cp2 = train(dir, &base, ("cp2", 2, 6), &[&cp(2)], None);
    close(
        &losses(&cp2.join("metrics.jsonl")),
        &l1,
        1e-5,
        "CP 2 vs one rank",
    );
    let w1 = weights(&one.join("checkpoints/step_6"));
    let err = worst(&weights(&cp2.join("checkpoints/step_6")), &w1);
    eprintln!("CP 2 vs one rank after 6 steps: weights within {err:e} per tensor");
    assert!(err < 2e-5, "CP 2 weights differ from one rank's by {err:e}");

    // Packed documents attend within themselves across the chunk edges: CP 4 (chunks of 8)
    // with activation checkpointing against one rank.
    let masked = [
        "data.document_masking=true",
        "training.activation_checkpointing=full",
    ];
    let one_d = train(dir, &base, ("one_d", 1, 6), &masked, None);
    let cp4_sets = [masked[0], masked[1], &cp(4)];
    let cp4_d = train(dir, &base, ("cp4_d", 4, 6), &cp4_sets, None);
    close(
        &losses(&cp4_d.join("metrics.jsonl")),
        &losses(&one_d.join("metrics.jsonl")),
        1e-5,
        "CP 4 with documents",
    );

    // CP 2 × data 2 at stage 3 against data 2 at stage 0.
    let dp2 = train(dir, &base, ("dp2", 2, 6), &[], None);
    let mesh = train(
        dir,
        &base,
        ("cp2dp2", 4, 6),
        &[&cp(2), "system.zero_stage=3"],
        None,
    );
    close(
        &losses(&mesh.join("metrics.jsonl")),
        &losses(&dp2.join("metrics.jsonl")),
        1e-5,
        "CP 2 × DP 2 stage 3",
    );

    // A CP checkpoint resumes on one rank, and one rank's at CP 4: the same steps 4-6.
    let from = |run: &Path| run.join("checkpoints/step_3");
    let tail = l1[3..].to_vec();
    let r = train(dir, &base, ("cp2to1", 1, 6), &[], Some(&from(&cp2)));
    close(&losses(&r.join("metrics.jsonl")), &tail, 1e-5, "CP 2 → 1");
    let r = train(dir, &base, ("1tocp4", 4, 6), &[&cp(4)], Some(&from(&one)));
    close(&losses(&r.join("metrics.jsonl")), &tail, 1e-5, "1 → CP 4");

    export_loads_in_transformers(dir, &base, &cp2.join("checkpoints/step_6"));
}

/// Layouts that cannot be: exit 2 before any worker trains, naming the key, the value and the
/// valid ones.
#[test]
fn bad_tensor_parallel_layouts_exit_2_naming_the_key() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let base = base(dir);
    let go = |nproc: usize, sets: &[&str]| {
        let mut args = vec![
            "run".to_string(),
            "--cpu".into(),
            "--nproc".into(),
            nproc.to_string(),
        ];
        args.extend(base.iter().cloned());
        for s in sets {
            args.extend(["--set".to_string(), s.to_string()]);
        }
        run(dir, &args)
    };
    // T = 3 splits neither the 4 heads nor the 4 KV heads nor the MLP's 128.
    fails(
        &go(3, &["system.tensor_parallel=3"]),
        2,
        &["system.tensor_parallel = 3", "valid: 1, 2, 4"],
    );
    // T must divide the ranks.
    fails(
        &go(3, &["system.tensor_parallel=2"]),
        2,
        &["system.tensor_parallel = 2: must divide the number of ranks, 3"],
    );
    // shard_degree counts data ranks: 4 ranks at T = 2 are 2 data ranks.
    fails(
        &go(
            4,
            &[
                "system.tensor_parallel=2",
                "system.zero_stage=3",
                "system.shard_degree=4",
            ],
        ),
        2,
        &["system.shard_degree = 4: must divide the 2 replicas (the ranks that hold the same parameters: the 4 ranks over system.tensor_parallel = 2), or be 0 for all of them; valid here: 0, 1, 2"],
    );
    for bad in ["0", "two"] {
        fails(
            &go(2, &[&format!("system.tensor_parallel={bad}")]),
            2,
            &[&format!("system.tensor_parallel={bad}"), "integer >= 1"],
        );
    }
    // Context parallelism: C must divide the ranks over T, 2C the context, and one rank has
    // no group.
    fails(
        &go(3, &["system.context_parallel=2"]),
        2,
        &["system.context_parallel = 2: must divide the number of ranks, 3; valid here: 1"],
    );
    fails(
        &go(
            4,
            &["system.context_parallel=2", "system.tensor_parallel=4"],
        ),
        2,
        &["system.context_parallel = 2: must divide the 1 ranks left over system.tensor_parallel = 4 (of 4)"],
    );
    fails(
        &go(3, &["system.context_parallel=3"]),
        2,
        &[
            "system.context_parallel = 3 cuts every sequence into 2 × 3 = 6 chunks",
            "training.context_length = 64 is not a multiple of 6",
            "e.g. 66",
        ],
    );
    let mut one = vec!["train".to_string()];
    one.extend(base.iter().cloned());
    one.extend(["--set".to_string(), "system.context_parallel=2".to_string()]);
    fails(
        &run(dir, &one),
        2,
        &[
            "system.context_parallel = 2",
            "one rank has no group to split a sequence over",
        ],
    );
    // Sequence parallelism splits every batch's tokens: a context of 63 over T = 2 does not.
    fails(
        &go(
            2,
            &[
                "system.tensor_parallel=2",
                "training.batch_size=3",
                "training.context_length=63",
            ],
        ),
        2,
        &[
            "training.context_length = 63 is not a multiple of 2",
            "system.sequence_parallel = false",
        ],
    );
}

/// The NaN guard's report names whole tensors: a NaN put into one element of o_proj's gradient
/// (split by columns over the TP ranks) is one NaN of [64, 64], not one per part.
#[test]
fn the_nan_report_of_a_tensor_parallel_run_is_whole() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let base = base(dir);
    let mut args = vec![
        "run".to_string(),
        "--cpu".into(),
        "--nproc".into(),
        "2".into(),
    ];
    args.extend(base.iter().cloned());
    for s in [
        "system.tensor_parallel=2",
        "debug.inject_nan_at_step=2",
        "debug.inject_nan_param=model.layers.1.self_attn.o_proj.weight",
    ] {
        args.extend(["--set".to_string(), s.to_string()]);
    }
    args.extend(["--max-steps".to_string(), "3".to_string()]);
    fails(
        &run(dir, &args),
        3,
        &[
            "model.layers.1.self_attn.o_proj.weight  shape [64, 64]  NaN 1/4096",
            "Checkpoint saved: runs/tiny/checkpoints/nan_step_2",
        ],
    );
    let dump = tensor_io::load_all(&dir.join("runs/tiny/debug/nan_step_2.safetensors")).unwrap();
    let embed = dump
        .iter()
        .find(|(n, _)| n.contains("embed_tokens") && !n.contains("grad"))
        .map(|(_, t)| t.size());
    assert_eq!(
        embed,
        Some(vec![512, 64]), // the tests' 512 ids
        "whole tensors, unpadded, in the dump"
    );
}
