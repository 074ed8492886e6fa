// quant_linear for many rows (prefill chunks, big decode batches): the
// weight is expanded to float32 a panel of outputs at a time (k-major, the
// layout the expansion produces) and multiplied by ATen's GEMM (MKL on x86).
//
// The few-row kernels expand each weight vector in registers and reuse it
// for at most 8 rows; that runs at roughly half the FMA units' rate, which
// is right when the weights' bytes are the cost (decode) but loses to a
// tuned GEMM once there are rows enough: here the expansion is one pass over
// the weight, paid once for all M rows. The values are the same expanded
// floats, so only the order of the additions differs.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>

#include "quant_expand.h"

namespace tandem_quant {
namespace {

// Outputs per panel: 256 x K float32 (0.6-1.5 MB for these models' K) stays
// in cache between its expansion and its GEMM (32 tiles measured a little
// ahead of 16 and 64).
constexpr int64_t kPanelTiles = 32;

template <Kind K>
void expand_panel(const uint8_t* base, int64_t nb, int64_t t0, int64_t t1, float* dst,
                  int64_t ld, Isa isa) {
  constexpr int64_t bytes = tile_block_bytes(K);
  at::parallel_for(t0, t1, 4, [&](int64_t a, int64_t b) {
    for (int64_t t = a; t < b; ++t)
      for (int64_t blk = 0; blk < nb; ++blk)
        expand_block<K>(base + (t * nb + blk) * bytes, dst + blk * kBlock * ld + (t - t0) * kTile,
                        ld, isa);
  });
}

// The weight's [K, tiles * 8] float32 expansion (k-major), every tile at once.
at::Tensor expand_all(const at::Tensor& packed, Isa isa) {
  const uint8_t* base = packed.data_ptr<uint8_t>();
  const int64_t tiles = packed.size(0), nb = packed.size(1), ld = tiles * kTile;
  at::Tensor w = at::empty({nb * kBlock, ld}, at::kFloat);
  float* dst = w.data_ptr<float>();
  switch (kind_of(packed)) {
    case Kind::Q4: expand_panel<Kind::Q4>(base, nb, 0, tiles, dst, ld, isa); break;
    case Kind::Q4F: expand_panel<Kind::Q4F>(base, nb, 0, tiles, dst, ld, isa); break;
    case Kind::Q8: expand_panel<Kind::Q8>(base, nb, 0, tiles, dst, ld, isa); break;
    case Kind::Q8H: expand_panel<Kind::Q8H>(base, nb, 0, tiles, dst, ld, isa); break;
    case Kind::BF16: expand_panel<Kind::BF16>(base, nb, 0, tiles, dst, ld, isa); break;
  }
  return w;
}

// Rows amx_bf16_gemm multiplies at once.
constexpr int64_t kAmxBf16ChunkRows = 2048;

// amx_bf16_gemm's row threshold; 0 turns the path off (set_amx_bf16_gemm_rows).
std::atomic<int64_t> amx_bf16_rows{kAmxBf16GemmRows};

}  // namespace

int64_t amx_bf16_gemm_rows() { return amx_bf16_rows.load(); }

int64_t set_amx_bf16_gemm_rows(int64_t rows) {
  TORCH_CHECK(rows >= 0, "rows must be >= 0 (0: off), got ", rows);
  return amx_bf16_rows.exchange(rows);
}

bool amx_bf16_gemm_takes(int64_t rows, Isa isa) {
#ifdef TANDEM_QUANT_AMX_BF16
  const int64_t from = amx_bf16_rows.load();
  return isa == Isa::Amx && from > 0 && rows >= from;
#else
  (void)rows;
  (void)isa;
  return false;
#endif
}

void amx_bf16_gemm(const at::Tensor& out, const at::Tensor& x, const at::Tensor& packed,
                   const c10::optional<at::Tensor>& bias, Isa isa) {
  const int64_t M = x.size(0), N = out.size(1), padded = packed.size(1) * kBlock;
  const at::Tensor w = expand_all(packed, isa).narrow(1, 0, N).to(at::kBFloat16);
  // oneDNN's bfloat16 matmul (AMX tiles) writes bfloat16, widened into out a
  // chunk of rows at a time: one [8192, 3072] product in bfloat16 was 50 MB
  // of fresh pages each call, a [2048, N] one stays in cache and is reused.
  const int64_t chunk = std::min<int64_t>(M, kAmxBf16ChunkRows);
  at::Tensor product = at::empty({chunk, N}, x.options().dtype(at::kBFloat16));
  for (int64_t m0 = 0; m0 < M; m0 += chunk) {
    const int64_t m = std::min(chunk, M - m0);
    at::Tensor xb = x.narrow(0, m0, m).to(at::kBFloat16);
    if (xb.size(1) != padded) xb = at::constant_pad_nd(xb, {0, padded - xb.size(1)});
    at::Tensor part = product.narrow(0, 0, m);
    at::mm_out(part, xb, w);
    at::Tensor rows = out.narrow(0, m0, m);
    rows.copy_(part);
    if (bias.has_value()) rows.add_(*bias);
  }
}

void quant_gemm(at::Tensor out, const at::Tensor& x, const at::Tensor& packed,
                const c10::optional<at::Tensor>& bias, Isa isa) {
  const Kind kind = kind_of(packed);
  const uint8_t* base = packed.data_ptr<uint8_t>();
  const int64_t tiles = packed.size(0), nb = packed.size(1), N = out.size(1);
  const int64_t panel_tiles = std::min(tiles, kPanelTiles), ld = panel_tiles * kTile;
  // x is padded to whole blocks (nb * 32 columns), as the panel's rows are.
  at::Tensor panel = at::empty({nb * kBlock, ld}, x.options());
  for (int64_t t0 = 0; t0 < tiles; t0 += panel_tiles) {
    const int64_t t1 = std::min(tiles, t0 + panel_tiles);
    float* dst = panel.data_ptr<float>();
    switch (kind) {
      case Kind::Q4: expand_panel<Kind::Q4>(base, nb, t0, t1, dst, ld, isa); break;
      case Kind::Q4F: expand_panel<Kind::Q4F>(base, nb, t0, t1, dst, ld, isa); break;
      case Kind::Q8: expand_panel<Kind::Q8>(base, nb, t0, t1, dst, ld, isa); break;
      case Kind::Q8H: expand_panel<Kind::Q8H>(base, nb, t0, t1, dst, ld, isa); break;
      case Kind::BF16: expand_panel<Kind::BF16>(base, nb, t0, t1, dst, ld, isa); break;
    }
    const int64_t n0 = t0 * kTile, n = std::min(N, t1 * kTile) - n0;
    at::Tensor slice = out.narrow(1, n0, n);
    if (bias.has_value())
      at::addmm_out(slice, bias->narrow(0, n0, n), x, panel.narrow(1, 0, n));
    else
      at::mm_out(slice, x, panel.narrow(1, 0, n));
  }
}

}  // namespace tandem_quant
