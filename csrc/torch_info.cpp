// What the loaded libtorch says about its own build: caffe2::GetBuildOptions(), the table
// `torch.__config__.show()` prints as "Build settings" (TORCH_VERSION, CUDA_VERSION,
// CUDNN_VERSION, COMMIT_SHA, USE_CUDA, USE_NCCL, ...). src/sys/libtorch.rs checks the version
// at start and `lockstep env` prints it. Unlike at::show_config(), it reads a table compiled
// into libtorch_cpu and never asks ATen's CUDA hooks, which must not be created before
// libtorch_cuda is loaded (FACTS.md, "The CUDA path").
#include <caffe2/core/common.h>

#include "ffi_util.hpp"

#include <new>
#include <string>

extern "C" {

// Error convention: csrc/ffi_util.hpp. `*out` receives "KEY=VALUE\n" lines, malloc'd.
int ls_torch_build_options(char** out, char** err) {
  return lockstep_ffi::guarded(err, "torch build options", [&] {
    std::string lines;
    for (const auto& [key, value] : caffe2::GetBuildOptions()) {
      lines += key;
      lines += '=';
      lines += value;
      lines += '\n';
    }
    char* p = lockstep_ffi::dup_cstr(lines);
    if (p == nullptr) throw std::bad_alloc();
    *out = p;
  });
}
}
