// NameTable: finds a record by its name where the names already live in the
// records (a checkpoint's tensors, a header's entries), so that the names are not
// copied into a map. An open-addressing hash table of 8-byte slots, each a record's
// position and 32 bits of its name's hash: a million names cost 16 MiB and no
// allocation each, where an unordered_map<std::string, std::size_t> cost about 90
// bytes and an allocation or two per name (issue 31, item 13).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string_view>
#include <vector>

namespace ferry::io {

class NameTable {
 public:
  // Positions are below this (4,294,967,295 records: far past any header limit).
  static constexpr std::uint32_t kMaxPositions = 0xffffffffu;

  std::size_t size() const { return size_; }
  // Heap bytes the table holds (its slots).
  std::uint64_t bytes_owned() const { return slots_.capacity() * sizeof(Slot); }

  // Makes room for `n` names in all without growing again.
  void reserve(std::size_t n) {
    std::size_t want = 16;
    while (want < 2 * n) {
      want *= 2;
    }
    if (want > slots_.size()) {
      rehash(want);
    }
  }

  void clear() {
    slots_.clear();
    slots_.shrink_to_fit();
    size_ = 0;
  }

  // The position whose name is `name`, where name_of(position) gives a position's
  // name; nullopt when there is none.
  template <class NameOf>
  std::optional<std::uint32_t> find(std::string_view name, const NameOf& name_of) const {
    if (slots_.empty()) {
      return std::nullopt;
    }
    const std::uint32_t h = hash(name);
    const std::size_t mask = slots_.size() - 1;
    for (std::size_t i = h & mask;; i = (i + 1) & mask) {
      const Slot& s = slots_[i];
      if (s.position == kEmpty) {
        return std::nullopt;
      }
      if (s.hash == h && name_of(s.position) == name) {
        return s.position;
      }
    }
  }

  // Adds `position` (below kMaxPositions) under name_of(position). When a position
  // of that name is there already, adds nothing and returns that one.
  template <class NameOf>
  std::optional<std::uint32_t> insert(std::uint32_t position, const NameOf& name_of) {
    if (2 * (size_ + 1) > slots_.size()) {
      rehash(slots_.empty() ? 16 : 2 * slots_.size());
    }
    const std::string_view name = name_of(position);
    const std::uint32_t h = hash(name);
    const std::size_t mask = slots_.size() - 1;
    for (std::size_t i = h & mask;; i = (i + 1) & mask) {
      Slot& s = slots_[i];
      if (s.position == kEmpty) {
        s = Slot{position, h};
        ++size_;
        return std::nullopt;
      }
      if (s.hash == h && name_of(s.position) == name) {
        return s.position;
      }
    }
  }

 private:
  static constexpr std::uint32_t kEmpty = 0xffffffffu;
  // A position and its name's 32-bit hash, which both places the slot (its low
  // bits) and skips most mismatches without reading the name; growing the table
  // moves slots by the hash alone, reading no name.
  struct Slot {
    std::uint32_t position = kEmpty;
    std::uint32_t hash = 0;
  };

  static std::uint32_t hash(std::string_view name) {
    const std::uint64_t h = std::hash<std::string_view>{}(name);
    return static_cast<std::uint32_t>(h ^ (h >> 32));
  }

  // `capacity` is a power of two.
  void rehash(std::size_t capacity) {
    std::vector<Slot> old(capacity);
    old.swap(slots_);
    const std::size_t mask = capacity - 1;
    for (const Slot& s : old) {
      if (s.position == kEmpty) {
        continue;
      }
      std::size_t i = s.hash & mask;
      while (slots_[i].position != kEmpty) {
        i = (i + 1) & mask;
      }
      slots_[i] = s;
    }
  }

  std::vector<Slot> slots_;  // a power of two in size, at most half full
  std::size_t size_ = 0;
};

}  // namespace ferry::io
