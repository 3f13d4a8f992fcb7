// The factory (SPEC §6) and what every executor shares: validation before any
// message, the call meter and the stats, in one non-virtual path.
#include <string_view>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

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
      options_(ctx.options),
      part_owners_(*ctx.options.part_owners),
      own_parts_(part_owners_.parts_of(rank_)) {}

std::vector<State> StateExchange::forward(std::span<const PartSummary> parts) {
  return call(parts, Direction::forward);
}

std::vector<State> StateExchange::backward(std::span<const PartSummary> parts) {
  return call(parts, Direction::backward);
}

State StateExchange::forward(const StateView& s, const StateView& m, PartFlags part) {
  const PartSummary one{s, m, part};
  return std::move(call(std::span(&one, 1), Direction::forward).front());
}

State StateExchange::backward(const StateView& g, const StateView& m, PartFlags part) {
  const PartSummary one{g, m, part};
  return std::move(call(std::span(&one, 1), Direction::backward).front());
}

std::vector<State> StateExchange::call(std::span<const PartSummary> parts, Direction direction) {
  const bool fwd = direction == Direction::forward;
  if (parts.size() != own_parts_.size())
    throw InvalidArgument(fmt::format("rank {}: {} parts given, expected the layout's {}", rank_,
                                      parts.size(), own_parts_.size()));
  // One part per rank: the summary is named as the call's own (S or G).
  const bool one = part_owners_.is_one_per_rank();
  SummaryShape shape{};
  for (std::size_t i = 0; i < parts.size(); ++i) {
    const std::string name =
        one ? std::string(fwd ? "S" : "G") : fmt::format("{} of part {}", fwd ? "S" : "G", own_parts_[i]);
    const SummaryShape s = validate_summary(parts[i].offset, parts[i].transfer, name, rank_);
    if (i > 0 && !(s == shape))
      throw InvalidArgument(fmt::format("rank {}: {} has shape {}, expected the shape of the first part, {}",
                                        rank_, name, to_string(s), to_string(shape)));
    shape = s;
  }
  detail::CallMeter meter(communicators());
  std::vector<State> result = run(Call{parts, shape, direction});
  std::size_t returned = 0;
  for (const State& s : result) returned += s.bytes();
  stats_ = meter.finish(returned);
  return result;
}

std::unique_ptr<StateExchange> make_state_exchange(const DeviceMesh& mesh,
                                                   const std::string& method,
                                                   long long allgather_group_size,
                                                   ExchangeOptions options) {
  const ProtocolDescriptor& row = find_protocol(method);
  if (allgather_group_size < 1)
    throw InvalidArgument(
        fmt::format("allgather_group_size is {}, expected a positive integer", allgather_group_size));
  auto rows_taking = [](bool ProtocolDescriptor::*knob) {
    std::vector<std::string_view> names;
    for (const ProtocolDescriptor* r : protocol_registry())
      if (r->*knob) names.push_back(r->name);
    return fmt::format("{}", fmt::join(names, " and "));
  };
  if (!row.takes_group_size && allgather_group_size != 1)
    throw InvalidArgument(fmt::format(
        "allgather_group_size is {} for method '{}', expected 1: a group size is only valid for {}",
        allgather_group_size, method, rows_taking(&ProtocolDescriptor::takes_group_size)));
  if (!row.takes_segments && options.segments != 0)
    throw InvalidArgument(fmt::format(
        "segments is {} for method '{}', expected 0: segments are only valid for {}", options.segments,
        method, rows_taking(&ProtocolDescriptor::takes_segments)));
  if (mesh.ndim() != 1)
    throw InvalidArgument(
        fmt::format("state exchange mesh has {} dims, expected a 1-D chronological CP mesh", mesh.ndim()));
  // Explicit from here on: none is one part per rank.
  if (!options.part_owners) options.part_owners = PartOwners::one_per_rank(mesh.size());
  if (options.part_owners->ranks() != mesh.size())
    throw InvalidArgument(fmt::format("part_owners spans {} ranks, expected the CP size {}",
                                      options.part_owners->ranks(), mesh.size()));
  if (!options.part_owners->is_one_per_rank() && !row.takes_layouts && !row.chooser())
    throw InvalidArgument(fmt::format("method '{}' does not take a layout (part_owners), expected one of: {}",
                                      method, rows_taking(&ProtocolDescriptor::takes_layouts)));
  if (!options.expected_cuts.empty() && options.expected_cuts.size() != options.part_owners->size())
    throw InvalidArgument(fmt::format("expected_cuts has {} flags, expected one per part of the layout ({})",
                                      options.expected_cuts.size(), options.part_owners->size()));
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
