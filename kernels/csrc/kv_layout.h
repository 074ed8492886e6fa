// A KV cache's memory order, read from its strides (kernels/kv_layout.py
// owns it): every cache has the shape [2, blocks, block_size, heads, row],
// token-major (contiguous) or head-major (memory [2, blocks, heads,
// block_size, row], the tensor its transpose(2, 3) view). A block is one
// contiguous unit either way; only where a (token, head) row sits in it
// differs, so kernels address rows through these strides.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>

namespace tandem_kv {

struct Layout {
  int64_t num_blocks, block_size, heads, row;  // sizes; row: elements per (token, head)
  int64_t v_offset;                            // elements from K's cache to V's
  int64_t block_stride, token_stride, head_stride;

  // Elements from the cache's start to (block, token in block, head) of K.
  int64_t at(int64_t block, int64_t token, int64_t head) const {
    return block * block_stride + token * token_stride + head * head_stride;
  }
  int64_t at_slot(int64_t slot, int64_t head) const {
    return at(slot / block_size, slot % block_size, head);
  }
};

// `who` names the caller in the error for any other strides.
inline Layout layout_of(const at::Tensor& cache, const char* who) {
  TORCH_CHECK(cache.dim() == 5 && cache.size(0) == 2, who,
              ": kv_cache must be [2, blocks, block_size, heads, row], got ", cache.sizes());
  const Layout l{cache.size(1),   cache.size(2),   cache.size(3),  cache.size(4),
                 cache.stride(0), cache.stride(1), cache.stride(2), cache.stride(3)};
  const int64_t block = l.block_size * l.heads * l.row;
  const bool token_major = l.token_stride == l.heads * l.row && l.head_stride == l.row;
  const bool head_major = l.head_stride == l.block_size * l.row && l.token_stride == l.row;
  TORCH_CHECK(cache.stride(4) == 1 && (token_major || head_major || cache.is_contiguous()) &&
                  l.block_stride == block && l.v_offset == l.num_blocks * block,
              who, ": kv_cache must be token- or head-major in memory, got strides ",
              cache.strides());
  return l;
}

}  // namespace tandem_kv
