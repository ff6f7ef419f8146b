// Frees and re-allocates a tensor's storage in place: `untyped_storage().resize_(n)` as torch
// FSDP uses it (_free_storage / _alloc_storage), which tch does not expose. Zero stage 3 frees
// a unit's gathered parameters after its forward this way: the autograd graph's saved views
// keep pointing at the same storage, now 0 bytes, and the gather before the unit's backward
// fills the same storage again (src/train/optim/mod.rs, the pass's `Events`).
#include <ATen/core/Tensor.h>
#include <c10/core/StorageImpl.h>
#include <c10/core/DeviceGuard.h>

#include "ffi_util.hpp"

extern "C" {

// Sets the storage behind `t` to `nbytes` bytes: only to or from 0 (nothing is copied, so the
// values are not kept), with the storage's own allocator (the tensor's device).
int lockstep_resize_storage(at::Tensor* t, size_t nbytes, char** err) {
  return lockstep_ffi::guarded(err, "resize_storage", [&] {
    c10::StorageImpl* s = t->storage().unsafeGetStorageImpl();
    const size_t old = s->nbytes();
    if (old == nbytes) return;
    TORCH_CHECK(old == 0 || nbytes == 0, "a storage of ", old, " bytes resized to ", nbytes,
                ": only to or from 0 bytes");
    TORCH_CHECK(s->resizable() && s->allocator() != nullptr,
                "the storage is not resizable (not allocated by libtorch)");
    if (nbytes == 0) {
      // The old DataPtr's deleter hands the block back to its allocator; CUDA's caching
      // allocator reuses it only in stream order after the kernels already queued on it.
      s->set_data_ptr_noswap(at::DataPtr(nullptr, s->device()));
    } else {
      // CUDA's caching allocator allocates on the current device: make it the storage's, as
      // at::native::resize_bytes_cuda does (a no-op on CPU).
      c10::DeviceGuard guard(s->device());
      s->set_data_ptr_noswap(s->allocator()->allocate(nbytes));
    }
    s->set_nbytes(nbytes);
  });
}

// The bytes the storage behind `t` holds now (cannot fail).
size_t lockstep_storage_nbytes(at::Tensor* t) { return t->storage().nbytes(); }
}
