//! Token files: lockstep's own `.tok` format (written and read) and, for
//! reading only, nanoGPT `.bin` arrays and llm.c shards.
//!
//! `.tok` layout, little-endian: a 64-byte header (magic `LSTOK\0\0\x01`,
//! u32 version = 1, u32 dtype = bytes per token (2 or 4), u64 token count,
//! u64 document count, 32-byte BLAKE3 of the tokenizer definition), the
//! tokens, then one u64 start offset (token index) per document.

use std::fmt;
use std::fs::{self, File};
use std::io::{BufWriter, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use memmap2::Mmap;

/// First 8 bytes of every `.tok` file.
pub const TOK_MAGIC: [u8; 8] = *b"LSTOK\0\0\x01";
/// Current `.tok` format version.
pub const TOK_VERSION: u32 = 1;
/// Size of the `.tok` header in bytes.
pub const TOK_HEADER_BYTES: u64 = 64;

/// llm.c shard magic for GPT-2 shards (u16 tokens).
const LLMC_MAGIC_U16: i32 = 20240520;
/// llm.c shard magic for Llama 3 shards (u32 tokens).
const LLMC_MAGIC_U32: i32 = 20240801;
const LLMC_HEADER_BYTES: u64 = 1024;

/// The first index in `0..n` where `pred` is false, `pred` being true on a prefix of the
/// range and false after (a binary search, like `slice::partition_point` over indices): how
/// document offsets, which increase, are searched here and in `prepare`.
pub(crate) fn partition_point(n: u64, pred: impl Fn(u64) -> bool) -> u64 {
    let (mut lo, mut hi) = (0, n);
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if pred(mid) {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    lo
}

/// Bytes per token needed to store ids below `vocab_size`.
pub fn dtype_for_vocab(vocab_size: usize) -> u32 {
    if vocab_size <= 1 << 16 {
        2
    } else {
        4
    }
}

/// Counts written by [`TokFileWriter::finish`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokFileInfo {
    /// Where the file now lives.
    pub path: PathBuf,
    /// Total tokens, EOS included.
    pub num_tokens: u64,
    /// Number of documents.
    pub num_docs: u64,
    /// Bytes per token.
    pub dtype_bytes: u32,
    /// The largest token id written (`None` for a file without tokens).
    pub max_token_id: Option<u32>,
}

/// Streams documents into a `.tok` file, atomically: data goes to
/// `<final>.tmp-<host>-<pid>` and is renamed into place by [`TokFileWriter::finish`];
/// a writer dropped before that removes its temporary files. Memory stays at its two 1 MiB
/// buffers whatever the size: the document offsets go to a side file
/// (`<final>.tmp-<host>-<pid>.offsets`, u64 each) appended at the end.
pub struct TokFileWriter {
    out: Option<BufWriter<File>>,
    offsets: Option<BufWriter<File>>,
    tmp_path: PathBuf,
    offsets_path: PathBuf,
    final_path: PathBuf,
    dtype_bytes: u32,
    tokenizer_hash: [u8; 32],
    num_tokens: u64,
    num_docs: u64,
    /// The largest id of each run of [`MAX_CHUNK`] tokens, so the largest id below any point
    /// is known after a split without reading the tokens again.
    chunk_max: Vec<u32>,
    /// Renamed into place: nothing to clean up.
    sealed: bool,
}

/// Tokens per entry of [`TokFileWriter`]'s `chunk_max`.
const MAX_CHUNK: u64 = 1 << 20;

/// The document start offsets of a stream being written, read from its side file.
pub struct DocStarts<'a> {
    bytes: &'a [u8],
}

impl DocStarts<'_> {
    /// Number of documents.
    pub fn len(&self) -> u64 {
        self.bytes.len() as u64 / 8
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    /// Where document `i` starts.
    pub fn get(&self, i: u64) -> u64 {
        le_u64(self.bytes, 8 * i as usize)
    }

    /// The index of the first document starting at or after token `t` (`len()` if none).
    pub fn first_at_or_after(&self, t: u64) -> u64 {
        partition_point(self.len(), |i| self.get(i) < t)
    }
}

fn tok_header(dtype: u32, tokens: u64, docs: u64, hash: &[u8; 32]) -> [u8; 64] {
    let mut h = [0u8; 64];
    h[0..8].copy_from_slice(&TOK_MAGIC);
    h[8..12].copy_from_slice(&TOK_VERSION.to_le_bytes());
    h[12..16].copy_from_slice(&dtype.to_le_bytes());
    h[16..24].copy_from_slice(&tokens.to_le_bytes());
    h[24..32].copy_from_slice(&docs.to_le_bytes());
    h[32..64].copy_from_slice(hash);
    h
}

impl TokFileWriter {
    /// Starts a file that will appear at `final_path` on `finish`.
    pub fn create(final_path: &Path, dtype_bytes: u32, tokenizer_hash: [u8; 32]) -> Result<Self> {
        if dtype_bytes != 2 && dtype_bytes != 4 {
            bail!(
                "{}: token dtype must be 2 or 4 bytes, got {dtype_bytes}",
                final_path.display()
            );
        }
        // Host and pid: two machines writing the same file on a shared file system (two
        // `prepare --shard` runs of one part) never share a temporary file.
        let mut tmp_name = final_path.as_os_str().to_owned();
        tmp_name.push(format!(
            ".tmp-{}-{}",
            crate::sys::hostname(),
            std::process::id()
        ));
        let tmp_path = PathBuf::from(tmp_name);
        // Readable too: finish_split maps it.
        let file = File::options()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&tmp_path)
            .with_context(|| format!("{}: cannot create token file", tmp_path.display()))?;
        let mut out = BufWriter::with_capacity(1 << 20, file);
        // Placeholder; the real counts are only known in finish().
        out.write_all(&tok_header(dtype_bytes, 0, 0, &tokenizer_hash))?;
        let mut offsets_name = tmp_path.as_os_str().to_owned();
        offsets_name.push(".offsets");
        let offsets_path = PathBuf::from(offsets_name);
        let offsets = File::options()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&offsets_path)
            .with_context(|| {
                let _ = fs::remove_file(&tmp_path);
                format!("{}: cannot create", offsets_path.display())
            })?;
        Ok(TokFileWriter {
            out: Some(out),
            offsets: Some(BufWriter::with_capacity(1 << 20, offsets)),
            tmp_path,
            offsets_path,
            final_path: final_path.to_path_buf(),
            dtype_bytes,
            tokenizer_hash,
            num_tokens: 0,
            num_docs: 0,
            chunk_max: Vec::new(),
            sealed: false,
        })
    }

    /// Tokens written so far.
    pub fn num_tokens(&self) -> u64 {
        self.num_tokens
    }

    /// Appends one document (the caller has already appended EOS).
    pub fn push_document(&mut self, tokens: &[u32]) -> Result<()> {
        self.start_document()?;
        self.push_tokens(tokens)
    }

    /// Starts a document at the current end: the tokens pushed next belong to it.
    pub fn start_document(&mut self) -> Result<()> {
        let offsets = self.offsets.as_mut().expect("writer used after finish");
        offsets.write_all(&self.num_tokens.to_le_bytes())?;
        self.num_docs += 1;
        Ok(())
    }

    /// Appends tokens to the current document (a long document arrives in pieces).
    pub fn push_tokens(&mut self, tokens: &[u32]) -> Result<()> {
        let out = self.out.as_mut().expect("writer used after finish");
        if self.dtype_bytes == 2 {
            if let Some(&bad) = tokens.iter().find(|&&t| t > u16::MAX as u32) {
                bail!(
                    "{}: token id {bad} does not fit in 2 bytes; the tokenizer's vocabulary needs \
                     dtype 4 (use dtype_for_vocab)",
                    self.final_path.display()
                );
            }
            for &t in tokens {
                out.write_all(&(t as u16).to_le_bytes())?;
            }
        } else {
            for &t in tokens {
                out.write_all(&t.to_le_bytes())?;
            }
        }
        let mut at = self.num_tokens;
        for &t in tokens {
            let chunk = (at / MAX_CHUNK) as usize;
            if chunk == self.chunk_max.len() {
                self.chunk_max.push(t);
            }
            self.chunk_max[chunk] = self.chunk_max[chunk].max(t);
            at += 1;
        }
        self.num_tokens = at;
        Ok(())
    }

    /// Ends the stream split in two: the tokens before `cut` stay in this file, the rest go
    /// to a new one at `val_path`. `choose(starts, total)` picks the cut from the document
    /// starts. A document cut in two keeps its head here, closed with `eos` so that every
    /// document still ends with one, and its tail starts `val_path`. Costs the second
    /// file's tokens and the first one's offsets in I/O, not a copy of the whole stream.
    pub fn finish_split(
        mut self,
        val_path: &Path,
        eos: u32,
        choose: impl FnOnce(&DocStarts<'_>, u64) -> u64,
    ) -> Result<(TokFileInfo, TokFileInfo)> {
        let ctx = || format!("{}: cannot write token file", self.tmp_path.display());
        let out = self.out.take().expect("finish called twice");
        let offsets = self.offsets.take().expect("finish called twice");
        let mut file = out
            .into_inner()
            .map_err(|e| e.into_error())
            .with_context(ctx)?;
        let offsets = offsets
            .into_inner()
            .map_err(|e| e.into_error())
            .with_context(ctx)?;
        // SAFETY: both files are this writer's own temporary files, written only below.
        let tokens = unsafe { Mmap::map(&file) }.with_context(ctx)?;
        let off_map = unsafe { Mmap::map(&offsets) }.with_context(ctx)?;
        let starts = DocStarts { bytes: &off_map };
        let total = self.num_tokens;
        let cut = choose(&starts, total).min(total);
        let d = self.dtype_bytes as usize;
        let token = |i: u64| {
            let at = TOK_HEADER_BYTES as usize + i as usize * d;
            match d {
                2 => u32::from(u16::from_le_bytes([tokens[at], tokens[at + 1]])),
                _ => le_u32(&tokens, at),
            }
        };

        // The second file: every document that ends after the cut, from the cut on.
        let mut val = TokFileWriter::create(val_path, self.dtype_bytes, self.tokenizer_hash)?;
        let first_after = starts.first_at_or_after(cut);
        let at_boundary = first_after < starts.len() && starts.get(first_after) == cut;
        let first = if at_boundary {
            first_after
        } else {
            first_after.saturating_sub(1)
        };
        let mut doc = Vec::new();
        for i in first..starts.len() {
            let end = if i + 1 < starts.len() {
                starts.get(i + 1)
            } else {
                total
            };
            doc.clear();
            doc.extend((starts.get(i).max(cut)..end).map(token));
            val.push_document(&doc)?;
        }
        let val = val.finish()?;

        // This file: its largest id below the cut from the chunk maxima and the partial chunk.
        let full = (cut / MAX_CHUNK) as usize;
        let partial = (full as u64 * MAX_CHUNK..cut).map(token).max();
        let mut max = self.chunk_max[..full].iter().copied().max().max(partial);
        let train_docs = first_after;
        drop(tokens);
        let mut kept = cut;
        file.set_len(TOK_HEADER_BYTES + cut * d as u64)
            .with_context(ctx)?;
        file.seek(SeekFrom::End(0)).with_context(ctx)?;
        let mut w = BufWriter::with_capacity(1 << 20, &mut file);
        if !at_boundary && cut > 0 {
            match d {
                2 => w.write_all(&(eos as u16).to_le_bytes()),
                _ => w.write_all(&eos.to_le_bytes()),
            }
            .with_context(ctx)?;
            kept += 1;
            max = max.max(Some(eos));
        }
        w.write_all(&off_map[..train_docs as usize * 8])
            .with_context(ctx)?;
        w.flush().with_context(ctx)?;
        drop(w);
        drop(off_map);
        drop(offsets);
        let _ = fs::remove_file(&self.offsets_path);
        self.num_tokens = kept;
        self.num_docs = train_docs;
        let train = self.seal(file, max)?;
        Ok((train, val))
    }

    /// Writes the offsets and final header, syncs, and renames into place.
    pub fn finish(mut self) -> Result<TokFileInfo> {
        let mut out = self.out.take().expect("finish called twice");
        let offsets = self.offsets.take().expect("finish called twice");
        let ctx = || format!("{}: cannot write token file", self.tmp_path.display());
        let mut offsets = offsets
            .into_inner()
            .map_err(|e| e.into_error())
            .with_context(ctx)?;
        offsets.seek(SeekFrom::Start(0)).with_context(ctx)?;
        std::io::copy(&mut offsets, &mut out).with_context(ctx)?;
        drop(offsets);
        let _ = fs::remove_file(&self.offsets_path);
        let max = self.chunk_max.iter().copied().max();
        let file = out
            .into_inner()
            .map_err(|e| e.into_error())
            .with_context(ctx)?;
        self.seal(file, max)
    }

    /// Writes the final header into `file` (data and offsets complete), syncs, and renames it
    /// into place.
    fn seal(&mut self, mut file: File, max_token_id: Option<u32>) -> Result<TokFileInfo> {
        let ctx = || format!("{}: cannot write token file", self.tmp_path.display());
        let docs = self.num_docs;
        let header = tok_header(
            self.dtype_bytes,
            self.num_tokens,
            docs,
            &self.tokenizer_hash,
        );
        file.seek(SeekFrom::Start(0)).with_context(ctx)?;
        file.write_all(&header).with_context(ctx)?;
        file.sync_all().with_context(ctx)?;
        drop(file);
        fs::rename(&self.tmp_path, &self.final_path).with_context(|| {
            format!(
                "cannot rename {} to {}",
                self.tmp_path.display(),
                self.final_path.display()
            )
        })?;
        self.sealed = true;
        sync_parent_dir(&self.final_path);
        Ok(TokFileInfo {
            path: self.final_path.clone(),
            num_tokens: self.num_tokens,
            num_docs: docs,
            dtype_bytes: self.dtype_bytes,
            max_token_id,
        })
    }
}

impl Drop for TokFileWriter {
    fn drop(&mut self) {
        if !self.sealed {
            let _ = fs::remove_file(&self.tmp_path);
        }
        let _ = fs::remove_file(&self.offsets_path);
    }
}

/// Makes a rename durable. Best effort: some filesystems refuse to fsync a
/// directory, and the data itself is already synced.
fn sync_parent_dir(path: &Path) {
    if let Some(dir) = path.parent() {
        let dir = if dir.as_os_str().is_empty() {
            Path::new(".")
        } else {
            dir
        };
        let _ = crate::sys::durable::sync_dir(dir);
    }
}

/// Which on-disk format a [`TokenFile`] was read from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SourceKind {
    /// lockstep `.tok` (with document offsets and tokenizer hash).
    Lockstep,
    /// nanoGPT `.bin`: raw little-endian u16 tokens, no header.
    NanoGpt,
    /// llm.c shard: 1024-byte header then u16 (GPT-2) or u32 (Llama 3) tokens.
    LlmC {
        /// The header's version field.
        version: i32,
    },
}

impl fmt::Display for SourceKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SourceKind::Lockstep => write!(f, "lockstep .tok"),
            SourceKind::NanoGpt => write!(f, "nanoGPT .bin (raw u16)"),
            SourceKind::LlmC { version } => write!(f, "llm.c shard (version {version})"),
        }
    }
}

/// One read-only, memory-mapped token file.
struct Mapped {
    map: Mmap,
    kind: SourceKind,
    dtype: u32,
    data_start: usize,
    num_tokens: u64,
    num_docs: u64,
    offsets_start: usize,
    tokenizer_hash: Option<[u8; 32]>,
}

fn le_u32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
}

fn le_u64(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
}

/// Whether `path` looks like a token file [`TokenFile::open`] can read
/// (by magic, or by the `.tok`/`.bin` extension).
pub fn is_token_file(path: &Path) -> bool {
    if !path.is_file() {
        return false;
    }
    if matches!(
        path.extension().and_then(|e| e.to_str()),
        Some("tok" | "bin")
    ) {
        return true;
    }
    let mut magic = [0u8; 8];
    match File::open(path).and_then(|mut f| std::io::Read::read_exact(&mut f, &mut magic)) {
        Ok(()) => magic == TOK_MAGIC || is_llmc_magic(&magic),
        Err(_) => false,
    }
}

fn is_llmc_magic(head: &[u8]) -> bool {
    head.len() >= 4 && {
        let m = i32::from_le_bytes(head[0..4].try_into().unwrap());
        m == LLMC_MAGIC_U16 || m == LLMC_MAGIC_U32
    }
}

impl Mapped {
    /// Maps and validates a `.tok` file, an llm.c shard (detected by magic) or
    /// a nanoGPT `.bin` (any other file ending in `.bin`).
    pub fn open(path: &Path) -> Result<Self> {
        let file = File::open(path)
            .with_context(|| format!("{}: cannot open token file", path.display()))?;
        // SAFETY: the file is only read. Token files are written to a temporary
        // name and renamed into place, so nothing lockstep does modifies a
        // mapped file; external truncation would be a user error.
        let map = unsafe { Mmap::map(&file) }
            .with_context(|| format!("{}: cannot memory-map token file", path.display()))?;
        let p = path.display();
        if map.len() >= 8 && map[0..8] == TOK_MAGIC {
            return Self::open_tok(map, path);
        }
        if map.len() >= LLMC_HEADER_BYTES as usize && is_llmc_magic(&map) {
            return Self::open_llmc(map, path);
        }
        if path.extension().is_some_and(|e| e == "bin") {
            if map.len() % 2 != 0 || map.is_empty() {
                bail!(
                    "{p}: read as a nanoGPT .bin (raw u16 tokens) but its size {} is {}; the file \
                     is truncated or not a token file, regenerate it",
                    map.len(),
                    if map.is_empty() { "zero" } else { "odd" }
                );
            }
            let num_tokens = map.len() as u64 / 2;
            return Ok(Mapped {
                map,
                kind: SourceKind::NanoGpt,
                dtype: 2,
                data_start: 0,
                num_tokens,
                num_docs: 0,
                offsets_start: 0,
                tokenizer_hash: None,
            });
        }
        bail!(
            "{p}: not a lockstep token file (no LSTOK magic); token files are recognised by \
             content (lockstep .tok, llm.c shards with magic {LLMC_MAGIC_U16}/{LLMC_MAGIC_U32}) \
             or by the .bin extension (nanoGPT raw u16); point data.path at text (.txt/.jsonl) \
             or at such a file"
        )
    }

    fn open_tok(map: Mmap, path: &Path) -> Result<Self> {
        let p = path.display();
        let fix = "delete it and run `lockstep prepare` again";
        if map.len() < TOK_HEADER_BYTES as usize {
            bail!(
                "{p}: file is {} bytes, shorter than the 64-byte header; the file is truncated, \
                 {fix}",
                map.len()
            );
        }
        let version = le_u32(&map, 8);
        if version != TOK_VERSION {
            bail!(
                "{p}: .tok format version {version} is not supported (expected {TOK_VERSION}); \
                 {fix} with this lockstep"
            );
        }
        let dtype = le_u32(&map, 12);
        if dtype != 2 && dtype != 4 {
            bail!(
                "{p}: header says {dtype} bytes per token, only 2 and 4 are valid; the file is \
                 corrupt, {fix}"
            );
        }
        let num_tokens = le_u64(&map, 16);
        let num_docs = le_u64(&map, 24);
        let expected = num_tokens
            .checked_mul(dtype as u64)
            .and_then(|t| num_docs.checked_mul(8).and_then(|d| t.checked_add(d)))
            .and_then(|x| x.checked_add(TOK_HEADER_BYTES));
        let actual = map.len() as u64;
        if expected != Some(actual) {
            let shown = expected.map_or("overflow".to_string(), |e| e.to_string());
            let what = if expected.is_some_and(|e| actual < e) {
                "truncated"
            } else {
                "corrupt (size does not match its header)"
            };
            bail!(
                "{p}: file is {actual} bytes but its header says \
                 64+{dtype}*{num_tokens}+8*{num_docs} = {shown}; the file is {what}, {fix}"
            );
        }
        let mut hash = [0u8; 32];
        hash.copy_from_slice(&map[32..64]);
        let data_start = TOK_HEADER_BYTES as usize;
        let tf = Mapped {
            offsets_start: data_start + (num_tokens * dtype as u64) as usize,
            map,
            kind: SourceKind::Lockstep,
            dtype,
            data_start,
            num_tokens,
            num_docs,
            tokenizer_hash: Some(hash),
        };
        let mut prev = None;
        for i in 0..num_docs {
            let o = tf.doc_offset(i);
            let ok = match prev {
                None => o == 0,
                Some(prev) => o > prev,
            } && o < num_tokens;
            if !ok {
                bail!(
                    "{p}: document offset {i} is {o}, which is not increasing within \
                     0..{num_tokens}; the file is corrupt, {fix}"
                );
            }
            prev = Some(o);
        }
        Ok(tf)
    }

    fn open_llmc(map: Mmap, path: &Path) -> Result<Self> {
        let p = path.display();
        let field = |i: usize| i32::from_le_bytes(map[i * 4..i * 4 + 4].try_into().unwrap());
        let magic = field(0);
        let version = field(1);
        let count = field(2);
        let dtype = if magic == LLMC_MAGIC_U16 { 2 } else { 4 };
        if count < 0 {
            bail!(
                "{p}: llm.c shard header has a negative token count {count}; the file is \
                 corrupt, regenerate it"
            );
        }
        let expected = LLMC_HEADER_BYTES + count as u64 * dtype as u64;
        let actual = map.len() as u64;
        if expected != actual {
            let what = if actual < expected {
                "truncated"
            } else {
                "corrupt (larger than its header says)"
            };
            bail!(
                "{p}: llm.c shard is {actual} bytes but its header says \
                 1024+{dtype}*{count} = {expected}; the file is {what}, regenerate it"
            );
        }
        Ok(Mapped {
            map,
            kind: SourceKind::LlmC { version },
            dtype,
            data_start: LLMC_HEADER_BYTES as usize,
            num_tokens: count as u64,
            num_docs: 0,
            offsets_start: 0,
            tokenizer_hash: None,
        })
    }

    // Ranges are checked by `TokenFile`, the only caller, against the stream's counts.

    /// Token index where document `i` starts.
    fn doc_offset(&self, i: u64) -> u64 {
        le_u64(&self.map, self.offsets_start + 8 * i as usize)
    }

    /// How many documents start before token `t`.
    fn docs_before(&self, t: u64) -> u64 {
        partition_point(self.num_docs, |i| self.doc_offset(i) < t)
    }

    /// Token `i`.
    fn get(&self, i: u64) -> u32 {
        let at = self.data_start + (i * self.dtype as u64) as usize;
        match self.dtype {
            2 => u16::from_le_bytes([self.map[at], self.map[at + 1]]) as u32,
            _ => le_u32(&self.map, at),
        }
    }

    /// Copies tokens `start..start + len` into `out[..len]` as i64.
    fn copy_window(&self, start: u64, len: usize, out: &mut [i64]) {
        let out = &mut out[..len];
        let d = self.dtype as usize;
        let from = self.data_start + start as usize * d;
        let bytes = &self.map[from..from + len * d];
        match self.dtype {
            2 => {
                for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                    *o = u16::from_le_bytes([c[0], c[1]]) as i64;
                }
            }
            _ => {
                for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                    *o = u32::from_le_bytes([c[0], c[1], c[2], c[3]]) as i64;
                }
            }
        }
    }

    /// The largest token id in the file (`None` when it has no tokens), by reading every token:
    /// a parallel scan of the mapped data (rayon's global pool). It reads the whole file, so
    /// callers remember the result ([`super::ids::max_token_id`]).
    pub fn scan_max_token_id(&self, tokens: u64) -> Option<u32> {
        use rayon::prelude::*;
        // Chunks of 4 MiB: large enough that scheduling costs nothing, small enough to balance.
        const CHUNK_BYTES: usize = 4 << 20;
        let d = self.dtype as usize;
        let end = self.data_start + tokens as usize * d;
        let data = &self.map[self.data_start..end];
        let chunks = data.par_chunks(CHUNK_BYTES - CHUNK_BYTES % d);
        match self.dtype {
            2 => chunks
                .map(|c| {
                    c.chunks_exact(2)
                        .map(|t| u16::from_le_bytes([t[0], t[1]]))
                        .max()
                })
                .max()
                .flatten()
                .map(u32::from),
            _ => chunks
                .map(|c| {
                    c.chunks_exact(4)
                        .map(|t| u32::from_le_bytes([t[0], t[1], t[2], t[3]]))
                        .max()
                })
                .max()
                .flatten(),
        }
    }
}

/// The first `tokens` tokens of one token file, and optionally one more token after them: a
/// part of a [`TokenFile`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenPrefix {
    /// The token file.
    pub path: PathBuf,
    /// How many of its tokens belong to the view (from the start).
    pub tokens: u64,
    /// A token read after them: the EOS that closes a document the prefix cuts (the head of
    /// the document split between training and validation tokens).
    pub eos: Option<u32>,
}

impl TokenPrefix {
    /// All of the file at `path`, which holds `tokens` tokens.
    pub fn whole(path: PathBuf, tokens: u64) -> TokenPrefix {
        TokenPrefix {
            path,
            tokens,
            eos: None,
        }
    }
}

/// One mapped file in a [`TokenFile`], at token `base` and document `doc_base` of the view:
/// its first `file_tokens` tokens, then `eos` if there is one (`tokens` counts both).
struct Part {
    file: Mapped,
    file_tokens: u64,
    eos: Option<u32>,
    tokens: u64,
    docs: u64,
    base: u64,
    doc_base: u64,
}

impl Part {
    fn get(&self, i: u64) -> u32 {
        match self.eos {
            Some(eos) if i == self.file_tokens => eos,
            _ => self.file.get(i),
        }
    }
}

/// A read-only, memory-mapped stream of tokens: one token file, or the prefixes of several
/// read as one (a cache entry's training tokens, [`TokenFile::open_prefixes`]). Token and
/// document indices are the stream's; every part's documents keep their starts, and a part
/// ends where its prefix does (a document cut there simply ends).
pub struct TokenFile {
    parts: Vec<Part>,
    num_tokens: u64,
    num_docs: u64,
}

impl TokenFile {
    /// Maps and validates a `.tok` file, an llm.c shard (detected by magic) or
    /// a nanoGPT `.bin` (any other file ending in `.bin`).
    pub fn open(path: &Path) -> Result<Self> {
        let file = Mapped::open(path)?;
        let tokens = file.num_tokens;
        Self::from_parts(vec![(file, tokens, None)])
    }

    /// The prefixes as one stream, in order. They must share their dtype and tokenizer.
    pub fn open_prefixes(prefixes: &[TokenPrefix]) -> Result<Self> {
        let mut parts = Vec::with_capacity(prefixes.len());
        for p in prefixes {
            let file = Mapped::open(&p.path)?;
            if p.tokens > file.num_tokens {
                bail!(
                    "{}: holds {} tokens but the cache entry's meta.json uses {}; the entry is \
                     damaged, delete it and run `lockstep prepare` again",
                    p.path.display(),
                    file.num_tokens,
                    p.tokens
                );
            }
            parts.push((file, p.tokens, p.eos));
        }
        let first = prefixes.first().map(|p| p.path.display().to_string());
        let this = Self::from_parts(parts)?;
        let same = this.parts.iter().all(|p| {
            p.file.dtype == this.parts[0].file.dtype
                && p.file.tokenizer_hash == this.parts[0].file.tokenizer_hash
        });
        if !same {
            bail!(
                "{}: the parts of this token stream differ in dtype or tokenizer; delete the \
                 cache entry and run `lockstep prepare` again",
                first.unwrap_or_default()
            );
        }
        Ok(this)
    }

    fn from_parts(files: Vec<(Mapped, u64, Option<u32>)>) -> Result<Self> {
        if files.is_empty() {
            bail!("a token stream needs at least one token file");
        }
        let (mut base, mut doc_base) = (0, 0);
        let mut parts = Vec::with_capacity(files.len());
        for (file, file_tokens, eos) in files {
            let docs = file.docs_before(file_tokens);
            let tokens = file_tokens + u64::from(eos.is_some());
            parts.push(Part {
                file,
                file_tokens,
                eos,
                tokens,
                docs,
                base,
                doc_base,
            });
            base += tokens;
            doc_base += docs;
        }
        Ok(TokenFile {
            parts,
            num_tokens: base,
            num_docs: doc_base,
        })
    }

    /// The part holding stream token `i` (`i < num_tokens`).
    fn part_of_token(&self, i: u64) -> &Part {
        let k = self.parts.partition_point(|p| p.base + p.tokens <= i);
        &self.parts[k]
    }

    /// Number of tokens.
    pub fn num_tokens(&self) -> u64 {
        self.num_tokens
    }

    /// Number of documents (0 for formats without document offsets).
    pub fn num_docs(&self) -> u64 {
        self.num_docs
    }

    /// Bytes per token (2 or 4).
    pub fn dtype_bytes(&self) -> u32 {
        self.parts[0].file.dtype
    }

    /// BLAKE3 of the tokenizer that wrote the file (`.tok` only).
    pub fn tokenizer_hash(&self) -> Option<[u8; 32]> {
        self.parts[0].file.tokenizer_hash
    }

    /// The format this stream was read as (its first file's).
    pub fn source_kind(&self) -> SourceKind {
        self.parts[0].file.kind
    }

    /// Token index where document `i` starts. Panics if `i >= num_docs()`.
    pub fn doc_offset(&self, i: u64) -> u64 {
        assert!(
            i < self.num_docs,
            "document {i} out of range 0..{}",
            self.num_docs
        );
        let k = self.parts.partition_point(|p| p.doc_base + p.docs <= i);
        let p = &self.parts[k];
        p.base + p.file.doc_offset(i - p.doc_base)
    }

    /// Lengths of the pieces that document starts cut `start..start + len` into, in order
    /// (summing to `len`): the documents a packed window holds, the first and last possibly
    /// partial. A binary search over the offsets table, then one entry per boundary inside the
    /// range; no token is read. A file without document offsets (nanoGPT, llm.c) is one piece.
    pub fn document_pieces(&self, start: u64, len: usize) -> Vec<usize> {
        let end = start + len as u64;
        // The first document starting after `start`: offsets are increasing.
        let lo = partition_point(self.num_docs, |i| self.doc_offset(i) <= start);
        let mut pieces = Vec::new();
        let mut from = start;
        for i in lo..self.num_docs {
            let o = self.doc_offset(i);
            if o >= end {
                break;
            }
            pieces.push((o - from) as usize);
            from = o;
        }
        pieces.push((end - from) as usize);
        pieces
    }

    /// Token `i`. Panics if `i >= num_tokens()`.
    pub fn get(&self, i: u64) -> u32 {
        assert!(
            i < self.num_tokens,
            "token {i} out of range 0..{}",
            self.num_tokens
        );
        let p = self.part_of_token(i);
        p.get(i - p.base)
    }

    /// Copies tokens `start..start + len` into `out[..len]` as i64 (the index dtype the model
    /// consumes), across parts where the window spans them. Panics if the range exceeds the
    /// stream.
    pub fn copy_window(&self, start: u64, len: usize, out: &mut [i64]) {
        assert!(
            start
                .checked_add(len as u64)
                .is_some_and(|end| end <= self.num_tokens),
            "window {start}+{len} exceeds {} tokens",
            self.num_tokens
        );
        let (mut at, mut done) = (start, 0);
        while done < len {
            let p = self.part_of_token(at);
            let local = at - p.base;
            let n = if local < p.file_tokens {
                let n = ((p.file_tokens - local) as usize).min(len - done);
                p.file.copy_window(local, n, &mut out[done..done + n]);
                n
            } else {
                out[done] = i64::from(p.get(local));
                1
            };
            at += n as u64;
            done += n;
        }
    }

    /// The largest token id in the stream (`None` when it has no tokens), by reading every
    /// token: a parallel scan of the mapped data (rayon's global pool). It reads everything,
    /// so callers remember the result ([`super::ids::max_token_id`]).
    pub fn scan_max_token_id(&self) -> Option<u32> {
        self.parts
            .iter()
            .filter_map(|p| p.file.scan_max_token_id(p.file_tokens).max(p.eos))
            .max()
    }
}

#[cfg(test)]
mod tests;
