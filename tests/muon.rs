//! Muon (`training.optimizer = muon`, issue 49) under every layout lockstep has: the
//! optimizer from the same gradient on CPU ranks of threads (every zero stage, hybrid sharding,
//! tensor parallelism, both exchanges) bitwise one rank's; real `lockstep run` workers; exact
//! resumes; the other optimizer's checkpoints; bad settings.

use crate::common;

use std::collections::HashMap;
use std::path::Path;

use common::ranks::{each_rank, Plain};
use common::runs::{bitwise, close_losses, run_at, worst};
use common::{fails, losses, ok, small, with, write_corpus};
use lockstep::config::{MuonAdjust, ZeroStage};
use lockstep::dist::{self, ProcessGroup, SingleProcess};
use lockstep::model::{AttentionBackend, GradUnit, Llama, LlamaShape, TensorParallel};
use lockstep::train::checkpoint::MomentFiles;
use lockstep::train::optim::{Hybrid, Hyper, Optimizer, Rule, Sharding, TensorGroups};
use lockstep::train::tensor_parallel::GroupComm;
use tch::nn::VarStore;
use tch::{Device, Kind, Tensor};

/// `small`'s model (2 layers, hidden 64) with Muon, 6 clipped steps, checkpoints at 3 and 6;
/// prepared.
fn muon_base(dir: &Path) -> Vec<String> {
    let base = with(
        &small(&write_corpus(dir)),
        &[],
        &[
            "--max-steps",
            "6",
            "--set",
            "training.optimizer=muon",
            "--set",
            "training.learning_rate=3e-3",
            "--set",
            "training.min_lr=3e-4",
            "--set",
            "checkpoint.interval=3",
        ],
    );
    ok(dir, &with(&base, &["prepare"], &[]));
    base
}

/// Every moment of every parameter a checkpoint holds, by (parameter, key).
fn all_moments(ckpt: &Path) -> HashMap<(String, &'static str), Tensor> {
    let m = MomentFiles::open(ckpt).unwrap();
    let w = common::checkpoint_weights(ckpt);
    let mut out = HashMap::new();
    for (n, t) in &w {
        for (key, v) in m.read_all(n, &(0..t.numel())).unwrap() {
            out.insert((n.clone(), key), v);
        }
    }
    out
}

/// A finished run: its losses, and the weights and moments of its step-6 checkpoint.
type Finished = (
    Vec<(u64, f64)>,
    HashMap<String, Tensor>,
    HashMap<(String, &'static str), Tensor>,
);

/// `base` on `world` ranks at `stage` with `batch` sequences per rank and `extra`.
fn finished(
    dir: &Path,
    base: &[String],
    (world, stage, batch): (usize, usize, usize),
    name: &str,
    extra: &[&str],
) -> Finished {
    let b = format!("training.batch_size={batch}");
    let mut tail = vec!["--set", b.as_str()];
    tail.extend(extra);
    run_at(dir, base, (world, stage), name, &tail);
    let run = dir.join("runs").join(name);
    let ckpt = run.join("checkpoints/step_6");
    (
        losses(&run.join("metrics.jsonl")),
        common::checkpoint_weights(&ckpt),
        all_moments(&ckpt),
    )
}

/// Every weight, moment and loss of two runs bitwise equal.
fn same_bits(what: &str, a: &Finished, b: &Finished) {
    assert_eq!(a.0, b.0, "{what}: losses");
    assert!(
        bitwise(&a.1, &b.1),
        "{what}: weights differ by {:e}",
        worst(&a.1, &b.1)
    );
    assert_eq!(a.2.len(), b.2.len(), "{what}: the same moments");
    for (k, x) in &a.2 {
        assert!(x.equal(&b.2[k]), "{what}: {k:?}");
    }
}

/// The momentum buffers and AdamW moments the checkpoint holds: Muon's matrices one buffer,
/// the rest two moments.
fn muon_moments_only_where_they_belong(f: &Finished) {
    let keys = |n: &str| -> Vec<&str> {
        let mut k: Vec<&str> =
            f.2.keys()
                .filter(|(p, _)| p == n)
                .map(|(_, k)| *k)
                .collect();
        k.sort_unstable();
        k
    };
    for name in f.1.keys() {
        let matrix = name.starts_with("model.layers.") && f.1[name].dim() == 2;
        let want = if matrix {
            vec!["momentum_buffer"]
        } else {
            vec!["exp_avg", "exp_avg_sq"]
        };
        assert_eq!(keys(name), want, "{name}");
    }
}

/// Muon through `lockstep run` on 2 ranks: zero stages 1, 2 and 3, and stage 2 with the
/// all-gather variant (`debug.muon_all_gather`), are bitwise stage 0. On two ranks every
/// averaged gradient is a sum of two terms (commutative) at every stage, and the exchanges move
/// bf16 values as they are, so the bf16 Newton–Schulz reads the same bits whichever rank
/// orthogonalizes a matrix. The checkpoint holds one momentum buffer per Muon matrix and two
/// moments per other parameter. Stopped at step 3 and resumed, the run ends bitwise the
/// uninterrupted one; its step-3 checkpoint resumes on one rank (batch 4, the same samples)
/// with the same losses within 1e-5.
#[test]
fn muon_is_bitwise_the_same_at_every_zero_stage_and_resumes_exactly() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let base = muon_base(dir);
    let zero = finished(dir, &base, (2, 0, 2), "s0", &[]);
    assert!(
        zero.0[0].1 - zero.0[5].1 > 0.1,
        "real training: {:?}",
        zero.0
    );
    muon_moments_only_where_they_belong(&zero);
    for stage in [1, 2, 3] {
        let name = format!("s{stage}");
        let got = finished(dir, &base, (2, stage, 2), &name, &[]);
        same_bits(&name, &got, &zero);
    }
    let gathered = ["--set", "debug.muon_all_gather=true"];
    let got = finished(dir, &base, (2, 2, 2), "s2-gather", &gathered);
    same_bits("the all-gather variant", &got, &zero);

    // Resumed at step 3, on the same layout: bitwise.
    let stop = ["--set", "training.batch_size=2", "--stop-at-step", "3"];
    run_at(dir, &base, (2, 2), "stopped", &stop);
    let resume = ["--set", "training.batch_size=2", "--resume", "auto"];
    run_at(dir, &base, (2, 2), "stopped", &resume);
    let ckpt = dir.join("runs/stopped/checkpoints/step_6");
    assert!(bitwise(&common::checkpoint_weights(&ckpt), &zero.1));
    let moments = all_moments(&ckpt);
    assert!(moments.iter().all(|(k, v)| v.equal(&zero.2[k])), "moments");
    // On one rank.
    let step3 = dir.join("runs/s2/checkpoints/step_3");
    let step3 = step3.to_str().unwrap();
    let one = ["--set", "training.batch_size=4", "--resume", step3];
    let out = run_at(dir, &base, (1, 0), "one", &one);
    assert!(out.contains("Resumed from"), "{out}");
    let resumed = losses(&dir.join("runs/one/metrics.jsonl"));
    assert_eq!(resumed.first().map(|s| s.0), Some(4), "continues at step 4");
    close_losses(&resumed, &zero.0[3..], 1e-5);
}

/// A run of [`like_one_rank`]: its name, (ranks, zero stage, batch per rank), its flags.
type Mesh<'a> = (&'a str, (usize, usize, usize), &'a [&'a str]);

/// The worst per-tensor relative L2 differences of `a`'s weights and moments from `b`'s.
fn spread(a: &Finished, b: &Finished) -> (f64, f64) {
    let moments =
        a.2.iter()
            .map(|(k, v)| {
                let y = &b.2[k];
                (v - y).norm().double_value(&[]) / y.norm().double_value(&[]).max(1e-30)
            })
            .fold(0.0, f64::max);
    (worst(&a.1, &b.1), moments)
}

/// Runs on meshes whose gradients are not one rank's bit for bit (a mean summed in another
/// order, matmuls split by tensor parallelism) against one rank with the same global batch:
/// every loss, weight and moment no further from one rank's than one rank is from itself with
/// its sums reordered (the batch as 2 accumulated micro-batches), with a margin of 3× (losses:
/// within 1e-5 where that is more; a mixture's routing turns small differences into larger
/// loss differences). Newton–Schulz reads the update rounded to bf16, so gradients that
/// differ in their last fp32 bits cross a few rounding boundaries, and the bf16 iteration
/// spreads each over its matrix (`muon::tests::last_bits_move_the_bf16_iteration_less_than_its_own_error`
/// compares both with the iteration in fp64); at this learning rate that is ~3e-3 of a weight
/// after 6 steps, on one rank as on a mesh. From the same gradient every layout is one rank
/// bit for bit (`the_optimizer_from_the_same_gradient_is_bitwise_one_rank_on_every_layout`).
fn like_one_rank(dir: &Path, base: &[String], meshes: &[Mesh<'_>]) {
    let one = finished(dir, base, (1, 0, 4), "one", &[]);
    let accum = ["--set", "training.grad_accum_nums=2"];
    let again = finished(dir, base, (1, 0, 2), "one-accumulated", &accum);
    let (sw, sm) = spread(&again, &one);
    let losses_apart = |a: &Finished| {
        a.0.iter()
            .zip(&one.0)
            .map(|((_, x), (_, y))| (x - y).abs() / y.abs())
            .fold(0.0, f64::max)
    };
    let sl = losses_apart(&again);
    assert!(sw > 0.0, "the reordered sums change bits");
    println!("one rank against itself: weights {sw:.2e}, moments {sm:.2e}, losses {sl:.1e}");
    for (name, layout, extra) in meshes {
        let got = finished(dir, base, *layout, name, extra);
        let (w, m) = spread(&got, &one);
        let l = losses_apart(&got);
        println!("{name}: weights {w:.2e}, moments {m:.2e}, losses {l:.1e}");
        assert!(
            l < (3.0 * sl).max(1e-5),
            "{name}: losses {l:e} apart (one rank: {sl:e})"
        );
        assert!(
            w < 3.0 * sw,
            "{name}: weights differ by {w:e} (one rank: {sw:e})"
        );
        assert!(
            m < 3.0 * sm,
            "{name}: moments differ by {m:e} (one rank: {sm:e})"
        );
    }
}

/// [`like_one_rank`]: hybrid sharding (2 groups of 2 at stage 2) on 4 ranks, tensor
/// parallelism 2 on 2 ranks, and TP 2 × data 2 at stage 3 on 4.
#[test]
fn muon_on_other_meshes_trains_like_one_rank() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let base = muon_base(dir);
    let hybrid = ["--set", "system.shard_degree=2"];
    let tp = ["--set", "system.tensor_parallel=2"];
    like_one_rank(
        dir,
        &base,
        &[
            ("hybrid", (4, 2, 1), &hybrid[..]),
            ("tp2", (2, 0, 4), &tp[..]),
            ("tp2-dp2-s3", (4, 3, 2), &tp[..]),
        ],
    );
}

/// [`like_one_rank`] for a mixture of experts (Qwen3-MoE, 4 experts of width 32, top 2; the
/// load-balancing loss off, as it is a mean per micro-batch): each expert's matrices and the
/// router are Muon matrices; expert parallelism 2 at stages 0 and 3 on 2 ranks.
#[test]
fn muon_with_expert_parallelism_trains_like_one_rank() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let base = with(
        &muon_base(dir),
        &[],
        &[
            "--set",
            "model.architecture=qwen3_moe",
            "--set",
            "model.num_experts=4",
            "--set",
            "model.moe_intermediate_size=32",
            "--set",
            "model.router_aux_loss_coef=0",
        ],
    );
    let ep = ["--set", "system.expert_parallel=2"];
    like_one_rank(
        dir,
        &base,
        &[("ep2", (2, 0, 2), &ep[..]), ("ep2-s3", (2, 3, 2), &ep[..])],
    );
}

/// The layouts of the optimizer-level test: the mesh and how Muon's matrices are assembled.
#[derive(Clone, Copy, Debug)]
struct Layout {
    tp: usize,
    data: usize,
    stage: ZeroStage,
    /// `system.shard_degree` (0: all the data ranks).
    shard: usize,
    all_gather: bool,
}

const LR: f64 = 3e-3;
const STEPS: usize = 3;

fn model_shape() -> LlamaShape {
    LlamaShape {
        family: Default::default(),
        head_size: None,
        vocab_size: 256,
        hidden_size: 64,
        num_layers: 2,
        num_heads: 8,
        num_kv_heads: 4,
        intermediate_size: 176,
        max_position_embeddings: 64,
        rope_theta: 10000.0,
        rope_scaling: None,
        rms_norm_eps: 1e-5,
        tie_word_embeddings: false,
        init_std: 0.02,
        attention: AttentionBackend::Sdpa,
        moe: None,
    }
}

fn hyper(all_gather: bool) -> Hyper {
    common::muon_hyper(MuonAdjust::MatchRmsAdamw, all_gather)
}

/// Each parameter's gradient `g` (its part of it): d/dp Σ p·g = g exactly.
fn set_gradients(params: &[(String, Tensor)], g: impl Fn(&str) -> Tensor) {
    params
        .iter()
        .map(|(n, p)| (p * g(n)).sum(Kind::Float))
        .reduce(|a, b| a + b)
        .unwrap()
        .backward();
}

/// What a layout ends with: every parameter's whole value (on rank 0), and every rank's pieces
/// of the Muon momentum buffers: (parameter, elements of the whole, values).
type Ended = (
    Vec<(String, Plain)>,
    Vec<(String, std::ops::Range<usize>, Plain)>,
);

/// One rank: the optimizer stepped with the whole gradients.
fn one_rank_from(init: &[(String, Plain)], grads: &[Vec<(String, Plain)>]) -> Ended {
    let vs = VarStore::new(Device::Cpu);
    let full = |name: &str| init.iter().find(|(n, _)| n == name).unwrap().1.tensor();
    let mut make = |name: &str, _: &[i64], _: tch::nn::Init| full(name);
    let model = Llama::new_with(&vs.root(), &model_shape(), 64, Kind::Float, &mut make);
    let named = Llama::named_parameters(&vs);
    let mut pg = SingleProcess;
    let table = model.parameters();
    let mut opt = Optimizer::new(
        &named,
        table,
        hyper(false),
        ZeroStage::Replicated,
        &pg,
        25.0,
        Kind::Float,
    )
    .unwrap();
    for step in grads {
        let g = |name: &str| step.iter().find(|(n, _)| n == name).unwrap().1.tensor();
        set_gradients(&named, g);
        opt.step(LR, &mut pg).unwrap();
        opt.zero_grad();
    }
    ended(&opt, &named, &mut pg)
}

/// The parameters' whole values and the momentum pieces this rank writes (collectives).
fn ended(opt: &Optimizer, named: &[(String, Tensor)], pg: &mut dyn ProcessGroup) -> Ended {
    let values = opt
        .full_parameters(named, pg)
        .unwrap()
        .iter()
        .map(|(n, t)| (n.clone(), Plain::of(t)))
        .collect();
    let mut pieces = Vec::new();
    for piece in opt.state(pg).unwrap().moments {
        for (key, t) in &piece.moments {
            if *key == "momentum_buffer" {
                pieces.push((piece.name.clone(), piece.range.clone(), Plain::of(t)));
            }
        }
    }
    (values, pieces)
}

/// The layout on its ranks (threads joined by the TCP ring), each step's gradients reduced as
/// backward reduces them (a pass of the optimizer over the units in backward order, each
/// rank's parts of the same whole gradients, so that their mean is those gradients), then the
/// optimizer's step; what each rank ends with.
fn layout_from(c: Layout, init: &[(String, Plain)], grads: &[Vec<(String, Plain)>]) -> Vec<Ended> {
    let world = c.tp * c.data;
    each_rank(world, |pg| {
        let mesh = dist::Mesh::new(pg.rank(), world, c.tp, 1, c.shard);
        let groups = mesh.groups(&mut *pg).unwrap();
        let (t, size) = (mesh.tensor_rank(), c.tp);
        let stage3 = c.stage.shards_parameters();
        let full = |name: &str| init.iter().find(|(n, _)| n == name).unwrap().1.tensor();
        let mut make = |name: &str, _: &[i64], _: tch::nn::Init| match stage3 {
            true => Tensor::empty([0], (Kind::Float, Device::Cpu)),
            false => full(name),
        };
        let vs = VarStore::new(Device::Cpu);
        let model = match &groups.tensor {
            Some(tensor) => {
                let comm = GroupComm::new(tensor.clone()).unwrap();
                let tp = TensorParallel::new(t, size, false, Box::new(comm));
                let s = model_shape();
                Llama::new_split(&vs.root(), &s, 64, Kind::Float, tp, &mut make).unwrap()
            }
            None => Llama::new_with(&vs.root(), &model_shape(), 64, Kind::Float, &mut make),
        };
        let named = Llama::named_parameters(&vs);
        let table = model.parameters().clone();
        let part = |name: &str, whole: Tensor| table.split(name).unwrap().shard(&whole, t, size);
        let sharding = Sharding {
            stage: c.stage,
            hybrid: groups.hybrid.map(|(shard, replica, index)| Hybrid {
                shard,
                replica,
                index,
            }),
            reduce: Kind::Float,
            tensor: groups.tensor.clone().map(|tensor| TensorGroups {
                data: groups.data.clone().unwrap(),
                tensor,
                sequence_parallel: false,
                parameters: table.clone(),
            }),
        };
        let mut opt = Optimizer::with_sharding(
            &named,
            &table,
            hyper(c.all_gather),
            sharding,
            &*pg,
            25.0,
            Kind::Float,
        )
        .unwrap();
        if stage3 {
            for (n, _) in &named {
                opt.set_initial(n, &part(n, full(n))).unwrap();
            }
        }
        let units: Vec<GradUnit> = named
            .iter()
            .map(|(n, _)| table.get(n).unwrap().unit)
            .collect();
        let order = GradUnit::group_in_backward_order(&units);
        let sequence: Vec<GradUnit> = order.iter().map(|(u, _)| *u).collect();
        for step in grads {
            let g = |name: &str| {
                let whole = step.iter().find(|(n, _)| n == name).unwrap().1.tensor();
                part(name, whole)
            };
            opt.pass(&mut *pg, false, &sequence, true, |events| {
                for (unit, members) in &order {
                    events.before(*unit)?;
                    let mine: Vec<(String, Tensor)> = members
                        .iter()
                        .map(|&i| (named[i].0.clone(), named[i].1.shallow_clone()))
                        .collect();
                    set_gradients(&mine, g);
                    events.grads_final(*unit)?;
                    events.after(*unit)?;
                }
                Ok(())
            })
            .unwrap();
            opt.finish_reduction().unwrap();
            opt.step(LR, &mut *pg).unwrap();
            opt.zero_grad();
        }
        ended(&opt, &named, &mut *pg)
    })
}

/// The optimizer from the same gradients (each a bf16 value, so that the mean of 2 or 4 equal
/// copies is itself in any order of additions: every layout's averaged gradient is one rank's
/// bit for bit), 3 steps: at zero stages 0 to 3 on 2 data ranks, hybrid sharding (2 groups of
/// 2) at stage 2, tensor parallelism 2 alone and with 2 data ranks at stages 0, 2 and 3, each
/// with owners and some with the all-gather variant, every Muon matrix and every piece of its
/// momentum buffer is bitwise one rank's, and every other tensor (AdamW's) is within 1e-6
/// (libtorch's fused AdamW rounds a tensor's vectorised body and its tail apart, and a slice
/// moves where tails are). Between them these layouts move matrices at both levels: a
/// matrix straddling two slices, a rank of embeddings receiving matrices to share the work,
/// the parts of tensor-parallel matrices, results sent back to every replicated rank.
#[test]
fn the_optimizer_from_the_same_gradient_is_bitwise_one_rank_on_every_layout() {
    tch::set_num_threads(1);
    tch::manual_seed(5);
    let vs = VarStore::new(Device::Cpu);
    let model = Llama::new(&vs.root(), &model_shape(), 64, Kind::Float);
    let named = Llama::named_parameters(&vs);
    let init: Vec<(String, Plain)> = named
        .iter()
        .map(|(n, p)| (n.clone(), Plain::of(p)))
        .collect();
    let grads: Vec<Vec<(String, Plain)>> = (0..STEPS)
        .map(|_| {
            named
                .iter()
                .map(|(n, p)| {
                    let g = (p.randn_like() * 1e-2).to_kind(Kind::BFloat16);
                    (n.clone(), Plain::of(&g.to_kind(Kind::Float)))
                })
                .collect()
        })
        .collect();
    let (want, want_momentum) = one_rank_from(&init, &grads);
    let table = model.parameters();
    let momentum: HashMap<&str, Tensor> = want_momentum
        .iter()
        .map(|(n, _, t)| (n.as_str(), t.tensor().reshape(-1)))
        .collect();
    let layout = |tp, data, stage, shard, all_gather| Layout {
        tp,
        data,
        stage,
        shard,
        all_gather,
    };
    use ZeroStage::*;
    for c in [
        layout(1, 2, Replicated, 0, false),
        layout(1, 2, Optimizer, 0, false),
        layout(1, 2, Gradients, 0, false),
        layout(1, 2, Parameters, 0, false),
        layout(1, 2, Gradients, 0, true),
        layout(1, 4, Gradients, 2, false),
        layout(2, 1, Replicated, 0, false),
        layout(2, 2, Replicated, 0, true),
        layout(2, 2, Gradients, 0, false),
        layout(2, 2, Parameters, 0, false),
    ] {
        let ranks = layout_from(c, &init, &grads);
        let (values, _) = &ranks[0];
        for ((name, got), (_, w)) in values.iter().zip(&want) {
            let (got, w) = (got.tensor(), w.tensor());
            match Rule::of(table.get(name).unwrap(), true) {
                Rule::Muon => assert!(got.equal(&w), "{c:?}: {name} is not one rank's"),
                _ => {
                    let err = common::ranks::rel_tensor(&got, &w);
                    assert!(err < 1e-6, "{c:?}: {name} {err:e} from one rank's");
                }
            }
        }
        let mut covered: HashMap<&str, usize> = HashMap::new();
        for (name, range, t) in ranks.iter().flat_map(|(_, pieces)| pieces) {
            let want = momentum[name.as_str()].narrow(0, range.start as i64, range.len() as i64);
            assert!(
                t.tensor().reshape(-1).equal(&want),
                "{c:?}: {name} {range:?}"
            );
            *covered.entry(name.as_str()).or_default() += range.len();
        }
        for (name, m) in &momentum {
            assert_eq!(
                covered.get(name),
                Some(&(m.numel())),
                "{c:?}: {name} written once"
            );
        }
    }
}

/// A checkpoint of one optimizer resumes with the other only with `training.reset_optimizer`:
/// an AdamW checkpoint resumed with Muon exits 1 naming both and the key (nothing trained);
/// with the key its weights continue with a fresh Muon (said in the log, momentum buffers in
/// the next checkpoint, trainer.json naming muon). The reset happens once: that run's own
/// checkpoint resumes with its Muon state even with the key still set, so a run reset at step 3
/// and resumed at step 5 ends bitwise where one reset at step 3 and never stopped does. Back
/// from Muon to AdamW is refused the same way.
#[test]
fn the_other_optimizers_checkpoint_resumes_only_with_reset_optimizer() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let base = with(&small(&write_corpus(dir)), &["train"], &[]);
    let named = |name: &str, extra: &[&str]| {
        let n = format!("logging.run_name={name}");
        with(&base, &[], &[&["--set", n.as_str()][..], extra].concat())
    };
    ok(dir, &named("adamw", &["--max-steps", "3"]));
    let muon = ["--set", "training.optimizer=muon"];
    let reset = ["--set", "training.reset_optimizer=true"];
    // The same schedule as the run that never stops (its cosine ends at step 7).
    let resume = [&muon[..], &["--max-steps", "7", "--resume", "auto"]].concat();
    let text = fails(
        &common::run(dir, &named("adamw", &resume)),
        1,
        &[
            "the checkpoint's optimizer state is adamw's and training.optimizer = muon",
            "resume with training.optimizer=adamw, or set training.reset_optimizer=true",
        ],
    );
    assert!(!text.contains("Step [4/7]"), "{text}");
    let stop = ["--stop-at-step", "5"];
    let text = ok(
        dir,
        &named("adamw", &[&resume[..], &reset[..], &stop[..]].concat()),
    );
    assert!(
        text.contains(
            "training.reset_optimizer: the weights of step 3 with a fresh muon optimizer"
        ),
        "{text}"
    );
    let step5 = dir.join("runs/adamw/checkpoints/step_5");
    let state: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(step5.join("trainer.json")).unwrap())
            .unwrap();
    assert_eq!(state["optimizer"], "muon");
    let moments = MomentFiles::open(&step5).unwrap();
    let q = "model.layers.0.self_attn.q_proj.weight";
    assert_eq!(moments.keys(q), ["momentum_buffer"]);
    // Continued from its own Muon checkpoint, the key still set: no second reset.
    let text = ok(dir, &named("adamw", &[&resume[..], &reset[..]].concat()));
    assert!(!text.contains("training.reset_optimizer:"), "{text}");
    // Reset at step 3 and never stopped.
    let step3 = dir.join("runs/adamw/checkpoints/step_3");
    let from3 = [
        &muon[..],
        &reset[..],
        &["--max-steps", "7", "--resume", step3.to_str().unwrap()],
    ]
    .concat();
    ok(dir, &named("straight", &from3));
    let (a, b) = (
        common::checkpoint_weights(&dir.join("runs/adamw/checkpoints/step_7")),
        common::checkpoint_weights(&dir.join("runs/straight/checkpoints/step_7")),
    );
    assert!(bitwise(&a, &b), "resumed at 5: {:e}", worst(&a, &b));
    // Back to AdamW.
    fails(
        &common::run(
            dir,
            &named("adamw", &["--max-steps", "8", "--resume", "auto"]),
        ),
        1,
        &["the checkpoint's optimizer state is muon's and training.optimizer = adamw"],
    );
}

/// Bad Muon settings exit 2 before anything is made, naming the key, the value and what is
/// valid; `plan` refuses them alike.
#[test]
fn bad_muon_settings_exit_2_naming_the_key_and_the_valid_values() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let base = small(&write_corpus(dir));
    for (set, says) in [
        (
            "training.optimizer=sgd",
            "--set training.optimizer=sgd: expected one of adamw | muon",
        ),
        (
            "training.muon_ns_steps=0",
            "--set training.muon_ns_steps=0: expected integer >= 1",
        ),
        (
            "training.muon_ns_steps=100",
            "training.muon_ns_steps = 100: must be 1 to 99",
        ),
        (
            "training.muon_adjust_lr=rms",
            "--set training.muon_adjust_lr=rms: expected one of match_rms_adamw | original",
        ),
        (
            "training.muon_momentum=1",
            "training.muon_momentum = 1: must be in [0, 1)",
        ),
    ] {
        for command in ["train", "plan"] {
            fails(
                &common::run(dir, &with(&base, &[command], &["--set", set])),
                2,
                &[says],
            );
        }
        assert!(
            !dir.join("runs").exists(),
            "{set}: a run directory was made"
        );
    }
}

/// `memory line`'s value in GB after `what` (`moments `).
fn gb_after(line: &str, what: &str) -> f64 {
    let at = line.find(what).unwrap() + what.len();
    line[at..].split(' ').next().unwrap().parse().unwrap()
}

/// Muon keeps one fp32 momentum buffer per element of the decoder layers' matrices where AdamW
/// keeps two moments: on one rank the trainer's memory line (its optimizer's buffers, 3
/// decimals of GB) says AdamW's moments × (8·A + 4·M) / (8·P) for M matrix elements of P (A =
/// P − M), `lockstep plan` estimates the same, and the checkpoint's optimizer file shrinks
/// likewise (its header aside).
#[test]
fn muon_keeps_one_momentum_buffer_per_matrix_element_as_plan_counts() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    // Matrices most of the model: hidden 512, FFN 1376, the tests' 512 ids.
    let base = with(
        &small(&write_corpus(dir)),
        &[],
        &[
            "--max-steps",
            "2",
            "--set",
            "model.hidden_size=512",
            "--set",
            "model.intermediate_size=1376",
            "--set",
            "logging.memory_interval=1",
        ],
    );
    let memory = |name: &str, extra: &[&str]| -> f64 {
        let n = format!("logging.run_name={name}");
        let out = ok(
            dir,
            &with(
                &base,
                &["train"],
                &[&["--set", n.as_str()][..], extra].concat(),
            ),
        );
        let line = out
            .lines()
            .rev()
            .find(|l| l.contains("Memory |"))
            .unwrap_or_else(|| panic!("no memory line:\n{out}"))
            .to_string();
        gb_after(&line, "moments ")
    };
    let muon = ["--set", "training.optimizer=muon"];
    let (adamw_gb, muon_gb) = (memory("adamw", &[]), memory("muon", &muon));
    let weights = common::checkpoint_weights(&dir.join("runs/muon/checkpoints/step_2"));
    let p: f64 = weights.values().map(|t| t.numel() as f64).sum();
    let m: f64 = weights
        .iter()
        .filter(|(n, t)| n.starts_with("model.layers.") && t.dim() == 2)
        .map(|(_, t)| t.numel() as f64)
        .sum();
    assert!(m > 0.9 * p, "{m} of {p}");
    let want = adamw_gb * (8.0 * (p - m) + 4.0 * m) / (8.0 * p);
    assert!(
        (muon_gb - want).abs() <= 0.0015,
        "{muon_gb} GB vs {want} GB"
    );
    let plan: serde_json::Value = serde_json::from_str(&ok(
        dir,
        &with(&base, &["plan", "--json", "--device", "cpu"], &muon),
    ))
    .unwrap();
    let planned = plan["configured"]["memory"]["moments"].as_f64().unwrap() / 1e9;
    assert!(
        (planned - muon_gb).abs() <= 0.0006,
        "plan {planned} GB, run {muon_gb} GB"
    );
    assert!(
        plan["muon"]["total_flops"].as_f64().unwrap() > 0.0,
        "{plan}"
    );
    let text = ok(dir, &with(&base, &["plan", "--device", "cpu"], &muon));
    assert!(
        text.contains("\nMuon: the decoder layers' matrices (")
            && text.contains("Muon's momentum buffer: "),
        "{text}"
    );
    let file = |run: &str| {
        let f = dir
            .join("runs")
            .join(run)
            .join("checkpoints/step_2/optimizer.safetensors");
        std::fs::metadata(f).unwrap().len() as f64
    };
    let ratio = file("muon") / file("adamw");
    let want = (8.0 * (p - m) + 4.0 * m) / (8.0 * p);
    assert!(
        (ratio - want).abs() < 0.01,
        "optimizer files {ratio} vs {want}"
    );
}
