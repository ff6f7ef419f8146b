//! safetensors files ⇄ tch tensors through the `safetensors` crate (tch bundles an older copy
//! whose types do not mix with ours). Files are memory-mapped for reading; tensors are written
//! from contiguous CPU copies.

use std::borrow::Cow;
use std::collections::HashMap;
use std::path::Path;

use anyhow::{bail, Context, Result};
use safetensors::tensor::{Dtype, SafeTensorError, SafeTensors, View};
use tch::{Device, Kind, Tensor};

pub fn kind_to_dtype(kind: Kind) -> Result<Dtype> {
    Ok(match kind {
        Kind::Float => Dtype::F32,
        Kind::Double => Dtype::F64,
        Kind::BFloat16 => Dtype::BF16,
        Kind::Half => Dtype::F16,
        Kind::Int64 => Dtype::I64,
        Kind::Int => Dtype::I32,
        Kind::Int16 => Dtype::I16,
        Kind::Uint8 => Dtype::U8,
        Kind::Int8 => Dtype::I8,
        Kind::Bool => Dtype::BOOL,
        k => bail!("tensor kind {k:?} has no safetensors dtype"),
    })
}

pub fn dtype_to_kind(dtype: Dtype) -> Result<Kind> {
    Ok(match dtype {
        Dtype::F32 => Kind::Float,
        Dtype::F64 => Kind::Double,
        Dtype::BF16 => Kind::BFloat16,
        Dtype::F16 => Kind::Half,
        Dtype::I64 => Kind::Int64,
        Dtype::I32 => Kind::Int,
        Dtype::I16 => Kind::Int16,
        Dtype::U8 => Kind::Uint8,
        Dtype::I8 => Kind::Int8,
        Dtype::BOOL => Kind::Bool,
        d => bail!("safetensors dtype {d:?} is not supported"),
    })
}

/// Contiguous CPU bytes of a tensor.
pub fn tensor_bytes(t: &Tensor) -> Vec<u8> {
    let t = t.detach().to_device(Device::Cpu).contiguous();
    let numel = t.numel();
    let mut buf = vec![0u8; numel * t.kind().elt_size_in_bytes()];
    t.copy_data_u8(&mut buf, numel);
    buf
}

/// One tensor as `save` hands it to safetensors: a CPU tensor is written straight from its
/// own memory, a GPU tensor is copied to the host when its turn comes, so a save holds at most
/// one tensor's extra copy (the whole model and optimizer state copied at once would add 12
/// bytes per parameter to the peak memory of the step that saves).
struct TensorData {
    /// Contiguous when on the CPU.
    tensor: Tensor,
    dtype: Dtype,
    shape: Vec<usize>,
    len: usize,
}

impl TensorData {
    fn new(t: &Tensor) -> Result<TensorData> {
        let tensor = if t.device() == Device::Cpu {
            t.detach().contiguous()
        } else {
            t.detach()
        };
        Ok(TensorData {
            dtype: kind_to_dtype(t.kind())?,
            shape: t.size().iter().map(|&d| d as usize).collect(),
            len: t.numel() * t.kind().elt_size_in_bytes(),
            tensor,
        })
    }
}

impl View for TensorData {
    fn dtype(&self) -> Dtype {
        self.dtype
    }

    fn shape(&self) -> &[usize] {
        &self.shape
    }

    fn data(&self) -> Cow<'_, [u8]> {
        if self.len == 0 {
            return Cow::Borrowed(&[]);
        }
        if self.tensor.device() == Device::Cpu {
            // SAFETY: a contiguous CPU tensor (made so in `new`) owns `len` bytes from its data
            // pointer; `self` keeps it alive for the borrow and nothing writes to it meanwhile
            // (a synchronous checkpoint is written by the thread that trains, between steps; a
            // background one from staging copies that the next save refills only after this
            // one has finished).
            let bytes = unsafe {
                std::slice::from_raw_parts(self.tensor.data_ptr() as *const u8, self.len)
            };
            Cow::Borrowed(bytes)
        } else {
            Cow::Owned(tensor_bytes(&self.tensor))
        }
    }

    fn data_len(&self) -> usize {
        self.len
    }
}

/// Writes `tensors` to `path` (not atomically: callers that need atomicity write into a
/// temporary directory and rename it).
pub fn save(
    path: &Path,
    tensors: &[(String, Tensor)],
    metadata: Option<HashMap<String, String>>,
) -> Result<()> {
    let views: Vec<(String, TensorData)> = tensors
        .iter()
        .map(|(name, t)| Ok((name.clone(), TensorData::new(t)?)))
        .collect::<Result<_>>()?;
    safetensors::serialize_to_file(views, metadata, path)
        .map_err(|e| match e {
            // The OS error alone: its Display would otherwise be printed twice in the chain.
            SafeTensorError::IoError(io) => anyhow::Error::from(io),
            other => anyhow::Error::from(other),
        })
        .with_context(|| format!("{}: cannot write safetensors file", path.display()))?;
    sort_metadata(path)
        .with_context(|| format!("{}: cannot write safetensors file", path.display()))
}

/// safetensors writes the `__metadata__` strings in the order of a `HashMap`, which differs
/// from process to process. Sorted (the same bytes, reordered: the header keeps its length),
/// the same tensors and metadata always give the same file, so two saves of one state are
/// bitwise equal whichever process or thread wrote them.
fn sort_metadata(path: &Path) -> Result<()> {
    use std::io::{Read, Seek, SeekFrom, Write};
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)?;
    let mut len = [0u8; 8];
    file.read_exact(&mut len)?;
    let mut header = vec![0u8; u64::from_le_bytes(len) as usize];
    file.read_exact(&mut header)?;
    let mut parsed: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(&header)?;
    let Some(serde_json::Value::Object(meta)) = parsed.get_mut("__metadata__") else {
        return Ok(());
    };
    let mut entries: Vec<(String, serde_json::Value)> = std::mem::take(meta).into_iter().collect();
    entries.sort_by(|a, b| a.0.cmp(&b.0));
    *meta = entries.into_iter().collect();
    let mut sorted = serde_json::to_vec(&parsed)?;
    anyhow::ensure!(
        sorted.len() <= header.len(),
        "internal: the sorted safetensors header grew"
    );
    sorted.resize(header.len(), b' ');
    if sorted != header {
        file.seek(SeekFrom::Start(8))?;
        file.write_all(&sorted)?;
    }
    Ok(())
}

/// A memory-mapped safetensors file.
pub struct SafeFile {
    mmap: memmap2::Mmap,
    path: std::path::PathBuf,
}

impl SafeFile {
    pub fn open(path: &Path) -> Result<SafeFile> {
        let file = std::fs::File::open(path)
            .with_context(|| format!("{}: cannot open", path.display()))?;
        // SAFETY: read-only map; a concurrent writer would be a user error we cannot prevent,
        // and our own writers never modify a file in place (they write a new file and rename).
        let mmap = unsafe { memmap2::Mmap::map(&file) }
            .with_context(|| format!("{}: cannot map", path.display()))?;
        let sf = SafeFile {
            mmap,
            path: path.to_path_buf(),
        };
        sf.parsed()?;
        Ok(sf)
    }

    fn parsed(&self) -> Result<SafeTensors<'_>> {
        SafeTensors::deserialize(&self.mmap).with_context(|| {
            format!(
                "{}: not a valid safetensors file (truncated or corrupt?)",
                self.path.display()
            )
        })
    }

    pub fn names(&self) -> Vec<String> {
        self.parsed()
            .map(|s| s.names().into_iter().map(str::to_string).collect())
            .unwrap_or_default()
    }

    pub fn contains(&self, name: &str) -> bool {
        self.parsed().is_ok_and(|s| s.tensor(name).is_ok())
    }

    /// Shape of `name` without materialising it.
    pub fn shape(&self, name: &str) -> Result<Vec<i64>> {
        let st = self.parsed()?;
        let view = st
            .tensor(name)
            .with_context(|| format!("{}: no tensor {name}", self.path.display()))?;
        Ok(view.shape().iter().map(|&d| d as i64).collect())
    }

    /// `name`'s bytes in the map, its shape and its kind.
    fn view(&self, name: &str) -> Result<(&[u8], Vec<usize>, Kind)> {
        let view = self
            .parsed()?
            .tensor(name)
            .with_context(|| format!("{}: no tensor {name}", self.path.display()))?;
        let kind = dtype_to_kind(view.dtype())
            .with_context(|| format!("{}: tensor {name}", self.path.display()))?;
        Ok((view.data(), view.shape().to_vec(), kind))
    }

    /// A CPU tensor copied out of the map.
    pub fn tensor(&self, name: &str) -> Result<Tensor> {
        let (data, shape, kind) = self.view(name)?;
        let shape: Vec<i64> = shape.iter().map(|&d| d as i64).collect();
        Ok(Tensor::from_data_size(data, &shape, kind))
    }

    /// Elements `range` of `name` flattened, as a 1-D CPU tensor: only those bytes are read
    /// from the map (a resume on another world size reads the pieces it owns, not whole files).
    pub fn elements(&self, name: &str, range: &std::ops::Range<usize>) -> Result<Tensor> {
        let (data, shape, kind) = self.view(name)?;
        let numel: usize = shape.iter().product();
        anyhow::ensure!(
            range.start <= range.end && range.end <= numel,
            "{}: elements {range:?} of {name}, which has {numel}",
            self.path.display()
        );
        let elt = kind.elt_size_in_bytes();
        let bytes = &data[range.start * elt..range.end * elt];
        Ok(Tensor::from_data_size(bytes, &[range.len() as i64], kind))
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The file's `__metadata__` strings (empty when it has none).
    pub fn metadata(&self) -> Result<std::collections::HashMap<String, String>> {
        let (_, meta) = SafeTensors::read_metadata(&self.mmap).with_context(|| {
            format!(
                "{}: not a valid safetensors file (truncated or corrupt?)",
                self.path.display()
            )
        })?;
        Ok(meta.metadata().clone().unwrap_or_default())
    }
}

/// Fails unless every element of `t` is finite, naming `what` (the file and tensor), how many
/// NaN and infinite values it holds, and `fix`: weights that were damaged on disk, or saved
/// after they went bad, are refused where they are read rather than trained or sampled from.
pub fn ensure_finite(t: &Tensor, what: impl std::fmt::Display, fix: &str) -> Result<()> {
    if !t.is_floating_point() || t.isfinite().all().int64_value(&[]) != 0 {
        return Ok(());
    }
    let nan = t.isnan().sum(Kind::Int64).int64_value(&[]);
    let inf = t.isinf().sum(Kind::Int64).int64_value(&[]);
    let first = t
        .reshape([-1])
        .isfinite()
        .logical_not()
        .nonzero()
        .int64_value(&[0, 0]);
    anyhow::bail!(
        "{what}: {nan} NaN and {inf} infinite values of {} (the first at element {first}); {fix}",
        t.numel()
    )
}

/// Every tensor of a file, in the file's order.
pub fn load_all(path: &Path) -> Result<Vec<(String, Tensor)>> {
    let f = SafeFile::open(path)?;
    let names = f.names();
    names
        .into_iter()
        .map(|n| Ok((n.clone(), f.tensor(&n)?)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn metadata(n: usize) -> HashMap<String, String> {
        (0..n)
            .map(|i| (format!("key{i}"), format!("{i}:{}", i + 1)))
            .collect()
    }

    #[test]
    fn the_same_tensors_and_metadata_give_the_same_bytes() -> Result<()> {
        // Each HashMap iterates in an order of its own; the files must not.
        let dir = tempfile::tempdir()?;
        let tensors = vec![
            (
                "b".to_string(),
                Tensor::arange(10, (Kind::Float, Device::Cpu)),
            ),
            (
                "a".to_string(),
                Tensor::ones([2, 3], (Kind::Float, Device::Cpu)),
            ),
        ];
        let files: Vec<Vec<u8>> = (0..4)
            .map(|i| {
                let path = dir.path().join(format!("{i}.safetensors"));
                save(&path, &tensors, Some(metadata(24)))?;
                Ok(std::fs::read(&path)?)
            })
            .collect::<Result<_>>()?;
        assert!(files.windows(2).all(|w| w[0] == w[1]));
        let f = SafeFile::open(&dir.path().join("0.safetensors"))?;
        assert_eq!(f.metadata()?, metadata(24));
        assert!(f.tensor("b")?.equal(&tensors[0].1));
        Ok(())
    }

    #[test]
    fn elements_reads_a_range_of_the_flattened_tensor() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("t.safetensors");
        let t = Tensor::arange(24, (Kind::Float, Device::Cpu)).view([4, 6]);
        save(&path, &[("t".to_string(), t.shallow_clone())], None)?;
        let f = SafeFile::open(&path)?;
        assert!(f
            .elements("t", &(5..17))?
            .equal(&t.view(-1).narrow(0, 5, 12)));
        assert_eq!(f.elements("t", &(24..24))?.numel(), 0);
        let err = f.elements("t", &(20..25)).unwrap_err().to_string();
        assert!(err.contains("elements 20..25 of t, which has 24"), "{err}");
        Ok(())
    }
}
