// The process-wide cache behind large Buffers (memory.hpp).
#include <cstdint>
#include <cstdlib>
#include <map>
#include <mutex>
#include <new>
#include <string>

#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>
#endif

#include "core/buffer_allocator.hpp"
#include "core/simulation.hpp"
#include "kdacp/memory.hpp"

#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define KDACP_ASAN 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__)
#define KDACP_ASAN 1
#endif
#if defined(KDACP_ASAN)
#include <sanitizer/asan_interface.h>
#endif

namespace kdacp {
namespace {

constexpr std::size_t kAlign = 64;

// Blocks of a huge page or more start on a huge page boundary, so that every
// 2 MiB of them can be one huge page.
std::align_val_t alignment_of(std::size_t cls) {
  return std::align_val_t{cls >= detail::kHugePageBytes ? detail::kHugePageBytes : kAlign};
}

// Where the cache's blocks come from and go: the system, or a simulator's
// allocator (core/simulation.hpp).
void* system_allocate(std::size_t cls) {
  if (const auto& sim = detail::simulation_hooks(); sim.allocate != nullptr) {
    void* p = sim.allocate(cls);
    if (p == nullptr) throw std::bad_alloc();
    return p;
  }
  void* p = ::operator new(cls, alignment_of(cls));
  detail::advise_huge_pages(p, cls);
  return p;
}
void system_free(void* p, std::size_t cls) noexcept {
  if (const auto& sim = detail::simulation_hooks(); sim.deallocate != nullptr) {
    sim.deallocate(p, cls);
    return;
  }
  ::operator delete(p, alignment_of(cls));
}
constexpr std::size_t kCachedFrom = 64 << 10;  // smaller blocks: plain operator new
constexpr std::size_t kDefaultLimit = std::size_t{1} << 30;

// Size class of a large block: rounded up to a quarter of its power of two.
std::size_t size_class(std::size_t bytes) {
  std::size_t p = 1;
  while (p * 2 <= bytes) p *= 2;
  const std::size_t step = p / 4;
  return (bytes + step - 1) / step * step;
}

void poison(void* p, std::size_t n) {
#if defined(KDACP_ASAN)
  ASAN_POISON_MEMORY_REGION(p, n);
#else
  (void)p, (void)n;
#endif
}
void unpoison(void* p, std::size_t n) {
#if defined(KDACP_ASAN)
  ASAN_UNPOISON_MEMORY_REGION(p, n);
#else
  (void)p, (void)n;
#endif
}

class Cache {
 public:

  void* allocate(std::size_t bytes) {
    const std::size_t cls = size_class(bytes);
    {
      std::lock_guard lock(mu_);
      init_limit();
      auto it = idle_.find(cls);
      if (it != idle_.end()) {
        void* p = it->second;
        idle_.erase(it);
        cached_ -= cls;
        ++hits_;
        unpoison(p, cls);
        return p;
      }
      ++misses_;
    }
    return system_allocate(cls);
  }

  void deallocate(void* p, std::size_t bytes) noexcept {
    const std::size_t cls = size_class(bytes);
    {
      std::lock_guard lock(mu_);
      if (cached_ + cls <= limit_) {
        poison(p, cls);
        idle_.emplace(cls, p);
        cached_ += cls;
        return;
      }
    }
    system_free(p, cls);
  }

  void release() noexcept {
    std::multimap<std::size_t, void*> idle;
    {
      std::lock_guard lock(mu_);
      idle.swap(idle_);
      cached_ = 0;
    }
    for (auto& [cls, p] : idle) {
      unpoison(p, cls);
      system_free(p, cls);
    }
  }

  void set_limit(std::size_t bytes) {
    {
      std::lock_guard lock(mu_);
      limit_set_ = true;
      limit_ = bytes;
    }
    release();
  }

  BufferCacheStats stats() {
    std::lock_guard lock(mu_);
    init_limit();
    return {cached_, limit_, hits_, misses_};
  }

 private:
  // Lock held.
  void init_limit() {
    if (limit_set_) return;
    limit_set_ = true;
    limit_ = kDefaultLimit;
    if (const char* env = std::getenv("KDACP_BUFFER_CACHE_MB")) {
      char* end = nullptr;
      const unsigned long long mb = std::strtoull(env, &end, 10);
      if (end != env && *end == '\0') limit_ = static_cast<std::size_t>(mb) << 20;
    }
  }

  std::mutex mu_;
  std::multimap<std::size_t, void*> idle_;
  std::size_t cached_ = 0, limit_ = 0, hits_ = 0, misses_ = 0;
  bool limit_set_ = false;
};

// Never destroyed: a Buffer that outlives static destruction (a global of
// the application's) must still find the cache. Its idle blocks stay
// reachable until exit.
Cache& cache() {
  static Cache* c = new Cache;
  return *c;
}

}  // namespace

BufferCacheStats buffer_cache_stats() { return cache().stats(); }
void set_buffer_cache_limit(std::size_t bytes) { cache().set_limit(bytes); }
void release_buffer_cache() { cache().release(); }

namespace detail {

void advise_huge_pages(const void* p, std::size_t bytes) noexcept {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  if (p == nullptr || bytes < kHugePageBytes) return;
  static const std::size_t page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  const auto begin = reinterpret_cast<std::uintptr_t>(p) / page * page;
  const auto end = (reinterpret_cast<std::uintptr_t>(p) + bytes + page - 1) / page * page;
  (void)::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#else
  (void)p, (void)bytes;
#endif
}

void* buffer_allocate(std::size_t bytes) {
  if (bytes < kCachedFrom) return ::operator new(bytes, std::align_val_t{kAlign});
  return cache().allocate(bytes);
}

void buffer_deallocate(void* ptr, std::size_t bytes) noexcept {
  if (bytes < kCachedFrom) {
    ::operator delete(ptr, std::align_val_t{kAlign});
    return;
  }
  cache().deallocate(ptr, bytes);
}

}  // namespace detail
}  // namespace kdacp
