// The factory table. A new protocol is one new file plus one row here.
#include <algorithm>

#include "exchange/protocols.hpp"
#include "kdacp/error.hpp"

namespace kdacp {

namespace {

struct Row {
  const char* name;
  bool exact;             // the chain's operations, bitwise equal to p2p
  bool takes_group_size;  // only these accept allgather_group_size != 1
  bool takes_segments;    // only these accept options.segments != 0
  bool chooser;           // picks one of the other rows
  std::unique_ptr<StateExchange> (*build)(const detail::ProtocolContext&);
};

constexpr Row kTable[] = {
    {"p2p", true, false, false, false, detail::make_p2p},
    {"allgather", true, false, false, false, detail::make_allgather},
    {"grouped_allgather_p2p", true, true, false, false, detail::make_grouped_allgather_p2p},
    {"pipelined_p2p", true, false, true, false, detail::make_pipelined_p2p},
    {"recursive_doubling", false, false, false, false, detail::make_recursive_doubling},
    {"grouped_allgather_rd", false, true, false, false, detail::make_grouped_allgather_rd},
    {"auto", false, false, true, true, detail::make_auto},
};

std::string known_methods() {
  std::string out;
  for (const Row& r : kTable) out += (out.empty() ? "" : ", ") + std::string(r.name);
  return out;
}

}  // namespace

std::vector<std::string> exchange_methods() {
  std::vector<std::string> out;
  for (const Row& r : kTable) out.emplace_back(r.name);
  return out;
}

std::vector<MethodInfo> exchange_method_info() {
  std::vector<MethodInfo> out;
  for (const Row& r : kTable)
    out.push_back({r.name, r.exact, r.takes_group_size, r.takes_segments, r.chooser});
  return out;
}

std::vector<std::string> exchange_protocols() {
  std::vector<std::string> out;
  for (const Row& r : kTable)
    if (!r.chooser) out.emplace_back(r.name);
  return out;
}

std::unique_ptr<StateExchange> make_state_exchange(const DeviceMesh& mesh,
                                                   const std::string& method,
                                                   long long allgather_group_size,
                                                   ExchangeOptions options) {
  const Row* row = std::find_if(std::begin(kTable), std::end(kTable),
                                [&](const Row& r) { return method == r.name; });
  if (row == std::end(kTable))
    throw InvalidArgument("unknown state_cp_method '" + method + "', expected one of: " +
                          known_methods());
  if (allgather_group_size < 1)
    throw InvalidArgument("allgather_group_size is " + std::to_string(allgather_group_size) +
                          ", expected a positive integer");
  if (!row->takes_group_size && allgather_group_size != 1)
    throw InvalidArgument("allgather_group_size is " + std::to_string(allgather_group_size) +
                          " for method '" + method +
                          "', expected 1: a group size is only valid for grouped_allgather_p2p "
                          "and grouped_allgather_rd");
  if (!row->takes_segments && options.segments != 0)
    throw InvalidArgument("segments is " + std::to_string(options.segments) + " for method '" +
                          method + "', expected 0: segments are only valid for pipelined_p2p and auto");
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
  return row->build(ctx);
}

}  // namespace kdacp
