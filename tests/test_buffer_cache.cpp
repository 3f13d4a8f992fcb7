// The large-buffer cache: freed blocks are reused by later allocations of
// their size class, the idle bytes stay under the limit, and a limit of 0
// turns it off.
#include <gtest/gtest.h>

#include <cstddef>

#include <cstdint>
#include <utility>

#include "core/flagged_buffer.hpp"
#include "kdacp/memory.hpp"
#include "kdacp/tensor.hpp"

namespace kdacp {
namespace {

// Outside a simulation a FlaggedBuffer (packed slots and affine pairs) is a
// Buffer's storage: 64-byte aligned, counted by the thread's MemoryScope
// while it lives, moved without a copy. Its stripes matter only to a
// simulator (smpi.small checks that path).
TEST(BufferCache, FlaggedBufferIsCountedLikeABuffer) {
  const std::size_t bytes = 3 * ((std::size_t{1} << 20) + 64);
  MemoryScope scope;
  std::byte* data = nullptr;
  {
    detail::FlaggedBuffer a(bytes, detail::FlagStripes{(std::size_t{1} << 20) + 64, std::size_t{1} << 20, 64});
    ASSERT_NE(a.data(), nullptr);
    EXPECT_EQ(a.bytes(), bytes);
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(a.data()) % 64, 0u);
    a.data()[bytes - 1] = std::byte{7};
    data = a.data();
    detail::FlaggedBuffer b(std::move(a));
    EXPECT_EQ(a.data(), nullptr);
    EXPECT_EQ(a.bytes(), 0u);
    EXPECT_EQ(b.data(), data);
    EXPECT_EQ(b.data()[bytes - 1], std::byte{7});
    detail::FlaggedBuffer c;
    c = std::move(b);
    EXPECT_EQ(c.data(), data);
    EXPECT_EQ(scope.peak(), bytes);
  }
  // Freed: a second one fits the same peak.
  { detail::FlaggedBuffer d(bytes, detail::FlagStripes{bytes, 0, 64}); }
  EXPECT_EQ(scope.peak(), bytes);
}

TEST(BufferCache, ReusesFreedLargeBlocksWithinTheLimit) {
  set_buffer_cache_limit(64 << 20);
  const std::size_t bytes = std::size_t{3} << 20;
  std::byte* first = nullptr;
  {
    Buffer b(bytes, Buffer::Init::uninitialized);
    first = b.data();
    b.data()[bytes - 1] = std::byte{1};
  }
  const BufferCacheStats after_free = buffer_cache_stats();
  EXPECT_GE(after_free.cached_bytes, std::size_t{3} << 20);
  EXPECT_LE(after_free.cached_bytes, after_free.limit_bytes);
  {
    // The same size class: served from the cache, and zeroed when asked.
    Buffer b(bytes, Buffer::Init::zero);
    EXPECT_EQ(b.data(), first);
    EXPECT_EQ(b.data()[bytes - 1], std::byte{0});
  }
  const BufferCacheStats again = buffer_cache_stats();
  EXPECT_EQ(again.hits, after_free.hits + 1);
  // Small buffers bypass the cache.
  { Buffer small(64); }
  EXPECT_EQ(buffer_cache_stats().hits, again.hits);
  EXPECT_EQ(buffer_cache_stats().misses, again.misses);

  // Limit 0: nothing is kept.
  set_buffer_cache_limit(0);
  { Buffer b(bytes); }
  EXPECT_EQ(buffer_cache_stats().cached_bytes, 0u);
  // A limit smaller than a block: that block goes back to the system.
  set_buffer_cache_limit(1 << 20);
  { Buffer b(bytes); }
  EXPECT_EQ(buffer_cache_stats().cached_bytes, 0u);
  set_buffer_cache_limit(std::size_t{1} << 30);
  release_buffer_cache();
  EXPECT_EQ(buffer_cache_stats().cached_bytes, 0u);
}

}  // namespace
}  // namespace kdacp
