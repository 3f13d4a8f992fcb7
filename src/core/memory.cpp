#include "kdacp/memory.hpp"

#include <algorithm>

namespace kdacp {

namespace {
// Innermost open scope of this thread. Thread-local, not global: each rank
// thread of an in-process world measures itself.
thread_local MemoryScope* t_scope = nullptr;
}  // namespace

MemoryScope::MemoryScope() : outer_(t_scope) { t_scope = this; }
MemoryScope::~MemoryScope() { t_scope = outer_; }

void MemoryScope::on_alloc(std::size_t bytes) noexcept {
  for (MemoryScope* s = t_scope; s != nullptr; s = s->outer_) {
    s->live_ += bytes;
    s->peak_ = std::max(s->peak_, s->live_);
  }
}

void MemoryScope::on_free(std::size_t bytes) noexcept {
  for (MemoryScope* s = t_scope; s != nullptr; s = s->outer_) {
    // Memory allocated before the scope opened may be freed inside it.
    s->live_ -= std::min(bytes, s->live_);
  }
}

}  // namespace kdacp
