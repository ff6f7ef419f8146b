//! Files that survive a crash: fsync a file or a directory, write a file durably, a file's
//! checksum, and the atomic directory that checkpoints (`train::checkpoint`), exports
//! (`commands::export`) and data cache entries (`data::prepare`) are written as: everything
//! goes into `<dest>.tmp/` (or a staging name of the writer's own), every file is fsynced,
//! then one rename makes `<dest>` appear complete, so a directory of that name is never
//! half-written.

use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

pub fn sync_file(path: &Path) -> Result<()> {
    fs::File::open(path)
        .and_then(|f| f.sync_all())
        .with_context(|| format!("{}: cannot fsync", path.display()))
}

/// fsyncs `path`, then tells the kernel its pages will not be read again soon: a checkpoint's
/// gigabytes then leave the page cache instead of pushing out what training reads (the token
/// files' pages), and the next save reuses the memory.
pub fn sync_and_release(path: &Path) -> Result<()> {
    use std::os::fd::AsRawFd;
    let file = fs::File::open(path).with_context(|| format!("{}: cannot fsync", path.display()))?;
    file.sync_all()
        .with_context(|| format!("{}: cannot fsync", path.display()))?;
    // SAFETY: advice on an open descriptor; failure only means the pages stay cached.
    unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    Ok(())
}

pub fn sync_dir(dir: &Path) -> Result<()> {
    fs::File::open(dir)
        .and_then(|f| f.sync_all())
        .with_context(|| format!("{}: cannot fsync directory", dir.display()))
}

/// BLAKE3 of a file's bytes, hex: what a token file's record and a checkpoint's trainer.json
/// keep to tell later whether the file is still the one written.
/// Read in 1 MiB pieces: 4.8 GB/s on one core of the build VM from the page cache, against
/// 3.1 GB/s through `io::copy`'s 8 KiB buffer (BLAKE3's SIMD wants long inputs).
pub fn file_blake3(path: &Path) -> Result<String> {
    use std::io::Read;
    let mut f = fs::File::open(path).with_context(|| format!("{}: cannot open", path.display()))?;
    let mut h = blake3::Hasher::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        match f.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                h.update(&buf[..n]);
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e).with_context(|| format!("{}: cannot read", path.display())),
        }
    }
    Ok(h.finalize().to_hex().to_string())
}

/// Writes `bytes` to `path` and fsyncs it.
pub fn write_synced(path: &Path, bytes: &[u8]) -> Result<()> {
    fs::write(path, bytes).with_context(|| format!("{}: cannot write", path.display()))?;
    sync_file(path)
}

/// Replaces `path` with `bytes` so that a reader sees the old file or the new one, never a part:
/// written beside it under a name of this process's own, then renamed (parents created).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    if let Some(dir) = path.parent() {
        fs::create_dir_all(dir).with_context(|| format!("{}: cannot create", dir.display()))?;
    }
    // Host and pid: writers on two machines sharing a file system never share the file.
    let tmp = sibling(
        path,
        &format!(".tmp-{}-{}", super::hostname(), std::process::id()),
    );
    fs::write(&tmp, bytes)
        .and_then(|()| fs::rename(&tmp, path))
        .inspect_err(|_| {
            let _ = fs::remove_file(&tmp);
        })
        .with_context(|| format!("{}: cannot write", path.display()))
}

/// `path` with `suffix` appended to its last component: a sibling, so renames between the two
/// stay on one filesystem.
pub fn sibling(path: &Path, suffix: &str) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(suffix);
    path.with_file_name(name)
}

/// A directory being written that appears under its final name complete or not at all.
pub struct AtomicDir {
    dest: PathBuf,
    tmp: PathBuf,
    /// Where [`AtomicDir::commit`] moves an existing `dest` while the new one takes its name.
    replaced: PathBuf,
}

impl AtomicDir {
    /// Where the contents of `dest` are written before [`AtomicDir::commit`]: `<dest>.tmp`.
    /// Other processes (a sharded checkpoint's ranks) write their files there too.
    pub fn staging_of(dest: &Path) -> PathBuf {
        sibling(dest, ".tmp")
    }

    /// Starts writing `dest`: creates an empty `<dest>.tmp/`, removing one a crash left. The
    /// errors are the file system's; callers add which setting to change.
    pub fn begin(dest: &Path) -> Result<AtomicDir> {
        let replaced = sibling(dest, ".replaced.tmp");
        Self::start(dest, Self::staging_of(dest), replaced)
    }

    /// The staging directory `<dest>.tmp` an earlier process left, complete, to commit.
    pub fn adopt(dest: &Path) -> AtomicDir {
        AtomicDir {
            dest: dest.to_path_buf(),
            tmp: Self::staging_of(dest),
            replaced: sibling(dest, ".replaced.tmp"),
        }
    }

    /// Like [`AtomicDir::begin`], staged in `<dest><suffix>`, a name of the caller's own (its
    /// process id in it, say): processes writing the same `dest` at once (two runs preparing
    /// one data cache entry) then never share the staging directory, nor the name an existing
    /// `dest` is moved aside to (`<dest><suffix>.replaced`). Leftovers of a killed writer are
    /// the caller's to recognize by the suffix and remove.
    pub fn begin_own(dest: &Path, suffix: &str) -> Result<AtomicDir> {
        let tmp = sibling(dest, suffix);
        let replaced = sibling(&tmp, ".replaced");
        Self::start(dest, tmp, replaced)
    }

    fn start(dest: &Path, tmp: PathBuf, replaced: PathBuf) -> Result<AtomicDir> {
        if tmp.exists() {
            fs::remove_dir_all(&tmp).with_context(|| {
                format!("{}: cannot remove a stale partial write", tmp.display())
            })?;
        }
        fs::create_dir(&tmp).with_context(|| format!("cannot create {}", tmp.display()))?;
        Ok(AtomicDir {
            dest: dest.to_path_buf(),
            tmp,
            replaced,
        })
    }

    /// The directory to write into.
    pub fn path(&self) -> &Path {
        &self.tmp
    }

    pub fn dest(&self) -> &Path {
        &self.dest
    }

    /// Makes the written directory `dest`: fsync it, move an existing `dest` aside in one
    /// rename (rename cannot replace a non-empty directory, and deleting it file by file under
    /// its own name could leave a partial one), rename, fsync the parent, delete the old one.
    /// The files inside must already be fsynced.
    pub fn commit(self) -> Result<PathBuf> {
        sync_dir(&self.tmp)?;
        let replaced = &self.replaced;
        if self.dest.exists() {
            if replaced.exists() {
                fs::remove_dir_all(replaced)
                    .with_context(|| format!("{}: cannot remove", replaced.display()))?;
            }
            fs::rename(&self.dest, replaced)
                .with_context(|| format!("{}: cannot move aside", self.dest.display()))?;
        }
        fs::rename(&self.tmp, &self.dest)
            .with_context(|| format!("{}: cannot rename into place", self.tmp.display()))?;
        let parent = match self.dest.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
        sync_dir(parent)?;
        if replaced.exists() {
            fs::remove_dir_all(replaced)
                .with_context(|| format!("{}: cannot delete", replaced.display()))?;
        }
        Ok(self.dest)
    }

    /// Gives up: the partial directory is removed and `dest` is left as it was.
    pub fn abandon(self) {
        let _ = fs::remove_dir_all(&self.tmp);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_committed_directory_replaces_the_old_one_whole() -> Result<()> {
        let root = tempfile::tempdir()?;
        let dest = root.path().join("out");
        fs::create_dir(&dest)?;
        fs::write(dest.join("old"), b"old")?;
        let dir = AtomicDir::begin(&dest)?;
        assert_eq!(dir.path(), root.path().join("out.tmp"));
        assert!(!dest.join("new").exists(), "nothing visible before commit");
        write_synced(&dir.path().join("new"), b"new")?;
        dir.commit()?;
        assert!(dest.join("new").is_file() && !dest.join("old").exists());
        assert!(!root.path().join("out.tmp").exists());
        assert!(!root.path().join("out.replaced.tmp").exists());

        let dir = AtomicDir::begin(&dest)?;
        fs::write(dir.path().join("partial"), b"x")?;
        dir.abandon();
        assert!(dest.join("new").is_file() && !root.path().join("out.tmp").exists());
        Ok(())
    }

    /// A staging directory of the caller's own name replaces `dest` the same way, moving the
    /// old one aside under that name too.
    #[test]
    fn a_directory_staged_under_its_own_name_replaces_the_old_one() -> Result<()> {
        let root = tempfile::tempdir()?;
        let dest = root.path().join("entry");
        fs::create_dir(&dest)?;
        fs::write(dest.join("old"), b"old")?;
        fs::create_dir(root.path().join("entry.tmp-7"))?;
        fs::write(root.path().join("entry.tmp-7/stale"), b"x")?;
        let dir = AtomicDir::begin_own(&dest, ".tmp-7")?;
        assert_eq!(dir.path(), root.path().join("entry.tmp-7"));
        assert!(
            !dir.path().join("stale").exists(),
            "a leftover staging dir is emptied"
        );
        assert_eq!(dir.replaced, root.path().join("entry.tmp-7.replaced"));
        write_synced(&dir.path().join("new"), b"new")?;
        dir.commit()?;
        assert!(dest.join("new").is_file() && !dest.join("old").exists());
        let left: Vec<_> = fs::read_dir(root.path())?
            .flatten()
            .map(|e| e.file_name())
            .collect();
        assert_eq!(left, ["entry"]);
        Ok(())
    }

    /// BENCHMARKS.md §11: `file_blake3` on a 512 MB file from the page cache (what a writer
    /// hashes right after writing), three times.
    #[test]
    #[ignore]
    fn file_blake3_speed() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("f");
        fs::write(&path, vec![7u8; 512 << 20])?;
        for _ in 0..3 {
            let t = std::time::Instant::now();
            file_blake3(&path)?;
            let s = t.elapsed().as_secs_f64();
            eprintln!(
                "file_blake3: 512 MiB in {:.3} s, {:.2} GB/s",
                s,
                (512 << 20) as f64 / s / 1e9
            );
        }
        Ok(())
    }
}
