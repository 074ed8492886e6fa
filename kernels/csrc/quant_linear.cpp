// Linear layers over block-quantized weights (GGUF Q4_0, Q4_1, Q4_K, Q6_K,
// Q8_0, int8 per channel) and bfloat16 weights (layout in quant_tiles.h), float32 in
// and out, on CPU.
//
// A decode step reads every weight once, so its speed is the weights'
// size: the default model's Q4_1 blocks are 0.625 bytes a weight, its
// float32 expansion 4. Here the weights stay in their blocks: each vector
// of 8 outputs' integers q is converted to float in registers and
// multiplied with float32 activations, and each block's sums are scaled
// once: dw * sum q x + mw * sum x, which is sum (dw q + mw) x, the float32
// model's dot product, regrouped (float32 rounding, as MKL's order is).
//
// One converted vector serves up to 8 input rows held in registers, so a
// few rows (decode batches) read the weight tile from L1 once per 8 rows;
// from gemm_rows() rows on, quant_gemm.cpp expands panels of the weight for
// ATen's GEMM instead. quant_linear_int8.cpp is the opt-in path that
// quantizes activations too.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <vector>

#include "cpu_ops.h"
#include "quant_expand.h"
#include "quant_int8_rows.h"

namespace tandem_quant {
namespace {

// Rows per pass over a task's tiles: their activations stay in L2 while
// the tiles' weights are expanded for them.
constexpr int64_t kRowChunk = 64;

// From this many rows on, expanding panels for ATen's GEMM beats the
// register kernels (measured at 16-256 rows: benchmarks/README.md,
// "quant_kernel_bench.py"). bfloat16's register kernel is the slowest of
// them (~60 GFLOP/s from 8 rows on), so it hands over sooner.
constexpr int64_t gemm_rows(Kind kind) { return kind == Kind::BF16 ? 32 : 128; }

// x's rows, readable in whole blocks of 32 (copied and zero-padded when the
// input width is not a multiple of 32, which only int8 weights allow).
struct Rows {
  const float* p;
  int64_t stride;
  const float* sums;  // [rows, blocks]: each row's sum over each block of 32
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

// acc[m][v] += w[v] * x[m][k] for the MR rows and NV tiles.
template <int MR, int NV>
inline void fma_rows(__m256 (&acc)[MR][NV], const __m256 (&w)[NV], const float* const* xr,
                     int64_t k) {
  for (int m = 0; m < MR; ++m) {
    const __m256 xv = _mm256_broadcast_ss(xr[m] + k);
    for (int v = 0; v < NV; ++v) acc[m][v] = _mm256_fmadd_ps(w[v], xv, acc[m][v]);
  }
}

// Q4/Q8 blocks are summed as  dw * sum_k q x  +  mw * sum_k x  (the second
// sum is the row's, shared by every output): the integers q are converted
// but not scaled, one multiply-add a weight fewer than expanding dw * q + mw
// first. P = 2 splits a block's sums in two (low/high nibbles, even/odd
// k-groups) where MR * NV sums alone are too few independent chains to
// hide the multiply-add's latency (the 1-row decode's case).
template <Kind K, int MR, int NV>
constexpr int kSplit = MR * NV <= 4 ? 2 : 1;

template <Kind K, int MR, int NV, int I>
inline void step(__m256 (&sums)[kSplit<K, MR, NV>][MR][NV], const __m256i (&raw)[NV],
                 const float* const* xr, int64_t c) {
  constexpr int P = kSplit<K, MR, NV>;
  __m256 w[NV];
  if constexpr (is_q4(K)) {
    for (int v = 0; v < NV; ++v) w[v] = low_nibbles<I>(raw[v]);
    fma_rows<MR, NV>(sums[0], w, xr, 4 * c + I);
    for (int v = 0; v < NV; ++v) w[v] = high_nibbles<I>(raw[v]);
    fma_rows<MR, NV>(sums[P - 1], w, xr, 16 + 4 * c + I);
  } else {
    for (int v = 0; v < NV; ++v) w[v] = int8s<I>(raw[v]);
    fma_rows<MR, NV>(sums[I % P], w, xr, 4 * c + I);
  }
}

// acc += dw * (the block's sums) + mw * (the rows' sums of x over the block).
// Q8H scales each half of the block by its own dw (`half`), the sums reset
// between.
template <Kind K, int MR, int NV>
inline void scale_block(__m256 (&acc)[MR][NV], __m256 (&sums)[kSplit<K, MR, NV>][MR][NV],
                        const uint8_t* const* blk, const Rows& x, int64_t m0, int64_t nb,
                        int64_t b, int half = 0) {
  for (int v = 0; v < NV; ++v) {
    const __m256 d = tile_scales<K>(blk[v], half);
    for (int m = 0; m < MR; ++m) {
      __m256 s = sums[0][m][v];
      if constexpr (kSplit<K, MR, NV> == 2) s = _mm256_add_ps(s, sums[1][m][v]);
      acc[m][v] = _mm256_fmadd_ps(d, s, acc[m][v]);
    }
    if constexpr (is_q4(K)) {
      const __m256 mn = tile_scales<K>(blk[v], 1);
      for (int m = 0; m < MR; ++m)
        acc[m][v] = _mm256_fmadd_ps(mn, _mm256_broadcast_ss(x.sums + (m0 + m) * nb + b), acc[m][v]);
    }
  }
}

// MR rows from m0 times NV tiles from t.
template <Kind K, int MR, int NV>
void micro(const uint8_t* base, int64_t nb, int64_t t, const Rows& x, int64_t m0,
           const OutTile& o) {
  constexpr int64_t bytes = tile_block_bytes(K);
  constexpr int vectors = is_q4(K) ? 4 : 8;
  constexpr int P = kSplit<K, MR, NV>;
  __m256 acc[MR][NV];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NV; ++v) acc[m][v] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const float* xr[MR];
    for (int m = 0; m < MR; ++m) xr[m] = x.p + (m0 + m) * x.stride + b * kBlock;
    if constexpr (K == Kind::BF16) {
      for (int v = 0; v < NV; ++v)
        prefetch_block(base + ((t + v) * nb + b) * bytes, NV * nb * bytes, bytes);
      for (int64_t p = 0; p < kBlock / 2; ++p) {
        __m256i pair[NV];
        __m256 w[NV];
        for (int v = 0; v < NV; ++v)
          pair[v] = _mm256_loadu_si256(
              reinterpret_cast<const __m256i*>(base + ((t + v) * nb + b) * bytes + p * 32));
        for (int v = 0; v < NV; ++v) w[v] = bf16s<0>(pair[v]);
        fma_rows<MR, NV>(acc, w, xr, 2 * p);
        for (int v = 0; v < NV; ++v) w[v] = bf16s<1>(pair[v]);
        fma_rows<MR, NV>(acc, w, xr, 2 * p + 1);
      }
      continue;
    }
    const uint8_t* blk[NV];
    for (int v = 0; v < NV; ++v) blk[v] = base + ((t + v) * nb + b) * bytes;
    for (int v = 0; v < NV; ++v) prefetch_block(blk[v], NV * nb * bytes, bytes);
    __m256 sums[P][MR][NV];
    for (int p = 0; p < P; ++p)
      for (int m = 0; m < MR; ++m)
        for (int v = 0; v < NV; ++v) sums[p][m][v] = _mm256_setzero_ps();
    for (int c = 0; c < vectors; ++c) {
      __m256i raw[NV];
      for (int v = 0; v < NV; ++v)
        raw[v] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk[v] + c * 32));
      step<K, MR, NV, 0>(sums, raw, xr, c);
      step<K, MR, NV, 1>(sums, raw, xr, c);
      step<K, MR, NV, 2>(sums, raw, xr, c);
      step<K, MR, NV, 3>(sums, raw, xr, c);
      if constexpr (K == Kind::Q8H) {
        if (c == 3) {  // k < 16 done: scale by their dw, then sum k >= 16 afresh
          scale_block<K, MR, NV>(acc, sums, blk, x, m0, nb, b, 0);
          for (int p = 0; p < P; ++p)
            for (int m = 0; m < MR; ++m)
              for (int v = 0; v < NV; ++v) sums[p][m][v] = _mm256_setzero_ps();
        }
      }
    }
    scale_block<K, MR, NV>(acc, sums, blk, x, m0, nb, b, K == Kind::Q8H ? 1 : 0);
  }
  o.store_all<MR, NV>(m0, t, acc);
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
void run(const at::Tensor& packed, const Rows& x, int64_t M, const OutTile& o, Isa isa) {
  const uint8_t* base = packed.data_ptr<uint8_t>();
  const int64_t nb = packed.size(1);
  // Enough tiles a task that a 1-row decode still splits over the threads,
  // few enough that each task amortises its start.
  const int64_t grain = std::max<int64_t>(4, 64 / std::max<int64_t>(M, 1));
  at::parallel_for(0, packed.size(0), grain, [&](int64_t t0, int64_t t1) {
    for (int64_t m0 = 0; m0 < M; m0 += kRowChunk) {
      const int64_t m1 = std::min(M, m0 + kRowChunk);
#ifdef TANDEM_QUANT_AVX2
      if (isa != Isa::Portable) {
        tiles_avx2<K>(base, nb, x, t0, t1, m0, m1, o);
        continue;
      }
#endif
      tiles_portable<K>(base, nb, x, t0, t1, m0, m1, o);
    }
  });
}

// Each row's sum over each block of 32 inputs: Q4's mw multiplies it (see
// scale_block). Computed here rather than by ATen: a decode step makes ~120
// of these calls, and an ATen op's dispatch costs more than the sums.
std::vector<float> block_sums(const at::Tensor& x, int64_t nb) {
  const int64_t M = x.size(0);
  std::vector<float> sums(M * nb);
  const float* p = x.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < nb; ++b) {
      float s = 0.f;
      for (int64_t k = 0; k < kBlock; ++k) s += p[m * x.stride(0) + b * kBlock + k];
      sums[m * nb + b] = s;
    }
  return sums;
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
                  const c10::optional<at::Tensor>& bias, bool int8_activations, int64_t isa_level) {
  const OutTile o = check_quant_linear(out, x, packed, bias);
  const Isa isa = usable_isa(isa_level);
  if (x.size(0) == 0) return;
  // BF16 weights are refused there: the flag is for integer blocks.
  if (int8_activations && amx_bf16_gemm_takes(x.size(0), isa))
    return amx_bf16_gemm(out, x, packed, bias, isa);
  if (int8_activations)
    return quant_linear_int8(o, x, packed, isa);
  const int64_t padded = packed.size(1) * kBlock;
  if (x.size(1) != padded) x = at::constant_pad_nd(x, {0, padded - x.size(1)});
  if (x.size(0) >= gemm_rows(kind_of(packed))) {
#ifdef TANDEM_QUANT_AVX512_BF16
    if (kind_of(packed) == Kind::BF16 && isa >= Isa::Avx512) {
      quant_linear_bf16_dot(o, x, packed);
      return;
    }
#endif
    return quant_gemm(out, x, packed, bias, isa);
  }
  const std::vector<float> sums = block_sums(x, packed.size(1));
  const Rows rows{x.data_ptr<float>(), x.stride(0), sums.data()};
  switch (kind_of(packed)) {
    case Kind::Q4: return run<Kind::Q4>(packed, rows, x.size(0), o, isa);
    case Kind::Q4F: return run<Kind::Q4F>(packed, rows, x.size(0), o, isa);
    case Kind::Q8: return run<Kind::Q8>(packed, rows, x.size(0), o, isa);
    case Kind::Q8H: return run<Kind::Q8H>(packed, rows, x.size(0), o, isa);
    case Kind::BF16: return run<Kind::BF16>(packed, rows, x.size(0), o, isa);
  }
}

void quant_linear_silu(at::Tensor out, at::Tensor gate_up, at::Tensor packed,
                       const c10::optional<at::Tensor>& bias, int64_t isa_level) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0,
              "gate_up must be [rows, 2 * in]: gate, then up");
  const OutTile o = check_quant_linear(out, gate_up.narrow(1, 0, gate_up.size(1) / 2), packed, bias);
  const Isa isa = usable_isa(isa_level);
  if (gate_up.size(0) == 0) return;
  if (amx_bf16_gemm_takes(gate_up.size(0), isa)) {
    at::Tensor act = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
    silu_mul(act, gate_up.contiguous());
    return amx_bf16_gemm(out, act, packed, bias, isa);
  }
  quant_linear_int8_silu(o, gate_up, packed, isa);
}

namespace {
// quant_linear_cap_isa's cap (benchmarks compare paths inside one process).
std::atomic<int64_t> isa_cap{static_cast<int64_t>(Isa::Amx)};
}  // namespace

Isa tandem_quant::best_isa() {
  Isa best = kBuiltIsa;
#ifdef TANDEM_QUANT_AMX
  if (!amx_usable()) best = Isa::Avx512;
#endif
  return static_cast<Isa>(std::min(static_cast<int64_t>(best), isa_cap.load()));
}

int64_t quant_linear_best_isa() { return static_cast<int64_t>(best_isa()); }

int64_t quant_linear_cap_isa(int64_t level) {
  TORCH_CHECK(level >= 0 && level <= static_cast<int64_t>(Isa::Amx), "isa ", level,
              " is not one of 0 (portable), 1 (avx2), 2 (avx512), 3 (amx)");
  isa_cap.store(level);
  return quant_linear_best_isa();
}

int64_t quant_linear_bf16_dot_rows() {
#ifdef TANDEM_QUANT_AVX512_BF16
  return gemm_rows(Kind::BF16);
#else
  return -1;
#endif
}

int64_t quant_linear_amx_bf16_rows() {
#ifdef TANDEM_QUANT_AMX_BF16
  return amx_usable() ? amx_bf16_gemm_rows() : -1;
#else
  return -1;
#endif
}

int64_t quant_linear_set_amx_bf16_rows(int64_t rows) { return set_amx_bf16_gemm_rows(rows); }

void quant_mlp_amx(at::Tensor out, at::Tensor x, at::Tensor gate_up, at::Tensor down,
                   int64_t intermediate, const c10::optional<at::Tensor>& gate_up_bias,
                   const c10::optional<at::Tensor>& down_bias, int64_t act) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "x must be [rows, in] float32 with contiguous rows");
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == at::kFloat && out.stride(1) == 1 &&
                  out.size(0) == x.size(0),
              "out must be [rows, hidden] float32 with contiguous rows, one per x row");
  for (const auto* w : {&gate_up, &down})
    TORCH_CHECK(w->dim() == 3 && w->scalar_type() == at::kByte && kind_of(*w) != Kind::BF16,
                "gate_up and down must be packed integer blocks");
  for (const auto* b : {&gate_up_bias, &down_bias})
    TORCH_CHECK(!b->has_value() || ((*b)->scalar_type() == at::kFloat && (*b)->is_contiguous()),
                "biases must be contiguous float32");
  TORCH_CHECK(!gate_up_bias.has_value() || gate_up_bias->numel() == 2 * intermediate,
              "gate_up_bias must have 2 * intermediate values");
  TORCH_CHECK(!down_bias.has_value() || down_bias->numel() == out.size(1),
              "down_bias must have one value per output");
  const Isa isa = best_isa();
  TORCH_CHECK(amx_bf16_gemm_takes(x.size(0), isa), "quant_mlp_amx: ", x.size(0),
              " rows do not take the AMX bfloat16 path here (quant_linear_amx_bf16_rows)");
  amx_bf16_mlp(out, x, gate_up, down, intermediate, gate_up_bias, down_bias, act, isa);
}
