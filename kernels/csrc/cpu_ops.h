// The float32 CPU kernels' entry points, shared by the bindings and by
// decode_stack.cpp (which calls them from C++). Each is defined in one .cpp.
#pragma once
#include <ATen/core/Tensor.h>
#include <vector>

// decode_attention.cpp; kv_cache float32, bfloat16 or int8 (kv_int8.h). window: a sliding window of that many keys (the
// token itself included); 0 is the whole causal context.
void decode_attention(at::Tensor out, at::Tensor query, at::Tensor kv_cache,
                      at::Tensor block_table, at::Tensor seq_lens, double scale,
                      int64_t window = 0);
// Whether decode_attention over an int8 cache quantizes the query (integer
// scores on AVX-512 VNNI; kernels/kv_int8.py's decode_query says how) for
// this head size and GQA group, or reads it as float32.
bool decode_int8_quantizes_query(int64_t head_dim, int64_t group);

// prefill_attention.cpp: causal attention of prefill chunks (AVX-512 builds)
bool prefill_attention_applies(int64_t head_dim, int64_t group, int64_t block_size);
// Whether prefill_attention over a bfloat16 cache multiplies in bfloat16
// (AVX512_BF16) rather than widening rows to float32. It does where the CPU
// can unless disallowed (process-wide; allowed by default): benchmarks time
// the float32 arithmetic against it.
bool prefill_attention_bf16_products();
bool allow_bf16_attention_products(bool allowed);  // returns the previous setting
void prefill_attention(at::Tensor out, at::Tensor query, at::Tensor kv_cache,
                       at::Tensor block_table, at::Tensor seq_lens, at::Tensor query_starts,
                       at::Tensor query_lens, double scale, int64_t window = 0);
// prefill_attention_amx.cpp: the bfloat16 products on AMX tiles, which
// prefill_attention takes over a bfloat16 or int8 cache where the CPU has
// AMX-BF16 and bfloat16 products are allowed; allow_amx_attention(false)
// keeps it on the vector kernels (returns the previous setting).
// prefill_attention_on_tiles: whether a call over this cache takes them.
bool prefill_attention_amx_applies(int64_t head_dim, const at::Tensor& kv_cache);
bool prefill_attention_on_tiles(int64_t head_dim, const at::Tensor& kv_cache);
bool allow_amx_attention(bool allowed);
void prefill_attention_amx(at::Tensor out, at::Tensor query, at::Tensor kv_cache,
                           at::Tensor block_table, at::Tensor seq_lens, at::Tensor query_starts,
                           at::Tensor query_lens, double scale, int64_t window);

// fused_ops.cpp
void rms_norm(at::Tensor out, at::Tensor x, at::Tensor weight, double eps);
void add_rms_norm(at::Tensor out, at::Tensor residual, at::Tensor delta,
                  at::Tensor weight, double eps);
void silu_mul(at::Tensor out, at::Tensor gate_up);
void rope_(at::Tensor x, at::Tensor positions, at::Tensor cos_cache, at::Tensor sin_cache);
void small_linear(at::Tensor out, at::Tensor x, at::Tensor weight,
                  const c10::optional<at::Tensor>& bias);
at::Tensor argmax_rows(at::Tensor x);
at::Tensor sample_rows(at::Tensor probs, at::Tensor uniforms);

// quant_pack.cpp, quant_linear.cpp (layout: quant_tiles.h)
at::Tensor pack_gguf_blocks(at::Tensor raw, int64_t ggml_type);
at::Tensor pack_bf16(at::Tensor weight);
void quant_linear(at::Tensor out, at::Tensor x, at::Tensor packed,
                  const c10::optional<at::Tensor>& bias, bool int8_activations, int64_t isa);
// out = (silu(gate) * up) @ dequant(packed).T + bias for gate_up = [gate | up],
// with int8 activations (Q4/Q8 weights): the activation quantized as computed.
void quant_linear_silu(at::Tensor out, at::Tensor gate_up, at::Tensor packed,
                       const c10::optional<at::Tensor>& bias, int64_t isa);
at::Tensor dequantize_rows(at::Tensor packed, at::Tensor rows, int64_t in_features);
int64_t quant_linear_best_isa();  // 0 portable, 1 AVX2, 2 AVX-512 (VNNI), 3 AMX
// Caps every later call's path at `level` (for A/B benchmarks); the new best.
int64_t quant_linear_cap_isa(int64_t level);
// From how many rows BF16 weights multiply bfloat16-rounded inputs
// (AVX512_BF16, at the avx512 level); -1 where the build has no such path.
int64_t quant_linear_bf16_dot_rows();
// From how many rows the int8 path's calls take oneDNN's bfloat16 GEMM on
// AMX tiles (quant_expand.h amx_bf16_gemm); -1 where the build has no AMX-BF16,
// 0 when turned off. The setter (0: off) returns the previous threshold.
int64_t quant_linear_amx_bf16_rows();
int64_t quant_linear_set_amx_bf16_rows(int64_t rows);
// A gated MLP in one call on AMX tiles (quant_expand.h amx_bf16_mlp): out =
// act(gate) * up @ down^T for calls of at least quant_linear_amx_bf16_rows()
// rows; act 0 = SiLU, 1 = GELU (tanh). Refused where that path is not taken.
void quant_mlp_amx(at::Tensor out, at::Tensor x, at::Tensor gate_up, at::Tensor down,
                   int64_t intermediate, const c10::optional<at::Tensor>& gate_up_bias,
                   const c10::optional<at::Tensor>& down_bias, int64_t act);

// decode_stack.cpp
void cache_kv(at::Tensor kv_cache, at::Tensor key, at::Tensor value, at::Tensor slot_mapping);

// kv_int8.cpp: reshape_and_cache into an int8 cache (format: kv_int8.h)
void cache_kv_int8(at::Tensor kv_cache, at::Tensor key, at::Tensor value, at::Tensor slot_mapping);

// kv_copy.cpp
void gather_kv_blocks(at::Tensor frames, int64_t offset, std::vector<at::Tensor> layers,
                      at::Tensor block_ids, at::Tensor frame_rows);
void scatter_kv_blocks(at::Tensor frames, int64_t offset, std::vector<at::Tensor> layers,
                       at::Tensor block_ids, at::Tensor frame_rows);
