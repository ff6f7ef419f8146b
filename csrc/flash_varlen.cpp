// Variable-length flash attention: libtorch's at::_flash_attention_forward with cumulative
// sequence lengths, which tch does not expose. Each packed document is its own causal sequence
// and no [seq, seq] mask is built. The op is called through the dispatcher, so autograd records
// its backward (FlashAttentionBackward0) as for any other op. It has a CUDA kernel only (fp16 /
// bf16); on anything else it throws, and the caller falls back to the masked SDPA path.
// The operator's dispatcher entry (at::_ops), not ATen/ATen.h: see fused_adamw.cpp.
#include <ATen/core/Tensor.h>
#include <ATen/ops/_flash_attention_forward_ops.h>

#include "ffi_util.hpp"

extern "C" {

// q: [total, heads, head_dim], k and v: [total, kv_heads, head_dim] (kv_heads divides heads),
// cu_seqlens: [pieces + 1] int32 on the same device. On success *out receives a new
// at::Tensor* ([total, heads, head_dim]) that the caller owns (tch's Tensor::from_ptr).
// Error convention: csrc/ffi_util.hpp (every failure is LS_ERR_OTHER).
int lockstep_flash_varlen(at::Tensor* q, at::Tensor* k, at::Tensor* v, at::Tensor* cu_seqlens,
                          int64_t max_len, at::Tensor** out, char** err) {
  return lockstep_ffi::guarded(err, "variable-length flash attention", [&] {
    auto result = at::_ops::_flash_attention_forward::call(
        *q, *k, *v, *cu_seqlens, *cu_seqlens, max_len, max_len, /*dropout_p=*/0.0,
        /*is_causal=*/true, /*return_debug_mask=*/false, /*scale=*/std::nullopt,
        /*window_size_left=*/std::nullopt, /*window_size_right=*/std::nullopt,
        /*seqused_k=*/std::nullopt, /*alibi_slopes=*/std::nullopt);
    *out = new at::Tensor(std::get<0>(result));
  });
}
}
