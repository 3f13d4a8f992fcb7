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

class RecursiveDoublingExchange final : public CommExchange {
 public:
  using CommExchange::CommExchange;

  std::string method() const override { return "recursive_doubling"; }
  bool exact() const override { return false; }

 private:
  State run(const StateView& offset, const StateView& m, const char* name, Direction dir) override {
    const SummaryShape shape = validate_summary(offset, m, name, rank_);
    CallMeter meter({comm_.get()});
    State result = rd_exclusive_scan(*comm_, offset, m, shape, dir, options_.exec,
                                     dir == Direction::forward ? kTagForward : kTagBackward);
    stats_ = meter.finish(result);
    return result;
  }

};

}  // namespace

std::unique_ptr<StateExchange> make_recursive_doubling(const ProtocolContext& ctx) {
  return std::make_unique<RecursiveDoublingExchange>(ctx.mesh->group(0), ctx.options);
}

}  // namespace kdacp::detail
