//! lockstep's own BPE encoder: the same ids as tiktoken (the embedded encodings) and as
//! Hugging Face `tokenizers` (byte-level BPE `tokenizer.json` files: GPT-2, Llama 3, Qwen,
//! models converted from tiktoken), several times faster than either.
//!
//! Three steps, each cheap:
//! - [`Splitter`]: the pre-tokenizer regex on `regex-automata`'s lazy DFA instead of
//!   `fancy-regex`'s backtracking; the one look-ahead of these patterns, `\s+(?!\S)`, is
//!   emulated by matching one more whitespace character and giving it back (the technique of
//!   GitHub's `bpe-openai`);
//! - a whole-piece lookup: most pieces of real text are one token;
//! - the rest is merged: for tiktoken encodings by the `bpe` crate's backtracking encoder
//!   (linear in the piece, where tiktoken's loop is quadratic), for `tokenizer.json` files
//!   by `tokenizers`' own rule (the adjacent pair with the lowest merge rank first, the
//!   leftmost among equals), kept at n·log n by a heap.
//!
//! [`FastBpe::from_hf_json`] accepts only what it reproduces exactly and says why it
//! declines otherwise (the caller then keeps `tokenizers`):
//! - no normalizer, or `NFC` (Qwen2; done with the crate `tokenizers` uses); pre-tokenizer
//!   `ByteLevel` (GPT-2's regex, no prefix space) or `Sequence [Split(regex, Isolated),
//!   ByteLevel(use_regex: false, no prefix space)]`;
//! - a regex with no look-around except a final `\s+(?!\S)|\s+` (every tiktoken-style
//!   pattern ends so);
//! - model `BPE` without dropout, subword prefix/suffix or byte fallback, all 256 byte
//!   symbols in the vocabulary, every merge made of vocabulary tokens;
//! - special added tokens' spellings are text (as lockstep encodes them everywhere); added
//!   tokens that are not special (Qwen2's `<tool_call>`) are found in the raw text as
//!   `tokenizers` finds them, unless they are normalized, single words or strip spaces.

use std::cell::RefCell;
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};

use aho_corasick::{AhoCorasick, MatchKind};
use anyhow::{anyhow, bail, Result};
use bpe_openai::byte_pair_encoding::BytePairEncoding;
use regex_automata::hybrid::dfa::{Cache as DfaCache, DFA};
use regex_automata::meta::Regex;
use regex_automata::{Anchored, Input};
use rustc_hash::FxHashMap;
use serde_json::Value;
use unicode_normalization_alignments::{is_nfc_quick, IsNormalized, UnicodeNormalization};

/// GPT-2's pre-tokenizer pattern (r50k_base, p50k_base; `ByteLevel` with `use_regex`).
pub const GPT2_PATTERN: &str =
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";

/// cl100k_base's pattern, also Llama 3's. tiktoken now writes it with possessive
/// quantifiers; this classic form splits the same way (the tests compare with tiktoken).
pub const CL100K_PATTERN: &str = concat!(
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}",
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
);

/// o200k_base's pattern.
pub const O200K_PATTERN: &str = concat!(
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
);

/// Qwen2's (and Qwen2.5's) pattern: cl100k's with single digits.
pub const QWEN2_PATTERN: &str = concat!(
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}",
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
);

/// Patterns under which no piece spans a `\n` between two non-whitespace characters, so a
/// text cut there encodes as the concatenation of its parts (`Tokenizer::split_for_parallel`).
const CUTTABLE_PATTERNS: &[&str] = &[GPT2_PATTERN, CL100K_PATTERN, O200K_PATTERN, QWEN2_PATTERN];

/// Patterns under which a run of ASCII letters, after at most one space, is a whole piece when
/// an ASCII character other than a letter (or the end of the text) follows it: their first
/// alternative that can match there is ` ?\p{L}+` (GPT-2) or `[^\r\n\p{L}\p{N}]?\p{L}+`
/// (cl100k, Llama 3, Qwen2), greedy; the contractions before it start with `'`. [`ascii_word`] finds
/// that end without the DFA (o200k's pattern splits by letter case, so it is not here).
const ASCII_WORD_PATTERNS: &[&str] = &[GPT2_PATTERN, CL100K_PATTERN, QWEN2_PATTERN];

/// The only look-ahead accepted, at the end of a pattern.
const LOOKAHEAD_TAIL: &str = r"|\s+(?!\S)|\s+";

/// A pre-tokenizer regex that splits text into pieces the way `fancy-regex` does with the
/// original pattern, without its backtracking: `A|\s+(?!\S)|\s+` becomes the patterns
/// `A|\s+$`, `\s+\s` (its last character given back) and `\s+`, tried in that order.
pub struct Splitter {
    /// Forward lazy DFA for the anchored search at each piece start: only the end of a match
    /// is needed, so no reverse search and none of `meta::Regex`'s per-call dispatch.
    dfa: DFA,
    /// For the rare text no pattern matches at the current position (found unanchored).
    regex: Regex,
    /// Per pattern: whether its last character is a look-ahead to give back.
    lookahead: Vec<bool>,
    /// Whether [`ascii_word`] may end a piece (the pattern is one of [`ASCII_WORD_PATTERNS`]).
    ascii_words: bool,
}

/// The end of the piece at `at` if it is an ASCII word: at most one space, ASCII letters, then
/// an ASCII byte that is not a letter or the end of the text (a byte >= 0x80 could start a
/// letter that continues the word: the DFA decides). Only for [`ASCII_WORD_PATTERNS`].
#[inline]
fn ascii_word(bytes: &[u8], at: usize) -> Option<usize> {
    let start = at + usize::from(bytes[at] == b' ');
    let end = start
        + bytes[start..]
            .iter()
            .position(|b| !b.is_ascii_alphabetic())
            .unwrap_or(bytes.len() - start);
    (end > start && bytes.get(end).is_none_or(|&b| b < 0x80)).then_some(end)
}

impl Splitter {
    /// Compiles `pattern`; fails on look-around other than the final `\s+(?!\S)|\s+`.
    pub fn new(pattern: &str) -> Result<Splitter> {
        let (patterns, lookahead): (Vec<String>, Vec<bool>) =
            match pattern.strip_suffix(LOOKAHEAD_TAIL) {
                Some(head) => (
                    vec![format!(r"{head}|\s+$"), r"\s+\s".into(), r"\s+".into()],
                    vec![false, true, false],
                ),
                None => (vec![pattern.to_string()], vec![false]),
            };
        if patterns
            .iter()
            .any(|p| p.contains("(?=") || p.contains("(?!") || p.contains("(?<"))
        {
            bail!("the pre-tokenizer regex has look-around");
        }
        let regex = Regex::new_many(&patterns)
            .map_err(|e| anyhow!("the pre-tokenizer regex does not compile as a DFA: {e}"))?;
        let dfa = DFA::new_many(&patterns)
            .map_err(|e| anyhow!("the pre-tokenizer regex does not compile as a DFA: {e}"))?;
        Ok(Splitter {
            dfa,
            regex,
            lookahead,
            ascii_words: ASCII_WORD_PATTERNS.contains(&pattern),
        })
    }

    /// Scratch space for [`Splitter::split`], one per thread.
    pub fn cache(&self) -> DfaCache {
        self.dfa.create_cache()
    }

    /// The end and pattern of the match anchored at `at`, if any.
    fn anchored_match(
        &self,
        text: &str,
        at: usize,
        cache: &mut DfaCache,
    ) -> Option<(usize, usize)> {
        let input = Input::new(text).range(at..).anchored(Anchored::Yes);
        match self.dfa.try_search_fwd(cache, &input) {
            Ok(m) => m.map(|m| (m.offset(), m.pattern().as_usize())),
            // The lazy DFA gave up (it never should without a quit byte): ask the full regex.
            Err(_) => self
                .regex
                .find(input)
                .map(|m| (m.end(), m.pattern().as_usize())),
        }
    }

    /// Calls `piece` with each piece of `text` in order: every match, and (as `tokenizers`'
    /// `Isolated` split does) any text between matches.
    pub fn split<'t>(&self, text: &'t str, cache: &mut DfaCache, mut piece: impl FnMut(&'t str)) {
        let mut at = 0;
        while at < text.len() {
            if self.ascii_words {
                if let Some(end) = ascii_word(text.as_bytes(), at) {
                    piece(&text[at..end]);
                    at = end;
                    continue;
                }
            }
            let (start, mut end, pattern) = match self.anchored_match(text, at, cache) {
                Some((end, pattern)) => (at, end, pattern),
                None => match self.regex.find(Input::new(text).range(at..)) {
                    Some(m) => {
                        piece(&text[at..m.start()]);
                        (m.start(), m.end(), m.pattern().as_usize())
                    }
                    None => {
                        piece(&text[at..]);
                        return;
                    }
                },
            };
            if self.lookahead[pattern] {
                let last = text[start..end]
                    .chars()
                    .next_back()
                    .map_or(0, char::len_utf8);
                end -= last;
            }
            if end == start {
                // An empty match cannot advance: the next character stands alone.
                end = start + text[start..].chars().next().map_or(1, char::len_utf8);
            }
            piece(&text[start..end]);
            at = end;
        }
    }
}

/// Whether a piece that is a token is that token without merging: always (tiktoken's rule;
/// `tokenizers` with `ignore_merges`), or where BPE merges the token's bytes back to it, as
/// it does for nearly every token (`tokenizers` without `ignore_merges`: Qwen2, GPT-2's
/// tokenizer.json). Each token is merged once, at its first use, and the answer kept.
enum Whole {
    Always,
    /// Per token id: 0 not known yet, 1 whole, 2 not (it merges into other tokens).
    Checked(Box<[AtomicU8]>),
}

/// A BPE encoder with its pre-tokenizer.
pub struct FastBpe {
    splitter: Splitter,
    /// Token bytes → id of every ordinary token.
    vocab: BytesMap<u32>,
    /// Whether a piece that is a token is that token without merging.
    whole: Whole,
    merger: Merger,
    /// Whether texts may be cut for parallel encoding (see [`CUTTABLE_PATTERNS`]).
    cuttable: bool,
    /// Whether text is put in Unicode NFC first (a tokenizer.json's `NFC` normalizer: Qwen2).
    nfc: bool,
    /// A tokenizer.json's added tokens that are not special (Qwen2's `<tool_call>`…), found
    /// in the raw text as `tokenizers` finds them; `None` where there are none.
    added: Option<AddedWords>,
    /// Tells this encoder's entries in a thread's [`MERGED`] cache from another's.
    id: u64,
}

/// Added tokens matched in the raw text before anything else, as `tokenizers` does with
/// special tokens encoded as text: one leftmost-longest search over every added token that is
/// not normalized, special ones included, whose matches are skipped (text, not tokens); a
/// match of a token that is not special is that token.
struct AddedWords {
    search: AhoCorasick,
    /// Per pattern of `search`: its token id, or `None` for a special token.
    ids: Vec<Option<u32>>,
}

/// What an encoder keeps per thread: the splitter's lazy DFA cache, and the ids of pieces
/// merged lately, by piece (words recur, and a merge costs ~10× a lookup; emptied when full).
/// Both are reset when another encoder uses the thread.
struct MergedCache {
    owner: u64,
    dfa: Option<DfaCache>,
    pieces: BytesMap<Box<[u32]>>,
}

/// Pieces kept in a thread's [`MergedCache`] before it is emptied (a few MB).
const MERGED_CAPACITY: usize = 1 << 16;

thread_local! {
    static MERGED: RefCell<MergedCache> = RefCell::new(MergedCache {
        owner: u64::MAX,
        dfa: None,
        pieces: BytesMap::new(),
    });
}

/// The bytes of `b` (at most 8) as a little-endian number, read with overlapping loads (a
/// copy of a variable length into a zeroed buffer costs a call and a stalled load: it was a
/// sixth of the encoder's time).
#[inline]
fn pack(b: &[u8]) -> u64 {
    let n = b.len();
    debug_assert!(n <= 8);
    let load4 = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes")) as u64;
    match n {
        8.. => u64::from_le_bytes(b[..8].try_into().expect("8 bytes")),
        4.. => load4(0) | load4(n - 4) << (8 * (n - 4)),
        1.. => {
            b[0] as u64 | (b[n / 2] as u64) << (8 * (n / 2)) | (b[n - 1] as u64) << (8 * (n - 1))
        }
        0 => 0,
    }
}

/// A new [`FastBpe::id`].
fn next_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// A map keyed by byte strings, split by length so that most keys are hashed and compared
/// as numbers (see [`Key`]): the vocabulary (token bytes → id; most tokens have up to 7 bytes,
/// a long word and its space up to 15) and the merged pieces.
struct BytesMap<V> {
    short: FxHashMap<u64, V>,
    mid: FxHashMap<(u64, u64), V>,
    long: FxHashMap<Box<[u8]>, V>,
}

/// A token's bytes as numbers: up to 7 bytes and, in the top byte, the length; or 8 to 15
/// bytes as the first 8 and the rest so; or the bytes themselves.
enum Key<'a> {
    Short(u64),
    Mid(u64, u64),
    Long(&'a [u8]),
}

impl Key<'_> {
    fn of(bytes: &[u8]) -> Key<'_> {
        let n = bytes.len();
        let tail = |b: &[u8]| pack(b) | (n as u64) << 56;
        match n {
            0..8 => Key::Short(tail(bytes)),
            8..16 => Key::Mid(pack(&bytes[..8]), tail(&bytes[8..])),
            _ => Key::Long(bytes),
        }
    }
}

impl<V> BytesMap<V> {
    fn new() -> BytesMap<V> {
        BytesMap {
            short: FxHashMap::default(),
            mid: FxHashMap::default(),
            long: FxHashMap::default(),
        }
    }

    fn from_pairs<B: AsRef<[u8]>>(pairs: impl IntoIterator<Item = (B, V)>) -> BytesMap<V> {
        let mut map = BytesMap::new();
        for (bytes, value) in pairs {
            map.insert(bytes.as_ref(), value);
        }
        map
    }

    fn get(&self, bytes: &[u8]) -> Option<&V> {
        match Key::of(bytes) {
            Key::Short(k) => self.short.get(&k),
            Key::Mid(a, b) => self.mid.get(&(a, b)),
            Key::Long(b) => self.long.get(b),
        }
    }

    fn insert(&mut self, bytes: &[u8], value: V) {
        match Key::of(bytes) {
            Key::Short(k) => self.short.insert(k, value),
            Key::Mid(a, b) => self.mid.insert((a, b), value),
            Key::Long(b) => self.long.insert(b.into(), value),
        };
    }

    fn len(&self) -> usize {
        self.short.len() + self.mid.len() + self.long.len()
    }

    fn clear(&mut self) {
        self.short.clear();
        self.mid.clear();
        self.long.clear();
    }
}

/// How a piece that is not looked up whole is merged.
enum Merger {
    /// tiktoken's rule (the pair whose concatenation has the lowest rank first) by the `bpe`
    /// crate, whose dictionary index is the rank; `ids` maps an index to its token id where
    /// the ranks have holes (p50k_base's `<|endoftext|>` sits at 50256 amid ordinary tokens).
    Ranks {
        bpe: &'static BytePairEncoding,
        ids: Option<Vec<u32>>,
    },
    /// `tokenizers`' rule.
    Merges {
        /// Id of each single byte.
        byte_ids: Box<[u32; 256]>,
        /// (left id, right id) → (merge rank, merged id).
        merges: FxHashMap<(u32, u32), (u32, u32)>,
    },
}

fn is_null_or_empty(v: &Value) -> bool {
    v.is_null() || v.as_str() == Some("")
}

impl FastBpe {
    /// The encoder of a tiktoken encoding: its classic `pattern`, the `bpe` crate's
    /// dictionary of its ordinary tokens (index = rank) and, where the ranks have holes, the
    /// token id of each index.
    pub fn tiktoken(
        pattern: &str,
        bpe: &'static BytePairEncoding,
        ids: Option<Vec<u32>>,
    ) -> Result<FastBpe> {
        let id = |i: usize| ids.as_ref().map_or(i as u32, |ids| ids[i]);
        let vocab = (0..bpe.num_tokens()).map(|i| (bpe.token_bytes(i as u32), id(i)));
        Ok(FastBpe {
            splitter: Splitter::new(pattern)?,
            vocab: BytesMap::from_pairs(vocab),
            whole: Whole::Always,
            merger: Merger::Ranks { bpe, ids },
            cuttable: CUTTABLE_PATTERNS.contains(&pattern),
            nfc: false,
            added: None,
            id: next_id(),
        })
    }

    /// Builds the encoder from a parsed `tokenizer.json`, or says why it cannot reproduce
    /// `tokenizers` exactly for it.
    pub fn from_hf_json(json: &Value) -> Result<FastBpe> {
        let nfc = match &json["normalizer"] {
            Value::Null => false,
            n if n["type"].as_str() == Some("NFC") => true,
            _ => bail!("it has a normalizer other than NFC"),
        };
        let pattern = pre_tokenizer_pattern(&json["pre_tokenizer"])?;
        let splitter = Splitter::new(&pattern)?;
        let added = added_words(json)?;
        let model = &json["model"];
        if model["type"].as_str() != Some("BPE") {
            bail!("its model is not BPE");
        }
        if !model["dropout"].is_null()
            || !is_null_or_empty(&model["continuing_subword_prefix"])
            || !is_null_or_empty(&model["end_of_word_suffix"])
            || model["byte_fallback"].as_bool() == Some(true)
        {
            bail!("its BPE has dropout, a subword prefix/suffix or byte fallback");
        }
        let chars: FxHashMap<char, u8> = super::hf_json::byte_chars()
            .iter()
            .enumerate()
            .map(|(b, &c)| (c, b as u8))
            .collect();
        let to_bytes =
            |s: &str| -> Option<Vec<u8>> { s.chars().map(|c| chars.get(&c).copied()).collect() };
        let entries = model["vocab"]
            .as_object()
            .ok_or_else(|| anyhow!("its BPE has no vocab object"))?;
        let mut vocab = FxHashMap::default();
        for (token, id) in entries {
            let id = id.as_u64().and_then(|i| u32::try_from(i).ok());
            match (to_bytes(token), id) {
                (Some(bytes), Some(id)) => {
                    vocab.insert(bytes.into_boxed_slice(), id);
                }
                _ => bail!("vocabulary entry {token:?} is not a byte-level token with an id"),
            }
        }
        let max_id = vocab.values().copied().max().unwrap_or(0) as usize;
        let mut byte_ids = [0u32; 256];
        for (b, slot) in byte_ids.iter_mut().enumerate() {
            *slot = *vocab
                .get([b as u8].as_slice())
                .ok_or_else(|| anyhow!("byte {b} has no token of its own"))?;
        }
        let list = model["merges"]
            .as_array()
            .ok_or_else(|| anyhow!("its BPE has no merges list"))?;
        let mut merges = FxHashMap::default();
        for (rank, m) in list.iter().enumerate() {
            let (a, b) = match m {
                Value::String(s) => s.split_once(' ').unzip(),
                Value::Array(p) if p.len() == 2 => (p[0].as_str(), p[1].as_str()),
                _ => (None, None),
            };
            let (Some(a), Some(b)) = (a.and_then(to_bytes), b.and_then(to_bytes)) else {
                bail!("merge {rank} ({m}) is not two byte-level tokens");
            };
            let joined: Vec<u8> = [a.as_slice(), b.as_slice()].concat();
            let (Some(&ia), Some(&ib), Some(&id)) = (
                vocab.get(a.as_slice()),
                vocab.get(b.as_slice()),
                vocab.get(joined.as_slice()),
            ) else {
                bail!("merge {rank} ({m}) names a token missing from the vocabulary");
            };
            // `tokenizers` keeps the first rank of a pair listed twice.
            merges.entry((ia, ib)).or_insert((rank as u32, id));
        }
        // A cut must not fall inside an added token (cuts are next to whitespace).
        let cuttable = CUTTABLE_PATTERNS.contains(&pattern.as_str())
            && added.as_ref().is_none_or(|a| !a.has_whitespace);
        Ok(FastBpe {
            cuttable,
            nfc,
            added: added.map(|a| a.words),
            splitter,
            vocab: BytesMap::from_pairs(vocab),
            whole: match model["ignore_merges"].as_bool() {
                Some(true) => Whole::Always,
                _ => Whole::Checked((0..=max_id).map(|_| AtomicU8::new(0)).collect()),
            },
            id: next_id(),
            merger: Merger::Merges {
                byte_ids: Box::new(byte_ids),
                merges,
            },
        })
    }

    /// Whether a text may be cut after a `\n` between non-whitespace characters and its
    /// parts encoded separately.
    pub fn cuttable(&self) -> bool {
        self.cuttable
    }

    /// Appends the ids of `text` to `out`.
    pub fn encode_into(&self, text: &str, out: &mut Vec<u32>) {
        let Some(added) = &self.added else {
            return self.encode_normalized(text, out);
        };
        let mut at = 0;
        for m in added.search.find_iter(text) {
            if let Some(id) = added.ids[m.pattern().as_usize()] {
                self.encode_normalized(&text[at..m.start()], out);
                out.push(id);
                at = m.end();
            }
        }
        self.encode_normalized(&text[at..], out);
    }

    /// Appends the ids of `text` (no added token in it) to `out`, after the normalizer.
    fn encode_normalized(&self, text: &str, out: &mut Vec<u32>) {
        if self.nfc && !text.is_ascii() && is_nfc_quick(text.chars()) != IsNormalized::Yes {
            let normal: String = text.nfc().map(|(c, _)| c).collect();
            return self.encode_text(&normal, out);
        }
        self.encode_text(text, out)
    }

    /// Appends the ids of a normalized `text` to `out`: split, then each piece looked up or
    /// merged.
    fn encode_text(&self, text: &str, out: &mut Vec<u32>) {
        let mut work = Work::default();
        MERGED.with_borrow_mut(|cache| {
            if cache.owner != self.id {
                cache.owner = self.id;
                cache.dfa = Some(self.splitter.cache());
                cache.pieces.clear();
            }
            let mut dfa = cache.dfa.take().expect("set above");
            self.splitter.split(text, &mut dfa, |piece| {
                self.encode_piece(piece.as_bytes(), out, &mut work, cache)
            });
            cache.dfa = Some(dfa);
        });
    }

    fn encode_piece(
        &self,
        piece: &[u8],
        out: &mut Vec<u32>,
        work: &mut Work,
        cache: &mut MergedCache,
    ) {
        if let Some(&id) = self.vocab.get(piece) {
            if self.is_whole(id, piece, work) {
                out.push(id);
                return;
            }
        }
        if let Some(ids) = cache.pieces.get(piece) {
            out.extend_from_slice(ids);
            return;
        }
        let from = out.len();
        self.merge_piece(piece, out, work);
        if cache.pieces.len() >= MERGED_CAPACITY {
            cache.pieces.clear();
        }
        cache.pieces.insert(piece, out[from..].into());
    }

    /// Whether `piece`, the bytes of token `id`, encodes as that token (see [`Whole`]).
    fn is_whole(&self, id: u32, piece: &[u8], work: &mut Work) -> bool {
        let Whole::Checked(known) = &self.whole else {
            return true;
        };
        let known = &known[id as usize];
        match known.load(Ordering::Relaxed) {
            0 => {
                let mut ids = Vec::new();
                self.merge_piece(piece, &mut ids, work);
                let whole = ids == [id];
                known.store(if whole { 1 } else { 2 }, Ordering::Relaxed);
                whole
            }
            state => state == 1,
        }
    }

    /// Appends the merged ids of a piece that is not one token (or may not be taken whole).
    fn merge_piece(&self, piece: &[u8], out: &mut Vec<u32>, work: &mut Work) {
        match &self.merger {
            Merger::Ranks { bpe, ids } => {
                let merged = bpe.encode_via_backtracking(piece);
                match ids {
                    Some(ids) => out.extend(merged.iter().map(|&i| ids[i as usize])),
                    None => out.extend(merged),
                }
            }
            Merger::Merges { byte_ids, merges } => merge(piece, byte_ids, merges, out, work),
        }
    }
}

/// `tokenizers`' BPE merge of one piece: one symbol per byte in a doubly linked list, the
/// queued pair with the lowest rank (then the leftmost) merged first.
fn merge(
    piece: &[u8],
    byte_ids: &[u32; 256],
    merges: &FxHashMap<(u32, u32), (u32, u32)>,
    out: &mut Vec<u32>,
    work: &mut Work,
) {
    match piece {
        [] => return,
        [b] => return out.push(byte_ids[*b as usize]),
        _ => {}
    }
    // One symbol per byte in a doubly linked list; `id == u32::MAX` marks a merged-away one.
    let n = piece.len();
    work.syms.clear();
    work.syms
        .extend(piece.iter().enumerate().map(|(i, &b)| Sym {
            id: byte_ids[b as usize],
            prev: i.wrapping_sub(1),
            next: i + 1,
        }));
    work.heap.clear();
    for i in 0..n - 1 {
        if let Some(&(rank, id)) = merges.get(&(work.syms[i].id, work.syms[i + 1].id)) {
            work.heap.push(Reverse((rank, i, id)));
        }
    }
    while let Some(Reverse((rank, i, id))) = work.heap.pop() {
        let left = work.syms[i];
        if left.id == u32::MAX || left.next >= n {
            continue;
        }
        let right = work.syms[left.next];
        // Stale: one side has changed since this pair was queued.
        if merges.get(&(left.id, right.id)) != Some(&(rank, id)) {
            continue;
        }
        work.syms[i] = Sym {
            id,
            prev: left.prev,
            next: right.next,
        };
        work.syms[left.next].id = u32::MAX;
        if right.next < n {
            work.syms[right.next].prev = i;
            if let Some(&(r, m)) = merges.get(&(id, work.syms[right.next].id)) {
                work.heap.push(Reverse((r, i, m)));
            }
        }
        if left.prev < n {
            if let Some(&(r, m)) = merges.get(&(work.syms[left.prev].id, id)) {
                work.heap.push(Reverse((r, left.prev, m)));
            }
        }
    }
    let mut i = 0;
    while i < n {
        out.push(work.syms[i].id);
        i = work.syms[i].next;
    }
}

#[derive(Clone, Copy)]
struct Sym {
    id: u32,
    prev: usize,
    next: usize,
}

/// Buffers reused across the pieces of one text.
#[derive(Default)]
struct Work {
    syms: Vec<Sym>,
    heap: BinaryHeap<Reverse<(u32, usize, u32)>>,
}

/// A tokenizer.json's [`AddedWords`], if it has added tokens that are not special, and
/// whether any of the tokens searched holds whitespace; an error for added tokens matched in
/// ways not reproduced (after normalization, or with `single_word`/`lstrip`/`rstrip`).
struct Added {
    words: AddedWords,
    has_whitespace: bool,
}

fn added_words(json: &Value) -> Result<Option<Added>> {
    let tokens = json["added_tokens"]
        .as_array()
        .map_or(&[][..], Vec::as_slice);
    let plain = |t: &&Value| t["special"].as_bool() != Some(true);
    if !tokens.iter().any(|t| plain(&t)) {
        return Ok(None);
    }
    let flag = |t: &Value, key: &str| t[key].as_bool() == Some(true);
    // `tokenizers`' default: an added token is normalized unless it is special.
    let normalized = |t: &Value| t["normalized"].as_bool().unwrap_or(plain(&t));
    if tokens
        .iter()
        .filter(plain)
        .any(|t| normalized(t) || flag(t, "single_word") || flag(t, "lstrip") || flag(t, "rstrip"))
    {
        bail!(
            "it has added tokens that are not special and are normalized, single words or \
             strip spaces"
        );
    }
    let (mut contents, mut ids) = (Vec::new(), Vec::new());
    for t in tokens.iter().filter(|t| !normalized(t)) {
        let (Some(content), Some(id)) = (t["content"].as_str(), t["id"].as_u64()) else {
            bail!("added token {t} has no content or id");
        };
        contents.push(content);
        ids.push(plain(&t).then_some(u32::try_from(id)?));
    }
    let search = AhoCorasick::builder()
        .match_kind(MatchKind::LeftmostLongest)
        .build(&contents)
        .map_err(|e| anyhow!("its added tokens do not build a search: {e}"))?;
    Ok(Some(Added {
        words: AddedWords { search, ids },
        has_whitespace: contents.iter().any(|c| c.chars().any(char::is_whitespace)),
    }))
}

/// The regex of a byte-level pre-tokenizer this encoder reproduces.
fn pre_tokenizer_pattern(pre: &Value) -> Result<String> {
    let byte_level = |p: &Value, with_regex: bool| {
        p["type"].as_str() == Some("ByteLevel")
            && p["add_prefix_space"].as_bool() != Some(true)
            && p["use_regex"].as_bool().unwrap_or(true) == with_regex
    };
    if byte_level(pre, true) {
        return Ok(GPT2_PATTERN.into());
    }
    if pre["type"].as_str() == Some("Sequence") {
        if let Some([split, last]) = pre["pretokenizers"].as_array().map(Vec::as_slice) {
            let regex = split["pattern"]["Regex"].as_str();
            if split["type"].as_str() == Some("Split")
                && split["behavior"].as_str() == Some("Isolated")
                && split["invert"].as_bool() != Some(true)
                && byte_level(last, false)
            {
                if let Some(regex) = regex {
                    return Ok(regex.to_string());
                }
            }
        }
    }
    bail!("its pre-tokenizer is not ByteLevel or Split(regex) + ByteLevel")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The pieces of `text` under `splitter`.
    fn pieces<'t>(splitter: &Splitter, text: &'t str) -> Vec<&'t str> {
        let mut cache = splitter.cache();
        let mut out = Vec::new();
        splitter.split(text, &mut cache, |p| out.push(p));
        out
    }

    /// A token that BPE does not merge its bytes back to ("abc" with the merges "a b", "b c"
    /// gives "ab" "c") is taken whole only with `ignore_merges`: the ids of `tokenizers`
    /// itself on the same tokenizer.json, both ways.
    #[test]
    fn a_token_its_merges_do_not_rebuild_is_whole_only_with_ignore_merges() {
        let chars = super::super::hf_json::byte_chars();
        let mut vocab = serde_json::Map::new();
        for (b, c) in chars.iter().enumerate() {
            vocab.insert(c.to_string(), b.into());
        }
        for (i, t) in ["ab", "bc", "abc"].iter().enumerate() {
            vocab.insert(t.to_string(), (256 + i).into());
        }
        for ignore_merges in [false, true] {
            let json = serde_json::json!({
                "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
                "normalizer": null,
                "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false,
                                  "trim_offsets": true, "use_regex": true},
                "post_processor": null, "decoder": null,
                "model": {"type": "BPE", "dropout": null, "unk_token": null,
                          "continuing_subword_prefix": null, "end_of_word_suffix": null,
                          "fuse_unk": false, "byte_fallback": false,
                          "ignore_merges": ignore_merges,
                          "vocab": vocab, "merges": ["a b", "b c"]}
            });
            let fast = FastBpe::from_hf_json(&json).unwrap();
            let reference: tokenizers::Tokenizer = json.to_string().parse().unwrap();
            for text in ["abc", "abc abc", "xabcx", "ab", "bc", "abcabc", " abc"] {
                let mut ids = Vec::new();
                fast.encode_into(text, &mut ids);
                let want = reference.encode(text, false).unwrap().get_ids().to_vec();
                assert_eq!(ids, want, "{text:?}, ignore_merges {ignore_merges}");
            }
            let mut ids = Vec::new();
            fast.encode_into("abc", &mut ids);
            assert_eq!(
                ids,
                if ignore_merges {
                    vec![258]
                } else {
                    vec![256, 99]
                }
            );
        }
    }

    #[test]
    fn pack_reads_up_to_8_bytes_as_a_little_endian_number() {
        let bytes: Vec<u8> = (0..8u8)
            .map(|i| i.wrapping_mul(37).wrapping_add(0x81))
            .collect();
        for n in 0..=8 {
            let mut padded = [0u8; 8];
            padded[..n].copy_from_slice(&bytes[..n]);
            assert_eq!(pack(&bytes[..n]), u64::from_le_bytes(padded), "{n} bytes");
        }
    }

    /// The ASCII-word shortcut ends every piece where the DFA does, on texts built to probe
    /// its edges: words against contractions, digits, punctuation, runs of spaces, line
    /// breaks, and letters beyond ASCII (é, ſ, K, 中) or not letters (😀) right after a word.
    #[test]
    fn ascii_words_split_as_the_dfa_does() {
        let parts = [
            "a", "Zq", " ", "  ", "'s", "'T", "'", "é", "中", "1", "22", ".", "\n", "\r\n", "\t",
            "x'S", "ſ", "\u{212a}", " é", "ab ", "-", "😀", " the", "don't", "\u{a0}",
        ];
        for pattern in ASCII_WORD_PATTERNS {
            let fast = Splitter::new(pattern).unwrap();
            let mut dfa = Splitter::new(pattern).unwrap();
            assert!(fast.ascii_words);
            dfa.ascii_words = false;
            let mut x = 0x2545_f491_4f6c_dd1du64;
            for _ in 0..5000 {
                let mut text = String::new();
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                for k in 0..(x % 24) {
                    text.push_str(parts[((x >> (k * 2 % 50)) as usize + k as usize) % parts.len()]);
                }
                assert_eq!(pieces(&fast, &text), pieces(&dfa, &text), "{text:?}");
            }
        }
        assert!(!Splitter::new(O200K_PATTERN).unwrap().ascii_words);
    }
}
