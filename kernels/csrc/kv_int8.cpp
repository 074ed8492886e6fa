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

}  // namespace tandem_kv_int8

// K and V rows [T, heads, dim] (float32, last dim contiguous) quantized into
// an int8 cache [2, blocks, block_size, heads, dim + 4] at their slots.
void cache_kv_int8(at::Tensor kv_cache, at::Tensor key, at::Tensor value,
                   at::Tensor slot_mapping) {
  TORCH_CHECK(kv_cache.scalar_type() == at::kChar && kv_cache.is_contiguous() &&
                  kv_cache.dim() == 5,
              "cache_kv_int8: kv_cache must be a contiguous int8 [2, blocks, block_size, heads, "
              "dim + 4] tensor");
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
  const int64_t num_slots = kv_cache.size(1) * kv_cache.size(2);
  const int64_t* slot = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < num_slots, "cache_kv_int8: slot ", slot[t],
                " outside the cache (", num_slots, " slots)");
  const int64_t row = tandem_kv_int8::row_elems(dim), slot_elems = heads * row;
  int8_t* k_cache = static_cast<int8_t*>(kv_cache.data_ptr());
  int8_t* v_cache = k_cache + num_slots * slot_elems;
  const float* k = key.data_ptr<float>();
  const float* v = value.data_ptr<float>();
  at::parallel_for(0, T, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t at_row = slot[t] * slot_elems + h * row;
        tandem_kv_int8::quantize_row(k_cache + at_row, k + t * key.stride(0) + h * key.stride(1),
                                     dim);
        tandem_kv_int8::quantize_row(v_cache + at_row,
                                     v + t * value.stride(0) + h * value.stride(1), dim);
      }
  });
}
