// The int8 KV cache's writer: float32 K/V rows quantized into their slots
// (format and rounding: kv_int8.h, kernels/kv_int8.py). The torch backend's
// reshape_and_cache calls cache_kv_int8 for an int8 cache, one call per
// layer; the attention kernels read the rows in place.
#include "kv_int8.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "cpu_ops.h"
#include "kv_layout.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace tandem_kv_int8 {

namespace {

float max_abs(const float* src, int64_t n) {
  float amax = 0.f;
#pragma omp simd reduction(max : amax)
  for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(src[i]));
  return amax;
}

// The scale and its reciprocal, each one float32 rounding as the Python
// quantizer computes them. The empty asm hides `scale`'s origin from the
// optimizer, so -ffast-math cannot fold 1 / (amax * c) into (1 / c) / amax
// (another rounding: not bit for bit with torch any more).
void scale_and_inverse(float amax, float* scale, float* inv) {
  constexpr float kInv127 = 1.0f / 127.0f;
  float s = amax * kInv127;
#if defined(__GNUC__) && defined(__x86_64__)
  asm("" : "+x"(s));
#endif
  *scale = s;
  *inv = s > 0.f ? 1.0f / s : 0.f;
}

}  // namespace

void quantize_row(int8_t* dst, const float* src, int64_t n) {
  float scale, inv;
  scale_and_inverse(max_abs(src, n), &scale, &inv);
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 vinv = _mm512_set1_ps(inv);
  const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
  for (; i + 16 <= n; i += 16) {
    const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(src + i), vinv);
    __m512i q = _mm512_cvt_roundps_epi32(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    q = _mm512_min_epi32(_mm512_max_epi32(q, lo), hi);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), _mm512_cvtepi32_epi8(q));
  }
#endif
  for (; i < n; ++i) {
    const float q = std::nearbyint(src[i] * inv);  // the default mode: half to even
    dst[i] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, q)));
  }
  std::memcpy(dst + n, &scale, sizeof(float));
}

void quantize_rows_at(const at::Tensor& kv_cache, const float* key, const float* value,
                      int64_t k_token, int64_t k_head, int64_t v_token, int64_t v_head,
                      const int64_t* slot, int64_t num_tokens) {
  const tandem_kv::Layout L = tandem_kv::layout_of(kv_cache, "int8 KV write");
  const int64_t dim = L.row - kScaleBytes, num_slots = L.num_blocks * L.block_size;
  for (int64_t t = 0; t < num_tokens; ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < num_slots, "int8 KV write: slot ", slot[t],
                " outside the cache (", num_slots, " slots)");
  int8_t* k_cache = static_cast<int8_t*>(kv_cache.data_ptr());
  int8_t* v_cache = k_cache + L.v_offset;
  at::parallel_for(0, num_tokens, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t h = 0; h < L.heads; ++h) {
        const int64_t at_row = L.at_slot(slot[t], h);
        quantize_row(k_cache + at_row, key + t * k_token + h * k_head, dim);
        quantize_row(v_cache + at_row, value + t * v_token + h * v_head, dim);
      }
  });
}

}  // namespace tandem_kv_int8

// K and V rows [T, heads, dim] (float32, last dim contiguous) quantized into
// an int8 cache [2, blocks, block_size, heads, dim + 4] (token- or
// head-major: kv_layout.h) at their slots.
void cache_kv_int8(at::Tensor kv_cache, at::Tensor key, at::Tensor value,
                   at::Tensor slot_mapping) {
  TORCH_CHECK(kv_cache.scalar_type() == at::kChar && kv_cache.dim() == 5,
              "cache_kv_int8: kv_cache must be an int8 [2, blocks, block_size, heads, dim + 4] "
              "tensor");
  const int64_t T = key.size(0), heads = kv_cache.size(3);
  const int64_t dim = kv_cache.size(4) - tandem_kv_int8::kScaleBytes;
  for (const at::Tensor* t : {&key, &value})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 3 && t->size(0) == T &&
                    t->size(1) == heads && t->size(2) == dim && t->stride(2) == 1,
                "cache_kv_int8: key and value must be float32 [T, ", heads, ", ", dim,
                "] with contiguous rows");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.numel() == T,
              "cache_kv_int8: slot_mapping must be contiguous int64, one per token");
  tandem_kv_int8::quantize_rows_at(kv_cache, key.data_ptr<float>(), value.data_ptr<float>(),
                                   key.stride(0), key.stride(1), value.stride(0),
                                   value.stride(1), slot_mapping.data_ptr<int64_t>(), T);
}
