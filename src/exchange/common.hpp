// Internal helpers shared by the protocols: packed [S|M] slot storage, byte
// spans of states, per-call measurement.
#pragma once

#include <cstddef>
#include <memory>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "core/flagged_buffer.hpp"
#include "kdacp/comm.hpp"
#include "kdacp/exchange.hpp"
#include "exchange/cost_terms.hpp"
#include "exchange/protocols.hpp"
#include "kdacp/kernels.hpp"
#include "kdacp/memory.hpp"
#include "kdacp/summary.hpp"

namespace kdacp::detail {

// Message tags on a CP communicator: a message is tagged by the chain
// position it enters and its direction, because a rank may exchange several
// parts with one peer, not in chain order (a cut sends first).
inline int part_tag(std::size_t position, Direction direction) {
  return 64 + 2 * static_cast<int>(position) + (direction == Direction::backward ? 1 : 0);
}

// The neighbours of chain position j in the direction the chain runs.
inline std::optional<std::size_t> chain_prev(std::size_t j, std::size_t n, Direction d) {
  if (d == Direction::forward) return j > 0 ? std::optional<std::size_t>(j - 1) : std::nullopt;
  return j + 1 < n ? std::optional<std::size_t>(j + 1) : std::nullopt;
}
inline std::optional<std::size_t> chain_next(std::size_t j, std::size_t n, Direction d) {
  return chain_prev(j, n, d == Direction::forward ? Direction::backward : Direction::forward);
}

// The protocols over one communicator, the CP group itself.
class CommExchange : public StateExchange {
 protected:
  CommExchange(const ProtocolContext& ctx, const ProtocolDescriptor& descriptor)
      : StateExchange(ctx, descriptor), comm_(ctx.mesh->group(0)) {}
  std::vector<const Communicator*> communicators() const final { return {comm_.get()}; }

  std::shared_ptr<Communicator> comm_;
};

// The grouped protocols' width rule: w divides P (InvalidArgument otherwise).
void check_group_width(std::size_t rank, std::size_t size, std::size_t width);

// `count` packed [offset | M] slots and their flags, as the gather buffer of a
// protocol. Each slot is contiguous: [B,H,K,V+K] then kSlotTailBytes.
class PackedSlots {
 public:
  PackedSlots(const SummaryShape& shape, std::size_t count);
  // Copies one rank's offset and transfer into slot `index`; a cut's
  // transfer is not copied (it is never read).
  void pack(std::size_t index, const StateView& offset, const StateView& transfer, bool cut);
  bool cut(std::size_t index) const;
  Slots slots() const;
  std::span<std::byte> bytes() const;
  std::span<std::byte> slot_bytes(std::size_t index) const;

  // The last slot in [first, end) that is a cut, or none.
  std::optional<std::size_t> last_cut(std::size_t first, std::size_t end) const;
  // The first slot in [first, end) that is a cut, or none.
  std::optional<std::size_t> first_cut(std::size_t first, std::size_t end) const;
  std::size_t count() const { return count_; }

 private:
  static std::size_t stride_of(const SummaryShape& shape);  // one slot with its flags
  std::size_t slot_stride_bytes() const;
  SummaryShape shape_;
  std::size_t count_;
  FlaggedBuffer buf_;  // each slot's tail holds its flags
};

std::span<std::byte> bytes_of(const State& s);
std::span<const std::byte> bytes_of(const StateView& dense_view);

// One rank's own summary as a one-slot stack, for single steps.
Slots single_slot(const StateView& offset, const StateView& transfer);

// Dense copy of a (possibly strided) view.
State dense_copy(const StateView& view);

// A [B,H,K,V] state of the summaries' dtype: zeroed, or (Init::uninitialized)
// for a buffer the protocol overwrites completely (a receive, a fold's output).
inline State make_state(const SummaryShape& s, Buffer::Init init = Buffer::Init::zero) {
  return State(s.batch, s.heads, s.key_dim, s.value_dim, s.dtype, init);
}

// Measures one protocol call: traffic from the communicators' counters and
// the peak of kdacp buffers allocated on this thread, less the returned state.
class CallMeter {
 public:
  // Null entries are skipped.
  explicit CallMeter(std::vector<const Communicator*> comms);
  ExchangeStats finish(const State& result) const { return finish(result.bytes()); }
  // `returned_bytes`: what the call hands back (not counted as extra).
  ExchangeStats finish(std::size_t returned_bytes) const;

 private:
  std::vector<const Communicator*> comms_;
  std::vector<CommStats> before_;
  MemoryScope scope_;
};

}  // namespace kdacp::detail
