// The factory table. A new protocol is one new file plus one row here.
#include <algorithm>

#include "exchange/protocols.hpp"
#include "kdacp/error.hpp"

namespace kdacp {

namespace {

struct Row {
  const char* name;
  bool takes_group_size;  // only these accept allgather_group_size != 1
  std::unique_ptr<StateExchange> (*build)(const detail::ProtocolContext&);
};

constexpr Row kTable[] = {
    {"p2p", false, detail::make_p2p},
    {"allgather", false, detail::make_allgather},
    {"grouped_allgather_p2p", true, detail::make_grouped_allgather_p2p},
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
                          "', expected 1: a group size is only valid for grouped_allgather_p2p");
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
