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
  std::size_t live() const { return live_; }

  // Called by Buffer; no-ops when no scope is open on this thread.
  static void on_alloc(std::size_t bytes) noexcept;
  static void on_free(std::size_t bytes) noexcept;

 private:
  MemoryScope* outer_;
  std::size_t live_ = 0;
  std::size_t peak_ = 0;
};

}  // namespace kdacp
