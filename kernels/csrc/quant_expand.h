// Tile blocks (quant_tiles.h) expanded to float32 in registers, shared by
// the few-row kernels (quant_linear.cpp), which multiply each expanded
// vector at once, and the many-row path (quant_gemm.cpp), which stores it.
//
// Every expanded value is what the GGUF dequantizer gives: dw * q + mw with
// one rounding (the product of dw and a small integer is exact: a float16
// dw, or a K-quant's float32 one of at most 18 significant bits).
#pragma once
#include <cstdint>

#include "quant_tiles.h"

namespace tandem_quant {

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

// A Q4/Q4F/Q8 tile block's 8 dw (which = 0) or mw (which = 1), as floats;
// Q8H's dw for k < 16 (which = 0) or k >= 16 (which = 1).
template <Kind K>
inline __m256 tile_scales(const uint8_t* blk, int which) {
  if constexpr (float_scales(K))
    return _mm256_loadu_ps(reinterpret_cast<const float*>(blk + scales_offset(K)) + which * kTile);
  return halves(blk + scales_offset(K) + which * 2 * kTile);
}

// 8 outputs' bfloat16 weights at k = 2p + I of a k-pair's 32 bytes, as
// floats: a bfloat16 is a float32's high half.
template <int I>
inline __m256 bf16s(__m256i pair) {
  if constexpr (I == 0) return _mm256_castsi256_ps(_mm256_slli_epi32(pair, 16));
  return _mm256_castsi256_ps(_mm256_and_si256(pair, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

template <Kind K, int I>
inline void store_group(__m256i raw, __m256 d, __m256 mn, float* dst, int64_t ld, int c) {
  if constexpr (is_q4(K)) {
    _mm256_storeu_ps(dst + (4 * c + I) * ld, _mm256_fmadd_ps(low_nibbles<I>(raw), d, mn));
    _mm256_storeu_ps(dst + (16 + 4 * c + I) * ld, _mm256_fmadd_ps(high_nibbles<I>(raw), d, mn));
  } else {
    _mm256_storeu_ps(dst + (4 * c + I) * ld, _mm256_mul_ps(int8s<I>(raw), d));
  }
}

#endif  // TANDEM_QUANT_AVX2

// A tile block's 32 k x 8 outputs as float32, k-major: dst[k * ld + j].
template <Kind K>
inline void expand_block(const uint8_t* blk, float* dst, int64_t ld, Isa isa) {
#ifdef TANDEM_QUANT_AVX2
  if (isa != Isa::Portable) {
    if constexpr (K == Kind::BF16) {
      for (int64_t p = 0; p < kBlock / 2; ++p) {
        const __m256i pair = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + p * 32));
        _mm256_storeu_ps(dst + 2 * p * ld, bf16s<0>(pair));
        _mm256_storeu_ps(dst + (2 * p + 1) * ld, bf16s<1>(pair));
      }
    } else {
      const __m256 d = tile_scales<K>(blk, 0);
      const __m256 mn = is_q4(K) ? tile_scales<K>(blk, 1) : _mm256_setzero_ps();
      const __m256 d_high = K == Kind::Q8H ? tile_scales<K>(blk, 1) : d;
      for (int c = 0; c < (is_q4(K) ? 4 : 8); ++c) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + c * 32));
        const __m256 dc = c >= 4 ? d_high : d;  // Q8: k-groups 4-7 are k >= 16
        store_group<K, 0>(raw, dc, mn, dst, ld, c);
        store_group<K, 1>(raw, dc, mn, dst, ld, c);
        store_group<K, 2>(raw, dc, mn, dst, ld, c);
        store_group<K, 3>(raw, dc, mn, dst, ld, c);
      }
    }
    return;
  }
#endif
  for (int64_t k = 0; k < kBlock; ++k)
    for (int64_t j = 0; j < kTile; ++j) dst[k * ld + j] = tile_value(blk, K, j, k);
}

// quant_gemm.cpp: many rows at once, through ATen's GEMM on expanded panels.
void quant_gemm(at::Tensor out, const at::Tensor& x, const at::Tensor& packed,
                const c10::optional<at::Tensor>& bias, Isa isa);

// The int8-activation path's many-row calls on CPUs with AMX-BF16 (prefill
// chunks): x rounded to bfloat16 times the weight expanded to bfloat16
// (exactly where its values fit; within 2^-9 of each where not), on AMX
// tiles through oneDNN's brgemm micro-kernel, float32 sums written straight
// into the output. The int8 kernels' many-row calls reach ~0.25 TOP/s on
// VNNI; the tiles 1.4-1.8 TFLOP/s here, which pays for expanding the weight
// each call from ~1,024 rows on (benchmarks/README.md,
// "amx_bf16_gemm_bench.py"). Both round the activations; this rounds less.
constexpr int64_t kAmxBf16GemmRows = 1024;
// Whether a call of `rows` rows at code path `isa` takes amx_bf16_gemm.
bool amx_bf16_gemm_takes(int64_t rows, Isa isa);
void amx_bf16_gemm(const at::Tensor& out, const at::Tensor& x, const at::Tensor& packed,
                   const c10::optional<at::Tensor>& bias, Isa isa);
// The threshold in force, and a new one (0: off); set returns the old one.
int64_t amx_bf16_gemm_rows();
int64_t set_amx_bf16_gemm_rows(int64_t rows);

// The weight's [K, tiles * 8] float32 expansion (k-major), every tile at once.
at::Tensor expand_all(const at::Tensor& packed, Isa isa);

#ifdef TANDEM_QUANT_AMX_BF16
// The AMX bfloat16 GEMMs' blocking (quant_gemm.cpp, amx_mlp.cpp): each
// thread takes kAmxRowBlock rows of the bfloat16 input (at most
// 256 x 2,048 x 2 bytes: in L2) and multiplies them by every column panel
// of the packed weight in turn (the whole weight, 1-4 MB in bfloat16 for
// these models, comes from L3); one brgemm call (oneDNN's micro-kernel,
// through ATen's cpublas) computes kAmxRowBlock x kAmxPanel float32 sums.
constexpr int64_t kAmxRowBlock = 256;
constexpr int64_t kAmxPanel = 64;
// Columns col0 .. col0 + N - 1 of expand_all's [Kp, ld] float32 expansion
// as bfloat16 panels of kAmxPanel columns in the layout AMX's bfloat16
// tiles read (pairs of k interleaved: [panels][Kp / 2][kAmxPanel][2]),
// rounded to nearest even as Tensor.to(bfloat16) rounds; the last panel
// zero-padded to the full width.
at::Tensor pack_vnni_panels(const at::Tensor& expanded, int64_t col0, int64_t N);
// x [M, K] float32 as contiguous bfloat16 rows padded with zeros to Kp.
at::Tensor bf16_rows(const at::Tensor& x, int64_t Kp);
// c[i * ldc + j] += bias[j] for an m x n tile of outputs.
void add_bias(float* c, int64_t ldc, const float* bias, int64_t m, int64_t n);
#endif

// amx_mlp.cpp: a gated MLP's many-row calls in one pass on AMX tiles.
// out = act(x @ gate^T + b_gate) * (x @ up^T + b_up) @ down^T + b_down for a
// gate_up weight [2 * I, K] (gate rows, then up rows) and down [H, I], both
// taking int8 activations; act 0 = SiLU, 1 = GELU (tanh). Each block of
// rows goes through gate_up, the activation and down while it is in cache:
// no [rows, 2 * I] product, no activation tensor, and each weight expanded
// once a call (the chunked path expanded both once per 1,024 rows).
// x and the activation are rounded to bfloat16, as amx_bf16_gemm rounds
// them; sums in float32.
void amx_bf16_mlp(const at::Tensor& out, const at::Tensor& x, const at::Tensor& gate_up,
                  const at::Tensor& down, int64_t intermediate,
                  const c10::optional<at::Tensor>& gate_up_bias,
                  const c10::optional<at::Tensor>& down_bias, int64_t act, Isa isa);

}  // namespace tandem_quant
