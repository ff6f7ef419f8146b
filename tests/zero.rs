//! Sharded data parallelism (`system.zero_stage` 1 and 2) through real `lockstep run` workers
//! on loopback: the same training as replicated data parallelism, 1/N of the optimizer state
//! per rank, and checkpoints that resume on another number of ranks and another stage.

mod common;

use std::collections::HashMap;
use std::path::Path;

use common::{losses, ok, small, with, write_corpus};
use lockstep::model::hf::Weights;
use lockstep::train::checkpoint::MomentFiles;

/// The weights of a checkpoint, single file or owner-written shards alike.
fn weights(ckpt: &Path) -> HashMap<String, tch::Tensor> {
    let w = Weights::open(ckpt).unwrap();
    w.names()
        .into_iter()
        .map(|n| {
            let t = w.tensor(&n).unwrap();
            (n, t)
        })
        .collect()
}

/// Both moments of every parameter, reassembled from whatever pieces the checkpoint holds.
fn moments(ckpt: &Path) -> HashMap<String, (tch::Tensor, tch::Tensor)> {
    let m = MomentFiles::open(ckpt).unwrap();
    let w = weights(ckpt);
    w.iter()
        .map(|(n, t)| (n.clone(), m.read(n, &(0..t.numel())).unwrap()))
        .collect()
}

/// Worst per-tensor relative L2 difference.
fn worst(a: &HashMap<String, tch::Tensor>, b: &HashMap<String, tch::Tensor>) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .map(|(n, x)| {
            let y = &b[n];
            (x - y).norm().double_value(&[]) / y.norm().double_value(&[]).max(1e-30)
        })
        .fold(0.0, f64::max)
}

fn bitwise(a: &HashMap<String, tch::Tensor>, b: &HashMap<String, tch::Tensor>) -> bool {
    a.len() == b.len() && a.iter().all(|(n, x)| x.equal(&b[n]))
}

fn close_losses(a: &[(u64, f64)], b: &[(u64, f64)], tol: f64) {
    assert_eq!(a.len(), b.len(), "{a:?} vs {b:?}");
    for ((sa, la), (sb, lb)) in a.iter().zip(b) {
        assert_eq!(sa, sb);
        assert!((la - lb).abs() <= tol * lb.abs(), "step {sa}: {la} vs {lb}");
    }
}

/// 2 and 3 ranks at stages 1 and 2 against stage 0 on the same ranks, 5 steps. What is bitwise
/// and why: stage 1 all-reduces the same full gradients and takes the norm from them as stage 0
/// does, and AdamW is elementwise, so it is bitwise equal on two ranks. On three, a few moment
/// elements next to a shard boundary differ in the last bit: libtorch's vectorised fused AdamW
/// runs the elements of a tensor's tail through its scalar loop, and where a slice ends moves
/// which elements those are (an FMA-or-not difference). Stage 2 sums each
/// gradient element in another ring order (reduce-scatter pieces follow the shards, not the
/// all-reduce's chunks) and takes the norm from the shards, so it matches within 1e-6; with two
/// ranks every sum has two terms (commutative), so without clipping it is bitwise equal too.
#[test]
fn sharded_stages_train_like_replicated_data_parallelism() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let lr = [
        "--set",
        "training.learning_rate=3e-4",
        "--set",
        "training.min_lr=3e-5",
        "--max-steps",
        "5",
    ];
    let base = with(&small(&write_corpus(dir)), &[], &lr);
    ok(dir, &with(&base, &["prepare"], &[]));
    let train = |world: usize, stage: usize, clip: bool| {
        let name = format!("w{world}-s{stage}-c{}", u8::from(clip));
        let nproc = world.to_string();
        let sets = [
            format!("system.zero_stage={stage}"),
            format!("logging.run_name={name}"),
            format!("training.max_grad_norm={}", if clip { 1.0 } else { 0.0 }),
        ];
        let mut args = vec!["run".to_string(), "--cpu".into(), "--nproc".into(), nproc];
        args.extend(base.iter().cloned());
        for s in sets {
            args.extend(["--set".to_string(), s]);
        }
        ok(dir, &args);
        dir.join("runs").join(name)
    };
    for world in [2, 3] {
        let zero = train(world, 0, true);
        let l0 = losses(&zero.join("metrics.jsonl"));
        let w0 = weights(&zero.join("checkpoints/step_5"));
        let m0 = moments(&zero.join("checkpoints/step_5"));
        assert!(l0[0].1 - l0[4].1 > 0.01, "real training: {l0:?}");
        for stage in [1, 2] {
            let run = train(world, stage, true);
            let ckpt = run.join("checkpoints/step_5");
            assert!(ckpt.join("model.safetensors.index.json").is_file());
            close_losses(&losses(&run.join("metrics.jsonl")), &l0, 1e-6);
            let w = weights(&ckpt);
            let err = worst(&w, &w0);
            assert!(
                err < 1e-6,
                "world {world} stage {stage}: weights differ by {err:e}"
            );
            // The moments scale with the clip coefficient, which stage 2 takes from a norm
            // summed over shards: libtorch's fp32 norm kernel on CPU (stage 0's, as PyTorch's
            // clip_grad_norm_) is off by up to ~1e-4 on millions of elements, the shards' summed
            // squares by ~1e-7, so the two coefficients differ by that much. AdamW's update is
            // invariant to a common gradient scale, which is why the weights still agree to 1e-6.
            let tol = if stage == 1 { 1e-6 } else { 5e-4 };
            let m = moments(&ckpt);
            for (n, (a, b)) in &m0 {
                for (x, y) in [(a, &m[n].0), (b, &m[n].1)] {
                    let err = (x.view(-1) - y.view(-1)).norm().double_value(&[])
                        / x.norm().double_value(&[]).max(1e-30);
                    assert!(
                        err < tol,
                        "world {world} stage {stage}: {n} moments {err:e}"
                    );
                }
            }
            if stage == 1 && world == 2 {
                assert!(bitwise(&w, &w0), "stage 1 is bitwise stage 0");
                assert!(m0
                    .iter()
                    .all(|(n, (a, b))| a.equal(&m[n].0) && b.equal(&m[n].1)));
            }
        }
    }
    // Two ranks, no clipping: stage 2 is bitwise stage 0 as well, moments included.
    let (a, b) = (train(2, 0, false), train(2, 2, false));
    let (a, b) = (a.join("checkpoints/step_5"), b.join("checkpoints/step_5"));
    assert!(bitwise(&weights(&a), &weights(&b)));
    let (ma, mb) = (moments(&a), moments(&b));
    assert!(ma
        .iter()
        .all(|(n, (x, y))| x.equal(&mb[n].0) && y.equal(&mb[n].1)));
}

/// The optimizer state of each rank is 1/N of stage 0's: in the files it writes and in the
/// memory line it prints.
#[test]
fn each_rank_holds_a_1_over_n_share_of_the_optimizer_state() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let base = with(
        &small(&write_corpus(dir)),
        &[],
        &["--max-steps", "2", "--set", "logging.memory_interval=1"],
    );
    let mut lines = Vec::new();
    let mut bytes = Vec::new();
    for (world, stage) in [(1, 0), (2, 2), (3, 1)] {
        let name = format!("w{world}-s{stage}");
        let out = ok(
            dir,
            &with(
                &base,
                &["run", "--cpu", "--nproc", &world.to_string()],
                &[
                    "--set",
                    &format!("system.zero_stage={stage}"),
                    "--set",
                    &format!("logging.run_name={name}"),
                ],
            ),
        );
        let memory = out
            .lines()
            .rev()
            .find(|l| l.starts_with("[CPU0] Memory |"))
            .unwrap_or_else(|| panic!("no memory line:\n{out}"))
            .to_string();
        lines.push(memory);
        let ckpt = dir.join("runs").join(&name).join("checkpoints/step_2");
        let files: Vec<u64> = std::fs::read_dir(&ckpt)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| {
                let n = p.file_name().unwrap().to_str().unwrap();
                n.starts_with("optimizer")
            })
            .map(|p| std::fs::metadata(p).unwrap().len())
            .collect();
        assert_eq!(files.len(), world, "one optimizer file per rank: {files:?}");
        bytes.push(files);
    }
    let moments_gb = |line: &str| -> f64 {
        let at = line.find("moments ").unwrap() + "moments ".len();
        line[at..].split(' ').next().unwrap().parse().unwrap()
    };
    let full = moments_gb(&lines[0]);
    for (i, world) in [(1, 2.0), (2, 3.0)] {
        let share = moments_gb(&lines[i]);
        assert!(
            (share * world - full).abs() <= 0.002,
            "{}: moments {share} GB vs {full} / {world}",
            lines[i]
        );
    }
    // Files: each rank's piece is 1/N of the replicated file (headers and padding aside).
    let whole = bytes[0][0] as f64;
    for (i, world) in [(1, 2.0), (2, 3.0)] {
        for &b in &bytes[i] {
            let ratio = b as f64 * world / whole;
            assert!(
                (0.97..1.03).contains(&ratio),
                "{b} bytes of {whole} with {world} ranks"
            );
        }
    }
    assert!(lines[1].contains("master 0.0"), "{}", lines[1]);
}

/// A checkpoint written by 2 ranks at stage 2, stopped at step 5, continues on 1 rank at stage
/// 0 and on 3 ranks at stage 2 with the same global sample order: the losses of steps 6–10
/// track the uninterrupted 2-rank run.
#[test]
fn a_sharded_checkpoint_resumes_on_other_world_sizes_and_stages() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let base = with(
        &small(&write_corpus(dir)),
        &[],
        &[
            "--max-steps",
            "10",
            "--set",
            "training.learning_rate=3e-4",
            "--set",
            "training.min_lr=3e-5",
        ],
    );
    ok(dir, &with(&base, &["prepare"], &[]));
    // Global batch 12 = 2 × 6 = 1 × 12 = 3 × 4.
    let run = |world: usize, stage: usize, name: &str, extra: &[&str]| {
        let per_rank = (12 / world).to_string();
        let mut tail = vec![
            "--set".to_string(),
            format!("training.batch_size={per_rank}"),
            "--set".into(),
            format!("system.zero_stage={stage}"),
            "--set".into(),
            format!("logging.run_name={name}"),
        ];
        tail.extend(extra.iter().map(|s| s.to_string()));
        let tail: Vec<&str> = tail.iter().map(String::as_str).collect();
        ok(
            dir,
            &with(
                &base,
                &["run", "--cpu", "--nproc", &world.to_string()],
                &tail,
            ),
        );
        losses(&dir.join("runs").join(name).join("metrics.jsonl"))
    };
    let straight = run(2, 2, "straight", &[]);
    let first = run(2, 2, "first", &["--stop-at-step", "5"]);
    close_losses(&first, &straight[..5], 1e-6);
    let ckpt = dir.join("runs/first/checkpoints/step_5");
    // The owner-written shards and their index are one Hugging Face directory: transformers
    // loads it, and so do eval and export.
    let numel: i64 = weights(&ckpt).values().map(|t| t.numel() as i64).sum();
    let out = std::process::Command::new(common::python())
        .args([
            "-c",
            "import sys; from transformers import AutoModelForCausalLM as M; \
             m = M.from_pretrained(sys.argv[1]); print(sum(p.numel() for p in m.parameters()))",
        ])
        .arg(&ckpt)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        text.trim(),
        numel.to_string(),
        "{}",
        common::output_text(&out)
    );
    let val = std::fs::read_dir(dir.join(".lockstep/cache"))
        .unwrap()
        .map(|e| e.unwrap().path().join("val.tok"))
        .find(|p| p.is_file())
        .unwrap();
    let eval = ok(
        dir,
        &[
            "eval".into(),
            "--model".into(),
            ckpt.display().to_string(),
            "--data".into(),
            val.display().to_string(),
            "--max-batches".into(),
            "1".into(),
        ],
    );
    assert!(eval.contains("perplexity"), "{eval}");
    let ckpt = ckpt.to_str().unwrap();
    for (world, stage) in [(1, 0), (3, 2)] {
        let name = format!("resumed-w{world}-s{stage}");
        let after = run(world, stage, &name, &["--resume", ckpt]);
        assert_eq!(after.first().map(|s| s.0), Some(6), "continues at step 6");
        close_losses(&after, &straight[5..], 1e-5);
    }
}

/// The NaN/Inf guard with sharded gradients: each rank holds only its slice, yet the report
/// printed once names the poisoned parameter with its full count, the dump holds full
/// gradients numpy can read, and the evidence checkpoint is a complete sharded one.
#[test]
fn the_nan_report_of_sharded_gradients_is_whole() {
    const UP: &str = "model.layers.0.mlp.up_proj.weight";
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let base = small(&write_corpus(dir));
    let inject = [
        "--max-steps",
        "6",
        "--set",
        "system.zero_stage=2",
        "--set",
        "debug.inject_nan_at_step=3",
        "--set",
        &format!("debug.inject_nan_param={UP}"),
    ];
    let out = common::run(
        dir,
        &with(
            &base,
            &["run", "--nproc", "2", "--cpu", "--log-ranks", "all"],
            &inject,
        ),
    );
    let text = common::output_text(&out);
    assert_eq!(out.status.code(), Some(3), "{text}");
    // Printed once, by rank 0 (the launcher may quote rank 0's log tail again).
    assert!(text.contains("[CPU0] NaN GRADIENT DETECTED"), "{text}");
    assert!(!text.contains("[CPU1] NaN GRADIENT"), "{text}");
    assert!(
        text.contains(&format!(
            "• {UP}  shape [128, 64]  NaN 1/8192  Inf 0/8192  values [nan,"
        )),
        "{text}"
    );
    let run_dir = dir.join("runs/tiny");
    let evidence = run_dir.join("checkpoints/nan_step_3");
    assert!(evidence.join("model.safetensors.index.json").is_file());
    assert!(MomentFiles::open(&evidence).is_ok());
    let dump = run_dir.join("debug/nan_step_3.safetensors");
    let script = format!(
        "from safetensors.numpy import load_file; import numpy as np; d = load_file('{}'); \
         print(len([k for k in d if k.endswith('.grad')]), sorted((k, int(np.isnan(v).sum())) for k, v in d.items() if np.isnan(v).any()))",
        dump.display()
    );
    let py = std::process::Command::new(common::python())
        .args(["-c", &script])
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&py.stdout).trim(),
        format!("21 [('{UP}.grad', 1)]"),
        "every parameter's full gradient, one NaN"
    );
}

/// Reducing each bucket while backward goes on (`system.overlap_comm`, the default) gives the
/// same bits as reducing after backward, at every zero stage, with gradient accumulation.
#[test]
fn the_overlapped_reduction_is_bitwise_the_one_after_backward() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let base = with(
        &small(&write_corpus(dir)),
        &[],
        &[
            "--max-steps",
            "4",
            "--set",
            "training.grad_accum_nums=2",
            "--set",
            "training.batch_size=2",
            // Small buckets: several per step, started at different layers.
            "--set",
            "system.bucket_mb=0.5",
        ],
    );
    ok(dir, &with(&base, &["prepare"], &[]));
    for stage in [0, 1, 2] {
        let mut ckpts = Vec::new();
        for overlap in [true, false] {
            let name = format!("s{stage}-o{overlap}");
            ok(
                dir,
                &with(
                    &base,
                    &["run", "--cpu", "--nproc", "2"],
                    &[
                        "--set",
                        &format!("system.zero_stage={stage}"),
                        "--set",
                        &format!("system.overlap_comm={overlap}"),
                        "--set",
                        &format!("logging.run_name={name}"),
                    ],
                ),
            );
            ckpts.push(dir.join("runs").join(name));
        }
        assert_eq!(
            losses(&ckpts[0].join("metrics.jsonl")),
            losses(&ckpts[1].join("metrics.jsonl")),
            "stage {stage}: losses"
        );
        let (a, b) = (
            ckpts[0].join("checkpoints/step_4"),
            ckpts[1].join("checkpoints/step_4"),
        );
        assert!(
            bitwise(&weights(&a), &weights(&b)),
            "stage {stage}: weights"
        );
        let (ma, mb) = (moments(&a), moments(&b));
        assert!(
            ma.iter()
                .all(|(n, (x, y))| x.equal(&mb[n].0) && y.equal(&mb[n].1)),
            "stage {stage}: moments"
        );
    }
}
