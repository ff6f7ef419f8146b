//! Text tokenizers: the OpenAI BPE encodings embedded in tiktoken-rs (offline)
//! and Hugging Face `tokenizer.json` files. Text is encoded by lockstep's own exact BPE
//! encoder ([`fast_bpe`]) for every tiktoken encoding and for byte-level BPE tokenizer.json
//! files; other tokenizer.json models go through `tokenizers`. tiktoken-rs and `tokenizers`
//! still decode, define the vocabulary hash and export.

mod fast_bpe;
mod hf_json;

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use anyhow::{anyhow, bail, Context, Result};
use tiktoken_rs::CoreBPE;

use fast_bpe::FastBpe;

/// Names accepted by [`Tokenizer::load`] besides a path to a `tokenizer.json`.
pub const BUILTIN_NAMES: &[&str] = &[
    "gpt2",
    "r50k_base",
    "p50k_base",
    "cl100k_base",
    "o200k_base",
];

/// Special-token spellings tried, in order, to find the end-of-sequence id of
/// a Hugging Face tokenizer.
const HF_EOS_CANDIDATES: &[&str] = &[
    "</s>",
    "<|end_of_text|>",
    "<|endoftext|>",
    "<|eot_id|>",
    "<eos>",
];

/// Special-token spellings tried, in order, to find the beginning-of-sequence id of a Hugging
/// Face tokenizer whose folder has no `tokenizer_config.json` naming it.
const HF_BOS_CANDIDATES: &[&str] = &["<s>", "<|begin_of_text|>", "<bos>", "<|startoftext|>"];

/// The beginning-of-sequence token of the tokenizer.json at `path`: the `bos_token` of the
/// `tokenizer_config.json` beside it where that names one (a spelling, or an object with its
/// `content`) or says `null` (none: Qwen's), as transformers reads it; else, with no such file
/// or key or a spelling not in the vocabulary, the first of `HF_BOS_CANDIDATES` it has.
fn hf_bos(path: &Path, inner: &tokenizers::Tokenizer) -> Option<(u32, String)> {
    let named = |t: &str| inner.token_to_id(t).map(|id| (id, t.to_string()));
    let config = std::fs::read(path.with_file_name("tokenizer_config.json")).ok();
    let config: Option<serde_json::Value> = config.and_then(|b| serde_json::from_slice(&b).ok());
    match config.as_ref().and_then(|c| c.get("bos_token")) {
        Some(serde_json::Value::Null) => return None,
        Some(v) => {
            let spelling = v
                .as_str()
                .or_else(|| v.get("content").and_then(|c| c.as_str()));
            if let Some(found) = spelling.and_then(named) {
                return Some(found);
            }
        }
        None => {}
    }
    HF_BOS_CANDIDATES.iter().find_map(|t| named(t))
}

/// A text tokenizer shared (read-only) by all tokenization threads.
pub struct Tokenizer {
    kind: Kind,
    vocab_size: usize,
    eos_id: u32,
    hash: OnceLock<[u8; 32]>,
}

enum Kind {
    Tiktoken {
        name: &'static str,
        bpe: &'static CoreBPE,
        /// Its static facts and lockstep's encoder for it.
        spec: &'static TiktokenSpec,
    },
    HuggingFace {
        path: PathBuf,
        inner: Box<tokenizers::Tokenizer>,
        /// lockstep's encoder where it reproduces this tokenizer.json exactly, else why not.
        fast: Result<Box<FastBpe>, String>,
        /// Its beginning-of-sequence token (`hf_bos`).
        bos: Option<(u32, String)>,
    },
}

/// Static facts about a tiktoken encoding. tiktoken-rs keeps its vocabulary
/// private, so the sizes (`n_vocab` in Python tiktoken: highest id + 1) are
/// tabulated here and checked against the encoder when loading.
struct TiktokenSpec {
    name: &'static str,
    vocab_size: usize,
    eos_id: u32,
    get: fn() -> &'static CoreBPE,
    /// The classic form of its pre-tokenizer pattern ([`fast_bpe`]).
    pattern: &'static str,
    /// `bpe-openai`'s prebuilt dictionary, where it ships one.
    prebuilt: Option<fn() -> &'static bpe_openai::Tokenizer>,
    /// lockstep's encoder, built on first use (r50k/p50k: ~0.4 s) once per process.
    fast: OnceLock<Result<FastBpe, String>>,
}

static TIKTOKEN_SPECS: [TiktokenSpec; 4] = [
    TiktokenSpec {
        name: "r50k_base",
        vocab_size: 50257,
        eos_id: 50256,
        get: tiktoken_rs::r50k_base_singleton,
        pattern: fast_bpe::GPT2_PATTERN,
        prebuilt: None,
        fast: OnceLock::new(),
    },
    TiktokenSpec {
        name: "p50k_base",
        vocab_size: 50281,
        eos_id: 50256,
        get: tiktoken_rs::p50k_base_singleton,
        pattern: fast_bpe::GPT2_PATTERN,
        prebuilt: None,
        fast: OnceLock::new(),
    },
    TiktokenSpec {
        name: "cl100k_base",
        vocab_size: 100277,
        eos_id: 100257,
        get: tiktoken_rs::cl100k_base_singleton,
        pattern: fast_bpe::CL100K_PATTERN,
        prebuilt: Some(bpe_openai::cl100k_base),
        fast: OnceLock::new(),
    },
    TiktokenSpec {
        name: "o200k_base",
        vocab_size: 200019,
        eos_id: 199999,
        get: tiktoken_rs::o200k_base_singleton,
        pattern: fast_bpe::O200K_PATTERN,
        prebuilt: Some(bpe_openai::o200k_base),
        fast: OnceLock::new(),
    },
];

impl Tokenizer {
    /// Loads a tokenizer from a built-in encoding name (`gpt2`, `r50k_base`,
    /// `p50k_base`, `cl100k_base`, `o200k_base`) or a path to a Hugging Face
    /// `tokenizer.json`.
    pub fn load(spec: &str) -> Result<Tokenizer> {
        let name = if spec == "gpt2" { "r50k_base" } else { spec };
        if let Some(t) = TIKTOKEN_SPECS.iter().find(|t| t.name == name) {
            return Self::load_tiktoken(t);
        }
        let path = Path::new(spec);
        if path.is_file() {
            return Self::load_hf(path);
        }
        bail!(
            "unknown tokenizer `{spec}`: it is neither a built-in encoding nor an existing file; \
             use one of {} or the path to a Hugging Face tokenizer.json",
            BUILTIN_NAMES.join(", ")
        )
    }

    fn load_tiktoken(t: &'static TiktokenSpec) -> Result<Tokenizer> {
        let bpe = (t.get)();
        // Guards the hand-written table above against a tiktoken-rs upgrade
        // that changes an encoding.
        let last = u32::try_from(t.vocab_size - 1)?;
        let eos = bpe.decode_bytes(&[t.eos_id]).ok();
        if bpe.decode_bytes(&[last]).is_err()
            || bpe.decode_bytes(&[last + 1]).is_ok()
            || eos.as_deref() != Some(b"<|endoftext|>".as_slice())
        {
            bail!(
                "tiktoken encoding {} does not have the expected vocabulary size {} and \
                 <|endoftext|> id {}; the tiktoken-rs version is incompatible with lockstep",
                t.name,
                t.vocab_size,
                t.eos_id
            );
        }
        Ok(Tokenizer {
            kind: Kind::Tiktoken {
                name: t.name,
                bpe,
                spec: t,
            },
            vocab_size: t.vocab_size,
            eos_id: t.eos_id,
            hash: OnceLock::new(),
        })
    }

    fn load_hf(path: &Path) -> Result<Tokenizer> {
        let path = path
            .canonicalize()
            .with_context(|| format!("{}: cannot resolve the tokenizer path", path.display()))?;
        let mut inner = tokenizers::Tokenizer::from_file(&path).map_err(|e| {
            anyhow!(
                "{}: {}; point data.tokenizer at a Hugging Face tokenizer.json or use one of {}",
                path.display(),
                why_not_a_tokenizer(&path, &e.to_string()),
                BUILTIN_NAMES.join(", ")
            )
        })?;
        // Training text that happens to contain "</s>" must stay ordinary text,
        // as with tiktoken's encode_ordinary.
        inner.set_encode_special_tokens(true);
        let json: serde_json::Value = serde_json::from_slice(&std::fs::read(&path)?)
            .with_context(|| format!("{}: not valid JSON", path.display()))?;
        can_encode_text(&json).map_err(|why| {
            anyhow!(
                "{}: {why}; it cannot encode text, so the corpus would become a few tokens. Use \
                 the tokenizer.json the model was published with, or one of {}",
                path.display(),
                BUILTIN_NAMES.join(", ")
            )
        })?;
        let fast = FastBpe::from_hf_json(&json)
            .map_err(|e| format!("{e:#}"))
            .map(Box::new);
        let eos_id = HF_EOS_CANDIDATES
            .iter()
            .find_map(|t| inner.token_to_id(t))
            .ok_or_else(|| {
                anyhow!(
                    "{}: the tokenizer has no EOS token (looked for {}); add one of them to its \
                     vocabulary",
                    path.display(),
                    HF_EOS_CANDIDATES.join(" ")
                )
            })?;
        let vocab_size = inner.get_vocab_size(true);
        let bos = hf_bos(&path, &inner);
        Ok(Tokenizer {
            kind: Kind::HuggingFace {
                path,
                inner: Box::new(inner),
                fast,
                bos,
            },
            vocab_size,
            eos_id,
            hash: OnceLock::new(),
        })
    }

    /// A stable name: `tiktoken:<encoding>` or `hf:<canonical path>`.
    pub fn id(&self) -> String {
        match &self.kind {
            Kind::Tiktoken { name, .. } => format!("tiktoken:{name}"),
            Kind::HuggingFace { path, .. } => format!("hf:{}", path.display()),
        }
    }

    /// BLAKE3 of the tokenizer definition, stored in `.tok` headers so a
    /// token file is never read with a different tokenizer.
    ///
    /// For a `tokenizer.json` it is the hash of the file bytes. For tiktoken it
    /// hashes the encoding name, the vocabulary size, the EOS id and then every
    /// id in `0..vocab_size` that exists with its byte string (as
    /// `id u32 LE, len u32 LE, bytes`), i.e. the whole vocabulary; it is
    /// computed once (tens of milliseconds) on first use.
    pub fn definition_hash(&self) -> [u8; 32] {
        *self.hash.get_or_init(|| match &self.kind {
            Kind::Tiktoken { name, bpe, .. } => {
                let mut h = blake3::Hasher::new();
                h.update(b"tiktoken\0");
                h.update(name.as_bytes());
                h.update(&(self.vocab_size as u64).to_le_bytes());
                h.update(&self.eos_id.to_le_bytes());
                for id in 0..self.vocab_size as u32 {
                    if let Ok(bytes) = bpe.decode_bytes(&[id]) {
                        h.update(&id.to_le_bytes());
                        h.update(&(bytes.len() as u32).to_le_bytes());
                        h.update(&bytes);
                    }
                }
                *h.finalize().as_bytes()
            }
            // The file was read successfully moments ago in load(); if it has
            // vanished since, hashing the path still identifies it.
            Kind::HuggingFace { path, .. } => match std::fs::read(path) {
                Ok(bytes) => *blake3::hash(&bytes).as_bytes(),
                Err(_) => *blake3::hash(path.to_string_lossy().as_bytes()).as_bytes(),
            },
        })
    }

    /// Number of ids, special tokens included (the model's minimum vocab size).
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// The end-of-sequence id appended after every document.
    pub fn eos_id(&self) -> u32 {
        self.eos_id
    }

    /// Encodes ordinary text: special-token spellings such as `<|endoftext|>`
    /// inside `text` are tokenized as plain characters, never as special ids.
    ///
    /// Never fails for tiktoken. A Hugging Face model that cannot represent
    /// some text (e.g. WordLevel without an unk token) yields an empty vector
    /// here; use [`Tokenizer::try_encode`] to get the error instead.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        self.try_encode(text).unwrap_or_default()
    }

    /// Like [`Tokenizer::encode`] but reports Hugging Face encoding failures.
    pub fn try_encode(&self, text: &str) -> Result<Vec<u32>> {
        let mut ids = Vec::new();
        match &self.kind {
            Kind::Tiktoken { spec, .. } => spec
                .fast
                .get_or_init(|| tiktoken_encoder(spec).map_err(|e| format!("{e:#}")))
                .as_ref()
                .map_err(|e| anyhow!("{e}"))?
                .encode_into(text, &mut ids),
            Kind::HuggingFace { fast: Ok(fast), .. } => fast.encode_into(text, &mut ids),
            Kind::HuggingFace { path, inner, .. } => {
                return inner
                    .encode(text, false)
                    .map(|e| e.get_ids().to_vec())
                    .map_err(|e| anyhow!("{}: cannot encode text: {e}", path.display()))
            }
        }
        Ok(ids)
    }

    /// Encodes `text` as a Hugging Face tokenizer's `encode(text)` does by default: with the
    /// special tokens its post-processor adds (Llama's BOS before the text). The embedded
    /// encodings add none, as their exported tokenizer.json adds none. Special-token spellings
    /// inside `text` stay ordinary text, as in [`Tokenizer::encode`].
    pub fn encode_with_specials(&self, text: &str) -> Result<Vec<u32>> {
        match &self.kind {
            Kind::HuggingFace { path, inner, .. } if inner.get_post_processor().is_some() => inner
                .encode(text, true)
                .map(|e| e.get_ids().to_vec())
                .map_err(|e| anyhow!("{}: cannot encode text: {e}", path.display())),
            _ => self.try_encode(text),
        }
    }

    /// A Hugging Face tokenizer's beginning-of-sequence token, id and spelling, as
    /// transformers' `bos_token_id` finds it (`hf_bos`); the embedded encodings have none.
    pub fn bos(&self) -> Option<(u32, String)> {
        match &self.kind {
            Kind::Tiktoken { .. } => None,
            Kind::HuggingFace { bos, .. } => bos.clone(),
        }
    }

    /// What encodes text: lockstep's BPE encoder, or `tokenizers` and why (for the
    /// `prepare` summary).
    pub fn engine(&self) -> String {
        match &self.kind {
            Kind::Tiktoken { .. } => "lockstep's BPE encoder (tiktoken's ids)".into(),
            Kind::HuggingFace { fast: Ok(_), .. } => {
                "lockstep's byte-level BPE encoder (the tokenizer.json's ids)".into()
            }
            Kind::HuggingFace { fast: Err(why), .. } => {
                format!("Hugging Face tokenizers (lockstep's faster encoder declined: {why})")
            }
        }
    }

    /// Whether texts may be cut at [`cut_ok`] points: tiktoken encodings, and tokenizer.json
    /// files lockstep's encoder runs with one of their patterns (Llama 3's is cl100k's); other
    /// pipelines (prefix spaces, normalizers) give no such guarantee.
    fn cuttable(&self) -> bool {
        match &self.kind {
            Kind::Tiktoken { .. } => true,
            Kind::HuggingFace { fast, .. } => fast.as_ref().is_ok_and(|f| f.cuttable()),
        }
    }

    /// Splits `text` into consecutive pieces of roughly `target_bytes` whose
    /// separate encodings concatenate to `encode(text)`, so one huge document
    /// can be tokenized on several threads (cuts at [`cut_ok`] points).
    pub fn split_for_parallel<'a>(&self, text: &'a str, target_bytes: usize) -> Vec<&'a str> {
        if !self.cuttable() || text.len() <= target_bytes {
            return vec![text];
        }
        let bytes = text.as_bytes();
        let mut pieces = Vec::new();
        let mut start = 0;
        while text.len() - start > target_bytes {
            let from = start + target_bytes.max(1);
            match (from..bytes.len()).find(|&c| cut_ok(bytes, c)) {
                Some(c) => {
                    pieces.push(&text[start..c]);
                    start = c;
                }
                None => break,
            }
        }
        pieces.push(&text[start..]);
        pieces
    }

    /// The last point at or after byte `from` where `text` may be cut so that its two sides
    /// encode to `encode(text)` (see [`cut_ok`]), if any: how `prepare` streams a document
    /// too large to hold (`from` skips what an earlier call searched in vain).
    pub fn last_cut(&self, text: &str, from: usize) -> Option<usize> {
        if !self.cuttable() {
            return None;
        }
        let bytes = text.as_bytes();
        (from.max(1)..bytes.len()).rev().find(|&c| cut_ok(bytes, c))
    }

    /// This tokenizer as a Hugging Face `tokenizer.json`, for exports: a tokenizer.json's own
    /// bytes, and for a tiktoken encoding an equivalent byte-level BPE built from its ranks
    /// (the same ids for every text; see `hf_json`). About 0.3 s for cl100k, 0.6 s for o200k.
    pub fn hf_tokenizer_json(&self) -> Result<Vec<u8>> {
        match &self.kind {
            Kind::Tiktoken { name, bpe, .. } => {
                let json = hf_json::from_tiktoken(name, bpe, self.vocab_size)?;
                Ok((serde_json::to_string_pretty(&json)? + "\n").into_bytes())
            }
            Kind::HuggingFace { path, .. } => std::fs::read(path)
                .with_context(|| format!("{}: cannot read the tokenizer", path.display())),
        }
    }

    /// Decodes ids back to text; fails on unknown ids or invalid UTF-8.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        match &self.kind {
            Kind::Tiktoken { name, bpe, .. } => bpe
                .decode(ids)
                .map_err(|e| anyhow!("tiktoken {name}: cannot decode ids: {e}")),
            Kind::HuggingFace { path, inner, .. } => inner
                .decode(ids, false)
                .map_err(|e| anyhow!("{}: cannot decode ids: {e}", path.display())),
        }
    }
}

/// lockstep's encoder for a tiktoken encoding: `bpe-openai`'s prebuilt dictionary where it
/// has one (checked token by token against tiktoken-rs's vocabulary), else one built from
/// tiktoken-rs's ranks.
fn tiktoken_encoder(spec: &TiktokenSpec) -> Result<FastBpe> {
    let core = (spec.get)();
    let special: Vec<u32> = core
        .special_tokens()
        .iter()
        .flat_map(|s| core.encode_with_special_tokens(s))
        .collect();
    // The ordinary tokens in rank order: tiktoken's ids, special ones left out.
    let (ids, tokens): (Vec<u32>, Vec<Vec<u8>>) = (0..spec.vocab_size as u32)
        .filter(|id| !special.contains(id))
        .filter_map(|id| core.decode_bytes(&[id]).ok().map(|bytes| (id, bytes)))
        .unzip();
    let bpe = match spec.prebuilt {
        Some(prebuilt) => {
            let bpe = &prebuilt().bpe;
            let same = bpe.num_tokens() == tokens.len()
                && tokens
                    .iter()
                    .enumerate()
                    .all(|(i, t)| bpe.token_bytes(i as u32) == t.as_slice());
            if !same {
                bail!(
                    "bpe-openai's {} vocabulary differs from tiktoken-rs's; the bpe-openai \
                     version is incompatible with lockstep",
                    spec.name
                );
            }
            bpe
        }
        None => {
            let bpe =
                bpe_openai::byte_pair_encoding::BytePairEncoding::from_dictionary(tokens, None);
            &*Box::leak(Box::new(bpe))
        }
    };
    let holes = ids.iter().enumerate().any(|(i, &id)| id != i as u32);
    FastBpe::tiktoken(spec.pattern, bpe, holes.then_some(ids))
}

/// Whether a text may be cut before byte `c` without changing its encoding, for the
/// tiktoken-style pre-tokenizer patterns (none has a look-behind, and none lets a piece span
/// either point):
/// - right after a `\n` that follows a non-whitespace character and precedes one;
/// - right before a single space between two ASCII letters (the letter run before it ends
///   there, and the space starts the next word's piece, ` ?\p{L}+` and its kin).
///
/// Both points are character boundaries.
fn cut_ok(b: &[u8], c: usize) -> bool {
    if c < 2 || c + 1 >= b.len() {
        return false;
    }
    (b[c - 1] == b'\n' && !is_ws(b[c - 2]) && !is_ws(b[c]))
        || (b[c] == b' ' && b[c - 1].is_ascii_alphabetic() && b[c + 1].is_ascii_alphabetic())
}

/// Whether byte `b` may belong to a whitespace character. Conservative: every
/// non-ASCII byte counts, because U+0085, U+00A0 and U+2000.. are `\s` for the
/// pre-tokenizer regexes and a cut next to them could merge differently.
fn is_ws(b: u8) -> bool {
    b.is_ascii_whitespace() || b == 0x0B || b >= 0x80
}

/// Why a tokenizer.json cannot represent ordinary text, if it cannot: its model's vocabulary is
/// empty (added tokens aside), or it is a byte-level BPE without a token for each of the 256
/// bytes (text it cannot encode would be dropped without a word).
fn can_encode_text(json: &serde_json::Value) -> Result<(), String> {
    let model = &json["model"];
    let vocab = match &model["vocab"] {
        serde_json::Value::Object(v) => v.len(),
        // Unigram: a list of [piece, score].
        serde_json::Value::Array(v) => v.len(),
        _ => usize::MAX,
    };
    let added: Vec<&str> = json["added_tokens"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|t| t["content"].as_str())
        .collect();
    if vocab == 0 {
        return Err(format!(
            "its vocabulary is empty (model.vocab has no entries{})",
            match added.as_slice() {
                [] => String::new(),
                a => format!("; its only tokens are the added ones: {}", a.join(" ")),
            }
        ));
    }
    let is_type = |v: &serde_json::Value, t: &str| {
        v["type"].as_str() == Some(t)
            || v["pretokenizers"]
                .as_array()
                .is_some_and(|list| list.iter().any(|p| p["type"].as_str() == Some(t)))
    };
    let byte_level =
        is_type(&json["pre_tokenizer"], "ByteLevel") || is_type(&json["decoder"], "ByteLevel");
    if model["type"].as_str() == Some("BPE") && byte_level {
        let tokens = model["vocab"].as_object().map_or(0, |v| v.len());
        let missing: Vec<String> = hf_json::byte_chars()
            .iter()
            .enumerate()
            .filter(|(_, c)| model["vocab"].get(c.to_string()).is_none())
            .map(|(b, _)| format!("0x{b:02x}"))
            .collect();
        if !missing.is_empty() {
            return Err(format!(
                "a byte-level BPE needs a token for each of the 256 bytes, and its vocabulary \
                 ({tokens} tokens) lacks {} of them ({}{})",
                missing.len(),
                missing
                    .iter()
                    .take(8)
                    .cloned()
                    .collect::<Vec<_>>()
                    .join(", "),
                if missing.len() > 8 { ", …" } else { "" }
            ));
        }
    }
    Ok(())
}

/// Why `tokenizers` refused `path`: not JSON at all (where), JSON that is not a tokenizer
/// (what it lacks and what it looks like instead), or the library's own reason.
fn why_not_a_tokenizer(path: &Path, library: &str) -> String {
    let Ok(text) = std::fs::read_to_string(path) else {
        return format!("not a valid Hugging Face tokenizer.json ({library})");
    };
    match serde_json::from_str::<serde_json::Value>(&text) {
        Err(e) => format!(
            "not valid JSON at line {}, column {} ({e}), so not a tokenizer.json",
            e.line(),
            e.column()
        ),
        Ok(serde_json::Value::Object(map)) if !map.contains_key("model") => {
            let mut keys: Vec<&str> = map.keys().map(String::as_str).take(8).collect();
            keys.sort_unstable();
            let looks_like = if map.contains_key("architectures") || map.contains_key("model_type")
            {
                " (it looks like a model's config.json)"
            } else if map.contains_key("tokenizer_class") {
                " (it looks like a tokenizer_config.json; the tokenizer.json beside it is needed)"
            } else {
                ""
            };
            format!(
                "valid JSON but not a tokenizer.json: it has no \"model\" section (its keys: \
                 {}){looks_like}",
                keys.join(", ")
            )
        }
        Ok(serde_json::Value::Object(_)) => {
            format!("not a valid Hugging Face tokenizer.json ({library})")
        }
        Ok(_) => "valid JSON but not a tokenizer.json: its top level is not an object".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_that_is_not_a_tokenizer_says_what_is_missing() {
        let dir = tempfile::tempdir().unwrap();
        let case = |name: &str, text: &str| {
            let p = dir.path().join(name);
            std::fs::write(&p, text).unwrap();
            format!("{:#}", Tokenizer::load(p.to_str().unwrap()).err().unwrap())
        };
        let config = case(
            "config.json",
            r#"{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 8}"#,
        );
        assert!(
            config.contains("valid JSON but not a tokenizer.json: it has no \"model\" section")
                && config.contains("it looks like a model's config.json")
                && !config.contains("syntax"),
            "{config}"
        );
        let broken = case("broken.json", "{\"model\": ");
        assert!(broken.contains("not valid JSON at line 1"), "{broken}");
        let list = case("list.json", "[1, 2]");
        assert!(list.contains("its top level is not an object"), "{list}");
    }

    #[test]
    fn gpt2_hello_world() {
        let t = Tokenizer::load("gpt2").unwrap();
        assert_eq!(t.encode("Hello world"), vec![15496, 995]);
        assert_eq!(t.id(), "tiktoken:r50k_base");
        assert_eq!(t.vocab_size(), 50257);
    }

    #[test]
    fn unicode_round_trip() {
        let text = "Ünïcödé — 日本語のテキスト, emoji 🦀🚀, Ελληνικά.\n\tTabs and  spaces.";
        for name in ["gpt2", "cl100k_base", "o200k_base"] {
            let t = Tokenizer::load(name).unwrap();
            assert_eq!(t.decode(&t.encode(text)).unwrap(), text, "{name}");
        }
    }

    #[test]
    fn eos_ids_and_sizes() {
        for (name, eos, vocab) in [
            ("gpt2", 50256, 50257),
            ("p50k_base", 50256, 50281),
            ("cl100k_base", 100257, 100277),
            ("o200k_base", 199999, 200019),
        ] {
            let t = Tokenizer::load(name).unwrap();
            assert_eq!(t.eos_id(), eos, "{name}");
            assert_eq!(t.vocab_size(), vocab, "{name}");
            assert_eq!(t.decode(&[eos]).unwrap(), "<|endoftext|>");
        }
    }

    #[test]
    fn special_strings_stay_ordinary() {
        let t = Tokenizer::load("gpt2").unwrap();
        let ids = t.encode("a<|endoftext|>b");
        assert!(!ids.contains(&50256));
        assert_eq!(t.decode(&ids).unwrap(), "a<|endoftext|>b");
    }

    #[test]
    fn hashes_differ_and_are_stable() {
        let a = Tokenizer::load("gpt2").unwrap();
        let b = Tokenizer::load("r50k_base").unwrap();
        let c = Tokenizer::load("p50k_base").unwrap();
        assert_eq!(a.definition_hash(), b.definition_hash());
        assert_ne!(a.definition_hash(), c.definition_hash());
    }

    #[test]
    fn unknown_name_lists_choices() {
        let err = Tokenizer::load("gpt5-ultra").err().unwrap().to_string();
        assert!(
            err.contains("cl100k_base") && err.contains("gpt5-ultra"),
            "{err}"
        );
    }

    #[test]
    fn parallel_split_matches_whole_encoding() {
        let t = Tokenizer::load("cl100k_base").unwrap();
        let mut text = String::new();
        for i in 0..400 {
            text.push_str(&format!("Line {i}:  some words, punct.!\n"));
            if i % 7 == 0 {
                text.push_str("   \n\n  indented\r\n");
            }
            if i % 11 == 0 {
                text.push_str("ünï\ncödé\n\n\n");
            }
        }
        let pieces = t.split_for_parallel(&text, 512);
        assert!(pieces.len() > 10);
        assert_eq!(pieces.concat(), text);
        let joined: Vec<u32> = pieces.iter().flat_map(|p| t.encode(p)).collect();
        assert_eq!(joined, t.encode(&text));
    }

    #[test]
    fn lines_without_breaks_are_cut_between_words() {
        let text = "It's a  long line, of WORDS and 42 numbers; café au lait x y. ".repeat(300);
        for name in ["gpt2", "cl100k_base", "o200k_base"] {
            let t = Tokenizer::load(name).unwrap();
            let pieces = t.split_for_parallel(&text, 256);
            assert!(pieces.len() > 20, "{name}: {} pieces", pieces.len());
            let joined: Vec<u32> = pieces.iter().flat_map(|p| t.encode(p)).collect();
            assert_eq!(joined, t.encode(&text), "{name}");
            let c = t.last_cut(&text, 0).unwrap();
            assert_eq!(t.last_cut(&text, c + 1), None);
            let mut two = t.encode(&text[..c]);
            two.extend(t.encode(&text[c..]));
            assert_eq!(two, t.encode(&text), "{name}");
        }
    }

    /// A minimal WordLevel tokenizer.json, written the way `tokenizers` saves one.
    pub(crate) fn write_wordlevel_json(dir: &Path) -> PathBuf {
        let json = r###"{
  "version": "1.0",
  "truncation": null,
  "padding": null,
  "added_tokens": [
    {"id": 0, "content": "<unk>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
    {"id": 1, "content": "</s>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}
  ],
  "normalizer": null,
  "pre_tokenizer": {"type": "Whitespace"},
  "post_processor": null,
  "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": false},
  "model": {
    "type": "WordLevel",
    "vocab": {"<unk>": 0, "</s>": 1, "hello": 2, "world": 3, "to": 4, "be": 5, "or": 6, "not": 7},
    "unk_token": "<unk>"
  }
}"###;
        let path = dir.join("tokenizer.json");
        std::fs::write(&path, json).unwrap();
        path
    }

    #[test]
    fn hf_tokenizer_json_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let path = write_wordlevel_json(dir.path());
        let t = Tokenizer::load(path.to_str().unwrap()).unwrap();
        assert_eq!(t.vocab_size(), 8);
        assert_eq!(t.eos_id(), 1);
        assert!(t.id().starts_with("hf:") && t.id().ends_with("tokenizer.json"));
        let ids = t.encode("to be or not to be");
        assert_eq!(ids, vec![4, 5, 6, 7, 4, 5]);
        assert_eq!(t.decode(&ids).unwrap(), "to be or not to be");
        // The special-token spelling in text is not mapped to the EOS id.
        assert!(!t.encode("hello </s> world").contains(&1));
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(t.definition_hash(), *blake3::hash(&bytes).as_bytes());
    }

    #[test]
    fn bos_is_what_tokenizer_config_names_else_a_known_spelling() {
        let dir = tempfile::tempdir().unwrap();
        let path = write_wordlevel_json(dir.path());
        let json = std::fs::read_to_string(&path).unwrap();
        // "<s>" in the vocabulary, after "to".. "not".
        let json = json.replace(r#""not": 7}"#, r#""not": 7, "<s>": 8}"#);
        std::fs::write(&path, json).unwrap();
        let bos = |config: Option<&str>| {
            let cfg = dir.path().join("tokenizer_config.json");
            match config {
                Some(c) => std::fs::write(&cfg, c).unwrap(),
                None => std::fs::remove_file(&cfg).unwrap_or(()),
            }
            Tokenizer::load(path.to_str().unwrap()).unwrap().bos()
        };
        let s = Some((8, "<s>".to_string()));
        assert_eq!(bos(None), s);
        assert_eq!(bos(Some(r#"{"eos_token": "</s>"}"#)), s);
        assert_eq!(bos(Some(r#"{"bos_token": null}"#)), None);
        assert_eq!(
            bos(Some(r#"{"bos_token": "hello"}"#)),
            Some((2, "hello".into()))
        );
        let object = r#"{"bos_token": {"content": "world", "special": true}}"#;
        assert_eq!(bos(Some(object)), Some((3, "world".into())));
        // A spelling the vocabulary lacks, or a file that is not JSON: the known spellings.
        assert_eq!(bos(Some(r#"{"bos_token": "<bos>"}"#)), s);
        assert_eq!(bos(Some("not json")), s);
    }

    #[test]
    fn a_tokenizer_that_cannot_encode_text_is_refused_naming_what_is_missing() {
        let dir = tempfile::tempdir().unwrap();
        let load = |vocab: &str| {
            let json = format!(
                r#"{{"version": "1.0", "added_tokens": [{{"id": 0, "content": "<|endoftext|>",
                "single_word": false, "lstrip": false, "rstrip": false, "normalized": false,
                "special": true}}], "normalizer": null,
                "pre_tokenizer": {{"type": "ByteLevel", "add_prefix_space": false,
                "trim_offsets": true, "use_regex": true}}, "post_processor": null,
                "decoder": {{"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true,
                "use_regex": true}}, "model": {{"type": "BPE", "dropout": null,
                "unk_token": null, "continuing_subword_prefix": "", "end_of_word_suffix": "",
                "fuse_unk": false, "vocab": {vocab}, "merges": []}}}}"#
            );
            let p = dir.path().join("tokenizer.json");
            std::fs::write(&p, json).unwrap();
            format!("{:#}", Tokenizer::load(p.to_str().unwrap()).err().unwrap())
        };
        let only_eos = load(r#"{"<|endoftext|>": 0}"#);
        assert!(
            only_eos.contains(
                "a byte-level BPE needs a token for each of the 256 bytes, and its vocabulary \
                 (1 tokens) lacks 256 of them (0x00, 0x01,"
            ) && only_eos.contains("it cannot encode text"),
            "{only_eos}"
        );
        let empty = load("{}");
        assert!(
            empty.contains(
                "its vocabulary is empty (model.vocab has no entries; its only \
                 tokens are the added ones: <|endoftext|>)"
            ) && !empty.contains("EOS"),
            "{empty}"
        );
    }

    #[test]
    fn hf_without_eos_is_rejected() {
        let dir = tempfile::tempdir().unwrap();
        let path = write_wordlevel_json(dir.path());
        let json = std::fs::read_to_string(&path)
            .unwrap()
            .replace("</s>", "<pad>");
        std::fs::write(&path, json).unwrap();
        let err = Tokenizer::load(path.to_str().unwrap())
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("no EOS token"), "{err}");
    }

    #[test]
    fn is_send_sync() {
        fn check<T: Send + Sync>() {}
        check::<Tokenizer>();
    }
}
