// The int8 KV cache's row format (kernels/kv_int8.py owns it): each
// (token, head) row is head_dim int8 values, then the row's float32 scale in
// its last 4 bytes. A value dequantizes to q * scale.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <cstring>

namespace tandem_kv_int8 {

constexpr int64_t kScaleBytes = 4;

// Cache elements (bytes) of one row of a head_dim-wide head.
constexpr int64_t row_elems(int64_t head_dim) { return head_dim + kScaleBytes; }

// The scale stored after a row's D values (4-byte aligned: D is a multiple of 4).
template <int64_t D>
inline float row_scale(const int8_t* row) {
  float scale;
  std::memcpy(&scale, row + D, sizeof(float));
  return scale;
}

// Quantizes n float32 values into dst (n int8 values, then the scale),
// exactly as kernels/kv_int8.py's quantize_rows: scale = max|x| * fl(1/127),
// q = round-half-even(x * fl(1/scale)) clamped to [-127, 127].
void quantize_row(int8_t* dst, const float* src, int64_t n);

// Token t's K row of head h at key + t * k_token + h * k_head (V's alike),
// each quantized into its slot of the int8 cache (token- or head-major:
// kv_layout.h). Checks the slots.
void quantize_rows_at(const at::Tensor& kv_cache, const float* key, const float* value,
                      int64_t k_token, int64_t k_head, int64_t v_token, int64_t v_head,
                      const int64_t* slot, int64_t num_tokens);

}  // namespace tandem_kv_int8
