// Thin C ABI over libtorch's c10d::ProcessGroupNCCL, consumed by src/dist/nccl/.
//
// Built by build.rs as its own shared library (linked against libtorch_cuda), embedded in the
// lockstep binary and loaded at run time only by CUDA ranks, so CPU runs never load the CUDA
// stack. Why ProcessGroupNCCL and not raw NCCL: its watchdog, per-collective timeouts, flight
// recorder and error handling are exactly what PyTorch users rely on, and it syncs with
// libtorch's current CUDA stream without us touching streams.
//
// Error convention: csrc/ffi_util.hpp (every failure is LS_ERR_OTHER). Tensors arrive as tch's
// handles, which are `at::Tensor*`.
#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/distributed/c10d/NCCLUtils.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

#include "ffi_util.hpp"

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <string>
#include <utility>
#include <vector>

namespace {

struct Group {
  c10::intrusive_ptr<c10d::ProcessGroupNCCL> pg;
};

template <typename F>
int guarded(char** err, F&& f) {
  return lockstep_ffi::guarded(err, "ProcessGroupNCCL", std::forward<F>(f));
}

void abort_quietly(c10d::ProcessGroupNCCL& pg) {
  try {
    pg.abort();
  } catch (...) {
  }
}

}  // namespace

extern "C" {

// `store` is a c10d::Store* owned elsewhere (ls_store_c10d); the group takes its own
// reference. Keys go under `prefix`, so a restarted attempt never reads a dead one's NCCL id.
// `timeout_ms` is the watchdog's limit for one collective. The communicator is created now on
// CUDA device `device` (as init_process_group(device_id=...) does), so a broken NCCL setup
// fails here, right after the ranks met on the CPU ring, not inside the first all-reduce.
int ls_nccl_new(void* store, const char* prefix, size_t prefix_len, int rank, int size,
                int device, int64_t timeout_ms, void** out, char** err) {
  return guarded(err, [&] {
    auto base = c10::intrusive_ptr<c10d::Store>::unsafe_reclaim_from_nonowning(
        static_cast<c10d::Store*>(store));
    auto prefixed =
        c10::make_intrusive<c10d::PrefixStore>(std::string(prefix, prefix_len), base);
    auto opts = c10d::ProcessGroupNCCL::Options::create();
    opts->timeout = std::chrono::milliseconds(timeout_ms);
    auto pg = c10::make_intrusive<c10d::ProcessGroupNCCL>(prefixed, rank, size, opts);
    try {
      // The rank's device becomes the current one (torch.cuda.set_device(local_rank) in a
      // PyTorch script): under torchrun every GPU is visible, and anything that uses the
      // current device (streams, handles) must not land on GPU 0 for every rank.
      c10::cuda::set_device(static_cast<c10::DeviceIndex>(device));
      const at::Device dev(at::kCUDA, static_cast<c10::DeviceIndex>(device));
      pg->setBoundDeviceId(dev);
      pg->eagerConnectSingleDevice(dev);
    } catch (...) {
      // Tear down explicitly: the destructor of a group that was never shut down aborts it
      // itself, and an exception there (noexcept) would terminate the process.
      abort_quietly(*pg);
      throw;
    }
    *out = new Group{std::move(pg)};
  });
}

// In-place all-reduce of one dense CUDA tensor; op 0 = sum, 1 = average. Returns once the
// collective is ordered before later work on the current stream (the CPU does not wait).
int ls_nccl_all_reduce(void* g, void* tensor, int op, char** err) {
  return guarded(err, [&] {
    std::vector<at::Tensor> ts{*static_cast<at::Tensor*>(tensor)};
    c10d::AllreduceOptions opts;
    opts.reduceOp = op == 1 ? c10d::ReduceOp(c10d::ReduceOp::AVG)
                            : c10d::ReduceOp(c10d::ReduceOp::SUM);
    static_cast<Group*>(g)->pg->allreduce(ts, opts)->wait();
  });
}

// In-place broadcast of one dense CUDA tensor from `root`.
int ls_nccl_broadcast(void* g, void* tensor, int root, char** err) {
  return guarded(err, [&] {
    std::vector<at::Tensor> ts{*static_cast<at::Tensor*>(tensor)};
    c10d::BroadcastOptions opts;
    opts.rootRank = root;
    static_cast<Group*>(g)->pg->broadcast(ts, opts)->wait();
  });
}

namespace {

// Views of `flat` cut into `n` consecutive pieces of `splits[i]` elements.
std::vector<at::Tensor> pieces(const at::Tensor& flat, const int64_t* splits, int n) {
  std::vector<at::Tensor> out;
  out.reserve(n);
  int64_t at = 0;
  for (int i = 0; i < n; ++i) {
    out.push_back(flat.narrow(0, at, splits[i]));
    at += splits[i];
  }
  TORCH_CHECK(at == flat.numel(), "pieces cover ", at, " of ", flat.numel(), " elements");
  return out;
}

bool all_equal(const int64_t* splits, int n) {
  for (int i = 1; i < n; ++i) {
    if (splits[i] != splits[0]) return false;
  }
  return true;
}

}  // namespace

// In-place reduce-scatter of a flat 1-D CUDA tensor cut into `n` (= world size) pieces of
// `splits[i]` elements: this rank's piece receives the sum (op 0) or mean (op 1) of all ranks'
// pieces.
// Equal pieces go through ncclReduceScatter (in place: the output is the input's own piece);
// uneven ones through ProcessGroupNCCL's uneven reduce_scatter (coalesced reduces).
int ls_nccl_reduce_scatter(void* g, void* tensor, const int64_t* splits, int n, int op,
                           char** err) {
  return guarded(err, [&] {
    auto& pg = static_cast<Group*>(g)->pg;
    const auto& flat = *static_cast<at::Tensor*>(tensor);
    auto parts = pieces(flat, splits, n);
    auto mine = parts.at(pg->getRank());
    c10d::ReduceScatterOptions opts;
    opts.reduceOp = op == 1 ? c10d::ReduceOp(c10d::ReduceOp::AVG)
                            : c10d::ReduceOp(c10d::ReduceOp::SUM);
    if (all_equal(splits, n)) {
      auto input = flat;
      pg->_reduce_scatter_base(mine, input, opts)->wait();
    } else {
      std::vector<at::Tensor> outputs{mine};
      std::vector<std::vector<at::Tensor>> inputs{parts};
      pg->reduce_scatter(outputs, inputs, opts)->wait();
    }
  });
}

// In-place all-gather over the same pieces: this rank's piece is sent, the others received.
int ls_nccl_all_gather(void* g, void* tensor, const int64_t* splits, int n, char** err) {
  return guarded(err, [&] {
    auto& pg = static_cast<Group*>(g)->pg;
    auto flat = *static_cast<at::Tensor*>(tensor);
    auto parts = pieces(flat, splits, n);
    auto mine = parts.at(pg->getRank());
    if (all_equal(splits, n)) {
      pg->_allgather_base(flat, mine)->wait();
    } else {
      std::vector<std::vector<at::Tensor>> outputs{parts};
      std::vector<at::Tensor> inputs{mine};
      pg->allgather(outputs, inputs)->wait();
    }
  });
}

// All-to-all of rows (torch.distributed.all_to_all_single with split sizes): `input`'s rows
// cut into `n` pieces of `in_splits[i]` rows, piece i to rank i; `output` (allocated by the
// caller, Σ out_splits rows of the same row shape and dtype) receives piece j from rank j.
int ls_nccl_all_to_all(void* g, void* output, void* input, const int64_t* out_splits,
                       const int64_t* in_splits, int n, char** err) {
  return guarded(err, [&] {
    auto& pg = static_cast<Group*>(g)->pg;
    auto out = *static_cast<at::Tensor*>(output);
    auto in = *static_cast<at::Tensor*>(input);
    std::vector<int64_t> outs(out_splits, out_splits + n), ins(in_splits, in_splits + n);
    pg->alltoall_base(out, in, outs, ins)->wait();
  });
}

// The NCCL version libtorch was built with, e.g. "2.28.9", into *out (malloc'd, free with
// free()).
int ls_nccl_version(char** out, char** err) {
  return guarded(err, [&] {
    char* v = lockstep_ffi::dup_cstr(c10d::getNcclVersion());
    if (v == nullptr) throw std::bad_alloc();
    *out = v;
  });
}

// Normal end: shutdown() flushes and destroys the communicators. After a failure (a peer is
// gone, a collective may never finish) abort() instead, which does not wait for the device.
// A shutdown that throws falls back to abort, so the destructor finds the group terminated.
void ls_nccl_free(void* g, int abort) {
  auto* group = static_cast<Group*>(g);
  if (abort != 0) {
    abort_quietly(*group->pg);
  } else {
    try {
      group->pg->shutdown();
    } catch (...) {
      abort_quietly(*group->pg);
    }
  }
  try {
    delete group;
  } catch (...) {
  }
}

}  // extern "C"
