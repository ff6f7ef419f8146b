//! A Hugging Face `tokenizer.json` equivalent to an embedded tiktoken encoding, so that an
//! export of a model trained with `gpt2`/`cl100k_base`/... loads with `AutoTokenizer` (and
//! other readers of tokenizer.json) without anyone hunting for GPT-2's files.
//!
//! A tiktoken encoding is a byte-level BPE given only by ranks (token bytes → id) and a
//! pre-tokenizer regex. Hugging Face's BPE model needs the same vocabulary plus an ordered
//! list of merges, which are recovered here from the ranks:
//!
//! - vocabulary: every ordinary token, its bytes spelled with GPT-2's byte → character map
//!   (the `ByteLevel` pre-tokenizer applies the same map to the text);
//! - merges: for each token of two or more bytes, the two tokens that tiktoken's BPE ends
//!   with when run on the token's own bytes with only merges into tokens ranked below it
//!   allowed; listed in the order of the merged token's rank, which is the priority tiktoken
//!   gives the merge. A token whose bytes do not end in two parts that way is never produced
//!   by merging; tiktoken still emits it when a whole pre-token equals it, which
//!   `ignore_merges` reproduces;
//! - pre-tokenizer: GPT-2's regex (the `ByteLevel` pre-tokenizer's own) for r50k/p50k, and for
//!   cl100k/o200k a `Split` on the encoding's pattern followed by `ByteLevel` without its regex;
//! - special tokens (`<|endoftext|>`, ...) with tiktoken's ids, as added tokens and in the
//!   vocabulary. Ids that the encoding leaves unassigned (cl100k's 100256 and
//!   100261..=100275, o200k's 199998 and 200000..=200017) stay absent, as in tiktoken.
//!
//! tiktoken-rs writes cl100k's pattern with possessive quantifiers and `$`; Hugging Face's
//! Python `tokenizers` compiles patterns with Oniguruma's Ruby syntax, where `{1,3}+` is a
//! repetition rather than possessive and `$` also matches before a newline. The patterns
//! below are plain equivalents that both Oniguruma and fancy-regex (the Rust crate's engine)
//! read as tiktoken does; the tests compare the ids on both against tiktoken-rs.

use std::collections::HashMap;

use anyhow::{bail, ensure, Result};
use serde_json::{json, Map, Value};
use tiktoken_rs::CoreBPE;

/// cl100k_base's pre-tokenizer: tiktoken's pattern without possessive quantifiers (none of
/// them changes what matches here, as nothing after them could backtrack into a shorter
/// match) and with `\s++$` (a whitespace run reaching the end of the text) written as
/// `\s+(?![\s\S])`, which means the same in every engine.
const CL100K_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s+(?![\s\S])|\s*[\r\n]+|\s+(?!\S)|\s+";

/// o200k_base's pre-tokenizer, as tiktoken writes it.
const O200K_PATTERN: &str = concat!(
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"|\p{N}{1,3}",
    r"| ?[^\s\p{L}\p{N}]+[\r\n/]*",
    r"|\s*[\r\n]+",
    r"|\s+(?!\S)",
    r"|\s+",
);

/// The pre-tokenizer of encoding `name` in tokenizer.json form.
fn pre_tokenizer(name: &str) -> Result<Value> {
    let split = |pattern: &str| {
        json!({
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated",
                 "invert": false},
                {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true,
                 "use_regex": false},
            ],
        })
    };
    Ok(match name {
        // The ByteLevel pre-tokenizer's built-in regex is GPT-2's, which r50k and p50k use.
        "r50k_base" | "p50k_base" => json!({
            "type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true,
            "use_regex": true,
        }),
        "cl100k_base" => split(CL100K_PATTERN),
        "o200k_base" => split(O200K_PATTERN),
        _ => bail!("no Hugging Face pre-tokenizer is known for the tiktoken encoding {name}"),
    })
}

/// GPT-2's reversible byte → character map, used by the `ByteLevel` pre-tokenizer and
/// decoder: printable Latin-1 bytes stand for themselves, the other 68 bytes for U+0100
/// onwards, in byte order.
pub(super) fn byte_chars() -> [char; 256] {
    let printable = |b: u32| (0x21..=0x7E).contains(&b) || (0xA1..=0xAC).contains(&b) || b >= 0xAE;
    let mut map = ['\0'; 256];
    let mut next = 0x100;
    for b in 0..256u32 {
        let c = if printable(b) {
            b
        } else {
            next += 1;
            next - 1
        };
        map[b as usize] = char::from_u32(c).expect("below U+0200");
    }
    map
}

/// The pieces that tiktoken's BPE leaves of `token` when it may only merge adjacent pieces
/// into tokens ranked below `limit`, as boundary offsets (first 0, last `token.len()`).
/// Like tiktoken, it merges the adjacent pair whose concatenation has the lowest rank,
/// leftmost first among equals, until no pair qualifies.
fn bpe_below(token: &[u8], limit: u32, ranks: &HashMap<&[u8], u32>) -> Vec<usize> {
    let mut bounds: Vec<usize> = (0..=token.len()).collect();
    // pair[i]: rank of the piece bounds[i]..bounds[i + 2] when it is a token below `limit`.
    let rank_of = |bounds: &[usize], i: usize| -> Option<u32> {
        let end = *bounds.get(i + 2)?;
        ranks
            .get(&token[bounds[i]..end])
            .copied()
            .filter(|&r| r < limit)
    };
    let mut pair: Vec<Option<u32>> = (0..bounds.len() - 1).map(|i| rank_of(&bounds, i)).collect();
    loop {
        let best = pair
            .iter()
            .enumerate()
            .filter_map(|(i, r)| r.map(|r| (r, i)))
            .min();
        let Some((_, i)) = best else { break };
        bounds.remove(i + 1);
        pair.remove(i + 1);
        pair[i] = rank_of(&bounds, i);
        if i > 0 {
            pair[i - 1] = rank_of(&bounds, i - 1);
        }
    }
    bounds
}

/// The tokenizer.json (as JSON) of the tiktoken encoding `name`, whose ids run below
/// `vocab_size`.
pub(super) fn from_tiktoken(name: &str, bpe: &CoreBPE, vocab_size: usize) -> Result<Value> {
    let pre_tokenizer = pre_tokenizer(name)?;
    let mut specials: Vec<(u32, String)> = Vec::new();
    for text in bpe.special_tokens() {
        match bpe.encode_with_special_tokens(text)[..] {
            [id] => specials.push((id, text.to_string())),
            _ => bail!("tiktoken {name}: the special token {text} does not encode to one id"),
        }
    }
    specials.sort();

    // Ordinary tokens in rank (= id) order; ids in gaps or taken by special tokens are absent.
    let mut tokens: Vec<(u32, Vec<u8>)> = Vec::with_capacity(vocab_size);
    for id in 0..u32::try_from(vocab_size)? {
        if specials.iter().any(|(s, _)| *s == id) {
            continue;
        }
        if let Ok(bytes) = bpe.decode_bytes(&[id]) {
            tokens.push((id, bytes));
        }
    }
    let ranks: HashMap<&[u8], u32> = tokens.iter().map(|(id, b)| (b.as_slice(), *id)).collect();
    ensure!(
        ranks.len() == tokens.len(),
        "tiktoken {name}: two ids have the same bytes"
    );
    // Byte-level BPE starts from single bytes: all 256 must be tokens.
    if let Some(b) = (0..=255u8).find(|b| !ranks.contains_key([*b].as_slice())) {
        bail!("tiktoken {name}: byte {b:#04x} is not a token, so it is not a byte-level BPE");
    }

    let chars = byte_chars();
    let spell = |bytes: &[u8]| -> String { bytes.iter().map(|&b| chars[b as usize]).collect() };
    let mut vocab: Vec<(u32, String)> = Vec::with_capacity(tokens.len() + specials.len());
    let mut merges = Vec::with_capacity(tokens.len());
    for (id, bytes) in &tokens {
        vocab.push((*id, spell(bytes)));
        if let [0, mid, end] = bpe_below(bytes, *id, &ranks)[..] {
            debug_assert_eq!(end, bytes.len());
            // Byte-level spellings never contain a space (0x20 is spelled `Ġ`), so the
            // two-strings-joined-by-a-space form, which every tokenizers version reads, is
            // unambiguous.
            merges.push(Value::String(format!(
                "{} {}",
                spell(&bytes[..mid]),
                spell(&bytes[mid..])
            )));
        }
    }
    // The special tokens are in the model's vocabulary too, as in GPT-2's tokenizer.json:
    // `tokenizers` gives an added token that is not there the next id after the vocabulary's
    // size, which is wrong wherever an encoding has unassigned ids below its specials.
    vocab.extend(specials.iter().cloned());
    vocab.sort();
    let mut vocab_map = Map::with_capacity(vocab.len());
    for (id, text) in vocab {
        if vocab_map.insert(text.clone(), json!(id)).is_some() {
            bail!("tiktoken {name}: {text:?} is spelled the same as another token");
        }
    }

    let added: Vec<Value> = specials
        .iter()
        .map(|(id, text)| {
            json!({"id": id, "content": text, "single_word": false, "lstrip": false,
                   "rstrip": false, "normalized": false, "special": true})
        })
        .collect();
    Ok(json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": pre_tokenizer,
        // Adds nothing (lockstep prepends no BOS); ByteLevel here only maps offsets back.
        "post_processor": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false,
                           "use_regex": false},
        "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true,
                    "use_regex": false},
        "model": {
            "type": "BPE",
            "dropout": null,
            "unk_token": null,
            "continuing_subword_prefix": null,
            "end_of_word_suffix": null,
            "fuse_unk": false,
            "byte_fallback": false,
            // tiktoken emits a pre-token that is itself a token as that token, before any BPE.
            "ignore_merges": true,
            "vocab": vocab_map,
            "merges": merges,
        },
    }))
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::data::tokenizer::Tokenizer;

    /// Every branch of the four pre-tokenizer patterns: contractions in any case, letters after
    /// punctuation, digit runs longer than 3, whitespace runs before words, digits and
    /// newlines, `\r\n`, Unicode spaces (NBSP, U+3000, U+0085), combining marks, CJK, emoji
    /// with joiners, and text that ends in whitespace.
    pub(crate) const EDGES: &[&str] = &[
        "Hello world! It's   spaced\tout,\n\nnew  paragraph\r\n  indented 12345678 + 3.14159 = \
         x_y; I'M YOU'LL they've We'D\n\n\n   \n  end",
        "  leading; \"quoted\" (parens) [brackets] {braces} <tags/> a//b ../path/x.rs #!@$%^&*~`|",
        "nbsp\u{a0}here\u{3000}ideographic \u{85}next-line \u{200b}zwsp\u{2003}em-space",
        "Ünïcödé café\u{301} naïve — 日本語のテキスト、中文字符。한국어 Ελληνικά Кириллица ſ K",
        "emoji 🦀🚀 👩\u{200d}👩\u{200d}👧 👍🏽 🇫🇷 ❤\u{fe0f}",
        "code:\n\tfn main() {\n\t\tprintln!(\"{}\", 1_000_000);\n\t}\n\n",
        "trailing spaces   ",
        "trailing mix  \n  ",
        "  \n  ",
        "\n",
        " ",
        "a",
        "1",
        "",
    ];

    fn hf_of(name: &str) -> (Tokenizer, tokenizers::Tokenizer) {
        let tok = Tokenizer::load(name).unwrap();
        let json = tok.hf_tokenizer_json().unwrap();
        let hf = tokenizers::Tokenizer::from_bytes(&json)
            .unwrap_or_else(|e| panic!("{name}: the tokenizers crate rejects the json: {e}"));
        (tok, hf)
    }

    fn check_same_ids(name: &str, tok: &Tokenizer, hf: &tokenizers::Tokenizer, text: &str) {
        let ours = tok.encode(text);
        let theirs = hf.encode(text, false).unwrap().get_ids().to_vec();
        if ours != theirs {
            let at = ours.iter().zip(&theirs).take_while(|(a, b)| a == b).count();
            panic!(
                "{name}: ids differ from token {at}: tiktoken {:?} vs tokenizers {:?} in {:?}",
                &ours[at..(at + 8).min(ours.len())],
                &theirs[at..(at + 8).min(theirs.len())],
                tok.decode(&ours[at.saturating_sub(4)..(at + 8).min(ours.len())])
            );
        }
        assert_eq!(hf.decode(&theirs, false).unwrap(), text, "{name}");
    }

    /// The written tokenizer.json, read by the `tokenizers` crate, gives tiktoken's ids for
    /// edge cases and a whole play, decodes them back, and maps the special-token spellings
    /// to tiktoken's special ids.
    #[test]
    fn tokenizers_crate_matches_tiktoken() {
        let play = std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("data/shakespeare/hamlet_gut.txt"),
        )
        .unwrap();
        for name in ["gpt2", "p50k_base", "cl100k_base", "o200k_base"] {
            let (tok, hf) = hf_of(name);
            for text in EDGES
                .iter()
                .copied()
                .chain([EDGES.concat().as_str(), &play])
            {
                check_same_ids(name, &tok, &hf, text);
            }
            let eos = tok.eos_id();
            assert_eq!(hf.token_to_id("<|endoftext|>"), Some(eos), "{name}");
            let ids = hf
                .encode("a<|endoftext|>b", false)
                .unwrap()
                .get_ids()
                .to_vec();
            assert_eq!(ids, [tok.encode("a"), vec![eos], tok.encode("b")].concat());
            assert_eq!(
                hf.get_vocab_size(true),
                tok.vocab_size() - missing_ids(name),
                "{name}: every id of the encoding is in the tokenizer.json"
            );
        }
    }

    /// Ids below the vocabulary size that the encoding leaves unassigned.
    fn missing_ids(name: &str) -> usize {
        match name {
            "cl100k_base" => 16, // 100256 and 100261..=100275
            "o200k_base" => 19,  // 199998 and 200000..=200017
            _ => 0,
        }
    }

    /// Every token above the 256 bytes of all three encodings turns out to be reachable by
    /// merging, so each gets its merge (GPT-2: 50,000, as in its merges.txt, starting with
    /// "Ġ t").
    #[test]
    fn merges_are_recovered_for_every_token() {
        for (name, ordinary) in [
            ("gpt2", 50_256),
            ("cl100k_base", 100_256),
            ("o200k_base", 199_998),
        ] {
            let tok = Tokenizer::load(name).unwrap();
            let json: Value = serde_json::from_slice(&tok.hf_tokenizer_json().unwrap()).unwrap();
            let merges = json["model"]["merges"].as_array().unwrap();
            assert_eq!(merges.len(), ordinary - 256, "{name}");
            if name == "gpt2" {
                assert_eq!(merges[0], "Ġ t", "GPT-2's first merge");
                assert_eq!(merges[1], "Ġ a", "GPT-2's second merge");
            }
        }
    }

    #[test]
    fn bpe_below_stops_at_the_rank_limit() {
        let ranks: HashMap<&[u8], u32> = [
            (&b"a"[..], 0),
            (b"b", 1),
            (b"c", 2),
            (b"ab", 3),
            (b"bc", 4),
            (b"abc", 5),
            (b"ca", 6),
        ]
        .into_iter()
        .collect();
        // "ab" (3) before "bc" (4); then "abc" (5) is not below its own rank.
        assert_eq!(bpe_below(b"abc", 5, &ranks), vec![0, 2, 3]);
        // Below rank 4 only "ab" may form.
        assert_eq!(bpe_below(b"abc", 4, &ranks), vec![0, 2, 3]);
        // Below rank 3 nothing merges.
        assert_eq!(bpe_below(b"abc", 3, &ranks), vec![0, 1, 2, 3]);
        // Equal ranks: the leftmost "ab" first, then the second one.
        assert_eq!(bpe_below(b"abab", 7, &ranks), vec![0, 2, 4]);
        assert_eq!(bpe_below(b"a", 7, &ranks), vec![0, 1]);
    }

    #[test]
    fn byte_chars_is_gpt2s_map() {
        let chars = byte_chars();
        assert_eq!(chars[b' ' as usize], 'Ġ');
        assert_eq!(chars[b'\n' as usize], 'Ċ');
        assert_eq!(chars[b'!' as usize], '!');
        assert_eq!(chars[0xFF], 'ÿ');
        assert_eq!(chars[0xAD], 'Ń');
        let distinct: std::collections::HashSet<char> = chars.iter().copied().collect();
        assert_eq!(distinct.len(), 256);
    }
}
