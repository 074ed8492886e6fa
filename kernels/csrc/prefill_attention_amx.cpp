// Paged causal attention for prefill chunks over a bfloat16 or int8 cache on
// AMX tiles (Intel Xeons from Sapphire Rapids): prefill_attention.cpp's
// "bfloat16 products" (Q and P rounded to bfloat16, float32 sums) with both
// products as oneDNN brgemm calls (ATen's cpublas), 16 x 16 x 32
// multiply-adds an instruction where the vector kernels do 16 or 32. An
// int8 cache's values are exact in bfloat16, so they are packed as they are
// (bf16_run) and their row scales applied in float32: K's to the scores
// (per key, a column of S), V's to the probabilities before those are
// rounded to bfloat16. No K/V value is rounded, only Q and P, as over a
// bfloat16 cache; its prefill then runs as fast as a bfloat16 cache's (the
// float32 arithmetic it took before is 1.7x slower). Rounding the
// dequantized values to bfloat16 instead parted 4 of tests/e2e/
// test_kv_cache_dtype.py's 8 greedy prompts from the float32 cache's
// within 32 tokens.
//
// A task is one (sequence, KV head, run of up to kTaskRows query rows:
// tokens x the GQA group's heads, token-major). Its rows are Q [rows, D] in
// bfloat16, O [rows, D] and the softmax state in float32. Keys come kKeys at
// a time, read in place through the block table (runs of 16 rows: block
// sizes are multiples of 16) and packed once for all of the task's rows:
// K^T into the layout AMX reads B from (pairs of d interleaved), V likewise
// (pairs of keys). Per chunk and block of up to kRows rows:
//
//   S = Q K^T                 brgemm, float32 [rows, kKeys]
//   online softmax per row    vector code: mask, max, exp, P in bfloat16
//   O = O * corr + P V        brgemm accumulating into O
//
// Rows whose tokens precede the chunk (causal) or whose window ends before
// it skip it, and chunks before the task's first row's window are not read.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/native/CPUBlas.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "cpu_ops.h"
#include "kv_int8.h"
#include "kv_layout.h"
#include "quant_int8_rows.h"
#include "silu.h"

#if defined(TANDEM_QUANT_AMX_BF16)

namespace {

constexpr int64_t kKeys = 64;        // keys per packed chunk (four runs of 16)
constexpr int64_t kRun = 16;         // cache rows in a run (block sizes: multiples of 16)
constexpr int64_t kRows = 256;       // query rows per brgemm
constexpr int64_t kTaskRows = 768;   // query rows per task
constexpr int64_t kMaxD = 256;
constexpr float kMasked = -1e30f;    // finite: the build assumes no infinities

std::atomic<bool> amx_allowed{true};

struct Scratch {
  alignas(64) uint16_t q[kTaskRows * kMaxD];          // Q, scaled, bfloat16 [rows][D]
  alignas(64) float o[kTaskRows * kMaxD];             // O [rows][D]
  alignas(64) float m[kTaskRows], l[kTaskRows];
  alignas(64) float s[kRows * kKeys];                 // S [rows][kKeys]
  alignas(64) uint16_t p[kRows * kKeys];              // P, bfloat16 [rows][kKeys]
  alignas(64) uint32_t kt[kMaxD / 2 * kKeys];         // K^T: [D / 2][kKeys] pairs of d
  alignas(64) uint32_t v[kKeys / 2 * kMaxD];          // V: [kKeys / 2][D] pairs of keys
  alignas(64) uint16_t run[kRun * kMaxD];             // an int8 run's values in bfloat16
  alignas(64) float k_scale[kKeys], v_scale[kKeys];   // an int8 chunk's row scales (0 past n)
};

struct Task {
  int64_t seq, head, first_token, tokens, cost;
};

template <typename T>
constexpr bool kInt8 = std::is_same_v<T, int8_t>;

// What a task reads, pointers at its sequence and KV head; T is the cache's
// element type (c10::BFloat16, or int8_t for an int8 cache: kv_int8.h).
template <typename T>
struct View {
  const float* q;
  int64_t q_tok, q_head;
  float* out;
  int64_t o_tok, o_head;
  const T* k;  // this KV head's slice of block 0 (V: + v_off)
  int64_t v_off;
  const int32_t* blocks;
  int64_t block_size, row, block_elems;
  int64_t rows, first_pos, window, group;
  float scale;

  const T* run(int64_t c0) const {  // the 16 rows from position c0
    return k + blocks[c0 / block_size] * block_elems + c0 % block_size * row;
  }
  int64_t pos(int64_t r) const { return first_pos + r / group; }
};

template <int D, typename T>
void load_queries(const View<T>& t, Scratch& s) {
  for (int64_t r = 0; r < t.rows; ++r) {
    const float* src = t.q + (r / t.group) * t.q_tok + (r % t.group) * t.q_head;
    const __m512 scale = _mm512_set1_ps(t.scale);
    for (int d = 0; d < D; d += 32) {
      const __m512 lo = _mm512_mul_ps(_mm512_loadu_ps(src + d), scale);
      const __m512 hi = _mm512_mul_ps(_mm512_loadu_ps(src + d + 16), scale);
      _mm512_storeu_si512(s.q + r * D + d, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
    }
    s.m[r] = kMasked;
    s.l[r] = 0.f;
  }
  std::fill_n(s.o, t.rows * D, 0.f);
}

// A run's first `live` rows as bfloat16 with their stride in elements: a
// bfloat16 cache's in place; an int8 cache's int8 values (exact in
// bfloat16) into `buf`, their row scales into `scales`, which the caller
// applies in float32 to the products (prefill_attention_amx's top).
template <int D>
std::pair<const uint16_t*, int64_t> bf16_run(const c10::BFloat16* rows, int64_t /*live*/,
                                             int64_t stride, uint16_t* /*buf*/,
                                             float* /*scales*/) {
  return {reinterpret_cast<const uint16_t*>(rows), stride};
}
template <int D>
std::pair<const uint16_t*, int64_t> bf16_run(const int8_t* rows, int64_t live, int64_t stride,
                                             uint16_t* buf, float* scales) {
  for (int64_t r = 0; r < live; ++r) {
    const int8_t* src = rows + r * stride;
    scales[r] = tandem_kv_int8::row_scale<D>(src);
    for (int d = 0; d < D; d += 32) {
      const __m512 lo = _mm512_cvtepi32_ps(
          _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + d))));
      const __m512 hi = _mm512_cvtepi32_ps(
          _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + d + 16))));
      _mm512_storeu_si512(buf + r * D + d, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
    }
  }
  for (int64_t r = live; r < kRun; ++r) scales[r] = 0.f;
  return {buf, D};
}

// Keys c0 .. c0 + n - 1 packed; keys n .. width - 1 zero (width: n rounded
// up to 32, the tiles' depth in bfloat16). Run by run of 16 keys: K^T by
// gathers, V by interleaving pairs of keys.
template <int D, typename T>
void pack_chunk(const View<T>& t, int64_t c0, int64_t n, int64_t width, Scratch& s) {
  const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                      39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi = _mm512_set_epi16(63, 31, 62, 30, 61, 29, 60, 28, 59, 27, 58, 26, 57, 25, 56,
                                      24, 55, 23, 54, 22, 53, 21, 52, 20, 51, 19, 50, 18, 49, 17,
                                      48, 16);
  for (int64_t j0 = 0; j0 < width; j0 += kRun) {
    const int64_t live = std::clamp<int64_t>(n - j0, 0, kRun);
    // A run past the chunk's keys (live 0) is read nowhere: the gathers'
    // mask and the V rows' nulls leave zeros, its scales are set to 0.
    // K^T: word i (dims 2i, 2i + 1) of key j at kt[i][j].
    const T* run = live > 0 ? t.run(c0 + j0) : nullptr;
    const auto [k_rows, k_stride] = bf16_run<D>(run, live, t.row, s.run, s.k_scale + j0);
    const auto* words = reinterpret_cast<const uint32_t*>(k_rows);
    const __m512i offsets =
        _mm512_mullo_epi32(iota, _mm512_set1_epi32(static_cast<int>(k_stride / 2)));
    const __mmask16 mask = static_cast<__mmask16>((1u << live) - 1);
    for (int i = 0; i < D / 2; ++i) {
      const __m512i w = _mm512_mask_i32gather_epi32(
          _mm512_setzero_si512(), mask, _mm512_add_epi32(offsets, _mm512_set1_epi32(i)), words, 4);
      _mm512_storeu_si512(s.kt + i * kKeys + j0, w);
    }
    // V: keys 2p and 2p + 1 interleaved, element by element (zero past live).
    const T* v_run = live > 0 ? run + t.v_off : nullptr;
    const auto [v_rows, v_stride] = bf16_run<D>(v_run, live, t.row, s.run, s.v_scale + j0);
    for (int64_t j = 0; j < kRun; j += 2) {
      const uint16_t* a = j < live ? v_rows + j * v_stride : nullptr;
      const uint16_t* b = j + 1 < live ? v_rows + (j + 1) * v_stride : nullptr;
      uint32_t* dst = s.v + (j0 + j) / 2 * D;
      for (int d = 0; d < D; d += 32) {
        const __m512i x = a ? _mm512_loadu_si512(a + d) : _mm512_setzero_si512();
        const __m512i y = b ? _mm512_loadu_si512(b + d) : _mm512_setzero_si512();
        _mm512_storeu_si512(dst + d, _mm512_permutex2var_epi16(x, lo, y));
        _mm512_storeu_si512(dst + d + 16, _mm512_permutex2var_epi16(x, hi, y));
      }
    }
  }
}

// Online softmax of rows r0 .. r0 + m - 1 over the chunk's keys (positions
// c0 + j, j < n; width packed): S -> P in bfloat16, O rescaled. Only the
// 16-key vectors holding keys a row sees are computed; the rest of its P is
// zero (rows before the chunk, keys past the diagonal or before a window).
template <int D, typename T>
void softmax_rows(const View<T>& t, int64_t r0, int64_t m, int64_t c0, int64_t n, int64_t width,
                  Scratch& s) {
  const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t i = 0; i < m; ++i) {
    const int64_t r = r0 + i, pos = t.pos(r);
    // Keys j in [lo, hi) are seen: c0 + j in (pos - window, pos], j < n.
    const int64_t hi = std::min(n, pos - c0 + 1);
    const int64_t lo = t.window > 0 ? std::max<int64_t>(0, pos - t.window + 1 - c0) : 0;
    uint16_t* prow = s.p + i * kKeys;
    if (hi <= lo) {  // nothing seen: P stays zero, the state as it was
      for (int64_t c = 0; c < width; c += 32) _mm512_storeu_si512(prow + c, zero);
      continue;
    }
    // Vectors of 32 keys (two of 16) from c_lo to c_hi hold every seen key.
    const int64_t c_lo = lo / 32 * 32, c_hi = (hi + 31) / 32 * 32;
    float* srow = s.s + i * kKeys;
    const __m512i lo_v = _mm512_set1_epi32(static_cast<int>(lo));
    const __m512i hi_v = _mm512_set1_epi32(static_cast<int>(hi));
    __m512 mx = _mm512_set1_ps(s.m[r]);
    for (int64_t c = c_lo; c < c_hi; c += 16) {
      const __m512i j = _mm512_add_epi32(iota, _mm512_set1_epi32(static_cast<int>(c)));
      const __mmask16 seen = _mm512_cmplt_epi32_mask(j, hi_v) & _mm512_cmpge_epi32_mask(j, lo_v);
      __m512 sc = _mm512_loadu_ps(srow + c);
      if constexpr (kInt8<T>) {  // the keys' row scales, on the integer values' products
        sc = _mm512_mul_ps(sc, _mm512_load_ps(s.k_scale + c));
        _mm512_storeu_ps(srow + c, sc);
      }
      mx = _mm512_mask_max_ps(mx, seen, mx, sc);
    }
    const float row_max = _mm512_reduce_max_ps(mx);
    const __m512 top = _mm512_set1_ps(row_max);
    // exp(old max - new max): lane 0 of the vector exp (no libm call a row).
    const float corr =
        _mm512_cvtss_f32(exp_ps(_mm512_set1_ps(std::max(s.m[r] - row_max, -80.f))));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t c = 0; c < width; c += 32) {
      if (c < c_lo || c >= c_hi) {
        _mm512_storeu_si512(prow + c, zero);
        continue;
      }
      __m512 p[2];
      for (int h = 0; h < 2; ++h) {
        const __m512i j = _mm512_add_epi32(iota, _mm512_set1_epi32(static_cast<int>(c + 16 * h)));
        const __mmask16 seen = _mm512_cmplt_epi32_mask(j, hi_v) & _mm512_cmpge_epi32_mask(j, lo_v);
        p[h] = _mm512_maskz_mov_ps(seen, exp_ps(_mm512_sub_ps(_mm512_loadu_ps(srow + c + 16 * h), top)));
        sum = _mm512_add_ps(sum, p[h]);
        // P V over V's integer values: each probability takes its row's scale.
        if constexpr (kInt8<T>) p[h] = _mm512_mul_ps(p[h], _mm512_load_ps(s.v_scale + c + 16 * h));
      }
      _mm512_storeu_si512(prow + c, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(p[1], p[0])));
    }
    s.l[r] = s.l[r] * corr + _mm512_reduce_add_ps(sum);
    s.m[r] = row_max;
    if (corr != 1.f) {
      float* orow = s.o + r * D;
      const __m512 cv = _mm512_set1_ps(corr);
      for (int d = 0; d < D; d += 16)
        _mm512_storeu_ps(orow + d, _mm512_mul_ps(_mm512_loadu_ps(orow + d), cv));
    }
  }
}

template <int D, typename T>
void run_task(const View<T>& t, Scratch& s) {
  load_queries<D>(t, s);
  const int64_t last = t.pos(t.rows - 1);
  int64_t c0 = 0;
  if (t.window > 0) {
    const int64_t first_key = std::max<int64_t>(0, t.first_pos - t.window + 1);
    c0 = first_key - first_key % kRun;
  }
  const auto* q = reinterpret_cast<const at::BFloat16*>(s.q);
  const auto* kt = reinterpret_cast<const at::BFloat16*>(s.kt);
  const auto* v = reinterpret_cast<const at::BFloat16*>(s.v);
  const auto* p = reinterpret_cast<const at::BFloat16*>(s.p);
  for (; c0 <= last; c0 += kKeys) {
    const int64_t n = std::min(kKeys, last + 1 - c0), width = (n + 31) / 32 * 32;
    pack_chunk<D>(t, c0, n, width, s);
    for (int64_t r0 = 0; r0 < t.rows; r0 += kRows) {
      const int64_t m = std::min(kRows, t.rows - r0);
      if (t.pos(r0 + m - 1) < c0) continue;  // every row precedes the chunk
      if (t.window > 0 && t.pos(r0) - t.window + 1 > c0 + n - 1) continue;
      at::native::cpublas::brgemm(m, width, D, D, kKeys, kKeys, false, q + r0 * D, kt, s.s);
      softmax_rows<D>(t, r0, m, c0, n, width, s);
      at::native::cpublas::brgemm(m, D, width, kKeys, D, D, true, p, v, s.o + r0 * D);
    }
  }
  for (int64_t r = 0; r < t.rows; ++r) {
    float* dst = t.out + (r / t.group) * t.o_tok + (r % t.group) * t.o_head;
    const __m512 inv = _mm512_set1_ps(1.f / s.l[r]);
    for (int d = 0; d < D; d += 16)
      _mm512_storeu_ps(dst + d, _mm512_mul_ps(_mm512_loadu_ps(s.o + r * D + d), inv));
  }
}

template <int D, typename T>
void run_all(at::Tensor out, at::Tensor query, at::Tensor kv_cache, at::Tensor block_table,
             at::Tensor seq_lens, at::Tensor query_starts, at::Tensor query_lens, double scale,
             int64_t window) {
  const tandem_kv::Layout L = tandem_kv::layout_of(kv_cache, "prefill_attention");
  const int64_t P = seq_lens.size(0), group = query.size(1) / L.heads;
  const int64_t tile = kTaskRows / group;
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* starts = query_starts.data_ptr<int32_t>();
  const int32_t* q_lens = query_lens.data_ptr<int32_t>();
  std::vector<Task> tasks;
  for (int64_t p = 0; p < P; ++p) {
    const int64_t q_len = q_lens[p], prefix = lens[p] - q_len;
    for (int64_t t0 = 0; t0 < q_len; t0 += tile) {
      const int64_t tokens = std::min(tile, q_len - t0);
      const int64_t seen = window > 0 ? std::min(prefix + t0, window) : prefix + t0;
      for (int64_t h = 0; h < L.heads; ++h)
        tasks.push_back({p, h, t0, tokens, tokens * (seen + tokens / 2)});
    }
  }
  std::stable_sort(tasks.begin(), tasks.end(),
                   [](const Task& a, const Task& b) { return a.cost > b.cost; });
  const auto* cache = static_cast<const T*>(kv_cache.data_ptr());
  const int32_t* bt = block_table.data_ptr<int32_t>();
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), tasks.size());
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    static thread_local std::unique_ptr<Scratch> scratch;
    if (!scratch) scratch = std::make_unique<Scratch>();
    for (int64_t i = next++; i < static_cast<int64_t>(tasks.size()); i = next++) {
      const Task& ti = tasks[i];
      const int64_t row0 = starts[ti.seq] + ti.first_token, head0 = ti.head * group;
      const View<T> view{query.data_ptr<float>() + row0 * query.stride(0) + head0 * query.stride(1),
                      query.stride(0),
                      query.stride(1),
                      out.data_ptr<float>() + row0 * out.stride(0) + head0 * out.stride(1),
                      out.stride(0),
                      out.stride(1),
                      cache + ti.head * L.head_stride,
                      L.v_offset,
                      bt + ti.seq * block_table.stride(0),
                      L.block_size,
                      L.token_stride,
                      L.block_stride,
                      ti.tokens * group,
                      lens[ti.seq] - q_lens[ti.seq] + ti.first_token,
                      window,
                      group,
                      static_cast<float>(scale)};
      run_task<D>(view, *scratch);
    }
    at::native::cpublas::brgemm_release();
  });
}

template <typename T>
void run_for(at::Tensor out, at::Tensor query, at::Tensor kv_cache, at::Tensor block_table,
             at::Tensor seq_lens, at::Tensor query_starts, at::Tensor query_lens, double scale,
             int64_t window) {
  switch (query.size(2)) {
    case 64:
      return run_all<64, T>(out, query, kv_cache, block_table, seq_lens, query_starts, query_lens,
                            scale, window);
    case 128:
      return run_all<128, T>(out, query, kv_cache, block_table, seq_lens, query_starts,
                             query_lens, scale, window);
    default:
      return run_all<256, T>(out, query, kv_cache, block_table, seq_lens, query_starts,
                             query_lens, scale, window);
  }
}

}  // namespace

bool prefill_attention_amx_applies(int64_t head_dim, const at::Tensor& kv_cache) {
  const auto dtype = kv_cache.scalar_type();
  return amx_allowed.load() && tandem_quant::amx_usable() &&
         (dtype == at::kBFloat16 || dtype == at::kChar) &&
         (head_dim == 64 || head_dim == 128 || head_dim == 256) && kv_cache.size(2) % kRun == 0;
}

bool allow_amx_attention(bool allowed) { return amx_allowed.exchange(allowed); }

void prefill_attention_amx(at::Tensor out, at::Tensor query, at::Tensor kv_cache,
                           at::Tensor block_table, at::Tensor seq_lens, at::Tensor query_starts,
                           at::Tensor query_lens, double scale, int64_t window) {
  if (kv_cache.scalar_type() == at::kChar)
    return run_for<int8_t>(out, query, kv_cache, block_table, seq_lens, query_starts, query_lens,
                           scale, window);
  run_for<c10::BFloat16>(out, query, kv_cache, block_table, seq_lens, query_starts, query_lens,
                         scale, window);
}

#else

bool prefill_attention_amx_applies(int64_t, const at::Tensor&) { return false; }
bool allow_amx_attention(bool) { return false; }
void prefill_attention_amx(at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                           at::Tensor, double, int64_t) {
  TORCH_CHECK(false, "prefill_attention_amx: this build has no AMX-BF16");
}

#endif
