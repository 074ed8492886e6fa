// DecodeStack: the decoder's layers run in one call (see decode_stack.cpp).
#pragma once
#include <ATen/core/Tensor.h>
#include <vector>

class DecodeStack {
 public:
  // layers[i] = {input_norm, qkv, qkv_bias, o, o_bias, post_norm, gate_up,
  // gate_up_bias, down, down_bias}; an empty tensor is "no bias". The
  // tensors are shared, not copied: weights changed in place stay visible.
  DecodeStack(std::vector<std::vector<at::Tensor>> layers, at::Tensor final_norm, double eps,
              int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double scale);

  // residual [T, hidden] (the embeddings; updated in place) -> the final
  // norm's output. T decode rows, one token per sequence, as the Python
  // path's forward; kv_caches[i] is layer i's paged cache.
  at::Tensor forward(at::Tensor residual, at::Tensor positions, at::Tensor cos_cache,
                     at::Tensor sin_cache, std::vector<at::Tensor> kv_caches,
                     at::Tensor block_table, at::Tensor seq_lens, at::Tensor slot_mapping);

 private:
  struct Layer {
    at::Tensor input_norm, qkv;
    c10::optional<at::Tensor> qkv_bias;
    at::Tensor o;
    c10::optional<at::Tensor> o_bias;
    at::Tensor post_norm, gate_up;
    c10::optional<at::Tensor> gate_up_bias;
    at::Tensor down;
    c10::optional<at::Tensor> down_bias;
  };
  std::vector<Layer> layers_;
  at::Tensor final_norm_;
  double eps_;
  int64_t heads_, kv_heads_, head_dim_;
  double scale_;
};
