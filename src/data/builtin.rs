//! Corpora compiled into the binary, named `builtin:<name>` in `data.path`.
//!
//! The default corpus has to work from any directory, not only from a checkout holding
//! `data/shakespeare/`, so build.rs packs that directory's `.txt` files (sorted by path, the
//! order [`super::sources::list_files`] reads a directory in) into one zstd stream that is
//! embedded here: per file a u32 name length, the `/`-separated relative name, a u64 byte length
//! and the bytes, little-endian. Each file is one document, read exactly as a `.txt` file on
//! disk is ([`super::sources::txt_document`]), so `builtin:shakespeare` and
//! `data/shakespeare` tokenize to the same tokens.

use anyhow::{anyhow, bail, Result};

/// What `data.path` starts with to name a built-in corpus.
pub const PREFIX: &str = "builtin:";

/// A corpus compiled into the binary.
#[derive(Debug)]
pub struct Builtin {
    name: &'static str,
    packed: &'static [u8],
}

/// One file of a built-in corpus.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BuiltinFile {
    /// Path relative to the corpus directory, `/`-separated (`hamlet_gut.txt`).
    pub name: String,
    /// The file's bytes, unchanged.
    pub bytes: Vec<u8>,
}

const CORPORA: &[Builtin] = &[Builtin {
    name: "shakespeare",
    packed: include_bytes!(concat!(env!("OUT_DIR"), "/shakespeare.pack.zst")),
}];

/// Every built-in corpus as `data.path` names it (`builtin:shakespeare`).
pub fn names() -> Vec<String> {
    CORPORA.iter().map(Builtin::id).collect()
}

/// The built-in corpus `data.path` names: `None` when it does not start with `builtin:`, an
/// error listing the known ones for an unknown name.
pub fn lookup(path: &str) -> Option<Result<&'static Builtin>> {
    let name = path.strip_prefix(PREFIX)?;
    Some(CORPORA.iter().find(|c| c.name == name).ok_or_else(|| {
        anyhow!(
            "data.path = {path:?}: no built-in corpus of that name; the built-in ones \
                     are {}",
            names().join(", ")
        )
    }))
}

impl Builtin {
    /// `builtin:<name>`: the dataset id in the cache key and in messages.
    pub fn id(&self) -> String {
        format!("{PREFIX}{}", self.name)
    }

    /// Bytes compiled into the binary (compressed).
    pub fn compressed_len(&self) -> usize {
        self.packed.len()
    }

    /// The corpus's files in reading order, decompressed (~5 ms per MB).
    pub fn files(&self) -> Result<Vec<BuiltinFile>> {
        let raw = zstd::stream::decode_all(self.packed).map_err(|e| {
            anyhow!(
                "{}: the embedded corpus does not decompress ({e})",
                self.id()
            )
        })?;
        unpack(&raw).map_err(|e| anyhow!("{}: the embedded corpus is malformed ({e})", self.id()))
    }
}

/// Reads the pack format build.rs writes.
fn unpack(mut raw: &[u8]) -> Result<Vec<BuiltinFile>> {
    fn take<'a>(raw: &mut &'a [u8], n: usize) -> Result<&'a [u8]> {
        if raw.len() < n {
            bail!("{} bytes left where {n} are needed", raw.len());
        }
        let (head, rest) = raw.split_at(n);
        *raw = rest;
        Ok(head)
    }
    let mut files = Vec::new();
    while !raw.is_empty() {
        let name_len = u32::from_le_bytes(take(&mut raw, 4)?.try_into()?) as usize;
        let name = String::from_utf8(take(&mut raw, name_len)?.to_vec())?;
        let len = u64::from_le_bytes(take(&mut raw, 8)?.try_into()?);
        let bytes = take(&mut raw, usize::try_from(len)?)?.to_vec();
        files.push(BuiltinFile { name, bytes });
    }
    Ok(files)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::sources::{list_files, read_documents, txt_document};
    use std::path::Path;

    /// The embedded corpus is data/shakespeare: the same files, byte for byte, in the order
    /// `list_files` reads the directory, so both give the same documents and hence the same
    /// tokens (prepare tokenizes documents; the tokenizer never sees where they came from).
    #[test]
    fn shakespeare_is_the_data_directory() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("data/shakespeare");
        let on_disk = list_files(&dir).unwrap();
        let corpus = lookup("builtin:shakespeare").unwrap().unwrap();
        let embedded = corpus.files().unwrap();
        assert_eq!(embedded.len(), on_disk.len());
        assert_eq!(embedded.len(), 42);
        for (e, f) in embedded.iter().zip(&on_disk) {
            assert_eq!(Path::new(&e.name), f.strip_prefix(&dir).unwrap());
            assert!(e.bytes == std::fs::read(f).unwrap(), "{} differs", e.name);
            let mut docs = Vec::new();
            read_documents(f, "text", |d| {
                docs.push(d);
                Ok(())
            })
            .unwrap();
            assert_eq!(docs, [txt_document(e.bytes.clone(), &e.name).unwrap()]);
        }
        // Compressed well below the 5 MB of text; the binary carries only this.
        let total: usize = embedded.iter().map(|f| f.bytes.len()).sum();
        assert_eq!(total, 5_057_198);
        assert!(
            corpus.compressed_len() < 2_000_000,
            "{}",
            corpus.compressed_len()
        );
    }

    #[test]
    fn names_and_unknown_names() {
        assert_eq!(names(), ["builtin:shakespeare"]);
        assert!(lookup("data/shakespeare").is_none());
        let err = lookup("builtin:shakespear")
            .unwrap()
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("\"builtin:shakespear\"") && err.contains("builtin:shakespeare"),
            "{err}"
        );
    }

    #[test]
    fn malformed_packs_are_errors() {
        let mut pack = Vec::new();
        pack.extend_from_slice(&3u32.to_le_bytes());
        pack.extend_from_slice(b"a.t");
        pack.extend_from_slice(&2u64.to_le_bytes());
        pack.extend_from_slice(b"hi");
        let files = unpack(&pack).unwrap();
        assert_eq!(
            files,
            [BuiltinFile {
                name: "a.t".into(),
                bytes: b"hi".to_vec()
            }]
        );
        let err = unpack(&pack[..pack.len() - 1]).unwrap_err().to_string();
        assert!(err.contains("1 bytes left where 2 are needed"), "{err}");
    }
}
