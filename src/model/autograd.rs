//! Where one segment of a backward hands its gradient to the next: leaves that autograd
//! accumulates into, and backward from given roots with given gradients (csrc/autograd.cpp,
//! `torch::autograd::backward(roots, grads)`, which tch does not expose). The training pass
//! (backward.rs), tensor parallelism and context parallelism cut their graphs with these.

use anyhow::Result;
use tch::Tensor;
use torch_sys::C_tensor;

extern "C" {
    /// csrc/autograd.cpp: torch::autograd::backward(roots, grads); a status and `err` as in
    /// crate::sys::ffi.
    fn lockstep_backward(
        roots: *const *mut C_tensor,
        grads: *const *mut C_tensor,
        n: usize,
        err: *mut *mut libc::c_char,
    ) -> libc::c_int;
}

/// A tensor with no history that autograd accumulates a gradient into: where one segment of
/// the backward hands its gradient to the next.
pub(super) fn leaf(x: &Tensor) -> Tensor {
    x.detach().set_requires_grad(true)
}

/// Back-propagates `grad` from `root` (whose graph is then freed), accumulating into the
/// `.grad` of the leaves behind it.
pub(super) fn backward_from(root: &Tensor, grad: &Tensor) -> Result<()> {
    backward_from_many(&[root], &[grad])
}

/// [`backward_from`] of several roots of one graph at once (each with its gradient), so that
/// what they share is back-propagated once, with the sum of what reaches it.
pub(super) fn backward_from_many(roots: &[&Tensor], grads: &[&Tensor]) -> Result<()> {
    assert_eq!(roots.len(), grads.len(), "internal: a gradient per root");
    let roots: Vec<*mut C_tensor> = roots.iter().map(|t| t.as_ptr() as *mut C_tensor).collect();
    let grads: Vec<*mut C_tensor> = grads.iter().map(|t| t.as_ptr() as *mut C_tensor).collect();
    // SAFETY: every pointer is a live tch tensor handle (`at::Tensor*`) borrowed for the call;
    // the shim catches every C++ exception.
    crate::sys::ffi::call(|err| unsafe {
        lockstep_backward(roots.as_ptr(), grads.as_ptr(), roots.len(), err)
    })
    .map_err(|e| anyhow::anyhow!("backward failed: {e}"))
}

/// The gradient autograd accumulated into a leaf.
pub(super) fn grad_of(leaf: &Tensor) -> Result<Tensor> {
    let g = leaf.grad();
    anyhow::ensure!(
        g.defined(),
        "internal error: no gradient reached a layer boundary"
    );
    Ok(g)
}
