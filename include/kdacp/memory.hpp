// Per-thread accounting of kdacp Buffer allocations. A protocol call opens a
// MemoryScope; every Buffer allocated and freed on that thread while the scope
// lives is counted, and peak() is the largest number of live bytes seen.
#pragma once

#include <cstddef>

namespace kdacp {

class MemoryScope {
 public:
  MemoryScope();
  ~MemoryScope();
  MemoryScope(const MemoryScope&) = delete;
  MemoryScope& operator=(const MemoryScope&) = delete;

  std::size_t peak() const { return peak_; }

  // Called by Buffer; no-ops when no scope is open on this thread.
  static void on_alloc(std::size_t bytes) noexcept;
  static void on_free(std::size_t bytes) noexcept;

 private:
  MemoryScope* outer_;
  std::size_t live_ = 0;
  std::size_t peak_ = 0;
};

// Large Buffers (>= 64 KiB) come from a process-wide cache of blocks in size
// classes (4 per power of two, so at most 25 % slack). Exchange buffers live
// for one call; returning them to the system on free (glibc unmaps blocks of
// that size, and a thread's arena drops whole heaps) made every call fault
// its pages in again, which cost more than the exchange on virtual machines.
// The cache holds raw memory only, never data a later call reads: every
// Buffer is zeroed or fully written by its owner. Idle cached bytes are
// bounded by a limit; blocks freed beyond it go back to the system.
struct BufferCacheStats {
  std::size_t cached_bytes = 0;  // idle blocks held now
  std::size_t limit_bytes = 0;
  std::size_t hits = 0;          // allocations served from the cache
  std::size_t misses = 0;        // large allocations that went to the system
};

BufferCacheStats buffer_cache_stats();
// 0 disables the cache (and releases it). Default 1 GiB, or the environment
// variable KDACP_BUFFER_CACHE_MB when set at the first large allocation.
void set_buffer_cache_limit(std::size_t bytes);
// Returns every idle block to the system.
void release_buffer_cache();

}  // namespace kdacp
