// ShmIndex: the slot index of a shared-memory block pool (shm_index.cpp).
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

// Index work of connectors/shm_pool.py over its header segment: key lookup,
// LRU touches, victim choice and publishing written slots. The pool's lock
// is held by the caller around every call; nothing here locks. Compiled
// because a single-block save or load is ~100 us of copying, and the same
// work in numpy, on caches the copy has just cooled, cost 40-60 us more.
//
// Keys are 32-byte digests passed concatenated in one bytes object. Slot
// states: 0 free, 1 full. The column layout (offsets into the header) is
// the pool's numpy dtype, passed in by the caller, so the layout has one
// definition.
class ShmIndex {
 public:
  // `header`: a writable buffer over the whole header segment; it is kept
  // referenced (not exported), so the caller must keep the mapping open for
  // as long as this index lives.
  ShmIndex(pybind11::object header, int64_t num_slots, int64_t clock_offset,
           int64_t evictions_offset, int64_t keys_offset, int64_t lengths_offset,
           int64_t last_used_offset, int64_t state_offset);

  // The full slot of each key, -1 where absent; with `touch`, hits are
  // marked recently used, in key order.
  std::vector<int64_t> find(const std::string& keys, bool touch);

  // For a write: touches the keys present, and picks a slot for each key
  // not present (the first occurrence of a repeated key; of those, only the
  // last `max_new`): free slots first, then the least recently used. The
  // picked slots are marked free (invisible until `publish`), and the pool's
  // eviction count grows by the full ones among them. Returns (positions in
  // `keys` of the new keys, their slots).
  std::pair<std::vector<int64_t>, std::vector<int64_t>> reserve(const std::string& keys,
                                                                int64_t max_new);

  // Makes slots[j] hold keys[j] with sizes[j] bytes, most recently used,
  // each slot's state written last.
  void publish(const std::vector<int64_t>& slots, const std::string& keys,
               const std::vector<int64_t>& sizes);

  // The stored length of each slot.
  std::vector<int64_t> lengths(const std::vector<int64_t>& slots) const;

 private:
  int64_t key_count(const std::string& keys) const;
  void check_slot(int64_t slot) const;
  uint64_t tick(int64_t count);
  std::vector<int64_t> oldest(int64_t count) const;

  pybind11::object header_;  // keeps the mapping referenced
  int64_t num_slots_;
  uint64_t* clock_;
  uint64_t* evictions_;
  uint64_t* keys_;  // [num_slots, 4]
  uint64_t* lengths_;
  uint64_t* last_used_;
  uint8_t* state_;
};
