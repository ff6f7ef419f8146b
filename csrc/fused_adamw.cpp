// The optimizer's two libtorch calls that tch does not expose. First, one call of libtorch's fused AdamW kernel (what torch.optim.AdamW(fused=True) runs, on CPU and
// CUDA) over a list of parameters. tch does not expose list-taking ops; its tensor handles are
// `at::Tensor*` (tch's own C glue, torch_api.h), which is what arrives here.
// The operator's dispatcher entry (at::_ops), not ATen/ATen.h or even ATen/ops/_fused_adamw.h:
// those parse ATen's Context and every operator, 3x the compile time of this file.
#include <ATen/core/Tensor.h>
#include <ATen/ops/_fused_adamw_ops.h>
#include <c10/core/GradMode.h>

#include "ffi_util.hpp"

#include <vector>

extern "C" {

// Error convention: csrc/ffi_util.hpp (every failure is LS_ERR_OTHER).
int lockstep_fused_adamw(at::Tensor** params, at::Tensor** grads, at::Tensor** exp_avgs,
                         at::Tensor** exp_avg_sqs, at::Tensor** steps, size_t n, double lr,
                         double beta1, double beta2, double weight_decay, double eps,
                         char** err) {
  return lockstep_ffi::guarded(err, "fused AdamW", [&] {
    std::vector<at::Tensor> p, g, m, v, s;
    for (size_t i = 0; i < n; ++i) {
      p.push_back(*params[i]);
      g.push_back(*grads[i]);
      m.push_back(*exp_avgs[i]);
      v.push_back(*exp_avg_sqs[i]);
      s.push_back(*steps[i]);
    }
    // Updating leaf parameters in place is only allowed with autograd off.
    c10::AutoGradMode no_grad(false);
    at::_ops::_fused_adamw_::call(p, g, m, v, /*max_exp_avg_sqs=*/{}, s, lr, beta1, beta2,
                                  weight_decay, eps, /*amsgrad=*/false, /*maximize=*/false,
                                  /*grad_scale=*/std::nullopt, /*found_inf=*/std::nullopt);
  });
}

// Drops each tensor's gradient (PyTorch's zero_grad(set_to_none=True)): tch's zero_grad only
// fills it with zeros, which costs a memset per parameter and keeps the memory between steps.
// Cannot fail: resetting an intrusive pointer does not throw.
void lockstep_drop_grads(at::Tensor** params, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    params[i]->mutable_grad().reset();
  }
}
}
