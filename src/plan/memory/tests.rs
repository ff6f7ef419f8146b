use super::super::test_setting;
use super::*;

/// Equal up to rounding (the terms are summed in different orders).
fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * b.abs().max(1.0)
}

/// Llama-3.1-8B's dimensions with 8 layers and its 128,256-id vocabulary, bf16, 8 ranks at
/// zero stage 3, plus `extra`.
fn stage_3(extra: &[&str]) -> (Setting, Layout) {
    let mut sets = vec![
        "model.num_layers=8",
        "model.vocab_size=128256",
        "system.zero_stage=3",
    ];
    sets.extend(extra);
    test_setting(&sets, 8)
}

/// Elements of one decoder layer (matrices and two norms) of that shape.
fn layer(s: &Setting) -> f64 {
    let sh = &s.shape;
    (sh.attention_matrix_params() + sh.mlp_matrix_params() + 2 * sh.hidden_size) as f64
}

#[test]
fn stage_3_keeps_slices_of_masters_moments_and_gradients_and_the_units_in_use() {
    let (s, l) = stage_3(&["training.activation_checkpointing=full"]);
    let m = estimate(&s, &l);
    let p = s.parameters.count() as f64;
    let (d, v) = (4096.0, 128_256.0);
    assert_eq!(m.weights, 0.0, "no working copy between uses");
    assert!(close(m.master_weights, 4.0 * p / 8.0));
    assert!(close(m.moments, 8.0 * p / 8.0));
    // The slice, and one unit's gradients with their fp32 send buffer (the largest unit:
    // the untied LM head or embedding).
    assert!(close(m.gradients, 4.0 * p / 8.0 + 2.0 * 4.0 * v * d));
    // bf16: the buffer of the unit in use (its parameters are views of it; at the head the
    // final norm's too) and one prefetched unit's (a decoder layer).
    let expected = match m.peak_during {
        PeakPhase::LmHead => 2.0 * (v * d + d + layer(&s)),
        PeakPhase::DecoderBackward => 2.0 * 2.0 * layer(&s),
        PeakPhase::CheckpointSave => unreachable!("a step's peak is above a save's: {m:?}"),
    };
    assert!(close(m.gathered_units, expected), "{m:?}");
    assert!(close(m.total(), m.parts().iter().map(|(_, b)| b).sum()));
    // Stage 2 of the same layout keeps bf16 working weights of the whole model instead.
    let two = estimate(
        &s,
        &Layout {
            zero_stage: ZeroStage::Gradients,
            ..l
        },
    );
    assert_eq!(two.gathered_units, 0.0);
    assert!(close(two.weights - m.gathered_units, 2.0 * p - expected));
    assert!(m.total() < two.total());
}

/// Finding 25: gradient accumulation's memory at stages 0-2 was not counted: the earlier
/// micro-batches' gradients (full fp32 ones, or fp32 sums of bf16 ones) live through the
/// next micro-batch's backward. At the LM-head peak of stages 0 and 1 they are all there
/// is besides the head's own; at the end of a backward stage 0 (and 1 with fp32) holds the
/// same full gradients either way, stage 1 with bf16 its bf16 gradients beside the sums,
/// stage 2 the sums or full gradients beside its slice; stage 3 adds nothing.
#[test]
fn gradient_accumulation_is_counted_where_it_keeps_memory() {
    for (stage, bf16) in [
        (0, true),
        (1, false),
        (1, true),
        (2, false),
        (2, true),
        (3, true),
    ] {
        let estimate_with = |accum: usize| {
            let stage = format!("system.zero_stage={stage}");
            let dtype = format!("training.dtype={}", if bf16 { "bf16" } else { "fp32" });
            let accum = format!("training.grad_accum_nums={accum}");
            let (s, l) = test_setting(&[&stage, &dtype, &accum], 8);
            (estimate(&s, &l), s.parameters.count() as f64)
        };
        let ((one, p), (four, _)) = (estimate_with(1), estimate_with(4));
        let head_peak = four.peak_during == PeakPhase::LmHead;
        let extra = match (stage, bf16) {
            (3, _) => 0.0,
            (0, _) | (1, false) if !head_peak => 0.0,
            _ => 4.0 * p,
        };
        assert!(
            close(four.gradients - one.gradients, extra),
            "stage {stage} bf16 {bf16} ({:?}): {} bytes per parameter",
            four.peak_during,
            (four.gradients - one.gradients) / p
        );
    }
}

#[test]
fn every_prefetched_unit_is_one_more_buffer_in_flight() {
    let mut previous: Option<Memory> = None;
    for p in 0..4 {
        let prefetch = format!("system.prefetch_units={p}");
        let (s, l) = stage_3(&["training.activation_checkpointing=full", &prefetch]);
        let m = estimate(&s, &l);
        if let Some(before) = previous {
            assert_eq!(m.peak_during, before.peak_during);
            assert!(close(
                m.gathered_units - before.gathered_units,
                2.0 * layer(&s)
            ));
        }
        previous = Some(m);
    }
    // Ahead of the last decoder layer's backward: the other 7 layers, then the embedding,
    // and nothing after it.
    let (s, l) = stage_3(&["system.prefetch_units=100"]);
    let g = gathered_at_stage_3(&s, &l, &Dims::of(&s));
    let (d, v) = (4096.0, 128_256.0);
    assert!(close(g.layer, 2.0 * (layer(&s) + 7.0 * layer(&s) + v * d)));
    assert!(close(g.head, 2.0 * (v * d + d + 8.0 * layer(&s) + v * d)));
}

/// Issue 45 item 27: a unit's gather buffer is freed after each use, also under the graph of a
/// layer's forward, so no layer's weights wait for its backward; except where the prefetch
/// issues a layer's backward gather during its forward: that gather gets a buffer of its own
/// and the graph keeps the forward's whole (with checkpointing none or selective).
#[test]
fn a_layers_gathered_weights_wait_for_its_backward_only_where_prefetch_reaches_it() {
    for (prefetch, held) in [(0, 0.0), (1, 0.0), (2, 0.0), (3, 1.0), (4, 1.0), (5, 2.0)] {
        let mut phases = Vec::new();
        for mode in ["none", "selective", "full"] {
            let (s, l) = stage_3(&[
                &format!("training.activation_checkpointing={mode}"),
                &format!("system.prefetch_units={prefetch}"),
            ]);
            let g = gathered_at_stage_3(&s, &l, &Dims::of(&s));
            let want = if mode == "full" { 0.0 } else { held };
            assert!(
                close(g.held, 2.0 * want * layer(&s)),
                "{mode}, prefetch {prefetch}: {g:?}"
            );
            phases.push((g.head, g.layer));
            let m = estimate(&s, &l);
            let at_peak = match m.peak_during {
                PeakPhase::LmHead => g.head,
                PeakPhase::DecoderBackward => g.layer,
                PeakPhase::CheckpointSave => unreachable!("{mode}: a step's peak is above"),
            };
            assert!(close(m.gathered_units, g.held + at_peak), "{mode}");
        }
        assert!(phases.windows(2).all(|w| w[0] == w[1]));
    }
}

/// `held_layers` against the pass itself: the unit order of `Llama::unit_order` with the
/// gathers issued `prefetch` positions ahead (`Events::before`); a layer's forward buffer is
/// kept when its next use is issued before its forward ends.
#[test]
fn the_held_layers_are_those_whose_backward_gather_is_issued_during_their_forward() {
    for layers in 1..7 {
        let mut order = vec![None];
        order.extend((0..layers).map(Some));
        order.extend([None, None]);
        order.extend((0..layers).rev().map(Some));
        order.push(None);
        for prefetch in 0..layers + 3 {
            let held = (0..layers)
                .filter(|&i| {
                    let forward = 1 + i;
                    let issued = (forward + prefetch).min(order.len() - 1);
                    order[forward + 1..=issued].contains(&Some(i))
                })
                .count();
            assert_eq!(
                held_layers(prefetch, layers),
                held,
                "{layers} layers, {prefetch}"
            );
        }
    }
}

/// The production preset's layers with a short context on `world` CPU ranks: the model
/// state outweighs a step's activations.
fn on_cpu(extra: &[&str], world: usize) -> (Setting, Layout) {
    let mut sets = vec![
        "model.num_layers=2",
        "model.vocab_size=32000",
        "training.context_length=64",
        "training.batch_size=1",
        "training.max_steps=100",
    ];
    sets.extend(extra);
    let (mut s, l) = test_setting(&sets, world);
    s.device = Device::Cpu;
    (s, l)
}

#[test]
fn a_cpu_rank_keeps_its_staging_copy_through_the_steps_after_its_first_save() {
    for world in [1, 4] {
        let (s, l) = on_cpu(&["checkpoint.interval=10"], world);
        let p = s.parameters.count() as f64;
        let step = during_step(&s, &l);
        assert!(close(step.staging, 12.0 * p / world as f64), "{step:?}");
        let sync = Setting {
            ckpt_async: false,
            ..s.clone()
        };
        let without = during_step(&sync, &l);
        assert_eq!(without.staging, 0.0);
        assert!(close(step.total() - without.total(), step.staging));
        assert_eq!(estimate(&s, &l).staging, step.staging);
    }
    // On a GPU the copy is pinned host memory: not in the estimate.
    let (mut s, l) = on_cpu(&["checkpoint.interval=10"], 1);
    s.device = Device::Cuda;
    assert_eq!(estimate(&s, &l).staging, 0.0);
    assert_eq!(during_save(&s, &l).staging, 0.0);
}

#[test]
fn one_save_after_the_last_step_meets_the_model_state_alone() {
    // checkpoint.interval = 0, or not below training.max_steps: no save between steps.
    for interval in ["checkpoint.interval=0", "checkpoint.interval=100"] {
        let (s, l) = on_cpu(&[interval], 1);
        let p = s.parameters.count() as f64;
        let step = during_step(&s, &l);
        assert_eq!(step.staging, 0.0, "{interval}");
        let save = during_save(&s, &l);
        assert_eq!(save.peak_during, PeakPhase::CheckpointSave);
        assert!(close(save.staging, 12.0 * p));
        assert_eq!(save.activations + save.logits + save.gathered_units, 0.0);
        assert_eq!(save.gradients, 0.0, "dropped after the update");
        // fp32 stage 0: weights and moments, the runtime and the copy.
        assert!(close(save.total(), 24.0 * p + CPU_RUNTIME_BYTES));
        assert!(
            save.total() > step.total(),
            "a short context: the save is the peak"
        );
        assert_eq!(estimate(&s, &l), save);
    }
    // Stage 3 with bf16: the fp32 gradient slice stays, and the full fp32 parameters this
    // rank writes are gathered from the master shards for the save.
    let (s, l) = on_cpu(
        &[
            "checkpoint.interval=0",
            "system.zero_stage=3",
            "training.dtype=bf16",
        ],
        4,
    );
    let p = s.parameters.count() as f64;
    let save = during_save(&s, &l);
    assert_eq!(save.weights, 0.0);
    assert!(close(save.master_weights, p));
    assert!(close(save.moments, 2.0 * p));
    assert!(close(save.gradients, p));
    assert!(close(save.workspace, CPU_RUNTIME_BYTES + p));
    assert!(close(save.staging, 3.0 * p));
}

/// Llama-3.1-8B's dimensions with 8 layers, bf16, on 8 GPUs at T = `tp`, with sequence
/// parallelism `sp`, plus `extra`.
fn split(tp: usize, sp: bool, extra: &[&str]) -> (Setting, Layout) {
    let tp = format!("system.tensor_parallel={tp}");
    let sp = format!("system.sequence_parallel={sp}");
    let mut sets = vec!["model.num_layers=8", "model.vocab_size=128256", &tp, &sp];
    sets.extend(extra);
    test_setting(&sets, 8)
}

#[test]
fn a_tp_rank_holds_an_eighth_of_the_matrices_and_the_norms_whole() {
    let (d, v) = (4096.0, 128_256.0);
    // The 8 layers' two norms and the final norm.
    let norms = (8.0 * 2.0 + 1.0) * d;
    for stage in ["system.zero_stage=0", "system.zero_stage=1"] {
        let (one, l) = split(1, true, &[stage]);
        let (eight, _) = split(8, true, &[stage]);
        let (a, b) = (estimate(&one, &l), estimate(&eight, &l));
        let p = one.parameters.count() as f64;
        let share = (p - norms) / 8.0 + norms;
        // Stage 0: fp32 weights and moments whole on each of the 8 ranks; stage 1 over 1
        // data-parallel rank at T = 8 (8 at T = 1).
        let (weights, moments) = if stage.ends_with('0') {
            (4.0, 8.0)
        } else {
            (2.0, 8.0)
        };
        assert!(close(a.weights, weights * p), "{stage}");
        assert!(close(b.weights, weights * share), "{stage}");
        let data = if stage.ends_with('0') { 1.0 } else { 8.0 };
        assert!(close(a.moments, moments * p / data), "{stage}");
        assert!(close(b.moments, moments * share), "{stage}");
    }
    // Stage 3 gathers a unit's TP share: a layer's matrices over 8, its norms whole.
    let sets = [
        "system.zero_stage=3",
        "training.activation_checkpointing=full",
    ];
    let (one, l) = split(1, true, &sets);
    let (eight, _) = test_setting(
        &[
            "model.num_layers=8",
            "model.vocab_size=128256",
            "system.tensor_parallel=8",
            sets[0],
            sets[1],
        ],
        64,
    );
    let (a, b) = (
        gathered_at_stage_3(&one, &l, &Dims::of(&one)),
        gathered_at_stage_3(&eight, &l, &Dims::of(&eight)),
    );
    let layer_share = (layer(&one) - 2.0 * d) / 8.0 + 2.0 * d;
    // The layer's buffer (its parameters are views of it) and one prefetched layer.
    assert!(close(b.layer, 2.0 * 2.0 * layer_share), "{b:?}");
    assert!(close(a.layer, 2.0 * 2.0 * layer(&one)));
    // The head unit's buffer, the final norm's, one prefetched layer.
    assert!(close(b.head, 2.0 * (v * d / 8.0 + d + layer_share)));
}

#[test]
fn sequence_parallelism_divides_what_is_kept_between_the_blocks_by_t() {
    let (d, f, c) = (4096.0, 14336.0, 2.0);
    let (q, kv, heads) = (4096.0, 1024.0, 32.0);
    let bytes = |tp: usize, sp: bool| {
        let (s, _) = split(tp, sp, &[]);
        layer_bytes(&s, &Dims::of(&s))
    };
    let (one, sp, no_sp) = (bytes(1, true), bytes(8, true), bytes(8, false));
    // T = 1 as before: the layer input, three (two) bf16 casts of each norm's output.
    assert_eq!(one.input, 4.0 * d);
    let inside = c * (q + 2.0 * kv) + c * q + 4.0 * heads + c * q;
    assert!(close(
        one.attention,
        4.0 * d + 3.0 * c * d + inside + 4.0 * d
    ));
    assert!(close(one.mlp, 4.0 * d + 2.0 * c * d + 4.0 * c * f));
    assert_eq!(one.embedded, 0.0);
    // Between the blocks: the layer input, each norm's fp32 input and its output cast once,
    // the residual after attention: over 8 with sequence parallelism, whole without.
    assert_eq!(sp.input, one.input / 8.0);
    assert_eq!(no_sp.input, one.input);
    let norm = 4.0 * d + c * d;
    // Inside the blocks: over 8 either way; each block's graph keeps its partial output
    // whole, and with sequence parallelism its gathered input.
    assert!(close(
        sp.attention,
        (norm + 4.0 * d) / 8.0 + inside / 8.0 + 2.0 * c * d
    ));
    assert!(close(
        no_sp.attention,
        norm + 4.0 * d + inside / 8.0 + c * d
    ));
    assert!(close(sp.mlp, norm / 8.0 + 4.0 * c * f / 8.0 + 2.0 * c * d));
    assert!(close(no_sp.mlp, norm + 4.0 * c * f / 8.0 + c * d));
    assert!(sp.attention + sp.mlp < no_sp.attention + no_sp.mlp);
    // Full checkpointing keeps the layer inputs: 8 times fewer bytes with sequence
    // parallelism, as many as at T = 1 without it (the embedding's sums besides).
    let kept = |tp: usize, sp: bool| {
        // Stage 1: bf16 working weights, no casts of fp32 ones in the layer's phase.
        let full = [
            "training.activation_checkpointing=full",
            "system.zero_stage=1",
        ];
        let (s, l) = split(tp, sp, &full);
        let m = during_step(&s, &l);
        let n = (l.batch * s.context) as f64;
        let b = layer_bytes(&s, &Dims::of(&s));
        let phase = match m.peak_during {
            PeakPhase::DecoderBackward => n * (b.attention + b.mlp + b.in_flight),
            _ => 0.0,
        };
        m.activations - phase - n * b.embedded
    };
    let whole = kept(1, true);
    assert!(close(kept(8, true), whole / 8.0));
    assert!(close(kept(8, false), whole));
}

#[test]
fn stages_0_to_2_gather_nothing() {
    for stage in 0..3 {
        let (s, l) = test_setting(
            &[
                "model.vocab_size=128256",
                &format!("system.zero_stage={stage}"),
            ],
            8,
        );
        assert_eq!(estimate(&s, &l).gathered_units, 0.0);
    }
}

/// Llama-3.1-8B (32 layers) at 131,072 tokens, one sequence per micro-batch, zero stage 3
/// with full checkpointing, on 32 GPUs split into CP groups of `c`.
fn long_context(c: usize) -> (Setting, Layout) {
    let cp = format!("system.context_parallel={c}");
    test_setting(
        &[
            "model.num_layers=32",
            "model.vocab_size=128256",
            "training.context_length=131072",
            "training.batch_size=1",
            "system.zero_stage=3",
            "training.activation_checkpointing=full",
            &cp,
        ],
        32,
    )
}

#[test]
fn a_ranks_activations_fall_c_fold_with_context_parallelism_and_its_cp_buffers_do_not() {
    let (s1, l) = long_context(1);
    let one = estimate(&s1, &l);
    assert_eq!(one.context_parallel, 0.0);
    let mut previous = one;
    for c in [2, 4, 8] {
        let (s, l) = long_context(c);
        let m = estimate(&s, &l);
        assert_eq!(m.peak_during, PeakPhase::DecoderBackward, "C = {c}");
        // Every kept and recomputed tensor, and the gradients in flight, are per token: a
        // rank holds s/C of each sequence.
        assert!(close(m.activations * c as f64, one.activations), "C = {c}");
        // The state is sharded over the same 32 ranks (data × context) at every C.
        assert_eq!(
            (m.master_weights, m.moments, m.gradients, m.gathered_units),
            (
                one.master_weights,
                one.moments,
                one.gradients,
                one.gathered_units
            )
        );
        // The attention's whole-sequence buffers: counted at the layer's backward, of the
        // same order at every C (the whole sequence's K/V and dK/dV; the chunks, and with them
        // a block and the dQ, shrink with C).
        assert!(close(
            m.context_parallel,
            super::super::context::buffers(&s, &l).peak()
        ));
        assert!(
            m.context_parallel > 2.5e9 && m.context_parallel < 4.5e9,
            "{m:?}"
        );
        assert!(m.total() < previous.total(), "C = {c}");
        previous = m;
    }
    // 8 ranks per sequence fit 8B at 131,072 tokens in 80 GB; one rank does not.
    assert!(one.total() > 80e9);
    assert!(previous.total() < 40e9, "{previous:?}");
}
