//! Packed documents (`data.document_masking` + `data.reset_position_ids`) against transformers
//! run on each document as its own sequence: the loss and every parameter's gradient norm agree
//! within 1e-5 relative, through the trainer's own path (documents in a .tok file → their
//! offsets → the batch's document mask → SDPA or the math backend). Without masking, or with
//! masking but positions running on across documents, the numbers differ.

use crate::common;

use common::rel;

use std::path::Path;

use lockstep::config::{self, Sources};
use lockstep::data::{TokFileWriter, TokenFile};
use lockstep::dist::SingleProcess;
use lockstep::model::{hf, AttentionBackend, Llama};
use lockstep::train::guard::Guard;
use lockstep::train::loader::{batch, Batch, Packing};
use lockstep::train::optim::{AdamWParams, Optimizer};
use lockstep::train::{train_step, StepConfig, StepPlan};
use tch::nn::VarStore;
use tch::{Device, Kind};

const CTX: usize = 32;

fn load_model(dir: &Path, backend: AttentionBackend) -> (VarStore, Llama) {
    let mut m = config::resolve(&Sources::default()).unwrap().config.model;
    m.num_layers = 2;
    m.attention_backend = backend;
    let shape = hf::shape_from_dir(&dir.join("model"), &m).unwrap();
    let vs = VarStore::new(Device::Cpu);
    let model = Llama::new(&vs.root(), &shape, 64, Kind::Float);
    hf::load_weights(&dir.join("model"), &vs).unwrap();
    (vs, model)
}

/// One .tok file per row of documents.json, as `prepare` lays documents out.
fn token_files(dir: &Path) -> Vec<TokenFile> {
    let rows: Vec<Vec<Vec<u32>>> =
        serde_json::from_str(&std::fs::read_to_string(dir.join("documents.json")).unwrap())
            .unwrap();
    rows.iter()
        .enumerate()
        .map(|(i, docs)| {
            let path = dir.join(format!("row{i}.tok"));
            let mut w = TokFileWriter::create(&path, 2, [0; 32]).unwrap();
            for d in docs {
                w.push_document(d).unwrap();
            }
            w.finish().unwrap();
            TokenFile::open(&path).unwrap()
        })
        .collect()
}

fn packed(files: &[TokenFile], packing: Packing) -> Batch {
    let rows: Vec<(&TokenFile, u64)> = files.iter().map(|f| (f, 0)).collect();
    batch(rows.into_iter(), CTX, packing, &mut Vec::new(), Device::Cpu)
}

/// The largest relative difference of a parameter's gradient norm from the reference's.
fn worst_grad_norm_error(vs: &VarStore, reference: &serde_json::Value) -> f64 {
    Llama::named_parameters(vs)
        .iter()
        .map(|(name, p)| {
            let want = reference["grad_norms"][name].as_f64().unwrap();
            rel(p.grad().norm().double_value(&[]), want)
        })
        .fold(0.0, f64::max)
}

const MASKED: Packing = Packing {
    masking: true,
    reset_positions: true,
};

#[test]
fn packed_documents_match_transformers_on_separate_sequences() {
    tch::set_num_threads(1);
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    common::run_python("tests/reference/hf_packed.py", &[dir.to_str().unwrap()]);
    let reference: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap())
            .unwrap();
    let want = reference["loss"].as_f64().unwrap();
    let files = token_files(dir);
    let b = packed(&files, MASKED);
    assert_eq!(b.inputs.size(), [2, CTX as i64]);

    for backend in [AttentionBackend::Sdpa, AttentionBackend::Math] {
        let (vs, model) = load_model(dir, backend);
        let loss = model.loss_with(&b.inputs, &b.targets, b.documents.as_ref());
        let got = loss.double_value(&[]);
        assert!(
            rel(got, want) < 1e-5,
            "{backend:?}: packed loss {got} vs transformers on separate documents {want}"
        );
        loss.backward();
        let grad_norms = reference["grad_norms"].as_object().unwrap();
        let params = Llama::named_parameters(&vs);
        assert_eq!(params.len(), grad_norms.len());
        for (name, p) in &params {
            let got = p.grad().norm().double_value(&[]);
            let want = grad_norms[name].as_f64().unwrap();
            assert!(
                rel(got, want) < 1e-5,
                "{backend:?} {name}: grad norm {got} vs transformers {want}"
            );
        }
    }

    // Without masking the documents see each other: transformers' plain packed rows, not the
    // separate documents. A random model's outputs are near uniform, so the loss moves little;
    // the gradients show it plainly.
    let (vs, model) = load_model(dir, AttentionBackend::Sdpa);
    let plain = packed(&files, Packing::default());
    assert!(plain.documents.is_none());
    let unmasked = model.loss(&plain.inputs, &plain.targets);
    let want_unmasked = reference["unmasked_loss"].as_f64().unwrap();
    let u = unmasked.double_value(&[]);
    assert!(rel(u, want_unmasked) < 1e-5, "{u} vs {want_unmasked}");
    assert!(rel(u, want) > 1e-4, "masking must matter: {u} vs {want}");
    unmasked.backward();
    let worst = worst_grad_norm_error(&vs, &reference);
    assert!(
        worst > 1e-2,
        "masking must matter to the gradients: {worst:e}"
    );
    // Masking alone, positions running on across documents: RoPE scores depend only on the
    // distance between query and key, and masked attention never crosses a document, so this
    // is the same function (up to rounding). Restarting positions matters without masking.
    let (_vs, model) = load_model(dir, AttentionBackend::Sdpa);
    let loss_of = |packing: Packing| {
        let b = packed(&files, packing);
        model
            .loss_with(&b.inputs, &b.targets, b.documents.as_ref())
            .double_value(&[])
    };
    let masked_only = loss_of(Packing {
        masking: true,
        reset_positions: false,
    });
    assert!(rel(masked_only, want) < 1e-5, "{masked_only} vs {want}");
    // Restarted positions without masking change the logits (attention crosses documents at
    // other distances); a random model's loss barely notices, so compare the logits.
    let reset = packed(
        &files,
        Packing {
            masking: false,
            reset_positions: true,
        },
    );
    let plain_logits = model.forward(&reset.inputs);
    let reset_logits = model.forward_with(&reset.inputs, reset.documents.as_ref());
    let change = (&reset_logits - &plain_logits)
        .abs()
        .max()
        .double_value(&[]);
    let scale = plain_logits.abs().max().double_value(&[]);
    assert!(
        change > 1e-3 * scale,
        "restarted positions change the logits by {change:e} (of {scale:e})"
    );
    let (vs, model) = load_model(dir, AttentionBackend::Sdpa);

    // The trainer's step takes the batch's documents along: its loss is the masked one.
    let params = Llama::named_parameters(&vs);
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
        tch::Kind::Float,
    )
    .unwrap();
    opt.zero_grad();
    let training = config::resolve(&Sources::default())
        .unwrap()
        .config
        .training;
    let out = train_step(
        &model,
        &mut opt,
        &mut SingleProcess,
        &mut Guard::new(&training),
        &StepConfig {
            grad_accum: 1,
            max_grad_norm: 1.0,
            overlap: false,
        },
        &StepPlan {
            save_failed: false,
            lr: 1e-3,
            ..Default::default()
        },
        std::iter::once(packed(&files, MASKED)),
    )
    .unwrap();
    assert!(
        rel(out.loss, want) < 1e-5,
        "step loss {} vs {want}",
        out.loss
    );
}
