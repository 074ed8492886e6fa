// Repacking GGUF blocks (and bfloat16 weights) into Tandem's tiles
// (quant_tiles.h), and expanding
// tiles back to float32 rows (embedding lookups, references, fallbacks).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>

#include "cpu_ops.h"
#include "quant_tiles.h"

using namespace tandem_quant;

namespace {

// GGML type ids (ggml.h), as GGUF stores them.
constexpr int64_t kGgmlQ4_0 = 2, kGgmlQ4_1 = 3, kGgmlQ5_0 = 6, kGgmlQ8_0 = 8, kGgmlQ4_K = 12,
                  kGgmlQ6_K = 14;
// A Q4_K super-block: float16 d, dmin, 12 bytes of 6-bit scales and mins,
// 128 bytes of nibbles; 256 k in 8 sub-blocks of 32 (one tile block each).
// A Q6_K one: 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8
// scales (one per 16 k), float16 d; 256 k, 8 tile blocks.
constexpr int64_t kQ4KBytes = 144, kQ6KBytes = 210, kKQuantTileBlocks = 8;

int64_t gguf_block_bytes(int64_t type) {
  if (type == kGgmlQ4_0) return 18;
  if (type == kGgmlQ4_1) return 20;
  if (type == kGgmlQ8_0) return 34;
  if (type == kGgmlQ5_0) return 22;
  if (type == kGgmlQ4_K) return kQ4KBytes;
  if (type == kGgmlQ6_K) return kQ6KBytes;
  TORCH_CHECK(false, "GGML type ", type,
              " is not a supported block format (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K)");
}

Kind kind_of_type(int64_t type) {
  if (type == kGgmlQ4_K) return Kind::Q4F;
  if (type == kGgmlQ6_K) return Kind::Q8H;
  // Q5_0's q - 16 (-16..15) are int8 Q8 values under the same float16 d.
  return type == kGgmlQ8_0 || type == kGgmlQ5_0 ? Kind::Q8 : Kind::Q4;
}

// One GGUF block: float16 d, (Q4_1) float16 m, (Q5_0) 32 high bits, then
// the quants. Q4, Q5_0: the low nibbles of qs[0..15] are k = 0..15, the
// high nibbles k = 16..31; Q5_0's fifth bit of k is bit k of its high bits,
// its value d * (q - 16).
struct GgufBlock {
  const uint8_t* p;
  int64_t type;
  uint16_t half_at(int64_t offset) const {
    uint16_t v;
    std::memcpy(&v, p + offset, 2);
    return v;
  }
  int q(int64_t k) const {
    if (type == kGgmlQ8_0) return static_cast<int8_t>(p[2 + k]);
    const uint8_t* qs = p + (type == kGgmlQ4_1 ? 4 : type == kGgmlQ5_0 ? 6 : 2);
    const int low = k < 16 ? (qs[k] & 0x0F) : (qs[k - 16] >> 4);
    if (type != kGgmlQ5_0) return low;
    uint32_t high;
    std::memcpy(&high, p + 2, 4);
    return (low | static_cast<int>((high >> k) & 1) << 4) - 16;
  }
};

void pack_tile_block(uint8_t* dst, const uint8_t* const* rows, int64_t b, int64_t type,
                     int64_t block_bytes) {
  const Kind kind = kind_of_type(type);
  uint16_t* scales = reinterpret_cast<uint16_t*>(dst + scales_offset(kind));
  for (int64_t j = 0; j < kTile; ++j) {
    if (rows[j] == nullptr) continue;  // padding past the last output row: zeros
    const GgufBlock blk{rows[j] + b * block_bytes, type};
    const uint16_t d = blk.half_at(0);
    scales[j] = d;
    if (kind == Kind::Q4)
      scales[kTile + j] =
          type == kGgmlQ4_1 ? blk.half_at(2) : float_to_half(-8.f * half_to_float(d));
    for (int64_t k = 0; k < kBlock; ++k) {
      const int64_t g = k / 4, i = k % 4;
      if (kind == Kind::Q4)
        dst[(g % 4) * 32 + j * 4 + i] |= static_cast<uint8_t>(blk.q(k) << (g < 4 ? 0 : 4));
      else
        dst[g * 32 + j * 4 + i] = static_cast<uint8_t>(static_cast<int8_t>(blk.q(k)));
    }
  }
}

// Tile block b (sub-block b % 8 of super-block b / 8) of Q4_K rows: dw =
// d * scale and mw = -dmin * min in float32, exact (gguf's dequantizer
// computes them in float32 too). Scales and mins are llama.cpp's
// get_scale_min_k4: sub-blocks 0-3 in the low 6 bits of bytes 0-3 and 4-7,
// 4-7 in bytes 8-11's nibbles with their high 2 bits in bytes 0-3 and 4-7's.
void pack_q4_k_tile_block(uint8_t* dst, const uint8_t* const* rows, int64_t b) {
  float* scales = reinterpret_cast<float*>(dst + scales_offset(Kind::Q4F));
  const int64_t i = b % kKQuantTileBlocks;
  for (int64_t j = 0; j < kTile; ++j) {
    if (rows[j] == nullptr) continue;  // padding past the last output row: zeros
    const uint8_t* p = rows[j] + (b / kKQuantTileBlocks) * kQ4KBytes;
    const GgufBlock blk{p, kGgmlQ4_K};
    const uint8_t* sm = p + 4;
    const int scale = i < 4 ? sm[i] & 63 : (sm[i + 4] & 15) | ((sm[i - 4] >> 6) << 4);
    const int min = i < 4 ? sm[i + 4] & 63 : (sm[i + 4] >> 4) | ((sm[i] >> 6) << 4);
    scales[j] = half_to_float(blk.half_at(0)) * static_cast<float>(scale);
    scales[kTile + j] = -(half_to_float(blk.half_at(2)) * static_cast<float>(min));
    // Sub-blocks 2c and 2c + 1 are the low and high nibbles of qs[32c..32c + 31].
    const uint8_t* qs = p + 16 + (i / 2) * 32;
    for (int64_t k = 0; k < kBlock; ++k) {
      const int64_t g = k / 4, n = k % 4;
      const int q = (qs[k] >> (i % 2 == 0 ? 0 : 4)) & 0x0F;
      dst[(g % 4) * 32 + j * 4 + n] |= static_cast<uint8_t>(q << (g < 4 ? 0 : 4));
    }
  }
}

// Tile block b (k = 32i.. of super-block b / 8, i = b % 8) of Q6_K rows as
// Q8H: the int8 q - 32 (q = low nibble | high pair << 4), dw = d * scale
// in float32 for each half of 16, exact. k = 128h + 64s + l takes nibble s
// of ql[64h + l]; k = 128h + 32s + l takes pair s of qh[32h + l] (gguf's
// dequantizer, llama.cpp's dequantize_row_q6_K).
void pack_q6_k_tile_block(uint8_t* dst, const uint8_t* const* rows, int64_t b) {
  float* scales = reinterpret_cast<float*>(dst + scales_offset(Kind::Q8H));
  const int64_t i = b % kKQuantTileBlocks;
  for (int64_t j = 0; j < kTile; ++j) {
    if (rows[j] == nullptr) continue;  // padding past the last output row: zeros
    const uint8_t* p = rows[j] + (b / kKQuantTileBlocks) * kQ6KBytes;
    const uint8_t *ql = p, *qh = p + 128;
    const int8_t* sc = reinterpret_cast<const int8_t*>(p + 192);
    const float d = half_to_float(GgufBlock{p, kGgmlQ6_K}.half_at(208));
    for (int64_t h = 0; h < 2; ++h) scales[h * kTile + j] = d * static_cast<float>(sc[2 * i + h]);
    for (int64_t k = 0; k < kBlock; ++k) {
      const int64_t e = 32 * i + k, half = e / 128, r = e % 128;
      const int low = (ql[64 * half + r % 64] >> (4 * (r / 64))) & 0x0F;
      const int high = (qh[32 * half + r % 32] >> (2 * (r / 32))) & 0x03;
      dst[(k / 4) * 32 + j * 4 + k % 4] = static_cast<uint8_t>(static_cast<int8_t>((low | (high << 4)) - 32));
    }
  }
}

}  // namespace

at::Tensor pack_gguf_blocks(at::Tensor raw, int64_t ggml_type) {
  const int64_t block_bytes = gguf_block_bytes(ggml_type);
  TORCH_CHECK(raw.scalar_type() == at::kByte && raw.dim() == 2 && raw.is_contiguous(),
              "raw GGUF rows must be a contiguous uint8 [rows, bytes] tensor");
  TORCH_CHECK(raw.size(1) % block_bytes == 0, "GGUF rows of ", raw.size(1),
              " bytes are not whole blocks of ", block_bytes);
  const bool k_quant = ggml_type == kGgmlQ4_K || ggml_type == kGgmlQ6_K;
  const int64_t per_block = k_quant ? kKQuantTileBlocks : 1;
  const int64_t N = raw.size(0), nb = raw.size(1) / block_bytes * per_block;
  const int64_t row_bytes = raw.size(1), tiles = (N + kTile - 1) / kTile;
  const int64_t bytes = tile_block_bytes(kind_of_type(ggml_type));
  at::Tensor packed = at::zeros({tiles, nb, bytes}, raw.options());
  const uint8_t* src = raw.data_ptr<uint8_t>();
  uint8_t* dst = packed.data_ptr<uint8_t>();
  at::parallel_for(0, tiles, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const uint8_t* rows[kTile];
      for (int64_t j = 0; j < kTile; ++j)
        rows[j] = t * kTile + j < N ? src + (t * kTile + j) * row_bytes : nullptr;
      for (int64_t b = 0; b < nb; ++b) {
        if (ggml_type == kGgmlQ4_K)
          pack_q4_k_tile_block(dst + (t * nb + b) * bytes, rows, b);
        else if (ggml_type == kGgmlQ6_K)
          pack_q6_k_tile_block(dst + (t * nb + b) * bytes, rows, b);
        else
          pack_tile_block(dst + (t * nb + b) * bytes, rows, b, ggml_type, block_bytes);
      }
    }
  });
  return packed;
}

at::Tensor pack_bf16(at::Tensor weight) {
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.dim() == 2,
              "weight must be a bfloat16 [out, in] tensor");
  const int64_t N = weight.size(0), K = weight.size(1);
  const int64_t nb = (K + kBlock - 1) / kBlock, tiles = (N + kTile - 1) / kTile;
  const at::Tensor w = weight.contiguous();
  at::Tensor packed = at::zeros({tiles, nb, kBF16Bytes}, weight.options().dtype(at::kByte));
  const uint16_t* src = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  uint8_t* dst = packed.data_ptr<uint8_t>();
  at::parallel_for(0, tiles, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t j = 0; j < kTile && t * kTile + j < N; ++j)
        for (int64_t k = 0; k < K; ++k)
          std::memcpy(dst + (t * nb + k / kBlock) * kBF16Bytes + bf16_offset(j, k % kBlock),
                      src + (t * kTile + j) * K + k, 2);
  });
  return packed;
}

at::Tensor dequantize_rows(at::Tensor packed, at::Tensor rows, int64_t in_features) {
  const Kind kind = kind_of(packed);
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1 && rows.is_contiguous(),
              "rows must be contiguous int64 [R]");
  const int64_t nb = packed.size(1), bytes = packed.size(2), R = rows.size(0);
  const int64_t limit = packed.size(0) * kTile;
  TORCH_CHECK(in_features > 0 && in_features <= nb * kBlock,
              "in_features must fit the weight's blocks");
  at::Tensor out = at::empty({R, in_features}, packed.options().dtype(at::kFloat));
  const int64_t* ids = rows.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r)
    TORCH_CHECK(ids[r] >= 0 && ids[r] < limit, "row ", ids[r], " outside the weight");
  const uint8_t* base = packed.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, R, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t t = ids[r] / kTile, j = ids[r] % kTile;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = base + (t * nb + b) * bytes;
        for (int64_t k = 0; k < kBlock && b * kBlock + k < in_features; ++k)
          op[r * in_features + b * kBlock + k] = tile_value(blk, kind, j, k);
      }
    }
  });
  return out;
}
