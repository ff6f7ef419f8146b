//! Tests of the `.tok` writer and of reading token files (`.tok`, nanoGPT `.bin`, llm.c shards).

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
