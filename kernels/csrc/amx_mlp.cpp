// A gated MLP's prefill-sized calls on AMX tiles in one pass (quant_expand.h
// amx_bf16_mlp): per block of kAmxRowBlock rows, the gate and up panels'
// products (float32, in a thread's 2 x 64 KB of scratch), the activation
// rounded to bfloat16 into the block's down input (in L2), then the down
// projection written into `out`. The chunked path it replaces wrote a
// [1,024, 2 * I] float32 product to memory, read it back for the
// activation, wrote and rounded that, and expanded both weights again for
// every 1,024 rows.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <vector>

#include "quant_expand.h"
#include "silu.h"

namespace tandem_quant {

#ifdef TANDEM_QUANT_AMX_BF16
namespace {

// gelu_tanh(g) * u = g * sigmoid(2 sqrt(2 / pi) (g + 0.044715 g^3)) * u,
// torch's approximate="tanh" GELU written through the same exp as SiLU.
inline __m512 gelu_tanh_times_ps(__m512 g, __m512 u) {
  const __m512 inner = _mm512_mul_ps(
      _mm512_set1_ps(-1.5957691216057308f),  // -2 sqrt(2 / pi)
      _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(0.044715f), g), _mm512_mul_ps(g, g), g));
  const __m512 e = exp_ps(_mm512_min_ps(inner, _mm512_set1_ps(80.f)));
  return _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e)), u);
}

// m rows of act(gate + bias) * (up + bias), 64 columns at col (n of them
// live), as bfloat16 into act_rows (row stride ld).
void activate(const float* gate, const float* up, const float* gate_bias, const float* up_bias,
              int64_t m, int64_t n, int64_t act, uint16_t* act_rows, int64_t ld) {
  const __mmask16 all = 0xFFFF;
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; j += 16) {
      const __mmask16 live = n - j >= 16 ? all : static_cast<__mmask16>((1u << (n - j)) - 1);
      __m512 g = _mm512_maskz_loadu_ps(live, gate + i * kAmxPanel + j);
      __m512 u = _mm512_maskz_loadu_ps(live, up + i * kAmxPanel + j);
      if (gate_bias != nullptr) {
        g = _mm512_add_ps(g, _mm512_maskz_loadu_ps(live, gate_bias + j));
        u = _mm512_add_ps(u, _mm512_maskz_loadu_ps(live, up_bias + j));
      }
      const __m512 a = act == 0 ? silu_times_ps(g, u) : gelu_tanh_times_ps(g, u);
      _mm256_mask_storeu_epi16(act_rows + i * ld + j, live,
                               reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(a)));
    }
}

}  // namespace

void amx_bf16_mlp(const at::Tensor& out, const at::Tensor& x, const at::Tensor& gate_up,
                  const at::Tensor& down, int64_t intermediate,
                  const c10::optional<at::Tensor>& gate_up_bias,
                  const c10::optional<at::Tensor>& down_bias, int64_t act, Isa isa) {
  const int64_t M = x.size(0), H = out.size(1), I = intermediate;
  const int64_t Kx = gate_up.size(1) * kBlock, Ka = down.size(1) * kBlock;
  TORCH_CHECK(act == 0 || act == 1, "act must be 0 (SiLU) or 1 (GELU tanh), got ", act);
  TORCH_CHECK(gate_up.size(0) * kTile >= 2 * I && Ka >= I && Ka - I < kBlock,
              "gate_up must have 2 * ", I, " outputs and down ", I, " inputs");
  TORCH_CHECK(x.size(1) <= Kx && down.size(0) * kTile >= H, "x, gate_up, down and out disagree");
  const at::Tensor expanded = expand_all(gate_up, isa);
  const at::Tensor gate_w = pack_vnni_panels(expanded, 0, I);
  const at::Tensor up_w = pack_vnni_panels(expanded, I, I);
  const at::Tensor down_w = pack_vnni_panels(expand_all(down, isa), 0, H);
  const at::Tensor xb = bf16_rows(x, Kx);
  const auto* xs = reinterpret_cast<const at::BFloat16*>(xb.data_ptr());
  const auto* gate_p = reinterpret_cast<const at::BFloat16*>(gate_w.data_ptr());
  const auto* up_p = reinterpret_cast<const at::BFloat16*>(up_w.data_ptr());
  const auto* down_p = reinterpret_cast<const at::BFloat16*>(down_w.data_ptr());
  const float* b1 = gate_up_bias.has_value() ? gate_up_bias->data_ptr<float>() : nullptr;
  const float* b2 = down_bias.has_value() ? down_bias->data_ptr<float>() : nullptr;
  float* o = out.data_ptr<float>();
  const int64_t ldo = out.stride(0), blocks = (M + kAmxRowBlock - 1) / kAmxRowBlock;
  const int64_t act_panels = gate_w.size(0), out_panels = down_w.size(0);
  at::parallel_for(0, blocks, 1, [&](int64_t r0, int64_t r1) {
    std::vector<float> gate(kAmxRowBlock * kAmxPanel), up(kAmxRowBlock * kAmxPanel);
    // The block's down input; columns I .. Ka - 1 stay zero (whole blocks of k).
    std::vector<uint16_t> acts(kAmxRowBlock * Ka, 0);
    const auto* a = reinterpret_cast<const at::BFloat16*>(acts.data());
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t m0 = r * kAmxRowBlock, m = std::min(kAmxRowBlock, M - m0);
      for (int64_t p = 0; p < act_panels; ++p) {
        const int64_t n0 = p * kAmxPanel, n = std::min(kAmxPanel, I - n0);
        at::native::cpublas::brgemm(m, n, Kx, Kx, kAmxPanel, kAmxPanel, false, xs + m0 * Kx,
                                    gate_p + p * Kx * kAmxPanel, gate.data());
        at::native::cpublas::brgemm(m, n, Kx, Kx, kAmxPanel, kAmxPanel, false, xs + m0 * Kx,
                                    up_p + p * Kx * kAmxPanel, up.data());
        activate(gate.data(), up.data(), b1 == nullptr ? nullptr : b1 + n0,
                 b1 == nullptr ? nullptr : b1 + I + n0, m, n, act, acts.data() + n0, Ka);
      }
      for (int64_t p = 0; p < out_panels; ++p) {
        const int64_t n0 = p * kAmxPanel, n = std::min(kAmxPanel, H - n0);
        float* c = o + m0 * ldo + n0;
        at::native::cpublas::brgemm(m, n, Ka, Ka, kAmxPanel, ldo, false, a,
                                    down_p + p * Ka * kAmxPanel, c);
        if (b2 != nullptr) add_bias(c, ldo, b2 + n0, m, n);
      }
    }
    at::native::cpublas::brgemm_release();
  });
}

#else

void amx_bf16_mlp(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                  int64_t, const c10::optional<at::Tensor>&, const c10::optional<at::Tensor>&,
                  int64_t, Isa) {
  TORCH_CHECK(false, "amx_bf16_mlp: this build has no AMX-BF16");
}

#endif

}  // namespace tandem_quant
