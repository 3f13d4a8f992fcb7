// The cost of recursive doubling over a layout's runs (add_layout_runs,
// cost_terms.hpp), priced round by round as rd_exclusive_scan_parts
// (runs.cpp) runs it, from the protocols' own run decomposition (runs.hpp).
#include <algorithm>
#include <array>
#include <vector>

#include "exchange/cost_terms.hpp"
#include "exchange/runs.hpp"

namespace kdacp::detail {

namespace {

// add_layout_runs' folds inside the runs: the carrier's of each run into a
// pair (its parts from the run's last cut on) and every rank's inside its
// runs (from the run's start or a cut to the next cut), the longest of each.
void add_run_folds(CostTerms& t, const ProblemShape& s, const Runs& runs) {
  std::size_t pair = 1, fold = 1;  // the longest of each, in parts
  for (std::size_t r = 0; r < runs.size(); ++r) {
    // The run's pieces: from its first part or a cut to the next cut.
    std::size_t start = runs.first[r];
    for (std::size_t j = runs.first[r] + 1; j <= runs.last[r]; ++j) {
      if (!s.part_cuts.empty() && s.part_cuts[j]) {
        fold = std::max(fold, j - start);
        start = j;
      }
    }
    const std::size_t last = runs.last[r] - start + 1;
    fold = std::max(fold, last);
    pair = std::max(pair, last);
  }
  t.folds += dbl(pair - 1) + dbl(fold - 1);
  t.products += dbl(pair - 1);
}

// add_layout_runs' scan over the runs.
void add_run_scan(CostTerms& t, const ProblemShape& s, const Runs& runs, std::size_t w) {
  auto carrier = [&](std::size_t run) { return runs.block[run] * w + w - 1; };  // as runs.cpp
  const std::size_t m = runs.size(), rounds = ceil_log2(m), node = rank_node_width(s);
  // Leaves (the members are ranks, whatever the layout): a leaf's uplinks
  // carry leaf/o ranks' bandwidth in each direction.
  const std::size_t leaf = node > 0 ? rank_leaf_width(s) : 0;
  const std::size_t leaves = leaf > 0 ? s.ranks / leaf : 0;
  // A run's pair is a cut (a constant map) when one of its parts is.
  std::vector<char> cut(m, 0);
  if (!s.part_cuts.empty())
    for (std::size_t r = 0; r < m; ++r)
      for (std::size_t j = runs.first[r]; j <= runs.last[r] && !cut[r]; ++j) cut[r] = s.part_cuts[j];
  // Per position, as rd_exclusive_scan_parts holds them: whether it holds a
  // prefix yet, whether that prefix is a cut, whether this round's outgoing
  // aggregate is.
  std::vector<char> have(m, 0), prefix_cut(m, 0), out_cut(m, 0);
  const double fold_weight = dbl(s.value_dim), product_weight = dbl(s.key_dim);  // flops per K·K
  // Per round: per rank, network messages sent, received and node messages
  // sent, received; per leaf, messages leaving it, entering it; per rank,
  // folds and products before its sends (the outgoing aggregates) and after
  // its receives (the prefixes) (compose(): a cut outer pair costs nothing,
  // a cut inner one no product).
  std::vector<std::array<std::size_t, 4>> count(s.ranks);
  std::vector<std::array<std::size_t, 2>> across(leaves), sending(s.ranks), receiving(s.ranks);
  for (std::size_t k = 0; k < rounds; ++k) {
    const std::size_t d = std::size_t{1} << k;
    auto final_round = [d](std::size_t q) { return d <= q && q < 2 * d; };
    std::fill(count.begin(), count.end(), std::array<std::size_t, 4>{});
    std::fill(across.begin(), across.end(), std::array<std::size_t, 2>{});
    std::fill(sending.begin(), sending.end(), std::array<std::size_t, 2>{});
    std::fill(receiving.begin(), receiving.end(), std::array<std::size_t, 2>{});
    for (std::size_t q = 0; q + d < m; ++q) {
      const std::size_t a = carrier(q), b = carrier(q + d);
      if (have[q]) {
        if (!cut[q]) {
          ++sending[a][0];
          if (!final_round(q + d) && !prefix_cut[q]) ++sending[a][1];
        }
        out_cut[q] = cut[q] || prefix_cut[q];
      } else {
        out_cut[q] = cut[q];
      }
      if (a == b) continue;
      const std::size_t kind = node > 0 && a / node == b / node ? 2 : 0;
      ++count[a][kind];
      ++count[b][kind + 1];
      if (leaf > 0 && a / leaf != b / leaf) {
        ++across[a / leaf][0];
        ++across[b / leaf][1];
      }
    }
    for (std::size_t q = d; q < m; ++q) {
      const bool src_cut = out_cut[q - d];
      if (!have[q]) {
        have[q] = 1;
        prefix_cut[q] = src_cut;
      } else if (!prefix_cut[q]) {
        ++receiving[carrier(q)][0];
        if (!final_round(q) && !src_cut) ++receiving[carrier(q)][1];
        prefix_cut[q] = src_cut;
      }
    }
    std::size_t most_net = 0, most_group = 0, most_across = 0;
    for (const auto& c : count) {
      most_net = std::max({most_net, c[0], c[1]});
      most_group = std::max({most_group, c[2], c[3]});
    }
    for (const auto& c : across) most_across = std::max({most_across, c[0], c[1]});
    const double bytes = dbl(k + 1 < rounds ? packed_bytes(s) : state_bytes(s));
    if (most_net > 0) {
      add_messages(t, false, 1, dbl(most_net) * bytes);
      // The busiest leaf's uplinks, when they take longer than the busiest
      // port: its messages at leaf/o ports' bandwidth (one part per rank:
      // the round's d senders per leaf, all of them from d = leaf on).
      const double uplinks = dbl(most_across) * s.leaf_oversubscription / dbl(leaf > 0 ? leaf : 1);
      if (uplinks > dbl(most_net)) t.contention_bytes += (uplinks - dbl(most_net)) * bytes;
    } else if (most_group > 0) {
      add_messages(t, true, 1, dbl(most_group) * bytes);
    }
    // The round's compute on the critical path: a carrier composes its
    // positions' aggregates before it sends them and their prefixes after
    // it receives, so a message waits for its sender's compositions and its
    // receiver's wait for it: the costliest message's sender's and
    // receiver's together (one part per rank: two compositions a round, a
    // fold on each side in the last).
    std::array<std::size_t, 2> path{};
    auto weight = [&](const std::array<std::size_t, 2>& c) {
      return dbl(c[0]) * fold_weight + dbl(c[1]) * product_weight;
    };
    for (std::size_t q = 0; q + d < m; ++q) {
      const auto& a = sending[carrier(q)];
      const auto& b = receiving[carrier(q + d)];
      const std::array<std::size_t, 2> both{a[0] + b[0], a[1] + b[1]};
      if (weight(both) > weight(path)) path = both;
    }
    t.folds += dbl(path[0]);
    t.products += dbl(path[1]);
    for (const auto* side : {&sending, &receiving})
      for (const auto& c : *side) {
        t.work_folds += dbl(c[0]);
        t.work_products += dbl(c[1]);
      }
  }
}

}  // namespace

// cost_terms.hpp
void add_layout_runs(CostTerms& t, const ProblemShape& s, std::size_t w) {
  const Runs runs(LayoutIndex(owners_of(s).list(), s.ranks), w);
  add_run_scan(t, s, runs, w);
  add_run_folds(t, s, runs);
}

// cost_terms.hpp
void add_run_work(CostTerms& t, const ProblemShape& s, std::size_t w, bool chain_relay) {
  const LayoutIndex layout(owners_of(s).list(), s.ranks);
  const Runs runs(layout, w);
  constexpr std::size_t kNone = static_cast<std::size_t>(-1);
  std::vector<std::size_t> reach(s.ranks, kNone);  // per rank: the steps to its last part in the run
  std::vector<std::size_t> folding;                // the ranks with a part in the run
  for (std::size_t r = 0; r < runs.size(); ++r) {
    const std::size_t len = runs.last[r] - runs.first[r] + 1;
    if (!chain_relay && w == 1 && len == 1) continue;
    if (!chain_relay && len > 1) {
      t.work_folds += dbl(len - 1);
      t.work_products += dbl(len - 1);
    }
    folding.clear();
    for (std::size_t j = runs.first[r]; j <= runs.last[r]; ++j) {
      const std::size_t owner = layout.owner[j];
      if (reach[owner] == kNone) folding.push_back(owner);
      reach[owner] = j - runs.first[r];
    }
    if (chain_relay && r + 1 < runs.size()) {
      const std::size_t carrier = runs.block[r] * w + w - 1;
      if (reach[carrier] == kNone) folding.push_back(carrier);
      reach[carrier] = len;
    }
    for (std::size_t owner : folding) {
      const std::size_t steps = reach[owner];
      t.work_folds += dbl(r > 0 ? steps : (steps > 0 ? steps - 1 : 0));
      reach[owner] = kNone;
    }
  }
}

}  // namespace kdacp::detail
