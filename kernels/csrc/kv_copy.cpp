// Whole-KV-block copies between the paged cache and connector frames.
//
// A frame row holds, after `offset` header bytes, every layer's K then V of
// one block: [layers, 2, block elements]. Each layer's cache is viewed as
// [2, num_blocks, block elements]. One memcpy per (block, layer, half),
// blocks split across threads: numpy needed a temporary or a strided take
// that ran at a third of memcpy speed.
#include <ATen/ATen.h>
#include <torch/extension.h>

#include <cstring>
#include <vector>

namespace {

struct Plan {
  std::vector<uint8_t*> bases;  // each layer's first byte
  int64_t half_stride = 0;      // bytes from K to V of one block
  int64_t block_stride = 0;     // bytes from block b to b + 1
  int64_t row = 0;              // bytes of one block's K (or V)
};

Plan make_plan(const std::vector<at::Tensor>& layers, const at::Tensor& frames,
               int64_t offset, const at::Tensor& block_ids, const at::Tensor& frame_rows) {
  TORCH_CHECK(!layers.empty(), "kv copy: no layers");
  TORCH_CHECK(frames.dim() == 2 && frames.scalar_type() == at::kByte && frames.stride(1) == 1,
              "kv copy: frames must be uint8 [n, frame_bytes] with contiguous rows");
  TORCH_CHECK(block_ids.dim() == 1 && block_ids.scalar_type() == at::kLong &&
                  block_ids.is_contiguous(),
              "kv copy: block_ids must be int64 [n]");
  if (frame_rows.numel() == 0) {
    TORCH_CHECK(block_ids.size(0) == frames.size(0), "kv copy: one frame row per block id");
  } else {
    TORCH_CHECK(frame_rows.dim() == 1 && frame_rows.scalar_type() == at::kLong &&
                    frame_rows.is_contiguous() && frame_rows.size(0) == block_ids.size(0),
                "kv copy: frame_rows must be int64 [n], one per block id");
    const int64_t* rows = frame_rows.data_ptr<int64_t>();
    for (int64_t j = 0; j < frame_rows.size(0); ++j) {
      TORCH_CHECK(rows[j] >= 0 && rows[j] < frames.size(0), "kv copy: frame row ", rows[j],
                  " outside the frames (", frames.size(0), " rows)");
    }
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
  TORCH_CHECK(offset >= 0 && offset + int64_t(layers.size()) * 2 * plan.row <= frames.size(1),
              "kv copy: frame rows are too short for the payload");
  const int64_t* ids = block_ids.data_ptr<int64_t>();
  for (int64_t j = 0; j < block_ids.size(0); ++j) {
    TORCH_CHECK(ids[j] >= 0 && ids[j] < num_blocks, "kv copy: block id ", ids[j],
                " outside the cache (", num_blocks, " blocks)");
  }
  return plan;
}

template <bool kToFrames>
void copy_blocks(at::Tensor frames, int64_t offset, const std::vector<at::Tensor>& layers,
                 at::Tensor block_ids, at::Tensor frame_rows) {
  const Plan plan = make_plan(layers, frames, offset, block_ids, frame_rows);
  const int64_t n = block_ids.size(0);
  const int64_t* ids = block_ids.data_ptr<int64_t>();
  const int64_t* rows_of = frame_rows.numel() ? frame_rows.data_ptr<int64_t>() : nullptr;
  uint8_t* rows = frames.data_ptr<uint8_t>();
  const int64_t row_stride = frames.stride(0);
  const int64_t num_layers = static_cast<int64_t>(plan.bases.size());
#pragma omp parallel for schedule(static) if (n > 1)
  for (int64_t j = 0; j < n; ++j) {
    uint8_t* frame = rows + (rows_of ? rows_of[j] : j) * row_stride + offset;
    for (int64_t l = 0; l < num_layers; ++l) {
      for (int64_t h = 0; h < 2; ++h) {
        uint8_t* cache = plan.bases[l] + h * plan.half_stride + ids[j] * plan.block_stride;
        if (kToFrames) {
          std::memcpy(frame, cache, plan.row);
        } else {
          std::memcpy(cache, frame, plan.row);
        }
        frame += plan.row;
      }
    }
  }
}

}  // namespace

// frame_rows: which row of `frames` each block uses (empty: row j for block j).
void gather_kv_blocks(at::Tensor frames, int64_t offset, std::vector<at::Tensor> layers,
                      at::Tensor block_ids, at::Tensor frame_rows) {
  copy_blocks<true>(frames, offset, layers, block_ids, frame_rows);
}

void scatter_kv_blocks(at::Tensor frames, int64_t offset, std::vector<at::Tensor> layers,
                       at::Tensor block_ids, at::Tensor frame_rows) {
  copy_blocks<false>(frames, offset, layers, block_ids, frame_rows);
}
