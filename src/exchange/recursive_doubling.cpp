// recursive_doubling (reassociating, opt-in): the exclusive scan of the
// ranks' affine pairs in ceil(log2 P) rounds (affine_pairs.hpp), forward
// over (M, S), backward over the transposed suffix of (M, G). Products of
// transfers are reassociated, so results differ from the chain by round-off
// within reassociation_bound (docs/protocols.md). Memory: three pairs per rank.
#include "exchange/affine_pairs.hpp"
#include "exchange/common.hpp"
#include "exchange/cost_terms.hpp"

namespace kdacp::detail {
namespace {

class RecursiveDoublingExchange final : public CommExchange {
 public:
  explicit RecursiveDoublingExchange(const ProtocolContext& ctx)
      : CommExchange(ctx, recursive_doubling_protocol) {}

 private:
  State run(const Call& c) override {
    return rd_exclusive_scan(*comm_, PairView{c.offset, c.transfer, c.cut}, c.shape, c.direction,
                             options().exec, c.tag);
  }
};

CostTerms recursive_doubling_cost(const ProblemShape& s, const ProtocolConfig&) {
  CostTerms t;
  add_recursive_doubling(t, s, s.ranks);
  t.peak_extra_bytes = recursive_doubling_memory(s, s.ranks);
  return t;
}

}  // namespace

const ProtocolDescriptor recursive_doubling_protocol{
    .name = "recursive_doubling",
    .kind = ProtocolClass::reassociating,
    .memory = "3 packed pairs",
    .use_when = "large P when round-off within the documented bound is acceptable",
    .cost = recursive_doubling_cost,
    .error_bound = reassociation_bound,
    .error_bound_text = "(⌈log₂P⌉+2)·K·2⁻²⁴",
    .build = [](const ProtocolContext& ctx) -> std::unique_ptr<StateExchange> {
      return std::make_unique<RecursiveDoublingExchange>(ctx);
    },
};

}  // namespace kdacp::detail
