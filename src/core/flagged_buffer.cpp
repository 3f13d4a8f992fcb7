#include "core/flagged_buffer.hpp"

#include <cstring>
#include <new>
#include <utility>

#include "core/buffer_allocator.hpp"
#include "core/simulation.hpp"
#include "kdacp/memory.hpp"

namespace kdacp::detail {

FlaggedBuffer::FlaggedBuffer(std::size_t bytes, const FlagStripes& stripes) : bytes_(bytes) {
  if (bytes == 0) return;
  if (const auto& sim = simulation_hooks(); sim.allocate_flagged != nullptr) {
    data_ = static_cast<std::byte*>(sim.allocate_flagged(bytes, stripes.stride, stripes.offset, stripes.length));
    if (data_ == nullptr) throw std::bad_alloc();
    simulated_ = true;
  } else {
    data_ = static_cast<std::byte*>(buffer_allocate(buffer_allocated_bytes(bytes)));
  }
#if defined(KDACP_FILL_UNINITIALIZED)
  std::memset(data_, 0xff, bytes);
#endif
  MemoryScope::on_alloc(bytes_);
}

FlaggedBuffer::FlaggedBuffer(FlaggedBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      bytes_(std::exchange(other.bytes_, 0)),
      simulated_(std::exchange(other.simulated_, false)) {}

FlaggedBuffer& FlaggedBuffer::operator=(FlaggedBuffer&& other) noexcept {
  if (this != &other) {
    release();
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
    simulated_ = std::exchange(other.simulated_, false);
  }
  return *this;
}

FlaggedBuffer::~FlaggedBuffer() { release(); }

void FlaggedBuffer::release() noexcept {
  if (data_ == nullptr) return;
  if (simulated_)
    simulation_hooks().deallocate(data_, bytes_);
  else
    buffer_deallocate(data_, buffer_allocated_bytes(bytes_));
  MemoryScope::on_free(bytes_);
  data_ = nullptr;
  bytes_ = 0;
}

}  // namespace kdacp::detail
