// Linear layers over block-quantized weights (GGUF Q4_0, Q4_1, Q8_0, int8
// per channel) and bfloat16 weights (layout in quant_tiles.h), float32 in
// and out, on CPU.
//
// A decode step reads every weight once, so its speed is the weights'
// size: the default model's Q4_1 blocks are 0.625 bytes a weight, its
// float32 expansion 4. Here the weights stay in their blocks and each
// vector of 8 outputs' values is expanded in registers, value = dw * q + mw
// with one rounding (exactly the float32 the GGUF's dequantizer gives),
// then multiplied with float32 activations: the result is the float32
// model's up to the order of the additions, as MKL's own is.
//
// One expanded vector serves up to 8 input rows held in registers, so
// batched rows (decode batches, prefill chunks) pay the expansion once per
// 8 rows and run at the FMA units' rate, reading the weight tile from L1.
// quant_linear_int8.cpp is the opt-in path that quantizes activations too.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define TANDEM_QUANT_AVX2 1
#endif

#include "cpu_ops.h"
#include "quant_tiles.h"

namespace tandem_quant {
namespace {

// Rows per pass over a task's tiles: their activations stay in L2 while
// the tiles' weights are expanded for them.
constexpr int64_t kRowChunk = 64;

// x's rows, readable in whole blocks of 32 (copied and zero-padded when the
// input width is not a multiple of 32, which only int8 weights allow).
struct Rows {
  const float* p;
  int64_t stride;
};

template <Kind K>
void tiles_portable(const uint8_t* base, int64_t nb, const Rows& x, int64_t t0, int64_t t1,
                    int64_t m0, int64_t m1, const OutTile& o) {
  constexpr int64_t bytes = tile_block_bytes(K);
  float acc[kTile];
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t m = m0; m < m1; ++m) {
      const float* xr = x.p + m * x.stride;
      std::fill(acc, acc + kTile, 0.f);
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = base + (t * nb + b) * bytes;
        for (int64_t j = 0; j < kTile; ++j)
          for (int64_t k = 0; k < kBlock; ++k)
            acc[j] = std::fma(tile_value(blk, K, j, k), xr[b * kBlock + k], acc[j]);
      }
      o.store(m, t, acc);
    }
}

#ifdef TANDEM_QUANT_AVX2

// The 8 outputs' quants at k offset I of a lane's 4 bytes, as floats.
template <int I>
inline __m256 low_nibbles(__m256i raw) {
  return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(raw, 8 * I), _mm256_set1_epi32(15)));
}
template <int I>
inline __m256 high_nibbles(__m256i raw) {
  return _mm256_cvtepi32_ps(
      _mm256_and_si256(_mm256_srli_epi32(raw, 8 * I + 4), _mm256_set1_epi32(15)));
}
template <int I>
inline __m256 int8s(__m256i raw) {
  return _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(raw, 24 - 8 * I), 24));
}

inline __m256 halves(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// acc[m][v] += w[v] * x[m][k] for the MR rows and NV tiles.
template <int MR, int NV>
inline void fma_rows(__m256 (&acc)[MR][NV], const __m256 (&w)[NV], const float* const* xr,
                     int64_t k) {
  for (int m = 0; m < MR; ++m) {
    const __m256 xv = _mm256_broadcast_ss(xr[m] + k);
    for (int v = 0; v < NV; ++v) acc[m][v] = _mm256_fmadd_ps(w[v], xv, acc[m][v]);
  }
}

// 8 outputs' bfloat16 weights at one k (16 bytes), as floats.
inline __m256 bf16s(const uint8_t* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

template <Kind K, int MR, int NV, int I>
inline void step(__m256 (&acc)[MR][NV], const __m256i (&raw)[NV], const __m256 (&d)[NV],
                 const __m256 (&mn)[NV], const float* const* xr, int64_t c) {
  __m256 w[NV];
  if constexpr (K == Kind::Q4) {
    for (int v = 0; v < NV; ++v) w[v] = _mm256_fmadd_ps(low_nibbles<I>(raw[v]), d[v], mn[v]);
    fma_rows<MR, NV>(acc, w, xr, 4 * c + I);
    for (int v = 0; v < NV; ++v) w[v] = _mm256_fmadd_ps(high_nibbles<I>(raw[v]), d[v], mn[v]);
    fma_rows<MR, NV>(acc, w, xr, 16 + 4 * c + I);
  } else {
    for (int v = 0; v < NV; ++v) w[v] = _mm256_mul_ps(int8s<I>(raw[v]), d[v]);
    fma_rows<MR, NV>(acc, w, xr, 4 * c + I);
  }
}

// MR rows from m0 times NV tiles from t.
template <Kind K, int MR, int NV>
void micro(const uint8_t* base, int64_t nb, int64_t t, const Rows& x, int64_t m0,
           const OutTile& o) {
  constexpr int64_t bytes = tile_block_bytes(K);
  constexpr int vectors = K == Kind::Q4 ? 4 : 8;
  __m256 acc[MR][NV];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NV; ++v) acc[m][v] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    if constexpr (K == Kind::BF16) {
      const float* xr[MR];
      for (int m = 0; m < MR; ++m) xr[m] = x.p + (m0 + m) * x.stride + b * kBlock;
      for (int64_t k = 0; k < kBlock; ++k) {
        __m256 w[NV];
        for (int v = 0; v < NV; ++v) w[v] = bf16s(base + ((t + v) * nb + b) * bytes + k * 16);
        fma_rows<MR, NV>(acc, w, xr, k);
      }
      continue;
    }
    const uint8_t* blk[NV];
    __m256 d[NV], mn[NV];
    for (int v = 0; v < NV; ++v) {
      blk[v] = base + ((t + v) * nb + b) * bytes;
      d[v] = halves(blk[v] + scales_offset(K));
      mn[v] = K == Kind::Q4 ? halves(blk[v] + scales_offset(K) + 16) : _mm256_setzero_ps();
    }
    const float* xr[MR];
    for (int m = 0; m < MR; ++m) xr[m] = x.p + (m0 + m) * x.stride + b * kBlock;
    for (int c = 0; c < vectors; ++c) {
      __m256i raw[NV];
      for (int v = 0; v < NV; ++v)
        raw[v] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk[v] + c * 32));
      step<K, MR, NV, 0>(acc, raw, d, mn, xr, c);
      step<K, MR, NV, 1>(acc, raw, d, mn, xr, c);
      step<K, MR, NV, 2>(acc, raw, d, mn, xr, c);
      step<K, MR, NV, 3>(acc, raw, d, mn, xr, c);
    }
  }
  alignas(32) float row[kTile];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NV; ++v) {
      _mm256_store_ps(row, acc[m][v]);
      o.store(m0 + m, t + v, row);
    }
}

// Rows [m0, m0 + MR) over tiles [t0, t1), NV tiles at a time.
template <Kind K, int MR, int NV>
void row_group(const uint8_t* base, int64_t nb, int64_t t0, int64_t t1, const Rows& x,
               int64_t m0, const OutTile& o) {
  int64_t t = t0;
  for (; t + NV <= t1; t += NV) micro<K, MR, NV>(base, nb, t, x, m0, o);
  for (; t < t1; ++t) micro<K, MR, 1>(base, nb, t, x, m0, o);
}

template <Kind K>
void tiles_avx2(const uint8_t* base, int64_t nb, const Rows& x, int64_t t0, int64_t t1,
                int64_t m0, int64_t m1, const OutTile& o) {
  int64_t m = m0;
  // Eight rows share each expanded vector of weights.
  for (; m + 8 <= m1; m += 8) row_group<K, 8, 1>(base, nb, t0, t1, x, m, o);
  // Fewer rows take several tiles at once: independent sums hide latency.
  if (m + 4 <= m1) row_group<K, 4, 1>(base, nb, t0, t1, x, m, o), m += 4;
  if (m + 2 <= m1) row_group<K, 2, 2>(base, nb, t0, t1, x, m, o), m += 2;
  if (m < m1) row_group<K, 1, 4>(base, nb, t0, t1, x, m, o);
}

#endif  // TANDEM_QUANT_AVX2

template <Kind K>
void run(const at::Tensor& packed, const Rows& x, int64_t M, const OutTile& o, bool portable) {
  const uint8_t* base = packed.data_ptr<uint8_t>();
  const int64_t nb = packed.size(1);
  // Enough tiles a task that a 1-row decode still splits over the threads,
  // few enough that each task amortises its start.
  const int64_t grain = std::max<int64_t>(4, 64 / std::max<int64_t>(M, 1));
  at::parallel_for(0, packed.size(0), grain, [&](int64_t t0, int64_t t1) {
    for (int64_t m0 = 0; m0 < M; m0 += kRowChunk) {
      const int64_t m1 = std::min(M, m0 + kRowChunk);
#ifdef TANDEM_QUANT_AVX2
      if (!portable) {
        tiles_avx2<K>(base, nb, x, t0, t1, m0, m1, o);
        continue;
      }
#endif
      tiles_portable<K>(base, nb, x, t0, t1, m0, m1, o);
    }
  });
}

}  // namespace

OutTile check_quant_linear(const at::Tensor& out, const at::Tensor& x, const at::Tensor& packed,
                           const c10::optional<at::Tensor>& bias) {
  kind_of(packed);
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 &&
                  x.stride(1) == 1,
              "x must be float32 [rows, in] on CPU with contiguous rows");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.dim() == 2 && out.stride(1) == 1 &&
                  out.size(0) == x.size(0),
              "out must be float32 [rows, out] with contiguous rows, one per row of x");
  const int64_t N = out.size(1), nb = packed.size(1), tiles = packed.size(0);
  TORCH_CHECK(x.size(1) <= nb * kBlock && x.size(1) > (nb - 1) * kBlock, "x has ", x.size(1),
              " columns: the weight's blocks hold ", nb * kBlock);
  TORCH_CHECK(N <= tiles * kTile && N > (tiles - 1) * kTile, "out has ", N,
              " columns: the weight has ", tiles, " tiles of ", kTile);
  const float* bias_ptr = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "bias must be contiguous float32 [out]");
    bias_ptr = bias->data_ptr<float>();
  }
  return OutTile{out.data_ptr<float>(), out.stride(0), bias_ptr, N - (tiles - 1) * kTile, tiles};
}

}  // namespace tandem_quant

using namespace tandem_quant;

void quant_linear(at::Tensor out, at::Tensor x, at::Tensor packed,
                  const c10::optional<at::Tensor>& bias, bool int8_activations, bool portable) {
  const OutTile o = check_quant_linear(out, x, packed, bias);
  if (x.size(0) == 0) return;
  if (int8_activations) return quant_linear_int8(o, x, packed, portable);
  const int64_t padded = packed.size(1) * kBlock;
  if (x.size(1) != padded) x = at::constant_pad_nd(x, {0, padded - x.size(1)});
  const Rows rows{x.data_ptr<float>(), x.stride(0)};
  switch (kind_of(packed)) {
    case Kind::Q4: return run<Kind::Q4>(packed, rows, x.size(0), o, portable);
    case Kind::Q8: return run<Kind::Q8>(packed, rows, x.size(0), o, portable);
    case Kind::BF16: return run<Kind::BF16>(packed, rows, x.size(0), o, portable);
  }
}

bool quant_linear_has_avx2() {
#ifdef TANDEM_QUANT_AVX2
  return true;
#else
  return false;
#endif
}
