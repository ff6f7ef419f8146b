//! The training pass with activation checkpointing and the chunked LM head against a plain
//! forward + one whole backward: the same loss and gradients — bitwise across checkpointing
//! modes (the recomputation is deterministic on CPU), within 1e-6 for chunking — for fp32 and
//! bf16 compute, grouped-query attention, tied and untied embeddings, and with gradient
//! accumulation. Also the order in which units' gradients become final.

use lockstep::config::{self, Sources};
use lockstep::model::{ActivationCheckpointing, ActivationMemory, GradUnit, Llama, UnitEvents};
use tch::nn::VarStore;
use tch::{Device, Kind, Reduction, Tensor};

const MODES: [ActivationCheckpointing; 3] = [
    ActivationCheckpointing::None,
    ActivationCheckpointing::Full,
    ActivationCheckpointing::Selective,
];

/// A 3-layer GQA model (8 query heads over 2 kv heads) with a small vocabulary.
fn model(tied: bool, compute: Kind) -> (VarStore, Llama) {
    let mut m = config::resolve(&Sources::default()).unwrap().config.model;
    m.num_layers = 3;
    m.hidden_size = 64;
    m.num_attention_heads = 8;
    m.num_key_value_heads = 2;
    m.intermediate_size = 160;
    m.tie_word_embeddings = tied;
    m.rope_theta = 10000.0;
    let shape = lockstep::model::LlamaShape::from_config(&m, 300).unwrap();
    tch::manual_seed(7);
    let vs = VarStore::new(Device::Cpu);
    let model = Llama::new(&vs.root(), &shape, 64, compute);
    // Norm weights start at 1; make them differ so their gradients are not degenerate.
    let mut params: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    params.sort_by(|a, b| a.0.cmp(&b.0)); // a fixed order of random draws
    tch::no_grad(|| {
        for (name, p) in params {
            if name.contains("norm") {
                p.shallow_clone().copy_(&(p.rand_like() + 0.5));
            }
        }
    });
    (vs, model)
}

fn batch(seed: i64) -> (Tensor, Tensor) {
    tch::manual_seed(seed);
    let tokens = Tensor::randint(300, [3, 33], (Kind::Int64, Device::Cpu));
    (tokens.narrow(1, 0, 32), tokens.narrow(1, 1, 32))
}

/// Every gradient, by name, after `f` ran a backward; the gradients are then cleared.
fn grads(vs: &VarStore, f: impl FnOnce() -> f64) -> (f64, Vec<(String, Tensor)>) {
    for (_, mut p) in vs.variables() {
        p.zero_grad();
    }
    let loss = f();
    let mut g: Vec<(String, Tensor)> = vs
        .variables()
        .into_iter()
        .map(|(n, p)| (n, p.grad().copy()))
        .collect();
    g.sort_by(|a, b| a.0.cmp(&b.0));
    for (_, p) in vs.variables() {
        let mut g = p.grad();
        if g.defined() {
            let _ = g.zero_();
        }
    }
    (loss, g)
}

/// Today's training pass: full logits, mean cross-entropy, one backward per micro-batch.
fn reference(model: &Llama, batches: &[(Tensor, Tensor)]) -> f64 {
    let mut total = 0.0;
    for (x, y) in batches {
        let logits = model.forward(x);
        let v = logits.size()[2];
        let loss = logits
            .view([-1, v])
            .to_kind(Kind::Float)
            .cross_entropy_loss::<Tensor>(&y.reshape([-1]), None, Reduction::Mean, -100, 0.0);
        (&loss / batches.len() as f64).backward();
        total += loss.double_value(&[]);
    }
    total / batches.len() as f64
}

fn pass(model: &Llama, batches: &[(Tensor, Tensor)]) -> f64 {
    let scale = 1.0 / batches.len() as f64;
    let mut total = 0.0;
    for (x, y) in batches {
        let loss = model
            .forward_backward(x, y, None, scale, &mut lockstep::model::NoEvents)
            .unwrap();
        total += loss.double_value(&[]);
    }
    total / batches.len() as f64
}

/// Largest relative L2 difference over the gradients, leaving out `except`.
fn max_rel(a: &[(String, Tensor)], b: &[(String, Tensor)], except: Option<&str>) -> (f64, String) {
    a.iter()
        .zip(b)
        .filter(|((name, _), _)| Some(name.as_str()) != except)
        .map(|((name, x), (_, y))| {
            let d = (x - y).norm().double_value(&[]) / y.norm().double_value(&[]).max(1e-30);
            (d, name.clone())
        })
        .fold((0.0, String::new()), |m, x| if x.0 > m.0 { x } else { m })
}

fn assert_bitwise(a: &[(String, Tensor)], b: &[(String, Tensor)], what: &str) {
    assert_eq!(a.len(), b.len());
    for ((name, x), (_, y)) in a.iter().zip(b) {
        assert!(x.equal(y), "{what}: {name} differs");
    }
}

/// The tests of this file run one at a time: they set libtorch's (process-wide) thread count,
/// which changes the summation order, and bf16 results with it, under a neighbour's feet.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn check(tied: bool, compute: Kind) {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    tch::set_num_threads(1);
    let (vs, mut model) = model(tied, compute);
    let batches = [batch(1), batch(2)];
    let (ref_loss, ref_grads) = grads(&vs, || reference(&model, &batches));
    for chunk in [0usize, 29] {
        let mut by_mode = Vec::new();
        for mode in MODES {
            model.set_activation_memory(ActivationMemory {
                checkpointing: mode,
                loss_chunk_tokens: chunk,
            });
            by_mode.push((mode, grads(&vs, || pass(&model, &batches))));
        }
        let (_, (none_loss, none_grads)) = &by_mode[0];
        for (mode, (loss, g)) in &by_mode[1..] {
            assert_eq!(loss, none_loss, "{mode} chunk {chunk}: loss");
            assert_bitwise(g, none_grads, &format!("{mode} vs none, chunk {chunk}"));
        }
        let loss_err = (none_loss - ref_loss).abs() / ref_loss;
        assert!(
            loss_err < 1e-6,
            "chunk {chunk}: loss {none_loss} vs {ref_loss}"
        );
        // With bf16 matmuls the LM head's weight gradient is rounded to bf16 once per chunk
        // instead of once per micro-batch, and the logits' gradient (computed in fp32 by the
        // fused cross-entropy instead of autograd's log-softmax, ~1e-7 apart) may round to a
        // neighbouring bf16 value: that one tensor differs at bf16 resolution (~4e-3 relative
        // per element); every other gradient stays within 1e-6.
        let head = if tied {
            "model.embed_tokens.weight"
        } else {
            "lm_head.weight"
        };
        let bf16_chunked = compute == Kind::BFloat16;
        let (grad_err, worst) = max_rel(none_grads, &ref_grads, bf16_chunked.then_some(head));
        eprintln!(
            "tied {tied} {compute:?} chunk {chunk}: loss rel diff {loss_err:e}, worst grad rel diff {grad_err:e} ({worst})"
        );
        assert!(
            grad_err < 1e-6,
            "chunk {chunk}: {worst} differs from the plain backward by {grad_err:e}"
        );
        if bf16_chunked {
            let (head_err, _) = max_rel(
                &none_grads
                    .iter()
                    .filter(|(n, _)| n == head)
                    .map(|(n, t)| (n.clone(), t.shallow_clone()))
                    .collect::<Vec<_>>(),
                &ref_grads
                    .iter()
                    .filter(|(n, _)| n == head)
                    .map(|(n, t)| (n.clone(), t.shallow_clone()))
                    .collect::<Vec<_>>(),
                None,
            );
            eprintln!("  {head}: rel diff {head_err:e}");
            assert!(head_err < 1e-2, "{head}: {head_err:e}");
        }
    }
}

#[test]
fn fp32_untied_gradients_match_in_every_mode() {
    check(false, Kind::Float);
}

#[test]
fn fp32_tied_gradients_match_in_every_mode() {
    check(true, Kind::Float);
}

#[test]
fn bf16_untied_gradients_match_in_every_mode() {
    check(false, Kind::BFloat16);
}

#[test]
fn bf16_tied_gradients_match_in_every_mode() {
    check(true, Kind::BFloat16);
}

/// Records what a pass tells its caller, checking on the way that a unit's gradients exist
/// when it is reported final and that every `after` closes an open `before`.
struct Seen<'a> {
    vs: &'a VarStore,
    table: &'a lockstep::model::Parameters,
    finals: Vec<GradUnit>,
    befores: Vec<GradUnit>,
    open: Vec<GradUnit>,
}

impl UnitEvents for Seen<'_> {
    fn before(&mut self, unit: GradUnit) -> anyhow::Result<()> {
        self.befores.push(unit);
        self.open.push(unit);
        Ok(())
    }

    fn after(&mut self, unit: GradUnit) -> anyhow::Result<()> {
        let at = self.open.iter().position(|u| *u == unit);
        assert!(at.is_some(), "after({unit:?}) without before");
        self.open.remove(at.unwrap());
        Ok(())
    }

    fn grads_final(&mut self, unit: GradUnit) -> anyhow::Result<()> {
        assert!(self.open.contains(&unit), "{unit:?} final outside its use");
        for (n, t) in self.vs.variables() {
            if self.table.unit(&n).unwrap() == unit {
                assert!(t.grad().defined(), "{unit:?}: {n}");
            }
        }
        self.finals.push(unit);
        Ok(())
    }
}

#[test]
fn units_become_final_from_the_head_down_to_the_embedding() {
    for tied in [false, true] {
        let (vs, mut model) = model(tied, Kind::Float);
        model.set_activation_memory(ActivationMemory {
            checkpointing: ActivationCheckpointing::Full,
            loss_chunk_tokens: 16,
        });
        let (x, y) = batch(3);
        let mut seen = Seen {
            vs: &vs,
            table: model.parameters(),
            finals: Vec::new(),
            befores: Vec::new(),
            open: Vec::new(),
        };
        let _loss = model
            .forward_backward(&x, &y, None, 1.0, &mut seen)
            .unwrap();
        let mut want = vec![GradUnit::FinalNorm];
        if !tied {
            want.insert(0, GradUnit::LmHead);
        }
        want.extend((0..3).rev().map(GradUnit::Layer));
        want.push(GradUnit::Embedding);
        assert_eq!(seen.finals, want, "tied {tied}");
        // The uses come in the order the stage-3 gathers are planned in, and all are closed.
        assert_eq!(seen.befores, model.unit_order(true), "tied {tied}");
        assert!(seen.open.is_empty(), "{:?}", seen.open);
        let head = if tied {
            GradUnit::Embedding
        } else {
            GradUnit::LmHead
        };
        assert_eq!(seen.befores[5], head);
    }
}

/// A mixture of experts (Qwen3-MoE: layers 0 and 2 of 4 experts, top 2, layer 1 dense) with
/// the load-balancing and z-losses: every checkpointing mode gives bitwise the same loss and
/// gradients (the MoE half is recomputed in `full` and `selective`, its routing with it), and
/// those of one autograd backward through the whole objective within 1e-6; the losses the
/// pass logs are the objective's.
#[test]
fn moe_gradients_match_in_every_mode_with_the_router_losses() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    tch::set_num_threads(1);
    let mut m = config::resolve(&Sources::default()).unwrap().config.model;
    m.architecture = lockstep::config::Architecture::Qwen3Moe;
    m.num_layers = 3;
    m.hidden_size = 64;
    m.num_attention_heads = 8;
    m.num_key_value_heads = 2;
    m.intermediate_size = 160;
    m.num_experts = 4;
    m.moe_intermediate_size = Some(48);
    m.router_aux_loss_coef = 0.05;
    m.rope_theta = 10000.0;
    let mut shape = lockstep::model::LlamaShape::from_config(&m, 300).unwrap();
    shape.moe.as_mut().unwrap().dense_layers = vec![1];
    tch::manual_seed(7);
    let vs = VarStore::new(Device::Cpu);
    let mut model = Llama::new(&vs.root(), &shape, 64, Kind::Float);
    model.set_router_z_loss(1e-3);
    let batches = [batch(1), batch(2)];
    let (ref_loss, ref_grads) = grads(&vs, || {
        let mut total = 0.0;
        for (x, y) in &batches {
            let o = model.objective(x, y);
            (o.total() / batches.len() as f64).backward();
            total += o.cross_entropy.double_value(&[]);
        }
        total / batches.len() as f64
    });
    let (aux, z): (Vec<f64>, Vec<f64>) = batches
        .iter()
        .map(|(x, y)| {
            let o = tch::no_grad(|| model.objective(x, y));
            (
                o.aux.unwrap().double_value(&[]),
                o.z.unwrap().double_value(&[]),
            )
        })
        .unzip();
    let mut by_mode = Vec::new();
    for mode in MODES {
        model.set_activation_memory(ActivationMemory {
            checkpointing: mode,
            loss_chunk_tokens: 29,
        });
        let _ = model.take_router_log();
        by_mode.push((mode, grads(&vs, || pass(&model, &batches))));
        let log = model.take_router_log();
        assert_eq!(log.micro_batches, 2, "{mode}");
        let rel = |a: f64, b: f64| (a - b).abs() / b.abs();
        assert!(
            rel(log.aux(), (aux[0] + aux[1]) / 2.0) < 1e-6,
            "{mode}: aux"
        );
        assert!(rel(log.z(), (z[0] + z[1]) / 2.0) < 1e-6, "{mode}: z");
        let layers: Vec<usize> = log.counts.iter().map(|(l, _)| *l).collect();
        assert_eq!(layers, [0, 2], "the MoE layers' loads");
        for (_, c) in &log.counts {
            assert_eq!(c.iter().sum::<i64>(), 2 * 2 * 3 * 32, "k slots per token");
        }
    }
    let (_, (none_loss, none_grads)) = &by_mode[0];
    for (mode, (loss, g)) in &by_mode[1..] {
        assert_eq!(loss, none_loss, "{mode}: loss");
        assert_bitwise(g, none_grads, &format!("moe {mode} vs none"));
    }
    assert!((none_loss - ref_loss).abs() / ref_loss < 1e-6);
    let (grad_err, worst) = max_rel(none_grads, &ref_grads, None);
    eprintln!("moe: worst grad rel diff {grad_err:e} ({worst})");
    assert!(
        grad_err < 1e-6,
        "{worst} differs from the autograd objective's by {grad_err:e}"
    );
    // The router's gradient holds the losses' part: without them it is another.
    let router = "model.layers.0.mlp.gate.weight";
    model.set_router_z_loss(0.0);
    let mut plain = shape.clone();
    plain.moe.as_mut().unwrap().aux_loss_coef = 0.0;
    let vs2 = VarStore::new(Device::Cpu);
    let mut copy = |name: &str, _: &[i64], _: tch::nn::Init| vs.variables()[name].detach().copy();
    let without = Llama::new_with(&vs2.root(), &plain, 64, Kind::Float, &mut copy);
    let (_, g) = grads(&vs2, || pass(&without, &batches));
    let pick = |g: &[(String, Tensor)]| g.iter().find(|(n, _)| n == router).unwrap().1.copy();
    let (with, bare) = (pick(none_grads), pick(&g));
    let d = (&with - &bare).norm().double_value(&[]) / with.norm().double_value(&[]);
    assert!(
        d > 1e-3,
        "the router losses move the router's gradient by {d:e}"
    );
}
