//! `lockstep export`, `eval` and `generate` against transformers: an exported checkpoint loads
//! in transformers (fp32, bf16, sharded) with the same logits, `eval`'s loss is transformers'
//! mean cross-entropy over the same windows, greedy `generate` emits transformers' tokens (and
//! stops at its EOS), and KV-cached decoding equals recomputing the whole sequence.

use crate::common;

use common::rel;

use std::path::Path;

use lockstep::data::tokenizer::Tokenizer;
use lockstep::data::tokfile::TokFileWriter;
use lockstep::model::generate::{generate, generate_uncached, GenerateOptions};
use lockstep::model::{hf, AttentionBackend, KvCache, Llama};
use lockstep::tensor_io::{self, SafeFile};
use serde_json::{json, Value};
use tch::{Device, Kind, Tensor};

const SAMPLE: &str = "HAMLET: To be, or not to be, that is the question.";

/// ‖a − b‖ / ‖b‖ over the whole tensor.
fn rel_l2(a: &Tensor, b: &Tensor) -> f64 {
    (a - b).norm().double_value(&[]) / b.norm().double_value(&[])
}

fn json_of(text: &str) -> Value {
    let line = text
        .lines()
        .rev()
        .find(|l| l.starts_with('{'))
        .unwrap_or_else(|| panic!("no JSON line in:\n{text}"));
    serde_json::from_str(line).unwrap()
}

fn strings(a: &[&str]) -> Vec<String> {
    a.iter().map(|s| s.to_string()).collect()
}

fn logits_of(dir: &Path, tokens: &Tensor) -> Tensor {
    let (_vs, model) =
        hf::load_model(dir, Device::Cpu, Kind::Float, 64, AttentionBackend::Sdpa).unwrap();
    tch::no_grad(|| model.forward(tokens))
}

/// Train a small model 6 steps, export it three ways, load each in transformers; eval the fp32
/// export (text, .tok, checkpoint dir, batch sizes) against transformers' loss.
#[test]
fn export_loads_in_transformers_and_eval_matches() {
    tch::set_num_threads(1);
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let corpus = common::write_corpus(dir);
    let base = common::small_gpt2(&corpus); // GPT-2's ids and tokenizer files are checked
    let export = |args: &[&str]| common::run(dir, &common::with(&base, &["export"], args));

    // Nothing trained yet: a clear error naming the checkpoint directory.
    let out = export(&["--hf", "none"]);
    let text = common::output_text(&out);
    assert!(
        !out.status.success()
            && text.contains("no complete checkpoint to export in runs/tiny/checkpoints"),
        "{text}"
    );

    common::ok(dir, &common::with(&base, &["train"], &["--max-steps", "6"]));
    // A second run with a tokenizer.json (a byte-level BPE trained on the corpus), named by its
    // directory: its export carries the tokenizer.
    let tokenizer_json = dir.join("tokenizer.json");
    common::run_python(
        "tests/reference/hf_interop.py",
        &[
            "tokenizer",
            dir.to_str().unwrap(),
            corpus.join("doc0.txt").to_str().unwrap(),
        ],
    );
    let bpe_run = [
        "--set".to_string(),
        "logging.run_name=bpe".to_string(),
        "--set".to_string(),
        format!("data.tokenizer={}", dir.display()),
    ];
    let bpe: Vec<String> = base.iter().cloned().chain(bpe_run).collect();
    common::ok(dir, &common::with(&bpe, &["train"], &["--max-steps", "2"]));
    common::ok(dir, &common::with(&bpe, &["export"], &["--hf", "hfbpe"]));
    // A Qwen3 run (q_norm/k_norm, heads of 32 where hidden / heads is 16): its export loads
    // as Qwen3ForCausalLM with transformers' logits.
    let qwen: Vec<String> = base
        .iter()
        .cloned()
        .chain(strings(&[
            "--set",
            "logging.run_name=qwen",
            "--set",
            "model.architecture=qwen3",
            "--set",
            "model.head_dim=32",
        ]))
        .collect();
    common::ok(dir, &common::with(&qwen, &["train"], &["--max-steps", "2"]));
    common::ok(dir, &common::with(&qwen, &["export"], &["--hf", "hfqwen"]));
    // Mixtures of experts: a Qwen3-MoE run (4 experts of width 32, top 2, the second layer
    // dense) and a Mixtral run on 2 CPU ranks with expert parallelism 2 (4 experts, top 2;
    // each rank trains and writes 2 of every layer's): their exports load as
    // Qwen3MoeForCausalLM and MixtralForCausalLM with transformers' logits.
    for (name, how, extra) in [
        (
            "qwenmoe",
            &["train"][..],
            &[
                "model.architecture=qwen3_moe",
                "model.num_experts=4",
                "model.moe_intermediate_size=32",
                "model.decoder_sparse_step=2",
            ][..],
        ),
        (
            "mixtral",
            &["run", "--cpu", "--nproc", "2"][..],
            &[
                "model.architecture=mixtral",
                "model.num_experts=4",
                "system.expert_parallel=2",
            ][..],
        ),
    ] {
        let mut run = base.clone();
        for set in std::iter::once(format!("logging.run_name={name}"))
            .chain(extra.iter().map(|e| e.to_string()))
        {
            run.extend(["--set".to_string(), set]);
        }
        common::ok(dir, &common::with(&run, how, &["--max-steps", "2"]));
        let out = format!("hf{name}");
        common::ok(dir, &common::with(&run, &["export"], &["--hf", &out]));
    }
    common::ok(
        dir,
        &common::with(&base, &["export"], &["--hf", "hf32", "--dtype", "fp32"]),
    );
    common::ok(
        dir,
        &common::with(&base, &["export"], &["--hf", "hf16", "--dtype", "bf16"]),
    );
    common::ok(
        dir,
        &common::with(
            &base,
            &["export"],
            &[
                "--hf",
                "sharded",
                "--checkpoint",
                "runs/tiny/checkpoints/step_5",
                "--max-shard-mb",
                "5",
            ],
        ),
    );
    // The fp32 export is the checkpoint, bit for bit.
    let ckpt = dir.join("runs/tiny/checkpoints/step_6");
    let exported: std::collections::HashMap<String, Tensor> =
        tensor_io::load_all(&dir.join("hf32/model.safetensors"))
            .unwrap()
            .into_iter()
            .collect();
    for (name, t) in tensor_io::load_all(&ckpt.join("model.safetensors")).unwrap() {
        assert!(
            t.equal(&exported[&name]),
            "{name} changed in the fp32 export"
        );
    }
    let config: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("hf16/config.json")).unwrap())
            .unwrap();
    assert_eq!(config["torch_dtype"], "bfloat16");
    let generation: Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("hf32/generation_config.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(generation["eos_token_id"], 50256, "gpt2's <|endoftext|>");
    let index: Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("sharded/model.safetensors.index.json")).unwrap(),
    )
    .unwrap();
    let shards: std::collections::BTreeSet<&str> = index["weight_map"]
        .as_object()
        .unwrap()
        .values()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert!(
        shards.len() >= 2,
        "--max-shard-mb 5 should shard a 26 MB model: {shards:?}"
    );
    let exported_bytes: u64 = ["embed_tokens", "lm_head"].len() as u64 * 50257 * 64 * 4;
    assert!(index["metadata"]["total_size"].as_u64().unwrap() > exported_bytes);
    assert!(
        !dir.join("hf32.tmp").exists(),
        "no temporary directory left behind"
    );

    // OUT exists: refused without --force, replaced with it.
    let out = export(&["--hf", "hf32"]);
    let text = common::output_text(&out);
    assert!(
        !out.status.success()
            && text.contains("--hf hf32: already exists and is not empty; pass --force"),
        "{text}"
    );
    common::ok(
        dir,
        &common::with(
            &base,
            &["export"],
            &["--hf", "hf32", "--dtype", "fp32", "--force"],
        ),
    );

    // A fixed batch, and the eval stream: the corpus tokenized as `prepare` does.
    tch::manual_seed(0);
    let g = Tensor::randint(50257, [2, 40], (Kind::Int64, Device::Cpu));
    tensor_io::save(
        &dir.join("batch.safetensors"),
        &[("tokens".into(), g.shallow_clone())],
        None,
    )
    .unwrap();
    let tok = Tokenizer::load("gpt2").unwrap();
    let eval_file = corpus.join("doc1.txt");
    let stream = lockstep::commands::eval::tokenize_text(&eval_file, &tok, "text").unwrap();
    let stream_t = Tensor::from_slice(&stream.iter().map(|&t| t as i64).collect::<Vec<_>>());
    tensor_io::save(
        &dir.join("stream.safetensors"),
        &[("tokens".into(), stream_t)],
        None,
    )
    .unwrap();
    let hf32 = dir.join("hf32");
    std::fs::write(
        dir.join("params.json"),
        json!({
            "dirs": [
                {"path": hf32, "dtype": "float32", "shards": 1},
                {"path": dir.join("hf16"), "dtype": "bfloat16", "shards": 1},
                {"path": dir.join("sharded"), "dtype": "float32", "shards": shards.len()},
                {"path": dir.join("hfbpe"), "dtype": "float32", "shards": 1, "logits": false,
                 "text": SAMPLE},
                {"path": dir.join("hfqwen"), "dtype": "float32", "shards": 1},
                {"path": dir.join("hfqwenmoe"), "dtype": "float32", "shards": 1},
                {"path": dir.join("hfmixtral"), "dtype": "float32", "shards": 1},
            ],
            "eval": {"dir": hf32, "context_length": 48},
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
    // transformers' AutoTokenizer reads the exported tokenizer as lockstep does.
    let bpe_tok = Tokenizer::load(tokenizer_json.to_str().unwrap()).unwrap();
    let hf_bpe = &reference["dirs"][3];
    assert_eq!(hf_bpe["ids"], json!(bpe_tok.encode(SAMPLE)));
    assert_eq!(hf_bpe["eos"], json!(["</s>", bpe_tok.eos_id()]));
    assert_eq!(hf_bpe["bos"], json!(["<s>", 0]));
    let generation: Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("hfbpe/generation_config.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(generation["eos_token_id"], json!(bpe_tok.eos_id()));
    assert_eq!(generation["bos_token_id"], 0);
    let hf_logits = |i: usize| {
        SafeFile::open(&dir.join(format!("logits_{i}.safetensors")))
            .unwrap()
            .tensor("logits")
            .unwrap()
    };

    // fp32: lockstep's logits from the export equal transformers' within 1e-5 relative.
    let ours = logits_of(&hf32, &g);
    let err = rel_l2(&ours, &hf_logits(0));
    let max_abs = (&ours - hf_logits(0)).abs().max().double_value(&[]);
    let scale = hf_logits(0).abs().max().double_value(&[]);
    eprintln!("fp32 export logits vs transformers: L2 {err:e}, max abs {max_abs:e} of {scale}");
    assert!(
        err < 1e-5 && max_abs / scale < 1e-5,
        "fp32 export logits differ: L2 {err:e}, max {max_abs:e} of {scale}"
    );
    let qwen_config = read_json(&dir.join("hfqwen/config.json"));
    assert_eq!(qwen_config["architectures"], json!(["Qwen3ForCausalLM"]));
    assert_eq!(qwen_config["head_dim"], 32);
    let err = rel_l2(&logits_of(&dir.join("hfqwen"), &g), &hf_logits(4));
    assert!(err < 1e-5, "Qwen3 export logits differ by {err:e}");
    for (i, name, class) in [
        (5, "hfqwenmoe", "Qwen3MoeForCausalLM"),
        (6, "hfmixtral", "MixtralForCausalLM"),
    ] {
        let config = read_json(&dir.join(name).join("config.json"));
        assert_eq!(config["architectures"], json!([class]));
        assert_eq!(config["num_experts_per_tok"], 2);
        let err = rel_l2(&logits_of(&dir.join(name), &g), &hf_logits(i));
        assert!(err < 1e-5, "{class} export logits differ by {err:e}");
    }
    let moe = read_json(&dir.join("hfqwenmoe/config.json"));
    assert_eq!(
        (
            moe["num_experts"].clone(),
            moe["decoder_sparse_step"].clone()
        ),
        (json!(4), json!(2))
    );
    // bf16: transformers computes in bf16 on the rounded weights; close to fp32, not equal.
    let err16 = rel_l2(&hf_logits(1), &ours);
    assert!(
        err16 < 3e-2,
        "bf16 export logits differ from fp32 by {err16:e}"
    );
    let ours16 = logits_of(&dir.join("hf16"), &g);
    assert!(rel_l2(&ours16, &ours) < 3e-2);
    // Sharded (step 5): lockstep loads the shards, and agrees with transformers on them.
    let ours_sharded = logits_of(&dir.join("sharded"), &g);
    let err = rel_l2(&ours_sharded, &hf_logits(2));
    assert!(err < 1e-5, "sharded export logits differ by {err:e}");
    assert!(
        rel_l2(&ours_sharded, &ours) > 1e-4,
        "step 5 and step 6 are different weights"
    );

    // eval: the text file vs transformers' mean CE over the same windows.
    let want = reference["eval"]["loss"].as_f64().unwrap();
    let windows = reference["eval"]["windows"].as_u64().unwrap();
    let eval = |model: &Path, data: &Path, extra: &[&str]| {
        let mut a = strings(&[
            "eval",
            "--model",
            model.to_str().unwrap(),
            "--data",
            data.to_str().unwrap(),
            "--json",
            "--context-length",
            "48",
            "--device",
            "cpu",
        ]);
        a.extend(strings(extra));
        json_of(&common::ok(dir, &a))
    };
    let got = eval(&hf32, &eval_file, &[]);
    assert_eq!(got["windows"].as_u64().unwrap(), windows);
    assert_eq!(got["tokens"].as_u64().unwrap(), windows * 48);
    let loss = got["loss"].as_f64().unwrap();
    eprintln!(
        "eval loss {loss} vs transformers {want}: {:e} relative",
        rel(loss, want)
    );
    assert!(
        rel(loss, want) < 1e-5,
        "eval loss {loss} vs transformers {want}"
    );
    assert!(rel(got["perplexity"].as_f64().unwrap(), want.exp()) < 1e-4);
    assert!(loss > 3.0 && loss < 11.0, "a briefly trained model: {loss}");
    // The same tokens as a .tok file, other batch sizes, and the checkpoint directory itself.
    let tok_path = dir.join("doc1.tok");
    let mut w = TokFileWriter::create(&tok_path, 2, tok.definition_hash()).unwrap();
    w.push_document(&stream).unwrap();
    w.finish().unwrap();
    for (model, data, extra) in [
        (&hf32, &tok_path, vec!["--batch-size", "3"]),
        (&ckpt, &eval_file, vec!["--batch-size", "1"]),
    ] {
        let l = eval(model, data, &extra)["loss"].as_f64().unwrap();
        assert!(
            rel(l, want) < 1e-5,
            "{} on {}: {l} vs {want}",
            model.display(),
            data.display()
        );
    }
    // --max-batches: the first windows only.
    let first = eval(
        &hf32,
        &eval_file,
        &["--batch-size", "2", "--max-batches", "1"],
    );
    assert_eq!(first["windows"], 2);
    assert!(rel(first["loss"].as_f64().unwrap(), loss) > 1e-6);

    // Errors name the path and the fix.
    for (args, expect) in [
        (
            vec!["eval", "--model", "missing", "--data", "x.txt"],
            "missing: no such directory",
        ),
        (
            vec!["eval", "--model", "hf32", "--data", "nothing.txt"],
            "--data nothing.txt: no such file",
        ),
        (
            vec!["generate", "--model", "corpus", "--prompt", "a"],
            "corpus: no config.json",
        ),
    ] {
        let out = common::run(dir, &strings(&args));
        let text = common::output_text(&out);
        assert!(
            !out.status.success() && text.contains(expect),
            "{args:?}: {text}"
        );
    }
    let mut cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(hf32.join("config.json")).unwrap()).unwrap();
    cfg["model_type"] = json!("gpt2");
    std::fs::create_dir(dir.join("gpt2")).unwrap();
    std::fs::write(dir.join("gpt2/config.json"), cfg.to_string()).unwrap();
    let out = common::run(
        dir,
        &strings(&["eval", "--model", "gpt2", "--data", "doc1.tok"]),
    );
    let text = common::output_text(&out);
    assert!(
        text.contains(
            "model_type \"gpt2\" is not a family lockstep trains; it trains llama, qwen3, \
             qwen3_moe, mixtral"
        ),
        "{text}"
    );
    // A MoE config.json whose k exceeds its experts: exit 2, the file and the valid range.
    let mut cfg = read_json(&dir.join("hfqwenmoe/config.json"));
    cfg["num_experts_per_tok"] = json!(9);
    std::fs::create_dir(dir.join("topk")).unwrap();
    std::fs::write(dir.join("topk/config.json"), cfg.to_string()).unwrap();
    let out = common::run(
        dir,
        &strings(&["eval", "--model", "topk", "--data", "doc1.tok"]),
    );
    let text = common::output_text(&out);
    assert!(
        out.status.code() == Some(2)
            && text.contains("topk/config.json: num_experts_per_tok = 9 with 4 experts; each token goes to 1..=4 of them"),
        "{text}"
    );
    // model.architecture naming another family than model_path's config.json: exit 2.
    let out = common::run(
        dir,
        &common::with(
            &base,
            &["train"],
            &[
                "--max-steps",
                "1",
                "--set",
                "model.model_path=hf32",
                "--set",
                "model.architecture=qwen3",
                "--set",
                "logging.run_name=mismatch",
            ],
        ),
    );
    let text = common::output_text(&out);
    assert!(!dir.join("runs/mismatch/checkpoints/step_1").exists());
    assert!(
        out.status.code() == Some(2)
            && text.contains("model.architecture = \"qwen3\" but hf32/config.json is a LlamaForCausalLM model (model_type \"llama\"); set model.architecture = \"llama\" or \"auto\""),
        "{text}"
    );

    // generate from the export: text in, text out, seeded sampling reproducible.
    let gen = |extra: &[&str]| {
        let mut a = strings(&[
            "generate",
            "--model",
            "hf32",
            "--prompt",
            "ROMEO:",
            "--max-new-tokens",
            "8",
            "--json",
            "--device",
            "cpu",
        ]);
        a.extend(strings(extra));
        json_of(&common::ok(dir, &a))
    };
    let a = gen(&["--seed", "1"]);
    assert_eq!(a["prompt_ids"], json!(tok.encode("ROMEO:")));
    let bpe_text = common::ok(
        dir,
        &strings(&[
            "generate",
            "--model",
            "hfbpe",
            "--prompt",
            "HAMLET:",
            "--max-new-tokens",
            "6",
            "--temperature",
            "0",
            "--device",
            "cpu",
        ]),
    );
    assert!(bpe_text.starts_with("HAMLET:"), "{bpe_text}");
    let same = gen(&["--seed", "1"]);
    assert_eq!(a["new_ids"], same["new_ids"], "same seed, same tokens");
    assert!(a["text"].is_string());
}

/// ASCII, punctuation, contractions, digit runs, tabs, whitespace runs, CRLF and blank lines,
/// accents (precomposed and combining), CJK, Cyrillic, Greek, emoji with joiners and skin
/// tones, Unicode spaces, and trailing whitespace after a newline.
const VARIED: &str = "Hello, World! It's 3.14159 -- isn't it? YOU'LL see.\n\n\tTabs,   runs of \
    spaces,\r\nCRLF; numbers 1234567890 and 42.\n\n\n  indented\nÜnïcödé café\u{301} naïve — \
    日本語のテキスト、中文，한국어 Ελληνικά Кириллица.\nEmoji: 🦀🚀 👩\u{200d}👩\u{200d}👧 👍🏽\
    \u{a0}nbsp\u{3000}wide  \n  ";

fn read_json(path: &Path) -> Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap()
}

/// An export of a model trained with a built-in tiktoken encoding carries a tokenizer.json
/// that transformers' AutoTokenizer loads: it encodes varied text to exactly lockstep's ids
/// and decodes them back, maps `<|endoftext|>` to the EOS id, and names the same eos/bos as
/// generation_config.json and config.json. lockstep's own tokenizer.json reader agrees too.
#[test]
fn export_of_tiktoken_model_loads_with_auto_tokenizer() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let corpus = common::write_corpus(dir);
    // Narrow models: o200k's 200k-row embeddings stay small.
    let narrow = [
        "model.hidden_size=16",
        "model.num_attention_heads=2",
        "model.num_key_value_heads=1",
        "model.intermediate_size=32",
        "model.num_layers=1",
    ];
    let encodings = ["gpt2", "cl100k_base", "o200k_base"];
    for name in encodings {
        let mut args = common::small(&corpus);
        for set in narrow.iter().map(|s| s.to_string()).chain([
            format!("data.tokenizer={name}"),
            format!("logging.run_name={name}"),
        ]) {
            args.extend(["--set".to_string(), set]);
        }
        common::ok(dir, &common::with(&args, &["train"], &["--max-steps", "1"]));
        common::ok(dir, &common::with(&args, &["export"], &["--hf", name]));
    }
    let special = "a<|endoftext|>b";
    let play = std::fs::read_to_string(corpus.join("doc0.txt")).unwrap();
    std::fs::write(
        dir.join("tokenizers.json"),
        json!({"dirs": encodings.map(|n| dir.join(n)), "texts": [VARIED, special, play]})
            .to_string(),
    )
    .unwrap();
    common::run_python(
        "tests/reference/hf_interop.py",
        &["tokenizers", dir.to_str().unwrap()],
    );
    let result = read_json(&dir.join("tokenizers_result.json"));
    for (i, name) in encodings.into_iter().enumerate() {
        let out = dir.join(name);
        let tok = Tokenizer::load(name).unwrap();
        let eos = tok.eos_id();
        let hf = &result[i];
        let varied = tok.encode(VARIED);
        assert_eq!(
            hf["texts"][0]["ids"],
            json!(varied),
            "{name}: AutoTokenizer ids"
        );
        assert_eq!(
            hf["texts"][0]["decoded"], VARIED,
            "{name}: AutoTokenizer decode"
        );
        // transformers reads the special token's spelling as the token; lockstep's training
        // text keeps it ordinary text.
        let with_eos = [tok.encode("a"), vec![eos], tok.encode("b")].concat();
        assert_eq!(hf["texts"][1]["ids"], json!(with_eos), "{name}");
        assert_eq!(hf["texts"][1]["decoded"], special, "{name}");
        assert_eq!(
            hf["texts"][2]["ids"],
            json!(tok.encode(&play)),
            "{name}: 30 kB of a play"
        );
        assert_eq!(hf["eos"], json!(["<|endoftext|>", eos]), "{name}");
        assert_eq!(hf["bos"], json!(["<|endoftext|>", eos]), "{name}");

        let generation = read_json(&out.join("generation_config.json"));
        let config = read_json(&out.join("config.json"));
        for (file, v) in [("generation_config", &generation), ("config", &config)] {
            assert_eq!(v["eos_token_id"], hf["eos"][1], "{name}: {file}.json eos");
            assert_eq!(v["bos_token_id"], hf["bos"][1], "{name}: {file}.json bos");
        }
        let tc = read_json(&out.join("tokenizer_config.json"));
        assert_eq!(tc["add_bos_token"], false, "{name}: lockstep adds no BOS");
        let map = read_json(&out.join("special_tokens_map.json"));
        assert_eq!(map["eos_token"], tc["eos_token"]);
        assert_eq!(map["bos_token"], tc["bos_token"]);
        // lockstep.json keeps the encoding's name, for lockstep's own eval/generate.
        assert_eq!(read_json(&out.join("lockstep.json"))["tokenizer"], name);
        // lockstep's reader of tokenizer.json files (tokenizers crate, special spellings kept
        // ordinary) gives tiktoken's ids too.
        let file = Tokenizer::load(out.join("tokenizer.json").to_str().unwrap()).unwrap();
        assert_eq!(file.eos_id(), eos, "{name}");
        for (k, text) in [VARIED, special, &play].into_iter().enumerate() {
            assert_eq!(file.encode(text), tok.encode(text), "{name}: text {k}");
        }
    }
}

fn greedy(eos: Vec<i64>, max_new_tokens: usize) -> GenerateOptions {
    GenerateOptions {
        max_new_tokens,
        temperature: 0.0,
        top_p: 1.0,
        seed: 0,
        eos,
    }
}

/// Greedy `lockstep generate` (KV-cached and not) of the random model `hf_interop.py generate
/// DIR extra…` saved, against transformers' `generate`: the prompts, transformers' outputs, the
/// EOS id and the token limit.
fn cli_generate_matches_transformers(
    dir: &Path,
    extra_args: &[&str],
) -> (Vec<Vec<i64>>, Vec<Vec<i64>>, i64, usize) {
    let mut args = vec!["generate", dir.to_str().unwrap()];
    args.extend(extra_args);
    common::run_python("tests/reference/hf_interop.py", &args);
    let reference: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("generate.json")).unwrap()).unwrap();
    let ids = |v: &Value| -> Vec<i64> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_i64().unwrap())
            .collect()
    };
    let prompts: Vec<Vec<i64>> = reference["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .map(ids)
        .collect();
    let outputs: Vec<Vec<i64>> = reference["outputs"]
        .as_array()
        .unwrap()
        .iter()
        .map(ids)
        .collect();
    let eos = reference["eos"].as_i64().unwrap();
    let n = reference["max_new_tokens"].as_u64().unwrap() as usize;
    let model_dir = dir.join("model");
    assert_eq!(hf::eos_token_ids(&model_dir).unwrap(), Some(vec![eos]));

    // The CLI, cached and not, against transformers.
    for (prompt, want) in prompts.iter().zip(&outputs) {
        let list = prompt
            .iter()
            .map(i64::to_string)
            .collect::<Vec<_>>()
            .join(",");
        for extra in [None, Some("--no-kv-cache")] {
            let mut a = strings(&[
                "generate",
                "--model",
                model_dir.to_str().unwrap(),
                "--prompt-ids",
                &list,
                "--max-new-tokens",
                &n.to_string(),
                "--temperature",
                "0",
                "--json",
                "--device",
                "cpu",
            ]);
            a.extend(extra.map(String::from));
            let got = json_of(&common::ok(dir, &a));
            assert_eq!(&ids(&got["new_ids"]), want, "prompt {prompt:?} ({extra:?})");
            let stop = if want.len() < n {
                "eos"
            } else {
                "max_new_tokens"
            };
            assert_eq!(got["stop"], stop);
        }
    }
    (prompts, outputs, eos, n)
}

/// The same for Qwen3 (q_norm/k_norm, head_dim apart from hidden / heads).
#[test]
fn qwen3_generate_matches_transformers() {
    tch::set_num_threads(1);
    let tmp = tempfile::tempdir().unwrap();
    let (_, outputs, _, _) = cli_generate_matches_transformers(tmp.path(), &["--qwen3"]);
    assert!(outputs.iter().all(|o| !o.is_empty()));
}

/// The same for the mixtures of experts: Qwen3-MoE (a dense layer among sparse ones) and
/// Mixtral, each token's experts chosen by lockstep's router as transformers' does.
#[test]
fn moe_generate_matches_transformers() {
    tch::set_num_threads(1);
    for family in ["--qwen3-moe", "--mixtral"] {
        let tmp = tempfile::tempdir().unwrap();
        let (_, outputs, _, _) = cli_generate_matches_transformers(tmp.path(), &[family]);
        assert!(outputs.iter().all(|o| !o.is_empty()), "{family}");
    }
}

/// Greedy `lockstep generate` on a random model saved by transformers emits exactly
/// transformers' `generate(do_sample=False)` tokens, stopping at the EOS of its
/// generation_config.json; KV-cached decoding equals recomputing the whole sequence.
#[test]
fn generate_matches_transformers_and_cache_matches_recompute() {
    tch::set_num_threads(1);
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let (prompts, outputs, eos, n) = cli_generate_matches_transformers(dir, &[]);
    let model_dir = dir.join("model");
    assert!(
        outputs[0].len() < n && outputs[0].last() == Some(&eos),
        "prompt 0 stops at EOS"
    );
    assert!(
        outputs[1..].iter().all(|o| o.len() == n),
        "the others run to the limit"
    );

    // Library level, both attention backends: cached greedy == recomputed greedy, and the cache's
    // logits equal full forward passes, whether the prompt goes in at once or in chunks.
    for backend in [AttentionBackend::Sdpa, AttentionBackend::Math] {
        let (_vs, model) =
            hf::load_model(&model_dir, Device::Cpu, Kind::Float, 128, backend).unwrap();
        for prompt in &prompts {
            let cached = generate(&model, prompt, &greedy(vec![], 40), Device::Cpu).unwrap();
            let recomputed =
                generate_uncached(&model, prompt, &greedy(vec![], 40), Device::Cpu).unwrap();
            assert_eq!(
                cached.tokens, recomputed.tokens,
                "{backend}: prompt {prompt:?}"
            );
            assert_eq!(cached.tokens.len(), 40);
        }
        check_cache_logits(&model, &prompts[2], backend);
        // Seeded sampling: the same tokens cached or not, and for the same seed.
        let sampling = GenerateOptions {
            temperature: 0.9,
            top_p: 0.9,
            seed: 5,
            ..greedy(vec![], 30)
        };
        let a = generate(&model, &prompts[0], &sampling, Device::Cpu).unwrap();
        let b = generate_uncached(&model, &prompts[0], &sampling, Device::Cpu).unwrap();
        let c = generate(
            &model,
            &prompts[0],
            &GenerateOptions {
                seed: 6,
                ..sampling.clone()
            },
            Device::Cpu,
        )
        .unwrap();
        assert_eq!(
            a.tokens, b.tokens,
            "{backend}: sampled, cached vs recomputed"
        );
        assert_ne!(a.tokens, c.tokens, "{backend}: another seed, other tokens");
        let g = generate(&model, &prompts[0], &greedy(vec![], 30), Device::Cpu).unwrap();
        assert_ne!(
            a.tokens, g.tokens,
            "sampling at temperature 0.9 is not greedy"
        );
    }
}

/// Logits of forward_with_cache, fed `tokens` in chunks (a multi-token prefill, then several
/// tokens on top of a cache, then single tokens), equal one forward pass over all of them.
fn check_cache_logits(model: &Llama, prompt: &[i64], backend: AttentionBackend) {
    let tokens = Tensor::from_slice(prompt).view([1, -1]);
    let full = tch::no_grad(|| model.forward(&tokens));
    let len = prompt.len() as i64;
    let mut cache = KvCache::new(model, 1, prompt.len());
    let mut parts = Vec::new();
    let mut at = 0;
    for size in [5, 4, 1, 1].iter().copied().chain(std::iter::repeat(3)) {
        if at >= len {
            break;
        }
        let size = size.min(len - at);
        let chunk = tokens.narrow(1, at, size);
        parts.push(tch::no_grad(|| {
            model.forward_with_cache(&chunk, &mut cache)
        }));
        at += size;
        assert_eq!(cache.len() as i64, at);
    }
    let cached = Tensor::cat(&parts, 1);
    let err = rel_l2(&cached, &full);
    eprintln!("{backend}: chunked cached logits vs forward: {err:e} relative (L2)");
    assert!(
        err < 1e-5,
        "{backend}: cached logits differ from forward by {err:e}"
    );
}
