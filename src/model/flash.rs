//! Variable-length flash attention for packed documents on CUDA (csrc/flash_varlen.cpp): every
//! document of the flattened batch is its own causal sequence, given by cumulative lengths, so
//! no [seq, seq] mask exists and no work is spent on the masked-out blocks.
//!
//! Not yet run on a GPU (none was available when it was written): the first failure of the
//! kernel is reported once and every later batch takes the masked SDPA path, which tests check
//! against transformers.

use std::sync::atomic::{AtomicBool, Ordering};

use tch::{Kind, Tensor};
use torch_sys::C_tensor;

use super::documents::DocumentMask;

extern "C" {
    /// csrc/flash_varlen.cpp; a status and `err` as in crate::sys::ffi.
    fn lockstep_flash_varlen(
        q: *mut C_tensor,
        k: *mut C_tensor,
        v: *mut C_tensor,
        cu_seqlens: *mut C_tensor,
        max_len: i64,
        out: *mut *mut C_tensor,
        err: *mut *mut libc::c_char,
    ) -> libc::c_int;
}

/// Set after the kernel failed once: the masked path from then on.
static FAILED: AtomicBool = AtomicBool::new(false);

/// Causal attention within documents: q [b, heads, t, hd], k and v [b, kv_heads, t, hd] (the
/// kernel reads kv head h / (heads / kv_heads) itself) → [b, heads, t, hd]. None where the
/// kernel does not apply: not CUDA, not fp16/bf16, a head dimension it lacks, or after a failure.
pub fn varlen_attention(q: &Tensor, k: &Tensor, v: &Tensor, docs: &DocumentMask) -> Option<Tensor> {
    let hd = q.size()[3];
    let usable = q.device().is_cuda()
        && matches!(q.kind(), Kind::BFloat16 | Kind::Half)
        && hd % 8 == 0
        && hd <= 256
        && !FAILED.load(Ordering::Relaxed);
    if !usable {
        return None;
    }
    let (b, heads, t) = (q.size()[0], q.size()[1], q.size()[2]);
    // [b, h, t, d] → [b·t, h, d]: the flattened batch the cumulative lengths index.
    let flat = |x: &Tensor| x.transpose(1, 2).reshape([b * t, x.size()[1], hd]);
    let (cu, max_len) = docs.cu_seqlens();
    match varlen_forward(&flat(q), &flat(k), &flat(v), cu, max_len) {
        Ok(y) => Some(y.view([b, t, heads, hd]).transpose(1, 2)),
        Err(e) => {
            if !FAILED.swap(true, Ordering::Relaxed) {
                eprintln!(
                    "WARNING: variable-length flash attention failed ({e}); packed documents use SDPA with a block-diagonal mask from now on"
                );
            }
            None
        }
    }
}

/// The shim's call: flattened q [total, heads, hd], k and v [total, kv_heads, hd].
fn varlen_forward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    cu_seqlens: &Tensor,
    max_len: i64,
) -> Result<Tensor, crate::sys::ffi::ShimError> {
    let mut out: *mut C_tensor = std::ptr::null_mut();
    // SAFETY: the tensor handles are live tch tensors borrowed for the call; on success the
    // shim stores a new `at::Tensor*` in `out`, whose ownership passes to the returned Tensor.
    crate::sys::ffi::call(|err| unsafe {
        lockstep_flash_varlen(
            q.as_ptr() as *mut C_tensor,
            k.as_ptr() as *mut C_tensor,
            v.as_ptr() as *mut C_tensor,
            cu_seqlens.as_ptr() as *mut C_tensor,
            max_len,
            &mut out,
            err,
        )
    })?;
    // SAFETY: a fresh handle from the shim, owned by nothing else.
    Ok(unsafe { Tensor::from_ptr(out) })
}

#[cfg(test)]
mod tests {
    use tch::Device;

    use super::*;

    /// The CUDA-only kernel asked to run on the CPU: the shim reports libtorch's error through
    /// the error convention (no abort), and the model's path never gets there on the CPU.
    #[test]
    fn the_shim_fails_cleanly_where_the_kernel_does_not_exist() {
        let q = Tensor::zeros([6, 4, 8], (Kind::BFloat16, Device::Cpu));
        let kv = Tensor::zeros([6, 2, 8], (Kind::BFloat16, Device::Cpu));
        let cu = Tensor::from_slice(&[0i32, 2, 6]);
        let e = varlen_forward(&q, &kv, &kv, &cu, 4).unwrap_err();
        assert!(!e.message.is_empty(), "{e:?}");
        let docs = DocumentMask::new(&[vec![2, 4]], true, false, Device::Cpu);
        let q4 = Tensor::zeros([1, 4, 6, 8], (Kind::BFloat16, Device::Cpu));
        let kv4 = Tensor::zeros([1, 2, 6, 8], (Kind::BFloat16, Device::Cpu));
        assert!(varlen_attention(&q4, &kv4, &kv4, &docs).is_none());
        assert!(!FAILED.load(Ordering::Relaxed), "not tried on the CPU");
    }
}
