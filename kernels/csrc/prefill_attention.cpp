// Paged causal attention for prefill chunks on CPU: float32 queries over a
// float32, bfloat16 or int8 cache (see kernels/torch_attention.py).
//
// torch's CPU flash attention, which the torch path calls once per
// sequence, cuts the keys into blocks of 512: at prompt lengths of a few
// hundred the causal half is computed and thrown away, and its small
// matrix products run at ~50 GFLOP/s on two cores. This kernel reads K/V
// in place through the block table and skips every key past a query's
// position, chunk by chunk.
//
// Layout of the work: a task is one (sequence, KV head, tile of query
// tokens); its rows are the tile's tokens x the GQA group's query heads,
// 48 of them, held *across* the vector lanes (3 x 16). Everything then runs
// vertically, with no horizontal sums and no transposes of K or V:
//
//   S^T[j, rows] = sum_d K[j, d] * Q^T[d, rows]     (K broadcast, Q^T loaded)
//   online softmax down the 16 keys of a chunk       (plain loops, per lane)
//   O^T[d, rows] = O^T * correction + sum_j V[j, d] * P^T[j, rows]
//
// Q^T is built once per task and O^T written back once, so their transposes
// cost nothing per key. AVX-512 only; elsewhere the torch path runs.
//
// A bfloat16 cache on a CPU with AVX512_BF16 takes bfloat16 products
// (run_task_bf16): Q and P rounded to bfloat16, K and V read as they are,
// sums in float32; 1.14-1.28x the float32 arithmetic's speed on the 64-request
// prompts on an AMD Zen 4 (benchmarks/cpu_attention_bench.py), whose vector
// FMAs issue once a cycle, so a bfloat16 pair-product instruction does twice
// the work. Intel's cores issue two FMAs a cycle and one of those: no gain,
// and the rounding costs extra (0.85x on a Sapphire Rapids-class Xeon), so
// on Intel CPUs the float32 arithmetic is the default, unless they have AMX
// tiles: there the same products run on the tiles (prefill_attention_amx.cpp,
// 1.9x the float32 arithmetic) and are the default.
//
// A sliding window (window > 0; 0 is the whole context) starts each task at
// the chunk of its first token's first in-window key and masks the keys
// before each row's own window start: a task then reads its window plus its
// tile, not the whole prefix (reading K/V the mask hides is wasted time).
//
// An int8 cache (kv_int8.h) is read in place too: each chunk's 16 rows are
// converted and multiplied by their row's scale into the float32 scratch
// rows the float32 arithmetic reads (as a bfloat16 cache's rows are widened
// without AVX512_BF16), so the result is attention over the dequantized
// rows, in float32. Where the tiles take bfloat16 products, they take an
// int8 cache too: its int8 values, exact in bfloat16, with the row scales
// applied in float32 (prefill_attention_amx.cpp).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>
#include <type_traits>
#include <vector>

#include "cpu_ops.h"
#include "kv_int8.h"
#include "kv_layout.h"
#include "quant_int8_rows.h"

namespace {
// Whether bfloat16 products are the default here (see the top: not on
// Intel, unless it has AMX tiles: prefill_attention_amx.cpp).
bool products_by_default() {
#if defined(TANDEM_QUANT_AMX_BF16)
  if (tandem_quant::amx_usable()) return true;
#endif
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  return !__builtin_cpu_is("intel");
#else
  return true;
#endif
}
// allow_bf16_attention_products: process-wide, read once per call.
std::atomic<bool> bf16_products_allowed{products_by_default()};
}  // namespace

#if defined(__AVX512F__)
#include <immintrin.h>

namespace {

constexpr int kLanes = 16;
constexpr int kRowVecs = 3;                   // 16-lane vectors of rows
constexpr int kRows = kLanes * kRowVecs;      // query rows per task
constexpr int kChunk = 16;                    // keys per softmax step
constexpr int kBlockJ = 8;                    // keys per S^T register block
constexpr int kBlockD = 8;                    // head dims per O^T register block
constexpr float kMasked = -1e30f;             // finite: the build assumes no infinities
// A hidden key's score: below kMasked, the running max a row starts with, so
// a row whose keys in a chunk are all hidden (possible under a window: the
// task starts at its first row's window) adds exp(kHidden - kMasked) = 0.
constexpr float kHidden = -2e30f;

// One task's view of the problem (pointers already at its sequence and head).
template <typename T>
struct Task {
  const float* q;       // the tile's first token, first head of the group
  int64_t q_tok, q_head;  // strides between tokens and heads of the query
  float* out;
  int64_t o_tok, o_head;
  const T* k;           // this KV head's slice of cache block 0 (V: + v_off)
  int64_t v_off;
  const int32_t* blocks;  // the sequence's block-table row
  int64_t block_size, row;  // cache rows per block; elements between rows
  int64_t block_elems;      // elements between blocks
  int64_t tokens;         // query tokens in the tile
  int64_t first_pos;      // context position of the tile's first token
  int64_t window;         // sliding window; 0: the whole causal context
  int group;
  float scale;
};

// Per-thread scratch, all rows across lanes.
struct Scratch {
  alignas(64) float qt[256 * kRows];     // Q^T [D][kRows], scaled
  alignas(64) float ot[256 * kRows];     // O^T [D][kRows]
  alignas(64) float st[kChunk * kRows];  // S^T, then P^T [kChunk][kRows]
  alignas(64) float kf[kChunk * 256];    // a chunk's K rows as float32 (bfloat16 caches)
  alignas(64) float vf[kChunk * 256];
  alignas(64) float m[kRows], l[kRows], corr[kRows], pos[kRows];
  // bfloat16 products (AVX512_BF16): pairs of bfloat16 in each 32-bit lane.
  alignas(64) uint32_t qtb[128 * kRows];         // Q^T [D/2][kRows]: (d, d+1) pairs
  alignas(64) uint32_t ptb[kChunk / 2 * kRows];  // P^T [kChunk/2][kRows]: (j, j+1)
  alignas(64) uint32_t vpb[kChunk / 2 * 256];    // V [kChunk/2][D]: (j, j+1) pairs
};

// n cache rows as float32, copied (or widened) into buf, one after the other:
// the scalar broadcasts then read one compact run (float32 rows read in
// place, other heads' rows between them, measured ~1.1x slower).
template <int D>
inline void rows_of(const float* first, int64_t row, int n, float* buf, const float** out) {
  for (int j = 0; j < n; ++j) {
    std::copy_n(first + j * row, D, buf + j * D);
    out[j] = buf + j * D;
  }
}
template <int D>
inline void rows_of(const c10::BFloat16* first, int64_t row, int n, float* buf,
                    const float** out) {
  for (int j = 0; j < n; ++j) {
    const auto* src = reinterpret_cast<const uint16_t*>(first + j * row);
    float* dst = buf + j * D;
    for (int c = 0; c < D; c += 16) {
      const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + c));
      _mm512_storeu_ps(dst + c,
                       _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16)));
    }
    out[j] = dst;
  }
}

// int8 rows: values converted and times the row's scale (q * scale, as
// kernels/kv_int8.py dequantizes).
template <int D>
inline void rows_of(const int8_t* first, int64_t row, int n, float* buf, const float** out) {
  for (int j = 0; j < n; ++j) {
    const int8_t* src = first + j * row;
    const __m512 scale = _mm512_set1_ps(tandem_kv_int8::row_scale<D>(src));
    float* dst = buf + j * D;
    for (int c = 0; c < D; c += 16) {
      const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + c));
      _mm512_storeu_ps(dst + c, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), scale));
    }
    out[j] = dst;
  }
}

// S^T rows j0..j0+kBlockJ-1 of the chunk (key rows past n repeat the last:
// computed, never used).
template <int D>
inline void scores_block(const float* const* k, int j0, int n, const float* qt, float* st) {
  __m512 acc[kBlockJ][kRowVecs];
  const float* kr[kBlockJ];
  for (int jj = 0; jj < kBlockJ; ++jj) {
    kr[jj] = k[std::min(j0 + jj, n - 1)];
    for (int v = 0; v < kRowVecs; ++v) acc[jj][v] = _mm512_setzero_ps();
  }
  for (int d = 0; d < D; ++d) {
    __m512 q[kRowVecs];
    for (int v = 0; v < kRowVecs; ++v) q[v] = _mm512_load_ps(qt + d * kRows + v * kLanes);
    for (int jj = 0; jj < kBlockJ; ++jj) {
      const __m512 kb = _mm512_set1_ps(kr[jj][d]);
      for (int v = 0; v < kRowVecs; ++v) acc[jj][v] = _mm512_fmadd_ps(kb, q[v], acc[jj][v]);
    }
  }
  for (int jj = 0; jj < kBlockJ; ++jj)
    for (int v = 0; v < kRowVecs; ++v)
      _mm512_store_ps(st + (j0 + jj) * kRows + v * kLanes, acc[jj][v]);
}

// exp(x) for x <= 0, exactly 0 below -80: masked scores (kMasked) must not
// reach the vector exp's slow out-of-range path.
inline float exp_or_zero(float x) {
  const float e = std::exp(std::max(x, -80.f));
  return x < -80.f ? 0.f : e;
}

// Hides the chunk's keys (positions c0..c0+n-1) that lie after a row's
// position or, under a window, at or before its position - window.
inline void mask_chunk(Scratch& s, int64_t c0, int n, int64_t window) {
  float* __restrict st = s.st;
  for (int j = 0; j < n; ++j) {
    const float key = static_cast<float>(c0 + j);
    if (window == 0) {
#pragma omp simd
      for (int r = 0; r < kRows; ++r)
        if (key > s.pos[r]) st[j * kRows + r] = kMasked;
    } else {
      const float reach = static_cast<float>(window);
#pragma omp simd
      for (int r = 0; r < kRows; ++r)
        if (key > s.pos[r] || key <= s.pos[r] - reach) st[j * kRows + r] = kHidden;
    }
  }
}

// Online softmax over one chunk of keys at positions c0..c0+n-1, lane by
// lane: st's first n rows become P^T (exp(s - m)), m/l/corr are updated;
// rows past n are never read.
inline void softmax_chunk(Scratch& s, int64_t c0, int n, bool masked, int64_t window) {
  float* __restrict st = s.st;
  if (masked) mask_chunk(s, c0, n, window);
  float mx[kRows];
#pragma omp simd
  for (int r = 0; r < kRows; ++r) mx[r] = s.m[r];
  for (int j = 0; j < n; ++j)
#pragma omp simd
    for (int r = 0; r < kRows; ++r) mx[r] = std::max(mx[r], st[j * kRows + r]);
#pragma omp simd
  for (int r = 0; r < kRows; ++r) {
    s.corr[r] = exp_or_zero(s.m[r] - mx[r]);
    s.l[r] *= s.corr[r];
    s.m[r] = mx[r];
  }
  for (int j = 0; j < n; ++j)
#pragma omp simd
    for (int r = 0; r < kRows; ++r) {
      const float p = exp_or_zero(st[j * kRows + r] - mx[r]);
      st[j * kRows + r] = p;
      s.l[r] += p;
    }
}

// O^T's dims d0..d0+kBlockD-1 into registers, rescaled by the chunk's
// softmax correction; and back.
using OtBlock = __m512[kBlockD][kRowVecs];
inline void load_corrected(const Scratch& s, int d0, OtBlock& acc) {
  for (int r = 0; r < kRowVecs; ++r) {
    const __m512 corr = _mm512_load_ps(s.corr + r * kLanes);
    for (int dd = 0; dd < kBlockD; ++dd)
      acc[dd][r] = _mm512_mul_ps(_mm512_load_ps(s.ot + (d0 + dd) * kRows + r * kLanes), corr);
  }
}
inline void store_ot(Scratch& s, int d0, const OtBlock& acc) {
  for (int dd = 0; dd < kBlockD; ++dd)
    for (int r = 0; r < kRowVecs; ++r)
      _mm512_store_ps(s.ot + (d0 + dd) * kRows + r * kLanes, acc[dd][r]);
}

// O^T = O^T * corr + sum_j V[j] P^T[j] over the chunk's n keys.
template <int D>
inline void accumulate_values(const float* const* v, int n, Scratch& s) {
  for (int d0 = 0; d0 < D; d0 += kBlockD) {
    OtBlock acc;
    load_corrected(s, d0, acc);
    for (int j = 0; j < n; ++j) {
      __m512 p[kRowVecs];
      for (int r = 0; r < kRowVecs; ++r) p[r] = _mm512_load_ps(s.st + j * kRows + r * kLanes);
      for (int dd = 0; dd < kBlockD; ++dd) {
        const __m512 vb = _mm512_set1_ps(v[j][d0 + dd]);
        for (int r = 0; r < kRowVecs; ++r) acc[dd][r] = _mm512_fmadd_ps(vb, p[r], acc[dd][r]);
      }
    }
    store_ot(s, d0, acc);
  }
}

// Row r of a task is token r / group, head r % group. Q^T (scaled) into
// s.qt, positions and softmax state reset, O^T zeroed.
template <int D, typename T>
void start_task(const Task<T>& t, Scratch& s) {
  const int rows = static_cast<int>(t.tokens) * t.group;
  for (int r = 0; r < kRows; ++r) {
    const bool live = r < rows;
    const int64_t tok = r / t.group, g = r % t.group;
    const float* src = t.q + tok * t.q_tok + g * t.q_head;
    for (int d = 0; d < D; ++d) s.qt[d * kRows + r] = live ? src[d] * t.scale : 0.f;
    s.pos[r] = static_cast<float>(t.first_pos + (live ? tok : 0));
    s.m[r] = kMasked;
    s.l[r] = 0.f;
  }
  std::fill_n(s.ot, D * kRows, 0.f);
}

template <int D, typename T>
void finish_task(const Task<T>& t, const Scratch& s) {
  const int rows = static_cast<int>(t.tokens) * t.group;
  for (int r = 0; r < rows; ++r) {
    const int64_t tok = r / t.group, g = r % t.group;
    float* dst = t.out + tok * t.o_tok + g * t.o_head;
    const float inv = 1.f / s.l[r];
    for (int d = 0; d < D; ++d) dst[d] = s.ot[d * kRows + r] * inv;
  }
}

// The cache slot of context position c0 (chunks never straddle a block:
// block sizes are multiples of kChunk).
template <typename T>
inline const T* chunk_rows(const Task<T>& t, int64_t c0) {
  return t.k + t.blocks[c0 / t.block_size] * t.block_elems + c0 % t.block_size * t.row;
}

// The first chunk a task reads: its first token's first in-window key's
// (chunks before it are skipped unread), or 0 without a window.
template <typename T>
inline int64_t first_chunk(const Task<T>& t) {
  if (t.window == 0) return 0;
  const int64_t first_key = std::max<int64_t>(0, t.first_pos - t.window + 1);
  return first_key - first_key % kChunk;
}

// Whether a chunk from c0 holds a key some row of the task must not see:
// past the first row's position, or under a window at or before the last
// row's window start.
template <typename T>
inline bool chunk_needs_mask(const Task<T>& t, int64_t c0) {
  const int64_t last = t.first_pos + t.tokens - 1;
  return c0 + kChunk - 1 > t.first_pos || (t.window > 0 && c0 <= last - t.window);
}

template <int D, typename T>
void run_task(const Task<T>& t, Scratch& s) {
  start_task<D>(t, s);
  const int64_t last = t.first_pos + t.tokens - 1;  // the last key any row sees
  const float* k_rows[kChunk];
  const float* v_rows[kChunk];
  for (int64_t c0 = first_chunk(t); c0 <= last; c0 += kChunk) {
    const int n = static_cast<int>(std::min<int64_t>(kChunk, last + 1 - c0));
    const T* k = chunk_rows(t, c0);
    rows_of<D>(k, t.row, n, s.kf, k_rows);
    rows_of<D>(k + t.v_off, t.row, n, s.vf, v_rows);
    for (int j0 = 0; j0 < n; j0 += kBlockJ) scores_block<D>(k_rows, j0, n, s.qt, s.st);
    softmax_chunk(s, c0, n, chunk_needs_mask(t, c0), t.window);
    accumulate_values<D>(v_rows, n, s);
  }
  finish_task<D>(t, s);
}

#if defined(__AVX512BF16__)
// A bfloat16 cache on CPUs with AVX512_BF16: vdpbf16ps multiplies pairs of
// bfloat16 with float32 sums, so K and V are read as they are (no widening)
// and each instruction does two keys' or two dims' products. Q and P are
// rounded to bfloat16 for it, as GPU flash attention and llama.cpp's and
// vLLM's CPU kernels round them. (Decode attention, bound by reading the
// cache, gained nothing from the same products and keeps float32.)
inline uint32_t bf16_pair(float lo, float hi) {
  return static_cast<uint32_t>(c10::BFloat16(lo).x) |
         (static_cast<uint32_t>(c10::BFloat16(hi).x) << 16);
}

// S^T rows j0..j0+kBlockJ-1 from bfloat16 K rows: per pair of dims, K's
// (d, d+1) pair broadcast (one 32-bit load from the row) times Q^T's pairs.
template <int D>
inline void scores_block_bf16(const c10::BFloat16* k, int64_t row, int j0, int n,
                              const uint32_t* qtb, float* st) {
  __m512 acc[kBlockJ][kRowVecs];
  const uint32_t* kr[kBlockJ];
  for (int jj = 0; jj < kBlockJ; ++jj) {
    kr[jj] = reinterpret_cast<const uint32_t*>(k + std::min(j0 + jj, n - 1) * row);
    for (int v = 0; v < kRowVecs; ++v) acc[jj][v] = _mm512_setzero_ps();
  }
  for (int i = 0; i < D / 2; ++i) {
    __m512bh q[kRowVecs];
    for (int v = 0; v < kRowVecs; ++v)
      q[v] = (__m512bh)_mm512_load_si512(qtb + i * kRows + v * kLanes);
    for (int jj = 0; jj < kBlockJ; ++jj) {
      const __m512bh kb = (__m512bh)_mm512_set1_epi32(static_cast<int>(kr[jj][i]));
      for (int v = 0; v < kRowVecs; ++v) acc[jj][v] = _mm512_dpbf16_ps(acc[jj][v], kb, q[v]);
    }
  }
  for (int jj = 0; jj < kBlockJ; ++jj)
    for (int v = 0; v < kRowVecs; ++v)
      _mm512_store_ps(st + (j0 + jj) * kRows + v * kLanes, acc[jj][v]);
}

// P^T's keys and V's rows in (j, j+1) pairs; an odd last key pairs with a
// zero probability and a copy of its own row (finite, unlike what lies past it).
template <int D>
inline void pair_chunk(const c10::BFloat16* v, int64_t row, int n, Scratch& s) {
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25,
                                              9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18,
                                              2, 17, 1, 16, 0);
  for (int j = 0; j < n; j += 2) {
    const bool odd = j + 1 == n;
    for (int r = 0; r < kRowVecs; ++r) {
      const __m512 p0 = _mm512_load_ps(s.st + j * kRows + r * kLanes);
      const __m512 p1 = odd ? _mm512_setzero_ps() : _mm512_load_ps(s.st + (j + 1) * kRows + r * kLanes);
      // p0's 16 bfloat16 in the low half, p1's in the high half: interleave.
      const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(p1, p0);
      _mm512_store_si512(s.ptb + j / 2 * kRows + r * kLanes,
                         _mm512_permutexvar_epi16(interleave, both));
    }
    const uint16_t* r0 = reinterpret_cast<const uint16_t*>(v + j * row);
    const uint16_t* r1 = odd ? r0 : r0 + row;
    for (int d = 0; d < D; d += 16) {
      const __m512i a = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r0 + d)));
      const __m512i b = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r1 + d)));
      _mm512_store_si512(s.vpb + j / 2 * D + d, _mm512_or_si512(a, _mm512_slli_epi32(b, 16)));
    }
  }
}

// O^T = O^T * corr + sum over key pairs of V's (j, j+1) pair (broadcast)
// times P^T's.
template <int D>
inline void accumulate_values_bf16(int n, Scratch& s) {
  for (int d0 = 0; d0 < D; d0 += kBlockD) {
    OtBlock acc;
    load_corrected(s, d0, acc);
    for (int jp = 0; jp < (n + 1) / 2; ++jp) {
      __m512bh p[kRowVecs];
      for (int r = 0; r < kRowVecs; ++r)
        p[r] = (__m512bh)_mm512_load_si512(s.ptb + jp * kRows + r * kLanes);
      for (int dd = 0; dd < kBlockD; ++dd) {
        const __m512bh vb =
            (__m512bh)_mm512_set1_epi32(static_cast<int>(s.vpb[jp * D + d0 + dd]));
        for (int r = 0; r < kRowVecs; ++r) acc[dd][r] = _mm512_dpbf16_ps(acc[dd][r], vb, p[r]);
      }
    }
    store_ot(s, d0, acc);
  }
}

template <int D>
void run_task_bf16(const Task<c10::BFloat16>& t, Scratch& s) {
  start_task<D>(t, s);
  for (int i = 0; i < D / 2; ++i)
    for (int r = 0; r < kRows; ++r)
      s.qtb[i * kRows + r] = bf16_pair(s.qt[2 * i * kRows + r], s.qt[(2 * i + 1) * kRows + r]);
  const int64_t last = t.first_pos + t.tokens - 1;
  for (int64_t c0 = first_chunk(t); c0 <= last; c0 += kChunk) {
    const int n = static_cast<int>(std::min<int64_t>(kChunk, last + 1 - c0));
    const c10::BFloat16* k = chunk_rows(t, c0);
    for (int j0 = 0; j0 < n; j0 += kBlockJ) scores_block_bf16<D>(k, t.row, j0, n, s.qtb, s.st);
    softmax_chunk(s, c0, n, chunk_needs_mask(t, c0), t.window);
    pair_chunk<D>(k + t.v_off, t.row, n, s);
    accumulate_values_bf16<D>(n, s);
  }
  finish_task<D>(t, s);
}
#endif

struct TaskIndex {
  int64_t seq, head, first_token, tokens, cost;
};

template <int D, typename T>
void prefill_attention_avx512(at::Tensor out, at::Tensor query, at::Tensor kv_cache,
                              at::Tensor block_table, at::Tensor seq_lens,
                              at::Tensor query_starts, at::Tensor query_lens, double scale,
                              int64_t window) {
  const int64_t P = seq_lens.size(0), H = query.size(1);
  const tandem_kv::Layout L = tandem_kv::layout_of(kv_cache, "prefill_attention");
  const int64_t HKV = L.heads;
  const int group = static_cast<int>(H / HKV);
  const int64_t tile = kRows / group;
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* starts = query_starts.data_ptr<int32_t>();
  const int32_t* q_lens = query_lens.data_ptr<int32_t>();
  std::vector<TaskIndex> tasks;
  for (int64_t p = 0; p < P; ++p) {
    const int64_t q_len = q_lens[p], prefix = lens[p] - q_len;
    for (int64_t t0 = 0; t0 < q_len; t0 += tile) {
      // Keys read: the tile's context, or at most its window and itself.
      const int64_t seen = window > 0 ? std::min(prefix + t0, window) : prefix + t0;
      for (int64_t h = 0; h < HKV; ++h)
        tasks.push_back({p, h, t0, std::min(tile, q_len - t0), seen + tile});
    }
  }
  // Longest first, taken from a shared counter: causal tiles differ in cost.
  std::stable_sort(tasks.begin(), tasks.end(),
                   [](const TaskIndex& a, const TaskIndex& b) { return a.cost > b.cost; });
  const float* q_base = query.data_ptr<float>();
  float* o_base = out.data_ptr<float>();
  const T* cache = static_cast<const T*>(kv_cache.data_ptr());
  const int32_t* bt = block_table.data_ptr<int32_t>();
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), tasks.size());
  [[maybe_unused]] const bool products = bf16_products_allowed.load();
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    // Per thread, kept: a fresh 140 KB a call would be fresh pages each time.
    static thread_local std::unique_ptr<Scratch> scratch;
    if (!scratch) scratch = std::make_unique<Scratch>();
    for (int64_t i = next++; i < static_cast<int64_t>(tasks.size()); i = next++) {
      const TaskIndex& ti = tasks[i];
      const int64_t q_len = q_lens[ti.seq];
      const int64_t row0 = starts[ti.seq] + ti.first_token, head0 = ti.head * group;
      const Task<T> task{q_base + row0 * query.stride(0) + head0 * query.stride(1),
                         query.stride(0),
                         query.stride(1),
                         o_base + row0 * out.stride(0) + head0 * out.stride(1),
                         out.stride(0),
                         out.stride(1),
                         cache + ti.head * L.head_stride,
                         L.v_offset,
                         bt + ti.seq * block_table.stride(0),
                         L.block_size,
                         L.token_stride,
                         L.block_stride,
                         ti.tokens,
                         lens[ti.seq] - q_len + ti.first_token,
                         window,
                         group,
                         static_cast<float>(scale)};
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<T, c10::BFloat16>)
        if (products) {
          run_task_bf16<D>(task, *scratch);
          continue;
        }
#endif
      run_task<D, T>(task, *scratch);
    }
  });
}

using PrefillFn = void (*)(at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                           at::Tensor, at::Tensor, double, int64_t);

template <typename T>
PrefillFn prefill_for(int64_t head_dim) {
  switch (head_dim) {
    case 64: return prefill_attention_avx512<64, T>;
    case 128: return prefill_attention_avx512<128, T>;
    case 256: return prefill_attention_avx512<256, T>;
    default: return nullptr;
  }
}

}  // namespace
#endif

bool prefill_attention_applies(int64_t head_dim, int64_t group, int64_t block_size) {
#if defined(__AVX512F__)
  return (head_dim == 64 || head_dim == 128 || head_dim == 256) && group >= 1 &&
         group <= 48 && block_size % 16 == 0;
#else
  (void)head_dim, (void)group, (void)block_size;
  return false;
#endif
}

bool allow_bf16_attention_products(bool allowed) { return bf16_products_allowed.exchange(allowed); }

bool prefill_attention_on_tiles(int64_t head_dim, const at::Tensor& kv_cache) {
  return prefill_attention_bf16_products() && prefill_attention_amx_applies(head_dim, kv_cache);
}

bool prefill_attention_bf16_products() {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  return bf16_products_allowed.load();
#else
  return false;
#endif
}

void prefill_attention(at::Tensor out, at::Tensor query, at::Tensor kv_cache,
                       at::Tensor block_table, at::Tensor seq_lens, at::Tensor query_starts,
                       at::Tensor query_lens, double scale, int64_t window) {
  TORCH_CHECK(query.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat,
              "prefill_attention: query and out must be float32");
  TORCH_CHECK(window >= 0, "prefill_attention: window must be >= 0 (0: none), got ", window);
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1,
              "prefill_attention: head rows must be contiguous");
  tandem_kv::layout_of(kv_cache, "prefill_attention");  // token- or head-major, else an error
  for (const at::Tensor* t : {&block_table, &seq_lens, &query_starts, &query_lens})
    TORCH_CHECK(t->scalar_type() == at::kInt && t->stride(-1) == 1,
                "prefill_attention: block_table, seq_lens, query_starts and query_lens must be "
                "int32 with contiguous rows");
  const int64_t P = seq_lens.numel();
  TORCH_CHECK(block_table.dim() == 2 && block_table.size(0) == P && query_starts.numel() == P &&
                  query_lens.numel() == P,
              "prefill_attention: one block-table row, length, query start and query length per "
              "sequence");
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* starts = query_starts.data_ptr<int32_t>();
  const int32_t* q_lens = query_lens.data_ptr<int32_t>();
  for (int64_t p = 0; p < P; ++p)
    TORCH_CHECK(q_lens[p] >= 1 && q_lens[p] <= lens[p] && starts[p] >= 0 &&
                    starts[p] + q_lens[p] <= query.size(0) &&
                    (lens[p] + kv_cache.size(2) - 1) / kv_cache.size(2) <= block_table.size(1),
                "prefill_attention: sequence ", p, " (query rows ", starts[p], " + ", q_lens[p],
                ", context ", lens[p], ") does not fit the query or its block-table row");
  const int32_t* bt = block_table.data_ptr<int32_t>();
  for (int64_t p = 0; p < P; ++p)
    for (int64_t b = 0; b * kv_cache.size(2) < lens[p]; ++b) {
      const int32_t block = bt[p * block_table.stride(0) + b];
      TORCH_CHECK(block >= 0 && block < kv_cache.size(1), "prefill_attention: sequence ", p,
                  " names block ", block, " of a ", kv_cache.size(1), "-block cache");
    }
  const int64_t H = query.size(1), HKV = kv_cache.size(3);
  const int64_t row = kv_cache.scalar_type() == at::kChar
                          ? tandem_kv_int8::row_elems(query.size(2))
                          : query.size(2);
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(4) == row, "prefill_attention: cache rows of ",
              kv_cache.size(-1), " elements for head_dim ", query.size(2), " (expected ", row, ")");
  TORCH_CHECK(H % HKV == 0, "prefill_attention: ", H, " query heads over ", HKV, " KV heads");
  TORCH_CHECK(prefill_attention_applies(query.size(2), H / HKV, kv_cache.size(2)),
              "prefill_attention: no kernel for head_dim ", query.size(2), ", group ", H / HKV,
              ", block size ", kv_cache.size(2), " on this build");
  if (prefill_attention_on_tiles(query.size(2), kv_cache))
    return prefill_attention_amx(out, query, kv_cache, block_table, seq_lens, query_starts,
                                 query_lens, scale, window);
#if defined(__AVX512F__)
  const auto dtype = kv_cache.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kChar,
              "prefill_attention: kv_cache must be float32, bfloat16 or int8");
  const PrefillFn fn = dtype == at::kBFloat16 ? prefill_for<c10::BFloat16>(query.size(2))
                       : dtype == at::kChar   ? prefill_for<int8_t>(query.size(2))
                                              : prefill_for<float>(query.size(2));
  fn(out, query, kv_cache, block_table, seq_lens, query_starts, query_lens, scale, window);
#endif
}
