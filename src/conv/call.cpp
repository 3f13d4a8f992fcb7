#include "conv/call.hpp"

#include <cstdint>
#include <vector>

#include <fmt/format.h>

#include "kdacp/agreement.hpp"
#include "kdacp/error.hpp"

namespace kdacp::conv {

Activation parse_activation(std::string_view name) {
  if (name.empty() || name == "none") return Activation::none;
  if (name == "silu" || name == "swish") return Activation::silu;
  throw InvalidArgument(fmt::format(
      "causal_conv1d: activation '{}', expected none, 'silu' or 'swish'", name));
}

std::string_view activation_name(Activation a) { return a == Activation::silu ? "silu" : "none"; }

void agree_conv_call(Communicator& comm, const ConvCall& c, const std::string& what) {
  Fingerprint f;
  f.add_int("B (x's batch)", static_cast<long long>(c.batch));
  f.add_int("T (the stream's tokens)", static_cast<long long>(c.tokens));
  f.add_int("D (x's channels)", static_cast<long long>(c.dim));
  f.add_int("W (weight's kernel width)", static_cast<long long>(c.width));
  f.add_bytes("cu_seqlens", std::as_bytes(c.boundaries), list_text(c.boundaries));
  std::vector<std::uint64_t> parts;
  parts.reserve(3 * c.parts.size());
  for (const LayoutPart& p : c.parts) parts.insert(parts.end(), {p.rank, p.begin, p.end});
  f.add_bytes("layout", std::as_bytes(std::span(parts)), std::to_string(c.parts.size()) + " parts");
  f.add_text("dtype", c.dtype);
  f.add_text("activation", c.activation);
  f.add_flag("bias given", c.bias);
  f.add_flag("initial_state given", c.initial_state);
  f.add_flag(what.find("backward") != std::string::npos ? "final_state's gradient given" : "output_final_state",
             c.final_state);
  agree(comm, f, what);
}

}  // namespace kdacp::conv
