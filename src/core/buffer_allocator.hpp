// Internal: the allocator behind Buffer and the KDA scratch, serving large
// blocks from the process-wide cache that memory.hpp describes.
#pragma once

#include <cstddef>

namespace kdacp::detail {

// 64-byte aligned; `bytes` is rounded as the cache needs. Free with the same
// `bytes`.
void* buffer_allocate(std::size_t bytes);
void buffer_deallocate(void* ptr, std::size_t bytes) noexcept;

}  // namespace kdacp::detail
