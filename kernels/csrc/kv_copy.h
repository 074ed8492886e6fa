// KVBlockCopier: whole-KV-block copies with xxh3-64 checksums (kv_copy.cpp).
#pragma once

#include <ATen/ATen.h>
#include <torch/extension.h>

#include <cstdint>
#include <vector>

namespace tandem_kv {

struct Plan {
  std::vector<uint8_t*> bases;  // each layer's first byte
  int64_t half_stride = 0;      // bytes from K to V of one block
  int64_t block_stride = 0;     // bytes from block b to b + 1
  int64_t row = 0;              // bytes of one block's K (or V)
  uint8_t* frames = nullptr;    // first byte of frame row 0's payload
  int64_t frame_stride = 0;     // bytes from frame row r to r + 1

  int64_t payload_bytes() const { return static_cast<int64_t>(bases.size()) * 2 * row; }
  uint8_t* payload(int64_t frame_row) const { return frames + frame_row * frame_stride; }
};

// Block ids (n) and, optionally, the frame row of each (rows: nullptr means
// row j for block j), checked against the cache and the frames.
struct Batch {
  const int64_t* ids;
  const int64_t* rows;
  int64_t n;

  int64_t row(int64_t j) const { return rows ? rows[j] : j; }
};

}  // namespace tandem_kv

// The layers are given once (their checks and layout computed once), and
// frames are any buffer (a numpy array, shared memory): per call there is
// no tensor to make, which matters for the single-block copies that are
// most of a connector's saves and loads. The GIL is released while copying.
class KVBlockCopier {
 public:
  explicit KVBlockCopier(std::vector<at::Tensor> layers);

  // Copies block_ids[j] into frames[frame_rows[j]] (empty frame_rows: row
  // j) after `offset` header bytes; returns each payload's xxh3-64, hashed
  // right after its copy while it is in cache.
  std::vector<uint64_t> gather_xxh3(pybind11::buffer frames, int64_t offset,
                                    const std::vector<int64_t>& block_ids,
                                    const std::vector<int64_t>& frame_rows) const;

  // The reverse, for the payloads whose xxh3-64 is expected[j], each hashed
  // right before its copy (a corrupt payload never reaches the cache).
  // Returns the positions j that did not match; those blocks are untouched.
  std::vector<int64_t> scatter_xxh3(pybind11::buffer frames, int64_t offset,
                                    const std::vector<int64_t>& block_ids,
                                    const std::vector<int64_t>& frame_rows,
                                    const std::vector<uint64_t>& expected) const;

 private:
  tandem_kv::Plan plan_for(const pybind11::buffer_info& frames, int64_t offset,
                           const tandem_kv::Batch& batch) const;

  std::vector<at::Tensor> layers_;  // keeps the caches alive
  std::vector<uint8_t*> bases_;
  int64_t num_blocks_ = 0;
  int64_t row_ = 0;
  int64_t half_stride_ = 0;
  int64_t block_stride_ = 0;
};
