//! Parquet documents: `prepare` reads a string column of `.parquet` files (snappy and zstd
//! compressed, dictionary-encoded or plain, v1 and v2 data pages, several row groups, nulls)
//! found by a glob pattern or a directory walk, in file and row order; a missing or
//! non-string column is an error naming the file, the column and the columns the file has.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use lockstep::data::{prepare, PrepareSpec, TokenFile, Tokenizer};
use parquet::basic::Compression;
use parquet::data_type::{ByteArray, ByteArrayType, Int64Type};
use parquet::file::properties::{WriterProperties, WriterVersion};
use parquet::file::writer::SerializedFileWriter;
use parquet::schema::parser::parse_message_type;

/// Writes `rows` (text, id) in row groups of `group` rows. `text_type` is the schema line of
/// the text column, e.g. `OPTIONAL BYTE_ARRAY content (UTF8)`.
fn write_parquet(
    path: &Path,
    text_type: &str,
    rows: &[(Option<&[u8]>, i64)],
    group: usize,
    props: WriterProperties,
) {
    let schema = parse_message_type(&format!(
        "message doc {{ {text_type}; REQUIRED INT64 id; }}"
    ))
    .unwrap();
    let optional = text_type.starts_with("OPTIONAL");
    let mut w = SerializedFileWriter::new(
        File::create(path).unwrap(),
        Arc::new(schema),
        Arc::new(props),
    )
    .unwrap();
    for chunk in rows.chunks(group) {
        let mut rg = w.next_row_group().unwrap();
        let mut col = rg.next_column().unwrap().unwrap();
        let values: Vec<ByteArray> = chunk
            .iter()
            .filter_map(|(t, _)| t.map(|t| ByteArray::from(t.to_vec())))
            .collect();
        let defs: Vec<i16> = chunk.iter().map(|(t, _)| i16::from(t.is_some())).collect();
        col.typed::<ByteArrayType>()
            .write_batch(&values, optional.then_some(&defs[..]), None)
            .unwrap();
        col.close().unwrap();
        let mut col = rg.next_column().unwrap().unwrap();
        let ids: Vec<i64> = chunk.iter().map(|(_, i)| *i).collect();
        col.typed::<Int64Type>()
            .write_batch(&ids, None, None)
            .unwrap();
        col.close().unwrap();
        rg.close().unwrap();
    }
    w.close().unwrap();
}

fn spec(path: &Path, cache: &Path, field: &str) -> PrepareSpec {
    PrepareSpec {
        tokenizer: "gpt2".into(),
        path: path.to_path_buf(),
        text_field: field.into(),
        val_fraction: 0.0,
        num_samples: None,
        cache_dir: cache.to_path_buf(),
        num_threads: 2,
        progress: false,
    }
}

fn all_tokens(path: &Path) -> Vec<u32> {
    let f = TokenFile::open(path).unwrap();
    (0..f.num_tokens()).map(|i| f.get(i)).collect()
}

fn docs(prefix: &str, n: usize) -> Vec<String> {
    (0..n)
        .map(|i| format!("{prefix} row {i}: {}", "to be or not to be, ".repeat(i % 7)))
        .collect()
}

/// a.parquet: snappy, dictionary, v1 pages, required column. b.parquet: zstd, plain, v2 pages
/// of 50 rows, nullable column with every fifth value null.
fn corpus(dir: &Path) -> (PathBuf, Vec<String>) {
    let data = dir.join("corpus");
    std::fs::create_dir_all(data.join("sub")).unwrap();
    let a = docs("alpha", 300);
    let rows: Vec<(Option<&[u8]>, i64)> = a
        .iter()
        .enumerate()
        .map(|(i, t)| (Some(t.as_bytes()), i as i64))
        .collect();
    let snappy = WriterProperties::builder()
        .set_compression(Compression::SNAPPY)
        .build();
    write_parquet(
        &data.join("a.parquet"),
        "REQUIRED BYTE_ARRAY content (UTF8)",
        &rows,
        128,
        snappy,
    );
    let b = docs("beta", 260);
    let rows: Vec<(Option<&[u8]>, i64)> = b
        .iter()
        .enumerate()
        .map(|(i, t)| ((i % 5 != 3).then_some(t.as_bytes()), i as i64))
        .collect();
    let zstd = WriterProperties::builder()
        .set_compression(Compression::ZSTD(Default::default()))
        .set_dictionary_enabled(false)
        .set_writer_version(WriterVersion::PARQUET_2_0)
        .set_data_page_row_count_limit(50)
        .build();
    write_parquet(
        &data.join("sub/b.parquet"),
        "OPTIONAL BYTE_ARRAY content (STRING)",
        &rows,
        100,
        zstd,
    );
    std::fs::write(data.join("notes.md"), "not data").unwrap();
    let b_kept = b
        .into_iter()
        .enumerate()
        .filter(|(i, _)| i % 5 != 3)
        .map(|(_, t)| t);
    (data, a.into_iter().chain(b_kept).collect())
}

#[test]
fn parquet_documents_in_order_from_a_directory_and_a_glob() {
    let dir = tempfile::tempdir().unwrap();
    let (data, texts) = corpus(dir.path());
    let tok = Tokenizer::load("gpt2").unwrap();
    let expected: Vec<u32> = texts
        .iter()
        .flat_map(|t| tok.encode(t).into_iter().chain([tok.eos_id()]))
        .collect();
    let cache = dir.path().join("cache");

    let p = prepare(&spec(&data, &cache, "content")).unwrap();
    assert_eq!(all_tokens(&p.train[0].path), expected);
    assert_eq!(
        TokenFile::open(&p.train[0].path).unwrap().num_docs(),
        texts.len() as u64
    );

    // `**` reaches the file in sub/; `*.parquet` alone only a.parquet.
    let pattern = data.join("**/*.parquet");
    let g = prepare(&spec(&pattern, &cache, "content")).unwrap();
    assert!(!g.cache_hit);
    assert_eq!(all_tokens(&g.train[0].path), expected);
    assert!(
        prepare(&spec(&pattern, &cache, "content"))
            .unwrap()
            .cache_hit
    );
    let only_a = prepare(&spec(&data.join("*.parquet"), &cache, "content")).unwrap();
    assert_eq!(
        TokenFile::open(&only_a.train[0].path).unwrap().num_docs(),
        300,
        "a.parquet has 300 rows"
    );
    let meta: serde_json::Value =
        serde_json::from_slice(&std::fs::read(g.dir.join("meta.json")).unwrap()).unwrap();
    assert!(
        meta["inputs"]["dataset"]
            .as_str()
            .unwrap()
            .starts_with("glob:"),
        "{meta}"
    );
    assert_eq!(meta["inputs"]["files"][0]["path"], "a.parquet");
    assert_eq!(meta["inputs"]["files"][1]["path"], "sub/b.parquet");

    let err = prepare(&spec(&data.join("*.jsonl"), &cache, "content"))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("matches no") && err.contains("*.jsonl"),
        "{err}"
    );
}

#[test]
fn wrong_column_errors_name_the_file_and_the_columns() {
    let dir = tempfile::tempdir().unwrap();
    let (data, _) = corpus(dir.path());
    let cache = dir.path().join("cache");
    let file = data.join("a.parquet");

    let err = format!("{:#}", prepare(&spec(&file, &cache, "text")).unwrap_err());
    assert!(
        err.contains("a.parquet")
            && err.contains("no column \"text\"")
            && err.contains("[content, id]")
            && err.contains("data.text_field"),
        "{err}"
    );
    let err = format!("{:#}", prepare(&spec(&file, &cache, "id")).unwrap_err());
    assert!(
        err.contains("a.parquet") && err.contains("INT64") && err.contains("not a string"),
        "{err}"
    );

    // A byte-array column that is not UTF-8 text.
    let bad = dir.path().join("bad.parquet");
    let rows: Vec<(Option<&[u8]>, i64)> = vec![(Some(b"fine"), 0), (Some(b"caf\xe9"), 1)];
    write_parquet(
        &bad,
        "REQUIRED BYTE_ARRAY text",
        &rows,
        10,
        WriterProperties::builder().build(),
    );
    let err = format!("{:#}", prepare(&spec(&bad, &cache, "text")).unwrap_err());
    assert!(
        err.contains("bad.parquet") && err.contains("invalid UTF-8") && err.contains("value 2"),
        "{err}"
    );

    // Not Parquet at all.
    let fake = dir.path().join("fake.parquet");
    std::fs::write(&fake, "just text").unwrap();
    let err = format!("{:#}", prepare(&spec(&fake, &cache, "text")).unwrap_err());
    assert!(
        err.contains("fake.parquet") && err.contains("not a readable Parquet file"),
        "{err}"
    );
}
