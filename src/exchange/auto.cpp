// auto: the cost model's choice (choose_protocol). The choice is made at
// construction, identically on every rank (same parameters, same expected
// shape, deterministic model), because the grouped protocols split the mesh
// collectively there. The executor returned is the chosen protocol's own,
// carrying the prediction.
#include <fmt/format.h>

#include "exchange/common.hpp"
#include "kdacp/error.hpp"

namespace kdacp {
namespace detail {
namespace {

// auto's rule: the fastest configuration within the budget (choose_protocol),
// among the rows that take layouts when the layout has several parts on a
// rank; an explicit segment count overrides the model's (the prediction
// follows it).
Prediction auto_choice(const ProblemShape& shape, const ExchangeOptions& o) {
  const Planner planner(o.cost);  // the choice and a forced segment count price one shape
  Prediction choice = planner.choose_protocol(shape, o.memory_budget_bytes, o.allow_reassociation,
                                              needs_layout_rows(shape));
  if (find_protocol(choice.config.method).takes_segments && o.segments != 0) {
    ProtocolConfig forced = choice.config;
    forced.segments = o.segments;
    choice = planner.predict(shape, forced);
  }
  return choice;
}

std::unique_ptr<StateExchange> build_auto(const ProtocolContext& ctx) {
  const ExchangeOptions& o = ctx.options;
  if (!o.expected_shape) {
    throw InvalidArgument(fmt::format("rank {}: method 'auto' needs ExchangeOptions::expected_shape "
                                      "(B, H, K, V) to predict the protocols' cost, got none",
                                      ctx.rank));
  }
  const SummaryShape& s = *o.expected_shape;
  if (s.batch == 0 || s.heads == 0 || s.key_dim == 0 || s.value_dim == 0) {
    throw InvalidArgument(fmt::format("rank {}: expected_shape is {}, expected positive B, H, K and V",
                                      ctx.rank, to_string(s)));
  }
  ProblemShape shape{ctx.size, s.slabs(), s.key_dim, s.value_dim, dtype_size(s.dtype)};
  // The layout, and the cuts the calls are expected to carry (the calls'
  // own flags are each rank's alone: the choice must be the same on all).
  shape.part_owners = o.part_owners;
  shape.part_cuts = o.expected_cuts;
  Prediction choice = auto_choice(shape, o);
  const ProtocolDescriptor& row = find_protocol(choice.config.method);
  ProtocolContext inner = ctx;
  inner.group_size = choice.config.group_size;
  inner.options.segments = choice.config.segments;
  auto chosen = row.build(inner);
  ExchangeAccess::set_prediction(*chosen, std::move(choice));
  return chosen;
}

}  // namespace

const ProtocolDescriptor auto_protocol{
    .name = "auto",
    .kind = ProtocolClass::chooser,
    .takes_segments = true,
    .memory = "within --memory-budget",
    .use_when = "always, unless you know better: the fastest exact one (or any, with "
                "--allow-reassociation)",
    .build = build_auto,
};

}  // namespace detail

Prediction predict_exchange(const ProblemShape& shape, const std::string& method, long long group_size,
                            const ExchangeOptions& options) {
  const ProtocolDescriptor& row = find_protocol(method);
  if (row.chooser()) return detail::auto_choice(shape, options);
  if (group_size < 1)
    throw InvalidArgument(fmt::format("group size is {}, expected a positive divisor of P", group_size));
  return predict(options.cost, shape, ProtocolConfig{method, static_cast<std::size_t>(group_size), options.segments});
}

}  // namespace kdacp
