// BF16 weights times many input rows on CPUs with AVX512_BF16: the inputs
// are rounded to bfloat16 (nearest even) and vdpbf16ps multiplies 8 lanes'
// pairs of bfloat16 and adds both products into float32 sums, twice the
// multiply-adds of a float32 FMA an instruction. That is what a bfloat16
// model computes anyway; it costs the inputs' rounding (up to 2^-9 of each
// input), so quant_linear takes it only where compute is the cost (from
// gemm_rows(BF16) rows: prefill chunks, big batches) and keeps float32
// inputs for decode, which is bound by the weights' bytes.
//
// The BF16 tile layout (quant_tiles.h) already holds each output's k-pairs
// in one 32-bit lane, as the instruction takes them; each input row is
// rounded once into the same pairs.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "quant_tiles.h"

#ifdef TANDEM_QUANT_AVX512_BF16

namespace tandem_quant {
namespace {

constexpr int64_t kPairsPerBlock = kBlock / 2;
// Rows whose pairs stay in L2 while a task's tiles pass over them.
constexpr int64_t kRowChunk = 64;
// Tiles a micro-kernel takes at once: with 4 rows, 12 independent sums, as
// many as the dot product's latency times its throughput.
constexpr int kTilesAtOnce = 3;

// x's rows (padded to nb * 32 columns) rounded to bfloat16: [M, nb * 16] pairs.
std::vector<uint32_t> round_rows(const at::Tensor& x, int64_t nb) {
  const int64_t M = x.size(0), xs = x.stride(0), width = nb * kPairsPerBlock;
  std::vector<uint32_t> pairs(M * width);
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t k = 0; k < nb * kBlock; k += 16) {
        const __m256bh h = _mm512_cvtneps_pbh(_mm512_loadu_ps(xp + m * xs + k));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(pairs.data() + m * width + k / 2),
                            reinterpret_cast<const __m256i&>(h));
      }
  });
  return pairs;
}

struct PairRows {
  const uint32_t* p;
  int64_t width;  // pairs per row
};

// MR rows from m0 times NV tiles from t.
template <int MR, int NV>
void micro(const uint8_t* base, int64_t nb, int64_t t, const PairRows& x, int64_t m0,
           const OutTile& o) {
  __m256 acc[MR][NV];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NV; ++v) acc[m][v] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk[NV];
    for (int v = 0; v < NV; ++v) blk[v] = base + ((t + v) * nb + b) * kBF16Bytes;
    const uint32_t* xr[MR];
    for (int m = 0; m < MR; ++m) xr[m] = x.p + (m0 + m) * x.width + b * kPairsPerBlock;
    for (int64_t p = 0; p < kPairsPerBlock; ++p) {
      __m256bh w[NV];
      for (int v = 0; v < NV; ++v) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk[v] + p * 32));
        w[v] = reinterpret_cast<const __m256bh&>(raw);
      }
      for (int m = 0; m < MR; ++m) {
        const __m256i xi = _mm256_set1_epi32(static_cast<int>(xr[m][p]));
        const __m256bh xb = reinterpret_cast<const __m256bh&>(xi);
        for (int v = 0; v < NV; ++v) acc[m][v] = _mm256_dpbf16_ps(acc[m][v], w[v], xb);
      }
    }
  }
  o.store_all<MR, NV>(m0, t, acc);
}

// Rows [m0, m0 + MR) times the tiles [t, t + n), n <= kTilesAtOnce.
template <int MR>
void rows_times_tiles(const uint8_t* base, int64_t nb, int64_t t, int64_t n, const PairRows& x,
                      int64_t m0, const OutTile& o) {
  if (n == kTilesAtOnce) return micro<MR, kTilesAtOnce>(base, nb, t, x, m0, o);
  for (int64_t v = 0; v < n; ++v) micro<MR, 1>(base, nb, t + v, x, m0, o);
}

// Each group of tiles meets every row of the chunk while its weights are
// in L1/L2 (the rows' pairs stay in L2).
void tiles(const uint8_t* base, int64_t nb, const PairRows& x, int64_t t0, int64_t t1, int64_t m0,
           int64_t m1, const OutTile& o) {
  for (int64_t t = t0; t < t1; t += kTilesAtOnce) {
    const int64_t n = std::min<int64_t>(kTilesAtOnce, t1 - t);
    int64_t m = m0;
    for (; m + 4 <= m1; m += 4) rows_times_tiles<4>(base, nb, t, n, x, m, o);
    if (m + 2 <= m1) rows_times_tiles<2>(base, nb, t, n, x, m, o), m += 2;
    if (m < m1) rows_times_tiles<1>(base, nb, t, n, x, m, o);
  }
}

}  // namespace

void quant_linear_bf16_dot(const OutTile& o, const at::Tensor& x, const at::Tensor& packed) {
  const int64_t nb = packed.size(1), M = x.size(0);
  TORCH_CHECK(x.size(1) == nb * kBlock, "x must be padded to the weight's blocks");
  const std::vector<uint32_t> pairs = round_rows(x, nb);
  const PairRows rows{pairs.data(), nb * kPairsPerBlock};
  const uint8_t* base = packed.data_ptr<uint8_t>();
  at::parallel_for(0, packed.size(0), 4, [&](int64_t t0, int64_t t1) {
    for (int64_t m0 = 0; m0 < M; m0 += kRowChunk)
      tiles(base, nb, rows, t0, t1, m0, std::min(M, m0 + kRowChunk), o);
  });
}

}  // namespace tandem_quant

#endif  // TANDEM_QUANT_AVX512_BF16
