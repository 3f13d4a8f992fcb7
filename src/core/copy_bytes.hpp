// Internal: a std::vector<T> holding a copy of raw bytes, built without the
// zero fill of std::vector<T>(n) (which writes, and faults in, every page once
// more before the copy does). The bytes are copied through a small block on
// the stack, so `bytes` need not be aligned for T.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <iterator>
#include <type_traits>
#include <vector>

#include "core/buffer_allocator.hpp"

namespace kdacp::detail {

template <class T>
std::vector<T> copy_bytes_as(const std::byte* bytes, std::size_t elems) {
  static_assert(std::is_trivially_copyable_v<T>);
  std::vector<T> out;
  out.reserve(elems);
  advise_huge_pages(out.data(), elems * sizeof(T));
  T block[4096 / sizeof(T)];
  for (std::size_t at = 0; at < elems; at += std::size(block)) {
    const std::size_t m = std::min(std::size(block), elems - at);
    std::memcpy(block, bytes + at * sizeof(T), m * sizeof(T));
    out.insert(out.end(), block, block + m);
  }
  return out;
}

}  // namespace kdacp::detail
