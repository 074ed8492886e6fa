// Fused float32 CPU versions of the decoder's small ops (see kernels/elementwise.py).
//
// Each replaces a chain of 3-8 torch kernels that each walk the whole
// activation once: at decode batch sizes the chains cost more in launches than
// in arithmetic, and at prefill sizes they cost extra passes over memory.
// The arithmetic follows transformers' recipe op for op (RMSNorm: mean of
// squares, rsqrt(mean + eps), scale; SiLU: x / (1 + exp(-x)), its exp a
// polynomial on AVX-512 (silu.h); rotate-half
// RoPE), so results differ from the torch chains only in rounding.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "silu.h"
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace {

// Rows per parallel task: small batches stay on one thread (no wake-up cost).
constexpr int64_t kRowGrain = 16;

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, name,
              " must be a float32 CPU tensor");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be 2-d with contiguous rows");
}

inline void normalize_row(float* __restrict out, const float* __restrict x,
                          const float* __restrict w, int64_t n, float eps) {
  float sum_sq = 0.f;
#pragma omp simd reduction(+ : sum_sq)
  for (int64_t i = 0; i < n; ++i) sum_sq += x[i] * x[i];
  const float inv_rms = 1.f / std::sqrt(sum_sq / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = (x[i] * inv_rms) * w[i];
}

}  // namespace

// out[t] = rms_norm(x[t]) * weight.
void rms_norm(at::Tensor out, at::Tensor x, at::Tensor weight, double eps) {
  check_rows(out, "out");
  check_rows(x, "x");
  const int64_t rows = x.size(0), n = x.size(1);
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t xs = x.stride(0), os = out.stride(0);
  at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      normalize_row(op + r * os, xp + r * xs, wp, n, static_cast<float>(eps));
  });
}

// residual[t] += delta[t]; out[t] = rms_norm(residual[t]) * weight.
void add_rms_norm(at::Tensor out, at::Tensor residual, at::Tensor delta,
                  at::Tensor weight, double eps) {
  check_rows(out, "out");
  check_rows(residual, "residual");
  check_rows(delta, "delta");
  const int64_t rows = residual.size(0), n = residual.size(1);
  const float* dp = delta.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* rp = residual.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t rs = residual.stride(0), ds = delta.stride(0), os = out.stride(0);
  at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* __restrict res = rp + r * rs;
      const float* __restrict d = dp + r * ds;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) res[i] += d[i];
      normalize_row(op + r * os, res, wp, n, static_cast<float>(eps));
    }
  });
}

// gate_up [T, 2I] holds gate | up; out [T, I] = silu(gate) * up.
void silu_mul(at::Tensor out, at::Tensor gate_up) {
  check_rows(out, "out");
  check_rows(gate_up, "gate_up");
  const int64_t rows = gate_up.size(0), inter = out.size(1);
  TORCH_CHECK(gate_up.size(1) == 2 * inter, "gate_up must be twice as wide as out");
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t gs = gate_up.stride(0), os = out.stride(0);
  at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* __restrict g = gp + r * gs;
      const float* __restrict u = g + inter;
      float* __restrict o = op + r * os;
      silu_times_n(g, u, o, inter);
    }
  });
}

// Rotate-half RoPE in place on x [T, heads, D] (last dim contiguous, any row
// and head strides) at positions [T], from cos/sin tables [max_pos, D/2].
void rope_(at::Tensor x, at::Tensor positions, at::Tensor cos_cache,
           at::Tensor sin_cache) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.scalar_type() == at::kFloat,
              "x must be float32 [T, heads, head_dim] with contiguous head_dim");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous(),
              "positions must be contiguous int64");
  TORCH_CHECK(cos_cache.is_contiguous() && sin_cache.is_contiguous(), "tables must be contiguous");
  const int64_t rows = x.size(0), heads = x.size(1), half = x.size(2) / 2;
  TORCH_CHECK(cos_cache.size(1) == half, "tables must be [max_pos, head_dim / 2]");
  const int64_t max_pos = cos_cache.size(0);
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK(pos[r] >= 0 && pos[r] < max_pos, "position ", pos[r], " outside the RoPE table");
  const float* cp = cos_cache.data_ptr<float>();
  const float* sp = sin_cache.data_ptr<float>();
  float* xp = x.data_ptr<float>();
  const int64_t s0 = x.stride(0), s1 = x.stride(1);
  at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* __restrict c = cp + pos[r] * half;
      const float* __restrict s = sp + pos[r] * half;
      for (int64_t h = 0; h < heads; ++h) {
        float* __restrict lo = xp + r * s0 + h * s1;
        float* __restrict hi = lo + half;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float a = lo[i], b = hi[i];
          lo[i] = a * c[i] - b * s[i];
          hi[i] = b * c[i] + a * s[i];
        }
      }
    }
  });
}

namespace {

struct LinearArgs {
  const float* x;
  int64_t x_stride;
  const float* w;  // [N, K], contiguous
  const float* bias;  // [N] or null
  float* out;
  int64_t out_stride;
  int64_t M, N, K;
};

#if defined(__AVX512F__)
// Weight rows [n, n + 4) against every input row, 16 columns per load, the
// last K % 16 masked. The next four rows' columns are prefetched alongside:
// the hardware prefetcher restarts at each 4 KiB page and would otherwise
// leave the first lines of every page to a demand miss (measured on the
// default model's shapes, 2 threads: 17.5 -> 19.5 GB/s, above a plain sum
// over the same bytes).
inline void rows4(const LinearArgs& a, int64_t n, bool prefetch_next) {
  const int64_t K = a.K;
  const float* w0 = a.w + n * K;
  const __mmask16 tail = static_cast<__mmask16>((1u << (K % 16)) - 1);
  const int64_t body = K - K % 16;
  for (int64_t m = 0; m < a.M; ++m) {
    const float* xm = a.x + m * a.x_stride;
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    // The rows sit in L1 after the first input row: prefetch only then.
    const bool pf = prefetch_next && m == 0;
    for (int64_t k = 0; k < body; k += 16) {
      if (pf) {
        const char* next = reinterpret_cast<const char*>(w0 + 4 * K + k);
        _mm_prefetch(next, _MM_HINT_T0);
        _mm_prefetch(next + 4 * K, _MM_HINT_T0);
        _mm_prefetch(next + 8 * K, _MM_HINT_T0);
        _mm_prefetch(next + 12 * K, _MM_HINT_T0);
      }
      const __m512 v = _mm512_loadu_ps(xm + k);
      a0 = _mm512_fmadd_ps(_mm512_loadu_ps(w0 + k), v, a0);
      a1 = _mm512_fmadd_ps(_mm512_loadu_ps(w0 + K + k), v, a1);
      a2 = _mm512_fmadd_ps(_mm512_loadu_ps(w0 + 2 * K + k), v, a2);
      a3 = _mm512_fmadd_ps(_mm512_loadu_ps(w0 + 3 * K + k), v, a3);
    }
    if (tail) {
      const __m512 v = _mm512_maskz_loadu_ps(tail, xm + body);
      a0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, w0 + body), v, a0);
      a1 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, w0 + K + body), v, a1);
      a2 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, w0 + 2 * K + body), v, a2);
      a3 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, w0 + 3 * K + body), v, a3);
    }
    float* o = a.out + m * a.out_stride + n;
    const float* b = a.bias;
    o[0] = _mm512_reduce_add_ps(a0) + (b ? b[n] : 0.f);
    o[1] = _mm512_reduce_add_ps(a1) + (b ? b[n + 1] : 0.f);
    o[2] = _mm512_reduce_add_ps(a2) + (b ? b[n + 2] : 0.f);
    o[3] = _mm512_reduce_add_ps(a3) + (b ? b[n + 3] : 0.f);
  }
}
#elif defined(__AVX2__) && defined(__FMA__)
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Weight rows [n, n + 4) against input rows [m, m + R): each weight vector
// is loaded once for R FMAs, where the one-row loop below reloads the four
// weight rows for every input row and is load-bound (a speculative verify
// step's k + 1 rows per request cost k + 1 times one row's; with R = 3 the
// default model's layers run ~1.8x faster at 5 rows). One input row keeps
// the compiler's loop, whose unrolled accumulators hide the FMA latency.
template <int R>
inline void block4(const LinearArgs& a, int64_t n, int64_t m) {
  const int64_t K = a.K, body = K - K % 8;
  const float* w0 = a.w + n * K;
  const float* xs[R];
  __m256 acc[4][R];
  for (int r = 0; r < R; ++r) {
    xs[r] = a.x + (m + r) * a.x_stride;
    for (int j = 0; j < 4; ++j) acc[j][r] = _mm256_setzero_ps();
  }
  for (int64_t k = 0; k < body; k += 8) {
    __m256 v[R];
    for (int r = 0; r < R; ++r) v[r] = _mm256_loadu_ps(xs[r] + k);
    for (int j = 0; j < 4; ++j) {
      const __m256 w = _mm256_loadu_ps(w0 + j * K + k);
      for (int r = 0; r < R; ++r) acc[j][r] = _mm256_fmadd_ps(w, v[r], acc[j][r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    float* o = a.out + (m + r) * a.out_stride + n;
    for (int j = 0; j < 4; ++j) {
      float sum = hsum8(acc[j][r]);
      for (int64_t k = body; k < K; ++k) sum += w0[j * K + k] * xs[r][k];
      o[j] = sum + (a.bias ? a.bias[n + j] : 0.f);
    }
  }
}

inline void rows4_simd(const LinearArgs& a, int64_t n);

inline void rows4(const LinearArgs& a, int64_t n, bool /*prefetch_next*/) {
  if (a.M == 1) {
    rows4_simd(a, n);
    return;
  }
  int64_t m = 0;
  for (; m + 3 <= a.M; m += 3) block4<3>(a, n, m);
  if (a.M - m == 2)
    block4<2>(a, n, m);
  else if (a.M - m == 1)
    block4<1>(a, n, m);
}
#endif

#if !defined(__AVX512F__)
inline void rows4_simd(const LinearArgs& a, int64_t n) {
  const int64_t K = a.K;
  const float* __restrict w0 = a.w + n * K;
  const float* __restrict w1 = w0 + K;
  const float* __restrict w2 = w1 + K;
  const float* __restrict w3 = w2 + K;
  for (int64_t m = 0; m < a.M; ++m) {
    const float* __restrict xm = a.x + m * a.x_stride;
    float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
    for (int64_t k = 0; k < K; ++k) {
      const float v = xm[k];
      a0 += w0[k] * v;
      a1 += w1[k] * v;
      a2 += w2[k] * v;
      a3 += w3[k] * v;
    }
    float* o = a.out + m * a.out_stride + n;
    const float* b = a.bias;
    o[0] = a0 + (b ? b[n] : 0.f);
    o[1] = a1 + (b ? b[n + 1] : 0.f);
    o[2] = a2 + (b ? b[n + 2] : 0.f);
    o[3] = a3 + (b ? b[n + 3] : 0.f);
  }
}
#if !(defined(__AVX2__) && defined(__FMA__))
inline void rows4(const LinearArgs& a, int64_t n, bool /*prefetch_next*/) { rows4_simd(a, n); }
#endif
#endif

inline void row1(const LinearArgs& a, int64_t n) {
  const float* __restrict w0 = a.w + n * a.K;
  for (int64_t m = 0; m < a.M; ++m) {
    const float* __restrict xm = a.x + m * a.x_stride;
    float a0 = 0.f;
#pragma omp simd reduction(+ : a0)
    for (int64_t k = 0; k < a.K; ++k) a0 += w0[k] * xm[k];
    a.out[m * a.out_stride + n] = a0 + (a.bias ? a.bias[n] : 0.f);
  }
}

}  // namespace

// out [M, N] = x [M, K] @ weight [N, K]^T (+ bias [N]) for a few rows M.
// BLAS's small-M path leaves bandwidth unused at decode sizes; this walks
// the weight once, four rows at a time, with every input row reusing each
// weight row while it is in L1.
void small_linear(at::Tensor out, at::Tensor x, at::Tensor weight,
                  const c10::optional<at::Tensor>& bias) {
  check_rows(out, "out");
  check_rows(x, "x");
  TORCH_CHECK(weight.is_contiguous() && weight.scalar_type() == at::kFloat,
              "weight must be contiguous float32");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(weight.size(1) == K && out.size(0) == M && out.size(1) == N, "shape mismatch");
  const float* bp = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == N, "bias must be contiguous [N]");
    bp = bias->data_ptr<float>();
  }
  const LinearArgs args{x.data_ptr<float>(), x.stride(0), weight.data_ptr<float>(), bp,
                        out.data_ptr<float>(), out.stride(0), M, N, K};
  at::parallel_for(0, N, 32, [&](int64_t begin, int64_t end) {
    int64_t n = begin;
    for (; n + 4 <= end; n += 4) rows4(args, n, n + 8 <= end);
    for (; n < end; ++n) row1(args, n);
  });
}

namespace {

// One row's argmax with torch's rules, one element at a time.
int64_t argmax_scalar(const float* row, int64_t n) {
  // Bit tests, not std::isnan: the build's -ffast-math assumes no NaNs.
  int64_t best = 0;
  float best_value = row[0];
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, row + i, sizeof(bits));
    if ((bits & 0x7fffffffu) > 0x7f800000u) return i;  // the first NaN
    if (row[i] > best_value) {
      best_value = row[i];
      best = i;
    }
  }
  return best;
}

#if defined(__AVX512F__)
// The same in two vector passes: the row's maximum (and whether it holds a
// NaN, which the scalar loop then finds), then the first index equal to it.
// A batch-64 decode step's logits (64 x 49152): 0.17 ms against the scalar
// loop's 1.66 (bound by its compare-and-branch), two threads.
int64_t argmax_avx512(const float* row, int64_t n) {
  const __m512i abs = _mm512_set1_epi32(0x7fffffff), inf = _mm512_set1_epi32(0x7f800000);
  const __m512 lowest = _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(0xff800000u)));
  __m512 mx = lowest;
  __mmask16 nan = 0;
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 live = n - i >= 16 ? 0xffff : static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m512 v = _mm512_mask_loadu_ps(lowest, live, row + i);
    nan |= _mm512_cmpgt_epi32_mask(_mm512_and_si512(_mm512_castps_si512(v), abs), inf);
    mx = _mm512_max_ps(mx, v);
  }
  if (nan != 0) return argmax_scalar(row, n);
  const __m512 best = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 live = n - i >= 16 ? 0xffff : static_cast<__mmask16>((1u << (n - i)) - 1);
    const __mmask16 hit =
        _mm512_mask_cmp_ps_mask(live, _mm512_mask_loadu_ps(lowest, live, row + i), best, _CMP_EQ_OQ);
    if (hit != 0) return i + __builtin_ctz(hit);
  }
  return 0;  // not reached: the maximum is one of the elements
}
#endif

}  // namespace

// The index of each row's largest value: torch.argmax(x, -1) for a float32
// [N, V] CPU tensor, with its tie and NaN rules (the first maximum; a NaN
// counts as the largest, the first NaN wins). torch's own kernel runs one
// thread at ~1 ns per element: 4 ms of a batch-64 decode step's logits.
// Rows in parallel; AVX-512 builds vectorize each row (argmax_avx512).
at::Tensor argmax_rows(at::Tensor x) {
  check_rows(x, "x");
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(n > 0, "argmax_rows: rows must not be empty");
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  const int64_t xs = x.stride(0);
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
#if defined(__AVX512F__)
      op[r] = argmax_avx512(xp + r * xs, n);
#else
      op[r] = argmax_scalar(xp + r * xs, n);
#endif
  });
  return out;
}

namespace {

// Elements a chunk sum covers: a row's chunk sums fit on the stack, and the
// second pass scans at most this many elements one by one.
constexpr int64_t kSampleChunk = 512;

// One draw from row[0..n) (non-negative weights, any total) by inverse CDF:
// the first index whose running sum exceeds u * total. The sums are double.
// A first pass sums chunks (vectorizable); the second finds the chunk where
// the running sum crosses the target, then walks that chunk. Because the
// chunk's own walk adds in another order than its sum did, the crossing can
// fall a rounding short: the chunk's last positive weight is then the draw.
// A zero weight is never drawn (the running sum does not move there).
int64_t sample_row(const float* row, int64_t n, double u) {
  const int64_t chunks = (n + kSampleChunk - 1) / kSampleChunk;
  std::vector<double> sums(chunks);
  double total = 0.0;
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t end = std::min(n, (c + 1) * kSampleChunk);
    float s = 0.0f;
    for (int64_t i = c * kSampleChunk; i < end; ++i) s += row[i];
    sums[c] = s;
    total += s;
  }
  // No mass, or NaN/inf in it (the build's -ffast-math assumes no NaNs, so
  // test the bits): the row's argmax, as the exponential race would pick.
  uint64_t bits;
  std::memcpy(&bits, &total, sizeof(bits));
  if ((bits & 0x7ff0000000000000ull) == 0x7ff0000000000000ull || total <= 0.0)
    return argmax_scalar(row, n);
  const double target = u * total;
  double cum = 0.0;
  int64_t c = 0;
  while (c < chunks - 1 && cum + sums[c] <= target) cum += sums[c++];
  const int64_t begin = c * kSampleChunk, end = std::min(n, begin + kSampleChunk);
  int64_t last_positive = -1;
  for (int64_t i = begin; i < end; ++i) {
    if (!(row[i] > 0.0f)) continue;
    cum += row[i];
    last_positive = i;
    if (cum > target) return i;
  }
  return last_positive >= 0 ? last_positive : argmax_scalar(row, n);
}

}  // namespace

// One token per row of probs [N, V] (float32, non-negative, rows need not
// sum to 1), drawn with the row's uniform u in [0, 1) (float64 [N]): the
// first token whose cumulative probability exceeds u times the row's total.
// One uniform a row where the exponential race drew V exponentials: torch's
// exponential_ took 63 ms of a 64-row decode step (49,152 tokens a row).
at::Tensor sample_rows(at::Tensor probs, at::Tensor uniforms) {
  check_rows(probs, "probs");
  const int64_t rows = probs.size(0), n = probs.size(1);
  TORCH_CHECK(n > 0, "sample_rows: rows must not be empty");
  TORCH_CHECK(uniforms.scalar_type() == at::kDouble && uniforms.is_contiguous() &&
                  uniforms.numel() == rows,
              "uniforms must be contiguous float64, one per row");
  at::Tensor out = at::empty({rows}, probs.options().dtype(at::kLong));
  const float* pp = probs.data_ptr<float>();
  const double* up = uniforms.data_ptr<double>();
  int64_t* op = out.data_ptr<int64_t>();
  const int64_t ps = probs.stride(0);
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) op[r] = sample_row(pp + r * ps, n, up[r]);
  });
  return out;
}
