// Python bindings for Tandem's CPU kernels (built by kernels/cpu_kernels.py).
#include <ATen/ATen.h>
#include <torch/extension.h>

#include "kv_copy.h"
#include "shm_index.h"

#include "cpu_ops.h"
#include "decode_stack.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using pybind11::arg;
  // window: a sliding window of that many keys; 0 (the default) is none.
  m.def("decode_attention", &decode_attention, "paged decode attention (float32 queries; float32, bfloat16 or int8 cache)", arg("out"),
        arg("query"), arg("kv_cache"), arg("block_table"), arg("seq_lens"), arg("scale"),
        arg("window") = 0);
  m.def("decode_int8_quantizes_query", &decode_int8_quantizes_query,
        "whether decode over an int8 cache quantizes the query (AVX-512 VNNI)", arg("head_dim"),
        arg("group"));
  m.def("prefill_attention", &prefill_attention,
        "paged causal attention of prefill chunks (float32 queries)", arg("out"), arg("query"),
        arg("kv_cache"), arg("block_table"), arg("seq_lens"), arg("query_starts"),
        arg("query_lens"), arg("scale"), arg("window") = 0,
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("prefill_attention_applies", &prefill_attention_applies,
        "whether prefill_attention has a kernel for (head_dim, group, block_size) here");
  m.def("prefill_attention_bf16_products", &prefill_attention_bf16_products,
        "whether prefill_attention over a bfloat16 cache multiplies in bfloat16 here");
  m.def("prefill_attention_on_tiles", &prefill_attention_on_tiles,
        "whether prefill_attention over this cache runs on AMX tiles here", arg("head_dim"),
        arg("kv_cache"));
  m.def("allow_amx_attention", &allow_amx_attention,
        "let prefill_attention's bfloat16 products run on AMX tiles or not; the previous");
  m.def("allow_bf16_attention_products", &allow_bf16_attention_products,
        "let prefill_attention over bfloat16 caches take bfloat16 products or not; the previous");
  m.def("rms_norm", &rms_norm, "out = rms_norm(x) * weight (float32 rows)");
  m.def("add_rms_norm", &add_rms_norm, "residual += delta; out = rms_norm(residual) * weight");
  m.def("silu_mul", &silu_mul, "out = silu(gate) * up for gate_up = [gate | up]");
  m.def("rope_", &rope_, "rotate-half RoPE in place at the given positions");
  m.def("small_linear", &small_linear, "out = x @ weight.T + bias for a few rows of x");
  m.def("argmax_rows", &argmax_rows, "torch.argmax(x, -1) of float32 rows, rows in parallel");
  m.def("sample_rows", &sample_rows,
        "one token per row of non-negative weights, by inverse CDF at the row's uniform");
  m.def("pack_gguf_blocks", &pack_gguf_blocks,
        "GGUF Q4_0/Q4_1/Q5_0/Q8_0/Q4_K/Q6_K rows [N, bytes] -> Tandem's tiles [tiles, blocks, bytes]",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("pack_bf16", &pack_bf16, "bfloat16 [N, K] -> Tandem's tiles [tiles, blocks, 512]",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("quant_linear", &quant_linear, "out = x @ dequant(packed).T + bias (x in float32 or, opted in, int8)",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("quant_linear_silu", &quant_linear_silu,
        "out = (silu(gate) * up) @ dequant(packed).T + bias, int8 activations, gate_up = [gate | up]",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("dequantize_rows", &dequantize_rows, "float32 rows of a packed weight",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("quant_linear_best_isa", &quant_linear_best_isa,
        "the best SIMD path quant_linear has: 0 portable, 1 AVX2, 2 AVX-512 (VNNI), 3 AMX");
  m.def("quant_linear_cap_isa", &quant_linear_cap_isa,
        "cap every later quant_linear call (serving's too) at a path; returns the new best");
  m.def("quant_linear_bf16_dot_rows", &quant_linear_bf16_dot_rows,
        "from how many rows bf16 weights take bfloat16 inputs (AVX512_BF16); -1: never");
  m.def("quant_linear_amx_bf16_rows", &quant_linear_amx_bf16_rows,
        "from how many rows int8-activation calls take bfloat16 GEMMs on AMX; -1: never, 0: off");
  m.def("quant_linear_set_amx_bf16_rows", &quant_linear_set_amx_bf16_rows,
        "set that threshold (0: off); returns the previous one");
  m.def("quant_mlp_amx", &quant_mlp_amx,
        "out = act(gate) * up @ down^T in one pass on AMX tiles (act 0 SiLU, 1 GELU tanh)",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("cache_kv", &cache_kv, "reshape_and_cache for a float32 cache: K/V rows into slots");
  m.def("cache_kv_int8", &cache_kv_int8,
        "reshape_and_cache for an int8 cache: K/V rows quantized into slots (kv_int8.h)");
  pybind11::class_<StackLinear>(m, "StackLinear")
      .def(pybind11::init<at::Tensor, at::Tensor, at::Tensor, std::vector<at::Tensor>,
                          std::vector<int64_t>>(),
           arg("weight"), arg("bias"), arg("packed"), arg("shards"), arg("shard_rows"));
  pybind11::class_<StackLayer>(m, "StackLayer")
      .def(pybind11::init<>())
      .def_readwrite("input_norm", &StackLayer::input_norm)
      .def_readwrite("q_norm", &StackLayer::q_norm)
      .def_readwrite("k_norm", &StackLayer::k_norm)
      .def_readwrite("attn_out_norm", &StackLayer::attn_out_norm)
      .def_readwrite("mlp_in_norm", &StackLayer::mlp_in_norm)
      .def_readwrite("mlp_out_norm", &StackLayer::mlp_out_norm)
      .def_readwrite("qkv", &StackLayer::qkv)
      .def_readwrite("o", &StackLayer::o)
      .def_readwrite("gate_up", &StackLayer::gate_up)
      .def_readwrite("down", &StackLayer::down)
      .def_readwrite("rotary_dim", &StackLayer::rotary_dim)
      .def_readwrite("rope_table", &StackLayer::rope_table)
      .def_readwrite("window", &StackLayer::window);
  pybind11::class_<StackOptions>(m, "StackOptions")
      .def(pybind11::init<>())
      .def_readwrite("eps", &StackOptions::eps)
      .def_readwrite("num_heads", &StackOptions::num_heads)
      .def_readwrite("num_kv_heads", &StackOptions::num_kv_heads)
      .def_readwrite("head_dim", &StackOptions::head_dim)
      .def_readwrite("scale", &StackOptions::scale)
      .def_readwrite("residual_multiplier", &StackOptions::residual_multiplier)
      .def_readwrite("gelu_tanh", &StackOptions::gelu_tanh)
      .def_readwrite("small_rows", &StackOptions::small_rows)
      .def_readwrite("packed_rows", &StackOptions::packed_rows)
      .def_readwrite("int8_activations", &StackOptions::int8_activations);
  pybind11::class_<DecodeStack>(m, "DecodeStack")
      .def(pybind11::init<std::vector<StackLayer>, at::Tensor, StackOptions>(), arg("layers"),
           arg("final_norm"), arg("options"))
      .def_property_readonly("max_rows", &DecodeStack::max_rows)
      // No Python object is touched inside: other threads run meanwhile.
      .def("forward", &DecodeStack::forward,
           pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("gather_kv_blocks", &gather_kv_blocks, "copy whole KV blocks into frame rows");
  m.def("scatter_kv_blocks", &scatter_kv_blocks, "copy frame rows into whole KV blocks");
  pybind11::class_<KVBlockCopier>(m, "KVBlockCopier")
      .def(pybind11::init<std::vector<at::Tensor>>(), "over each layer's [2, num_blocks, E] view")
      .def("gather_xxh3", &KVBlockCopier::gather_xxh3,
           "blocks into frame rows; each payload's xxh3-64")
      .def("scatter_xxh3", &KVBlockCopier::scatter_xxh3,
           "frame rows whose payload's xxh3-64 matches into blocks; positions that did not");
  pybind11::class_<ShmIndex>(m, "ShmIndex")
      .def(pybind11::init<pybind11::object, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                          int64_t>(),
           "over a shared-memory pool's header: (header, num_slots, then the byte offsets of "
           "clock, evictions, keys, lengths, last_used, state)")
      .def("find", &ShmIndex::find, "each key's full slot (-1: absent); touch marks hits used")
      .def("reserve", &ShmIndex::reserve, "(positions of new keys, slots picked for them)")
      .def("publish", &ShmIndex::publish, "make slots hold keys with sizes, state last")
      .def("lengths", &ShmIndex::lengths, "stored length of each slot");
}
