// The registry's rows (protocols.def) and what every caller derives from them.
#include <cmath>
#include <string_view>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "exchange/protocols.hpp"
#include "kdacp/error.hpp"

namespace kdacp {

namespace {

constexpr const ProtocolDescriptor* kRows[] = {
#define KDACP_PROTOCOL(name) &detail::name##_protocol,
#include "exchange/protocols.def"
#undef KDACP_PROTOCOL
};

}  // namespace

std::string to_string(ProtocolClass kind) {
  switch (kind) {
    case ProtocolClass::exact: return "exact";
    case ProtocolClass::reassociating: return "reassociating";
    case ProtocolClass::chooser: return "chooser";
  }
  return "?";
}

std::span<const ProtocolDescriptor* const> protocol_registry() { return kRows; }

std::string protocol_names() {
  std::vector<std::string_view> names;
  for (const ProtocolDescriptor* row : kRows) names.push_back(row->name);
  return fmt::format("{}", fmt::join(names, ", "));
}

const ProtocolDescriptor& find_protocol(std::string_view name) {
  for (const ProtocolDescriptor* row : kRows)
    if (row->name == name) return *row;
  throw InvalidArgument(fmt::format("unknown state_cp_method '{}', expected one of: {}", name, protocol_names()));
}

double error_bound(const ProtocolDescriptor& protocol, std::size_t ranks, std::size_t key_dim) {
  return protocol.error_bound ? protocol.error_bound(ranks, key_dim) : 0.0;
}

double error_bound(const ProtocolDescriptor& protocol, const ProblemShape& shape) {
  if (!protocol.error_bound) return 0.0;
  // The positions the bound counts: the runs, a run of L parts weighed as
  // 2^(L-1) of them (one part per rank: P).
  const ChainProfile chain = chain_profile(shape, 1);
  const std::size_t positions = chain.runs << std::min<std::size_t>(chain.longest_run - 1, 40);
  return protocol.error_bound(positions, shape.key_dim);
}

std::string protocol_label(const ProtocolConfig& config) {
  std::string out = config.method;
  if (config.group_size > 1) out += fmt::format(" w={}", config.group_size);
  if (config.segments > 0) out += fmt::format(" c={}", config.segments);
  return out;
}

std::vector<ProtocolConfig> valid_configs(const ProtocolDescriptor& protocol, std::size_t ranks,
                                          std::size_t value_dim) {
  std::vector<ProtocolConfig> out;
  if (protocol.chooser()) return out;
  std::vector<std::size_t> widths{1};
  if (protocol.takes_group_size)
    for (std::size_t w = 2; w <= ranks; ++w)
      if (ranks % w == 0) widths.push_back(w);
  std::vector<std::size_t> segments{0};
  if (protocol.takes_segments) {
    segments.clear();
    for (std::size_t c = 1; c <= max_segments(value_dim); ++c) segments.push_back(c);
  }
  for (std::size_t w : widths)
    for (std::size_t c : segments) out.push_back({std::string(protocol.name), w, c});
  return out;
}

std::vector<std::string> exchange_methods() {
  std::vector<std::string> out;
  for (const ProtocolDescriptor* row : kRows) out.emplace_back(row->name);
  return out;
}

}  // namespace kdacp
