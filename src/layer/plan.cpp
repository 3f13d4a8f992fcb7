// The layer's plan: the exchange options and cost-model shape of its stream,
// and the Ulysses width the cost model picks (kdacp/layer.hpp).
#include <algorithm>
#include <vector>

#include "kdacp/kda_ulysses.hpp"
#include "kdacp/layer.hpp"

namespace kdacp {

ProblemShape layer_problem_shape(const kda::Shape& s, std::size_t elem_bytes, const Layout& layout,
                                 const std::vector<bool>& cuts) {
  ProblemShape ps{layout.ranks(), s.batch * s.value_heads, s.key_dim, s.value_dim, elem_bytes};
  ps.part_owners = layout.owners();
  ps.part_cuts = cuts;
  return ps;
}

ExchangeOptions layer_exchange_options(const ExchangeOptions& given, const kda::Shape& s, DType dtype,
                                       const Layout& layout, const kda::Sequences& seqs) {
  ExchangeOptions eo = given;
  if (!eo.expected_shape) {
    eo.expected_shape = layer_summary_shape(s);
    eo.expected_shape->dtype = dtype;
  }
  if (eo.expected_cuts.empty()) eo.expected_cuts = layout.cuts(seqs);
  return eo;
}

std::size_t choose_ulysses(const kda::Shape& s, const Layout& layout, const ExchangeOptions& eo,
                           std::size_t elem_bytes) {
  const std::size_t ranks = layout.ranks();
  const ProblemShape ps = layer_problem_shape(s, elem_bytes, layout, eo.expected_cuts);
  UlyssesOptions uo;
  uo.heads = s.heads * s.batch;  // U divides H (and so HV); the slabs are B·HV
  for (std::size_t r = 0; r < ranks; ++r) uo.tokens_per_rank = std::max(uo.tokens_per_rank, layout.local_tokens(r));
  uo.activation_bytes = elem_bytes;
  // The cost parameters' nodes, else UlyssesOptions' islands (as `kdacp plan`).
  if (eo.cost.node_ranks > 0) uo.node_size = eo.cost.node_ranks;
  uo.memory_budget_bytes = eo.memory_budget_bytes;
  // Each U's exchange: the head groups' layout and cuts on P/U ranks.
  const auto at = [&](std::size_t state_ranks) {
    const std::size_t width = ranks / state_ranks;
    const ExchangeOptions go = kda::ulysses_exchange_options(eo, layout, width);
    return layer_problem_shape(s, elem_bytes, kda::ulysses_group_layout(layout, width), go.expected_cuts);
  };
  return best_ulysses(predict_ulysses(eo.cost, ps, uo, at)).width;
}

SummaryShape layer_summary_shape(const kda::Shape& s) {
  return SummaryShape{s.batch, s.value_heads, s.key_dim, s.value_dim};
}

}  // namespace kdacp
