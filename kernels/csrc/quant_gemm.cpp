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
#include <ATen/native/CPUBlas.h>

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

}  // namespace

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

#ifdef TANDEM_QUANT_AMX_BF16
at::Tensor pack_vnni_panels(const at::Tensor& expanded, int64_t col0, int64_t N) {
  const int64_t Kp = expanded.size(0), ld = expanded.size(1);
  const int64_t panels = (N + kAmxPanel - 1) / kAmxPanel;
  at::Tensor packed = at::zeros({panels, Kp / 2, kAmxPanel, 2}, at::kBFloat16);
  const float* src = expanded.data_ptr<float>();
  auto* dst = reinterpret_cast<uint16_t*>(packed.data_ptr());
  // 32 bfloat16 of [row 2i: 0..15 | row 2i + 1: 0..15] -> pairs (2i, 2i + 1).
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                              24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1,
                                              16, 0);
  at::parallel_for(0, panels * (Kp / 2), 64, [&](int64_t a, int64_t b) {
    for (int64_t task = a; task < b; ++task) {
      const int64_t p = task / (Kp / 2), i = task % (Kp / 2);
      const int64_t n0 = p * kAmxPanel, width = std::min(kAmxPanel, N - n0);
      const float* r0 = src + 2 * i * ld + col0 + n0;
      const float* r1 = r0 + ld;
      uint16_t* out = dst + (p * (Kp / 2) + i) * kAmxPanel * 2;
      for (int64_t j = 0; j < width; j += 16) {
        const __mmask16 live = static_cast<__mmask16>(
            width - j >= 16 ? 0xFFFF : (1u << (width - j)) - 1);
        const __m512 lo = _mm512_maskz_loadu_ps(live, r0 + j);
        const __m512 hi = _mm512_maskz_loadu_ps(live, r1 + j);
        const __m512i both = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo));
        _mm512_storeu_si512(out + 2 * j, _mm512_permutexvar_epi16(interleave, both));
      }
    }
  });
  return packed;
}

at::Tensor bf16_rows(const at::Tensor& x, int64_t Kp) {
  at::Tensor xb = x.to(at::kBFloat16);
  if (xb.size(1) != Kp) xb = at::constant_pad_nd(xb, {0, Kp - xb.size(1)});
  return xb.contiguous();
}

void add_bias(float* c, int64_t ldc, const float* bias, int64_t m, int64_t n) {
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) c[i * ldc + j] += bias[j];
}
#endif

namespace {

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
#ifdef TANDEM_QUANT_AMX_BF16
  const int64_t M = x.size(0), N = out.size(1), Kp = packed.size(1) * kBlock;
  const at::Tensor w = pack_vnni_panels(expand_all(packed, isa), 0, N);
  const at::Tensor xb = bf16_rows(x, Kp);
  const auto* a_base = reinterpret_cast<const at::BFloat16*>(xb.data_ptr());
  const auto* b_base = reinterpret_cast<const at::BFloat16*>(w.data_ptr());
  float* c_base = out.data_ptr<float>();
  const int64_t ldc = out.stride(0), panels = w.size(0);
  const float* bias_ptr = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  const int64_t row_blocks = (M + kAmxRowBlock - 1) / kAmxRowBlock;
  at::parallel_for(0, row_blocks, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t m0 = r * kAmxRowBlock, m = std::min(kAmxRowBlock, M - m0);
      for (int64_t p = 0; p < panels; ++p) {
        const int64_t n0 = p * kAmxPanel, n = std::min(kAmxPanel, N - n0);
        float* c = c_base + m0 * ldc + n0;
        at::native::cpublas::brgemm(m, n, Kp, Kp, kAmxPanel, ldc, /*add_C=*/false,
                                    a_base + m0 * Kp, b_base + p * Kp * kAmxPanel, c);
        if (bias_ptr != nullptr) add_bias(c, ldc, bias_ptr + n0, m, n);
      }
    }
    at::native::cpublas::brgemm_release();
  });
#else
  (void)out, (void)x, (void)packed, (void)bias, (void)isa;
  TORCH_CHECK(false, "amx_bf16_gemm: this build has no AMX-BF16");
#endif
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
