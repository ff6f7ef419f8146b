// Muon's two libtorch calls that tch does not expose (src/train/optim/muon.rs): the
// Newton-Schulz iteration, op for op as torch.optim.Muon's _zeropower_via_newtonschulz runs it
// (addmm with beta and alpha, which tch lacks: emulated with separate ops it would round
// differently), and the update p.mul_(1 - lr*wd); p.add_(o, alpha=-adjusted_lr) (add with alpha:
// one rounding per element, as torch's kernel does it).
// The operators' dispatcher entries (at::_ops), not ATen/ATen.h: as csrc/fused_adamw.cpp.
#include <ATen/core/Tensor.h>
#include <ATen/ops/add_ops.h>
#include <ATen/ops/addmm_ops.h>
#include <ATen/ops/clamp_ops.h>
#include <ATen/ops/clone_ops.h>
#include <ATen/ops/div_ops.h>
#include <ATen/ops/linalg_vector_norm_ops.h>
#include <ATen/ops/matmul_ops.h>
#include <ATen/ops/mul_ops.h>
#include <ATen/ops/to_ops.h>
#include <c10/core/GradMode.h>

#include "ffi_util.hpp"

extern "C" {

// Error convention: csrc/ffi_util.hpp (every failure is LS_ERR_OTHER). `update` is a 2-D
// matrix of any floating dtype (left unchanged); *out receives a new bf16 tensor of its shape
// that the caller owns (tch's Tensor::from_ptr): the orthogonalized update.
int lockstep_newton_schulz(at::Tensor* update, double a, double b, double c, int64_t steps,
                           double eps, at::Tensor** out, char** err) {
  return lockstep_ffi::guarded(err, "Newton-Schulz", [&] {
    c10::AutoGradMode no_grad(false);
    const at::Tensor& g = *update;
    TORCH_CHECK(g.dim() == 2, "Newton-Schulz takes a matrix, got ", g.dim(), " dimensions");
    // grad.bfloat16(); a bf16 input is copied, since the division below is in place.
    at::Tensor x = g.scalar_type() == at::kBFloat16
                       ? at::_ops::clone::call(g, std::nullopt)
                       : at::_ops::to_dtype::call(g, at::kBFloat16, false, false, std::nullopt);
    const bool tall = g.size(0) > g.size(1);
    if (tall) x = x.t();
    // ortho_grad.div_(ortho_grad.norm().clamp(min=eps)); Tensor.norm() is vector_norm(x, 2).
    at::Tensor norm = at::_ops::linalg_vector_norm::call(x, 2, std::nullopt, false, std::nullopt);
    at::_ops::div__Tensor::call(x, at::_ops::clamp::call(norm, eps, std::nullopt));
    for (int64_t i = 0; i < steps; ++i) {
      at::Tensor gram = at::_ops::matmul::call(x, x.t());
      at::Tensor gram_update = at::_ops::addmm::call(gram, gram, gram, b, c);
      x = at::_ops::addmm::call(x, gram_update, x, a, 1);
    }
    if (tall) x = x.t();
    *out = new at::Tensor(x);
  });
}

// param.mul_(decay); param.add_(update, alpha): Muon's decoupled weight decay (decay =
// 1 - lr*weight_decay) and its step (alpha = -adjusted lr), in place on `param` (any view).
int lockstep_muon_apply(at::Tensor* param, at::Tensor* update, double decay, double alpha,
                        char** err) {
  return lockstep_ffi::guarded(err, "Muon update", [&] {
    c10::AutoGradMode no_grad(false);
    at::_ops::mul__Scalar::call(*param, decay);
    at::_ops::add__Tensor::call(*param, *update, alpha);
  });
}
}
