// DecodeStack: the decoder's layers run in one call (see decode_stack.cpp).
#pragma once
#include <ATen/core/Tensor.h>
#include <vector>

class DecodeStack {
 public:
  // layers[i] = {input_norm, qkv, qkv_bias, o, o_bias, post_norm, gate_up,
  // gate_up_bias, down, down_bias, qkv_packed, o_packed, gate_up_packed,
  // down_packed}; an empty tensor is "no bias" or "not packed". The packed
  // weights are MKL's (kernels/layer_ops.py mkl_pack_linear) or, as uint8,
  // quantized tiles (kernels/quant.py), whose float weight is then an
  // [out, 0] placeholder; quantized linears take any row count. The tensors
  // are shared, not copied: weights changed in place stay visible.
  // Decodes of up to small_rows rows use small_linear; with every weight
  // packed, decodes of up to packed_rows rows use MKL's packed linear, as
  // the Python layers do (layer_ops: SMALL_LINEAR_ROWS, PACKED_LINEAR_MAX_ROWS).
  DecodeStack(std::vector<std::vector<at::Tensor>> layers, at::Tensor final_norm, double eps,
              int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double scale,
              int64_t small_rows, int64_t packed_rows, bool int8_activations);

  // residual [T, hidden] (the embeddings; updated in place) -> the final
  // norm's output. T decode rows (at most max_rows()), one token per
  // sequence, as the Python path's forward; kv_caches[i] is layer i's cache.
  at::Tensor forward(at::Tensor residual, at::Tensor positions, at::Tensor cos_cache,
                     at::Tensor sin_cache, std::vector<at::Tensor> kv_caches,
                     at::Tensor block_table, at::Tensor seq_lens, at::Tensor slot_mapping);

  // The largest decode batch forward() takes.
  int64_t max_rows() const { return max_rows_; }

 private:
  struct Linear {
    at::Tensor weight;
    c10::optional<at::Tensor> bias;
    at::Tensor packed;  // undefined: not packed
  };
  struct Layer {
    at::Tensor input_norm;
    Linear qkv, o;
    at::Tensor post_norm;
    Linear gate_up, down;
  };
  static bool is_quantized(const Linear& w);
  // x @ w.T + bias: into `buffer` (small_linear) or a new tensor (MKL).
  at::Tensor linear(at::Tensor& buffer, const at::Tensor& x, const Linear& w) const;
  // w's product with silu(gate) * up of gate_up = [gate | up]; `act` holds the
  // activation unless int8 activations over quantized weights quantize it as
  // it is computed (never written out).
  at::Tensor down(at::Tensor& buffer, at::Tensor& act, const at::Tensor& gate_up,
                  const Linear& w) const;

  std::vector<Layer> layers_;
  at::Tensor final_norm_;
  double eps_;
  int64_t heads_, kv_heads_, head_dim_;
  double scale_;
  int64_t small_rows_, max_rows_;
  bool int8_activations_;  // quantized linears quantize their inputs too
};
