// quant_linear's int8 path on AMX tiles (Intel Xeons from Sapphire Rapids)
// for signed 8-bit weights (Q8: Q8_0, Q5_0, int8; Q8H: Q6_K): one TDPBSSD
// multiplies 16 quantized input rows by a block of 16 outputs, 16 x 16 x 32
// multiply-adds an instruction, where VNNI's vpdpbusd does 64.
//
// The sums are the VNNI kernels' (quant_linear_int8.cpp): each (row, weight
// block) pair's integer dot product, scaled by dw * dx and added in block
// order, Q8H's halves one after the other. So the floats equal the avx512
// path's bit for bit; only the speed differs.
//
// Every block has its own scales, so each 16 x 16 product goes through
// memory to be scaled by vector code: that round trip, not the tile unit,
// bounds the speed (benchmarks/amx_int8_bench.py: 1.2-1.5x VNNI from 32
// rows on, for Q8 and Q8H). Q4's nibbles, widened to bytes for the tiles,
// gained 0.9-1.2x and stay on VNNI, as do calls of fewer than kAmxMinRows
// rows (decode steps, bound by reading the weights).
//
// A tile of weights is 16 outputs x 4 consecutive k a row (the "VNNI
// layout"); Tandem's tiles hold 8 outputs x 4 k a 32-byte group
// (quant_tiles.h), so each group of 4 weight tiles (32 outputs) is copied
// once a call into two such B tiles a block, then reused by every 32 rows.
// Tile registers: tmm0-1 two A tiles (32 rows), tmm2-3 two B tiles (32
// outputs), tmm4-7 their four products.
#include <ATen/Parallel.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "quant_int8_rows.h"

#ifdef TANDEM_QUANT_AMX
#include <sys/syscall.h>
#include <unistd.h>

namespace tandem_quant {

bool amx_usable() {
  static const bool usable = [] {
    const char* wanted = std::getenv("TANDEM_AMX");  // "0": stay on VNNI
    if (wanted != nullptr && std::string(wanted) == "0") return false;
    constexpr int kGetPerm = 0x1022, kRequestPerm = 0x1023, kTileData = 18;
    if (syscall(SYS_arch_prctl, kRequestPerm, kTileData) != 0) return false;
    unsigned long granted = 0;
    if (syscall(SYS_arch_prctl, kGetPerm, &granted) != 0) return false;
    return (granted & (1UL << kTileData)) != 0;
  }();
  return usable;
}

namespace {

constexpr int64_t kGroupTiles = 4;                      // weight tiles a pass computes
constexpr int64_t kGroupCols = kGroupTiles * kTile;     // their 32 outputs
constexpr int64_t kBRowBytes = 64;                      // 16 outputs x 4 k
constexpr int64_t kBlockBBytes = 2 * 8 * kBRowBytes;    // a block's two B tiles (32 k)
constexpr int64_t kRowChunk = 512;                      // rows per repacking of a group (of kAmxPadRows)

// Q8H's halves of 16 k have their own scales, so each is its own product.
template <Kind K>
constexpr int64_t kParts = K == Kind::Q8H ? 2 : 1;
template <Kind K>
constexpr int64_t kPartK = kBlock / kParts<K>;
template <Kind K>
constexpr int64_t kBRows = kPartK<K> / 4;
// A block's scales, float: dw per part, 32 outputs each.
template <Kind K>
constexpr int64_t kScaleFloats = kParts<K> * kGroupCols;

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

template <Kind K>
TileConfig tile_config() {
  TileConfig c;
  for (int a : {0, 1}) c.rows[a] = kAmxRows, c.colsb[a] = kPartK<K>;
  for (int b : {2, 3}) c.rows[b] = kBRows<K>, c.colsb[b] = kBRowBytes;
  for (int p : {4, 5, 6, 7}) c.rows[p] = kAmxRows, c.colsb[p] = kBRowBytes;
  return c;
}

// A static object: GCC 12 drops stores to a local one that only
// ldtilecfg reads (the instruction then faults on the half-written shapes).
template <Kind K>
void configure_tiles() {
  static const TileConfig config = tile_config<K>();
  _tile_loadconfig(&config);
}

// Weight tiles t0..t0+3, every block, into B tiles and float scales. Tile
// v's 8 outputs are columns (v % 2) * 8.. of B tile v / 2; absent tiles
// (past the last) are zeros.
template <Kind K>
void repack_group(const uint8_t* base, int64_t tiles, int64_t nb, int64_t t0, uint8_t* b_out,
                  float* s_out) {
  static_assert(K == Kind::Q8 || K == Kind::Q8H, "signed 8-bit weights only");
  constexpr int64_t bytes = tile_block_bytes(K);
  for (int64_t b = 0; b < nb; ++b) {
    uint8_t* dst = b_out + b * kBlockBBytes;
    float* sc = s_out + b * kScaleFloats<K>;
    for (int64_t v = 0; v < kGroupTiles; ++v) {
      // Group G of 4 k lands in part G / kBRows, row G % kBRows.
      auto row = [&](int64_t G) {
        const int64_t part = G / kBRows<K>, r = G % kBRows<K>;
        return reinterpret_cast<__m256i*>(dst + ((part * 2 + v / 2) * kBRows<K> + r) * kBRowBytes +
                                          (v % 2) * 32);
      };
      if (t0 + v >= tiles) {
        for (int64_t G = 0; G < 8; ++G) _mm256_storeu_si256(row(G), _mm256_setzero_si256());
        for (int64_t i = 0; i < kScaleFloats<K>; i += kGroupCols)
          std::memset(sc + i + v * kTile, 0, kTile * sizeof(float));
        continue;
      }
      const uint8_t* blk = base + ((t0 + v) * nb + b) * bytes;
      for (int64_t G = 0; G < 8; ++G)
        _mm256_storeu_si256(row(G),
                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + G * 32)));
      const uint8_t* scales = blk + scales_offset(K);
      for (int64_t which = 0; which < kScaleFloats<K> / kGroupCols; ++which) {
        const __m256 s = float_scales(K)
                             ? _mm256_loadu_ps(reinterpret_cast<const float*>(scales) + which * kTile)
                             : _mm256_cvtph_ps(_mm_loadu_si128(
                                   reinterpret_cast<const __m128i*>(scales + which * kTile * 2)));
        _mm256_storeu_ps(sc + which * kGroupCols + v * kTile, s);
      }
    }
  }
}

// Step i's integer products: part i % kParts of block i / kParts, rows m0 ..
// m0 + 32 (tmm0, tmm1) times the group's two B tiles (tmm2, tmm3), into
// tmm4-7 and then memory (c), where vector code scales them.
template <Kind K>
inline void tile_products(const QuantizedRows& x, const uint8_t* b_in, int64_t m0, int64_t i,
                          int32_t (&c)[2][2][kAmxRows][16]) {
  const int64_t stride = x.nb * kBlock, b = i / kParts<K>, part = i % kParts<K>;
  const int8_t* a = x.q + m0 * stride + b * kBlock + part * kPartK<K>;
  const uint8_t* bt = b_in + b * kBlockBBytes + part * 2 * kBRows<K> * kBRowBytes;
  _tile_zero(4);
  _tile_zero(5);
  _tile_zero(6);
  _tile_zero(7);
  _tile_loadd(0, a, stride);
  _tile_loadd(1, a + kAmxRows * stride, stride);
  _tile_loadd(2, bt, kBRowBytes);
  _tile_loadd(3, bt + kBRows<K> * kBRowBytes, kBRowBytes);
  _tile_dpbssd(4, 0, 2);
  _tile_dpbssd(5, 0, 3);
  _tile_dpbssd(6, 1, 2);
  _tile_dpbssd(7, 1, 3);
  _tile_stored(4, c[0][0], kBRowBytes);
  _tile_stored(5, c[0][1], kBRowBytes);
  _tile_stored(6, c[1][0], kBRowBytes);
  _tile_stored(7, c[1][1], kBRowBytes);
}

// acc[r] += c[r] * (dw * dx[r]): the VNNI kernels' operations.
template <Kind K>
inline void scale_into(float (&acc)[kAmxPadRows][kGroupCols], const int32_t (&c)[2][2][kAmxRows][16],
                       const float* sc, const QuantizedRows& x, int64_t m0, int64_t i) {
  const int64_t nb = x.nb, b = i / kParts<K>, part = i % kParts<K>;
  const __m512 dw0 = _mm512_load_ps(sc + part * kGroupCols);
  const __m512 dw1 = _mm512_load_ps(sc + part * kGroupCols + 16);
  const float* dx = x.d + m0 * nb + b;
  for (int r = 0; r < kAmxPadRows; ++r) {
    const int32_t(&cr)[2][kAmxRows][16] = c[r / kAmxRows];
    const __m512 d = _mm512_set1_ps(dx[r * nb]);
    _mm512_store_ps(acc[r], _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(cr[0][r % 16])),
                                            _mm512_mul_ps(dw0, d), _mm512_load_ps(acc[r])));
    _mm512_store_ps(acc[r] + 16,
                    _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(cr[1][r % 16])),
                                    _mm512_mul_ps(dw1, d), _mm512_load_ps(acc[r] + 16)));
  }
}

// Rows m0 .. m0 + 32 (`rows` of them real) times the group's 32 outputs from
// tile t0. (Issuing step i + 1's products before scaling step i, or several
// steps' before scaling them, measured no faster.)
template <Kind K>
void rows_times_group(const uint8_t* b_in, const float* s_in, const QuantizedRows& x, int64_t m0,
                      int64_t rows, int64_t t0, const OutTile& o) {
  const int64_t steps = x.nb * kParts<K>;
  alignas(64) float acc[kAmxPadRows][kGroupCols];
  alignas(64) int32_t c[2][2][kAmxRows][16];
  std::memset(acc, 0, sizeof(acc));
  for (int64_t i = 0; i < steps; ++i) {
    tile_products<K>(x, b_in, m0, i, c);
    scale_into<K>(acc, c, s_in + (i / kParts<K>) * kScaleFloats<K>, x, m0, i);
  }
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t v = 0; v < kGroupTiles && t0 + v < o.tiles; ++v) {
      const int64_t t = t0 + v;
      if (t == o.tiles - 1 && o.cols != kTile) {
        o.store(m0 + r, t, acc[r] + v * kTile);
        continue;
      }
      __m256 y = _mm256_load_ps(acc[r] + v * kTile);
      if (o.bias) y = _mm256_add_ps(y, _mm256_loadu_ps(o.bias + t * kTile));
      _mm256_storeu_ps(o.out + (m0 + r) * o.stride + t * kTile, y);
    }
}

template <Kind K>
void run_amx(const uint8_t* base, int64_t tiles, int64_t nb, const QuantizedRows& x, int64_t M,
             const OutTile& o) {
  const int64_t groups = (tiles + kGroupTiles - 1) / kGroupTiles;
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    thread_local std::vector<uint8_t> b_room;
    thread_local std::vector<float> s_room;
    if (b_room.size() < static_cast<size_t>(nb * kBlockBBytes)) b_room.resize(nb * kBlockBBytes);
    if (s_room.size() < static_cast<size_t>(nb * kScaleFloats<K>) + 16)
      s_room.resize(nb * kScaleFloats<K> + 16);
    // 64-byte aligned scales for the aligned loads above.
    float* scales = s_room.data();
    while (reinterpret_cast<uintptr_t>(scales) % 64 != 0) ++scales;
    configure_tiles<K>();
    for (int64_t c0 = 0; c0 < M; c0 += kRowChunk) {
      const int64_t c1 = std::min(M, c0 + kRowChunk);
      for (int64_t g = g0; g < g1; ++g) {
        const int64_t t0 = g * kGroupTiles;
        repack_group<K>(base, tiles, nb, t0, b_room.data(), scales);
        for (int64_t m = c0; m < c1; m += kAmxPadRows)
          rows_times_group<K>(b_room.data(), scales, x, m, std::min(kAmxPadRows, c1 - m), t0, o);
      }
    }
    _tile_release();
  });
}

}  // namespace

void amx_int8_linear(Kind kind, const uint8_t* base, int64_t tiles, int64_t nb,
                     const QuantizedRows& x, int64_t M, const OutTile& o) {
  switch (kind) {
    case Kind::Q8: return run_amx<Kind::Q8>(base, tiles, nb, x, M, o);
    case Kind::Q8H: return run_amx<Kind::Q8H>(base, tiles, nb, x, M, o);
    default: TORCH_CHECK(false, "AMX int8 tiles take signed 8-bit blocks (Q8, Q8H)");
  }
}

}  // namespace tandem_quant

#endif  // TANDEM_QUANT_AMX
