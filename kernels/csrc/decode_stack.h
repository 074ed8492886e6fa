// DecodeStack: the decoder's layers run in one call (see decode_stack.cpp).
#pragma once
#include <ATen/core/Tensor.h>
#include <vector>

// One linear layer. An empty tensor is "no bias" or "not packed". The packed
// weight is MKL's (kernels/layer_ops.py mkl_pack_linear) or, as uint8,
// quantized tiles (kernels/quant.py), whose float weight is then an [out, 0]
// placeholder; quantized linears take any row count. A weight whose row
// shards are tiles of different kinds (kernels/quant.py ShardedWeight) has
// no packed tensor but shards: each shard's tiles and row count, multiplied
// into its own output columns.
struct StackLinear {
  StackLinear() = default;
  StackLinear(at::Tensor weight, at::Tensor bias, at::Tensor packed,
              std::vector<at::Tensor> shards, std::vector<int64_t> shard_rows)
      : weight(std::move(weight)),
        bias(std::move(bias)),
        packed(std::move(packed)),
        shards(std::move(shards)),
        shard_rows(std::move(shard_rows)) {}
  at::Tensor weight, bias, packed;
  std::vector<at::Tensor> shards;
  std::vector<int64_t> shard_rows;
};

// One decoder layer, as engine/models/llama.py builds it. Norm weights that
// a family lacks are empty tensors: Llama has input_norm and mlp_in_norm
// (HF's post_attention_layernorm); Gemma adds attn_out_norm and mlp_out_norm
// (its sandwich norms) and, as Qwen3 does, q_norm and k_norm over each head.
struct StackLayer {
  at::Tensor input_norm, q_norm, k_norm, attn_out_norm, mlp_in_norm, mlp_out_norm;
  StackLinear qkv, o, gate_up, down;
  int64_t rotary_dim = 0;  // the first rotary_dim dims of each head rotate; 0: no RoPE
  int64_t rope_table = 0;  // which of forward()'s RoPE tables (Gemma's local layers: 1)
  int64_t window = 0;      // a sliding window of that many keys; 0: the whole context
};

// What every layer shares.
struct StackOptions {
  double eps = 1e-6;
  int64_t num_heads = 0, num_kv_heads = 0, head_dim = 0;
  double scale = 1.0;             // attention's
  double residual_multiplier = 1.0;  // Granite's, on each sublayer's output
  bool gelu_tanh = false;         // GeGLU (Gemma) rather than SwiGLU
  // Decodes of up to small_rows rows use small_linear; with every weight
  // packed, decodes of up to packed_rows rows use MKL's packed linear, as
  // the Python layers do (layer_ops: SMALL_LINEAR_ROWS, PACKED_LINEAR_MAX_ROWS).
  int64_t small_rows = 1, packed_rows = 1;
  bool int8_activations = false;  // quantized linears quantize their inputs too
};

class DecodeStack {
 public:
  // The tensors are shared, not copied: weights changed in place stay visible.
  DecodeStack(std::vector<StackLayer> layers, at::Tensor final_norm, StackOptions options);

  // residual [T, hidden] (the embeddings; updated in place) -> the final
  // norm's output. T decode rows (at most max_rows()), one token per
  // sequence, as the Python path's forward. Per layer i: kv_caches[i], and
  // its KV cache group's block_tables[i] and slot_mappings[i]. rope_tables
  // holds (cos, sin) pairs, a layer's rope_table-th pair at 2 * index.
  at::Tensor forward(at::Tensor residual, at::Tensor positions,
                     std::vector<at::Tensor> rope_tables, std::vector<at::Tensor> kv_caches,
                     std::vector<at::Tensor> block_tables, at::Tensor seq_lens,
                     std::vector<at::Tensor> slot_mappings);

  // The largest decode batch forward() takes.
  int64_t max_rows() const { return max_rows_; }

 private:
  struct Linear {
    at::Tensor weight;
    c10::optional<at::Tensor> bias;
    at::Tensor packed;  // undefined: not packed
    std::vector<at::Tensor> shards;  // quantized row shards, each its columns
    std::vector<int64_t> shard_rows;
  };
  struct Layer {
    at::Tensor input_norm, q_norm, k_norm, attn_out_norm, mlp_in_norm, mlp_out_norm;
    Linear qkv, o, gate_up, down;
    int64_t rotary_dim, rope_table, window;
  };
  static bool is_quantized(const Linear& w);
  static Linear linear_of(const StackLinear& w);
  Layer checked_layer(const StackLayer& w) const;
  void check_inputs(const at::Tensor& residual, const at::Tensor& positions,
                    const std::vector<at::Tensor>& rope_tables,
                    const std::vector<at::Tensor>& kv_caches,
                    const std::vector<at::Tensor>& block_tables, const at::Tensor& seq_lens,
                    const std::vector<at::Tensor>& slot_mappings) const;
  // x @ w.T + bias: into `buffer` (small_linear) or a new tensor (MKL).
  at::Tensor linear(at::Tensor& buffer, const at::Tensor& x, const Linear& w) const;
  // q and k of the fused qkv heads [T, heads + 2 kv_heads, D] normed per head
  // (QK-norm), then rotated, in place.
  void norm_and_rotate(const at::Tensor& heads, const Layer& w, const at::Tensor& positions,
                       const std::vector<at::Tensor>& rope_tables) const;
  // w's product with act(gate) * up of gate_up = [gate | up]; `act` holds the
  // activation unless int8 activations over quantized weights quantize a
  // SiLU's as it is computed (never written out).
  at::Tensor down(at::Tensor& buffer, at::Tensor& act, const at::Tensor& gate_up,
                  const Linear& w) const;

  std::vector<Layer> layers_;
  at::Tensor final_norm_;
  StackOptions opt_;
  int64_t max_rows_;
};
