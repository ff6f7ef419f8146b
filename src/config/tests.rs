use std::collections::BTreeSet;
use std::io::Write;

use super::*;

fn with_file(json: &str) -> (tempfile::NamedTempFile, Sources) {
    let mut f = tempfile::NamedTempFile::new().unwrap();
    f.write_all(json.as_bytes()).unwrap();
    let src = Sources {
        config_file: Some(f.path().to_path_buf()),
        ..Default::default()
    };
    (f, src)
}

fn error_of(src: &Sources) -> String {
    resolve(src).expect_err("config should be rejected").0
}

#[test]
fn presets_have_the_documented_shapes() {
    let prod = resolve(&Sources::default()).unwrap();
    assert_eq!(prod.preset, "production");
    let m = &prod.config.model;
    assert_eq!(
        (
            m.num_layers,
            m.hidden_size,
            m.num_attention_heads,
            m.num_key_value_heads
        ),
        (4, 4096, 32, 8)
    );
    assert_eq!((m.intermediate_size, m.rope_theta), (14336, 500000.0));
    assert_eq!(
        (
            prod.config.training.context_length,
            prod.config.training.max_steps
        ),
        (8192, 100)
    );
    assert_eq!(prod.config.training.learning_rate, 1e-5);

    let debug = resolve(&Sources {
        preset: Some("debug".into()),
        ..Default::default()
    })
    .unwrap()
    .config;
    assert_eq!(
        (
            debug.model.num_layers,
            debug.training.max_steps,
            debug.training.context_length
        ),
        (2, 10, 512)
    );
    assert_eq!(debug.training.learning_rate, 1e-7);
    assert!(debug.training.nan_check && debug.logging.verbose);

    let tiny = resolve(&Sources {
        preset: Some("tiny".into()),
        ..Default::default()
    })
    .unwrap()
    .config;
    assert_eq!(
        (
            tiny.model.hidden_size,
            tiny.model.num_layers,
            tiny.model.intermediate_size
        ),
        (256, 4, 688)
    );
}

#[test]
fn layers_apply_in_order_file_then_set_then_flags() {
    let (_f, mut src) =
        with_file(r#"{"training": {"batch_size": 3, "max_steps": 7, "learning_rate": 2e-4}}"#);
    src.sets = vec![
        "training.max_steps=9".into(),
        "data.path=corpus dir/a.txt".into(),
    ];
    let c = resolve(&src).unwrap().config;
    assert_eq!(
        (
            c.training.batch_size,
            c.training.max_steps,
            c.training.learning_rate
        ),
        (3, 9, 2e-4)
    );
    assert_eq!(c.data.path, "corpus dir/a.txt");
    // Untouched keys keep the preset's value (deep merge, not replacement of the section).
    assert_eq!(c.training.context_length, 8192);
    src.max_steps = Some(11);
    assert_eq!(resolve(&src).unwrap().config.training.max_steps, 11);
}

#[test]
fn aliases_map_to_canonical_keys() {
    let (_f, src) =
        with_file(r#"{"training": {"grad_accum_steps": 4}, "model": {"init_from": "hf/llama"}}"#);
    let c = resolve(&src).unwrap().config;
    assert_eq!(c.training.grad_accum_nums, 4);
    assert_eq!(c.model.model_path.as_deref(), Some("hf/llama"));
    let c = resolve(&Sources {
        sets: vec!["training.grad_accum_steps=2".into()],
        ..Default::default()
    })
    .unwrap()
    .config;
    assert_eq!(c.training.grad_accum_nums, 2);
}

#[test]
fn unknown_keys_name_the_file_and_suggest_the_nearest() {
    let (f, src) = with_file(r#"{"training": {"batch_sise": 4}}"#);
    let e = error_of(&src);
    assert!(e.contains(&f.path().display().to_string()), "{e}");
    assert!(
        e.contains("training.batch_sise") && e.contains("did you mean \"training.batch_size\""),
        "{e}"
    );

    let (_f, src) = with_file(r#"{"model": {"learning_rate": 1e-3}}"#);
    assert!(error_of(&src).contains("training.learning_rate"));

    let e = error_of(&Sources {
        sets: vec!["trainig.max_steps=3".into()],
        ..Default::default()
    });
    assert!(
        e.contains("--set trainig.max_steps=3") && e.contains("training.max_steps"),
        "{e}"
    );

    let (_f, src) = with_file(r#"{"optimizer": {"lr": 1}}"#);
    assert!(error_of(&src).contains("unknown section \"optimizer\""));
}

#[test]
fn wrong_types_name_key_value_and_expectation() {
    let (_f, src) = with_file(r#"{"training": {"batch_size": "eight"}}"#);
    let e = error_of(&src);
    assert!(
        e.contains("training.batch_size = \"eight\"") && e.contains("integer >= 1"),
        "{e}"
    );
    let e = error_of(&Sources {
        sets: vec!["training.batch_size=-1".into()],
        ..Default::default()
    });
    assert!(
        e.contains("--set training.batch_size=-1: expected integer >= 1"),
        "{e}"
    );
    let e = error_of(&Sources {
        sets: vec!["system.device=tpu".into()],
        ..Default::default()
    });
    assert!(e.contains("one of auto | cpu | cuda"), "{e}");
    let e = error_of(&Sources {
        sets: vec!["training.max_steps".into()],
        ..Default::default()
    });
    assert!(e.contains("expected section.key=value"), "{e}");
}

#[test]
fn malformed_json_reports_line_and_column() {
    let (_f, src) = with_file("{\n  \"training\": {\"batch_size\": 4,}\n}");
    let e = error_of(&src);
    assert!(e.contains("not valid JSON at line 2"), "{e}");
    let missing = Sources {
        config_file: Some("/nonexistent/cfg.json".into()),
        ..Default::default()
    };
    assert!(error_of(&missing).contains("/nonexistent/cfg.json: cannot read"));
}

#[test]
fn impossible_shapes_are_rejected_with_a_fix() {
    let set = |s: &[&str]| Sources {
        sets: s.iter().map(|x| x.to_string()).collect(),
        ..Default::default()
    };
    let e = error_of(&set(&["model.num_attention_heads=30"]));
    assert!(
        e.contains("model.num_attention_heads = 30 does not divide model.hidden_size = 4096"),
        "{e}"
    );
    assert!(e.contains("e.g. 32"), "{e}");
    let e = error_of(&set(&["model.head_dim=7"]));
    assert!(
        e.contains("model.head_dim = 7: RoPE needs an even head dimension"),
        "{e}"
    );
    let e = error_of(&set(&["model.architecture=deepseek"]));
    assert!(
        e.contains(
            "model.architecture=deepseek: expected one of auto | llama | qwen3 | qwen3_moe | mixtral"
        ),
        "{e}"
    );
    // Mixtures of experts: experts only for a MoE family, k within them, a width TP splits.
    let e = error_of(&set(&["model.num_experts=8"]));
    assert!(
        e.contains("model.num_experts = 8: model.architecture = \"auto\" is a dense family"),
        "{e}"
    );
    let e = error_of(&set(&["model.architecture=mixtral"]));
    assert!(
        e.contains(
            "model.architecture = \"mixtral\" is a mixture of experts and model.num_experts = 0"
        ),
        "{e}"
    );
    let e = error_of(&set(&[
        "model.architecture=qwen3_moe",
        "model.num_experts=4",
        "model.num_experts_per_tok=5",
    ]));
    assert!(
        e.contains("model.num_experts_per_tok = 5 exceeds model.num_experts = 4")
            && e.contains("valid: 1..=4"),
        "{e}"
    );
    let e = error_of(&set(&[
        "model.architecture=mixtral",
        "model.num_experts=8",
        "model.moe_intermediate_size=100",
    ]));
    assert!(
        e.contains("model.moe_intermediate_size = 100: a Mixtral expert"),
        "{e}"
    );
    let e = error_of(&set(&["model.router_aux_loss_coef=-0.1"]));
    assert!(
        e.contains("model.router_aux_loss_coef = -0.1: a negative weight"),
        "{e}"
    );
    let e = error_of(&set(&[
        "model.architecture=qwen3_moe",
        "model.num_experts=8",
        "model.moe_intermediate_size=100",
        "system.tensor_parallel=8",
    ]));
    assert!(
        e.contains("system.tensor_parallel = 8: must divide")
            && e.contains("and of each expert (width 100)")
            && e.contains("valid: 1, 2, 4"),
        "{e}"
    );
    assert!(crate::config::resolve(&Sources {
        preset: Some("qwen3-moe-tiny".into()),
        ..Default::default()
    })
    .is_ok());
    // With head_dim set, the heads need not divide hidden_size (Qwen3-0.6B: d 1024, 16 heads
    // of 128).
    assert!(crate::config::resolve(&set(&[
        "model.num_attention_heads=24",
        "model.head_dim=128"
    ]))
    .is_ok());
    let e = error_of(&set(&["model.num_key_value_heads=5"]));
    assert!(
        e.contains("model.num_key_value_heads = 5 does not divide model.num_attention_heads = 32"),
        "{e}"
    );
    let e = error_of(&set(&["training.context_length=200000"]));
    assert!(
        e.contains("exceeds model.max_position_embeddings = 131072"),
        "{e}"
    );
    let e = error_of(&set(&["system.dist_backend=nccl", "system.device=cpu"]));
    assert!(
        e.contains("system.dist_backend = nccl needs CUDA ranks, but system.device = cpu"),
        "{e}"
    );
    let e = error_of(&set(&["training.min_lr=1"]));
    assert!(e.contains("training.min_lr"), "{e}");
    let e = error_of(&Sources {
        preset: Some("huge".into()),
        ..Default::default()
    });
    assert!(
        e.contains("available presets: production, debug, tiny"),
        "{e}"
    );
}

#[test]
fn schema_table_and_typed_struct_agree() {
    let json = resolve(&Sources::default()).unwrap().to_json();
    fn leaves(prefix: &str, v: &serde_json::Value, out: &mut BTreeSet<String>) {
        match v.as_object() {
            // `data.sources` is one key whose value is a list, not a group.
            Some(obj) => {
                for (k, inner) in obj {
                    let key = if prefix.is_empty() {
                        k.clone()
                    } else {
                        format!("{prefix}.{k}")
                    };
                    leaves(&key, inner, out);
                }
            }
            None => {
                out.insert(prefix.to_string());
            }
        }
    }
    let mut from_struct = BTreeSet::new();
    leaves("", &json, &mut from_struct);
    let from_table: BTreeSet<String> = schema::KEYS.iter().map(|k| k.key.to_string()).collect();
    assert_eq!(from_struct, from_table);
}

#[test]
fn config_docs_are_current() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/docs/CONFIG.md");
    let on_disk = std::fs::read_to_string(path).unwrap_or_default();
    assert!(
        on_disk == schema::markdown_table(),
        "docs/CONFIG.md is stale: run `lockstep config --markdown > docs/CONFIG.md`"
    );
}

#[test]
fn data_sources_are_a_checked_list_of_records() {
    let (_f, src) = with_file(
        r#"{"data": {"sources": [
            {"path": "web.jsonl", "weight": 0.7},
            {"path": "code/", "weight": 0.3, "text_field": "content", "name": "code"}
        ], "document_masking": true}}"#,
    );
    let c = resolve(&src).unwrap().config;
    assert_eq!(c.data.sources.len(), 2);
    assert_eq!(
        (c.data.sources[0].path.as_str(), c.data.sources[0].weight),
        ("web.jsonl", 0.7)
    );
    assert_eq!(c.data.sources[0].text_field, None);
    assert_eq!(c.data.sources[1].text_field.as_deref(), Some("content"));
    assert!(c.data.document_masking && !c.data.reset_position_ids);
    // The resolved config (what checkpoints and the worker spec carry) reads back the same.
    let back: Config =
        serde_json::from_value(Resolved::new(c.clone(), "x".into()).unwrap().to_json()).unwrap();
    assert_eq!(back, c);

    let set = |s: &str| Sources {
        sets: vec![s.to_string()],
        ..Default::default()
    };
    let c = resolve(&set(r#"data.sources=[{"path":"a.txt","weight":1}]"#))
        .unwrap()
        .config;
    assert_eq!(c.data.sources[0].weight, 1.0);

    let e = error_of(&set(r#"data.sources=[{"path":"a.txt","wieght":1}]"#));
    assert!(
        e.contains("data.sources[0] has an unknown field \"wieght\" (did you mean \"weight\"?)"),
        "{e}"
    );
    let e = error_of(&set(r#"data.sources=[{"path":"a.txt"}]"#));
    assert!(e.contains("data.sources[0] has no \"weight\""), "{e}");
    let e = error_of(&set(r#"data.sources=[{"path":"a.txt","weight":"half"}]"#));
    assert!(
        e.contains("data.sources[0].weight = \"half\" is not allowed; expected number"),
        "{e}"
    );
    let e = error_of(&set("data.sources=a.txt"));
    assert!(
        e.contains("expected list of {path: string, weight: number"),
        "{e}"
    );
    // A typo of the key itself still gets the nearest key.
    let e = error_of(&set(r#"data.source=[]"#));
    assert!(e.contains("did you mean \"data.sources\""), "{e}");
}

#[test]
fn data_sources_rules_name_the_entry_and_the_fix() {
    let sets = |s: &[&str]| Sources {
        sets: s.iter().map(|x| x.to_string()).collect(),
        ..Default::default()
    };
    let e = error_of(&sets(&[
        "data.path=corpus.txt",
        r#"data.sources=[{"path":"a.txt","weight":1}]"#,
    ]));
    assert!(
        e.contains("data.path = \"corpus.txt\" and data.sources are both set"),
        "{e}"
    );
    let e = error_of(&sets(&[
        r#"data.sources=[{"path":"a.txt","weight":1},{"path":"b.txt","weight":0}]"#,
    ]));
    assert!(e.contains("data.sources[1].weight = 0: must be > 0"), "{e}");
    let e = error_of(&sets(&[
        r#"data.sources=[{"path":"a.txt","weight":1},{"path":"b.txt","weight":1e-6}]"#,
    ]));
    assert!(e.contains("data.sources[1].weight = 0.000001"), "{e}");
    let e = error_of(&sets(&[
        r#"data.sources=[{"path":"a","weight":1,"name":"x"},{"path":"b","weight":1,"name":"x"}]"#,
    ]));
    assert!(
        e.contains("data.sources[1].name = \"x\" is used twice"),
        "{e}"
    );
    let e = error_of(&sets(&[r#"data.sources=[{"path":" ","weight":1}]"#]));
    assert!(e.contains("data.sources[0].path is empty"), "{e}");
}

#[test]
fn tracker_groups_nest_and_their_mistakes_are_named() {
    let sets = |v: &[&str]| Sources {
        sets: v.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    };
    // A group in a file, and a list both as JSON and comma-separated.
    let (_f, src) = with_file(
        r#"{"logging": {"wandb": {"project": "p", "tags": ["a", "b"]}, "mlflow": {"experiment": "e"}}}"#,
    );
    let c = resolve(&src).unwrap().config;
    assert_eq!(c.logging.wandb.project.as_deref(), Some("p"));
    assert_eq!(c.logging.wandb.tags, ["a", "b"]);
    assert_eq!(c.logging.mlflow.experiment.as_deref(), Some("e"));
    let c = resolve(&sets(&["logging.wandb.tags=x, y"])).unwrap().config;
    assert_eq!(c.logging.wandb.tags, ["x", "y"]);
    for (bad, says) in [
        (
            "logging.wandb.mode=sometimes",
            "is not a W&B mode; use one of online, offline",
        ),
        (
            "logging.mlflow.tracking_uri=file:///m",
            "not a file store or other scheme",
        ),
        (
            "logging.wandb.project=",
            "logging.wandb.project is an empty string",
        ),
        (
            "logging.wandb.projekt=x",
            "did you mean \"logging.wandb.project\"",
        ),
        (
            "logging.wandb={}",
            "logging.wandb is a group of keys (project, entity",
        ),
    ] {
        let e = error_of(&sets(&[bad]));
        assert!(e.contains(says), "{bad}: {e}");
    }
    let (_f, src) = with_file(r#"{"logging": {"wandb": "p"}}"#);
    let e = error_of(&src);
    assert!(e.contains("\"logging.wandb\" must be an object"), "{e}");
    let (_f, src) = with_file(r#"{"logging": {"mlflow": {"tracking_url": "http://x"}}}"#);
    let e = error_of(&src);
    assert!(
        e.contains("did you mean \"logging.mlflow.tracking_uri\""),
        "{e}"
    );
}

/// `system.expert_parallel`: against the ranks (it is carved out of the data-parallel ones)
/// and the model's experts, each refusal naming the key, the value and what is valid; it
/// composes with zero stage 3 and tensor parallelism.
#[test]
fn expert_parallel_degrees_are_checked_with_a_fix() {
    let cfg = |sets: &[&str]| {
        let mut s: Vec<String> = [
            "model.architecture=qwen3_moe",
            "model.num_experts=4",
            "model.moe_intermediate_size=32",
        ]
        .iter()
        .map(|x| x.to_string())
        .collect();
        s.extend(sets.iter().map(|x| x.to_string()));
        resolve(&Sources {
            sets: s,
            ..Default::default()
        })
    };
    let ok = cfg(&["system.expert_parallel=2"]).unwrap().config;
    assert!(check_world(&ok, 4).is_ok());
    let e = check_world(&ok, 3).unwrap_err().0;
    assert!(
        e.contains("system.expert_parallel = 2: must divide the 3 data-parallel ranks")
            && e.contains("valid here: 1, 3"),
        "{e}"
    );
    let e = check_world(&ok, 1).unwrap_err().0;
    assert!(
        e.contains("one rank has no group to split the experts over"),
        "{e}"
    );
    let e = cfg(&["system.expert_parallel=3"])
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("system.expert_parallel = 3 must divide the 4 experts per layer")
            && e.contains("valid: 1, 2, 4"),
        "{e}"
    );
    let e = cfg(&[
        "system.expert_parallel=2",
        "model.architecture=llama",
        "model.num_experts=0",
    ])
    .err()
    .unwrap()
    .to_string();
    assert!(
        e.contains("is a dense model; set system.expert_parallel = 1"),
        "{e}"
    );
    for with in ["system.zero_stage=3", "system.tensor_parallel=2"] {
        assert!(cfg(&["system.expert_parallel=2", with]).is_ok(), "{with}");
    }
    // Hybrid sharding: an expert-parallel group inside a shard group.
    let hybrid = |ep: &str| {
        cfg(&[ep, "system.zero_stage=2", "system.shard_degree=2"])
            .unwrap()
            .config
    };
    assert!(check_world(&hybrid("system.expert_parallel=2"), 4).is_ok());
    let e = check_world(&hybrid("system.expert_parallel=4"), 8)
        .unwrap_err()
        .0;
    assert!(
        e.contains("system.expert_parallel = 4 must divide system.shard_degree = 2")
            && e.contains("valid shard degrees here: 4, 8, or 0"),
        "{e}"
    );
}

/// The pipeline's keys: each refusal names the key, the value and what is valid, and the
/// other dimensions are checked on one stage's ranks.
#[test]
fn pipeline_keys_are_checked_with_a_fix() {
    let cfg = |sets: &[&str]| {
        let mut s = vec!["model.num_layers=8".to_string()];
        s.extend(sets.iter().map(|x| x.to_string()));
        resolve(&Sources {
            sets: s,
            ..Default::default()
        })
    };
    let err = |sets: &[&str]| cfg(sets).unwrap_err().to_string();
    let ok = cfg(&["system.pipeline_parallel=4"]).unwrap().config;
    assert!(check_world(&ok, 8).is_ok());
    let e = check_world(&ok, 6).unwrap_err().0;
    assert!(
        e.contains("system.pipeline_parallel = 4: must divide the number of ranks, 6")
            && e.contains("valid here: 1, 2, 3, 6"),
        "{e}"
    );
    // The other dimensions on one stage's ranks: 8 ranks over 4 stages are 2.
    let tp = cfg(&["system.pipeline_parallel=4", "system.tensor_parallel=4"])
        .unwrap()
        .config;
    let e = check_world(&tp, 8).unwrap_err().0;
    assert!(
        e.contains("system.tensor_parallel = 4: must divide the number of ranks, 2")
            && e.contains(
                "per pipeline stage: the 8 ranks over system.pipeline_parallel = 4 are 2"
            ),
        "{e}"
    );
    let e = err(&["system.pipeline_parallel=16"]);
    assert!(
        e.contains("system.pipeline_parallel = 16 = 16 pipeline stages, and the model has 8")
            && e.contains("use at most 8 pipeline ranks"),
        "{e}"
    );
    let e = err(&[
        "system.pipeline_parallel=4",
        "system.pipeline_schedule=interleaved",
        "system.virtual_stages=4",
        "training.grad_accum_nums=4",
    ]);
    assert!(
        e.contains("× system.virtual_stages = 4 = 16 pipeline stages")
            && e.contains("use at most 2 pipeline ranks here"),
        "{e}"
    );
    let e = err(&["system.pipeline_parallel=2", "system.virtual_stages=2"]);
    assert!(
        e.contains("system.virtual_stages = 2 is for system.pipeline_schedule = interleaved, and the schedule is 1f1b"),
        "{e}"
    );
    let e = err(&[
        "system.pipeline_parallel=2",
        "system.pipeline_schedule=zbv",
        "system.virtual_stages=2",
    ]);
    assert!(
        e.contains("(which always puts two stages on every rank, in a V)"),
        "{e}"
    );
    let e = err(&[
        "system.pipeline_parallel=2",
        "system.pipeline_schedule=interleaved",
    ]);
    assert!(
        e.contains("system.virtual_stages = 1; set it to 2 or more"),
        "{e}"
    );
    let e = err(&[
        "system.pipeline_parallel=4",
        "system.pipeline_schedule=interleaved",
        "system.virtual_stages=2",
        "training.grad_accum_nums=6",
    ]);
    assert!(
        e.contains("training.grad_accum_nums = 6 is not a multiple of 4; use 8 (or 4)"),
        "{e}"
    );
    let e = err(&["system.pipeline_schedule=bogus"]);
    assert!(e.contains("1f1b") && e.contains("zbv"), "{e}");
    // `train` refuses pipelines until their runtime lands; `plan` takes them.
    let e = check_trains(&ok).unwrap_err().0;
    assert!(
        e.contains("system.pipeline_parallel = 4: `lockstep plan` models"),
        "{e}"
    );
    assert!(check_trains(&cfg(&[]).unwrap().config).is_ok());
}
