// recursive_doubling (reassociating, opt-in): the exclusive scan of the
// ranks' affine pairs in ceil(log2 P) rounds (affine_pairs.hpp), forward
// over (M, S), backward over the transposed suffix of (M, G). Products of
// transfers are reassociated, so results differ from the chain by round-off:
// docs/protocols.md states the bound. Memory: three pairs per rank.
#include "exchange/affine_pairs.hpp"
#include "exchange/common.hpp"
#include "exchange/protocols.hpp"

namespace kdacp::detail {
namespace {

class RecursiveDoublingExchange final : public StateExchange {
 public:
  RecursiveDoublingExchange(std::shared_ptr<Communicator> comm, ExchangeOptions options)
      : StateExchange(comm->rank(), comm->size()), comm_(std::move(comm)), options_(options) {}

  std::string method() const override { return "recursive_doubling"; }
  bool exact() const override { return false; }

  State forward(const StateView& s, const StateView& m) override {
    return run(s, m, "S", Direction::forward);
  }
  State backward(const StateView& g, const StateView& m) override {
    return run(g, m, "G", Direction::backward);
  }

 private:
  State run(const StateView& offset, const StateView& m, const char* name, Direction dir) {
    const SummaryShape shape = validate_summary(offset, m, name, rank_);
    CallMeter meter({comm_.get()});
    State result = rd_exclusive_scan(*comm_, offset, m, shape, dir, options_.exec,
                                     dir == Direction::forward ? kTagForward : kTagBackward);
    stats_ = meter.finish(result);
    return result;
  }

  std::shared_ptr<Communicator> comm_;
  ExchangeOptions options_;
};

}  // namespace

std::unique_ptr<StateExchange> make_recursive_doubling(const ProtocolContext& ctx) {
  return std::make_unique<RecursiveDoublingExchange>(ctx.mesh->group(0), ctx.options);
}

}  // namespace kdacp::detail
