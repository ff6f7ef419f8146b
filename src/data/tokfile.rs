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
pub(crate) fn sync_parent_dir(path: &Path) {
    if let Some(dir) = path.parent() {
        let dir = if dir.as_os_str().is_empty() {
            Path::new(".")
        } else {
            dir
        };
        if let Ok(d) = File::open(dir) {
            let _ = d.sync_all();
        }
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
mod tests {
    use super::*;

    fn write(path: &Path, dtype: u32, docs: &[Vec<u32>]) -> TokFileInfo {
        let mut w = TokFileWriter::create(path, dtype, [7u8; 32]).unwrap();
        for d in docs {
            w.push_document(d).unwrap();
        }
        w.finish().unwrap()
    }

    #[test]
    fn dtype_choice() {
        assert_eq!(dtype_for_vocab(50257), 2);
        assert_eq!(dtype_for_vocab(65536), 2);
        assert_eq!(dtype_for_vocab(65537), 4);
    }

    #[test]
    fn round_trip_u16_and_u32() {
        let dir = tempfile::tempdir().unwrap();
        for (dtype, big) in [(2u32, 65535u32), (4, 200_018)] {
            let path = dir.path().join(format!("t{dtype}.tok"));
            let docs = vec![vec![1, 2, 3, 9], vec![big, 9], vec![9]];
            let info = write(&path, dtype, &docs);
            assert_eq!((info.num_tokens, info.num_docs), (7, 3));
            let len = fs::metadata(&path).unwrap().len();
            assert_eq!(len, 64 + 7 * dtype as u64 + 8 * 3);
            let f = TokenFile::open(&path).unwrap();
            assert_eq!(f.source_kind(), SourceKind::Lockstep);
            assert_eq!(
                (f.num_tokens(), f.num_docs(), f.dtype_bytes()),
                (7, 3, dtype)
            );
            assert_eq!(f.tokenizer_hash(), Some([7u8; 32]));
            assert_eq!(
                [f.doc_offset(0), f.doc_offset(1), f.doc_offset(2)],
                [0, 4, 6]
            );
            let all: Vec<u32> = (0..7).map(|i| f.get(i)).collect();
            assert_eq!(all, docs.concat());
            let mut out = vec![0i64; 3];
            f.copy_window(3, 3, &mut out);
            assert_eq!(out, vec![9, big as i64, 9]);
        }
    }

    #[test]
    fn too_large_token_for_u16_is_rejected() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = TokFileWriter::create(&dir.path().join("x.tok"), 2, [0; 32]).unwrap();
        let err = w.push_document(&[1, 70_000]).unwrap_err().to_string();
        assert!(err.contains("70000") && err.contains("dtype 4"), "{err}");
    }

    #[test]
    fn truncated_file_rejected() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.tok");
        write(&path, 2, &[vec![1, 2, 3], vec![4, 5]]);
        let bytes = fs::read(&path).unwrap();
        fs::write(&path, &bytes[..bytes.len() - 5]).unwrap();
        let err = TokenFile::open(&path).err().unwrap().to_string();
        assert!(err.contains("truncated"), "{err}");
        assert!(
            err.contains("t.tok") && err.contains("= 90") && err.contains("85 bytes"),
            "{err}"
        );
        assert!(err.contains("lockstep prepare"), "{err}");
        fs::write(&path, &bytes[..10]).unwrap();
        let err = TokenFile::open(&path).err().unwrap().to_string();
        assert!(err.contains("truncated"), "{err}");
        fs::write(&path, b"").unwrap();
        assert!(TokenFile::open(&path).is_err());
    }

    #[test]
    fn foreign_file_rejected() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("notes.tok");
        fs::write(
            &path,
            b"hello, this is plain text and not tokens at all............",
        )
        .unwrap();
        let err = TokenFile::open(&path).err().unwrap().to_string();
        assert!(err.contains("not a lockstep token file"), "{err}");
        assert!(err.contains("nanoGPT") && err.contains("llm.c"), "{err}");
    }

    fn tokens_of(f: &TokenFile) -> Vec<u32> {
        (0..f.num_tokens()).map(|i| f.get(i)).collect()
    }

    fn docs_of(f: &TokenFile) -> Vec<u64> {
        (0..f.num_docs()).map(|i| f.doc_offset(i)).collect()
    }

    #[test]
    fn split_at_a_boundary_and_inside_a_document() {
        let dir = tempfile::tempdir().unwrap();
        let docs = [vec![1, 2, 3, 4, 9], vec![5, 70_000, 9], vec![6, 7, 8, 9]];
        for (cut, train_tokens, train_docs, val_tokens, val_docs) in [
            // At the start of the second document: nothing is added.
            (
                5,
                vec![1, 2, 3, 4, 9],
                vec![0],
                vec![5, 70_000, 9, 6, 7, 8, 9],
                vec![0, 3],
            ),
            // Inside it: its head is closed with EOS (9), its tail starts the second file.
            (
                6,
                vec![1, 2, 3, 4, 9, 5, 9],
                vec![0, 5],
                vec![70_000, 9, 6, 7, 8, 9],
                vec![0, 2],
            ),
        ] {
            let (t, v) = (dir.path().join("t.tok"), dir.path().join("v.tok"));
            let mut w = TokFileWriter::create(&t, 4, [3; 32]).unwrap();
            for d in &docs {
                w.push_document(d).unwrap();
            }
            let (train, val) = w
                .finish_split(&v, 9, |starts, total| {
                    assert_eq!((starts.len(), total), (3, 12));
                    assert_eq!((starts.get(1), starts.first_at_or_after(6)), (5, 2));
                    cut
                })
                .unwrap();
            let (tf, vf) = (TokenFile::open(&t).unwrap(), TokenFile::open(&v).unwrap());
            assert_eq!(
                (tokens_of(&tf), docs_of(&tf)),
                (train_tokens.clone(), train_docs)
            );
            assert_eq!(
                (tokens_of(&vf), docs_of(&vf)),
                (val_tokens.clone(), val_docs)
            );
            assert_eq!(
                (train.num_tokens, val.num_tokens),
                (train_tokens.len() as u64, val_tokens.len() as u64)
            );
            // Each file's largest id is its own.
            assert_eq!(train.max_token_id, train_tokens.iter().copied().max());
            assert_eq!(val.max_token_id, Some(70_000));
            assert_eq!(tf.tokenizer_hash(), Some([3; 32]));
            let mut left: Vec<String> = fs::read_dir(dir.path())
                .unwrap()
                .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect();
            left.sort();
            assert_eq!(
                left,
                ["t.tok", "v.tok"],
                "no temporary or side file is left"
            );
        }
    }

    #[test]
    fn prefixes_of_several_files_read_as_one_stream() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (dir.path().join("a.tok"), dir.path().join("b.tok"));
        write(&a, 2, &[vec![1, 2, 9], vec![3, 9]]);
        // The last document of b lies beyond the prefix: 999 must not count.
        write(&b, 2, &[vec![4, 5, 6, 9], vec![7, 9], vec![999, 9]]);
        let prefix = |path: &Path, tokens| TokenPrefix::whole(path.to_path_buf(), tokens);
        let f = TokenFile::open_prefixes(&[prefix(&a, 5), prefix(&b, 5)]).unwrap();
        assert_eq!(tokens_of(&f), [1, 2, 9, 3, 9, 4, 5, 6, 9, 7]);
        // b's second document starts inside the prefix and is cut at its end.
        assert_eq!(docs_of(&f), [0, 3, 5, 9]);
        let mut out = vec![0i64; 6];
        f.copy_window(2, 6, &mut out);
        assert_eq!(out, [9, 3, 9, 4, 5, 6]);
        assert_eq!(f.document_pieces(2, 6), [1, 2, 3]);
        assert_eq!(f.scan_max_token_id(), Some(9));
        assert_eq!(f.tokenizer_hash(), Some([7; 32]));

        let err = TokenFile::open_prefixes(&[prefix(&a, 6)])
            .err()
            .unwrap()
            .to_string();
        assert!(
            err.contains("holds 5 tokens") && err.contains("uses 6"),
            "{err}"
        );
        let c = dir.path().join("c.tok");
        write(&c, 4, &[vec![1, 9]]);
        let err = TokenFile::open_prefixes(&[prefix(&a, 5), prefix(&c, 2)])
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("differ in dtype or tokenizer"), "{err}");

        // A document cut by a prefix closed with an EOS read after it.
        let cut = TokenPrefix {
            eos: Some(9),
            ..prefix(&b, 2)
        };
        let f = TokenFile::open_prefixes(&[prefix(&a, 5), cut, prefix(&b, 3)]).unwrap();
        assert_eq!(tokens_of(&f), [1, 2, 9, 3, 9, 4, 5, 9, 4, 5, 6]);
        assert_eq!(docs_of(&f), [0, 3, 5, 8]);
        let mut out = vec![0i64; 5];
        f.copy_window(5, 5, &mut out);
        assert_eq!(out, [4, 5, 9, 4, 5]);
    }

    #[test]
    fn temp_file_removed_on_drop() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.tok");
        {
            let mut w = TokFileWriter::create(&path, 2, [0; 32]).unwrap();
            w.push_document(&[1, 2, 3]).unwrap();
            // The token file and its side file of document offsets.
            assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 2);
        }
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 0);
        assert!(!path.exists());
    }

    #[test]
    fn nanogpt_bin_reads_back() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("train.bin");
        let toks: Vec<u16> = vec![50256, 15496, 995, 0, 65535];
        let bytes: Vec<u8> = toks.iter().flat_map(|t| t.to_le_bytes()).collect();
        fs::write(&path, &bytes).unwrap();
        assert!(is_token_file(&path));
        let f = TokenFile::open(&path).unwrap();
        assert_eq!(f.source_kind(), SourceKind::NanoGpt);
        assert_eq!(
            (f.num_tokens(), f.num_docs(), f.tokenizer_hash()),
            (5, 0, None)
        );
        let mut out = vec![0i64; 5];
        f.copy_window(0, 5, &mut out);
        assert_eq!(out, vec![50256, 15496, 995, 0, 65535]);
        fs::write(&path, &bytes[..9]).unwrap();
        assert!(TokenFile::open(&path)
            .err()
            .unwrap()
            .to_string()
            .contains("odd"));
    }

    fn llmc_shard(magic: i32, version: i32, toks: &[u32], dtype: usize) -> Vec<u8> {
        let mut header = [0i32; 256];
        header[0] = magic;
        header[1] = version;
        header[2] = toks.len() as i32;
        let mut bytes: Vec<u8> = header.iter().flat_map(|h| h.to_le_bytes()).collect();
        for &t in toks {
            bytes.extend_from_slice(&t.to_le_bytes()[..dtype]);
        }
        bytes
    }

    #[test]
    fn llmc_shards_read_back() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("shard_000.bin");
        fs::write(&path, llmc_shard(20240520, 1, &[10, 20, 50256], 2)).unwrap();
        let f = TokenFile::open(&path).unwrap();
        assert_eq!(f.source_kind(), SourceKind::LlmC { version: 1 });
        assert_eq!((f.num_tokens(), f.dtype_bytes()), (3, 2));
        assert_eq!(f.get(2), 50256);

        fs::write(&path, llmc_shard(20240801, 7, &[128_000, 5, 128_001], 4)).unwrap();
        let f = TokenFile::open(&path).unwrap();
        assert_eq!(f.source_kind(), SourceKind::LlmC { version: 7 });
        let mut out = vec![0i64; 3];
        f.copy_window(0, 3, &mut out);
        assert_eq!(out, vec![128_000, 5, 128_001]);

        let mut bytes = llmc_shard(20240520, 1, &[1, 2, 3], 2);
        bytes.truncate(bytes.len() - 2);
        fs::write(&path, bytes).unwrap();
        let err = TokenFile::open(&path).err().unwrap().to_string();
        assert!(
            err.contains("truncated") && err.contains("1024+2*3 = 1030"),
            "{err}"
        );
    }

    #[test]
    fn largest_id_is_counted_while_writing_and_found_by_scanning() {
        let dir = tempfile::tempdir().unwrap();
        // Over one 4 MiB scan chunk, with the largest id in the last chunk.
        let mut docs: Vec<Vec<u32>> = (0..3u32)
            .map(|d| (0..1_100_000u32).map(|i| (i * 7 + d) % 40_000).collect())
            .collect();
        docs[2][1_099_999] = 60_001;
        for dtype in [2u32, 4] {
            let path = dir.path().join(format!("big{dtype}.tok"));
            let info = write(&path, dtype, &docs);
            assert_eq!(info.max_token_id, Some(60_001));
            let f = TokenFile::open(&path).unwrap();
            assert_eq!(f.scan_max_token_id(), Some(60_001));
        }
        let empty = dir.path().join("empty.tok");
        assert_eq!(write(&empty, 2, &[]).max_token_id, None);
        assert_eq!(TokenFile::open(&empty).unwrap().scan_max_token_id(), None);
        let shard = dir.path().join("shard.bin");
        fs::write(&shard, llmc_shard(20240801, 7, &[5, 128_255, 9], 4)).unwrap();
        assert_eq!(
            TokenFile::open(&shard).unwrap().scan_max_token_id(),
            Some(128_255)
        );
    }

    #[test]
    fn document_pieces_follow_the_offsets() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("d.tok");
        // Documents at 0, 3, 4, 9 (lengths 3, 1, 5, 2): 11 tokens.
        let docs = [vec![1, 2, 0], vec![0], vec![5, 6, 7, 8, 0], vec![9, 0]];
        write(&path, 2, &docs);
        let f = TokenFile::open(&path).unwrap();
        assert_eq!(f.document_pieces(0, 11), vec![3, 1, 5, 2]);
        assert_eq!(f.document_pieces(0, 3), vec![3]);
        assert_eq!(f.document_pieces(0, 4), vec![3, 1]);
        assert_eq!(f.document_pieces(1, 6), vec![2, 1, 3]);
        assert_eq!(f.document_pieces(3, 1), vec![1]);
        assert_eq!(f.document_pieces(5, 6), vec![4, 2]);
        assert_eq!(f.document_pieces(10, 1), vec![1]);
        // Brute force over every window: pieces sum to the length and cut at document starts.
        for start in 0..11u64 {
            for len in 1..=(11 - start) as usize {
                let pieces = f.document_pieces(start, len);
                assert_eq!(pieces.iter().sum::<usize>(), len);
                let mut at = start;
                for p in &pieces[..pieces.len() - 1] {
                    at += *p as u64;
                    assert!([3, 4, 9].contains(&at), "{start}+{len}: cut at {at}");
                }
                let inside = [3u64, 4, 9]
                    .iter()
                    .filter(|&&o| o > start && o < start + len as u64);
                assert_eq!(inside.count(), pieces.len() - 1);
            }
        }
    }

    #[test]
    fn is_send_sync() {
        fn check<T: Send + Sync>() {}
        check::<TokenFile>();
    }
}
