//! Hugging Face names resolved from a hub cache the test builds (no network): models,
//! tokenizers and datasets in the `models--owner--name/{refs,snapshots,blobs}` layout, checked
//! against `huggingface_hub`'s own resolution, and the errors for what is missing.

use crate::common;

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use lockstep::data::hub::{hub_cache_dir, resolve_model, resolve_tokenizer};
use lockstep::data::{dataset_files, TokenFile, Tokenizer};

const C1: &str = "1111111111111111111111111111111111111111";
const C0: &str = "0000000000000000000000000000000000000000";

/// A minimal WordLevel tokenizer.json (as `tokenizers` saves one), EOS `</s>` = 1.
const TOKENIZER: &str = r#"{"version": "1.0", "truncation": null, "padding": null,
 "added_tokens": [
  {"id": 0, "content": "<unk>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
  {"id": 1, "content": "</s>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}],
 "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
 "decoder": null,
 "model": {"type": "WordLevel", "vocab": {"<unk>": 0, "</s>": 1, "hello": 2, "world": 3, "to": 4, "be": 5, "or": 6, "not": 7}, "unk_token": "<unk>"}}"#;

/// One cached repo the way huggingface_hub lays it out: content in `blobs/<hash>`, the snapshot
/// holding relative links to it, `refs/<name>` holding the commit. A `None` content makes a
/// link whose blob is missing (an interrupted download). Returns the snapshot directory.
fn add_repo(
    cache: &Path,
    folder: &str,
    commit: &str,
    refs: &[&str],
    files: &[(&str, Option<&[u8]>)],
) -> PathBuf {
    let repo = cache.join(folder);
    let snap = repo.join("snapshots").join(commit);
    fs::create_dir_all(repo.join("blobs")).unwrap();
    for (name, content) in files {
        let hash = blake3::hash(name.as_bytes()).to_hex().to_string()
            + &content.map_or("missing".into(), |c| blake3::hash(c).to_hex().to_string());
        if let Some(c) = content {
            fs::write(repo.join("blobs").join(&hash), c).unwrap();
        }
        let link = snap.join(name);
        fs::create_dir_all(link.parent().unwrap()).unwrap();
        let depth = Path::new(name).components().count() + 1;
        let target = "../".repeat(depth) + "blobs/" + &hash;
        std::os::unix::fs::symlink(target, &link).unwrap();
    }
    fs::create_dir_all(&snap).unwrap();
    if !refs.is_empty() {
        fs::create_dir_all(repo.join("refs")).unwrap();
    }
    for r in refs {
        fs::write(repo.join("refs").join(r), commit).unwrap();
    }
    snap
}

fn parquet_bytes(texts: &[&str]) -> Vec<u8> {
    use parquet::data_type::{ByteArray, ByteArrayType};
    use parquet::file::properties::WriterProperties;
    use parquet::file::writer::SerializedFileWriter;
    let schema = parquet::schema::parser::parse_message_type(
        "message m { REQUIRED BYTE_ARRAY text (UTF8); }",
    )
    .unwrap();
    let mut out = Vec::new();
    let props = Arc::new(WriterProperties::builder().build());
    let mut w = SerializedFileWriter::new(&mut out, Arc::new(schema), props).unwrap();
    let mut rg = w.next_row_group().unwrap();
    let mut col = rg.next_column().unwrap().unwrap();
    let values: Vec<ByteArray> = texts.iter().map(|t| ByteArray::from(*t)).collect();
    col.typed::<ByteArrayType>()
        .write_batch(&values, None, None)
        .unwrap();
    col.close().unwrap();
    rg.close().unwrap();
    w.close().unwrap();
    out
}

/// HF_HUB_CACHE = `<root>/hub`, HF_HOME = `<root>/home` (so datasets also come from
/// `<root>/home/datasets`).
fn build_cache(root: &Path) {
    let hub = root.join("hub");
    let config = br#"{"model_type": "llama"}"#;
    add_repo(
        &hub,
        "models--acme--tiny-llama",
        C1,
        &["main"],
        &[
            ("config.json", Some(config)),
            ("model.safetensors", Some(b"weights")),
            ("tokenizer.json", Some(TOKENIZER.as_bytes())),
        ],
    );
    // An older revision, reachable by tag or by commit.
    add_repo(
        &hub,
        "models--acme--tiny-llama",
        C0,
        &["v1"],
        &[
            (
                "config.json",
                Some(br#"{"model_type": "llama", "old": true}"#),
            ),
            ("model.safetensors", Some(b"old weights")),
        ],
    );
    let index = br#"{"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}"#;
    add_repo(
        &hub,
        "models--acme--sharded",
        C1,
        &["main"],
        &[
            ("config.json", Some(config)),
            ("model.safetensors.index.json", Some(index)),
            ("model-00001-of-00002.safetensors", Some(b"one")),
            ("model-00002-of-00002.safetensors", None),
        ],
    );
    add_repo(
        &hub,
        "models--acme--old",
        C1,
        &["main"],
        &[
            ("config.json", Some(config)),
            ("pytorch_model.bin", Some(b"pickle")),
        ],
    );

    let p = |t: &[&str]| parquet_bytes(t);
    let (t0, t1, test) = (
        p(&["hello world", "to be"]),
        p(&["or not to be"]),
        p(&["test split"]),
    );
    add_repo(
        &hub,
        "datasets--acme--corpus",
        C1,
        &["main"],
        &[
            ("README.md", Some(b"# corpus")),
            ("data/train-00000-of-00002.parquet", Some(&t0)),
            ("data/train-00001-of-00002.parquet", Some(&t1)),
            ("data/test-00000-of-00001.parquet", Some(&test)),
        ],
    );
    let (w103, w103v, w2) = (p(&["hello hello world"]), p(&["world"]), p(&["to be"]));
    add_repo(
        &hub,
        "datasets--Salesforce--wikitext",
        C1,
        &["main"],
        &[
            (
                "wikitext-103-raw-v1/train-00000-of-00001.parquet",
                Some(&w103),
            ),
            (
                "wikitext-103-raw-v1/validation-00000-of-00001.parquet",
                Some(&w103v),
            ),
            ("wikitext-2-raw-v1/train-00000-of-00001.parquet", Some(&w2)),
        ],
    );
    add_repo(
        &hub,
        "datasets--acme--broken",
        C1,
        &["main"],
        &[("train.parquet", None)],
    );
    // Copied by hand into the datasets cache: no refs/, one snapshot.
    add_repo(
        &root.join("home/datasets"),
        "datasets--local--lines",
        C0,
        &[],
        &[(
            "train.jsonl",
            Some(b"{\"text\": \"hello\"}\n{\"text\": \"world\"}\n"),
        )],
    );
}

fn python_hub(env: &[(&str, &Path)], code: &str) -> String {
    let mut cmd = Command::new(common::python());
    cmd.args(["-c", code])
        .env_remove("HF_HUB_CACHE")
        .env_remove("HUGGINGFACE_HUB_CACHE")
        .env_remove("HF_HOME")
        .env("HF_HUB_OFFLINE", "1");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "python: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

fn rel(files: &[PathBuf], root: &Path) -> Vec<String> {
    files
        .iter()
        .map(|f| f.strip_prefix(root).unwrap().to_string_lossy().into_owned())
        .collect()
}

/// The only test in this binary that touches the process environment (the others pass it to
/// child processes), so no other test sees the variables change.
#[test]
fn models_tokenizers_and_datasets_resolve_from_the_cache() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().canonicalize().unwrap();
    build_cache(&root);
    let hub = root.join("hub");

    // Nothing is downloaded here (tests/hub_download.rs covers that): missing files are errors.
    std::env::set_var("HF_HUB_OFFLINE", "1");
    // The cache directory is chosen as huggingface_hub chooses it.
    std::env::remove_var("HF_HUB_CACHE");
    std::env::remove_var("HUGGINGFACE_HUB_CACHE");
    std::env::remove_var("HF_DATASETS_CACHE");
    std::env::set_var("HF_HOME", root.join("home"));
    let py = python_hub(
        &[("HF_HOME", &root.join("home"))],
        "import huggingface_hub.constants as c; print(c.HF_HUB_CACHE)",
    );
    assert_eq!(hub_cache_dir(), PathBuf::from(py));
    std::env::set_var("HF_HUB_CACHE", &hub);

    // Models: main, a tag, a commit; huggingface_hub finds the same files.
    let snap = resolve_model("acme/tiny-llama").unwrap();
    assert_eq!(
        snap,
        hub.join("models--acme--tiny-llama/snapshots").join(C1)
    );
    let py = python_hub(
        &[("HF_HUB_CACHE", &hub)],
        "import huggingface_hub as h; print(h.try_to_load_from_cache('acme/tiny-llama', 'config.json'))",
    );
    assert_eq!(PathBuf::from(py), snap.join("config.json"));
    let old = hub.join("models--acme--tiny-llama/snapshots").join(C0);
    assert_eq!(resolve_model("acme/tiny-llama@v1").unwrap(), old);
    assert_eq!(
        resolve_model(&format!("acme/tiny-llama@{C0}")).unwrap(),
        old
    );
    // An existing local directory is used as it is.
    let local = root.join("home");
    assert_eq!(resolve_model(local.to_str().unwrap()).unwrap(), local);

    // Missing pieces are named, with how to get them.
    let err = format!("{:#}", resolve_model("acme/sharded").unwrap_err());
    assert!(
        err.contains("model-00002-of-00002.safetensors")
            && !err.contains("model-00001")
            && err.contains("hf download acme/sharded")
            && err.contains("HF_HUB_CACHE"),
        "{err}"
    );
    let err = format!(
        "{:#}",
        resolve_model("meta-llama/Llama-3.1-8B").unwrap_err()
    );
    assert!(
        err.contains("has no models--meta-llama--Llama-3.1-8B")
            && err.contains(hub.to_str().unwrap())
            && err.contains(
                "hf download meta-llama/Llama-3.1-8B --include \"*.json\" --include \"*.safetensors\""
            )
            && err.contains("huggingface-cli download meta-llama/Llama-3.1-8B")
            && err.contains("does not download"),
        "{err}"
    );
    let err = format!("{:#}", resolve_model("acme/old").unwrap_err());
    assert!(err.contains("only PyTorch .bin"), "{err}");
    let err = format!("{:#}", resolve_model("acme/tiny-llama@v9").unwrap_err());
    assert!(err.contains("no refs/v9") && err.contains(C0), "{err}");

    // Tokenizers.
    assert_eq!(resolve_tokenizer("gpt2").unwrap(), "gpt2");
    let file = resolve_tokenizer("acme/tiny-llama").unwrap();
    assert_eq!(PathBuf::from(&file), snap.join("tokenizer.json"));
    let tok = Tokenizer::load(&file).unwrap();
    assert_eq!((tok.vocab_size(), tok.eos_id()), (8, 1));
    assert_eq!(
        resolve_tokenizer(snap.to_str().unwrap()).unwrap(),
        snap.join("tokenizer.json").to_string_lossy()
    );
    let err = format!("{:#}", resolve_tokenizer("acme/sharded").unwrap_err());
    assert!(err.contains("has no tokenizer.json"), "{err}");
    let err = format!("{:#}", resolve_tokenizer("nobody/none").unwrap_err());
    assert!(
        err.contains("neither a built-in") && err.contains("hf download nobody/none"),
        "{err}"
    );

    // Datasets: the train split of a repo; configurations by full or bare name.
    let d = dataset_files(Path::new("acme/corpus")).unwrap();
    let snap = hub.join("datasets--acme--corpus/snapshots").join(C1);
    assert_eq!(d.root, snap);
    assert_eq!(
        rel(&d.files, &snap),
        [
            "data/train-00000-of-00002.parquet",
            "data/train-00001-of-00002.parquet"
        ]
    );
    assert_eq!(d.id, format!("hf-dataset:acme/corpus@{C1}"));
    let err = format!(
        "{:#}",
        dataset_files(Path::new("Salesforce/wikitext")).unwrap_err()
    );
    assert!(
        err.contains("wikitext-103-raw-v1, wikitext-2-raw-v1")
            && err.contains("data.path=Salesforce/wikitext/wikitext-103-raw-v1"),
        "{err}"
    );
    let wiki = hub
        .join("datasets--Salesforce--wikitext/snapshots")
        .join(C1);
    let d = dataset_files(Path::new("Salesforce/wikitext/wikitext-2-raw-v1")).unwrap();
    assert_eq!(
        rel(&d.files, &wiki),
        ["wikitext-2-raw-v1/train-00000-of-00001.parquet"]
    );
    let d = dataset_files(Path::new("wikitext-103-raw-v1")).unwrap();
    assert_eq!(
        rel(&d.files, &wiki),
        ["wikitext-103-raw-v1/train-00000-of-00001.parquet"]
    );
    assert_eq!(
        d.id,
        format!("hf-dataset:Salesforce/wikitext@{C1}/wikitext-103-raw-v1")
    );
    let d = dataset_files(Path::new("local/lines")).unwrap();
    assert_eq!(
        d.files,
        [root
            .join("home/datasets/datasets--local--lines/snapshots")
            .join(C0)
            .join("train.jsonl")]
    );

    let err = format!("{:#}", dataset_files(Path::new("acme/broken")).unwrap_err());
    assert!(
        err.contains("incomplete") && err.contains("train.parquet"),
        "{err}"
    );
    let err = format!(
        "{:#}",
        dataset_files(Path::new("nobody/nothing")).unwrap_err()
    );
    // Missing everywhere: a missing local path first, then where the hub cache was searched.
    assert!(
        err.starts_with("data.path = \"nobody/nothing\": no such file or directory: ")
            && err.contains("If \"nobody/nothing\" is meant as a Hugging Face dataset: it is not in the local cache either")
            && err.contains("hf download --repo-type dataset nobody/nothing")
            && err.contains(hub.to_str().unwrap()),
        "{err}"
    );
    let err = format!(
        "{:#}",
        dataset_files(Path::new("acme/corpus/nope")).unwrap_err()
    );
    assert!(
        err.contains("has no nope") && err.contains("[README.md, data]"),
        "{err}"
    );
    // A missing local file is only that: no Hub text for a name with a data-file extension.
    let err = format!("{:#}", dataset_files(Path::new("corpus.txt")).unwrap_err());
    assert!(
        err.contains("data.path = \"corpus.txt\": no such file or directory")
            && !err.contains("Hugging Face"),
        "{err}"
    );
}

/// `lockstep prepare` with a Hub dataset name and a Hub tokenizer id, offline.
#[test]
fn prepare_from_hub_names() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().canonicalize().unwrap();
    build_cache(&root);
    let args: Vec<String> = [
        "prepare",
        "--preset",
        "tiny",
        "--set",
        "data.path=acme/corpus",
        "--set",
        "data.tokenizer=acme/tiny-llama",
        "--set",
        "data.val_fraction=0",
        "--set",
        "data.cache_dir=cache",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let out = common::lockstep(&root)
        .args(&args)
        .env("HF_HUB_CACHE", root.join("hub"))
        .env("HF_HOME", root.join("home"))
        .env("HF_HUB_OFFLINE", "1")
        .output()
        .unwrap();
    let text = common::output_text(&out);
    assert!(out.status.success(), "{text}");
    // hello world </s> to be </s> or not to be </s>
    let entry = fs::read_dir(root.join("cache"))
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    let f = TokenFile::open(&entry.join("train.tok")).unwrap();
    let tokens: Vec<u32> = (0..f.num_tokens()).map(|i| f.get(i)).collect();
    assert_eq!(tokens, [2, 3, 1, 4, 5, 1, 6, 7, 4, 5, 1]);

    let out = common::lockstep(&root)
        .args(&args)
        .env("HF_HUB_CACHE", root.join("empty"))
        .env("HF_HUB_OFFLINE", "1")
        .output()
        .unwrap();
    let text = common::output_text(&out);
    assert!(!out.status.success());
    assert!(
        text.contains("data.tokenizer = \"acme/tiny-llama\"") && text.contains("hf download"),
        "{text}"
    );
}
