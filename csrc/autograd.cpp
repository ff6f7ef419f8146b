// Backward from tensors with given gradients: torch::autograd::backward(roots, grads), which
// tch does not expose (its `backward` seeds with ones, and `run_backward` returns gradients
// instead of accumulating them into the leaves). src/model/backward.rs uses it to go backward
// one decoder layer at a time: the layer's output is the root, the gradient that arrived from
// the layer above is its seed, and the parameters' .grad accumulate as in one whole backward.
#include <torch/csrc/autograd/autograd.h>

#include "ffi_util.hpp"

#include <vector>

extern "C" {

// Error convention: csrc/ffi_util.hpp (every failure is LS_ERR_OTHER). The graph behind the
// roots is freed afterwards (retain_graph = false), as Tensor::backward() does.
int lockstep_backward(at::Tensor** roots, at::Tensor** grads, size_t n, char** err) {
  return lockstep_ffi::guarded(err, "backward", [&] {
    std::vector<at::Tensor> r, g;
    for (size_t i = 0; i < n; ++i) {
      r.push_back(*roots[i]);
      g.push_back(*grads[i]);
    }
    torch::autograd::backward(r, g, /*retain_graph=*/false, /*create_graph=*/false);
  });
}
}
