// The factory (SPEC §6) and what every executor shares: validation before any
// message, the call meter and the stats, in one non-virtual path.
#include "exchange/common.hpp"
#include "exchange/protocols.hpp"
#include "kdacp/error.hpp"

namespace kdacp {

StateExchange::StateExchange(const detail::ProtocolContext& ctx,
                             const ProtocolDescriptor& descriptor)
    : rank_(ctx.rank),
      size_(ctx.size),
      descriptor_(&descriptor),
      config_{std::string(descriptor.name), descriptor.takes_group_size ? ctx.group_size : 1,
              descriptor.takes_segments ? ctx.options.segments : 0},
      options_(ctx.options) {}

State StateExchange::forward(const StateView& s, const StateView& m, PartFlags part) {
  return call(s, m, Direction::forward, part);
}

State StateExchange::backward(const StateView& g, const StateView& m, PartFlags part) {
  return call(g, m, Direction::backward, part);
}

State StateExchange::call(const StateView& offset, const StateView& m, Direction direction,
                          PartFlags part) {
  const bool fwd = direction == Direction::forward;
  const SummaryShape shape = validate_summary(offset, m, fwd ? "S" : "G", rank_);
  detail::CallMeter meter(communicators());
  State result = run(Call{offset, m, shape, direction,
                          fwd ? detail::kTagForward : detail::kTagBackward, part.cut});
  stats_ = meter.finish(result);
  return result;
}

std::unique_ptr<StateExchange> make_state_exchange(const DeviceMesh& mesh,
                                                   const std::string& method,
                                                   long long allgather_group_size,
                                                   ExchangeOptions options) {
  const ProtocolDescriptor& row = find_protocol(method);
  if (allgather_group_size < 1)
    throw InvalidArgument("allgather_group_size is " + std::to_string(allgather_group_size) +
                          ", expected a positive integer");
  auto rows_taking = [](bool ProtocolDescriptor::*knob) {
    std::string out;
    for (const ProtocolDescriptor* r : protocol_registry())
      if (r->*knob) out += (out.empty() ? "" : " and ") + std::string(r->name);
    return out;
  };
  if (!row.takes_group_size && allgather_group_size != 1)
    throw InvalidArgument("allgather_group_size is " + std::to_string(allgather_group_size) +
                          " for method '" + method + "', expected 1: a group size is only valid for " +
                          rows_taking(&ProtocolDescriptor::takes_group_size));
  if (!row.takes_segments && options.segments != 0)
    throw InvalidArgument("segments is " + std::to_string(options.segments) + " for method '" +
                          method + "', expected 0: segments are only valid for " +
                          rows_taking(&ProtocolDescriptor::takes_segments));
  if (mesh.ndim() != 1)
    throw InvalidArgument("state exchange mesh has " + std::to_string(mesh.ndim()) +
                          " dims, expected a 1-D chronological CP mesh");
  // Collective slots and p2p peers are group ranks: they must be the
  // chronological positions.
  mesh.validate_order();
  detail::ProtocolContext ctx;
  ctx.mesh = &mesh;
  ctx.rank = mesh.local_rank();
  ctx.size = mesh.size();
  ctx.group_size = static_cast<std::size_t>(allgather_group_size);
  ctx.options = options;
  return row.build(ctx);
}

namespace detail {

void ExchangeAccess::set_prediction(StateExchange& exchange, Prediction prediction) {
  exchange.prediction_ = std::move(prediction);
}

}  // namespace detail

}  // namespace kdacp
