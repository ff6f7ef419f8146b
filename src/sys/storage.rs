//! A tensor's storage freed and re-allocated in place (csrc/storage.cpp): what torch FSDP does
//! with `untyped_storage().resize_(0)` after a unit's forward. Every tensor that shares the
//! storage — the autograd graph's saved views of a gathered parameter among them — sees it
//! empty, then filled again once it is re-allocated and written.

use anyhow::Result;
use tch::Tensor;
use torch_sys::C_tensor;

extern "C" {
    /// csrc/storage.cpp; a status and `err` as in crate::sys::ffi.
    fn lockstep_resize_storage(
        t: *mut C_tensor,
        nbytes: usize,
        err: *mut *mut libc::c_char,
    ) -> libc::c_int;
    /// csrc/storage.cpp: the storage's bytes now.
    fn lockstep_storage_nbytes(t: *mut C_tensor) -> usize;
}

/// Frees the storage behind `t` (0 bytes); its tensors keep their shapes and must not be read
/// until [`alloc`].
pub fn free(t: &Tensor) -> Result<()> {
    resize(t, 0)
}

/// Gives the storage behind `t` room for `t`'s elements again (uninitialised) if it was freed.
pub fn alloc(t: &Tensor) -> Result<()> {
    resize(t, t.numel() * t.kind().elt_size_in_bytes())
}

/// The bytes the storage behind `t` holds now (0 once freed).
pub fn bytes(t: &Tensor) -> usize {
    // SAFETY: `t` is a live tensor handle borrowed for the call.
    unsafe { lockstep_storage_nbytes(t.as_ptr() as *mut C_tensor) }
}

fn resize(t: &Tensor, nbytes: usize) -> Result<()> {
    // SAFETY: `t` is a live tch tensor handle (`at::Tensor*`) borrowed for the call; the shim
    // catches every C++ exception.
    super::ffi::call(|err| unsafe {
        lockstep_resize_storage(t.as_ptr() as *mut C_tensor, nbytes, err)
    })
    .map_err(|e| anyhow::anyhow!("resizing a tensor's storage to {nbytes} bytes: {e}"))
}
