// One call of libtorch's fused AdamW kernel (what torch.optim.AdamW(fused=True) runs, on CPU and
// CUDA) over a list of parameters. tch does not expose list-taking ops; its tensor handles are
// `at::Tensor*` (tch's own C glue, torch_api.h), which is what arrives here.
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <cstring>
#include <vector>

extern "C" {

// Returns nullptr on success, else a malloc'ed message the caller frees with free().
char* lockstep_fused_adamw(at::Tensor** params, at::Tensor** grads, at::Tensor** exp_avgs,
                           at::Tensor** exp_avg_sqs, at::Tensor** steps, size_t n, double lr,
                           double beta1, double beta2, double weight_decay, double eps) {
  try {
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
    at::_fused_adamw_(p, g, m, v, {}, s, lr, beta1, beta2, weight_decay, eps,
                      /*amsgrad=*/false, /*maximize=*/false);
    return nullptr;
  } catch (const std::exception& e) {
    return strdup(e.what());
  }
}
}
