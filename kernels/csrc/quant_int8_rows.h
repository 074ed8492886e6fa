// Input rows quantized to int8 in blocks of 32, as quant_linear_int8.cpp
// makes them and its kernels (VNNI, AMX) read them.
#pragma once
#include <cstdint>

#include "quant_tiles.h"

namespace tandem_quant {

// Each row of x quantized in blocks of 32: q int8 [rows, nb * 32] (zero past
// K), d and s float [rows, nb], where rows is M or, for calls the AMX kernel
// takes, M rounded up to kAmxPadRows with the rows past M zeros (its tiles
// never read past the end); qsum (sum of a block's q) int32 [M, nb].
struct QuantizedRows {
  const int8_t* q;
  const float *d, *s;
  const int32_t* qsum;     // per block: sum of its 32 q
  const int32_t* qsum_lo;  // per block: sum of its first 16 q (Q8H's halves)
  int64_t nb;
};

// Rows an AMX tile holds; the AMX kernel takes two tiles of rows at once,
// and q, d and s are padded to a multiple of those.
constexpr int64_t kAmxRows = 16;
constexpr int64_t kAmxPadRows = 2 * kAmxRows;

#ifdef TANDEM_QUANT_AMX
// Whether the OS lets this process use AMX's tile registers (Linux asks
// each process to request them once: arch_prctl(ARCH_REQ_XCOMP_PERM)).
bool amx_usable();
// From this many rows quant_linear's int8 path runs signed 8-bit weights on
// AMX tiles (below, the two 16-row tiles of rows are mostly padding).
constexpr int64_t kAmxMinRows = 32;
// Whether `kind` has an AMX kernel (quant_linear_amx.cpp says why Q4 not).
constexpr bool amx_takes(Kind kind) { return kind == Kind::Q8 || kind == Kind::Q8H; }
// y = x @ w.T for Q8 and Q8H tiles on AMX: the same sums as the VNNI
// kernels, in the same order, so the same floats.
void amx_int8_linear(Kind kind, const uint8_t* base, int64_t tiles, int64_t nb,
                     const QuantizedRows& x, int64_t M, const OutTile& o);
#endif

}  // namespace tandem_quant
