"""A compiled CPU kernel for the decode part of paged attention.

Decode attention on a CPU is bound by memory bandwidth: each step reads
every running sequence's whole K/V context once. The pure-torch path reads
it three times (gather into a padded buffer, write it, read it again in
SDPA); this kernel walks the block table and reads each K/V row once, in
place, with an online softmax per (sequence, KV head) and all query heads
of a GQA group sharing each row. It is built with torch's C++ extension
tooling on first use (a compiler and ninja are needed; about a minute,
then cached under torch's extension directory) and used for float32
caches. If it cannot be built, `load()` returns None once, logs why, and
the torch path runs as before. ``TANDEM_CPU_KERNELS=0`` turns it off.
"""

from __future__ import annotations

import logging
import os
from types import ModuleType

logger = logging.getLogger(__name__)

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

// query [S, H, D] (one decode token per sequence; any row stride),
// kv_cache [2, num_blocks, block_size, Hkv, D] contiguous float32,
// block_table [S, max_blocks] int32, seq_lens [S] int32, out [S, H, D].
// D is a template constant so the per-row loops unroll and vectorize fully.
template <int64_t D>
void decode_attention_d(torch::Tensor out, torch::Tensor query, torch::Tensor kv_cache,
                        torch::Tensor block_table, torch::Tensor seq_lens, double scale) {
  const int64_t S = query.size(0), H = query.size(1);
  const int64_t NB = kv_cache.size(1), BS = kv_cache.size(2), HKV = kv_cache.size(3);
  const int64_t G = H / HKV;
  const int64_t q_s0 = query.stride(0), q_s1 = query.stride(1);
  const int64_t o_s0 = out.stride(0), o_s1 = out.stride(1);
  const int64_t bt_s0 = block_table.stride(0);
  const float* q_base = query.data_ptr<float>();
  const float* k_base = kv_cache.data_ptr<float>();
  const float* v_base = k_base + NB * BS * HKV * D;
  const int32_t* bt = block_table.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  float* o_base = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, S * HKV, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(G * D), m(G), l(G), q(G * D), scores(G * BS);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / HKV, h = task % HKV;
      const int64_t len = lens[s];
      for (int64_t g = 0; g < G; ++g) {
        const float* src = q_base + s * q_s0 + (h * G + g) * q_s1;
        for (int64_t d = 0; d < D; ++d) q[g * D + d] = src[d] * fscale;
        m[g] = -std::numeric_limits<float>::infinity();
        l[g] = 0.f;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t start = 0; start < len; start += BS) {
        const int64_t block = bt[s * bt_s0 + start / BS];
        const int64_t n = std::min(BS, len - start);
        const float* kb = k_base + (block * BS * HKV + h) * D;
        const float* vb = v_base + (block * BS * HKV + h) * D;
        for (int64_t g = 0; g < G; ++g) {
          const float* __restrict qg = q.data() + g * D;
          float block_max = m[g];
          for (int64_t t = 0; t < n; ++t) {
            const float* __restrict k = kb + t * HKV * D;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < D; ++d) dot += qg[d] * k[d];
            scores[g * BS + t] = dot;
            block_max = std::max(block_max, dot);
          }
          // Online softmax: rescale what was summed under the old max.
          const float correction = std::exp(m[g] - block_max);
          float* __restrict ag = acc.data() + g * D;
          float* pg = scores.data() + g * BS;
          float sum = 0.f;
#pragma omp simd reduction(+ : sum)
          for (int64_t t = 0; t < n; ++t) {
            pg[t] = std::exp(pg[t] - block_max);
            sum += pg[t];
          }
          sum += l[g] * correction;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) ag[d] *= correction;
          for (int64_t t = 0; t < n; ++t) {
            const float p = pg[t];
            const float* __restrict v = vb + t * HKV * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) ag[d] += p * v[d];
          }
          m[g] = block_max;
          l[g] = sum;
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float* dst = o_base + s * o_s0 + (h * G + g) * o_s1;
        const float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;
        for (int64_t d = 0; d < D; ++d) dst[d] = acc[g * D + d] * inv;
      }
    }
  });
}

void decode_attention(torch::Tensor out, torch::Tensor query, torch::Tensor kv_cache,
                      torch::Tensor block_table, torch::Tensor seq_lens, double scale) {
  switch (query.size(2)) {
    case 64: return decode_attention_d<64>(out, query, kv_cache, block_table, seq_lens, scale);
    case 128: return decode_attention_d<128>(out, query, kv_cache, block_table, seq_lens, scale);
    case 256: return decode_attention_d<256>(out, query, kv_cache, block_table, seq_lens, scale);
    default:
      TORCH_CHECK(false, "decode_attention: head_dim ", query.size(2), " is not 64, 128 or 256");
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "paged decode attention (float32, CPU)");
}
"""

# The head sizes the kernel is instantiated for (others use the torch path).
HEAD_DIMS = (64, 128, 256)

_STATE: dict[str, ModuleType | None] = {}


def load() -> ModuleType | None:
    """The compiled module, or None if it is disabled or cannot be built."""
    if "module" in _STATE:
        return _STATE["module"]
    module = None
    if os.environ.get("TANDEM_CPU_KERNELS", "1") != "0":
        module = _build()
    _STATE["module"] = module
    return module


def _build() -> ModuleType | None:
    try:
        from torch.utils.cpp_extension import load_inline

        logger.info("loading Tandem's CPU decode-attention kernel (built on first use: ~1 min)")
        module: ModuleType = load_inline(  # type: ignore[no-untyped-call]
            name="tandem_cpu_decode_v5",
            cpp_sources=[_SOURCE],
            extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
        return module
    except Exception as exc:  # a missing compiler must not stop serving
        logger.warning("CPU decode kernel unavailable (%s); using the torch path", exc)
        return None
