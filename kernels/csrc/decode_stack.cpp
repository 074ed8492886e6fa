// The whole decoder stack for decode steps of a few sequences (float32, CPU).
//
// A single-stream decode step reads every weight once and does little else.
// Driven from Python, each of the model's layers also paid ~150 us of
// interpreter and dispatch overhead around its dozen kernel calls: ~5 ms of a
// ~40 ms step on the default model. Here the layer loop runs in C++, with the
// GIL released (the service's event loop runs meanwhile), calling the very
// kernels the Python path calls, in the same order, so the two paths agree
// bit for bit. See engine/models/llama.py for when it is used. Larger decode
// batches (up to 128 rows) go through MKL's packed linear, as the Python
// layers do, called through the dispatcher: at batch 64 the Python layer
// loop cost ~10 ms of a ~350 ms step, and the GIL was held throughout.
#include "decode_stack.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <cstring>
#include <vector>

#include "cpu_ops.h"
#include "kv_int8.h"

namespace {

c10::optional<at::Tensor> bias_or_none(const at::Tensor& t) {
  // The constructor takes an empty tensor for "no bias" (simpler to bind
  // than a list of optionals).
  if (t.numel() == 0) return c10::nullopt;
  return t;
}

at::Tensor undefined_if_empty(const at::Tensor& t) { return t.numel() == 0 ? at::Tensor() : t; }

}  // namespace

// Quantized linears carry their tiles (uint8, kernels/csrc/quant_linear.cpp)
// where float ones carry MKL's packed copy.
bool DecodeStack::is_quantized(const Linear& w) {
  return !w.shards.empty() || (w.packed.defined() && w.packed.scalar_type() == at::kByte);
}

namespace {

// torch.ops.mkl._mkl_linear(x, packed, weight, bias, rows): what
// kernels/layer_ops.py's _packed_linear calls (same op, same result).
at::Tensor mkl_packed_linear(const at::Tensor& x, const at::Tensor& packed,
                             const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("mkl::_mkl_linear", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const c10::optional<at::Tensor>&, int64_t)>();
  return op.call(x, packed, weight, bias, x.size(0));
}

void check_weight(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous(),
              what, " must be a contiguous float32 CPU tensor");
}

// One float32 row into a cache row of element type T: a copy for float, a
// round-to-nearest-even narrowing for bfloat16 (as Tensor.to does).
template <typename T>
inline void store_row(T* dst, const float* src, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(dst, src, n * sizeof(float));
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i]);
  }
}

// Each token's new K and V rows (row_floats each, at key/value + t * stride)
// into the cache's slot for it, as index_copy_ would do.
template <typename T>
void copy_into_slots(T* k_cache, T* v_cache, int64_t num_slots, int64_t row_floats,
                     const float* key, const float* value, int64_t stride, const int64_t* slot,
                     int64_t num_tokens) {
  for (int64_t t = 0; t < num_tokens; ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < num_slots, "slot ", slot[t], " outside the cache");
  // Both threads: a prefill chunk's thousands of rows were ~1% of its step
  // on one thread while the other waited.
  at::parallel_for(0, num_tokens, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      store_row(k_cache + slot[t] * row_floats, key + t * stride, row_floats);
      store_row(v_cache + slot[t] * row_floats, value + t * stride, row_floats);
    }
  });
}

// K and V rows quantized into an int8 cache (tandem_kv_int8::quantize_rows_at:
// bit for bit as cache_kv_int8 writes them for the Python layers).
void quantize_rows_into_cache(const at::Tensor& kv_cache, const float* key, const float* value,
                              int64_t stride, const int64_t* slot, int64_t num_tokens) {
  const int64_t dim = kv_cache.size(4) - tandem_kv_int8::kScaleBytes;
  tandem_kv_int8::quantize_rows_at(kv_cache, key, value, stride, dim, stride, dim, slot,
                                   num_tokens);
}

// K and V rows (float32, token t's at key/value + t * stride) into a float32,
// bfloat16 or int8 cache [2, blocks, block_size, heads, dim (+ 4 for int8)].
void copy_rows_into_cache(const at::Tensor& kv_cache, const float* key, const float* value,
                          int64_t stride, const int64_t* slot, int64_t num_tokens) {
  if (kv_cache.scalar_type() == at::kChar) {
    quantize_rows_into_cache(kv_cache, key, value, stride, slot, num_tokens);
    return;
  }
  TORCH_CHECK(kv_cache.is_contiguous(), "a float32 or bfloat16 KV cache must be token-major");
  const int64_t row = kv_cache.size(3) * kv_cache.size(4);
  const int64_t num_slots = kv_cache.size(1) * kv_cache.size(2);
  if (kv_cache.scalar_type() == at::kBFloat16) {
    auto* k_cache = static_cast<c10::BFloat16*>(kv_cache.data_ptr());
    copy_into_slots(k_cache, k_cache + num_slots * row, num_slots, row, key, value, stride, slot,
                    num_tokens);
    return;
  }
  float* k_cache = kv_cache.data_ptr<float>();
  copy_into_slots(k_cache, k_cache + num_slots * row, num_slots, row, key, value, stride, slot,
                  num_tokens);
}

void write_kv(const at::Tensor& qkv, const at::Tensor& kv_cache, const at::Tensor& slots,
              int64_t q_heads, int64_t kv_heads, int64_t head_dim) {
  const int64_t row = kv_heads * head_dim;
  const float* key = qkv.data_ptr<float>() + q_heads * head_dim;
  copy_rows_into_cache(kv_cache, key, key + row, qkv.stride(0), slots.data_ptr<int64_t>(),
                       qkv.size(0));
}

}  // namespace

DecodeStack::Linear DecodeStack::linear_of(const StackLinear& w) {
  TORCH_CHECK(w.shards.size() == w.shard_rows.size(), "one row count per shard");
  int64_t rows = 0;
  for (size_t i = 0; i < w.shards.size(); ++i) {
    TORCH_CHECK(w.shards[i].scalar_type() == at::kByte, "shards must be quantized tiles (uint8)");
    rows += w.shard_rows[i];
  }
  TORCH_CHECK(w.shards.empty() || (rows == w.weight.size(0) && w.packed.numel() == 0),
              "a sharded weight's shards must cover its rows, with no packed tensor");
  return {w.weight, bias_or_none(w.bias), undefined_if_empty(w.packed), w.shards, w.shard_rows};
}

DecodeStack::Layer DecodeStack::checked_layer(const StackLayer& w) const {
  Layer layer{w.input_norm,
              undefined_if_empty(w.q_norm),
              undefined_if_empty(w.k_norm),
              undefined_if_empty(w.attn_out_norm),
              w.mlp_in_norm,
              undefined_if_empty(w.mlp_out_norm),
              linear_of(w.qkv),
              linear_of(w.o),
              linear_of(w.gate_up),
              linear_of(w.down),
              w.rotary_dim,
              w.rope_table,
              w.window};
  for (const at::Tensor* t : {&layer.input_norm, &layer.mlp_in_norm, &layer.qkv.weight,
                              &layer.o.weight, &layer.gate_up.weight, &layer.down.weight})
    check_weight(*t, "a layer weight");
  for (const at::Tensor* t : {&layer.q_norm, &layer.k_norm, &layer.attn_out_norm,
                              &layer.mlp_out_norm})
    if (t->defined()) check_weight(*t, "a norm weight");
  TORCH_CHECK(layer.q_norm.defined() == layer.k_norm.defined(), "QK-norm needs both norms");
  TORCH_CHECK(!layer.q_norm.defined() || layer.q_norm.numel() == opt_.head_dim,
              "QK-norm weights must have head_dim elements");
  TORCH_CHECK(layer.rotary_dim >= 0 && layer.rotary_dim <= opt_.head_dim &&
                  layer.rotary_dim % 2 == 0,
              "rotary_dim must be even and at most head_dim, got ", layer.rotary_dim);
  TORCH_CHECK(layer.rope_table >= 0, "rope_table must be >= 0");
  TORCH_CHECK(layer.window >= 0, "window must be >= 0 (0: none)");
  TORCH_CHECK(layer.qkv.weight.size(0) == (opt_.num_heads + 2 * opt_.num_kv_heads) * opt_.head_dim,
              "qkv weight rows do not match the head counts");
  return layer;
}

DecodeStack::DecodeStack(std::vector<StackLayer> layers, at::Tensor final_norm,
                         StackOptions options)
    : final_norm_(std::move(final_norm)),
      opt_(options),
      max_rows_(std::max(options.small_rows, options.packed_rows)) {
  TORCH_CHECK(opt_.num_kv_heads > 0 && opt_.num_heads % opt_.num_kv_heads == 0,
              "query heads must be a multiple of KV heads");
  TORCH_CHECK(opt_.small_rows >= 1, "small_rows must be >= 1");
  check_weight(final_norm_, "final norm");
  for (const StackLayer& w : layers) {
    Layer layer = checked_layer(w);
    for (const Linear* lin : {&layer.qkv, &layer.o, &layer.gate_up, &layer.down}) {
      if (!is_quantized(*lin) && !lin->packed.defined())
        max_rows_ = opt_.small_rows;  // MKL needs every float weight packed
      // A quantized weight's float tensor is an [out, 0] placeholder.
      TORCH_CHECK(is_quantized(*lin) || lin->weight.size(1) > 0, "a float weight is empty");
    }
    layers_.push_back(std::move(layer));
  }
}

at::Tensor DecodeStack::linear(at::Tensor& buffer, const at::Tensor& x, const Linear& w) const {
  if (is_quantized(w)) {
    at::Tensor out = buffer.defined() ? buffer : at::empty({x.size(0), w.weight.size(0)}, x.options());
    const int64_t isa = quant_linear_best_isa();
    if (w.shards.empty()) {
      quant_linear(out, x, w.packed, w.bias, opt_.int8_activations, isa);
      return out;
    }
    // As kernels/quant.py's quant_linear: each shard into its columns.
    int64_t start = 0;
    for (size_t i = 0; i < w.shards.size(); ++i) {
      const int64_t n = w.shard_rows[i];
      c10::optional<at::Tensor> bias;
      if (w.bias) bias = w.bias->narrow(0, start, n);
      quant_linear(out.narrow(1, start, n), x, w.shards[i], bias, opt_.int8_activations, isa);
      start += n;
    }
    return out;
  }
  if (x.size(0) <= opt_.small_rows) {
    small_linear(buffer, x, w.weight, w.bias);
    return buffer;
  }
  return mkl_packed_linear(x, w.packed, w.weight, w.bias);
}

namespace {

// RMSNorm of each [head_dim] row of heads [T, n, D] (a strided view), in
// place: through a contiguous copy, as the Python layers' _norm_heads_.
void norm_heads_(const at::Tensor& heads, const at::Tensor& weight, double eps) {
  const at::Tensor rows = heads.reshape({-1, heads.size(2)}).contiguous();
  at::Tensor normed = at::empty_like(rows);
  rms_norm(normed, rows, weight, eps);
  heads.copy_(normed.view(heads.sizes()));
}

}  // namespace

void DecodeStack::norm_and_rotate(const at::Tensor& heads, const Layer& w,
                                  const at::Tensor& positions,
                                  const std::vector<at::Tensor>& rope_tables) const {
  const int64_t h = opt_.num_heads, hkv = opt_.num_kv_heads;
  if (w.q_norm.defined()) {
    norm_heads_(heads.narrow(1, 0, h), w.q_norm, opt_.eps);
    norm_heads_(heads.narrow(1, h, hkv), w.k_norm, opt_.eps);
  }
  if (w.rotary_dim == 0) return;
  // q and k are adjacent heads of the fused output: one rotation covers both.
  rope_(heads.narrow(1, 0, h + hkv).narrow(2, 0, w.rotary_dim), positions,
        rope_tables[2 * w.rope_table], rope_tables[2 * w.rope_table + 1]);
}

at::Tensor DecodeStack::down(at::Tensor& buffer, at::Tensor& act, const at::Tensor& gate_up,
                             const Linear& w) const {
  if (opt_.gelu_tanh) {
    // As the Python layers: gelu(gate, approximate="tanh") * up.
    const int64_t inter = act.size(1);
    at::mul_out(act, at::gelu(gate_up.narrow(1, 0, inter), "tanh"),
                gate_up.narrow(1, inter, inter));
    return linear(buffer, act, w);
  }
  if (opt_.int8_activations && is_quantized(w) && w.shards.empty()) {
    at::Tensor out = buffer.defined() ? buffer
                                      : at::empty({gate_up.size(0), w.weight.size(0)}, gate_up.options());
    quant_linear_silu(out, gate_up, w.packed, w.bias, quant_linear_best_isa());
    return out;
  }
  silu_mul(act, gate_up);
  return linear(buffer, act, w);
}

void DecodeStack::check_inputs(const at::Tensor& residual, const at::Tensor& positions,
                               const std::vector<at::Tensor>& rope_tables,
                               const std::vector<at::Tensor>& kv_caches,
                               const std::vector<at::Tensor>& block_tables,
                               const at::Tensor& seq_lens,
                               const std::vector<at::Tensor>& slot_mappings) const {
  const size_t n = layers_.size();
  TORCH_CHECK(kv_caches.size() == n && block_tables.size() == n && slot_mappings.size() == n,
              "got ", kv_caches.size(), " KV caches, ", block_tables.size(), " block tables and ",
              slot_mappings.size(), " slot mappings for ", n, " layers");
  const int64_t T = residual.size(0);
  TORCH_CHECK(positions.numel() == T, "one position per row");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous() && seq_lens.numel() == T,
              "seq_lens must be contiguous int32, one per row");
  TORCH_CHECK(rope_tables.size() % 2 == 0, "rope_tables holds (cos, sin) pairs");
  for (size_t i = 0; i < n; ++i) {
    const Layer& w = layers_[i];
    TORCH_CHECK(w.rotary_dim == 0 || 2 * w.rope_table + 1 < static_cast<int64_t>(rope_tables.size()),
                "layer ", i, " rotates by RoPE table ", w.rope_table, ": not given");
    const at::Tensor& slots = slot_mappings[i];
    TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == T,
                "slot_mapping must be contiguous int64, one slot per row");
    const at::Tensor& table = block_tables[i];
    TORCH_CHECK(table.scalar_type() == at::kInt && table.dim() == 2 && table.size(0) == T &&
                    table.stride(1) == 1,
                "block_table must be int32 [rows, blocks] with contiguous rows");
  }
  TORCH_CHECK(T <= max_rows_, "decode batch of ", T, " rows: the stack takes at most ",
              max_rows_);
}

at::Tensor DecodeStack::forward(at::Tensor residual, at::Tensor positions,
                                std::vector<at::Tensor> rope_tables,
                                std::vector<at::Tensor> kv_caches,
                                std::vector<at::Tensor> block_tables, at::Tensor seq_lens,
                                std::vector<at::Tensor> slot_mappings) {
  check_inputs(residual, positions, rope_tables, kv_caches, block_tables, seq_lens,
               slot_mappings);
  const int64_t T = residual.size(0), hidden = residual.size(1);
  const int64_t h = opt_.num_heads, hkv = opt_.num_kv_heads, D = opt_.head_dim;
  const int64_t inter = layers_.empty() ? 0 : layers_[0].gate_up.weight.size(0) / 2;
  const auto opts = residual.options();
  // Buffers shared by every layer: each is fully rewritten before it is read
  // (the small_linear outputs only for batches it serves).
  const bool small = T <= opt_.small_rows;
  auto small_buffer = [&](int64_t cols) {
    return small ? at::empty({T, cols}, opts) : at::Tensor();
  };
  at::Tensor x = at::empty({T, hidden}, opts), qkv_buf = small_buffer((h + 2 * hkv) * D);
  at::Tensor attn = at::empty({T, h * D}, opts), proj_buf = small_buffer(hidden);
  at::Tensor gate_up_buf = small_buffer(2 * inter), act = at::empty({T, inter}, opts);
  at::Tensor delta = small_buffer(hidden);
  const at::Tensor attn_heads = attn.view({T, h, D});
  const double multiplier = opt_.residual_multiplier;
  for (size_t i = 0; i < layers_.size(); ++i) {
    const Layer& w = layers_[i];
    if (i == 0)
      rms_norm(x, residual, w.input_norm, opt_.eps);
    else
      add_rms_norm(x, residual, delta, w.input_norm, opt_.eps);
    const at::Tensor qkv = linear(qkv_buf, x, w.qkv);
    const at::Tensor heads = qkv.view({T, h + 2 * hkv, D});
    norm_and_rotate(heads, w, positions, rope_tables);
    write_kv(qkv, kv_caches[i], slot_mappings[i], h, hkv, D);
    decode_attention(attn_heads, heads.narrow(1, 0, h), kv_caches[i], block_tables[i], seq_lens,
                     opt_.scale, w.window);
    at::Tensor attn_out = linear(proj_buf, attn, w.o);
    if (multiplier != 1.0) attn_out.mul_(multiplier);
    if (w.attn_out_norm.defined()) {
      at::Tensor normed = at::empty_like(attn_out);
      rms_norm(normed, attn_out, w.attn_out_norm, opt_.eps);
      attn_out = normed;
    }
    add_rms_norm(x, residual, attn_out, w.mlp_in_norm, opt_.eps);
    delta = down(delta, act, linear(gate_up_buf, x, w.gate_up), w.down);
    if (multiplier != 1.0) delta.mul_(multiplier);
    if (w.mlp_out_norm.defined()) {
      at::Tensor normed = at::empty_like(delta);
      rms_norm(normed, delta, w.mlp_out_norm, opt_.eps);
      delta = normed;
    }
  }
  at::Tensor out = at::empty({T, hidden}, opts);
  if (layers_.empty())
    rms_norm(out, residual, final_norm_, opt_.eps);
  else
    add_rms_norm(out, residual, delta, final_norm_, opt_.eps);
  return out;
}

// The torch backend's reshape_and_cache for float32 keys into float32 or
// bfloat16 CPU caches: one call per layer instead of two index_copy_ calls
// (~40 us each at decode batch 64).
void cache_kv(at::Tensor kv_cache, at::Tensor key, at::Tensor value, at::Tensor slot_mapping) {
  TORCH_CHECK((kv_cache.scalar_type() == at::kFloat ||
               kv_cache.scalar_type() == at::kBFloat16) &&
                  kv_cache.is_contiguous() && kv_cache.dim() == 5,
              "kv_cache must be a contiguous float32 or bfloat16 [2, blocks, block_size, heads, "
              "dim] tensor");
  const int64_t T = key.size(0), heads = kv_cache.size(3), dim = kv_cache.size(4);
  for (const at::Tensor* t : {&key, &value})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 3 && t->size(0) == T &&
                    t->size(1) == heads && t->size(2) == dim && t->stride(2) == 1 &&
                    t->stride(1) == dim && t->stride(0) == key.stride(0),
                "key and value must be float32 [T, heads, dim] with each token's heads adjacent");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.numel() == T,
              "slot_mapping must be contiguous int64, one per token");
  copy_rows_into_cache(kv_cache, key.data_ptr<float>(), value.data_ptr<float>(), key.stride(0),
                       slot_mapping.data_ptr<int64_t>(), T);
}
