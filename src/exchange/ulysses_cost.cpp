// Ulysses × state CP priced (cost_model.hpp): the all-to-alls of a head group
// and the state exchange over the P/U ranks that hold the same heads.
#include <algorithm>
#include <functional>
#include <vector>

#include <fmt/format.h>

#include "exchange/cost_terms.hpp"
#include "kdacp/cost_model.hpp"
#include "kdacp/error.hpp"

namespace kdacp {

using detail::check_cost_params;
using detail::check_cost_shape;

double all_to_all_seconds(const CostParams& params, std::size_t width, double bytes, std::size_t node_size) {
  check_cost_params(params);
  if (width <= 1) return 0;
  const double alpha = params.alpha_s, beta = params.beta_s_per_byte;
  const double group_alpha = params.group_alpha_s > 0 ? params.group_alpha_s : alpha;
  const double group_beta = params.group_beta_s_per_byte > 0 ? params.group_beta_s_per_byte : beta;
  const double w = static_cast<double>(width), share = bytes / w;
  // Steps inside the island and across it. A step waits for its send and
  // its receive: in a group wider than an island, the rank at an island's
  // edge has a peer in another island on one side or the other in every
  // step (its first steps receive from the island before it, its last ones
  // send to it), so all U - 1 steps go at the network's pace (simulated:
  // U = 16 over two nodes of 8 read 1.66 when only the sends were counted).
  double inside = 0, across = w - 1;
  if (node_size > 0 && node_size % width == 0) inside = w - 1, across = 0;
  return inside * (group_alpha + group_beta * share) + across * (alpha + beta * share);
}

std::vector<UlyssesPrediction> predict_ulysses(const CostParams& params, const ProblemShape& shape,
                                               const UlyssesOptions& options,
                                               const std::function<ProblemShape(std::size_t)>& shape_at) {
  check_cost_params(params);
  check_cost_shape(shape);
  const std::size_t heads = options.heads == 0 ? shape.slabs : options.heads;
  if (options.tokens_per_rank == 0 || options.activation_bytes == 0 || options.node_size == 0)
    throw InvalidArgument(fmt::format("Ulysses: tokens per rank {}, activation bytes {}, node size {}, expected "
                                      "each positive",
                                      options.tokens_per_rank, options.activation_bytes, options.node_size));
  if (shape.slabs % heads != 0)
    throw InvalidArgument(fmt::format("Ulysses: H = {} does not divide B*H = {}, expected the heads of one row",
                                      heads, shape.slabs));
  if (params.node_ranks > 0 && params.node_ranks != options.node_size)
    throw InvalidArgument(fmt::format("Ulysses: node size {} with cost parameters of {} ranks per node (node_ranks), "
                                      "expected the same",
                                      options.node_size, params.node_ranks));
  if (!shape_at && (shape.part_owners || !shape.part_cuts.empty()))
    throw InvalidArgument("Ulysses: a shape with a layout or cuts needs shape_at, its layout on P/U ranks");
  const double kv = static_cast<double>(shape.key_dim), vv = static_cast<double>(shape.value_dim);
  // What one element per head and token weighs on a rank: T/P tokens x B*H
  // heads x a bytes (in double: the product can pass 2^64).
  const double per_head_element = static_cast<double>(options.tokens_per_rank) * static_cast<double>(shape.slabs) *
                                  static_cast<double>(options.activation_bytes);
  std::vector<UlyssesPrediction> out;
  for (std::size_t u = 1; u <= std::min(heads, shape.ranks); ++u) {
    if (heads % u != 0 || shape.ranks % u != 0) continue;
    UlyssesPrediction p;
    p.width = u;
    p.state_ranks = shape.ranks / u;
    p.in_bytes = per_head_element * (3 * kv + vv + 1);  // q, k, g: K each; v: V; beta: 1
    p.out_bytes = per_head_element * vv;                // o: V
    p.all_to_all_seconds = all_to_all_seconds(params, u, p.in_bytes, options.node_size) +
                           all_to_all_seconds(params, u, p.out_bytes, options.node_size);
    ProblemShape sub = u == 1 ? shape : (shape_at ? shape_at(p.state_ranks) : shape);
    sub.ranks = p.state_ranks;
    sub.slabs = shape.slabs / u;
    CostParams sub_params = params;
    // One head slice's C ranks are U apart: islands of node_size ranks hold
    // node_size/U of them while U divides node_size and none together from
    // U = node_size on. With nodes in the parameters (node_ranks), the
    // exchange prices each message by where its ranks are: a node holds
    // node_size/U of the C ranks, or one.
    const bool shared = u < options.node_size && options.node_size % u == 0;
    if (u > 1 && !shared) sub_params.group_alpha_s = sub_params.group_beta_s_per_byte = 0;
    if (u > 1 && params.node_ranks > 0) sub.ranks_per_node = shared ? options.node_size / u : 1;
    p.exchange = choose_protocol(sub_params, sub, options.memory_budget_bytes, false, needs_layout_rows(sub));
    p.seconds = p.all_to_all_seconds + p.exchange.seconds;
    out.push_back(std::move(p));
  }
  return out;
}

UlyssesPrediction best_ulysses(const std::vector<UlyssesPrediction>& options) {
  if (options.empty()) throw InvalidArgument("Ulysses: no option to choose from");
  const UlyssesPrediction* best = &options.front();
  for (const UlyssesPrediction& p : options)
    if (p.seconds < best->seconds) best = &p;
  return *best;
}

}  // namespace kdacp
