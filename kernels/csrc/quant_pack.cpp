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
constexpr int64_t kGgmlQ4_0 = 2, kGgmlQ4_1 = 3, kGgmlQ8_0 = 8;

int64_t gguf_block_bytes(int64_t type) {
  if (type == kGgmlQ4_0) return 18;
  if (type == kGgmlQ4_1) return 20;
  if (type == kGgmlQ8_0) return 34;
  TORCH_CHECK(false, "GGML type ", type, " is not a supported block format (Q4_0, Q4_1, Q8_0)");
}

// One GGUF block: float16 d, (Q4_1) float16 m, then the quants. Q4: the
// low nibbles of qs[0..15] are k = 0..15, the high nibbles k = 16..31.
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
    const uint8_t* qs = p + (type == kGgmlQ4_1 ? 4 : 2);
    return k < 16 ? (qs[k] & 0x0F) : (qs[k - 16] >> 4);
  }
};

void pack_tile_block(uint8_t* dst, const uint8_t* const* rows, int64_t b, int64_t type,
                     int64_t block_bytes) {
  const Kind kind = type == kGgmlQ8_0 ? Kind::Q8 : Kind::Q4;
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

}  // namespace

at::Tensor pack_gguf_blocks(at::Tensor raw, int64_t ggml_type) {
  const int64_t block_bytes = gguf_block_bytes(ggml_type);
  TORCH_CHECK(raw.scalar_type() == at::kByte && raw.dim() == 2 && raw.is_contiguous(),
              "raw GGUF rows must be a contiguous uint8 [rows, bytes] tensor");
  TORCH_CHECK(raw.size(1) % block_bytes == 0, "GGUF rows of ", raw.size(1),
              " bytes are not whole blocks of ", block_bytes);
  const int64_t N = raw.size(0), nb = raw.size(1) / block_bytes, row_bytes = raw.size(1);
  const int64_t tiles = (N + kTile - 1) / kTile;
  const int64_t bytes = tile_block_bytes(ggml_type == kGgmlQ8_0 ? Kind::Q8 : Kind::Q4);
  at::Tensor packed = at::zeros({tiles, nb, bytes}, raw.options());
  const uint8_t* src = raw.data_ptr<uint8_t>();
  uint8_t* dst = packed.data_ptr<uint8_t>();
  at::parallel_for(0, tiles, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const uint8_t* rows[kTile];
      for (int64_t j = 0; j < kTile; ++j)
        rows[j] = t * kTile + j < N ? src + (t * kTile + j) * row_bytes : nullptr;
      for (int64_t b = 0; b < nb; ++b)
        pack_tile_block(dst + (t * nb + b) * bytes, rows, b, ggml_type, block_bytes);
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
