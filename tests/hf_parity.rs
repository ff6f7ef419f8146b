//! lockstep's Llama, Qwen3, Qwen3-MoE and Mixtral against transformers' LlamaForCausalLM,
//! Qwen3ForCausalLM, Qwen3MoeForCausalLM and MixtralForCausalLM on the same weights and batch:
//! loss, every gradient norm, and parameters after 3 AdamW steps with clipping, within 1e-5
//! relative; for the mixtures of experts also the router's choices and the load-balancing
//! loss (transformers' `aux_loss`), which the objective adds.
//! The model runs as training runs it by default: the LM head + cross-entropy in chunks (here
//! of 40 tokens, so the 3 × 32-token batch spans three, one of them partial), and the
//! training steps with full activation checkpointing.

use crate::common;

use common::rel;

use std::collections::HashMap;
use std::path::Path;

use lockstep::config::MuonAdjust;
use lockstep::config::{self, Sources};
use lockstep::dist::SingleProcess;
use lockstep::model::{
    hf, ActivationCheckpointing, ActivationMemory, AttentionBackend, Family, Llama,
};
use lockstep::tensor_io::{self, SafeFile};
use lockstep::train::guard::Guard;
use lockstep::train::optim::{AdamWParams, Optimizer, Rule};
use lockstep::train::{train_step, Batch, StepConfig, StepOutcome, StepPlan};
use tch::nn::VarStore;
use tch::{Device, Kind, Tensor};

fn load_model(dir: &Path, backend: AttentionBackend, layers: usize) -> (VarStore, Llama) {
    let mut m = config::resolve(&Sources::default()).unwrap().config.model;
    m.num_layers = layers;
    m.attention_backend = backend;
    let shape = hf::shape_from_dir(&dir.join("model"), &m).unwrap();
    assert_eq!(
        (shape.num_heads, shape.num_kv_heads),
        (8, 2),
        "the reference uses GQA"
    );
    let vs = VarStore::new(Device::Cpu);
    let mut model = Llama::new(&vs.root(), &shape, 64, Kind::Float);
    model.set_activation_memory(ActivationMemory {
        checkpointing: ActivationCheckpointing::Full,
        loss_chunk_tokens: 40,
    });
    hf::load_weights(&dir.join("model"), &vs).unwrap();
    (vs, model)
}

fn batch(dir: &Path) -> (Tensor, Tensor) {
    let tokens = SafeFile::open(&dir.join("batch.safetensors"))
        .unwrap()
        .tensor("tokens")
        .unwrap();
    let t = tokens.size()[1];
    (tokens.narrow(1, 0, t - 1), tokens.narrow(1, 1, t - 1))
}

fn check_against_reference(tied: bool, llama3_rope: bool, family: Family) {
    tch::set_num_threads(1);
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let mut args = vec![dir.to_str().unwrap()];
    if tied {
        args.push("--tied");
    }
    if llama3_rope {
        args.push("--llama3-rope");
    }
    args.extend(match family {
        Family::Llama => None,
        Family::Qwen3 => Some("--qwen3"),
        Family::Qwen3Moe => Some("--qwen3-moe"),
        Family::Mixtral => Some("--mixtral"),
    });
    let layers = if family == Family::Qwen3Moe { 3 } else { 2 };
    common::run_python("tests/reference/hf_llama.py", &args);
    let reference: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap())
            .unwrap();
    let (x, y) = batch(dir);

    let (vs, model) = load_model(dir, AttentionBackend::Sdpa, layers);
    assert_eq!(model.shape.family, family, "config.json's model_type read");
    if family.qk_norm() {
        assert_eq!(
            model.shape.head_dim(),
            16,
            "head_dim apart from hidden / heads"
        );
    }
    let objective = model.objective(&x, &y);
    let loss = &objective.cross_entropy;
    let want = reference["loss"].as_f64().unwrap();
    assert!(
        rel(loss.double_value(&[]), want) < 1e-5,
        "loss {} vs transformers {want}",
        loss.double_value(&[])
    );
    assert!(want > 5.0, "a random model's loss is near ln(vocab)");
    if family.is_moe() {
        check_routing(&model, &objective, &reference, &x);
    }
    objective.total().backward();
    let grad_norms = reference["grad_norms"].as_object().unwrap();
    let params = Llama::named_parameters(&vs);
    assert_eq!(
        params.len(),
        grad_norms.len(),
        "same parameter set as transformers"
    );
    for (name, p) in &params {
        let got = p.grad().norm().double_value(&[]);
        let want = grad_norms[name]
            .as_f64()
            .unwrap_or_else(|| panic!("transformers has no {name}"));
        assert!(
            rel(got, want) < 1e-5,
            "{name}: grad norm {got} vs transformers {want}"
        );
    }

    if llama3_rope {
        // The scaling is read and it matters: the same weights with plain RoPE differ.
        let mut m = config::resolve(&Sources::default()).unwrap().config.model;
        m.num_layers = 2;
        let mut shape = hf::shape_from_dir(&dir.join("model"), &m).unwrap();
        assert_eq!(shape.rope_scaling.map(|s| s.factor), Some(8.0));
        shape.rope_scaling = None;
        let vs_plain = VarStore::new(Device::Cpu);
        let plain = Llama::new(&vs_plain.root(), &shape, 64, Kind::Float);
        hf::load_weights(&dir.join("model"), &vs_plain).unwrap();
        let plain_loss = plain.loss(&x, &y).double_value(&[]);
        assert!(
            rel(plain_loss, want) > 1e-5,
            "plain RoPE should not match: {plain_loss} vs {want}"
        );
    }

    // The math backend is the same function.
    let (_, math) = load_model(dir, AttentionBackend::Math, layers);
    assert!(rel(math.loss(&x, &y).double_value(&[]), want) < 1e-5);

    let before: HashMap<String, Tensor> = params
        .iter()
        .map(|(n, p)| (n.clone(), p.detach().copy()))
        .collect();
    let hp = AdamWParams {
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
    };
    let mut opt = Optimizer::new(
        &params,
        model.parameters(),
        hp.into(),
        lockstep::config::ZeroStage::Replicated,
        &SingleProcess,
        25.0,
        Kind::Float,
    )
    .unwrap();
    opt.zero_grad();
    // The trainer's own step: forward/backward, norm, guard, clip(1.0), fused AdamW.
    three_steps(&model, &mut opt, (&x, &y), |step, out| {
        assert!(out.event.is_none(), "the guard lets a finite step through");
        if family.is_moe() {
            // The training pass's load-balancing loss, logged: the first step's weights are
            // the reference's.
            let log = model.take_router_log();
            assert_eq!(log.micro_batches, 1);
            if step == 0 {
                let want = reference["aux_loss"].as_f64().unwrap();
                assert!(rel(log.aux(), want) < 1e-5, "aux {} vs {want}", log.aux());
            }
        }
        let want_l = reference["step_losses"][step].as_f64().unwrap();
        let want_n = reference["step_grad_norms"][step].as_f64().unwrap();
        assert!(rel(out.loss, want_l) < 1e-5, "step {step} loss");
        assert!(
            rel(out.grad_norm, want_n) < 1e-5,
            "step {step} grad norm {} vs {want_n}",
            out.grad_norm
        );
    });
    let after: HashMap<String, Tensor> = tensor_io::load_all(&dir.join("after.safetensors"))
        .unwrap()
        .into_iter()
        .collect();
    for (name, p) in &params {
        let want = &after[name];
        let diff = p - want;
        let err = diff.norm().double_value(&[]) / want.norm().double_value(&[]);
        let moved = (p - &before[name]).norm().double_value(&[]) / want.norm().double_value(&[]);
        // Per-tensor L2: Adam's m/(sqrt(v)+eps) amplifies rounding in near-zero gradient
        // elements, so single elements are ill-conditioned while the update as a whole is not.
        assert!(
            err < 1e-5,
            "{name}: parameters after 3 AdamW steps differ by {err:e} (relative, L2)"
        );
        assert!(
            moved > 1e-3,
            "{name}: 3 AdamW steps at lr 1e-3 should move the tensor, moved {moved:e}"
        );
    }
}

/// The trainer's own step 3 times on the batch `(x, y)` at lr 1e-3, clipping at 1.0 (forward
/// and backward, the norm, the guard, the clip, the update), `each(step, outcome)` after each.
fn three_steps(
    model: &Llama,
    opt: &mut Optimizer,
    (x, y): (&Tensor, &Tensor),
    mut each: impl FnMut(usize, &StepOutcome),
) {
    let mut guard = Guard::new(
        &config::resolve(&Sources::default())
            .unwrap()
            .config
            .training,
    );
    let step_cfg = StepConfig {
        grad_accum: 1,
        max_grad_norm: 1.0,
        overlap: false,
    };
    let plan = StepPlan {
        lr: 1e-3,
        ..Default::default()
    };
    for step in 0..3 {
        let batch = std::iter::once(Batch::new(x.shallow_clone(), y.shallow_clone()));
        let out = train_step(
            model,
            opt,
            &mut SingleProcess,
            &mut guard,
            &step_cfg,
            &plan,
            batch,
        )
        .unwrap();
        each(step, &out);
    }
}

/// Relative L2 distance of `a` from `b`.
fn rel_l2(a: &Tensor, b: &Tensor) -> f64 {
    (a - b).norm().double_value(&[]) / b.norm().double_value(&[]).max(1e-30)
}

/// Muon (`training.optimizer = muon`, replicated on one rank) against torch.optim.Muon on the
/// decoder layers' matrices (each expert's matrices with torch's own update function) and
/// torch.optim.AdamW on the rest, from the same Hugging Face weights and batch, `adjust` as
/// given:
/// - the optimizer given torch's clipped gradients of each of 3 steps: every Muon matrix and
///   its momentum buffer bitwise torch's, every AdamW tensor within 1e-6 (fused AdamW against
///   torch's single-tensor loop);
/// - the trainer's own step 3 times (forward, backward, norm, clipping, update): losses within
///   1e-5, gradient norms within 1e-5 before the first update and 1e-4 after it (measured:
///   2.4e-5). Its weights are not compared: Newton–Schulz runs in bf16 on an
///   update it first rounds to bf16, so gradients that differ in their last fp32 bits (lockstep's
///   forward and backward are not transformers') cross a few bf16 rounding boundaries, and the
///   bf16 iteration spreads each crossing over its matrix. torch against itself with its
///   gradients scaled by 1 + 1e-6·N(0, 1) differs by as much (`benches/muon_spread.py`,
///   BENCHMARKS.md §22): 0.55–0.6% in a matrix's 3-step change, 2.7–3.2% in the square
///   o_proj, against lockstep's 0.57–0.87% and 2.9–3.9%.
fn check_muon_against_reference(family: Family, adjust: MuonAdjust) {
    tch::set_num_threads(1);
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let mut args = vec![dir.to_str().unwrap()];
    args.extend(match family {
        Family::Qwen3Moe => Some("--qwen3-moe"),
        Family::Mixtral => Some("--mixtral"),
        _ => None,
    });
    args.extend(["--muon", adjust.name()]);
    common::run_python("tests/reference/hf_llama.py", &args);
    let reference: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap())
            .unwrap();
    let load = |f: &str| -> HashMap<String, Tensor> {
        tensor_io::load_all(&dir.join(f))
            .unwrap()
            .into_iter()
            .collect()
    };
    let (after, momentum) = (load("after.safetensors"), load("momentum.safetensors"));
    let layers = if family == Family::Qwen3Moe { 3 } else { 2 };
    let hp = common::muon_hyper(adjust, false);
    let optimizer = |model: &Llama, params: &[(String, Tensor)]| {
        Optimizer::new(
            params,
            model.parameters(),
            hp,
            lockstep::config::ZeroStage::Replicated,
            &SingleProcess,
            25.0,
            Kind::Float,
        )
        .unwrap()
    };

    // The optimizer from torch's gradients.
    let (vs, model) = load_model(dir, AttentionBackend::Sdpa, layers);
    let params = Llama::named_parameters(&vs);
    let mut opt = optimizer(&model, &params);
    for step in 0..3 {
        let grads = load(&format!("grads{step}.safetensors"));
        // d/dp Σ p·g = g, exactly.
        let seed = params
            .iter()
            .map(|(n, p)| (p * &grads[n]).sum(Kind::Float))
            .reduce(|a, b| a + b)
            .unwrap();
        seed.backward();
        opt.step(1e-3, &mut SingleProcess).unwrap();
        opt.zero_grad();
    }
    let table = model.parameters();
    let mut matrices = 0;
    for (name, p) in &params {
        let muon = Rule::of(table.get(name).unwrap(), true) == Rule::Muon;
        assert_eq!(
            muon,
            momentum.contains_key(name),
            "{name}: Muon's in both or neither"
        );
        if muon {
            assert!(
                p.equal(&after[name]),
                "{name}: not bitwise torch's after 3 Muon steps"
            );
            matrices += 1;
        } else {
            let err = rel_l2(p, &after[name]);
            assert!(
                err < 1e-6,
                "{name}: {err:e} from torch's after 3 AdamW steps"
            );
        }
    }
    assert_eq!(matrices, momentum.len(), "every Muon matrix compared");
    let state = opt.state(&mut SingleProcess).unwrap();
    let mut buffers = 0;
    for piece in &state.moments {
        for (key, t) in &piece.moments {
            if *key == lockstep::train::optim::state::MOMENTUM {
                let want = &momentum[&piece.name];
                assert!(
                    t.view_as(want).equal(want),
                    "{}: momentum buffer",
                    piece.name
                );
                buffers += 1;
            }
        }
    }
    assert_eq!(buffers, momentum.len(), "every momentum buffer compared");

    // The trainer's step.
    let (vs, model) = load_model(dir, AttentionBackend::Sdpa, layers);
    let params = Llama::named_parameters(&vs);
    let mut opt = optimizer(&model, &params);
    let (x, y) = batch(dir);
    three_steps(&model, &mut opt, (&x, &y), |step, out| {
        let want_l = reference["step_losses"][step].as_f64().unwrap();
        let want_n = reference["step_grad_norms"][step].as_f64().unwrap();
        assert!(
            rel(out.loss, want_l) < 1e-5,
            "step {step} loss {} vs {want_l}",
            out.loss
        );
        let bound = if step == 0 { 1e-5 } else { 1e-4 };
        assert!(
            rel(out.grad_norm, want_n) < bound,
            "step {step} grad norm {} vs {want_n}",
            out.grad_norm
        );
    });
}

/// Muon's arithmetic (`train::optim::muon`: the momentum, Nesterov, Newton–Schulz through
/// csrc/muon.cpp, the decay and the adjusted step) against torch.optim.Muon on the same
/// matrices and gradients, 2 steps, a tall and a wide matrix, both adjust modes: bitwise (the
/// same libtorch kernels in the same order), the first step's bf16 Newton–Schulz result too.
#[test]
fn muon_is_bitwise_torch_from_the_same_update() {
    use lockstep::train::optim::muon;
    tch::set_num_threads(1);
    for adjust in [MuonAdjust::Original, MuonAdjust::MatchRmsAdamw] {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        common::run_python(
            "tests/reference/muon_step.py",
            &[dir.to_str().unwrap(), adjust.name()],
        );
        let t: HashMap<String, Tensor> = tensor_io::load_all(&dir.join("muon.safetensors"))
            .unwrap()
            .into_iter()
            .collect();
        let hp = common::muon_hyper(adjust, false).muon.unwrap();
        for name in ["tall", "wide"] {
            let p = t[&format!("{name}.before")].copy();
            let buffer = p.zeros_like();
            let shape = p.size();
            for step in 0..2 {
                let g = &t[&format!("{name}.grad{step}")];
                let update = muon::nesterov(&buffer, Some(g), hp.momentum);
                let o = muon::newton_schulz(&update, hp.ns_steps).unwrap();
                if step == 0 {
                    assert!(o.equal(&t[&format!("{name}.ns0")]), "{name}: Newton-Schulz");
                }
                let adjusted = hp.adjusted_lr(1e-2, [shape[0], shape[1]]);
                muon::apply(&p, &o, 1e-2, adjusted, &hp).unwrap();
            }
            assert!(
                buffer.equal(&t[&format!("{name}.momentum")]),
                "{name}: buffer"
            );
            assert!(
                p.equal(&t[&format!("{name}.after")]),
                "{name} {adjust}: weights"
            );
        }
    }
}

#[test]
fn muon_matches_torch_with_match_rms_adamw() {
    check_muon_against_reference(Family::Llama, MuonAdjust::MatchRmsAdamw);
}

#[test]
fn muon_matches_torch_with_the_original_adjustment() {
    check_muon_against_reference(Family::Llama, MuonAdjust::Original);
}

/// Each expert's matrices (and the router) on their own, against torch's update function on
/// the views of transformers' fused expert tensors.
#[test]
fn muon_matches_torch_on_a_mixture_of_experts() {
    check_muon_against_reference(Family::Qwen3Moe, MuonAdjust::MatchRmsAdamw);
}

/// The router's top-k experts per token of every MoE layer, and the load-balancing loss,
/// against transformers'.
fn check_routing(
    model: &Llama,
    objective: &lockstep::model::Objective,
    reference: &serde_json::Value,
    x: &Tensor,
) {
    let want = reference["aux_loss"].as_f64().unwrap();
    let aux = objective.aux.as_ref().expect("a MoE model's aux loss");
    assert!(
        rel(aux.double_value(&[]), want) < 1e-5,
        "aux_loss {} vs transformers {want}",
        aux.double_value(&[])
    );
    let choices = model.router_choices(x);
    let layers = reference["choices"].as_object().unwrap();
    assert_eq!(choices.len(), layers.len(), "the same MoE layers");
    for (layer, got) in &choices {
        let want: Vec<Vec<i64>> = serde_json::from_value(layers[&layer.to_string()].clone())
            .unwrap_or_else(|_| panic!("transformers routes layer {layer}"));
        let got: Vec<Vec<i64>> = Vec::<Vec<i64>>::try_from(got).unwrap();
        assert_eq!(got, want, "layer {layer}: the experts of each token");
    }
}

#[test]
fn untied_llama_matches_transformers() {
    check_against_reference(false, false, Family::Llama);
}

#[test]
fn tied_llama_matches_transformers() {
    check_against_reference(true, false, Family::Llama);
}

#[test]
fn llama3_rope_scaling_matches_transformers() {
    check_against_reference(false, true, Family::Llama);
}

/// Qwen3: q_norm/k_norm before RoPE and a head_dim of 16 where hidden / heads is 8, tied as
/// the small Qwen3 models are.
#[test]
fn tied_qwen3_matches_transformers() {
    check_against_reference(true, false, Family::Qwen3);
}

/// Qwen3-MoE: 3 layers, the middle one dense (`mlp_only_layers`), the others 8 experts of
/// width 32 with top-2 routing renormalised; untied.
#[test]
fn qwen3_moe_matches_transformers() {
    check_against_reference(false, false, Family::Qwen3Moe);
}

/// Mixtral: 2 layers of 4 experts, top 2, Llama's attention.
#[test]
fn mixtral_matches_transformers() {
    check_against_reference(false, false, Family::Mixtral);
}
