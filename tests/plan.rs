//! `lockstep plan`, `train`'s start check against it, and an allocation that fails in the
//! middle of a run: the plan's numbers follow the zero-stage memory model (stage 3 fitting
//! Llama-3.1-70B on 64 GPUs of 80 GB where stages 0-2 cannot), its advice fits when
//! applied, a config that cannot fit is refused before anything is prepared or allocated
//! (exit 2), and an out-of-memory error names its phase without a panic (exit 1), leaving the
//! last complete checkpoint as it was.

use crate::common;

use std::path::Path;

use common::{ok, output_text, run, small, small_gpt2, with, write_corpus};
use serde_json::Value;

fn plan_json(dir: &Path, args: &[&str]) -> Value {
    let mut a = vec!["--json"];
    a.extend(args);
    serde_json::from_str(&plan_text(dir, &a)).unwrap()
}

/// `lockstep plan` with `args`: its text (it must succeed).
fn plan_text(dir: &Path, args: &[&str]) -> String {
    let mut a = vec!["plan".to_string()];
    a.extend(args.iter().map(|s| s.to_string()));
    ok(dir, &a)
}

/// Asserts that `text` holds every one of `parts`.
fn says(text: &str, parts: &[&str]) {
    for part in parts {
        assert!(text.contains(part), "expected `{part}` in:\n{text}");
    }
}

/// Llama-3.1-8B's shape (the production preset has its dimensions with 4 layers) with its
/// 128,256-id vocabulary, at context 8192.
const LLAMA_8B: [&str; 6] = [
    "--set",
    "model.num_layers=32",
    "--set",
    "model.vocab_size=128256",
    "--set",
    "training.context_length=8192",
];

#[test]
fn zero_stages_follow_the_sharding_model_and_every_layout_is_listed() {
    let tmp = tempfile::tempdir().unwrap();
    let mut args = LLAMA_8B.to_vec();
    args.extend(["--gpus", "8", "--device", "cuda", "--gpu-memory-gb", "80"]);
    let p = plan_json(tmp.path(), &args);
    let params = p["model"]["parameters"].as_f64().unwrap();
    assert_eq!(params, 8_030_261_248.0, "Llama-3.1-8B");
    let layouts = p["layouts"].as_array().unwrap();
    assert_eq!(layouts.len(), 12, "4 zero stages × 3 checkpointing modes");
    let at = |stage: u64, mode: &str| {
        layouts
            .iter()
            .find(|l| {
                l["layout"]["zero_stage"] == stage
                    && l["layout"]["activation_checkpointing"] == mode
            })
            .unwrap()
    };
    let bytes = |l: &Value, k: &str| l["memory"][k].as_f64().unwrap();
    let total = |l: &Value| l["total_bytes"].as_f64().unwrap();
    // Stage 0: fp32 weights and two moments, 12 bytes per parameter; the gradients, dropped
    // after each update, at the LM head's peak only the head's own (4 bytes × vocab × hidden),
    // at a decoder layer's backward all of them.
    let s0 = at(0, "none");
    let state = ["weights", "master_weights", "moments"]
        .iter()
        .map(|k| bytes(s0, k))
        .sum::<f64>();
    assert_eq!(state, 12.0 * params);
    let head = 4.0 * 128_256.0 * 4096.0;
    let at_peak = if s0["memory"]["peak_during"] == "lm_head" {
        head
    } else {
        4.0 * params
    };
    assert_eq!(bytes(s0, "gradients"), at_peak, "{}", s0["memory"]);
    // Stage 1 (bf16 compute, 8 ranks): bf16 working weights, an fp32 master shard and moment
    // shards; gradients still whole, in the working weights' bf16 (half of stage 0's), and
    // the fp32 gradient slice the update reads (kept between steps: an H200 measured it).
    let s1 = at(1, "none");
    assert_eq!(bytes(s1, "weights"), 2.0 * params);
    assert_eq!(bytes(s1, "master_weights"), 4.0 * params / 8.0);
    assert_eq!(bytes(s1, "moments"), 8.0 * params / 8.0);
    let slice = 4.0 * params / 8.0;
    assert!(
        [head / 2.0 + slice, 2.0 * params + slice].contains(&bytes(s1, "gradients")),
        "{}",
        s1["memory"]
    );
    // Stage 2: this rank's fp32 gradient slice, plus one unit's gradients and their send buffer
    // in flight (the largest unit: the untied 525M-parameter embedding or LM head).
    let s2 = at(2, "none");
    assert_eq!(bytes(s2, "gradients"), 4.0 * params / 8.0 + 2.0 * head);
    assert!(bytes(s2, "gradients") < 0.3 * 4.0 * params);
    // Stage 3: no working weights between uses; the fp32 master, moment and gradient slices
    // are stage 0's 16 bytes per parameter over the 8 ranks, up to what is in use: one unit's
    // gradients with their send buffer, and the gathered units (in bf16: the buffer of the unit
    // in use, its parameters being views of it, and one prefetched; with one prefetched no
    // layer's buffer waits for its backward, whatever the checkpointing).
    for mode in ["none", "selective", "full"] {
        let s3 = at(3, mode);
        assert_eq!(bytes(s3, "weights"), 0.0);
        let slices = ["master_weights", "moments", "gradients"]
            .iter()
            .map(|k| bytes(s3, k))
            .sum::<f64>();
        assert!(
            (slices - 2.0 * head - 16.0 * params / 8.0).abs() < 1.0,
            "{mode}: {}",
            s3["memory"]
        );
        assert!(bytes(s3, "gathered_units") > 0.0);
        assert_eq!(bytes(at(2, mode), "gathered_units"), 0.0);
    }
    // A decoder layer: q, k, v, o (4096 × 128 × (32 + 32 + 8 + 8)), gate, up, down and two norms.
    let layer = 41_943_040.0 + 3.0 * 4096.0 * 14336.0 + 2.0 * 4096.0;
    let gathered = if at(3, "full")["memory"]["peak_during"] == "lm_head" {
        2.0 * (head / 4.0 + 4096.0 + layer)
    } else {
        2.0 * 2.0 * layer
    };
    assert!((bytes(at(3, "full"), "gathered_units") - gathered).abs() < 1.0);
    // Stage 3 needs less than stage 2 with every checkpointing mode: without checkpointing too,
    // since a layer's gathered weights are freed after its forward (issue 45 item 27; they
    // used to wait for its backward, as much as stage 2's bf16 weights). 8 × 80 GB hold 8B at
    // 8192 tokens at stage 3 with full or selective checkpointing; without, the kept
    // activations alone do not fit.
    for mode in ["none", "selective", "full"] {
        assert!(total(at(3, mode)) < total(at(2, mode)), "{mode}");
    }
    for mode in ["selective", "full"] {
        assert!(at(3, mode)["fits"].as_bool().unwrap(), "{mode}");
    }
    assert!(!at(3, "none")["fits"].as_bool().unwrap());
    for l in layouts {
        let total = l["total_bytes"].as_f64().unwrap();
        let parts: f64 = l["memory"]
            .as_object()
            .unwrap()
            .values()
            .filter_map(Value::as_f64)
            .sum();
        assert!(
            (total - parts).abs() < 1.0,
            "total is the sum of the breakdown"
        );
        assert_eq!(l["fits"].as_bool().unwrap(), total <= 80e9);
    }
    // Checkpointing only ever lowers the activations, and full keeps the least.
    for stage in 0..4 {
        let a = |m| bytes(at(stage, m), "activations");
        assert!(a("full") < a("selective") && a("selective") < a("none"));
    }
    // 8 × 80 GB without checkpointing does not hold 8B at 8192 tokens; full checkpointing at
    // stage 1 does (torchtitan's Llama-3 8B rows all use activation checkpointing).
    assert!(!at(0, "none")["fits"].as_bool().unwrap());
    assert!(at(1, "full")["fits"].as_bool().unwrap());
    // Communication: an all-reduce of fp32 gradients sends 2·7/8·4·P bytes per rank.
    let sent = p["comm_bytes_per_step"][0].as_f64().unwrap();
    assert!(
        (sent - 2.0 * 7.0 / 8.0 * 4.0 * params).abs() < 1.0,
        "{sent}"
    );
    let scaling = p["scaling"].as_array().unwrap();
    assert_eq!(
        scaling
            .iter()
            .map(|s| s["ranks"].as_u64().unwrap())
            .collect::<Vec<_>>(),
        [8, 64, 512]
    );
    assert!(
        scaling[0]["efficiency"].as_f64().unwrap() > scaling[1]["efficiency"].as_f64().unwrap()
    );
}

/// Llama-3.1-70B's shape (untied, 128,256-id vocabulary) at context 8192, one sequence per
/// GPU, full activation checkpointing.
const LLAMA_70B: [&str; 18] = [
    "--set",
    "model.num_layers=80",
    "--set",
    "model.hidden_size=8192",
    "--set",
    "model.num_attention_heads=64",
    "--set",
    "model.num_key_value_heads=8",
    "--set",
    "model.intermediate_size=28672",
    "--set",
    "model.vocab_size=128256",
    "--set",
    "training.context_length=8192",
    "--set",
    "training.batch_size=1",
    "--set",
    "training.activation_checkpointing=full",
];

#[test]
fn llama_70b_on_64_gpus_fits_at_stage_3_only() {
    let tmp = tempfile::tempdir().unwrap();
    let mut args = LLAMA_70B.to_vec();
    args.extend(["--gpus", "64", "--device", "cuda", "--gpu-memory-gb", "80"]);
    let p = plan_json(tmp.path(), &args);
    let params = p["model"]["parameters"].as_f64().unwrap();
    assert_eq!(params, 70_553_706_496.0, "Llama-3.1-70B");
    let layouts = p["layouts"].as_array().unwrap();
    for l in layouts {
        let stage = l["layout"]["zero_stage"].as_u64().unwrap();
        let full = l["layout"]["activation_checkpointing"] == "full";
        // Stages 0-2 keep the whole model's weights on every rank (at least 2 bytes each).
        assert_eq!(
            l["fits"].as_bool().unwrap(),
            stage == 3 && full,
            "stage {stage} {}: {}",
            l["layout"]["activation_checkpointing"],
            l["total_bytes"]
        );
    }
    // The configured stage 0 does not fit; the cheapest change is stage 3 alone.
    assert!(!p["fits"].as_bool().unwrap());
    assert_eq!(
        p["advice"]["sets"],
        serde_json::json!(["system.zero_stage=3"])
    );

    let mut at_3 = args.clone();
    at_3.extend(["--set", "system.zero_stage=3"]);
    let q = plan_json(tmp.path(), &at_3);
    assert!(q["fits"].as_bool().unwrap(), "{}", q["configured"]);
    assert_eq!(q["configured"]["total_bytes"], p["advice"]["total_bytes"]);
    // Communication per rank and step at stage 3: the parameters all-gathered in bf16 for the
    // forward and again for the backward (the final norm and the LM head once: they stay
    // gathered through their backward), and the fp32 gradients reduce-scattered.
    let f = 63.0 / 64.0;
    let (d, v) = (8192.0, 128_256.0);
    let gathers = f * 2.0 * (2.0 * params - d - v * d);
    let scatter = f * 4.0 * params;
    let sent = q["comm_bytes_per_step"][3].as_f64().unwrap();
    assert!((sent - (gathers + scatter)).abs() < 1e-3, "{sent}");
    // The step time: the FLOPs at 40% of the peak, then the communication over the
    // inter-node link (64 ranks span 8 nodes).
    let flops = &q["flops_per_token"];
    let compute = 8192.0
        * (flops["model"].as_f64().unwrap() + flops["recomputed"].as_f64().unwrap())
        / (q["peak_flops"].as_f64().unwrap() * q["mfu"].as_f64().unwrap());
    let comm = sent / q["inter_node_bandwidth"].as_f64().unwrap();
    let step = q["step_seconds"].as_f64().unwrap();
    assert!((step - (compute + comm)).abs() < 1e-9 * step, "{step}");
    assert_eq!(q["configured"]["step_seconds"], q["step_seconds"]);

    // Every micro-batch gathers and reduce-scatters again.
    let mut accumulated = at_3.clone();
    accumulated.extend(["--set", "training.grad_accum_nums=2"]);
    let r = plan_json(tmp.path(), &accumulated);
    let twice = r["comm_bytes_per_step"][3].as_f64().unwrap();
    assert!((twice - 2.0 * sent).abs() < 1e-3, "{twice}");
    assert_eq!(
        r["configured"]["total_bytes"],
        q["configured"]["total_bytes"]
    );

    // The text names the gathered units and stage 3's communication.
    let text = plan_text(tmp.path(), &at_3);
    says(
        &text,
        &[
            "zero stage 3 (1 + 1 prefetched = 2 unit gathers in flight)",
            "  gathered units ",
            "2 unit buffers (the one in use + 1 prefetched)",
            ", stage 3 553.54 GB",
            "  3 ",
            "Fits: ",
        ],
    );
}

#[test]
fn the_advice_fits_when_applied() {
    let tmp = tempfile::tempdir().unwrap();
    let mut args = LLAMA_8B.to_vec();
    args.extend(["--gpus", "8", "--device", "cuda", "--gpu-memory-gb", "80"]);
    let p = plan_json(tmp.path(), &args);
    assert!(!p["fits"].as_bool().unwrap());
    let sets: Vec<String> = p["advice"]["sets"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap().to_string())
        .collect();
    assert!(!sets.is_empty(), "{p}");
    let mut again: Vec<&str> = args.clone();
    for s in &sets {
        again.extend(["--set", s.as_str()]);
    }
    let q = plan_json(tmp.path(), &again);
    assert!(
        q["fits"].as_bool().unwrap(),
        "advice {sets:?} applied:\n{q}"
    );
    assert_eq!(
        q["configured"]["total_bytes"], p["advice"]["total_bytes"],
        "the advice's estimate is the plan of the advised config"
    );

    // The text form says the same.
    let text = plan_text(tmp.path(), &args);
    assert!(text.contains("DOES NOT FIT"), "{text}");
    assert!(
        text.contains(&format!("Cheapest change that fits: --set {}", sets[0])),
        "{text}"
    );
}

#[test]
fn a_config_that_cannot_fit_is_refused_before_anything_is_prepared() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    // The production preset (the default) with a 4 GB budget: weights, gradients and moments
    // alone are 20 GB.
    let out = run(
        dir,
        &[
            "train".into(),
            "--set".into(),
            "system.memory_budget_gb=4".into(),
        ],
    );
    let text = output_text(&out);
    assert_eq!(out.status.code(), Some(2), "{text}");
    says(
        &text,
        &[
            "error: this config needs an estimated",
            "per rank (weights 5.14 GB, moments 10.27 GB, gradients 5.14 GB",
            "but 4.00 GB is available (system.memory_budget_gb)",
            "No layout fits",
            "`lockstep plan` with the same flags shows the breakdown",
        ],
    );
    assert!(!text.contains("panicked"), "{text}");
    // Refused before the data was prepared or anything was written.
    assert!(!dir.join(".lockstep").exists(), "no data cache");
    assert!(!dir.join("runs/production/config.json").exists());

    // A config that a change fits names the change, and that change starts.
    let corpus = write_corpus(dir);
    let base = small_gpt2(&corpus);
    let refused = run(
        dir,
        &with(
            &base,
            &["train"],
            &[
                "--max-steps",
                "1",
                "--set",
                "model.hidden_size=256",
                "--set",
                "training.loss_chunk_tokens=0",
                "--set",
                "training.batch_size=32",
                "--set",
                "system.memory_budget_gb=0.9",
            ],
        ),
    );
    let text = output_text(&refused);
    assert_eq!(refused.status.code(), Some(2), "{text}");
    let advice = text
        .split("Cheapest change that fits: ")
        .nth(1)
        .and_then(|t| t.split(" (needs").next())
        .unwrap_or_else(|| panic!("no advice in:\n{text}"));
    let mut args = with(
        &base,
        &["train"],
        &[
            "--max-steps",
            "1",
            "--set",
            "model.hidden_size=256",
            "--set",
            "training.loss_chunk_tokens=0",
            "--set",
            "training.batch_size=32",
            "--set",
            "system.memory_budget_gb=0.9",
        ],
    );
    args.extend(advice.split_whitespace().map(str::to_string));
    let started = ok(dir, &args);
    assert!(started.contains("Memory plan:"), "{started}");
    // system.memory_check=warn starts anyway, after saying so.
    let warned = ok(
        dir,
        &with(
            &base,
            &["train"],
            &[
                "--max-steps",
                "1",
                "--set",
                "system.memory_budget_gb=0.01",
                "--set",
                "system.memory_check=warn",
                "--set",
                "logging.run_name=warned",
            ],
        ),
    );
    assert!(
        warned.contains("WARNING: this config needs an estimated"),
        "{warned}"
    );
}

#[test]
fn out_of_memory_mid_run_names_the_phase_and_keeps_the_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let base = small(&write_corpus(dir));
    for (phase, name) in [
        ("backward", "backward"),
        ("checkpoint", "checkpoint"),
        ("model_build", "model build"),
    ] {
        let run_name = format!("oom_{phase}");
        let args = with(
            &base,
            &["train"],
            &[
                "--max-steps",
                "3",
                "--set",
                "checkpoint.interval=1",
                "--set",
                "training.activation_checkpointing=full",
                "--set",
                &format!("debug.inject_oom={phase}"),
                "--set",
                "debug.inject_oom_step=2",
                "--set",
                &format!("logging.run_name={run_name}"),
            ],
        );
        let out = run(dir, &args);
        let text = output_text(&out);
        assert_eq!(out.status.code(), Some(1), "{phase}:\n{text}");
        for part in [
            format!("error: out of memory in the {name} phase: DefaultCPUAllocator: can't allocate memory"),
            "Memory in use: RSS".to_string(),
            "The plan estimated".to_string(),
            "The last complete checkpoint is untouched".to_string(),
        ] {
            assert!(text.contains(&part), "{phase}: expected `{part}` in:\n{text}");
        }
        assert!(
            !text.contains("panicked") && !text.contains("backtrace"),
            "{phase}: no panic output:\n{text}"
        );
        let ckpts = dir.join("runs").join(&run_name).join("checkpoints");
        if phase == "model_build" {
            assert!(!ckpts.join("step_1").exists());
            continue;
        }
        // Step 1's checkpoint is complete and is what a resume starts from.
        let resumed = ok(
            dir,
            &with(
                &base,
                &["train"],
                &[
                    "--max-steps",
                    "3",
                    "--set",
                    "checkpoint.interval=1",
                    "--set",
                    &format!("logging.run_name={run_name}"),
                    "--resume",
                    "auto",
                ],
            ),
        );
        assert!(resumed.contains("at step 1"), "{phase}: {resumed}");
        assert!(resumed.contains("Step [3/3]"), "{phase}: {resumed}");
    }
}

/// `checkpoint.interval` and `training.max_steps` with saves between steps.
const SAVING: [&str; 4] = [
    "--set",
    "checkpoint.interval=1000",
    "--set",
    "training.max_steps=100000",
];

#[test]
fn a_save_stages_12_bytes_per_parameter_over_the_writers_and_stalls_by_the_storage_bandwidth() {
    let tmp = tempfile::tempdir().unwrap();
    let plan = |extra: &[&str]| {
        let mut args = LLAMA_8B.to_vec();
        args.extend(SAVING);
        args.extend(["--device", "cuda", "--gpu-memory-gb", "80"]);
        args.extend(extra);
        plan_json(tmp.path(), &args)
    };
    let params = 8_030_261_248.0;
    // Every rank writes its share at every zero stage; with hybrid sharding the first shard
    // group writes.
    for (extra, writers) in [
        (vec!["--gpus", "1"], 1.0),
        (vec!["--gpus", "16", "--set", "system.zero_stage=0"], 16.0),
        (vec!["--gpus", "16", "--set", "system.zero_stage=3"], 16.0),
        (
            vec![
                "--gpus",
                "16",
                "--set",
                "system.zero_stage=3",
                "--set",
                "system.shard_degree=4",
            ],
            4.0,
        ),
    ] {
        let p = plan(&extra);
        let c = &p["checkpoint"];
        let f = |k: &str| c[k].as_f64().unwrap();
        assert_eq!(p["model"]["parameters"].as_f64().unwrap(), params);
        assert_eq!(f("writing_ranks"), writers, "{extra:?}");
        assert_eq!(f("bytes_per_save"), 12.0 * params);
        assert_eq!(f("bytes_per_rank"), 12.0 * params / writers, "{extra:?}");
        assert_eq!(f("staging_bytes_per_rank"), 12.0 * params / writers);
        // Nodes of 8 GPUs: the first holds up to 8 of the writers, sharing its storage.
        let on_node = writers.min(8.0);
        assert_eq!(f("writing_ranks_per_node"), on_node);
        assert_eq!(
            f("staging_bytes_per_node"),
            on_node * 12.0 * params / writers
        );
        assert!(
            (f("write_seconds") - on_node * 12.0 * params / writers / 2e9).abs() < 1e-6,
            "2 GB/s per node by default: {c}"
        );
        // On a GPU the staging buffer is pinned host memory, not in the GPU's estimate.
        assert_eq!(c["staging_in_rank_memory"], false);
        assert_eq!(p["configured"]["memory"]["staging"].as_f64().unwrap(), 0.0);
    }

    // Twice the storage bandwidth halves the synchronous stall (less the masters' gather,
    // which stage 3 adds to both), half of it doubles it; the asynchronous stall, a copy at
    // the PCIe's speed, stays.
    let stage_3 = ["--gpus", "16", "--set", "system.zero_stage=3"];
    let at = |gbps: &str| {
        let mut extra = stage_3.to_vec();
        extra.extend(["--storage-gbps", gbps]);
        plan(&extra)["checkpoint"].clone()
    };
    let (base, fast, slow) = (at("2"), at("4"), at("1"));
    let f = |c: &Value, k: &str| c[k].as_f64().unwrap();
    let gather = f(&base, "gather_seconds");
    assert!(gather > 0.0, "stage 3 gathers the fp32 masters: {base}");
    let write = |c: &Value| f(c, "stall_sync_seconds") - gather;
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-9 * b;
    assert!(close(write(&fast), write(&base) / 2.0), "{fast}");
    assert!(close(write(&slow), write(&base) * 2.0), "{slow}");
    assert_eq!(
        f(&fast, "stall_async_seconds"),
        f(&base, "stall_async_seconds")
    );
    assert_eq!(
        f(&slow, "stall_async_seconds"),
        f(&base, "stall_async_seconds")
    );
    assert!(f(&base, "stall_async_seconds") < f(&base, "stall_sync_seconds"));
    assert_eq!(base["stall_seconds"], base["stall_async_seconds"]);
    // The share of training time lost: the stall over the training between two saves.
    let between = f(&base, "seconds_between_saves");
    let lost = f(&base, "time_lost_sync");
    let stall = f(&base, "stall_sync_seconds");
    assert!(close(lost, stall / (between + stall)), "{base}");

    // The text says the same.
    let mut args: Vec<String> = ["plan", "--device", "cuda", "--gpu-memory-gb", "80"]
        .iter()
        .chain(&LLAMA_8B)
        .chain(&SAVING)
        .chain(&stage_3)
        .map(|s| s.to_string())
        .collect();
    let text = ok(tmp.path(), &args);
    says(
        &text,
        &[
        "Checkpoint: 96.36 GB per save (fp32 weights and AdamW moments, 12 B/param): 6.02 GB from each of 16 writing ranks, 48.18 GB from the node with the most (8); storage 2.0 GB/s per node (--storage-gbps)",
        "  staging 6.02 GB per rank of pinned host memory, kept from the first save (checkpoint.async): 48.18 GB per node of 8 writing ranks",
        "  stall per save: synchronous ",
        "configured: asynchronous",
        "  time lost to saves every 1000 steps (",
        ],
    );

    // checkpoint.async=false: nothing staged, the synchronous stall is the configured one.
    args.extend(["--set".into(), "checkpoint.async=false".into()]);
    let text = ok(tmp.path(), &args);
    says(
        &text,
        &[
            "  staging 0.00 GB per rank (checkpoint.async = false",
            "configured: synchronous",
        ],
    );
    let mut extra = stage_3.to_vec();
    extra.extend(["--set", "checkpoint.async=false"]);
    let c = plan(&extra)["checkpoint"].clone();
    assert_eq!(f(&c, "staging_bytes_per_rank"), 0.0);
    assert_eq!(f(&c, "staging_bytes_per_node"), 0.0);
    assert_eq!(c["stall_seconds"], c["stall_sync_seconds"]);
}

#[test]
fn a_cpu_rank_counts_its_staging_copy_in_its_memory() {
    let tmp = tempfile::tempdir().unwrap();
    let plan = |extra: &[&str]| {
        let mut args = vec![
            "--preset",
            "tiny",
            "--device",
            "cpu",
            "--gpu-memory-gb",
            "100",
        ];
        args.extend(extra);
        plan_json(tmp.path(), &args)
    };
    let memory = |p: &Value, k: &str| p["configured"]["memory"][k].as_f64().unwrap();
    let total = |p: &Value| p["configured"]["total_bytes"].as_f64().unwrap();
    // Saving every 10 of 100 steps: the copy made at the first save is there at every later
    // step's peak, 12 bytes per parameter over the writing ranks.
    for ranks in [1.0, 2.0] {
        let gpus = format!("{ranks}");
        let saving = ["--gpus", &gpus, "--set", "checkpoint.interval=10"];
        let p = plan(&saving);
        let params = p["model"]["parameters"].as_f64().unwrap();
        assert_eq!(
            memory(&p, "staging"),
            12.0 * params / ranks,
            "{}",
            p["checkpoint"]
        );
        assert_eq!(p["checkpoint"]["staging_in_rank_memory"], true);
        let mut sync = saving.to_vec();
        sync.extend(["--set", "checkpoint.async=false"]);
        let q = plan(&sync);
        assert_eq!(memory(&q, "staging"), 0.0);
        assert_eq!(
            q["checkpoint"]["staging_bytes_per_rank"].as_f64().unwrap(),
            0.0
        );
        assert!((total(&p) - total(&q) - 12.0 * params / ranks).abs() < 1.0);
    }
    // One save, after the last step: the copy meets the model state alone (weights, moments,
    // the runtime), not a step's activations; the estimate is the larger of the two.
    let p = plan(&["--set", "checkpoint.interval=0"]);
    let params = p["model"]["parameters"].as_f64().unwrap();
    let m = &p["configured"]["memory"];
    if m["peak_during"] == "checkpoint_save" {
        assert_eq!(memory(&p, "staging"), 12.0 * params);
        assert_eq!(memory(&p, "activations") + memory(&p, "logits"), 0.0);
    } else {
        assert_eq!(memory(&p, "staging"), 0.0, "{m}");
    }
    let text = ok(
        tmp.path(),
        &[
            "plan",
            "--preset",
            "tiny",
            "--device",
            "cpu",
            "--set",
            "checkpoint.interval=10",
        ]
        .map(String::from),
    );
    says(
        &text,
        &[
        "  staging ",
        "checkpoint.async: host copy of what this rank writes (12 B/param over 1 writing rank)",
        "of host memory, kept from the first save (checkpoint.async): in the per-rank peak above",
        ],
    );
}

#[test]
fn the_start_check_counts_the_staging_copy_on_cpu_and_names_checkpoint_async() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let base = small(&write_corpus(dir));
    // Saves at steps 1 and 2 of 3: the staging copy is alive at step 2's and 3's peaks.
    let saving = ["--max-steps", "3", "--set", "checkpoint.interval=1"];
    let estimate = |extra: &[&str]| {
        let mut args = with(&base, &["plan", "--json", "--device", "cpu"], &saving);
        args.extend(extra.iter().map(|s| s.to_string()));
        let p: Value = serde_json::from_str(&ok(dir, &args)).unwrap();
        p["configured"]["total_bytes"].as_f64().unwrap()
    };
    let (with_copy, without) = (
        estimate(&[]),
        estimate(&["--set", "checkpoint.async=false"]),
    );
    assert!(with_copy > without);
    // A budget between the two: refused, naming the copy and checkpoint.async=false.
    let budget = format!("system.memory_budget_gb={:.4}", (with_copy + without) / 2e9);
    let train = |extra: &[&str]| {
        let mut args = with(&base, &["train"], &saving);
        args.extend(["--set".to_string(), budget.clone()]);
        args.extend(extra.iter().map(|s| s.to_string()));
        args
    };
    let out = run(dir, &train(&["--set", "logging.run_name=refused"]));
    let text = output_text(&out);
    assert_eq!(out.status.code(), Some(2), "{text}");
    says(
        &text,
        &[
            "error: this config needs an estimated",
            ", checkpoint.async staging 0.",
            "--set checkpoint.async=false, without the ",
            "every save then stalls training for its whole write",
        ],
    );
    // Without the copy it starts, and says nothing of staging.
    let started = ok(
        dir,
        &train(&[
            "--set",
            "checkpoint.async=false",
            "--set",
            "logging.run_name=sync",
        ]),
    );
    assert!(started.contains("Memory plan:"), "{started}");
    assert!(!started.contains("staging"), "{started}");
    // With room for it, the plan line says it is included.
    let mut roomy = with(&base, &["train"], &saving);
    roomy.extend(["--set", "logging.run_name=roomy"].map(String::from));
    let started = ok(dir, &roomy);
    assert!(
        started.contains("checkpoint.async's staging copy of "),
        "{started}"
    );
}

/// `args` with `--set` for each of `sets`.
fn with_sets<'a>(args: &[&'a str], sets: &'a [String]) -> Vec<&'a str> {
    let mut v = args.to_vec();
    for s in sets {
        v.extend(["--set", s.as_str()]);
    }
    v
}

/// The `--set`s of an advice object (`advice` or `tensor_parallel_advice.change`).
fn advised_sets(change: &Value) -> Vec<String> {
    change["sets"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap().to_string())
        .collect()
}

#[test]
fn tensor_parallelism_splits_each_ranks_share_and_the_plan_shows_the_mesh() {
    let tmp = tempfile::tempdir().unwrap();
    let plan = |extra: &[&str]| {
        let mut args = LLAMA_8B.to_vec();
        args.extend(["--gpus", "8", "--device", "cuda", "--gpu-memory-gb", "80"]);
        args.extend(extra);
        plan_json(tmp.path(), &args)
    };
    let (one, eight) = (plan(&[]), plan(&["--set", "system.tensor_parallel=8"]));
    let at = |p: &Value, stage: u64, mode: &str| {
        p["layouts"]
            .as_array()
            .unwrap()
            .iter()
            .find(|l| {
                l["layout"]["zero_stage"] == stage
                    && l["layout"]["activation_checkpointing"] == mode
            })
            .unwrap()
            .clone()
    };
    let bytes = |l: &Value, k: &str| l["memory"][k].as_f64().unwrap();
    // Stage 0's fp32 weights: the matrices, embedding and LM head over 8, the 65 norms whole.
    let params = 8_030_261_248.0;
    let norms = (32.0 * 2.0 + 1.0) * 4096.0;
    assert_eq!(bytes(&at(&one, 0, "none"), "weights"), 4.0 * params);
    assert_eq!(
        bytes(&at(&eight, 0, "none"), "weights"),
        4.0 * ((params - norms) / 8.0 + norms)
    );
    assert_eq!(eight["tensor_parallel"], 8);
    assert_eq!(eight["data_parallel_ranks"], 1);
    assert_eq!(eight["sequence_parallel"], true);
    assert_eq!(eight["padded_vocab_size"], 128_256);
    assert_eq!(one["tensor_parallel_bytes_per_step"], 0.0);
    // TP traffic: 8 × 7/8 × d × 2 B per layer and token (bf16), plus the embedding's and the
    // head's fp32 hidden states and the cross-entropy's per-token scalars.
    let f = 7.0 / 8.0;
    let per_layer = 8.0 * f * 4096.0 * 2.0;
    let outside = 4.0 * f * 4096.0 * 4.0 + 4.0 * 7.0 + 2.0 * f * 8.0;
    let expected = 8192.0 * (32.0 * per_layer + outside);
    let sent = eight["tensor_parallel_bytes_per_step"].as_f64().unwrap();
    assert!((sent - expected).abs() < 1e-6 * expected, "{sent}");
    assert_eq!(eight["tensor_parallel_link"], "intra_node");
    // One data-parallel rank: nothing sent at any stage.
    assert_eq!(eight["comm_bytes_per_step"][3], 0.0);

    // Without sequence parallelism: the same traffic, but what is kept between the blocks
    // (with full checkpointing, every layer's input) is whole on every rank.
    let no_sp = plan(&[
        "--set",
        "system.tensor_parallel=8",
        "--set",
        "system.sequence_parallel=false",
    ]);
    assert_eq!(no_sp["sequence_parallel"], false);
    assert_eq!(no_sp["tensor_parallel_bytes_per_step"], sent);
    for mode in ["none", "selective", "full"] {
        let (a, b) = (at(&eight, 1, mode), at(&no_sp, 1, mode));
        assert!(
            bytes(&a, "activations") < bytes(&b, "activations"),
            "{mode}"
        );
    }

    // The text names the mesh and the TP traffic's link.
    let mut args = vec!["plan".to_string()];
    args.extend(LLAMA_8B.iter().map(|s| s.to_string()));
    args.extend(
        [
            "--gpus",
            "16",
            "--device",
            "cuda",
            "--gpu-memory-gb",
            "80",
            "--set",
            "system.tensor_parallel=8",
        ]
        .map(String::from),
    );
    let text = ok(tmp.path(), &args);
    says(
        &text,
        &[
            "Layout: 16 GPUs = mesh 8 tensor-parallel × 2 data-parallel, sequence parallel on |",
            "× 1 accumulation per data-parallel rank |",
            "1/8 of it on each rank of a tensor-parallel group",
            "Communication per step per rank among 2 data-parallel ranks",
            "Tensor parallelism: ",
            "per step per rank in each group of 8 (8 × 7/8 × d × 2 B per layer and token;",
            "over a node's links at 360 GB/s",
            "TP time",
        ],
    );
}

#[test]
fn llama_70b_on_64_gpus_is_advised_tensor_parallelism_8_in_a_node() {
    let tmp = tempfile::tempdir().unwrap();
    let mut args = LLAMA_70B.to_vec();
    args.extend(["--gpus", "64", "--device", "cuda", "--gpu-memory-gb", "80"]);
    let p = plan_json(tmp.path(), &args);
    // Data parallelism alone fits at stage 3 (the advice) but spends half its step sending.
    assert!(!p["fits"].as_bool().unwrap());
    let data_only = p["advice"]["efficiency"].as_f64().unwrap();
    assert!(data_only < 0.6, "{}", p["advice"]);
    let tp = &p["tensor_parallel_advice"];
    assert_eq!(tp["tensor_parallel"], 8, "{tp}");
    assert_eq!(tp["data_parallel_ranks"], 8);
    let sets = advised_sets(&tp["change"]);
    assert_eq!(sets[0], "system.tensor_parallel=8");
    // Applied, it fits in what it said, the world trains the same tokens per step, and the
    // step computes a larger share of the time.
    let q = plan_json(tmp.path(), &with_sets(&args, &sets));
    assert!(q["fits"].as_bool().unwrap(), "{}", q["configured"]);
    assert_eq!(q["configured"]["total_bytes"], tp["change"]["total_bytes"]);
    assert_eq!(q["tensor_parallel"], 8);
    let layout = &q["configured"]["layout"];
    let sequences = layout["batch"].as_u64().unwrap() * layout["grad_accum"].as_u64().unwrap();
    assert_eq!(8 * sequences, 64, "{layout}");
    let efficiency = q["configured"]["efficiency"].as_f64().unwrap();
    assert_eq!(efficiency, tp["change"]["efficiency"].as_f64().unwrap());
    assert!(efficiency > data_only + 0.2, "{efficiency} vs {data_only}");
    let time = &q["configured"]["time"];
    let step = q["step_seconds"].as_f64().unwrap();
    let parts: f64 = [
        "compute_seconds",
        "data_parallel_seconds",
        "tensor_parallel_seconds",
    ]
    .iter()
    .map(|k| time[k].as_f64().unwrap())
    .sum();
    assert!((step - parts).abs() < 1e-9 * step);
    // The text says it beside the data-parallel change.
    let text = plan_text(tmp.path(), &args);
    says(
        &text,
        &[
            "Cheapest change that fits: --set system.zero_stage=3",
            "With tensor parallelism in a node: --set system.tensor_parallel=8 ",
            "(mesh 8 tensor-parallel × 8 data-parallel, the same tokens per step;",
        ],
    );
}

/// Llama-3.1-405B's shape (126 layers, d 16384, 128 heads / 8 KV heads, FFN 53248, untied
/// 128,256-id vocabulary) at context 8192, one sequence per data-parallel rank, full
/// activation checkpointing.
const LLAMA_405B: [&str; 18] = [
    "--set",
    "model.num_layers=126",
    "--set",
    "model.hidden_size=16384",
    "--set",
    "model.num_attention_heads=128",
    "--set",
    "model.num_key_value_heads=8",
    "--set",
    "model.intermediate_size=53248",
    "--set",
    "model.vocab_size=128256",
    "--set",
    "training.context_length=8192",
    "--set",
    "training.batch_size=1",
    "--set",
    "training.activation_checkpointing=full",
];

#[test]
fn llama_405b_fits_on_512_gpus_with_tensor_parallelism() {
    let tmp = tempfile::tempdir().unwrap();
    let mut args = LLAMA_405B.to_vec();
    args.extend(["--gpus", "512", "--device", "cuda", "--gpu-memory-gb", "80"]);
    let p = plan_json(tmp.path(), &args);
    assert_eq!(p["model"]["parameters"], 405_853_388_800_u64);
    // No data-parallel layout fits: stage 3 over 512 still keeps 126 layer inputs of 8192 ×
    // 16384 fp32 values.
    assert!(!p["fits"].as_bool().unwrap());
    assert!(p["advice"].is_null(), "{}", p["advice"]);
    let tp = &p["tensor_parallel_advice"];
    let sets = advised_sets(&tp["change"]);
    let q = plan_json(tmp.path(), &with_sets(&args, &sets));
    assert!(
        q["fits"].as_bool().unwrap(),
        "{sets:?}: {}",
        q["configured"]
    );
    assert_eq!(q["configured"]["total_bytes"], tp["change"]["total_bytes"]);
    let text = ok(
        tmp.path(),
        &std::iter::once("plan")
            .chain(args.iter().copied())
            .map(String::from)
            .collect::<Vec<_>>(),
    );
    assert!(
        text.contains("No layout fits") && text.contains("With tensor parallelism in a node: "),
        "{text}"
    );
}

#[test]
fn a_tensor_parallel_degree_that_cannot_split_the_model_or_the_ranks_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    for (extra, expected) in [
        // The production preset has 8 KV heads.
        (
            vec!["--gpus", "6", "--set", "system.tensor_parallel=3"],
            "system.tensor_parallel = 3: must divide the attention heads (32), the KV heads (8)",
        ),
        (
            vec!["--gpus", "6", "--set", "system.tensor_parallel=4"],
            "system.tensor_parallel = 4: must divide the number of ranks, 6",
        ),
    ] {
        let mut args = vec!["plan", "--device", "cuda"];
        args.extend(extra);
        let out = run(
            tmp.path(),
            &args.iter().map(|s| s.to_string()).collect::<Vec<_>>(),
        );
        let text = output_text(&out);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {text}");
        assert!(text.contains(expected), "expected `{expected}` in:\n{text}");
    }
}

/// `lockstep plan` and `train`'s start check decide a rank's memory by one rule
/// (`plan::start::rank_budget`): on this machine, two CPU ranks planned with `plan --gpus 2`
/// are given what the two workers of `lockstep run --nproc 2` check against, and the plan's
/// per-rank estimate is the one the workers print.
#[test]
fn the_plan_and_the_start_check_agree_on_a_ranks_budget_and_estimate() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let base = small(&write_corpus(dir));
    let p: Value = serde_json::from_str(&ok(
        dir,
        &with(
            &base,
            &["plan", "--json", "--device", "cpu", "--gpus", "2"],
            &["--max-steps", "1"],
        ),
    ))
    .unwrap();
    let source = p["budget_source"].as_str().unwrap().to_string();
    assert!(
        source.starts_with("MemAvailable ") && source.ends_with(" / 2 ranks on this node"),
        "{source}"
    );
    let text = ok(
        dir,
        &with(
            &base,
            &["run", "--nproc", "2", "--cpu"],
            &["--max-steps", "1"],
        ),
    );
    // `[CPU0] Memory plan: 0.49 GB per rank estimated, 11.02 GB available (MemAvailable 22.04 GB / 2 ranks on this node)`
    let line = text
        .lines()
        .find(|l| l.contains("Memory plan: "))
        .unwrap_or_else(|| panic!("no memory plan line in:\n{text}"));
    let estimated = format!(
        "{:.2} GB per rank estimated",
        p["configured"]["total_bytes"].as_f64().unwrap() / 1e9
    );
    assert!(
        line.contains(&estimated),
        "plan: {estimated}; train: {line}"
    );
    let (available, train_source) = line
        .split_once(" available (")
        .map(|(a, s)| (a.rsplit(", ").next().unwrap(), s.trim_end_matches(')')))
        .unwrap();
    let digits = |s: &str| s.replace(|c: char| c.is_ascii_digit() || c == '.', "");
    assert_eq!(digits(train_source), digits(&source), "{line}");
    // MemAvailable moves between the two reads; the rule is the same, the figures close.
    let gb: f64 = available.trim_end_matches(" GB").parse().unwrap();
    let planned = p["budget_bytes"].as_f64().unwrap() / 1e9;
    assert!(
        (gb / planned - 1.0).abs() < 0.2,
        "plan {planned} GB, train {gb} GB: {line}"
    );
}

/// Llama-3.1-8B's shape at context 131,072, one sequence per data-parallel rank.
const LLAMA_8B_128K: [&str; 8] = [
    "--set",
    "model.num_layers=32",
    "--set",
    "model.vocab_size=128256",
    "--set",
    "training.context_length=131072",
    "--set",
    "training.batch_size=1",
];

/// 8B at 131,072 tokens on 32 × 80 GB: no layout of 32 data-parallel ranks holds one sequence;
/// the plan proposes the smallest context parallelism that does (C = 2), which fits when
/// applied. At C = 8 the mesh is 4 × 8 × 1, a rank keeps an eighth of the activations, the
/// zero stages shard over all 32 ranks, and the CP group's K/V traffic is the hand formula.
#[test]
fn context_parallelism_splits_each_sequence_and_the_plan_shows_the_mesh() {
    let tmp = tempfile::tempdir().unwrap();
    let mut args = LLAMA_8B_128K.to_vec();
    args.extend(["--gpus", "32", "--device", "cuda", "--gpu-memory-gb", "80"]);
    let p = plan_json(tmp.path(), &args);
    assert!(!p["fits"].as_bool().unwrap());
    assert!(p["advice"].is_null(), "{}", p["advice"]);
    assert_eq!(p["context_parallel"], 1);
    let cp = &p["context_parallel_advice"];
    assert_eq!(cp["context_parallel"], 2, "{cp}");
    assert_eq!(cp["tensor_parallel"], 1);
    assert_eq!(cp["data_parallel_ranks"], 16);
    let sets = advised_sets(&cp["change"]);
    assert_eq!(sets[0], "system.context_parallel=2");
    let q = plan_json(tmp.path(), &with_sets(&args, &sets));
    assert!(q["fits"].as_bool().unwrap(), "{}", q["configured"]);
    assert_eq!(q["configured"]["total_bytes"], cp["change"]["total_bytes"]);
    assert_eq!(
        (
            &q["context_parallel"],
            &q["data_parallel_ranks"],
            &q["replica_ranks"]
        ),
        (&2.into(), &16.into(), &32.into())
    );
    let layout = &q["configured"]["layout"];
    let sequences = layout["batch"].as_u64().unwrap() * layout["grad_accum"].as_u64().unwrap();
    assert_eq!(16 * sequences, 32, "the world's tokens per step: {layout}");

    // C = 8 at zero stage 3 with full checkpointing, against C = 1.
    let fixed = [
        "--set",
        "system.zero_stage=3",
        "--set",
        "training.activation_checkpointing=full",
    ];
    let one = plan_json(tmp.path(), &[args.as_slice(), &fixed].concat());
    let eight = plan_json(
        tmp.path(),
        &[
            args.as_slice(),
            &fixed,
            &["--set", "system.context_parallel=8"],
        ]
        .concat(),
    );
    let bytes = |p: &Value, k: &str| p["configured"]["memory"][k].as_f64().unwrap();
    assert_eq!(eight["data_parallel_ranks"], 4);
    assert_eq!(eight["replica_ranks"], 32);
    assert_eq!(eight["shard_ranks"], 32);
    assert!(eight["fits"].as_bool().unwrap());
    let ratio = bytes(&one, "activations") / bytes(&eight, "activations");
    assert!((ratio - 8.0).abs() < 1e-9, "{ratio}");
    assert_eq!(bytes(&one, "moments"), bytes(&eight, "moments"));
    assert_eq!(bytes(&one, "context_parallel"), 0.0);
    assert!(bytes(&eight, "context_parallel") > 0.0);
    // Per step: 32 layers × 131,072 tokens × 7/8 × 2 × 8 KV heads × 128 × (3 bf16 all-gathers
    // with full recomputation × 2 B + one fp32 reduce-scatter × 4 B).
    let expected = 32.0 * 131_072.0 * 7.0 / 8.0 * 2.0 * 1024.0 * (3.0 * 2.0 + 4.0);
    let sent = eight["context_parallel_bytes_per_step"].as_f64().unwrap();
    assert!((sent - expected).abs() < 1e-6 * expected, "{sent}");
    assert_eq!(eight["context_parallel_link"], "intra_node");
    // A rank computes an eighth of the sequence's FLOPs.
    let compute = |p: &Value| p["configured"]["time"]["compute_seconds"].as_f64().unwrap();
    assert!((compute(&one) / compute(&eight) - 8.0).abs() < 1e-9);

    let mut text_args = vec!["plan".to_string()];
    text_args.extend(args.iter().map(|s| s.to_string()));
    let text = ok(tmp.path(), &text_args);
    assert!(
        text.contains(
            "With context parallelism (each sequence split among 2 ranks): --set system.context_parallel=2 "
        ),
        "{text}"
    );
    text_args.extend(
        [&fixed[..], &["--set", "system.context_parallel=8"]]
            .concat()
            .iter()
            .map(|s| s.to_string()),
    );
    let text = ok(tmp.path(), &text_args);
    says(
        &text,
        &[
            "Layout: 32 GPUs = mesh 4 data-parallel × 8 context-parallel × 1 tensor-parallel |",
            "32 layers × 16384 tokens (1/8 of each sequence: context parallel)",
            "  cp buffers ",
            "1/8 of it on each rank of a context-parallel group",
            "Communication per step per rank among 32 data × context ranks",
            "Context parallelism: ",
            "per step per rank in each group of 8",
            "CP time",
        ],
    );
}

#[test]
fn a_context_parallel_degree_the_ranks_or_the_context_do_not_allow_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    for (extra, expected) in [
        (
            vec!["--gpus", "6", "--set", "system.context_parallel=4"],
            "system.context_parallel = 4: must divide the number of ranks, 6",
        ),
        (
            vec![
                "--gpus",
                "8",
                "--set",
                "system.context_parallel=8",
                "--set",
                "training.context_length=200",
            ],
            "system.context_parallel = 8 cuts every sequence into 2 × 8 = 16 chunks",
        ),
    ] {
        let mut args = vec!["plan", "--device", "cuda"];
        args.extend(extra);
        let out = run(
            tmp.path(),
            &args.iter().map(|s| s.to_string()).collect::<Vec<_>>(),
        );
        let text = output_text(&out);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {text}");
        assert!(text.contains(expected), "expected `{expected}` in:\n{text}");
    }
}

/// Qwen3-30B-A3B (128 experts of width 768, top 8, in each of 48 layers; context 8192) on 16 ×
/// 80 GB: data parallelism alone fits only at stage 3, gathering every expert for every
/// micro-batch; the advice splits the experts 8 ways inside a node (E = 16 would span the
/// nodes' slower links), each rank holding 16 of every layer's, and the all-to-all moves each
/// token's 8 copies instead; at tensor parallelism 2, 4 ways.
#[test]
fn qwen3_30b_a3b_on_16_gpus_is_advised_expert_parallelism_8_in_a_node() {
    let tmp = tempfile::tempdir().unwrap();
    let args = [
        "--preset",
        "qwen3-30b-a3b",
        "--gpus",
        "16",
        "--device",
        "cuda",
        "--gpu-memory-gb",
        "80",
    ];
    let p = plan_json(tmp.path(), &args);
    assert!(!p["fits"].as_bool().unwrap());
    assert_eq!(p["advice"]["layout"]["zero_stage"], 3, "{}", p["advice"]);
    let data_only = p["advice"]["step_seconds"].as_f64().unwrap();
    let ep = &p["expert_parallel_advice"];
    assert_eq!(ep["expert_parallel"], 8, "{ep}");
    assert_eq!(ep["experts_per_rank"], 16);
    assert_eq!(ep["link"], "intra_node");
    let sets = advised_sets(&ep["change"]);
    assert_eq!(sets[0], "system.expert_parallel=8");
    let step = ep["change"]["step_seconds"].as_f64().unwrap();
    assert!(step < data_only / 2.0, "{step} s against {data_only} s");
    // Applied, it fits in what it said and sends what the module's formula says: per MoE layer
    // and token, 7/8 of its 8 copies of d bf16 values out and back in the forward, again in the
    // backward, and once more each way in the selective recomputation.
    let q = plan_json(tmp.path(), &with_sets(&args, &sets));
    assert!(q["fits"].as_bool().unwrap(), "{}", q["configured"]);
    assert_eq!(q["configured"]["total_bytes"], ep["change"]["total_bytes"]);
    assert_eq!(q["expert_parallel"], 8);
    let layout = &q["configured"]["layout"];
    assert_eq!(layout["activation_checkpointing"], "selective");
    let tokens =
        layout["batch"].as_f64().unwrap() * layout["grad_accum"].as_f64().unwrap() * 8192.0;
    let bytes = 6.0 * 7.0 / 8.0 * 8.0 * 2048.0 * 2.0 * tokens * 48.0;
    assert_eq!(q["expert_parallel_bytes_per_step"].as_f64().unwrap(), bytes);
    let time = &q["configured"]["time"];
    assert!(time["expert_parallel_seconds"].as_f64().unwrap() > 0.0);
    let parts: f64 = [
        "compute_seconds",
        "data_parallel_seconds",
        "expert_parallel_seconds",
    ]
    .iter()
    .map(|k| time[k].as_f64().unwrap())
    .sum();
    let step = q["step_seconds"].as_f64().unwrap();
    assert!((step - parts).abs() < 1e-9 * step, "{time}");
    // A rank's weights hold its 16 experts of each layer and every dense parameter.
    let weights = q["configured"]["memory"]["weights"].as_f64().unwrap();
    let experts = 48.0 * 128.0 * 3.0 * 2048.0 * 768.0;
    let dense = 30.532e9 - experts;
    let held = 2.0 * (dense + experts / 8.0);
    assert!(
        (weights / held - 1.0).abs() < 1e-3,
        "{weights} against {held}"
    );
    // The text names the change and the exchange.
    let text = plan_text(tmp.path(), &args);
    assert!(
        text.contains("With expert parallelism (each rank 16 of every MoE layer's experts"),
        "{text}"
    );
    let text = plan_text(tmp.path(), &with_sets(&args, &sets));
    says(
        &text,
        &[
        "| expert parallel 8 (groups of 8 replicas, each rank 16 of every MoE layer's 128 experts)",
        "Expert parallelism: 67.65 GB per step per rank in each group of 8",
        "over a node's links at 360 GB/s",
        "the experts' gradients reduced among their 2 holders",
        ],
    );
    // With tensor parallelism 2 the group's E·T ranks stay inside a node: E = 4, each rank
    // holding 32 of every layer's experts, each split by its width over the tensor group.
    let mut tp = args.to_vec();
    tp.extend(["--set", "system.tensor_parallel=2"]);
    let p = plan_json(tmp.path(), &tp);
    let ep = &p["expert_parallel_advice"];
    assert_eq!(
        (&ep["expert_parallel"], &ep["link"]),
        (&serde_json::json!(4), &serde_json::json!("intra_node")),
        "{ep}"
    );
    assert_eq!(ep["experts_per_rank"], 32);
}

/// The goal: Qwen3-30B-A3B on 8 × 80 GB. Without EP it fits at stage 3 with every
/// expert gathered for every micro-batch; at E = 8 (each rank 16 of every layer's experts, one
/// holder each) nothing at stages 0-2 fits (the bf16 working copy of a rank's experts and the
/// dense parameters on top of the fp32 state), stage 3 with full checkpointing does: the
/// save's peak (the fp32 state, the gradient slice and the weights it writes, gathered) under
/// 80 GB, the step's below it; and the step's data-parallel traffic is a fraction of what
/// gathering every expert costs.
#[test]
fn qwen3_30b_a3b_fits_on_8_gpus_at_expert_parallelism_8_and_stage_3() {
    let tmp = tempfile::tempdir().unwrap();
    let args = [
        "--preset",
        "qwen3-30b-a3b",
        "--gpus",
        "8",
        "--device",
        "cuda",
        "--gpu-memory-gb",
        "80",
        "--set",
        "system.expert_parallel=8",
    ];
    let p = plan_json(tmp.path(), &args);
    assert!(!p["fits"].as_bool().unwrap());
    let layouts = p["layouts"].as_array().unwrap();
    let fitting: Vec<_> = layouts
        .iter()
        .filter(|l| l["fits"].as_bool().unwrap())
        .map(|l| &l["layout"])
        .collect();
    assert_eq!(fitting.len(), 1, "{fitting:?}");
    assert_eq!(fitting[0]["zero_stage"], 3);
    assert_eq!(fitting[0]["activation_checkpointing"], "full");
    let sets = advised_sets(&p["advice"]);
    let q = plan_json(tmp.path(), &with_sets(&args, &sets));
    assert!(q["fits"].as_bool().unwrap(), "{}", q["configured"]);
    let total = q["configured"]["total_bytes"].as_f64().unwrap();
    assert!(total < 80e9, "{total}");
    let memory = &q["configured"]["memory"];
    assert_eq!(memory["weights"], 0.0);
    // The fp32 state of 30.5B parameters over 8 ranks: masters 4, moments 8, gradient slice 4
    // B/param, with 16 of the 128 experts sharded over one holder each.
    let per_rank = 30.532e9 / 8.0;
    for (part, bytes) in [
        ("master_weights", 4.0),
        ("moments", 8.0),
        ("gradients", 4.0),
    ] {
        let got = memory[part].as_f64().unwrap();
        assert!(
            (got / (bytes * per_rank) - 1.0).abs() < 1e-3,
            "{part}: {got}"
        );
    }
    let without = plan_json(
        tmp.path(),
        &with_sets(&args[..8], &["system.zero_stage=3".into()]),
    );
    let sent = |p: &serde_json::Value| p["comm_bytes_per_step"][3].as_f64().unwrap();
    assert!(
        sent(&q) < 0.2 * sent(&without),
        "{} against {}",
        sent(&q),
        sent(&without)
    );
}

/// Pipeline parallelism in the plan: Llama-3.1-405B on 512 GPUs at the tensor-parallel
/// advice's layout lists every pipeline layout that fits and proposes the most efficient;
/// applied, the plan shows the pipeline rank by rank and fits with what was advertised.
/// Training with stages is refused (exit 2, before any worker starts) until it runs.
#[test]
fn a_pipeline_is_planned_rank_by_rank_and_its_advice_fits_when_applied() {
    let tmp = tempfile::tempdir().unwrap();
    let mut args = LLAMA_405B.to_vec();
    args.extend(["--gpus", "512", "--device", "cuda", "--gpu-memory-gb", "80"]);
    let tp = [
        "--set",
        "system.tensor_parallel=8",
        "--set",
        "training.batch_size=4",
        "--set",
        "training.grad_accum_nums=2",
        "--set",
        "system.zero_stage=3",
    ];
    args.extend(tp);
    let p = plan_json(tmp.path(), &args);
    let options = p["pipeline_options"].as_array().unwrap();
    assert!(options.len() > 8, "{options:?}");
    let advice = &p["pipeline_advice"];
    let sets = advised_sets(&advice["change"]);
    let stages: usize = sets
        .iter()
        .find_map(|s| s.strip_prefix("system.pipeline_parallel="))
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("no pipeline advised: {sets:?}"));
    assert!(stages > 1, "{sets:?}");
    assert!(advice["change"]["efficiency"].as_f64().unwrap() >= 0.8);
    let q = plan_json(tmp.path(), &with_sets(&args, &sets));
    assert!(q["fits"].as_bool().unwrap(), "{}", q["configured"]);
    assert_eq!(
        q["configured"]["total_bytes"],
        advice["change"]["total_bytes"]
    );
    let pipe = &q["configured"]["pipeline"];
    assert_eq!(pipe["ranks"], stages);
    assert_eq!(pipe["rank_bytes"].as_array().unwrap().len(), stages);
    assert_eq!(
        pipe["stage_layers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|n| n.as_u64().unwrap())
            .sum::<u64>(),
        126
    );
    let text = plan_text(tmp.path(), &with_sets(&args, &sets));
    let mesh = format!(
        "= mesh {stages} pipeline × {} data-parallel × 1 context-parallel × 8 tensor-parallel",
        64 / stages
    );
    let line = format!("Pipeline: {stages} ranks, ");
    says(
        &text,
        &[
            &mesh,
            "Per-rank peak memory of pipeline rank ",
            "+ pipeline bubble ",
            &line,
            "Pipeline layouts that fit",
        ],
    );

    let out = run(
        tmp.path(),
        &[
            "run",
            "--cpu",
            "--nproc",
            "2",
            "--set",
            "system.pipeline_parallel=2",
        ]
        .map(String::from),
    );
    let text = output_text(&out);
    assert_eq!(out.status.code(), Some(2), "{text}");
    says(
        &text,
        &["system.pipeline_parallel = 2: `lockstep plan` models pipeline stages"],
    );
    assert!(!text.contains("[CPU0]"), "no worker starts: {text}");
}
