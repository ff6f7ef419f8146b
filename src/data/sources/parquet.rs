//! `.parquet` files: one document per row of a string column, streamed row group by row group.

use std::fs::File;
use std::ops::Range;
use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};

/// Documents read from a Parquet column per call into the parquet decoder.
const PARQUET_BATCH: usize = 1024;

/// Streams the `text_field` column of a Parquet file, row group by row group,
/// in batches of [`PARQUET_BATCH`] values (never the whole file in memory).
pub(super) fn read_parquet(
    file: &Path,
    text_field: &str,
    bytes: Range<u64>,
    mut f: impl FnMut(String) -> Result<()>,
) -> Result<()> {
    use parquet::basic::Type as Physical;
    use parquet::column::reader::ColumnReader;
    use parquet::file::reader::{FileReader, SerializedFileReader};

    let p = file.display();
    let handle = File::open(file).with_context(|| format!("{p}: cannot open"))?;
    let reader = SerializedFileReader::new(handle)
        .map_err(|e| anyhow!("{p}: not a readable Parquet file ({e})"))?;
    let schema = reader.metadata().file_metadata().schema_descr_ptr();
    let Some(column) = schema
        .columns()
        .iter()
        .position(|c| c.path().parts().join(".") == text_field)
    else {
        let names: Vec<String> = schema
            .root_schema()
            .get_fields()
            .iter()
            .map(|t| t.name().to_string())
            .collect();
        bail!(
            "{p}: no column \"{text_field}\" (its columns: [{}]); set `data.text_field` to the \
             column holding the text",
            names.join(", ")
        );
    };
    let descr = schema.column(column);
    if descr.physical_type() != Physical::BYTE_ARRAY || descr.max_rep_level() > 0 {
        let what = if descr.max_rep_level() > 0 {
            "a list".to_string()
        } else {
            format!("of type {}", descr.physical_type())
        };
        bail!(
            "{p}: column \"{text_field}\" is {what}, not a string column; set \
             `data.text_field` to the column holding the text"
        );
    }
    let nullable = descr.max_def_level() > 0;
    let mut values = Vec::with_capacity(PARQUET_BATCH);
    let mut defs = Vec::with_capacity(PARQUET_BATCH);
    let mut row = 0u64;
    for group in 0..reader.num_row_groups() {
        let meta = reader.metadata().row_group(group);
        if !bytes.contains(&meta.column(column).byte_range().0) {
            row += meta.num_rows() as u64;
            continue;
        }
        let rg = reader
            .get_row_group(group)
            .map_err(|e| anyhow!("{p}: row group {group}: {e}"))?;
        let ColumnReader::ByteArrayColumnReader(mut col) = rg
            .get_column_reader(column)
            .map_err(|e| parquet_error(file, group, e))?
        else {
            bail!("{p}: column \"{text_field}\" is not a byte-array column");
        };
        loop {
            values.clear();
            defs.clear();
            let (records, _, _) = col
                .read_records(
                    PARQUET_BATCH,
                    nullable.then_some(&mut defs),
                    None,
                    &mut values,
                )
                .map_err(|e| parquet_error(file, group, e))?;
            if records == 0 {
                break;
            }
            for v in values.drain(..) {
                row += 1;
                let text = String::from_utf8(v.data().to_vec()).map_err(|e| {
                    anyhow!(
                        "{p}: column \"{text_field}\" holds invalid UTF-8 (value {row} of the column, \
                         byte offset {}); it must be a UTF-8 string column",
                        e.utf8_error().valid_up_to()
                    )
                })?;
                f(text)?;
            }
        }
    }
    Ok(())
}

/// A decoding error; a codec left out of this build gets the list of those it has.
fn parquet_error(file: &Path, group: usize, e: parquet::errors::ParquetError) -> anyhow::Error {
    let p = file.display();
    let text = e.to_string();
    match text.split_once("Disabled feature at compile time: ") {
        Some((_, codec)) => anyhow!(
            "{p}: row group {group} is compressed with {codec}, which lockstep does not read \
             (it reads snappy, zstd, lz4, gzip and uncompressed Parquet); rewrite the file with \
             another codec, e.g. pyarrow.parquet.write_table(table, path, compression=\"zstd\")"
        ),
        None => anyhow!("{p}: cannot decode row group {group} ({text})"),
    }
}
