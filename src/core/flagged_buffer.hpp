// Internal: storage whose flag bytes decide what a protocol does next (the
// cut flags of packed slots and affine pairs, exchange/common.hpp and
// affine_pairs.hpp) and travel in the same messages as the data.
//
// Outside a simulation it is a Buffer's storage (the block cache of
// memory.hpp). In the SMPI build's shared-memory mode (core/simulation.hpp) every
// rank's large blocks map the same pages, so flags written there are any
// rank's: the grouped relay read cuts where there were none and waited for
// states it did not need (grouped_allgather_p2p w = 2 at P = 64 with zigzag
// and documents: 3x the model on both simulated clusters, docs/scale.md). A
// simulator that offers SimulationHooks::allocate_flagged keeps the stripes
// [i·stride + offset, i·stride + offset + length) of such a block each
// rank's own, and its messages carry them as they are.
#pragma once

#include <cstddef>

namespace kdacp::detail {

struct FlagStripes {
  std::size_t stride = 0;  // bytes from one stripe to the next (> 0)
  std::size_t offset = 0;  // the first stripe's start
  std::size_t length = 0;  // bytes per stripe (> 0)
};

// Uninitialized, 64-byte aligned storage of `bytes` bytes; counted by the
// thread's MemoryScope like a Buffer's. Every byte is written before it is
// read (sanitizer builds fill it with 0xff, as they fill a Buffer).
class FlaggedBuffer {
 public:
  FlaggedBuffer() = default;
  FlaggedBuffer(std::size_t bytes, const FlagStripes& stripes);
  FlaggedBuffer(FlaggedBuffer&& other) noexcept;
  FlaggedBuffer& operator=(FlaggedBuffer&& other) noexcept;
  FlaggedBuffer(const FlaggedBuffer&) = delete;
  FlaggedBuffer& operator=(const FlaggedBuffer&) = delete;
  ~FlaggedBuffer();

  std::byte* data() const { return data_; }
  std::size_t bytes() const { return bytes_; }

 private:
  void release() noexcept;
  std::byte* data_ = nullptr;
  std::size_t bytes_ = 0;
  bool simulated_ = false;  // from SimulationHooks::allocate_flagged
};

}  // namespace kdacp::detail
