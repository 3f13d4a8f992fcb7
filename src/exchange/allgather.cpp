// allgather (SPEC §6): pack [S|M] (or [G|M]), gather P slots in place, fold
// the exclusive prefix (or transposed suffix) in one fused pass per (b,h).
// One collective; P packed slots per rank; the fold consumes the gathered
// offsets in place, so no scratch beyond the gather buffer.
#include "exchange/common.hpp"
#include "exchange/protocols.hpp"

namespace kdacp::detail {
namespace {

class AllGatherExchange final : public CommExchange {
 public:
  using CommExchange::CommExchange;

  std::string method() const override { return "allgather"; }
  bool exact() const override { return true; }

 private:
  State run(const StateView& offset, const StateView& m, const char* name, Direction dir) override {
    const SummaryShape shape = validate_summary(offset, m, name, rank_);
    CallMeter meter({comm_.get()});
    PackedSlots gathered(shape, size_);
    gathered.pack(rank_, offset, m);
    comm_->all_gather(gathered.bytes());
    State result = make_state(shape);
    merge(gathered.slots(), rank_, dir, result.view(), options_.exec, FoldFlags::consume_offsets);
    stats_ = meter.finish(result);
    return result;
  }

};

}  // namespace

std::unique_ptr<StateExchange> make_allgather(const ProtocolContext& ctx) {
  return std::make_unique<AllGatherExchange>(ctx.mesh->group(0), ctx.options);
}

}  // namespace kdacp::detail
