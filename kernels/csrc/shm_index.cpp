// The slot index of connectors/shm_pool.py's shared-memory pool (see shm_index.h).
#include "shm_index.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <numeric>
#include <string_view>
#include <unordered_set>

namespace {

constexpr int64_t kKeyBytes = 32;
constexpr int64_t kKeyWords = kKeyBytes / 8;
constexpr uint8_t kFree = 0;
constexpr uint8_t kFull = 1;

uint64_t first_word(const char* key) {
  uint64_t word;
  std::memcpy(&word, key, sizeof(word));  // little-endian, as the numpy column
  return word;
}

}  // namespace

ShmIndex::ShmIndex(pybind11::object header, int64_t num_slots, int64_t clock_offset,
                   int64_t evictions_offset, int64_t keys_offset, int64_t lengths_offset,
                   int64_t last_used_offset, int64_t state_offset)
    : header_(std::move(header)), num_slots_(num_slots) {
  TORCH_CHECK(num_slots > 0, "shm index: num_slots must be positive");
  uint8_t* base = nullptr;
  int64_t size = 0;
  {
    // Only the address is kept: the caller's array keeps the mapping alive,
    // and holding an export would stop the segment from ever closing.
    const pybind11::buffer_info info = header_.cast<pybind11::buffer>().request(true);
    base = static_cast<uint8_t*>(info.ptr);
    size = info.size * info.itemsize;
  }
  auto column = [&](int64_t offset, int64_t bytes, const char* name) {
    TORCH_CHECK(offset >= 0 && offset + bytes <= size, "shm index: the ", name,
                " column lies outside the header (", size, " bytes)");
    return base + offset;
  };
  clock_ = reinterpret_cast<uint64_t*>(column(clock_offset, 8, "clock"));
  evictions_ = reinterpret_cast<uint64_t*>(column(evictions_offset, 8, "evictions"));
  keys_ = reinterpret_cast<uint64_t*>(column(keys_offset, num_slots * kKeyBytes, "keys"));
  lengths_ = reinterpret_cast<uint64_t*>(column(lengths_offset, num_slots * 8, "lengths"));
  last_used_ = reinterpret_cast<uint64_t*>(column(last_used_offset, num_slots * 8, "last_used"));
  state_ = column(state_offset, num_slots, "state");
}

int64_t ShmIndex::key_count(const std::string& keys) const {
  TORCH_CHECK(keys.size() % kKeyBytes == 0, "shm index: keys must be 32-byte digests, got ",
              keys.size(), " bytes");
  return static_cast<int64_t>(keys.size()) / kKeyBytes;
}

void ShmIndex::check_slot(int64_t slot) const {
  TORCH_CHECK(slot >= 0 && slot < num_slots_, "shm index: slot ", slot, " outside the pool (",
              num_slots_, " slots)");
}

uint64_t ShmIndex::tick(int64_t count) {
  const uint64_t first = *clock_ + 1;
  *clock_ = first + static_cast<uint64_t>(count) - 1;
  return first;
}

std::vector<int64_t> ShmIndex::find(const std::string& keys, bool touch) {
  const int64_t n = key_count(keys);
  std::vector<int64_t> slots(n, -1);
  if (n == 0) {
    return slots;
  }
  // One pass over the slots, each first word looked up among the keys'
  // (sorted): keys are digests, so a first-word match is almost always the key.
  std::vector<std::pair<uint64_t, int64_t>> wanted(n);
  for (int64_t i = 0; i < n; ++i) {
    wanted[i] = {first_word(keys.data() + i * kKeyBytes), i};
  }
  std::sort(wanted.begin(), wanted.end());
  for (int64_t s = 0; s < num_slots_; ++s) {
    if (state_[s] != kFull) {
      continue;
    }
    const uint64_t* stored = keys_ + s * kKeyWords;
    auto it = std::lower_bound(wanted.begin(), wanted.end(), std::make_pair(stored[0], int64_t{0}));
    for (; it != wanted.end() && it->first == stored[0]; ++it) {
      if (std::memcmp(stored, keys.data() + it->second * kKeyBytes, kKeyBytes) == 0) {
        slots[it->second] = s;
      }
    }
  }
  if (touch) {
    const int64_t hits = std::count_if(slots.begin(), slots.end(), [](int64_t s) { return s >= 0; });
    uint64_t at = hits ? tick(hits) : 0;
    for (int64_t s : slots) {
      if (s >= 0) {
        last_used_[s] = at++;
      }
    }
  }
  return slots;
}

std::vector<int64_t> ShmIndex::oldest(int64_t count) const {
  // Never-written slots hold 0, below every tick: free slots come first.
  auto older = [this](int64_t a, int64_t b) {
    return last_used_[a] != last_used_[b] ? last_used_[a] < last_used_[b] : a < b;
  };
  if (count == 1) {
    int64_t best = 0;
    for (int64_t s = 1; s < num_slots_; ++s) {
      if (last_used_[s] < last_used_[best]) {
        best = s;
      }
    }
    return {best};
  }
  std::vector<int64_t> order(num_slots_);
  std::iota(order.begin(), order.end(), int64_t{0});
  std::partial_sort(order.begin(), order.begin() + count, order.end(), older);
  order.resize(count);
  return order;
}

std::pair<std::vector<int64_t>, std::vector<int64_t>> ShmIndex::reserve(const std::string& keys,
                                                                        int64_t max_new) {
  TORCH_CHECK(max_new >= 0, "shm index: max_new must be >= 0");
  const std::vector<int64_t> slots = find(keys, /*touch=*/true);
  std::vector<int64_t> fresh;
  std::unordered_set<std::string_view> seen;
  for (int64_t i = 0; i < static_cast<int64_t>(slots.size()); ++i) {
    if (slots[i] < 0 && seen.emplace(keys.data() + i * kKeyBytes, kKeyBytes).second) {
      fresh.push_back(i);
    }
  }
  const int64_t keep = std::min<int64_t>({static_cast<int64_t>(fresh.size()), max_new, num_slots_});
  fresh.erase(fresh.begin(), fresh.end() - keep);
  if (keep == 0) {
    return {fresh, {}};
  }
  std::vector<int64_t> victims = oldest(keep);
  uint64_t evicted = 0;
  for (int64_t s : victims) {
    evicted += state_[s] == kFull;
    state_[s] = kFree;  // invisible until published
  }
  *evictions_ += evicted;
  return {fresh, victims};
}

void ShmIndex::publish(const std::vector<int64_t>& slots, const std::string& keys,
                       const std::vector<int64_t>& sizes) {
  const int64_t n = key_count(keys);
  TORCH_CHECK(static_cast<int64_t>(slots.size()) == n && static_cast<int64_t>(sizes.size()) == n,
              "shm index: publish needs one slot and one size per key");
  for (int64_t slot : slots) {
    check_slot(slot);
  }
  uint64_t at = tick(n);
  for (int64_t j = 0; j < n; ++j) {
    std::memcpy(keys_ + slots[j] * kKeyWords, keys.data() + j * kKeyBytes, kKeyBytes);
    lengths_[slots[j]] = static_cast<uint64_t>(sizes[j]);
    last_used_[slots[j]] = at++;
  }
  // The state last: a writer killed before this leaves the slots free,
  // never a half-described blob under a valid key.
  std::atomic_thread_fence(std::memory_order_release);
  for (int64_t slot : slots) {
    state_[slot] = kFull;
  }
}

std::vector<int64_t> ShmIndex::lengths(const std::vector<int64_t>& slots) const {
  std::vector<int64_t> out;
  out.reserve(slots.size());
  for (int64_t slot : slots) {
    check_slot(slot);
    out.push_back(static_cast<int64_t>(lengths_[slot]));
  }
  return out;
}
