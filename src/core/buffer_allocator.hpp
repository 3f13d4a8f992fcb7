// Internal: the allocator behind Buffer and the KDA scratch, serving large
// blocks from the process-wide cache that memory.hpp describes.
#pragma once

#include <cstddef>

namespace kdacp::detail {

// The bytes a Buffer (or FlaggedBuffer) of `bytes` bytes allocates: whole
// 64-byte lines.
inline std::size_t buffer_allocated_bytes(std::size_t bytes) { return (bytes + 63) / 64 * 64; }

// 64-byte aligned; `bytes` is rounded as the cache needs. Free with the same
// `bytes`.
void* buffer_allocate(std::size_t bytes);
void buffer_deallocate(void* ptr, std::size_t bytes) noexcept;

// Blocks from this size on are worth transparent huge pages.
inline constexpr std::size_t kHugePageBytes = std::size_t{2} << 20;

// Asks the kernel to back the pages of [p, p + bytes) with transparent huge
// pages when they are first touched (Linux: madvise(MADV_HUGEPAGE) on the
// 4 KiB pages covering the range; elsewhere, or below kHugePageBytes, a
// no-op). Call it before the first write. On a host whose THP setting is
// `madvise`, a first touch then costs one fault per 2 MiB instead of 512;
// the data are the same. Failure (no THP in the kernel) is ignored: the
// pages are then ordinary ones.
void advise_huge_pages(const void* p, std::size_t bytes) noexcept;

}  // namespace kdacp::detail
