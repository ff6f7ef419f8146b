//! Disk room for a cache entry: refused before writing when the file system has too little,
//! and a write that ran out of room told apart, both with where and how much.

use std::path::Path;

use anyhow::{bail, Result};

use super::spec::PrepareSpec;

/// Bytes free to this user on the file system holding `dir` (None where it cannot be read).
fn free_bytes(dir: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    // SAFETY: statvfs fills the zeroed struct; the path is a valid C string.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    (unsafe { libc::statvfs(c.as_ptr(), &mut st) } == 0)
        .then(|| st.f_bavail as u64 * st.f_frsize as u64)
}

/// The error for a cache entry that does not fit: where, how much, and the key to change.
fn room_error(spec: &PrepareSpec, need: u64, free: Option<u64>) -> String {
    let free = free.map_or(String::new(), |f| {
        format!(", {:.1} MB free", f as f64 / 1e6)
    });
    format!(
        "data.cache_dir {}: the token files need {:.1} MB{free}; free space there, or set \
         data.cache_dir to a disk with room (nothing was kept: an entry is written whole or not \
         at all)",
        spec.cache_dir.display(),
        need as f64 / 1e6
    )
}

/// Refuses before writing when the file system holding `tmp` has less room than `need`.
pub(super) fn check_room(spec: &PrepareSpec, tmp: &Path, need: u64) -> Result<()> {
    match free_bytes(tmp) {
        Some(free) if free < need => bail!("{}", room_error(spec, need, Some(free))),
        _ => Ok(()),
    }
}

/// A write that failed for want of room (another writer took it meanwhile) says what
/// [`check_room`] says; other errors pass unchanged.
pub(super) fn out_of_room(
    spec: &PrepareSpec,
    tmp: &Path,
    need: u64,
    e: anyhow::Error,
) -> anyhow::Error {
    let full = e.chain().any(|c| {
        c.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.raw_os_error() == Some(libc::ENOSPC))
    });
    if full {
        let why = room_error(spec, need, free_bytes(tmp));
        e.context(why)
    } else {
        e
    }
}
