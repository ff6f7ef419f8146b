//! The model on the device that `LOCKSTEP_TEST_DEVICE` names: `cpu` (the default) or `cuda`
//! (device 0). CI runs them on the CPU; benches/gpu/accept.sh runs them on a GPU machine, in a
//! process of their own (`model::` tests only), with `LOCKSTEP_TEST_DEVICE=cuda`: there a
//! missing CUDA backend fails the test instead of quietly testing the CPU again.
//!
//! - the forward, the loss and every gradient on the device against the same weights on the
//!   CPU (fp32 within 1e-5; bf16 compute within bf16's resolution of the fp32 result);
//! - the training pass (layer by layer, each activation-checkpointing mode, the chunked LM
//!   head) against one whole backward on the device;
//! - a mixture of experts (Qwen3-MoE: 4 experts, top 2, a dense layer between two MoE
//!   layers): the same experts chosen for every token, the objective (cross-entropy plus the
//!   load-balancing and z-losses) and every gradient on the device against the CPU, and the
//!   training pass against one backward of that objective on the device;
//! - KV-cached greedy decoding on the device against uncached decoding and the CPU's tokens;
//! - variable-length flash attention (packed documents, CUDA bf16 only) against SDPA with the
//!   block-diagonal mask, forward and backward;
//! - context parallelism's block kernels (flash on CPU, memory-efficient attention on CUDA):
//!   queries against two key chunks merged by log-sum-exp, and each block's backward given the
//!   merged output, against SDPA over both chunks (GQA, causal and within documents);
//! - parity with transformers on the device (ignored unless `LOCKSTEP_PARITY_DIR` names the
//!   directory benches/gpu/hf_parity_device.py wrote).

use std::path::Path;

use tch::nn::VarStore;
use tch::{Device, Kind, Tensor};

use super::backward::ActivationCheckpointing;
use super::documents::DocumentMask;
use super::generate::{generate, generate_uncached, GenerateOptions};
use super::shape::{AttentionBackend, LlamaShape};
use super::units::ActivationMemory;
use super::{flash, hf, Llama};

/// The device under test. CUDA's backend is loaded before anything else touches libtorch's
/// device machinery (see crate::sys::cuda).
fn test_device() -> Device {
    match std::env::var("LOCKSTEP_TEST_DEVICE").as_deref() {
        Ok("cuda") => {
            if let Err(e) = crate::sys::cuda::load_cuda_backend() {
                panic!("LOCKSTEP_TEST_DEVICE=cuda but libtorch's CUDA backend does not load: {e}");
            }
            assert!(
                tch::Cuda::is_available(),
                "LOCKSTEP_TEST_DEVICE=cuda but libtorch sees no CUDA device"
            );
            Device::Cuda(0)
        }
        Ok("cpu") | Err(_) => Device::Cpu,
        Ok(other) => panic!("LOCKSTEP_TEST_DEVICE={other}: expected cpu or cuda"),
    }
}

/// ‖a − b‖ / ‖b‖ (fp64, on the CPU).
fn rel(a: &Tensor, b: &Tensor) -> f64 {
    let a = a.to_device(Device::Cpu).to_kind(Kind::Double);
    let b = b.to_device(Device::Cpu).to_kind(Kind::Double);
    (&a - &b).norm().double_value(&[]) / b.norm().double_value(&[]).max(1e-30)
}

fn rel_scalar(a: f64, b: f64) -> f64 {
    (a - b).abs() / b.abs().max(1e-30)
}

/// The default config's model section with a 2-layer GQA model (8 query heads over 2 kv
/// heads, head_dim 16, MLP width 352).
fn small_model() -> crate::config::ModelConfig {
    let mut m = crate::config::resolve(&crate::config::Sources::default())
        .unwrap()
        .config
        .model;
    m.num_layers = 2;
    m.hidden_size = 128;
    m.num_attention_heads = 8;
    m.num_key_value_heads = 2;
    m.intermediate_size = 352;
    m.rope_theta = 10000.0;
    m
}

/// The 2-layer GQA model of `small_model`.
fn shape(vocab: usize, tied: bool) -> LlamaShape {
    let mut m = small_model();
    m.tie_word_embeddings = tied;
    LlamaShape::from_config(&m, vocab).unwrap()
}

/// Random weights (norm weights away from 1) on the CPU, and the same weights on `device`,
/// each as a model computing in `compute`.
fn twin_models(
    shape: &LlamaShape,
    device: Device,
    compute: Kind,
) -> ((VarStore, Llama), (VarStore, Llama)) {
    tch::manual_seed(11);
    let cpu_vs = VarStore::new(Device::Cpu);
    let cpu = Llama::new(&cpu_vs.root(), shape, 64, compute);
    tch::no_grad(|| {
        // In name order: the same draws land on the same weights every time.
        for (name, p) in Llama::named_parameters(&cpu_vs) {
            if name.contains("norm") {
                p.shallow_clone().copy_(&(p.rand_like() + 0.5));
            }
        }
    });
    let mut dev_vs = VarStore::new(device);
    let dev = Llama::new(&dev_vs.root(), shape, 64, compute);
    dev_vs.copy(&cpu_vs).unwrap();
    ((cpu_vs, cpu), (dev_vs, dev))
}

/// A fixed batch: a pseudo-random sequence of its own, since the global generator is shared
/// with the tests running beside this one.
fn batch(vocab: i64, device: Device) -> (Tensor, Tensor) {
    let ids: Vec<i64> = (0..99).map(|i| (i * 7919 + 13) % vocab).collect();
    let tokens = Tensor::from_slice(&ids).view([3, 33]).to_device(device);
    (tokens.narrow(1, 0, 32), tokens.narrow(1, 1, 32))
}

/// Every gradient by name (copied to the CPU), then cleared.
fn take_grads(vs: &VarStore) -> Vec<(String, Tensor)> {
    let mut g: Vec<(String, Tensor)> = Llama::named_parameters(vs)
        .into_iter()
        // A copy: on the CPU `to_device` is the same tensor, which the zeroing below clears.
        .map(|(n, p)| (n, p.grad().to_device(Device::Cpu).copy()))
        .collect();
    g.sort_by(|a, b| a.0.cmp(&b.0));
    for (_, p) in vs.variables() {
        let mut grad = p.grad();
        if grad.defined() {
            let _ = grad.zero_();
        }
    }
    g
}

/// The largest relative L2 difference over the gradients, and whose.
fn max_rel(a: &[(String, Tensor)], b: &[(String, Tensor)]) -> (f64, String) {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|((name, x), (other, y))| {
            assert_eq!(name, other);
            (rel(x, y), name.clone())
        })
        .fold((0.0, String::new()), |m, x| if x.0 > m.0 { x } else { m })
}

/// One whole forward + backward through `Llama::loss`; returns the loss.
fn whole_backward(model: &Llama, x: &Tensor, y: &Tensor) -> f64 {
    let loss = model.loss(x, y);
    loss.backward();
    loss.double_value(&[])
}

#[test]
fn loss_and_gradients_on_the_device_match_the_cpu() {
    let device = test_device();
    for (compute, tol_loss, tol_grad) in [(Kind::Float, 1e-5, 1e-4), (Kind::BFloat16, 1e-2, 5e-2)] {
        for tied in [false, true] {
            let shape = shape(384, tied);
            let ((cpu_vs, cpu), (dev_vs, dev)) = twin_models(&shape, device, compute);
            // The CPU in fp32 is the reference for both dtypes: the same weights, copied (not
            // drawn again: other tests draw from the same global generator meanwhile).
            let mut ref_vs = VarStore::new(Device::Cpu);
            let reference = Llama::new(&ref_vs.root(), &shape, 64, Kind::Float);
            ref_vs.copy(&cpu_vs).unwrap();
            let (xc, yc) = batch(384, Device::Cpu);
            let (xd, yd) = batch(384, device);
            let want = whole_backward(&reference, &xc, &yc);
            let want_g = take_grads(&ref_vs);
            let cpu_loss = whole_backward(&cpu, &xc, &yc);
            let cpu_g = take_grads(&cpu_vs);
            let got = whole_backward(&dev, &xd, &yd);
            let got_g = take_grads(&dev_vs);
            let (g_err, g_name) = max_rel(&got_g, &want_g);
            let what = format!("{compute:?} tied={tied} on {device:?}");
            println!(
                "{what}: loss {got} vs CPU fp32 {want} (rel {:.2e}; CPU {compute:?} rel {:.2e}); \
                 worst gradient {g_name} rel {g_err:.2e} (CPU {compute:?} {:.2e})",
                rel_scalar(got, want),
                rel_scalar(cpu_loss, want),
                max_rel(&cpu_g, &want_g).0,
            );
            assert!(rel_scalar(got, want) < tol_loss, "{what}: loss");
            assert!(g_err < tol_grad, "{what}: gradient of {g_name}");
            // Logits of a plain forward, too (the generation path reads them).
            let logits = tch::no_grad(|| dev.forward(&xd)).to_kind(Kind::Float);
            let want_logits = tch::no_grad(|| reference.forward(&xc));
            assert!(rel(&logits, &want_logits) < tol_grad, "{what}: logits");
        }
    }
}

#[test]
fn training_pass_matches_one_whole_backward_on_the_device() {
    let device = test_device();
    for compute in [Kind::Float, Kind::BFloat16] {
        let tol = if compute == Kind::Float { 1e-5 } else { 2e-2 };
        let shape = shape(384, false);
        let (_, (vs, mut model)) = twin_models(&shape, device, compute);
        let (x, y) = batch(384, device);
        let want = whole_backward(&model, &x, &y);
        let want_g = take_grads(&vs);
        for mode in [
            ActivationCheckpointing::None,
            ActivationCheckpointing::Full,
            ActivationCheckpointing::Selective,
        ] {
            for chunk in [0, 40] {
                model.set_activation_memory(ActivationMemory {
                    checkpointing: mode,
                    loss_chunk_tokens: chunk,
                });
                let loss = model
                    .forward_backward(&x, &y, None, 1.0, &mut crate::model::NoEvents)
                    .unwrap()
                    .double_value(&[]);
                let (err, name) = max_rel(&take_grads(&vs), &want_g);
                let what = format!("{compute:?} {mode:?} chunk {chunk} on {device:?}");
                println!(
                    "{what}: loss rel {:.2e}, worst gradient {name} rel {err:.2e}",
                    rel_scalar(loss, want)
                );
                assert!(
                    rel_scalar(loss, want) < tol,
                    "{what}: loss {loss} vs {want}"
                );
                assert!(err < tol, "{what}: gradient of {name}");
            }
        }
    }
}

/// A 3-layer Qwen3-MoE model: layers 0 and 2 route to 2 of 4 experts of width 48, layer 1
/// is a dense MLP of width 352; the load-balancing loss weighted 0.05.
fn moe_shape(vocab: usize) -> LlamaShape {
    let mut m = small_model();
    m.architecture = crate::config::Architecture::Qwen3Moe;
    m.num_layers = 3;
    m.num_experts = 4;
    m.moe_intermediate_size = Some(48);
    m.router_aux_loss_coef = 0.05;
    let mut shape = LlamaShape::from_config(&m, vocab).unwrap();
    shape.moe.as_mut().unwrap().dense_layers = vec![1];
    shape
}

/// The grouped experts (a sort by expert, one matmul per expert's block, `index_add` back)
/// and the router losses on the device: in fp32 the same experts for every token and the
/// CPU's objective and gradients; in either dtype the training pass (the router losses'
/// gradient added in each MoE layer's backward) equals one backward of the objective.
#[test]
fn mixture_of_experts_on_the_device_matches_the_cpu() {
    let device = test_device();
    let shape = moe_shape(384);
    for (compute, tol) in [(Kind::Float, 1e-5), (Kind::BFloat16, 2e-2)] {
        let ((cpu_vs, mut cpu), (dev_vs, mut dev)) = twin_models(&shape, device, compute);
        cpu.set_router_z_loss(1e-3);
        dev.set_router_z_loss(1e-3);
        let (xc, yc) = batch(384, Device::Cpu);
        let (xd, yd) = batch(384, device);
        let what = format!("MoE {compute:?} on {device:?}");
        let objective = |model: &Llama, x: &Tensor, y: &Tensor| {
            let o = model.objective(x, y);
            o.total().backward();
            [
                o.cross_entropy.double_value(&[]),
                o.aux.unwrap().double_value(&[]),
                o.z.unwrap().double_value(&[]),
            ]
        };
        let got = objective(&dev, &xd, &yd);
        let got_g = take_grads(&dev_vs);
        if compute == Kind::Float {
            let chosen = |m: &Llama, x: &Tensor| -> Vec<(usize, Vec<i64>)> {
                m.router_choices(x)
                    .into_iter()
                    .map(|(l, c)| {
                        (
                            l,
                            Vec::<i64>::try_from(c.to_device(Device::Cpu).view([-1])).unwrap(),
                        )
                    })
                    .collect()
            };
            let routes = chosen(&dev, &xd);
            assert_eq!(routes.iter().map(|r| r.0).collect::<Vec<_>>(), [0, 2]);
            assert_eq!(routes, chosen(&cpu, &xc), "{what}: the experts chosen");
            let want = objective(&cpu, &xc, &yc);
            let want_g = take_grads(&cpu_vs);
            let (g_err, g_name) = max_rel(&got_g, &want_g);
            println!(
                "{what}: cross-entropy, aux, z {got:?} vs CPU {want:?}; worst gradient \
                 {g_name} rel {g_err:.2e}"
            );
            for (name, (a, b)) in ["cross-entropy", "aux", "z"]
                .iter()
                .zip(got.iter().zip(&want))
            {
                assert!(rel_scalar(*a, *b) < tol, "{what}: {name} {a} vs {b}");
            }
            assert!(g_err < 1e-4, "{what}: gradient of {g_name}");
        }
        for mode in [ActivationCheckpointing::None, ActivationCheckpointing::Full] {
            dev.set_activation_memory(ActivationMemory {
                checkpointing: mode,
                loss_chunk_tokens: 40,
            });
            let _ = dev.take_router_log();
            let loss = dev
                .forward_backward(&xd, &yd, None, 1.0, &mut crate::model::NoEvents)
                .unwrap()
                .double_value(&[]);
            let log = dev.take_router_log();
            let (err, name) = max_rel(&take_grads(&dev_vs), &got_g);
            println!(
                "{what} {mode:?}: loss rel {:.2e}, aux rel {:.2e}, worst gradient {name} rel {err:.2e} \
                 against the objective's backward",
                rel_scalar(loss, got[0]),
                rel_scalar(log.aux(), got[1]),
            );
            assert!(rel_scalar(loss, got[0]) < tol, "{what} {mode:?}: loss");
            assert!(rel_scalar(log.aux(), got[1]) < tol, "{what} {mode:?}: aux");
            assert!(rel_scalar(log.z(), got[2]) < tol, "{what} {mode:?}: z");
            assert!(err < tol, "{what} {mode:?}: gradient of {name}");
        }
    }
}

#[test]
fn cached_greedy_decoding_on_the_device_matches_uncached_and_the_cpu() {
    let device = test_device();
    let shape = shape(384, false);
    let ((_, cpu), (_, dev)) = twin_models(&shape, device, Kind::Float);
    let opts = GenerateOptions {
        max_new_tokens: 24,
        temperature: 0.0,
        top_p: 1.0,
        seed: 0,
        eos: vec![],
    };
    let prompt = [5i64, 17, 99, 3, 250, 8];
    let cached = generate(&dev, &prompt, &opts, device).unwrap().tokens;
    let uncached = generate_uncached(&dev, &prompt, &opts, device)
        .unwrap()
        .tokens;
    let on_cpu = generate(&cpu, &prompt, &opts, Device::Cpu).unwrap().tokens;
    println!("{device:?}: {cached:?}");
    assert_eq!(cached.len(), 24);
    assert_eq!(cached, uncached, "KV cache on {device:?}");
    assert_eq!(cached, on_cpu, "{device:?} against the CPU");
    // Sampling from a seed is the same draw on any device (the draw runs on the host).
    let sampled = GenerateOptions {
        temperature: 0.8,
        top_p: 0.95,
        seed: 3,
        ..opts
    };
    assert_eq!(
        generate(&dev, &prompt, &sampled, device).unwrap().tokens,
        generate(&cpu, &prompt, &sampled, Device::Cpu)
            .unwrap()
            .tokens
    );
}

/// CUDA bf16: the variable-length kernel runs (no fallback) and computes what SDPA with the
/// block-diagonal causal mask computes, forward and backward. Elsewhere the kernel does not
/// apply and the model takes the masked path (the CPU's tests cover it).
#[test]
fn varlen_flash_attention_matches_masked_sdpa() {
    let device = test_device();
    let pieces = [vec![5, 60, 1, 62], vec![128], vec![64, 64]];
    let docs = DocumentMask::new(&pieces, true, false, device);
    let (b, heads, kv_heads, t, hd) = (3, 8, 2, 128, 64);
    tch::manual_seed(3);
    let leaf = |h: i64| {
        Tensor::randn([b, h, t, hd], (Kind::Float, device))
            .to_kind(Kind::BFloat16)
            .set_requires_grad(true)
    };
    let (q, k, v) = (leaf(heads), leaf(kv_heads), leaf(kv_heads));
    let Some(y) = flash::varlen_attention(&q, &k, &v, &docs) else {
        assert!(
            !device.is_cuda(),
            "variable-length flash attention fell back to the mask on CUDA (see the WARNING above)"
        );
        println!("{device:?}: the variable-length kernel does not apply here");
        return;
    };
    let mask = docs.attention_mask().shallow_clone();
    let want =
        Tensor::scaled_dot_product_attention(&q, &k, &v, Some(&mask), 0.0, false, None, true);
    let fwd = rel(&y, &want);
    let w = Tensor::randn([b, heads, t, hd], (Kind::Float, device)).to_kind(Kind::BFloat16);
    let grads = |out: &Tensor| -> Vec<Tensor> {
        Tensor::run_backward(&[(out * &w).sum(Kind::Float)], &[&q, &k, &v], false, false)
    };
    let (g, g_want) = (grads(&y), grads(&want));
    let bwd = g
        .iter()
        .zip(&g_want)
        .map(|(a, b)| rel(a, b))
        .fold(0.0f64, f64::max);
    println!("{device:?} varlen flash vs masked SDPA (bf16): forward rel {fwd:.2e}, backward rel {bwd:.2e}");
    assert!(fwd < 1e-2, "forward differs by {fwd:e}");
    assert!(bwd < 2e-2, "backward differs by {bwd:e}");
}

/// Loss and every gradient against transformers on the same device, weights and batch:
/// `LOCKSTEP_PARITY_DIR` holds tests/reference/hf_llama.py's model and batch and
/// benches/gpu/hf_parity_device.py's `device_reference.safetensors` (fp32, and bf16 autocast,
/// on the device it was run on). fp32: loss 1e-5, gradient norms 1e-5, whole gradients 1e-4
/// (relative). bf16: lockstep's distance to transformers' fp32 result may be at most twice
/// transformers' own bf16 distance to it, plus 2e-3 (loss) / 1e-2 (gradients).
#[test]
#[ignore = "needs LOCKSTEP_PARITY_DIR (benches/gpu/accept.sh sets it)"]
fn matches_transformers_on_the_device() {
    let device = test_device();
    let dir = std::env::var("LOCKSTEP_PARITY_DIR").expect("LOCKSTEP_PARITY_DIR");
    let dir = Path::new(&dir);
    let reference: std::collections::HashMap<String, Tensor> =
        crate::tensor_io::load_all(&dir.join("device_reference.safetensors"))
            .unwrap()
            .into_iter()
            .collect();
    let tokens = crate::tensor_io::SafeFile::open(&dir.join("batch.safetensors"))
        .unwrap()
        .tensor("tokens")
        .unwrap()
        .to_device(device);
    let t = tokens.size()[1];
    let (x, y) = (tokens.narrow(1, 0, t - 1), tokens.narrow(1, 1, t - 1));
    let scalar = |key: &str| reference[key].double_value(&[0]);
    let mut lines = Vec::new();
    let mut failures = Vec::new();
    for compute in [Kind::Float, Kind::BFloat16] {
        let (mut vs, mut model) = hf::load_model(
            &dir.join("model"),
            device,
            compute,
            64,
            AttentionBackend::Sdpa,
        )
        .unwrap();
        // load_model freezes the weights (inference); train them here.
        vs.unfreeze();
        // The training path: layer by layer, full recomputation, the LM head in 40-token
        // chunks (the 96 targets span three, one partial).
        model.set_activation_memory(ActivationMemory {
            checkpointing: ActivationCheckpointing::Full,
            loss_chunk_tokens: 40,
        });
        let loss = model
            .forward_backward(&x, &y, None, 1.0, &mut crate::model::NoEvents)
            .unwrap()
            .double_value(&[]);
        let grads = take_grads(&vs);
        let want_loss = scalar("fp32/loss");
        let loss_err = rel_scalar(loss, want_loss);
        let (mut grad_err, mut worst, mut norm_err, mut hf_grad_err) =
            (0.0f64, String::new(), 0.0f64, 0.0f64);
        for (name, g) in &grads {
            let want = &reference[&format!("fp32/grad/{name}")];
            let e = rel(g, want);
            if e > grad_err {
                (grad_err, worst) = (e, name.clone());
            }
            let norm = g.norm().double_value(&[]);
            norm_err = norm_err.max(rel_scalar(norm, want.norm().double_value(&[])));
            if compute == Kind::BFloat16 {
                let theirs = &reference[&format!("bf16/grad/{name}")];
                hf_grad_err = hf_grad_err.max(rel(theirs, want));
            }
        }
        let line = if compute == Kind::Float {
            for (err, tol, what) in [
                (loss_err, 1e-5, "loss"),
                (norm_err, 1e-5, "gradient norm"),
                (grad_err, 1e-4, "gradient"),
            ] {
                if err >= tol {
                    failures.push(format!("fp32 {what}: {err:.2e} >= {tol:e}"));
                }
            }
            format!("fp32 loss rel {loss_err:.2e}, grad-norm rel {norm_err:.2e}, grad rel {grad_err:.2e} ({worst})")
        } else {
            let hf_loss_err = rel_scalar(scalar("bf16/loss"), want_loss);
            let (loss_tol, grad_tol) = (2.0 * hf_loss_err + 2e-3, 2.0 * hf_grad_err + 1e-2);
            if loss_err >= loss_tol {
                failures.push(format!("bf16 loss: {loss_err:.2e} >= {loss_tol:.2e}"));
            }
            if grad_err >= grad_tol {
                failures.push(format!(
                    "bf16 gradient {worst}: {grad_err:.2e} >= {grad_tol:.2e}"
                ));
            }
            format!(
                "bf16 vs fp32 reference: loss rel {loss_err:.2e} (transformers bf16 {hf_loss_err:.2e}), \
                 grad rel {grad_err:.2e} ({worst}; transformers bf16 worst {hf_grad_err:.2e})"
            )
        };
        lines.push(line);
    }
    println!("PARITY on {device:?}: {}", lines.join(" | "));
    assert!(failures.is_empty(), "{failures:?}");
}

/// Context parallelism's attention blocks on the device: the second of two chunks of queries
/// against the first chunk (all visible, or within documents) and against itself (causal),
/// merged by log-sum-exp, forward and backward, against SDPA over the whole sequence.
#[test]
fn context_parallel_blocks_equal_sdpa_on_the_device() {
    use super::context_parallel::{kernel, merge, Visible};
    let device = test_device();
    let (b, heads, kv, m, hd) = (2, 8, 2, 64, 32);
    for (kind, bound) in [(Kind::Float, 1e-5), (Kind::BFloat16, 2e-2)] {
        for docs in [false, true] {
            tch::manual_seed(11);
            let draw = |h: i64| Tensor::randn([b, h, 2 * m, hd], (Kind::Float, device));
            let (q, k, v, g) = (draw(heads), draw(kv), draw(kv), draw(heads));
            // Documents: row 0 breaks at 40 and 100, row 1 at 64 (the chunk edge).
            let pieces = [vec![40, 60, 28], vec![64, 64]];
            let mask = DocumentMask::new(&pieces, true, false, device);
            let allowed = mask.attention_mask().shallow_clone();
            // The reference in fp32 on the device: the second chunk's rows.
            let (qr, kr, vr) = (
                q.set_requires_grad(true),
                k.set_requires_grad(true),
                v.set_requires_grad(true),
            );
            let cast = |t: &Tensor| t.to_kind(kind).to_kind(Kind::Float);
            let out = Tensor::scaled_dot_product_attention(
                &cast(&qr),
                &cast(&kr),
                &cast(&vr),
                docs.then_some(&allowed),
                0.0,
                !docs,
                None,
                true,
            );
            let tail = |t: &Tensor| t.narrow(2, m, m);
            (tail(&out) * tail(&g)).sum(Kind::Float).backward();
            let (want, dq_want) = (tail(&out).detach(), tail(&qr.grad()));
            let (dk_want, dv_want) = (kr.grad(), vr.grad());
            // The blocks, in `kind`.
            let qc = tail(&q).to_kind(kind);
            let (k, v) = (k.to_kind(kind), v.to_kind(kind));
            // What the second chunk sees of each key chunk, as a CP rank makes it.
            let blocks = Visible::blocks(1, m, docs.then(|| mask.doc_ids()));
            let visible = |j: i64| &blocks[j as usize].1;
            let key = |t: &Tensor, j: i64| t.narrow(2, j * m, m);
            let (o0, l0) = kernel::forward(&qc, &key(&k, 0), &key(&v, 0), visible(0)).unwrap();
            let (o1, l1) = kernel::forward(&qc, &key(&k, 1), &key(&v, 1), visible(1)).unwrap();
            let (o, l) = merge(&o0.to_kind(Kind::Float), &l0, &o1.to_kind(Kind::Float), &l1);
            let e = rel(&o, &want);
            assert!(e < bound, "{kind:?} documents {docs}: output off by {e:e}");
            let (o, gc) = (o.to_kind(kind), tail(&g).to_kind(kind));
            let mut dq = Tensor::zeros_like(&want);
            let (mut dks, mut dvs) = (Vec::new(), Vec::new());
            for j in 0..2 {
                let (dqj, dkj, dvj) =
                    kernel::backward(&gc, &qc, &key(&k, j), &key(&v, j), &o, &l, visible(j))
                        .unwrap();
                dq += dqj.to_kind(Kind::Float);
                dks.push(dkj.to_kind(Kind::Float));
                dvs.push(dvj.to_kind(Kind::Float));
            }
            // The first chunk's keys get gradient from the second chunk's queries only here.
            let dk = Tensor::cat(&dks, 2);
            let dv = Tensor::cat(&dvs, 2);
            for (name, got, want) in [
                ("dq", &dq, &dq_want),
                ("dk", &dk, &dk_want),
                ("dv", &dv, &dv_want),
            ] {
                let e = rel(got, want);
                assert!(e < bound, "{kind:?} documents {docs}: {name} off by {e:e}");
            }
        }
    }
}
