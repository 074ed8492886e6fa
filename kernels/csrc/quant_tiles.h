// The tiled layout of quantized linear weights, shared by the repacking
// (quant_pack.cpp) and the kernels (quant_linear*.cpp); kernels/quant.py
// describes the formats.
//
// Weights are repacked at load into tiles of 8 output rows, so that one
// 32-byte vector holds 4 consecutive k of 8 outputs: lane j (32 bits) holds
// output j's 4 values, byte i of it k = 4g + i of k-group g.
//
//   packed[tile][block of 32 k] =
//     Q4: 4 x 32 bytes of nibbles (low nibble: group c, high: group c + 4),
//         then dw[8] and mw[8] (float16): value = dw * q + mw
//     Q4F: Q4's nibbles, then dw[8] and mw[8] in float32 (GGUF Q4_K: a
//         sub-block's dw = d * scale and mw = -dmin * min, products of a
//         float16 and a 6-bit integer, exact in float32 but not in float16)
//     Q8: 8 x 32 bytes of int8, then dw[8] (float16): value = dw * q
//     Q8H: Q8's int8s, then dw[2][8] in float32, dw[h] for k in [16h, 16h + 16)
//         (GGUF Q6_K: sub-blocks of 16, dw = d * scale exact in float32)
//     BF16: 16 k-pairs x 8 outputs x 2 bfloat16 (32 bytes per pair of k:
//           lane j holds output j's k = 2p, 2p + 1, the pairs AVX512_BF16's
//           dot product takes), no scales
//
// Q4_1's mw is its block minimum; Q4_0's nibbles are offset by 8, so its
// mw is -8 dw (exact in float16). Padding rows past the last output are 0.
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cmath>
#include <cstring>

// The SIMD paths this build has (the kernels are built with -march=native).
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define TANDEM_QUANT_AVX2 1
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__)
#define TANDEM_QUANT_AVX512 1
#if defined(__AVX512BF16__)
#define TANDEM_QUANT_AVX512_BF16 1
#endif
#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define TANDEM_QUANT_AMX 1
#if defined(__AMX_BF16__)
#define TANDEM_QUANT_AMX_BF16 1
#endif
#endif
#endif
#endif

namespace tandem_quant {

// Which code a call may use, at most: tests and benchmarks ask for each
// path this build has; serving takes the best. Amx is Avx512 plus AMX tiles
// for the int8 path's many-row calls.
enum class Isa : int64_t { Portable = 0, Avx2 = 1, Avx512 = 2, Amx = 3 };

#if defined(TANDEM_QUANT_AMX)
constexpr Isa kBuiltIsa = Isa::Amx;
#elif defined(TANDEM_QUANT_AVX512)
constexpr Isa kBuiltIsa = Isa::Avx512;
#elif defined(TANDEM_QUANT_AVX2)
constexpr Isa kBuiltIsa = Isa::Avx2;
#else
constexpr Isa kBuiltIsa = Isa::Portable;
#endif

// The best path this build has that the OS allows (AMX needs its leave).
Isa best_isa();

// `requested` (an Isa's number), capped at what this build and OS allow.
inline Isa usable_isa(int64_t requested) {
  TORCH_CHECK(requested >= 0 && requested <= 3, "isa ", requested,
              " is not one of 0 (portable), 1 (avx2), 2 (avx512), 3 (amx)");
  return static_cast<Isa>(std::min<int64_t>(requested, static_cast<int64_t>(best_isa())));
}

constexpr int64_t kTile = 8;    // output rows per tile
constexpr int64_t kBlock = 32;  // k per block
constexpr int64_t kQ4Bytes = 4 * 32 + 2 * 16;
constexpr int64_t kQ4FBytes = 4 * 32 + 2 * 32;
constexpr int64_t kQ8HBytes = 8 * 32 + 2 * 32;
constexpr int64_t kQ8Bytes = 8 * 32 + 16;
constexpr int64_t kBF16Bytes = 32 * 8 * 2;

enum class Kind { Q4, Q8, BF16, Q4F, Q8H };

// Q4 and Q4F share their nibbles' layout; only their scales' type differs.
constexpr bool is_q4(Kind k) { return k == Kind::Q4 || k == Kind::Q4F; }
// Q4F's and Q8H's scales are float32 (the K-quants'); only Q4 and Q8 have
// int8-activation kernels.
constexpr bool float_scales(Kind k) { return k == Kind::Q4F || k == Kind::Q8H; }

// Whether quant_linear has an int8-activation kernel for the kind: every
// integer one (Q8H sums each half block apart), not BF16.
constexpr bool takes_int8(Kind k) { return k != Kind::BF16; }

constexpr int64_t tile_block_bytes(Kind k) {
  return k == Kind::Q4    ? kQ4Bytes
         : k == Kind::Q4F ? kQ4FBytes
         : k == Kind::Q8  ? kQ8Bytes
         : k == Kind::Q8H ? kQ8HBytes
                          : kBF16Bytes;
}
constexpr int64_t scales_offset(Kind k) { return is_q4(k) ? 128 : 256; }

inline Kind kind_of(const at::Tensor& packed) {
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 3 && packed.is_contiguous(),
              "packed weights must be a contiguous uint8 [tiles, blocks, bytes] tensor");
  const int64_t bytes = packed.size(2);
  TORCH_CHECK(bytes == kQ4Bytes || bytes == kQ8Bytes || bytes == kBF16Bytes ||
                  bytes == kQ4FBytes || bytes == kQ8HBytes,
              "packed tile blocks of ", bytes, " bytes: expected ", kQ4Bytes, " (Q4), ", kQ8Bytes,
              " (Q8), ", kBF16Bytes, " (BF16), ", kQ4FBytes, " (Q4F) or ", kQ8HBytes, " (Q8H)");
  if (bytes == kQ4FBytes) return Kind::Q4F;
  if (bytes == kQ8HBytes) return Kind::Q8H;
  return bytes == kQ4Bytes ? Kind::Q4 : bytes == kQ8Bytes ? Kind::Q8 : Kind::BF16;
}

inline float half_to_float(uint16_t bits) { return c10::Half(bits, c10::Half::from_bits()); }
inline uint16_t float_to_half(float v) { return c10::Half(v).x; }

// Where output j's bfloat16 weight at k (0..31) lies in a BF16 tile block.
constexpr int64_t bf16_offset(int64_t j, int64_t k) {
  return ((k / 2) * kTile + j) * 4 + (k % 2) * 2;
}

// bfloat16 weight of output j, k (0..31) in a BF16 tile block.
inline float tile_bf16(const uint8_t* blk, int64_t j, int64_t k) {
  uint16_t half;
  std::memcpy(&half, blk + bf16_offset(j, k), 2);
  const uint32_t bits = static_cast<uint32_t>(half) << 16;
  float value;
  std::memcpy(&value, &bits, 4);
  return value;
}

// The quantized value of output j, k (0..31) in a Q4 or Q8 tile block.
inline int tile_q(const uint8_t* blk, Kind kind, int64_t j, int64_t k) {
  const int64_t g = k / 4, i = k % 4;
  if (is_q4(kind)) return (blk[(g % 4) * 32 + j * 4 + i] >> (g < 4 ? 0 : 4)) & 0x0F;
  return static_cast<int8_t>(blk[g * 32 + j * 4 + i]);
}

// dw[j] and (Q4) mw[j] of a tile block, as float.
inline float tile_d(const uint8_t* blk, Kind kind, int64_t j) {
  if (kind == Kind::Q4F) return reinterpret_cast<const float*>(blk + scales_offset(kind))[j];
  return half_to_float(reinterpret_cast<const uint16_t*>(blk + scales_offset(kind))[j]);
}
inline float tile_m(const uint8_t* blk, Kind kind, int64_t j) {
  if (!is_q4(kind)) return 0.f;
  if (kind == Kind::Q4F) return reinterpret_cast<const float*>(blk + scales_offset(kind))[kTile + j];
  return half_to_float(reinterpret_cast<const uint16_t*>(blk + scales_offset(kind))[kTile + j]);
}

#ifdef TANDEM_QUANT_AVX2
// A decode step reads each weight once, in short runs (NV tiles' blocks
// side by side, then the next NV tiles'), which the hardware prefetcher
// (restarting at every 4 KiB page) follows late. The kernels prefetch the
// next group's block while they multiply this one's: `ahead` bytes on.
inline void prefetch_block(const uint8_t* blk, int64_t ahead, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64)
    _mm_prefetch(reinterpret_cast<const char*>(blk + ahead + off), _MM_HINT_T0);
}
#endif

// Where a kernel writes: out rows (stride apart), an optional bias, and the
// number of valid outputs in the last tile (1..8).
struct OutTile {
  float* out;
  int64_t stride;
  const float* bias;
  int64_t cols;
  int64_t tiles;

  void store(int64_t m, int64_t t, const float* acc) const {
    float* dst = out + m * stride + t * kTile;
    const int64_t n = t == tiles - 1 ? cols : kTile;
    for (int64_t j = 0; j < n; ++j) dst[j] = acc[j] + (bias ? bias[t * kTile + j] : 0.f);
  }

#ifdef TANDEM_QUANT_AVX2
  // A micro-kernel's sums, acc[m][v]: rows m0.. times tiles t.. .
  // Whole tiles as one vector store each: store()'s loop over 8 floats
  // compiles to a call to memcpy where there is no bias (4.6% of a
  // 64-request run, measured).
  template <int MR, int NV>
  void store_all(int64_t m0, int64_t t, const __m256 (&acc)[MR][NV]) const {
    alignas(32) float row[kTile];
    for (int m = 0; m < MR; ++m)
      for (int v = 0; v < NV; ++v) {
        if (t + v == tiles - 1 && cols != kTile) {  // the last, partial tile
          _mm256_store_ps(row, acc[m][v]);
          store(m0 + m, t + v, row);
          continue;
        }
        __m256 r = acc[m][v];
        if (bias) r = _mm256_add_ps(r, _mm256_loadu_ps(bias + (t + v) * kTile));
        _mm256_storeu_ps(out + (m0 + m) * stride + (t + v) * kTile, r);
      }
  }
#endif
};

// Checks the shapes of quant_linear's arguments; the OutTile it writes.
OutTile check_quant_linear(const at::Tensor& out, const at::Tensor& x, const at::Tensor& packed,
                           const c10::optional<at::Tensor>& bias);

// The float32 value of output j, k (0..31) in a tile block.
inline float tile_value(const uint8_t* blk, Kind kind, int64_t j, int64_t k) {
  if (kind == Kind::BF16) return tile_bf16(blk, j, k);
  // One rounding, as gguf's d * q + m (the product is exact; Q4_K's too).
  const float d = kind == Kind::Q8H
                      ? reinterpret_cast<const float*>(blk + scales_offset(kind))[(k / 16) * kTile + j]
                      : tile_d(blk, kind, j);
  return std::fma(d, static_cast<float>(tile_q(blk, kind, j, k)), tile_m(blk, kind, j));
}

// quant_linear_int8.cpp: activations quantized to int8 on the fly (Q4, Q8).
void quant_linear_int8(const OutTile& o, const at::Tensor& x, const at::Tensor& packed, Isa isa);
// The same with x = silu(gate) * up for gate_up = [gate | up] (the MLP's down
// projection), the activation quantized as it is computed.
void quant_linear_int8_silu(const OutTile& o, const at::Tensor& gate_up, const at::Tensor& packed,
                            Isa isa);

#ifdef TANDEM_QUANT_AVX512_BF16
// quant_linear_bf16.cpp: BF16 weights times inputs rounded to bfloat16, by
// AVX512_BF16's dot products (float32 sums).
void quant_linear_bf16_dot(const OutTile& o, const at::Tensor& x, const at::Tensor& packed);
#endif

}  // namespace tandem_quant
