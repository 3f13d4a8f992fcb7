// p2p: the chain (SPEC §6). Rank r receives incoming_r from r-1 and sends
// M_r·incoming_r + S_r (S_0 on rank 0) to r+1; backward mirrors it with Mᵀ.
// P-1 dependent hops; one extra state per rank.
#include "exchange/common.hpp"
#include "exchange/protocols.hpp"

namespace kdacp::detail {
namespace {

class P2PExchange final : public CommExchange {
 public:
  using CommExchange::CommExchange;

  std::string method() const override { return "p2p"; }
  bool exact() const override { return true; }

 private:
  State run(const StateView& offset, const StateView& m, const char* name, Direction dir) override {
    const SummaryShape shape = validate_summary(offset, m, name, rank_);
    CallMeter meter({comm_.get()});
    const bool fwd = dir == Direction::forward;
    const int tag = fwd ? kTagForward : kTagBackward;
    // Chronological neighbours: forward receives from r-1, sends to r+1.
    const bool has_prev = fwd ? rank_ > 0 : rank_ + 1 < size_;
    const bool has_next = fwd ? rank_ + 1 < size_ : rank_ > 0;
    const std::size_t prev = fwd ? rank_ - 1 : rank_ + 1;
    const std::size_t next = fwd ? rank_ + 1 : rank_ - 1;

    // Received whole, or the zero state of the chain's first rank.
    State result = make_state(shape, has_prev ? Buffer::Init::uninitialized : Buffer::Init::zero);
    if (has_prev) comm_->irecv(bytes_of(result), prev, tag)->wait();
    if (has_next) {
      State send;
      std::span<const std::byte> payload;
      if (!has_prev) {
        // The first rank of the chain sends its offset itself: never a
        // product with the zero state.
        if (offset.is_dense()) {
          payload = bytes_of(offset);
        } else {
          send = dense_copy(offset);
          payload = bytes_of(send);
        }
      } else {
        send = make_state(shape, Buffer::Init::uninitialized);  // the step writes it all
        const StateView in = result.view();
        scan(single_slot(offset, m), 0, 1, dir, &in, send.view(), std::nullopt, nullptr,
             options_.exec);
        payload = bytes_of(send);
      }
      comm_->isend(payload, next, tag)->wait();
    }
    stats_ = meter.finish(result);
    return result;
  }

};

}  // namespace

std::unique_ptr<StateExchange> make_p2p(const ProtocolContext& ctx) {
  return std::make_unique<P2PExchange>(ctx.mesh->group(0), ctx.options);
}

}  // namespace kdacp::detail
