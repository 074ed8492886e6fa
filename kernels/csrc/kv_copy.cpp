// Whole-KV-block copies between the paged cache and connector frames.
//
// A frame row holds, after `offset` header bytes, every layer's K then V of
// one block: [layers, 2, block elements]. Each layer's cache is viewed as
// [2, num_blocks, block elements]. One memcpy per (block, layer, half),
// blocks split across threads: numpy needed a temporary or a strided take
// that ran at a third of memcpy speed.
//
// KVBlockCopier (kv_copy.h) also checksums each frame's payload (xxh3-64, seed 0:
// the value BlockCodec stores in frame headers). A payload is one block
// (hundreds of KiB, within a core's L2), so hashing it right after its copy
// out (save) or right before its copy in (load) reads it from cache, not
// from memory: copy and checksum cost about one pass over the bytes, not
// two. A load hashes before it copies so that a corrupt payload never
// reaches the cache. It takes block ids and rows as lists and frames as any
// buffer, not tensors: most calls move a few blocks, where making tensors
// cost more than the call.
#include <ATen/ATen.h>
#include <torch/extension.h>

#include <cstring>
#include <utility>
#include <vector>

#include "kv_copy.h"

// Header-only, every function static inline: nothing clashes with another
// copy of xxHash in the process (the Python xxhash package has its own).
#define XXH_INLINE_ALL
#include "third_party/xxhash/xxhash.h"

using tandem_kv::Batch;
using tandem_kv::Plan;

namespace {

Plan make_plan(const std::vector<at::Tensor>& layers, const at::Tensor& frames, int64_t offset,
               const Batch& batch) {
  TORCH_CHECK(!layers.empty(), "kv copy: no layers");
  TORCH_CHECK(frames.dim() == 2 && frames.scalar_type() == at::kByte && frames.stride(1) == 1,
              "kv copy: frames must be uint8 [n, frame_bytes] with contiguous rows");
  if (batch.rows == nullptr) {
    TORCH_CHECK(batch.n == frames.size(0), "kv copy: one frame row per block id");
  }
  for (int64_t j = 0; j < batch.n; ++j) {
    TORCH_CHECK(batch.row(j) >= 0 && batch.row(j) < frames.size(0), "kv copy: frame row ",
                batch.row(j), " outside the frames (", frames.size(0), " rows)");
  }
  const auto& first = layers[0];
  Plan plan;
  const int64_t item = first.element_size();
  plan.row = first.size(2) * item;
  plan.half_stride = first.stride(0) * item;
  plan.block_stride = first.stride(1) * item;
  const int64_t num_blocks = first.size(1);
  for (const auto& layer : layers) {
    TORCH_CHECK(layer.device().is_cpu() && layer.dim() == 3 && layer.stride(2) == 1 &&
                    layer.sizes() == first.sizes() && layer.strides() == first.strides() &&
                    layer.scalar_type() == first.scalar_type(),
                "kv copy: every layer must be a CPU [2, num_blocks, E] view like the first");
    plan.bases.push_back(static_cast<uint8_t*>(layer.data_ptr()));
  }
  TORCH_CHECK(offset >= 0 && offset + plan.payload_bytes() <= frames.size(1),
              "kv copy: frame rows are too short for the payload");
  for (int64_t j = 0; j < batch.n; ++j) {
    TORCH_CHECK(batch.ids[j] >= 0 && batch.ids[j] < num_blocks, "kv copy: block id ",
                batch.ids[j], " outside the cache (", num_blocks, " blocks)");
  }
  plan.frames = frames.data_ptr<uint8_t>() + offset;
  plan.frame_stride = frames.stride(0);
  return plan;
}

Batch tensor_batch(const at::Tensor& block_ids, const at::Tensor& frame_rows) {
  TORCH_CHECK(block_ids.dim() == 1 && block_ids.scalar_type() == at::kLong &&
                  block_ids.is_contiguous(),
              "kv copy: block_ids must be int64 [n]");
  const int64_t n = block_ids.size(0);
  if (frame_rows.numel() == 0) {
    return {block_ids.data_ptr<int64_t>(), nullptr, n};
  }
  TORCH_CHECK(frame_rows.dim() == 1 && frame_rows.scalar_type() == at::kLong &&
                  frame_rows.is_contiguous() && frame_rows.size(0) == n,
              "kv copy: frame_rows must be int64 [n], one per block id");
  return {block_ids.data_ptr<int64_t>(), frame_rows.data_ptr<int64_t>(), n};
}

Batch list_batch(const std::vector<int64_t>& block_ids, const std::vector<int64_t>& frame_rows) {
  const auto n = static_cast<int64_t>(block_ids.size());
  if (frame_rows.empty()) {
    return {block_ids.data(), nullptr, n};
  }
  TORCH_CHECK(static_cast<int64_t>(frame_rows.size()) == n,
              "kv copy: frame_rows must name one row per block id");
  return {block_ids.data(), frame_rows.data(), n};
}

// One block between the cache and its frame payload.
template <bool kToFrames>
void copy_block(const Plan& plan, uint8_t* payload, int64_t block_id) {
  for (uint8_t* base : plan.bases) {
    for (int64_t h = 0; h < 2; ++h) {
      uint8_t* cache = base + h * plan.half_stride + block_id * plan.block_stride;
      if (kToFrames) {
        std::memcpy(payload, cache, plan.row);
      } else {
        std::memcpy(cache, payload, plan.row);
      }
      payload += plan.row;
    }
  }
}

template <bool kToFrames>
void copy_blocks(const Plan& plan, const Batch& batch) {
#pragma omp parallel for schedule(static) if (batch.n > 1)
  for (int64_t j = 0; j < batch.n; ++j) {
    copy_block<kToFrames>(plan, plan.payload(batch.row(j)), batch.ids[j]);
  }
}

uint64_t xxh3(const uint8_t* data, int64_t length) {
  return XXH3_64bits(data, static_cast<size_t>(length));
}

// copy_block<true> that hashes each (layer, half) piece right after copying
// it, while it is in L1, into one running xxh3-64 of the whole payload (the
// same value as hashing it at once). Interleaved this way the hashing also
// overlaps the copy's stores still draining to memory: a save of one block
// cost the copy plus ~30% before.
uint64_t copy_block_out_xxh3(const Plan& plan, uint8_t* payload, int64_t block_id) {
  XXH3_state_t state;
  XXH3_INITSTATE(&state);
  XXH3_64bits_reset(&state);
  for (uint8_t* base : plan.bases) {
    for (int64_t h = 0; h < 2; ++h) {
      std::memcpy(payload, base + h * plan.half_stride + block_id * plan.block_stride, plan.row);
      XXH3_64bits_update(&state, payload, static_cast<size_t>(plan.row));
      payload += plan.row;
    }
  }
  return XXH3_64bits_digest(&state);
}

}  // namespace

// frame_rows: which row of `frames` each block uses (empty: row j for block j).
void gather_kv_blocks(at::Tensor frames, int64_t offset, std::vector<at::Tensor> layers,
                      at::Tensor block_ids, at::Tensor frame_rows) {
  const Batch batch = tensor_batch(block_ids, frame_rows);
  copy_blocks<true>(make_plan(layers, frames, offset, batch), batch);
}

void scatter_kv_blocks(at::Tensor frames, int64_t offset, std::vector<at::Tensor> layers,
                       at::Tensor block_ids, at::Tensor frame_rows) {
  const Batch batch = tensor_batch(block_ids, frame_rows);
  copy_blocks<false>(make_plan(layers, frames, offset, batch), batch);
}

// ---- KVBlockCopier ---------------------------------------------------------

KVBlockCopier::KVBlockCopier(std::vector<at::Tensor> layers) : layers_(std::move(layers)) {
  TORCH_CHECK(!layers_.empty(), "kv copy: no layers");
  const auto& first = layers_[0];
  num_blocks_ = first.size(1);
  const int64_t item = first.element_size();
  row_ = first.size(2) * item;
  half_stride_ = first.stride(0) * item;
  block_stride_ = first.stride(1) * item;
  for (const auto& layer : layers_) {
    TORCH_CHECK(layer.device().is_cpu() && layer.dim() == 3 && layer.stride(2) == 1 &&
                    layer.sizes() == first.sizes() && layer.strides() == first.strides() &&
                    layer.scalar_type() == first.scalar_type(),
                "kv copy: every layer must be a CPU [2, num_blocks, E] view like the first");
    bases_.push_back(static_cast<uint8_t*>(layer.data_ptr()));
  }
}

Plan KVBlockCopier::plan_for(const pybind11::buffer_info& frames, int64_t offset,
                             const Batch& batch) const {
  TORCH_CHECK(frames.ndim == 2 && frames.itemsize == 1 && frames.strides[1] == 1,
              "kv copy: frames must be uint8 [n, frame_bytes] with contiguous rows");
  Plan plan;
  plan.bases = bases_;
  plan.row = row_;
  plan.half_stride = half_stride_;
  plan.block_stride = block_stride_;
  TORCH_CHECK(offset >= 0 && offset + plan.payload_bytes() <= frames.shape[1],
              "kv copy: frame rows are too short for the payload");
  if (batch.rows == nullptr) {
    TORCH_CHECK(batch.n == frames.shape[0], "kv copy: one frame row per block id");
  }
  for (int64_t j = 0; j < batch.n; ++j) {
    TORCH_CHECK(batch.row(j) >= 0 && batch.row(j) < frames.shape[0], "kv copy: frame row ",
                batch.row(j), " outside the frames (", frames.shape[0], " rows)");
    TORCH_CHECK(batch.ids[j] >= 0 && batch.ids[j] < num_blocks_, "kv copy: block id ",
                batch.ids[j], " outside the cache (", num_blocks_, " blocks)");
  }
  plan.frames = static_cast<uint8_t*>(frames.ptr) + offset;
  plan.frame_stride = frames.strides[0];
  return plan;
}

std::vector<uint64_t> KVBlockCopier::gather_xxh3(pybind11::buffer frames, int64_t offset,
                                                 const std::vector<int64_t>& block_ids,
                                                 const std::vector<int64_t>& frame_rows) const {
  const pybind11::buffer_info info = frames.request(/*writable=*/true);
  const Batch batch = list_batch(block_ids, frame_rows);
  const Plan plan = plan_for(info, offset, batch);
  std::vector<uint64_t> sums(batch.n);
  pybind11::gil_scoped_release unlocked;  // other threads run Python meanwhile
#pragma omp parallel for schedule(static) if (batch.n > 1)
  for (int64_t j = 0; j < batch.n; ++j) {
    sums[j] = copy_block_out_xxh3(plan, plan.payload(batch.row(j)), batch.ids[j]);
  }
  return sums;
}

std::vector<int64_t> KVBlockCopier::scatter_xxh3(pybind11::buffer frames, int64_t offset,
                                                 const std::vector<int64_t>& block_ids,
                                                 const std::vector<int64_t>& frame_rows,
                                                 const std::vector<uint64_t>& expected) const {
  const pybind11::buffer_info info = frames.request();
  const Batch batch = list_batch(block_ids, frame_rows);
  const Plan plan = plan_for(info, offset, batch);
  TORCH_CHECK(static_cast<int64_t>(expected.size()) == batch.n,
              "kv copy: expected must hold one checksum per block id");
  std::vector<uint8_t> matched(batch.n);
  {
    pybind11::gil_scoped_release unlocked;
#pragma omp parallel for schedule(static) if (batch.n > 1)
    for (int64_t j = 0; j < batch.n; ++j) {
      uint8_t* payload = plan.payload(batch.row(j));
      matched[j] = xxh3(payload, plan.payload_bytes()) == expected[j];
      if (matched[j]) {
        copy_block<false>(plan, payload, batch.ids[j]);
      }
    }
  }
  std::vector<int64_t> mismatched;
  for (int64_t j = 0; j < batch.n; ++j) {
    if (!matched[j]) {
      mismatched.push_back(j);
    }
  }
  return mismatched;
}
