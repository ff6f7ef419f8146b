//! Hugging Face ids missing from the hub cache are downloaded (src/data/hub/download.rs) from
//! `HF_ENDPOINT`, here a mock Hub this test runs on 127.0.0.1 that answers the requests lockstep
//! makes (`GET /{repo}/resolve/{revision}/{file}` with a Range, `x-repo-commit`, `etag` /
//! `x-linked-etag`, `content-range`) from a tiny Llama the test builds. Each lockstep run is a
//! subprocess with its own HF_HUB_CACHE / HF_HOME / HF_TOKEN, so tests stay independent.

use crate::common;

use common::strs;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Output;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use safetensors::tensor::{serialize, Dtype, TensorView};
use serde_json::json;

const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";
const TOKEN: &str = "hf_SeCrEt0123456789abcdefTOKEN";

/// WordLevel tokenizer.json, 8 ids, EOS `</s>` = 1.
const TOKENIZER: &str = r#"{"version": "1.0", "truncation": null, "padding": null,
 "added_tokens": [
  {"id": 0, "content": "<unk>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
  {"id": 1, "content": "</s>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}],
 "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
 "decoder": null,
 "model": {"type": "WordLevel", "vocab": {"<unk>": 0, "</s>": 1, "hello": 2, "world": 3, "to": 4, "be": 5, "or": 6, "not": 7}, "unk_token": "<unk>"}}"#;

/// A 2-layer Llama (vocab 8, hidden 16) as a Hub repo: config.json, two safetensors shards and
/// their index, tokenizer.json and tokenizer_config.json (no generation_config.json).
fn tiny_llama() -> BTreeMap<String, Vec<u8>> {
    let (vocab, d, ff, layers) = (8usize, 16usize, 32usize, 2usize);
    let config = json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
        "hidden_size": d, "intermediate_size": ff, "num_hidden_layers": layers,
        "num_attention_heads": 2, "num_key_value_heads": 2, "max_position_embeddings": 64,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "hidden_act": "silu",
        "tie_word_embeddings": false, "torch_dtype": "float32"
    });
    let mut shapes: Vec<(String, Vec<usize>)> =
        vec![("model.embed_tokens.weight".into(), vec![vocab, d])];
    for i in 0..layers {
        let p = format!("model.layers.{i}");
        for (n, s) in [
            ("input_layernorm", vec![d]),
            ("post_attention_layernorm", vec![d]),
            ("self_attn.q_proj", vec![d, d]),
            ("self_attn.k_proj", vec![d, d]),
            ("self_attn.v_proj", vec![d, d]),
            ("self_attn.o_proj", vec![d, d]),
            ("mlp.gate_proj", vec![ff, d]),
            ("mlp.up_proj", vec![ff, d]),
            ("mlp.down_proj", vec![d, ff]),
        ] {
            shapes.push((format!("{p}.{n}.weight"), s));
        }
    }
    shapes.push(("model.norm.weight".into(), vec![d]));
    shapes.push(("lm_head.weight".into(), vec![vocab, d]));
    // Deterministic small values; norms at 1.
    let data: Vec<(String, Vec<usize>, Vec<u8>)> = shapes
        .into_iter()
        .enumerate()
        .map(|(k, (name, shape))| {
            let n: usize = shape.iter().product();
            let bytes = (0..n)
                .flat_map(|j| {
                    let v = if name.contains("norm") {
                        1.0f32
                    } else {
                        ((j * 7 + k * 13) % 17) as f32 / 17.0 * 0.1 - 0.05
                    };
                    v.to_le_bytes()
                })
                .collect();
            (name, shape, bytes)
        })
        .collect();
    let shard_names = [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ];
    let mut files = BTreeMap::new();
    let mut weight_map = serde_json::Map::new();
    let half = data.len() / 2;
    for (s, part) in [&data[..half], &data[half..]].into_iter().enumerate() {
        let views: Vec<(String, TensorView)> = part
            .iter()
            .map(|(n, shape, b)| {
                (
                    n.clone(),
                    TensorView::new(Dtype::F32, shape.clone(), b).unwrap(),
                )
            })
            .collect();
        for (n, _, _) in part {
            weight_map.insert(n.clone(), json!(shard_names[s]));
        }
        files.insert(shard_names[s].to_string(), serialize(views, None).unwrap());
    }
    let index = json!({"metadata": {"total_size": 0}, "weight_map": weight_map});
    files.insert(
        "model.safetensors.index.json".into(),
        index.to_string().into_bytes(),
    );
    files.insert("config.json".into(), config.to_string().into_bytes());
    files.insert("tokenizer.json".into(), TOKENIZER.as_bytes().to_vec());
    files.insert(
        "tokenizer_config.json".into(),
        br#"{"eos_token": "</s>", "model_max_length": 64}"#.to_vec(),
    );
    files
}

/// One request the mock saw.
#[derive(Debug, Clone)]
struct Seen {
    path: String,
    authorization: Option<String>,
}

/// A mock Hub: repo `acme/tiny` at revisions main, v1 and its commit; `acme/private` answers 401
/// like the Hub does for a repo that is missing or needs a token.
struct MockHub {
    endpoint: String,
    seen: Arc<Mutex<Vec<Seen>>>,
}

impl MockHub {
    fn start(files: BTreeMap<String, Vec<u8>>) -> MockHub {
        MockHub::redirecting(files, None)
    }

    /// A Hub whose safetensors files live elsewhere: it answers them with a 302 to
    /// `{cdn}/{path}` carrying the commit and linked etag, as the Hub does for LFS files.
    fn redirecting(files: BTreeMap<String, Vec<u8>>, cdn: Option<String>) -> MockHub {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let endpoint = format!("http://{}", listener.local_addr().unwrap());
        let seen = Arc::new(Mutex::new(Vec::new()));
        let files = Arc::new(files);
        let log = seen.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(stream) = stream else { continue };
                let (files, log, cdn) = (files.clone(), log.clone(), cdn.clone());
                std::thread::spawn(move || answer(stream, &files, &log, cdn.as_deref()));
            }
        });
        MockHub { endpoint, seen }
    }

    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }
}

fn answer(
    stream: TcpStream,
    files: &BTreeMap<String, Vec<u8>>,
    log: &Mutex<Vec<Seen>>,
    cdn: Option<&str>,
) {
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let mut line = String::new();
    if reader.read_line(&mut line).unwrap_or(0) == 0 {
        return;
    }
    let mut parts = line.split_whitespace();
    let (method, path) = (
        parts.next().unwrap_or("").to_string(),
        parts.next().unwrap_or("").to_string(),
    );
    let mut headers = BTreeMap::new();
    loop {
        let mut h = String::new();
        if reader.read_line(&mut h).unwrap_or(0) == 0 || h.trim().is_empty() {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            headers.insert(k.trim().to_ascii_lowercase(), v.trim().to_string());
        }
    }
    log.lock().unwrap().push(Seen {
        path: path.clone(),
        authorization: headers.get("authorization").cloned(),
    });
    let mut out = stream;
    let respond = |out: &mut TcpStream, status: &str, extra: &[(&str, String)], body: &[u8]| {
        let mut head = format!(
            "HTTP/1.1 {status}\r\nContent-Length: {}\r\nConnection: close\r\n",
            body.len()
        );
        for (k, v) in extra {
            head.push_str(&format!("{k}: {v}\r\n"));
        }
        head.push_str("\r\n");
        let _ = out.write_all(head.as_bytes());
        if method != "HEAD" {
            let _ = out.write_all(body);
        }
        let _ = out.flush();
    };
    // /{owner}/{name}/resolve/{revision}/{file}
    let segs: Vec<&str> = path
        .split('?')
        .next()
        .unwrap_or("")
        .trim_start_matches('/')
        .splitn(5, '/')
        .collect();
    let [owner, name, "resolve", rev, file] = segs[..] else {
        return respond(&mut out, "400 Bad Request", &[], b"");
    };
    if format!("{owner}/{name}") != "acme/tiny" {
        let e = [("X-Error-Code", "RepoNotFound".to_string())];
        return respond(&mut out, "401 Unauthorized", &e, b"Repository not found");
    }
    if !["main", "v1", COMMIT].contains(&rev) {
        let e = [("X-Error-Code", "RevisionNotFound".to_string())];
        return respond(&mut out, "404 Not Found", &e, b"");
    }
    let Some(content) = files.get(file) else {
        let e = [("X-Error-Code", "EntryNotFound".to_string())];
        return respond(&mut out, "404 Not Found", &e, b"");
    };
    let hash = blake3::hash(content).to_hex().to_string();
    // Large (LFS) files carry x-linked-etag on the Hub; small ones a plain etag.
    let etag = if file.ends_with(".safetensors") {
        ("X-Linked-Etag", format!("\"{hash}\""))
    } else {
        ("ETag", format!("\"{hash}\""))
    };
    if let (Some(cdn), true) = (cdn, file.ends_with(".safetensors")) {
        let extra = [
            ("X-Repo-Commit", COMMIT.to_string()),
            etag,
            ("Location", format!("{cdn}{path}?X-Amz-Signature=abc")),
        ];
        return respond(&mut out, "302 Found", &extra, b"");
    }
    let len = content.len();
    let (from, to) = headers
        .get("range")
        .and_then(|r| r.strip_prefix("bytes="))
        .and_then(|r| r.split_once('-'))
        .map(|(a, b)| {
            let a: usize = a.parse().unwrap_or(0);
            let b: usize = b.parse().map_or(len - 1, |b: usize| b.min(len - 1));
            (a, b)
        })
        .unwrap_or((0, len - 1));
    let extra = [
        ("X-Repo-Commit", COMMIT.to_string()),
        etag,
        ("Content-Range", format!("bytes {from}-{to}/{len}")),
    ];
    respond(&mut out, "206 Partial Content", &extra, &content[from..=to]);
}

fn corpus(dir: &Path) -> PathBuf {
    let f = dir.join("corpus.txt");
    let line = "hello world to be or not to be hello world\n";
    std::fs::write(&f, line.repeat(60)).unwrap();
    f
}

/// A lockstep subprocess in `dir` with this test's hub environment (HF_* from the parent
/// cleared first).
fn lockstep(dir: &Path, env: &[(&str, &str)], args: &[&str]) -> (Output, String, f64) {
    let mut cmd = common::lockstep(dir);
    for k in [
        "HF_HUB_CACHE",
        "HUGGINGFACE_HUB_CACHE",
        "HF_HOME",
        "HF_ENDPOINT",
        "HF_TOKEN",
        "HUGGING_FACE_HUB_TOKEN",
        "HF_TOKEN_PATH",
        "HF_HUB_OFFLINE",
        "TRANSFORMERS_OFFLINE",
        "HF_HUB_ETAG_TIMEOUT",
        "HF_HUB_DOWNLOAD_TIMEOUT",
        "http_proxy",
        "https_proxy",
        "HTTP_PROXY",
        "HTTPS_PROXY",
        "ALL_PROXY",
        "all_proxy",
    ] {
        cmd.env_remove(k);
    }
    cmd.env("HF_HOME", dir.join("hf-home")).env("NO_PROXY", "*");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let start = Instant::now();
    let out = cmd.args(args).output().unwrap();
    let text = common::output_text(&out);
    (out, text, start.elapsed().as_secs_f64())
}

fn train_args<'a>(model: &'a str, corpus: &'a str, run: &'a str) -> Vec<String> {
    [
        "train",
        "--preset",
        "tiny",
        "--max-steps",
        "1",
        "--set",
        &format!("model.model_path={model}"),
        "--set",
        &format!("data.tokenizer={model}"),
        "--set",
        &format!("data.path={corpus}"),
        "--set",
        "data.val_fraction=0",
        "--set",
        "model.num_layers=2",
        "--set",
        "training.context_length=16",
        "--set",
        "training.batch_size=2",
        "--set",
        "training.warmup_steps=0",
        "--set",
        "training.eval_interval=0",
        "--set",
        "checkpoint.interval=0",
        "--set",
        "system.num_threads=1",
        "--set",
        &format!("logging.run_name={run}"),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

#[test]
fn downloads_with_token_then_uses_the_cache() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().canonicalize().unwrap();
    let files = tiny_llama();
    let hub = MockHub::start(files.clone());
    let cache = dir.join("hub-cache");
    let corpus = corpus(&dir);
    let cache_s = cache.to_str().unwrap().to_string();
    let env = [
        ("HF_ENDPOINT", hub.endpoint.as_str()),
        ("HF_HUB_CACHE", cache_s.as_str()),
        ("HF_TOKEN", TOKEN),
    ];

    // 1. Train one step from the model and tokenizer at tag v1: both downloaded.
    let args = train_args("acme/tiny@v1", corpus.to_str().unwrap(), "a");
    let (out, text, secs) = lockstep(&dir, &env, &strs(&args));
    assert!(out.status.success(), "{text}");
    assert!(text.contains("Loaded weights from acme/tiny@v1"), "{text}");
    assert!(!text.contains(TOKEN), "the token was printed:\n{text}");
    let repo = cache.join("models--acme--tiny");
    assert_eq!(
        std::fs::read_to_string(repo.join("refs/v1")).unwrap(),
        COMMIT
    );
    let snap = repo.join("snapshots").join(COMMIT);
    for (name, content) in &files {
        let f = snap.join(name);
        assert!(f.is_symlink(), "{name}: not a link into blobs/");
        assert_eq!(&std::fs::read(&f).unwrap(), content, "{name}");
    }
    assert!(!snap.join("generation_config.json").exists());
    // Only the ref asked for: files fetched by commit leave no refs/<commit>.
    let refs: Vec<_> = std::fs::read_dir(repo.join("refs")).unwrap().collect();
    assert_eq!(refs.len(), 1, "{refs:?}");
    let seen = hub.seen();
    assert!(!seen.is_empty());
    for s in &seen {
        assert_eq!(
            s.authorization.as_deref(),
            Some(format!("Bearer {TOKEN}").as_str()),
            "{s:?}"
        );
    }
    // The revision is resolved once; everything after the first file is fetched by commit.
    let paths: Vec<&str> = seen.iter().map(|s| s.path.as_str()).collect();
    assert!(
        paths.contains(&"/acme/tiny/resolve/v1/tokenizer.json")
            && paths.contains(&"/acme/tiny/resolve/v1/config.json")
            && paths.contains(
                &format!("/acme/tiny/resolve/{COMMIT}/model-00002-of-00002.safetensors").as_str()
            )
            && paths
                .contains(&format!("/acme/tiny/resolve/{COMMIT}/generation_config.json").as_str()),
        "{paths:#?}"
    );
    assert!(
        !paths.contains(&"/acme/tiny/resolve/v1/model.safetensors"),
        "{paths:#?}"
    );
    eprintln!(
        "download + 1 training step: {secs:.1}s, {} requests",
        seen.len()
    );

    // 2. The same model by commit, through eval: a cache hit, no request.
    let before = hub.seen().len();
    let id = format!("acme/tiny@{COMMIT}");
    let (out, text, _) = lockstep(
        &dir,
        &env,
        &[
            "eval",
            "--model",
            &id,
            "--data",
            corpus.to_str().unwrap(),
            "--device",
            "cpu",
            "--context-length",
            "16",
            "--max-batches",
            "1",
        ],
    );
    assert!(out.status.success(), "{text}");
    assert!(text.contains("loss"), "{text}");
    assert_eq!(
        hub.seen().len(),
        before,
        "the cached model was requested again"
    );
    // And training again from the tag: no request either.
    let args = train_args("acme/tiny@v1", corpus.to_str().unwrap(), "b");
    let (out, text, _) = lockstep(&dir, &env, &strs(&args));
    assert!(out.status.success(), "{text}");
    assert_eq!(
        hub.seen().len(),
        before,
        "the cached model was requested again"
    );

    // 3. Offline with an empty cache: the clear error, and the server is not contacted.
    let empty = dir.join("empty-cache");
    let offline = [
        ("HF_ENDPOINT", hub.endpoint.as_str()),
        ("HF_HUB_CACHE", empty.to_str().unwrap()),
        ("HF_TOKEN", TOKEN),
        ("HF_HUB_OFFLINE", "1"),
    ];
    let (out, text, _) = lockstep(
        &dir,
        &offline,
        &[
            "eval",
            "--model",
            "acme/tiny",
            "--data",
            corpus.to_str().unwrap(),
        ],
    );
    assert!(!out.status.success());
    assert!(
        text.contains("--model = \"acme/tiny\"")
            && text.contains("has no models--acme--tiny")
            && text.contains("HF_HUB_OFFLINE is set, so lockstep does not download")
            && text.contains("hf download acme/tiny"),
        "{text}"
    );
    assert!(!text.contains(TOKEN), "{text}");
    assert_eq!(
        hub.seen().len(),
        before,
        "offline, yet the server was contacted"
    );
}

#[test]
fn unreachable_or_refusing_hubs_fail_fast_and_clearly() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().canonicalize().unwrap();
    let corpus = corpus(&dir);
    let cache = dir.join("hub-cache");
    let cache_s = cache.to_str().unwrap().to_string();

    // A closed port: connection refused at once.
    let dead = {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}", l.local_addr().unwrap())
    };
    let env = [
        ("HF_ENDPOINT", dead.as_str()),
        ("HF_HUB_CACHE", cache_s.as_str()),
        ("HF_TOKEN", TOKEN),
    ];
    let (out, text, secs) = lockstep(
        &dir,
        &env,
        &[
            "eval",
            "--model",
            "acme/tiny",
            "--data",
            corpus.to_str().unwrap(),
        ],
    );
    assert!(!out.status.success());
    assert!(
        text.contains("--model = \"acme/tiny\"")
            && text.contains(&format!("downloading it from {dead} failed"))
            && text.contains("Connection refused")
            && text.contains("HF_HUB_OFFLINE=1")
            && text.contains("hf download acme/tiny"),
        "{text}"
    );
    assert!(!text.contains(TOKEN), "{text}");
    assert!(secs < 20.0, "took {secs:.1}s");

    // A server that accepts and never answers: the stall timeout ends it.
    let silent = TcpListener::bind("127.0.0.1:0").unwrap();
    let silent_url = format!("http://{}", silent.local_addr().unwrap());
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for s in silent.incoming() {
            held.push(s);
        }
    });
    let env = [
        ("HF_ENDPOINT", silent_url.as_str()),
        ("HF_HUB_CACHE", cache_s.as_str()),
        ("HF_HUB_ETAG_TIMEOUT", "1"),
    ];
    let (out, text, secs) = lockstep(
        &dir,
        &env,
        &[
            "eval",
            "--model",
            "acme/tiny",
            "--data",
            corpus.to_str().unwrap(),
        ],
    );
    assert!(!out.status.success());
    assert!(
        text.contains("no answer within 1s") && text.contains("HF_HUB_ETAG_TIMEOUT"),
        "{text}"
    );
    assert!(secs < 20.0, "took {secs:.1}s");

    // A repo the Hub refuses (401 without a token): the error says a token may be needed.
    let hub = MockHub::start(tiny_llama());
    let env = [
        ("HF_ENDPOINT", hub.endpoint.as_str()),
        ("HF_HUB_CACHE", cache_s.as_str()),
    ];
    let (out, text, _) = lockstep(
        &dir,
        &env,
        &[
            "prepare",
            "--preset",
            "tiny",
            "--set",
            "data.tokenizer=acme/private",
            "--set",
            &format!("data.path={}", corpus.display()),
        ],
    );
    assert!(!out.status.success());
    assert!(
        text.contains("data.tokenizer = \"acme/private\"")
            && text.contains("HTTP 401")
            && text.contains("set HF_TOKEN"),
        "{text}"
    );
    assert!(hub.seen().iter().all(|s| s.authorization.is_none()));
    // A token read from HF_TOKEN_PATH is sent, and not printed either.
    let token_file = dir.join("token");
    std::fs::write(&token_file, format!("{TOKEN}\n")).unwrap();
    let env = [
        ("HF_ENDPOINT", hub.endpoint.as_str()),
        ("HF_HUB_CACHE", cache_s.as_str()),
        ("HF_TOKEN_PATH", token_file.to_str().unwrap()),
    ];
    let (out, text, _) = lockstep(
        &dir,
        &env,
        &[
            "prepare",
            "--preset",
            "tiny",
            "--set",
            "data.tokenizer=acme/tiny",
            "--set",
            &format!("data.path={}", corpus.display()),
        ],
    );
    assert!(out.status.success(), "{text}");
    assert!(!text.contains(TOKEN), "{text}");
    let last = hub.seen().last().cloned().unwrap();
    assert_eq!(last.authorization, Some(format!("Bearer {TOKEN}")));
    assert!(cache
        .join("models--acme--tiny/snapshots")
        .join(COMMIT)
        .join("tokenizer_config.json")
        .is_file());
}

/// A mirror that redirects weight files to other hosts (S3, a CDN) must not hand them the
/// token: not to another host name, and not to the same host on another port (another
/// service); the Hub's own requests keep it, and the files arrive whole.
#[test]
fn the_token_never_follows_a_redirect_to_another_origin() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().canonicalize().unwrap();
    let files = tiny_llama();
    let corpus = corpus(&dir);
    for (case, host) in [("other host", "localhost"), ("other port", "127.0.0.1")] {
        let cdn = MockHub::start(files.clone());
        let port = cdn.endpoint.rsplit(':').next().unwrap().to_string();
        let hub = MockHub::redirecting(files.clone(), Some(format!("http://{host}:{port}")));
        let cache = dir.join(format!("cache-{host}"));
        let env = [
            ("HF_ENDPOINT", hub.endpoint.as_str()),
            ("HF_HUB_CACHE", cache.to_str().unwrap()),
            ("HF_TOKEN", TOKEN),
        ];
        let run = format!("r-{host}");
        let args = train_args("acme/tiny", corpus.to_str().unwrap(), &run);
        let (out, text, _) = lockstep(&dir, &env, &strs(&args));
        assert!(out.status.success(), "{case}: {text}");
        assert!(
            !text.contains(TOKEN),
            "{case}: the token was printed:\n{text}"
        );
        let to_cdn = cdn.seen();
        assert!(
            to_cdn.iter().any(|s| s.path.contains(".safetensors")),
            "{case}: the weights were not fetched from the redirect target: {to_cdn:#?}"
        );
        for s in &to_cdn {
            assert_eq!(s.authorization, None, "{case}: token sent to {s:?}");
        }
        for s in hub.seen() {
            assert_eq!(
                s.authorization.as_deref(),
                Some(format!("Bearer {TOKEN}").as_str()),
                "{case}: {s:?}"
            );
        }
        let snap = cache.join("models--acme--tiny/snapshots").join(COMMIT);
        for (name, content) in &files {
            assert_eq!(
                &std::fs::read(snap.join(name)).unwrap(),
                content,
                "{case}: {name}"
            );
        }
    }
}
