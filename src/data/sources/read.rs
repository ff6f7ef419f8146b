//! The documents of one data file, whatever its format: [`read_documents`] (whole documents)
//! and [`read_documents_in`] (those starting in a byte range, large ones in pieces), handing
//! each file to its reader by extension ([`super::text`], [`super::jsonl`], [`super::parquet`]).

use std::ops::Range;
use std::path::Path;

use anyhow::{bail, Result};

use super::files::TEXT_EXTENSIONS;
use super::jsonl::read_jsonl;
use super::parquet::read_parquet;
use super::text::read_txt;

/// Calls `f` with every document of `file`, in order.
///
/// A `.txt` file is one document (a leading UTF-8 BOM is dropped). A `.jsonl`
/// file holds one JSON object per line whose `text_field` string is the
/// document; blank lines are skipped. A `.parquet` file holds one document
/// per row in its `text_field` string column; null values are skipped.
pub fn read_documents(
    file: &Path,
    text_field: &str,
    mut f: impl FnMut(String) -> Result<()>,
) -> Result<()> {
    let mut doc = String::new();
    read_documents_in(file, text_field, 0..u64::MAX, |text, ends| {
        doc.push_str(&text);
        if ends {
            f(std::mem::take(&mut doc))?;
        }
        Ok(())
    })
}

/// Like [`read_documents`], only the documents that start inside `bytes` (offsets in the
/// file: a `.txt` file's one document starts at 0, a `.jsonl` line where it starts, a
/// `.parquet` row group's documents where its text column chunk starts), as
/// `f(text, ends_document)`: a `.txt` file or a `.jsonl` line larger than [`PIECE`](super::text::PIECE) comes in
/// pieces.
pub fn read_documents_in(
    file: &Path,
    text_field: &str,
    bytes: Range<u64>,
    mut f: impl FnMut(String, bool) -> Result<()>,
) -> Result<()> {
    let ext = file.extension().and_then(|e| e.to_str()).unwrap_or("");
    match ext {
        "txt" if bytes.start > 0 => Ok(()),
        "txt" => read_txt(file, f),
        "jsonl" => read_jsonl(file, text_field, bytes, f),
        "parquet" => read_parquet(file, text_field, bytes, |d| f(d, true)),
        _ => bail!(
            "{}: unsupported extension; text sources must end in .{}",
            file.display(),
            TEXT_EXTENSIONS.join(" or .")
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::super::text::PIECE;
    use super::*;
    use std::fs;

    fn collect(file: &Path, field: &str) -> Result<Vec<String>> {
        let mut docs = Vec::new();
        read_documents(file, field, |d| {
            docs.push(d);
            Ok(())
        })?;
        Ok(docs)
    }

    #[test]
    fn txt_is_one_document_and_bad_utf8_is_located() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.txt");
        fs::write(&path, "\u{feff}line one\nline two\n").unwrap();
        assert_eq!(
            collect(&path, "text").unwrap(),
            vec!["line one\nline two\n"]
        );
        fs::write(&path, b"caf\xe9 au lait").unwrap();
        let err = collect(&path, "text").unwrap_err().to_string();
        assert!(
            err.contains("byte offset 3") && err.contains("a.txt"),
            "{err}"
        );
        // A file read in pieces: the mark dropped once, a bad byte found by its offset in the
        // file, past the first piece.
        let mut big = "\u{feff}".to_string() + &"é中😀a".repeat(PIECE / 4);
        assert!(big.len() > 2 * PIECE);
        fs::write(&path, &big).unwrap();
        assert_eq!(collect(&path, "text").unwrap().concat(), big[3..]);
        let bad_at = big.len() - 5;
        big.truncate(bad_at);
        let mut bytes = big.into_bytes();
        bytes.extend_from_slice(b"\xff tail");
        fs::write(&path, bytes).unwrap();
        let err = collect(&path, "text").unwrap_err().to_string();
        assert!(err.contains(&format!("byte offset {bad_at};")), "{err}");
    }

    #[test]
    fn jsonl_documents_and_errors() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("d.jsonl");
        fs::write(
            &path,
            "{\"body\": \"first\", \"id\": 1}\n\n  \n{\"body\": \"sec\\nond\"}\n",
        )
        .unwrap();
        assert_eq!(collect(&path, "body").unwrap(), vec!["first", "sec\nond"]);

        let err = collect(&path, "text").unwrap_err().to_string();
        assert!(
            err.contains("d.jsonl:1") && err.contains("\"text\""),
            "{err}"
        );
        assert!(err.contains("[body, id]"), "{err}");

        fs::write(&path, "{\"text\": \"ok\"}\n{\"text\": 5}\n").unwrap();
        let err = collect(&path, "text").unwrap_err().to_string();
        assert!(err.contains("d.jsonl:2") && err.contains("number"), "{err}");

        fs::write(&path, "{\"text\": \"ok\"}\nnot json\n").unwrap();
        let err = collect(&path, "text").unwrap_err().to_string();
        assert!(
            err.contains("d.jsonl:2") && err.contains("not valid JSON"),
            "{err}"
        );
    }

    /// A `.jsonl` line longer than [`PIECE`] (64 KiB in tests) is parsed as it is read and its
    /// text handed on in pieces: the same documents as a line parsed whole, the same errors.
    #[test]
    fn long_jsonl_lines_stream_in_pieces() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("d.jsonl");
        // ~400 KB of text: escapes, a surrogate pair, raw 2/3/4-byte characters at every
        // alignment against the piece edges.
        let mut body = String::new();
        let mut k = 0usize;
        while body.len() < 400_000 {
            body.push_str(
                [
                    "ab",
                    "é",
                    "中",
                    "😀",
                    "\\n",
                    "\\\"",
                    "\\\\",
                    "\\u00e9",
                    "\\ud83d\\ude00",
                    " ",
                ][k % 10],
            );
            if k.is_multiple_of(7) {
                body.push('a');
            }
            k += 1;
        }
        let other = r#""meta": {"a": [1, -2.5e3, true, null, "x\"y", {"b": []}], "c": "\u00e9"}"#;
        let lines = [
            r#"{"text": "short one", "id": 1}"#.to_string(),
            format!(r#"{{{other}, "text": "{body}", "n": 7}}"#),
            format!(r#"  {{"text": "{body}{body}"}}  "#),
            r#"{"text": "after"}"#.to_string(),
        ];
        fs::write(&path, lines.join("\n") + "\r\n").unwrap();
        let expected: Vec<String> = lines
            .iter()
            .map(|l| {
                let v: serde_json::Value = serde_json::from_str(l).unwrap();
                v["text"].as_str().unwrap().to_string()
            })
            .collect();
        assert!(expected[1].len() > 3 * PIECE);
        assert!(["é", "中", "😀", "\n", "\"", "\\"]
            .iter()
            .all(|c| expected[1].contains(c)));
        assert_eq!(collect(&path, "text").unwrap(), expected);
        // In pieces, each at most a piece and whole characters.
        let mut pieces = Vec::new();
        read_documents_in(&path, "text", 0..u64::MAX, |t, ends| {
            assert!(t.len() <= PIECE, "{}", t.len());
            pieces.push(ends);
            Ok(())
        })
        .unwrap();
        assert!(pieces.len() > 10 && pieces.iter().filter(|&&e| e).count() == 4);
        // A part that starts inside a long line begins at the next line.
        let second = lines[0].len() as u64 + 1;
        let mut docs = Vec::new();
        read_documents_in(&path, "text", second + 5..u64::MAX, |t, ends| {
            docs.push((t, ends));
            Ok(())
        })
        .unwrap();
        let text: String = docs.iter().map(|(t, _)| t.as_str()).collect();
        assert_eq!(text, expected[2].clone() + &expected[3]);
        // Where a line would be a document, reading a range that starts at it takes it.
        let mut firsts = Vec::new();
        read_documents_in(&path, "text", second..second + 1, |t, _| {
            firsts.push(t);
            Ok(())
        })
        .unwrap();
        assert_eq!(firsts.concat(), expected[1]);

        let long = "x".repeat(PIECE + 10);
        let cases = [
            (
                format!(r#"{{"id": 3, "body": "{long}"}}"#),
                "has no field \"text\" (its other keys: [id, body])",
            ),
            (
                format!(r#"{{"pad": "{long}", "text": 5}}"#),
                "non-string (number) field",
            ),
            (format!(r#"{{"text": "{long}"}} x"#), "not valid JSON"),
            (format!(r#"{{"text": "{long}""#), "not valid JSON"),
            (format!(r#"{{"text": "{long}\q"}}"#), "not valid JSON"),
            (format!("{{\"text\": \"{long}\u{1}\"}}"), "not valid JSON"),
            (format!(r#"{{"text": "{long}\ud800"}}"#), "not valid JSON"),
            (
                format!(r#"{{"text": "{long}", "text": "b"}}"#),
                "appears twice",
            ),
            (format!(r#"["{long}"]"#), "expected a JSON object"),
        ];
        for (line, needle) in cases {
            fs::write(
                &path,
                format!("{{\"text\": \"ok\"}}\n{line}\n{{\"text\": \"ok\"}}\n"),
            )
            .unwrap();
            let err = collect(&path, "text").unwrap_err().to_string();
            assert!(
                err.contains("d.jsonl:2") && err.contains(needle),
                "{needle}: {err}"
            );
        }
        // Invalid UTF-8 inside the long string.
        let mut bytes = format!("{{\"text\": \"{long}").into_bytes();
        bytes.extend_from_slice(b"\xff\"}\n");
        fs::write(&path, bytes).unwrap();
        let err = collect(&path, "text").unwrap_err().to_string();
        assert!(
            err.contains("d.jsonl:1") && err.contains("invalid UTF-8"),
            "{err}"
        );
    }
}
