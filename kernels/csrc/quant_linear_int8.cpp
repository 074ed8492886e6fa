// quant_linear with int8 activations, as llama.cpp computes Q4/Q8 weights:
// each input row is quantized on the fly in blocks of 32 (dx = absmax / 127)
// and each (row, weight block) pair is one integer dot product and one
// float multiply-add:
//
//   y[m, n] = sum_b  dw[n, b] * dx[m, b] * sum_k qw[n, k] qx[m, k]
//                  + mw[n, b] * sx[m, b]            sx = dx * sum_k qx[m, k]
//
// About 4x fewer instructions a weight than the float path, at the cost of
// the activations' rounding (up to absmax / 254 per input): on the default
// model that moves logits by ~0.1 on average, enough to change greedy
// choices within a few dozen tokens, so it is opt-in (kernels/quant.py).
// AVX2: maddubs (u8 x s8 pairs into s16); AVX-512 VNNI (in 256-bit
// vectors): vpdpbusd; portable: the same sums in C++.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>

#include "quant_int8_rows.h"
#include "quant_tiles.h"
#include "silu.h"

namespace tandem_quant {
namespace {

// Rows per pass over a task's tiles (kept in L2 meanwhile).
constexpr int64_t kRowChunk = 64;

// Room that grows to the largest call and is then reused, its contents
// left as they are (every element is written before it is read): a decode
// step makes ~120 calls, and fresh zeroed vectors for each took ~7% of the
// step on the calling thread (memset and page faults) while the other
// thread waited.
template <typename T>
class Reused {
 public:
  T* take(int64_t n) {
    if (n > capacity_) {
      data_.reset(new T[n]);  // default-initialized: not zeroed
      capacity_ = n;
    }
    return data_.get();
  }

 private:
  std::unique_ptr<T[]> data_;
  int64_t capacity_ = 0;
};

// One set per calling thread, so concurrent callers never share one.
struct RowArena {
  Reused<int8_t> q;
  Reused<float> scales;  // d then s
  Reused<int32_t> qsum;  // qsum, then qsum_lo
};

// One block of n (1..32) inputs: q[0..31] (zero past n), d = absmax / 127,
// s = d * sum q, qsum = sum q, qsum_lo = the sum of q[0..15].
void quantize_block(const float* x, int64_t n, int8_t* q, float& d, float& s, int32_t& qsum,
                    int32_t& qsum_lo) {
  float amax = 0.f;
  for (int64_t k = 0; k < n; ++k) amax = std::max(amax, std::fabs(x[k]));
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  int sum = 0;
  for (int64_t k = 0; k < kBlock; ++k) {
    const int v = k < n ? static_cast<int>(std::nearbyint(x[k] * inv)) : 0;
    q[k] = static_cast<int8_t>(v);
    sum += v;
    if (k == kBlock / 2 - 1) qsum_lo = sum;
  }
  d = amax / 127.f;
  s = d * static_cast<float>(sum);
  qsum = sum;
}

#ifdef TANDEM_QUANT_AVX512
// quantize_block for a whole block, 16 inputs a vector: the same values
// (cvtps2dq rounds half to even, as nearbyint does).
void quantize_block_avx512(const float* x, int8_t* q, float& d, float& s, int32_t& qsum,
                           int32_t& qsum_lo) {
  const __m512 lo = _mm512_loadu_ps(x), hi = _mm512_loadu_ps(x + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
  const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
  const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inv));
  const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inv));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(qlo));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtsepi32_epi8(qhi));
  const int sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
  d = amax / 127.f;
  s = d * static_cast<float>(sum);
  qsum = sum;
  qsum_lo = _mm512_reduce_add_epi32(qlo);
}
#endif

// Where row m's K inputs come from: x's row itself or, for the MLP's down
// projection, silu(gate) * up of a gate_up row [gate | up] (each K wide),
// computed a row at a time into a buffer that stays in L1 as it is
// quantized: the activation is never written to memory and read back.
// (Block by block instead, each block's exp, division and reductions form
// one dependent chain, and the fused path took 1.6x as long on one thread.)
struct RowSource {
  const float* x;
  int64_t stride, K;
  bool silu;
};

void quantize_row(const RowSource& src, int64_t m, int64_t nb, Isa isa, int8_t* q, float* d,
                  float* s, int32_t* qsum, int32_t* qsum_lo) {
  const float* x = src.x + m * src.stride;
  if (src.silu) {
    thread_local Reused<float> act;
    float* row = act.take(src.K);
    silu_times_n(x, x + src.K, row, src.K);
    x = row;
  }
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t k0 = b * kBlock, n = std::min(kBlock, src.K - k0);
#ifdef TANDEM_QUANT_AVX512
    if (isa >= Isa::Avx512 && n == kBlock) {
      quantize_block_avx512(x + k0, q + k0, d[b], s[b], qsum[b], qsum_lo[b]);
      continue;
    }
#endif
    quantize_block(x + k0, n, q + k0, d[b], s[b], qsum[b], qsum_lo[b]);
  }
  (void)isa;
}

QuantizedRows quantize_rows(const RowSource& src, int64_t M, int64_t nb, Isa isa) {
  thread_local RowArena arena;
  // For the AMX kernel, whole tiles of rows, the rows past M zeros (only
  // there: a decode call of one row would otherwise clear 31 more).
  int64_t padded = M;
#ifdef TANDEM_QUANT_AMX
  if (isa == Isa::Amx && M >= kAmxMinRows)
    padded = (M + kAmxPadRows - 1) / kAmxPadRows * kAmxPadRows;
#endif
  int8_t* q = arena.q.take(padded * nb * kBlock);
  std::memset(q + M * nb * kBlock, 0, (padded - M) * nb * kBlock);
  float* d = arena.scales.take(2 * padded * nb);
  float* s = d + padded * nb;
  std::fill(d + M * nb, d + padded * nb, 0.f);
  std::fill(s + M * nb, s + padded * nb, 0.f);
  int32_t* qsum = arena.qsum.take(2 * M * nb);
  int32_t* qsum_lo = qsum + M * nb;
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m)
      quantize_row(src, m, nb, isa, q + m * nb * kBlock, d + m * nb, s + m * nb, qsum + m * nb,
                   qsum_lo + m * nb);
  });
  return QuantizedRows{q, d, s, qsum, qsum_lo, nb};
}

template <Kind K>
void tiles_portable(const uint8_t* base, int64_t nb, const QuantizedRows& x, int64_t t0,
                    int64_t t1, int64_t M, const OutTile& o) {
  constexpr int64_t bytes = tile_block_bytes(K);
  float acc[kTile];
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t m = 0; m < M; ++m) {
      const int8_t* qx = x.q + m * nb * kBlock;
      std::fill(acc, acc + kTile, 0.f);
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = base + (t * nb + b) * bytes;
        const float dx = x.d[m * nb + b], sx = x.s[m * nb + b];
        for (int64_t j = 0; j < kTile; ++j) {
          if constexpr (K == Kind::Q8H) {  // a scale per half block
            const float* dw = reinterpret_cast<const float*>(blk + scales_offset(K));
            for (int64_t h = 0; h < 2; ++h) {
              int dot = 0;
              for (int64_t k = 16 * h; k < 16 * h + 16; ++k)
                dot += tile_q(blk, K, j, k) * qx[b * kBlock + k];
              acc[j] = std::fma(static_cast<float>(dot), dw[h * kTile + j] * dx, acc[j]);
            }
            continue;
          }
          int dot = 0;
          for (int64_t k = 0; k < kBlock; ++k) dot += tile_q(blk, K, j, k) * qx[b * kBlock + k];
          acc[j] = std::fma(static_cast<float>(dot), tile_d(blk, K, j) * dx, acc[j]);
          if (is_q4(K)) acc[j] = std::fma(tile_m(blk, K, j), sx, acc[j]);
        }
      }
      o.store(m, t, acc);
    }
}

#ifdef TANDEM_QUANT_AVX2

inline __m256i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// With only one or two rows, VNNI's chain of eight dependent vpdpbusd a
// block would bound the speed: split it in two (integer sums: same result).
template <int MR>
constexpr bool kSplitDots = MR <= 2;

// One block of one tile: its 8 outputs' integer dot products with MR rows,
// two ways. Avx2 (maddubs: u8 x s8 pairs into s16, then madd into s32)
// and, where the CPU has AVX-512 VNNI, vpdpbusd (4 u8 x s8 products added
// into each s32 lane: one instruction for AVX2's two or three). Both take
// the weights as the unsigned side.
//
// Q8H (a scale per half block) sums each half apart: dot takes k 0-15 and
// dot_hi k 16-31 (unused for the other kinds), and VNNI's offsets are the
// halves' own: offset for the low half (or the whole block), offset_hi.
template <Kind K, bool Vnni, int MR>
inline void block_dots(__m256i (&dot)[MR], __m256i (&dot_hi)[MR], const uint8_t* blk,
                       const int8_t* const* qx, const int32_t* offset, const int32_t* offset_hi) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  __m256i dot2[MR];
  for (int m = 0; m < MR; ++m) dot2[m] = _mm256_setzero_si256();
  if constexpr (is_q4(K)) {
    for (int m = 0; m < MR; ++m) dot[m] = _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + c * 32));
      const __m256i lo = _mm256_and_si256(raw, low4);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
      for (int m = 0; m < MR; ++m) {
        const __m256i xl = broadcast4(qx[m] + 4 * c), xh = broadcast4(qx[m] + 16 + 4 * c);
#ifdef TANDEM_QUANT_AVX512
        if constexpr (Vnni) {
          dot[m] = _mm256_dpbusd_epi32(dot[m], lo, xl);
          __m256i& into = kSplitDots<MR> ? dot2[m] : dot[m];
          into = _mm256_dpbusd_epi32(into, hi, xh);
          continue;
        }
#endif
        // s16 sums: 8 groups x 2 x 15 x 127 = 30480 fits, so one madd a block.
        dot[m] = _mm256_add_epi16(dot[m], _mm256_maddubs_epi16(lo, xl));
        dot[m] = _mm256_add_epi16(dot[m], _mm256_maddubs_epi16(hi, xh));
      }
    }
    if constexpr (!Vnni) {
      const __m256i ones = _mm256_set1_epi16(1);
      for (int m = 0; m < MR; ++m) dot[m] = _mm256_madd_epi16(dot[m], ones);
    }
  } else {
    // Signed weights. VNNI: w + 128 (w ^ 0x80) is unsigned, and the sums
    // start at -128 * sum qx to take it back out. AVX2: |w| times x with
    // w's sign.
    constexpr bool halves = K == Kind::Q8H;
    for (int m = 0; m < MR; ++m) {
      dot[m] = Vnni ? _mm256_set1_epi32(offset[m]) : _mm256_setzero_si256();
      if constexpr (halves) dot_hi[m] = Vnni ? _mm256_set1_epi32(offset_hi[m]) : _mm256_setzero_si256();
    }
    const __m256i ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8(static_cast<char>(0x80));
    for (int g = 0; g < 8; ++g) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + g * 32));
      const __m256i aw = Vnni ? _mm256_xor_si256(w, flip) : _mm256_sign_epi8(w, w);
      for (int m = 0; m < MR; ++m) {
        const __m256i xb = broadcast4(qx[m] + 4 * g);
#ifdef TANDEM_QUANT_AVX512
        if constexpr (Vnni) {
          __m256i& into = halves ? (g < 4 ? dot[m] : dot_hi[m])
                                 : (kSplitDots<MR> && g % 2 ? dot2[m] : dot[m]);
          into = _mm256_dpbusd_epi32(into, aw, xb);
          continue;
        }
#endif
        const __m256i p = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(xb, w));
        __m256i& into = halves && g >= 4 ? dot_hi[m] : dot[m];
        into = _mm256_add_epi32(into, _mm256_madd_epi16(p, ones));
      }
    }
  }
  if constexpr (Vnni && kSplitDots<MR> && K != Kind::Q8H)
    for (int m = 0; m < MR; ++m) dot[m] = _mm256_add_epi32(dot[m], dot2[m]);
}

// A tile block's 8 scales: dw (which 0) or mw (1), float16 or, in Q4F,
// float32; in Q8H (float32) the low half's dw (0) or the high half's (1).
template <Kind K>
inline __m256 eight_scales(const uint8_t* scales, int which) {
  if constexpr (float_scales(K))
    return _mm256_loadu_ps(reinterpret_cast<const float*>(scales) + which * kTile);
  return _mm256_cvtph_ps(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + which * kTile * 2)));
}

// MR input rows x tile t; acc[m]: the tile's 8 outputs for row m. One tile
// at a time: its blocks are one run of memory, which the prefetchers follow
// at the memory's full speed (several tiles side by side, their blocks
// interleaved, left the 1- and 2-row decode at ~2/3 of it: benchmarks/
// JOURNAL.md, "Huge pages and one tile at a time").
template <Kind K, bool Vnni, int MR>
void micro(const uint8_t* base, int64_t nb, int64_t t, const QuantizedRows& x, int64_t m0,
           const OutTile& o) {
  constexpr int64_t bytes = tile_block_bytes(K);
  __m256 acc[MR][1];
  for (int m = 0; m < MR; ++m) acc[m][0] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = base + (t * nb + b) * bytes;
    prefetch_block(blk, nb * bytes, bytes);  // the next tile's block
    const int8_t* qx[MR];
    int32_t offset[MR], offset_hi[MR];
    for (int m = 0; m < MR; ++m) {
      const int64_t i = (m0 + m) * nb + b;
      qx[m] = x.q + i * kBlock;
      offset[m] = -128 * (K == Kind::Q8H ? x.qsum_lo[i] : x.qsum[i]);
      // Only Q8H reads its halves' sums: the other kinds' hot loop is as before.
      if constexpr (K == Kind::Q8H) offset_hi[m] = -128 * (x.qsum[i] - x.qsum_lo[i]);
    }
    __m256i dot[MR], dot_hi[MR];
    block_dots<K, Vnni, MR>(dot, dot_hi, blk, qx, offset, offset_hi);
    const uint8_t* scales = blk + scales_offset(K);
    const __m256 dw = eight_scales<K>(scales, 0);
    for (int m = 0; m < MR; ++m) {
      const __m256 scale = _mm256_mul_ps(dw, _mm256_set1_ps(x.d[(m0 + m) * nb + b]));
      acc[m][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[m]), scale, acc[m][0]);
    }
    if constexpr (K == Kind::Q8H) {
      const __m256 dw_hi = eight_scales<K>(scales, 1);
      for (int m = 0; m < MR; ++m) {
        const __m256 scale = _mm256_mul_ps(dw_hi, _mm256_set1_ps(x.d[(m0 + m) * nb + b]));
        acc[m][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_hi[m]), scale, acc[m][0]);
      }
    }
    if constexpr (is_q4(K)) {
      const __m256 mw = eight_scales<K>(scales, 1);
      for (int m = 0; m < MR; ++m)
        acc[m][0] = _mm256_fmadd_ps(mw, _mm256_set1_ps(x.s[(m0 + m) * nb + b]), acc[m][0]);
    }
  }
  o.store_all<MR, 1>(m0, t, acc);
}

#ifdef TANDEM_QUANT_AVX512
// Two tiles side by side in 512-bit vectors (tile t's 8 outputs in the low
// half, tile t + 1's in the high half) for whole chunks of 64 rows, where
// the kernel is bound by compute, not memory: each activation broadcast
// then feeds 16 outputs, half the loads and instructions a dot product of
// micro's (1.08x at 64 and 512 rows; at 8 rows, bound by reading the
// weights, 0.86x: micro's one tile at a time streams better). The same
// integer sums and float operations in the same order: results equal
// micro's bit for bit.
inline __m512i two_tiles(const uint8_t* a, const uint8_t* b) {
  const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a));
  return _mm512_inserti64x4(_mm512_castsi256_si512(lo),
                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)), 1);
}
// Two tile blocks' 8 scales each (eight_scales' `which`), a's low.
template <Kind K>
inline __m512 two_scales(const uint8_t* a, const uint8_t* b, int which) {
  return _mm512_castpd_ps(_mm512_insertf64x4(
      _mm512_castpd256_pd512(_mm256_castps_pd(eight_scales<K>(a, which))),
      _mm256_castps_pd(eight_scales<K>(b, which)), 1));
}
inline __m512i broadcast4x16(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

template <Kind K, int MR>
void micro_pair(const uint8_t* base, int64_t nb, int64_t t, const QuantizedRows& x, int64_t m0,
                const OutTile& o) {
  constexpr int64_t bytes = tile_block_bytes(K);
  const uint8_t* first = base + t * nb * bytes;  // tile t; tile t + 1 follows
  __m512 acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* b0 = first + b * bytes;
    const uint8_t* b1 = b0 + nb * bytes;
    const int8_t* qx[MR];
    for (int m = 0; m < MR; ++m) qx[m] = x.q + ((m0 + m) * nb + b) * kBlock;
    __m512i dot[MR], dot_hi[MR];
    if constexpr (is_q4(K)) {
      const __m512i low4 = _mm512_set1_epi8(0x0F);
      for (int m = 0; m < MR; ++m) dot[m] = _mm512_setzero_si512();
      for (int c = 0; c < 4; ++c) {
        const __m512i raw = two_tiles(b0 + c * 32, b1 + c * 32);
        const __m512i lo = _mm512_and_si512(raw, low4);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
        for (int m = 0; m < MR; ++m) {
          dot[m] = _mm512_dpbusd_epi32(dot[m], lo, broadcast4x16(qx[m] + 4 * c));
          dot[m] = _mm512_dpbusd_epi32(dot[m], hi, broadcast4x16(qx[m] + 16 + 4 * c));
        }
      }
    } else {
      // Signed weights as in block_dots: w + 128 unsigned, -128 * sum qx back out.
      const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
      // Q8H: the halves apart, each from its own offset (block_dots).
      constexpr bool halves = K == Kind::Q8H;
      for (int m = 0; m < MR; ++m) {
        const int64_t i = (m0 + m) * nb + b;
        dot[m] = _mm512_set1_epi32(-128 * (halves ? x.qsum_lo[i] : x.qsum[i]));
        if constexpr (halves) dot_hi[m] = _mm512_set1_epi32(-128 * (x.qsum[i] - x.qsum_lo[i]));
      }
      for (int g = 0; g < 8; ++g) {
        const __m512i w = _mm512_xor_si512(two_tiles(b0 + g * 32, b1 + g * 32), flip);
        for (int m = 0; m < MR; ++m) {
          __m512i& into = halves && g >= 4 ? dot_hi[m] : dot[m];
          into = _mm512_dpbusd_epi32(into, w, broadcast4x16(qx[m] + 4 * g));
        }
      }
    }
    const __m512 dw = two_scales<K>(b0 + scales_offset(K), b1 + scales_offset(K), 0);
    for (int m = 0; m < MR; ++m) {
      const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(x.d[(m0 + m) * nb + b]));
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[m]), scale, acc[m]);
    }
    if constexpr (K == Kind::Q8H) {
      const __m512 dw_hi = two_scales<K>(b0 + scales_offset(K), b1 + scales_offset(K), 1);
      for (int m = 0; m < MR; ++m) {
        const __m512 scale = _mm512_mul_ps(dw_hi, _mm512_set1_ps(x.d[(m0 + m) * nb + b]));
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot_hi[m]), scale, acc[m]);
      }
    }
    if constexpr (is_q4(K)) {
      const __m512 mw = two_scales<K>(b0 + scales_offset(K), b1 + scales_offset(K), 1);
      for (int m = 0; m < MR; ++m)
        acc[m] = _mm512_fmadd_ps(mw, _mm512_set1_ps(x.s[(m0 + m) * nb + b]), acc[m]);
    }
  }
  __m256 halves[MR][2];
  for (int m = 0; m < MR; ++m) {
    halves[m][0] = _mm512_castps512_ps256(acc[m]);
    halves[m][1] = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[m]), 1));
  }
  o.store_all<MR, 2>(m0, t, halves);
}
#endif

// The last 0-3 rows of a chunk for tile t.
template <Kind K, bool Vnni>
void tail_rows(const uint8_t* base, int64_t nb, int64_t t, const QuantizedRows& x, int64_t m,
               int64_t rows, const OutTile& o) {
  switch (rows) {
    case 3: return micro<K, Vnni, 3>(base, nb, t, x, m, o);
    case 2: return micro<K, Vnni, 2>(base, nb, t, x, m, o);
    case 1: return micro<K, Vnni, 1>(base, nb, t, x, m, o);
    default: return;
  }
}

template <Kind K, bool Vnni>
void tiles_simd(const uint8_t* base, int64_t nb, const QuantizedRows& x, int64_t t0, int64_t t1,
                int64_t M, const OutTile& o) {
  // Four rows share each weight vector (eight with AVX-512's 32 vector
  // registers); a tile's weights stay in L1 while a chunk of rows passes
  // over them, and the chunk's quantized rows stay in L2 over the tiles.
  constexpr int64_t wide = Vnni ? 8 : 4;
  for (int64_t c0 = 0; c0 < M; c0 += kRowChunk) {
    const int64_t c1 = std::min(M, c0 + kRowChunk);
    for (int64_t t = t0; t < t1; ++t) {
      int64_t m = c0;
#ifdef TANDEM_QUANT_AVX512
      if (Vnni && t + 1 < t1 && c1 - c0 == kRowChunk) {  // tiles t and t + 1 together
        for (; m + 8 <= c1; m += 8) micro_pair<K, 8>(base, nb, t, x, m, o);
        if (m + 4 <= c1) micro_pair<K, 4>(base, nb, t, x, m, o), m += 4;
        for (int64_t u = t; u <= t + 1; ++u) tail_rows<K, Vnni>(base, nb, u, x, m, c1 - m, o);
        ++t;
        continue;
      }
#endif
      for (; m + wide <= c1; m += wide) micro<K, Vnni, wide>(base, nb, t, x, m, o);
      if (wide == 8 && m + 4 <= c1) micro<K, Vnni, 4>(base, nb, t, x, m, o), m += 4;
      tail_rows<K, Vnni>(base, nb, t, x, m, c1 - m, o);
    }
  }
}

#endif  // TANDEM_QUANT_AVX2

template <Kind K>
void run(const at::Tensor& packed, const QuantizedRows& x, int64_t M, const OutTile& o,
         Isa isa) {
  const uint8_t* base = packed.data_ptr<uint8_t>();
  const int64_t nb = packed.size(1);
#ifdef TANDEM_QUANT_AMX
  if (isa == Isa::Amx && amx_takes(K) && M >= kAmxMinRows)
    return amx_int8_linear(K, base, packed.size(0), nb, x, M, o);
#endif
  const int64_t grain = std::max<int64_t>(4, 64 / std::max<int64_t>(M, 1));
  at::parallel_for(0, packed.size(0), grain, [&](int64_t t0, int64_t t1) {
#ifdef TANDEM_QUANT_AVX512
    if (isa >= Isa::Avx512) return tiles_simd<K, true>(base, nb, x, t0, t1, M, o);
#endif
#ifdef TANDEM_QUANT_AVX2
    if (isa != Isa::Portable) return tiles_simd<K, false>(base, nb, x, t0, t1, M, o);
#endif
    tiles_portable<K>(base, nb, x, t0, t1, M, o);
  });
}

void run_quantized(const at::Tensor& packed, const QuantizedRows& q, int64_t M, const OutTile& o,
                   Isa isa) {
  switch (kind_of(packed)) {
    case Kind::Q4: return run<Kind::Q4>(packed, q, M, o, isa);
    case Kind::Q4F: return run<Kind::Q4F>(packed, q, M, o, isa);
    case Kind::Q8H: return run<Kind::Q8H>(packed, q, M, o, isa);
    default: return run<Kind::Q8>(packed, q, M, o, isa);
  }
}

}  // namespace

void quant_linear_int8(const OutTile& o, const at::Tensor& x, const at::Tensor& packed, Isa isa) {
  TORCH_CHECK(takes_int8(kind_of(packed)),
              "int8 activations need integer blocks (Q4, Q4F, Q8, Q8H), not BF16");
  const RowSource src{x.data_ptr<float>(), x.stride(0), x.size(1), false};
  run_quantized(packed, quantize_rows(src, x.size(0), packed.size(1), isa), x.size(0), o, isa);
}

void quant_linear_int8_silu(const OutTile& o, const at::Tensor& gate_up, const at::Tensor& packed,
                            Isa isa) {
  TORCH_CHECK(takes_int8(kind_of(packed)),
              "int8 activations need integer blocks (Q4, Q4F, Q8, Q8H), not BF16");
  const RowSource src{gate_up.data_ptr<float>(), gate_up.stride(0), gate_up.size(1) / 2, true};
  const int64_t M = gate_up.size(0);
  run_quantized(packed, quantize_rows(src, M, packed.size(1), isa), M, o, isa);
}

}  // namespace tandem_quant
