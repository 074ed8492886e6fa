// Paged decode attention on CPU for float32 queries over float32 or bfloat16
// caches (see kernels/cpu_kernels.py).
//
// Two implementations: a portable one (online softmax, loops the compiler
// vectorizes) and, where the build targets AVX-512, one with the GQA group's
// queries and accumulators held in registers, each K/V row loaded once for
// the whole group, and a two-pass softmax (all scores of a head with their
// running maximum kept in a register, then one exp pass of 16 lanes, then
// the V pass). Scores come 16 keys at a time, their partial
// sums folded together by shuffles instead of one horizontal sum per key,
// and blocks are prefetched into L2 four ahead. The AVX-512 path covers
// group sizes 1-8 and head dims 64/128/256, which spans the Llama/Mistral/
// Qwen2/Gemma 3 checkpoints people run on CPUs (at 256 a group's queries and
// sums no longer fit the 32 registers and spill to L1; Gemma 3 270M's decode
// attention still ran 1.6x the portable loop's speed). A bfloat16 cache (--kv-cache-dtype
// bfloat16) takes either, its rows widened to float32 (exactly) as they are
// read.
//
// An int8 cache (kv_int8.h: int8 values, then each row's float32 scale)
// takes either too, its rows converted to float32 in registers as they are
// read and the scale applied once per key rather than per element: K's to
// the 16 keys' dot products at once, V's to the key's probability. Rows
// are D + 4 bytes, about half a bfloat16 row: decode reads half the bytes.
// Where the CPU has AVX-512 VNNI, the scores of an int8 cache are integer
// dot products instead (vpdpbusd, 64 products an instruction): each query
// head is quantized to int8 with its own scale, as llama.cpp quantizes the
// query for a q8_0 cache; and V's weighted sum is integer too (vpdpwssd:
// each 16 keys' weights rounded to int16 against their largest). Converting
// every K and V value to float cost more than reading it: with the cache
// head-major (kv_layout.h: a head's rows of a block in one run), the float
// path read 13.8 GiB/s where bfloat16 streamed 25; integer, 17.5
// (benchmarks/README.md, kv_int8_bench.py).
//
// A sliding window (window > 0; 0 is the whole context) starts each
// sequence's walk at its first in-window key, len - window, skipping the
// blocks before it unread: reading K/V that the mask would hide is wasted
// bandwidth, and bandwidth is what decode is bound by (a 4k context under a
// 512 window reads ~512 rows per head, not 4k).
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <atomic>
#include <numeric>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <limits>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "kv_int8.h"
#include "kv_layout.h"
#include "silu.h"

using tandem_kv_int8::row_scale;

namespace {
// Cache elements per (token, head) row: D, or D + 4 for int8 (the scale).
template <typename T, int64_t D>
constexpr int64_t kRow = std::is_same_v<T, int8_t> ? tandem_kv_int8::row_elems(D) : D;

// The first context position a decode at position len - 1 sees.
inline int64_t window_start(int64_t len, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, len - window) : 0;
}
}  // namespace


// One KV head's n rows of a block as float32, with their row stride: the
// cache itself, or bfloat16 rows widened into `buf` (once per block, not
// once per query head of the group).
template <int64_t D>
inline std::pair<const float*, int64_t> rows_as_float(const float* rows, int64_t stride,
                                                      int64_t /*n*/, float* /*buf*/) {
  return {rows, stride};
}

template <int64_t D>
inline std::pair<const float*, int64_t> rows_as_float(const c10::BFloat16* rows, int64_t stride,
                                                      int64_t n, float* buf) {
  for (int64_t t = 0; t < n; ++t) {
    const auto* bits = reinterpret_cast<const uint16_t*>(rows + t * stride);
    auto* out = reinterpret_cast<uint32_t*>(buf + t * D);
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) out[d] = static_cast<uint32_t>(bits[d]) << 16;
  }
  return {buf, D};
}

template <int64_t D>
inline std::pair<const float*, int64_t> rows_as_float(const int8_t* rows, int64_t stride,
                                                      int64_t n, float* buf) {
  for (int64_t t = 0; t < n; ++t) {
    const int8_t* row = rows + t * stride;
    const float scale = row_scale<D>(row);
    float* out = buf + t * D;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) out[d] = static_cast<float>(row[d]) * scale;
  }
  return {buf, D};
}

// query [S, H, D] float32 (one decode token per sequence; any row stride),
// kv_cache [2, num_blocks, block_size, Hkv, kRow<T, D>] (token- or head-major: kv_layout.h), of element
// type T (float, c10::BFloat16 or int8_t), block_table [S, max_blocks] int32, seq_lens [S]
// int32, out [S, H, D] float32. D is a template constant so the per-row
// loops unroll and vectorize fully.
template <int64_t D, typename T>
void decode_attention_d(at::Tensor out, at::Tensor query, at::Tensor kv_cache,
                        at::Tensor block_table, at::Tensor seq_lens, double scale,
                        int64_t window) {
  const int64_t S = query.size(0), H = query.size(1);
  const tandem_kv::Layout L = tandem_kv::layout_of(kv_cache, "decode_attention");
  const int64_t BS = L.block_size, HKV = L.heads;
  const int64_t G = H / HKV;
  const int64_t q_s0 = query.stride(0), q_s1 = query.stride(1);
  const int64_t o_s0 = out.stride(0), o_s1 = out.stride(1);
  const int64_t bt_s0 = block_table.stride(0);
  const float* q_base = query.data_ptr<float>();
  const T* k_base = static_cast<const T*>(kv_cache.data_ptr());
  const T* v_base = k_base + L.v_offset;
  const int32_t* bt = block_table.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  float* o_base = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, S * HKV, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(G * D), m(G), l(G), q(G * D), scores(G * BS);
    std::vector<float> kbuf(std::is_same_v<T, float> ? 0 : BS * D), vbuf(kbuf.size());
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / HKV, h = task % HKV;
      const int64_t len = lens[s];
      for (int64_t g = 0; g < G; ++g) {
        const float* src = q_base + s * q_s0 + (h * G + g) * q_s1;
        for (int64_t d = 0; d < D; ++d) q[g * D + d] = src[d] * fscale;
        m[g] = -std::numeric_limits<float>::infinity();
        l[g] = 0.f;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      // From the first in-window key: its block's earlier rows are skipped,
      // and the blocks before it never read.
      for (int64_t start = window_start(len, window); start < len; start += BS - start % BS) {
        const int64_t block = bt[s * bt_s0 + start / BS];
        const int64_t n = std::min(BS - start % BS, len - start);
        const int64_t first_row = L.at(block, start % BS, h);
        const auto [kb, k_stride] =
            rows_as_float<D>(k_base + first_row, L.token_stride, n, kbuf.data());
        const auto [vb, v_stride] =
            rows_as_float<D>(v_base + first_row, L.token_stride, n, vbuf.data());
        for (int64_t g = 0; g < G; ++g) {
          const float* __restrict qg = q.data() + g * D;
          float block_max = m[g];
          for (int64_t t = 0; t < n; ++t) {
            const float* __restrict k = kb + t * k_stride;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < D; ++d) dot += qg[d] * k[d];
            scores[g * BS + t] = dot;
            block_max = std::max(block_max, dot);
          }
          // Online softmax: rescale what was summed under the old max.
          const float correction = std::exp(m[g] - block_max);
          float* __restrict ag = acc.data() + g * D;
          float* pg = scores.data() + g * BS;
          float sum = 0.f;
#pragma omp simd reduction(+ : sum)
          for (int64_t t = 0; t < n; ++t) {
            pg[t] = std::exp(pg[t] - block_max);
            sum += pg[t];
          }
          sum += l[g] * correction;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) ag[d] *= correction;
          for (int64_t t = 0; t < n; ++t) {
            const float p = pg[t];
            const float* __restrict v = vb + t * v_stride;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) ag[d] += p * v[d];
          }
          m[g] = block_max;
          l[g] = sum;
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float* dst = o_base + s * o_s0 + (h * G + g) * o_s1;
        const float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;
        for (int64_t d = 0; d < D; ++d) dst[d] = acc[g * D + d] * inv;
      }
    }
  });
}

#if defined(__AVX512F__)
namespace {

// Ask for one head's rows of a block some blocks ahead: blocks are scattered,
// so the hardware prefetcher cannot guess where the next one starts. Into
// L2, not L1: L1's few outstanding misses held a DRAM-resident cache to a
// third of the read bandwidth (10.8 GB/s against 20-21 into L2, 64
// sequences x ~300 keys, two threads; benchmarks/JOURNAL.md).
// An int8 row (D + 4 bytes) is not line-aligned: its last byte may sit on
// one more line than its first bytes' span. (Asking for each line of a
// head-major run once instead measured slower, 2026-11-29.)
template <int D, typename T>
inline void prefetch_rows(const T* first, int64_t n, int64_t row) {
  constexpr int64_t bytes = kRow<T, D> * sizeof(T);
  for (int64_t t = 0; t < n; ++t) {
    const char* p = reinterpret_cast<const char*>(first + t * row);
    for (int64_t c = 0; c < bytes; c += 64) _mm_prefetch(p + c, _MM_HINT_T1);
    if constexpr (bytes % 64 != 0) _mm_prefetch(p + bytes - 1, _MM_HINT_T1);
  }
}

// A K/V row of D cache elements as float32 in C = D / 16 registers. float32
// rows load as they are. bfloat16 rows load 32 elements at a time and split
// into the even and the odd ones (a bfloat16 is float32's upper half: two
// ops for 32 elements, exact); queries and outputs take the same order
// (row_order_query, natural_order_out), and sums over d do not care.
template <int D>
inline void load_row(const float* p, __m512 (&r)[D / 16]) {
  for (int c = 0; c < D / 16; ++c) r[c] = _mm512_loadu_ps(p + c * 16);
}
template <int D>
inline void load_row(const c10::BFloat16* p, __m512 (&r)[D / 16]) {
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int c = 0; c < D / 16; c += 2) {
    const __m512i x = _mm512_loadu_si512(p + c * 16);
    r[c] = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
    r[c + 1] = _mm512_castsi512_ps(_mm512_and_si512(x, high));
  }
}

// int8 rows: 16 values at a time sign-extended and converted (exact), in
// their natural order; the row's scale is applied by the caller.
template <int D>
inline void load_row(const int8_t* p, __m512 (&r)[D / 16]) {
  for (int c = 0; c < D / 16; ++c)
    r[c] = _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + c * 16))));
}

template <typename T, int D>
inline void row_order_query(const float* q, float scale, __m512 (&r)[D / 16]) {
  const __m512 s = _mm512_set1_ps(scale);
  for (int c = 0; c < D / 16; ++c) r[c] = _mm512_mul_ps(_mm512_loadu_ps(q + c * 16), s);
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i odd = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
    for (int c = 0; c < D / 16; c += 2) {
      const __m512 a = r[c], b = r[c + 1];
      r[c] = _mm512_permutex2var_ps(a, even, b);
      r[c + 1] = _mm512_permutex2var_ps(a, odd, b);
    }
  }
}

template <typename T, int D>
inline void natural_order_out(float* o, __m512 (&acc)[D / 16], float scale) {
  const __m512 s = _mm512_set1_ps(scale);
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const __m512i lo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i hi =
        _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
    for (int c = 0; c < D / 16; c += 2) {
      const __m512 even = acc[c], odd = acc[c + 1];
      acc[c] = _mm512_permutex2var_ps(even, lo, odd);
      acc[c + 1] = _mm512_permutex2var_ps(even, hi, odd);
    }
  }
  for (int c = 0; c < D / 16; ++c) _mm512_storeu_ps(o + c * 16, _mm512_mul_ps(acc[c], s));
}

template <typename T>
struct HeadTask {
  const float* q;  // the group's first query head
  int64_t q_s1;
  float* out;
  int64_t o_s1;
  const T* k;  // this KV head's slice of block 0 of the K (and V) cache
  const T* v;
  const int32_t* blocks;  // the block-table row from the first block read
  // Context positions from blocks[0]'s first, and how many of blocks[0]'s
  // rows precede the first key attended (a sliding window's start).
  int64_t len, skip;
  int64_t block_size, block_elems, row;
  float scale;
};

// q . k as 16 partial sums (two FMA chains).
template <int C>
inline __m512 partial_dot(const __m512 (&q)[C], const __m512 (&k)[C]) {
  __m512 even = _mm512_mul_ps(q[0], k[0]);
  __m512 odd = _mm512_setzero_ps();
  for (int c = 1; c < C; c += 2) {
    odd = _mm512_fmadd_ps(q[c], k[c], odd);
    if (c + 1 < C) even = _mm512_fmadd_ps(q[c + 1], k[c + 1], even);
  }
  return _mm512_add_ps(even, odd);
}

// 16 keys' partial sums -> one vector of their 16 dot products, without a
// horizontal sum per key. pairs[p] holds keys 2p, 2p + 1 folded once
// (shuffle_f32x4 0x44 / 0xEE, added): 128-bit chunks 0-1 key 2p, 2-3 key
// 2p + 1. Three more fold levels leave key 4m + k in lane 4k + m; one
// permute puts key j in lane j.
inline __m512 fold_pair(__m512 a, __m512 b) {
  return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
}
inline __m512 sixteen_dots(const __m512 (&pairs)[8]) {
  __m512 quads[4];
  for (int i = 0; i < 4; ++i)
    quads[i] = _mm512_add_ps(_mm512_shuffle_f32x4(pairs[2 * i], pairs[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(pairs[2 * i], pairs[2 * i + 1], 0xDD));
  __m512 halves[2];
  for (int i = 0; i < 2; ++i)
    halves[i] = _mm512_add_ps(_mm512_shuffle_ps(quads[2 * i], quads[2 * i + 1], 0x44),
                              _mm512_shuffle_ps(quads[2 * i], quads[2 * i + 1], 0xEE));
  const __m512 folded = _mm512_add_ps(_mm512_shuffle_ps(halves[0], halves[1], 0x88),
                                      _mm512_shuffle_ps(halves[0], halves[1], 0xDD));
  const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
  return _mm512_permutexvar_ps(order, folded);
}

#if defined(__AVX512VNNI__)
// The G query heads of a group, quantized for integer scores over an int8
// cache: per head, q * softmax scale = bytes * scale (round to nearest even,
// scale = max|q| / 127). vpdpbusd multiplies unsigned by signed bytes, so
// keys are read as k + 128 (k ^ 0x80) and `bias` takes 128 * sum(q) back
// out: both exact in int32 (|sum| < 2^18 for D <= 128).
template <int D, int G>
struct Int8Query {
  static constexpr int C = D / 64;  // 64-byte chunks of a row
  __m512i bytes[G][C];
  __m512i bias[G];  // per lane: -128 * (the 4 query bytes it sums)
  float scale[G];
};

template <int D, int G>
inline void quantize_query(const float* q, int64_t q_s1, float softmax_scale,
                           Int8Query<D, G>& out) {
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int g = 0; g < G; ++g) {
    __m512 x[D / 16];
    __m512 amax = _mm512_setzero_ps();
    const __m512 s = _mm512_set1_ps(softmax_scale);
    for (int c = 0; c < D / 16; ++c) {
      x[c] = _mm512_mul_ps(_mm512_loadu_ps(q + g * q_s1 + c * 16), s);
      amax = _mm512_max_ps(amax, _mm512_abs_ps(x[c]));
    }
    const float m = _mm512_reduce_max_ps(amax);
    out.scale[g] = m / 127.f;
    const __m512 inv = _mm512_set1_ps(m > 0.f ? 127.f / m : 0.f);
    __m512i bias = _mm512_setzero_si512();
    for (int c = 0; c < Int8Query<D, G>::C; ++c) {
      alignas(64) int8_t b[64];
      for (int i = 0; i < 4; ++i)
        _mm_store_si128(reinterpret_cast<__m128i*>(b + 16 * i),
                        _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(x[4 * c + i], inv))));
      out.bytes[g][c] = _mm512_load_si512(b);
      bias = _mm512_dpbusd_epi32(bias, flip, out.bytes[g][c]);
    }
    out.bias[g] = _mm512_sub_epi32(_mm512_setzero_si512(), bias);
  }
}

// One key row's integer dot product with head g, as 16 float partial sums.
template <int D, int G>
inline __m512 int8_partial_dot(const Int8Query<D, G>& q, int g, const int8_t* k) {
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512i acc = q.bias[g];
  for (int c = 0; c < Int8Query<D, G>::C; ++c)
    acc = _mm512_dpbusd_epi32(acc, _mm512_xor_si512(_mm512_loadu_si512(k + 64 * c), flip),
                              q.bytes[g][c]);
  return _mm512_cvtepi32_ps(acc);
}

// score_keys for an int8 cache on VNNI: the scores are the integer dot
// products times the query head's scale and each key's row scale.
template <int D, int G>
inline void score_keys_int8(const Int8Query<D, G>& q, const int8_t* first, int64_t row, int n,
                            float* scores, int64_t len, int64_t at, __m512 (&top)[G]) {
  __m512 pairs[G][8];
  for (int p = 0; p < 8; ++p) {
    const int8_t* k0 = first + std::min(2 * p, n - 1) * row;
    const int8_t* k1 = first + std::min(2 * p + 1, n - 1) * row;
    for (int g = 0; g < G; ++g)
      pairs[g][p] = fold_pair(int8_partial_dot(q, g, k0), int8_partial_dot(q, g, k1));
  }
  alignas(64) float key_scales[16];
  for (int i = 0; i < 16; ++i) key_scales[i] = row_scale<D>(first + std::min(i, n - 1) * row);
  const __m512 sv = _mm512_load_ps(key_scales);
  const __mmask16 live = static_cast<__mmask16>((1u << n) - 1);
  for (int g = 0; g < G; ++g) {
    const __m512 dots =
        _mm512_mul_ps(sixteen_dots(pairs[g]), _mm512_mul_ps(sv, _mm512_set1_ps(q.scale[g])));
    _mm512_mask_storeu_ps(scores + g * len + at, live, dots);
    top[g] = _mm512_mask_max_ps(top[g], live, top[g], dots);
  }
}
#endif

// Scores of keys first..first+n-1 (n <= 16, rows `row` apart) for the G heads
// into scores[g * len + at ...], and into top[g] (lane-wise) their running
// maximum, which the softmax needs. Rows past n repeat the last (read,
// unused).
template <int D, int G, typename T>
inline void score_keys(const __m512 (&q)[G][D / 16], const T* first, int64_t row, int n,
                       float* scores, int64_t len, int64_t at, __m512 (&top)[G]) {
  constexpr int C = D / 16;
  __m512 pairs[G][8];
  for (int p = 0; p < 8; ++p) {
    __m512 k0[C], k1[C];
    load_row<D>(first + std::min(2 * p, n - 1) * row, k0);
    load_row<D>(first + std::min(2 * p + 1, n - 1) * row, k1);
    for (int g = 0; g < G; ++g) pairs[g][p] = fold_pair(partial_dot(q[g], k0), partial_dot(q[g], k1));
  }
  const __mmask16 live = static_cast<__mmask16>((1u << n) - 1);
  if constexpr (std::is_same_v<T, int8_t>) {
    // Each key's dot product times its row's scale: one multiply per key.
    alignas(64) float key_scales[16];
    for (int i = 0; i < 16; ++i) key_scales[i] = row_scale<D>(first + std::min(i, n - 1) * row);
    const __m512 sv = _mm512_load_ps(key_scales);
    for (int g = 0; g < G; ++g) {
      const __m512 dots = _mm512_mul_ps(sixteen_dots(pairs[g]), sv);
      _mm512_mask_storeu_ps(scores + g * len + at, live, dots);
      top[g] = _mm512_mask_max_ps(top[g], live, top[g], dots);
    }
  } else {
    for (int g = 0; g < G; ++g) {
      const __m512 dots = sixteen_dots(pairs[g]);
      _mm512_mask_storeu_ps(scores + g * len + at, live, dots);
      top[g] = _mm512_mask_max_ps(top[g], live, top[g], dots);
    }
  }
}

// Softmax numerators in place over one head's n scores, whose maximum is
// top's largest lane: exp(s - max) 16 at a time (exp_ps, silu.h), the last
// vector masked. Returns 1 / their sum. (Written out because GCC compiles
// `omp simd reduction(max)` into a serial scalar loop, a dependency chain
// that cost 29% of the kernel, and calls libmvec's 8-lane expf.)
inline float softmax_numerators(float* __restrict sc, int64_t n, __m512 top) {
  const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(top));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 live = n - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - i)) - 1);
    const __m512 e = exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, sc + i), m));
    _mm512_mask_storeu_ps(sc + i, live, e);
    sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(live, e));
  }
  return 1.f / _mm512_reduce_add_ps(sum);
}

// The weight of a V row's values: the key's probability, times the row's
// scale for an int8 cache.
template <int D, typename T>
inline float value_weight(float p, const T* row) {
  if constexpr (std::is_same_v<T, int8_t>) return p * row_scale<D>(row);
  return p;
}

// How many blocks ahead of the one in use to prefetch (2 and 4 measured
// alike, 1 and 3 slower).
constexpr int64_t kAhead = 4;

#if defined(__AVX512VNNI__)
// Pass 2 for an int8 cache on VNNI: the weighted sum of V rows in integers.
// Per group of 16 keys and head, the weights w = p * (the row's scale) are
// rounded to int16 against the group's largest (w * 32767 / max w), and
// vpdpwssd adds two keys' w * v products into each int32 lane: V rows are
// widened to int16 once for all G heads, never to float. Each group's sums
// (|sum| < 16 * 32767 * 127 < 2^31) go to float32 with its scale. The int32
// lanes hold d in the unpack order (lo: 32c + 8l + j, hi: 32c + 8l + 4 + j
// in lane 4l + j of chunk c); the output is written in natural order.
template <int D, int G>
void int8_value_pass(const HeadTask<int8_t>& t, const float* scores, int64_t keys,
                     const float (&inv_sum)[G]) {
  constexpr int C = D / 16;  // int32 registers per head: D / 32 chunks x (lo, hi)
  const int64_t len = t.len, BS = t.block_size, skip = t.skip, row = t.row;
  const int64_t num_blocks = (len + BS - 1) / BS;
  __m512 out[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) out[g][c] = _mm512_setzero_ps();
  for (int64_t b = 0; b < num_blocks; ++b) {
    const int64_t start = b * BS, n = std::min(BS, len - start);
    const int8_t* vb = t.v + t.blocks[b] * t.block_elems;
    if (b + kAhead < num_blocks)
      prefetch_rows<D>(t.v + t.blocks[b + kAhead] * t.block_elems, BS, row);
    for (int64_t i0 = b == 0 ? skip : 0; i0 < n; i0 += 16) {
      const int count = static_cast<int>(std::min<int64_t>(16, n - i0));
      const int8_t* first = vb + i0 * row;
      const __mmask16 live = static_cast<__mmask16>((1u << count) - 1);
      alignas(64) float row_scales[16] = {};
      for (int j = 0; j < count; ++j) row_scales[j] = row_scale<D>(first + j * row);
      const __m512 vscale = _mm512_load_ps(row_scales);
      alignas(64) int32_t pairs[G][8];  // int16 weights of keys 2p, 2p + 1
      float step[G];
      for (int g = 0; g < G; ++g) {
        const __m512 w =
            _mm512_mul_ps(_mm512_maskz_loadu_ps(live, scores + g * keys + start + i0 - skip), vscale);
        const float w_max = _mm512_reduce_max_ps(w);
        step[g] = w_max / 32767.f;
        const __m512 to_int = _mm512_set1_ps(w_max > 0.f ? 32767.f / w_max : 0.f);
        _mm256_store_si256(reinterpret_cast<__m256i*>(pairs[g]),
                           _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(w, to_int))));
      }
      __m512i sums[G][C];
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < C; ++c) sums[g][c] = _mm512_setzero_si512();
      for (int p = 0; 2 * p < count; ++p) {
        const int8_t* r0 = first + 2 * p * row;
        const int8_t* r1 = first + std::min(2 * p + 1, count - 1) * row;  // weight 0 past count
        __m512i w[G];
        for (int g = 0; g < G; ++g) w[g] = _mm512_set1_epi32(pairs[g][p]);
        for (int c = 0; c < D / 32; ++c) {
          const __m512i a =
              _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r0 + 32 * c)));
          const __m512i e =
              _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r1 + 32 * c)));
          const __m512i lo = _mm512_unpacklo_epi16(a, e), hi = _mm512_unpackhi_epi16(a, e);
          for (int g = 0; g < G; ++g) {
            sums[g][2 * c] = _mm512_dpwssd_epi32(sums[g][2 * c], lo, w[g]);
            sums[g][2 * c + 1] = _mm512_dpwssd_epi32(sums[g][2 * c + 1], hi, w[g]);
          }
        }
      }
      for (int g = 0; g < G; ++g) {
        const __m512 s = _mm512_set1_ps(step[g]);
        for (int c = 0; c < C; ++c)
          out[g][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[g][c]), s, out[g][c]);
      }
    }
  }
  for (int g = 0; g < G; ++g) {
    alignas(64) float lanes[D];
    for (int c = 0; c < C; ++c) _mm512_store_ps(lanes + 16 * c, out[g][c]);
    float* o = t.out + g * t.o_s1;
    for (int c = 0; c < D / 32; ++c)
      for (int l = 0; l < 4; ++l)
        for (int j = 0; j < 4; ++j) {
          o[32 * c + 8 * l + j] = lanes[32 * c + 4 * l + j] * inv_sum[g];
          o[32 * c + 8 * l + 4 + j] = lanes[32 * c + 16 + 4 * l + j] * inv_sum[g];
        }
  }
}
#endif

// One (sequence, KV head): the G query heads of its group over its context
// (keys t.skip .. t.len - 1 of the task's blocks). `scores` holds G * keys
// floats, key i of the context at scores[g * keys + i - t.skip].
template <int D, int G, typename T>
void attend_group(const HeadTask<T>& t, float* __restrict scores) {
  constexpr int C = D / 16;  // 16-float registers per head row
  const int64_t len = t.len, BS = t.block_size, skip = t.skip;
  const int64_t keys = len - skip;
  const int64_t num_blocks = (len + BS - 1) / BS;
  __m512 qr[G][C];
#if defined(__AVX512VNNI__)
  constexpr bool integer_scores = std::is_same_v<T, int8_t>;
  Int8Query<D, G> q8;
  if constexpr (integer_scores) quantize_query<D, G>(t.q, t.q_s1, t.scale, q8);
  else
#endif
    for (int g = 0; g < G; ++g) row_order_query<T, D>(t.q + g * t.q_s1, t.scale, qr[g]);
  // Pass 1: every score, 16 keys at a time.
  __m512 top[G];
  for (int g = 0; g < G; ++g) top[g] = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t b = 0; b < std::min<int64_t>(kAhead, num_blocks); ++b)
    prefetch_rows<D>(t.k + t.blocks[b] * t.block_elems, BS, t.row);
  for (int64_t b = 0; b < num_blocks; ++b) {
    const int64_t start = b * BS, n = std::min(BS, len - start);
    const T* kb = t.k + t.blocks[b] * t.block_elems;
    const int64_t ahead = b + kAhead;
    if (ahead < num_blocks)
      prefetch_rows<D>(t.k + t.blocks[ahead] * t.block_elems, BS, t.row);
    else if (ahead - num_blocks < num_blocks)
      prefetch_rows<D>(t.v + t.blocks[ahead - num_blocks] * t.block_elems, BS, t.row);
    for (int64_t i = b == 0 ? skip : 0; i < n; i += 16) {
      const int count = static_cast<int>(std::min<int64_t>(16, n - i));
#if defined(__AVX512VNNI__)
      if constexpr (integer_scores) {
        score_keys_int8<D, G>(q8, kb + i * t.row, t.row, count, scores, keys, start + i - skip,
                              top);
        continue;
      }
#endif
      score_keys<D, G, T>(qr, kb + i * t.row, t.row, count, scores, keys, start + i - skip, top);
    }
  }
  // Softmax per head over the keys attended.
  float inv_sum[G];
  for (int g = 0; g < G; ++g) inv_sum[g] = softmax_numerators(scores + g * keys, keys, top[g]);
  // Pass 2: the probability-weighted sum of V rows.
#if defined(__AVX512VNNI__)
  if constexpr (integer_scores) {
    int8_value_pass<D, G>(t, scores, keys, inv_sum);
    return;
  }
#endif
  __m512 acc[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) acc[g][c] = _mm512_setzero_ps();
  for (int64_t b = 0; b < num_blocks; ++b) {
    const int64_t start = b * BS, n = std::min(BS, len - start);
    const T* vb = t.v + t.blocks[b] * t.block_elems;
    if (b + kAhead < num_blocks)
      prefetch_rows<D>(t.v + t.blocks[b + kAhead] * t.block_elems, BS, t.row);
    for (int64_t i = b == 0 ? skip : 0; i < n; ++i) {
      __m512 vr[C];
      const T* v_row = vb + i * t.row;
      load_row<D>(v_row, vr);
      for (int g = 0; g < G; ++g) {
        const __m512 p =
            _mm512_set1_ps(value_weight<D>(scores[g * keys + start + i - skip], v_row));
        for (int c = 0; c < C; ++c) acc[g][c] = _mm512_fmadd_ps(p, vr[c], acc[g][c]);
      }
    }
  }
  for (int g = 0; g < G; ++g) natural_order_out<T, D>(t.out + g * t.o_s1, acc[g], inv_sum[g]);
}

template <int D, int G, typename T>
void decode_attention_avx512(at::Tensor out, at::Tensor query, at::Tensor kv_cache,
                             at::Tensor block_table, at::Tensor seq_lens, double scale,
                             int64_t window) {
  const int64_t S = query.size(0);
  const tandem_kv::Layout L = tandem_kv::layout_of(kv_cache, "decode_attention");
  const int64_t BS = L.block_size, HKV = L.heads;
  const float* q_base = query.data_ptr<float>();
  const T* k_base = static_cast<const T*>(kv_cache.data_ptr());
  const T* v_base = k_base + L.v_offset;
  const int32_t* bt = block_table.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  float* o_base = out.data_ptr<float>();
  int64_t max_keys = 0;  // scores per head of the longest task
  for (int64_t s = 0; s < S; ++s)
    max_keys = std::max<int64_t>(max_keys, lens[s] - window_start(lens[s], window));
  // Longest sequences first, handed out one task at a time: contexts differ
  // in length, and two threads splitting the tasks in halves waited on
  // each other.
  std::vector<int64_t> order(S);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return lens[a] > lens[b]; });
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), S * HKV);
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    std::vector<float> scores(G * std::max<int64_t>(max_keys, 1));
    for (int64_t task = next++; task < S * HKV; task = next++) {
      const int64_t s = order[task / HKV], h = task % HKV;
      if (lens[s] <= 0) {  // nothing to attend to: zeros, as the generic path gives
        for (int64_t g = 0; g < G; ++g)
          std::fill_n(o_base + s * out.stride(0) + (h * G + g) * out.stride(1), D, 0.f);
        continue;
      }
      const int64_t first = window_start(lens[s], window), first_block = first / BS;
      const HeadTask<T> t{q_base + s * query.stride(0) + h * G * query.stride(1),
                       query.stride(1),
                       o_base + s * out.stride(0) + h * G * out.stride(1),
                       out.stride(1),
                       k_base + h * L.head_stride,
                       v_base + h * L.head_stride,
                       bt + s * block_table.stride(0) + first_block,
                       lens[s] - first_block * BS,
                       first - first_block * BS,
                       BS,
                       L.block_stride,
                       L.token_stride,
                       static_cast<float>(scale)};
      attend_group<D, G, T>(t, scores.data());
    }
  });
}

using DecodeFn = void (*)(at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, double,
                          int64_t);

template <int D, typename T>
DecodeFn avx512_for_group(int64_t group) {
  switch (group) {
    case 1: return decode_attention_avx512<D, 1, T>;
    case 2: return decode_attention_avx512<D, 2, T>;
    case 3: return decode_attention_avx512<D, 3, T>;
    case 4: return decode_attention_avx512<D, 4, T>;
    case 5: return decode_attention_avx512<D, 5, T>;
    case 6: return decode_attention_avx512<D, 6, T>;
    case 7: return decode_attention_avx512<D, 7, T>;
    case 8: return decode_attention_avx512<D, 8, T>;
    default: return nullptr;
  }
}

template <typename T>
DecodeFn avx512_for(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& out) {
  if (query.stride(2) != 1 || out.stride(2) != 1) return nullptr;
  const int64_t group = query.size(1) / kv_cache.size(3);
  if (query.size(2) == 64) return avx512_for_group<64, T>(group);
  if (query.size(2) == 128) return avx512_for_group<128, T>(group);
  if (query.size(2) == 256) return avx512_for_group<256, T>(group);
  return nullptr;
}

}  // namespace
#endif

namespace {

template <typename T>
void decode_attention_portable(at::Tensor out, at::Tensor query, at::Tensor kv_cache,
                               at::Tensor block_table, at::Tensor seq_lens, double scale,
                               int64_t window) {
  switch (query.size(2)) {
    case 64:
      return decode_attention_d<64, T>(out, query, kv_cache, block_table, seq_lens, scale, window);
    case 128:
      return decode_attention_d<128, T>(out, query, kv_cache, block_table, seq_lens, scale, window);
    case 256:
      return decode_attention_d<256, T>(out, query, kv_cache, block_table, seq_lens, scale, window);
    default:
      TORCH_CHECK(false, "decode_attention: head_dim ", query.size(2), " is not 64, 128 or 256");
  }
}

}  // namespace

namespace {

template <typename T>
void decode_attention_typed(at::Tensor out, at::Tensor query, at::Tensor kv_cache,
                            at::Tensor block_table, at::Tensor seq_lens, double scale,
                            int64_t window) {
#if defined(__AVX512F__)
  const DecodeFn fast = avx512_for<T>(query, kv_cache, out);
  if (fast != nullptr) return fast(out, query, kv_cache, block_table, seq_lens, scale, window);
#endif
  decode_attention_portable<T>(out, query, kv_cache, block_table, seq_lens, scale, window);
}

}  // namespace

bool decode_int8_quantizes_query(int64_t head_dim, int64_t group) {
#if defined(__AVX512VNNI__)
  // The AVX-512 path's shapes (avx512_for); the portable one reads floats.
  return (head_dim == 64 || head_dim == 128 || head_dim == 256) && group >= 1 && group <= 8;
#else
  (void)head_dim;
  (void)group;
  return false;
#endif
}

void decode_attention(at::Tensor out, at::Tensor query, at::Tensor kv_cache,
                      at::Tensor block_table, at::Tensor seq_lens, double scale,
                      int64_t window) {
  TORCH_CHECK(query.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat,
              "decode_attention: query and out must be float32");
  TORCH_CHECK(window >= 0, "decode_attention: window must be >= 0 (0: none), got ", window);
  const auto dtype = kv_cache.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kChar,
              "decode_attention: kv_cache must be float32, bfloat16 or int8");
  const int64_t row = dtype == at::kChar ? tandem_kv_int8::row_elems(query.size(2)) : query.size(2);
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(4) == row,
              "decode_attention: cache rows of ", kv_cache.size(-1), " elements for head_dim ",
              query.size(2), " (expected ", row, ")");
  if (dtype == at::kBFloat16)
    return decode_attention_typed<c10::BFloat16>(out, query, kv_cache, block_table, seq_lens,
                                                 scale, window);
  if (dtype == at::kChar)
    return decode_attention_typed<int8_t>(out, query, kv_cache, block_table, seq_lens, scale,
                                          window);
  decode_attention_typed<float>(out, query, kv_cache, block_table, seq_lens, scale, window);
}
