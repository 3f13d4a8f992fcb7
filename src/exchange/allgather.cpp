// allgather (SPEC §6): pack [S|M] (or [G|M]) and the cut flag, gather P slots
// in place, fold the exclusive prefix (or transposed suffix) in one fused pass
// per (b,h), from the nearest cut when there is one (SPEC §10).
// One collective; P packed slots per rank; the fold consumes the gathered
// offsets in place, so no scratch beyond the gather buffer.
#include <algorithm>

#include "exchange/common.hpp"
#include "exchange/cost_terms.hpp"

namespace kdacp::detail {
namespace {

class AllGatherExchange final : public CommExchange {
 public:
  explicit AllGatherExchange(const ProtocolContext& ctx) : CommExchange(ctx, allgather_protocol) {}

 private:
  // Each rank gathers its parts as k slots (k: the most parts a rank
  // holds), one collective for all; every part then folds the chain over
  // parts from the nearest cut (or the rank's previous part) in chain order.
  // A stretch of chain positions whose slots are consecutive in the gather
  // buffer folds in one fused pass per (b,h), consuming those slots' offsets
  // in place; other steps fold one at a time. One part per rank is the
  // chain-of-ranks merge: slot j is position j, so rank r folds slots 0..r-1
  // (or from the last cut before it) in one pass, with no scratch beyond
  // the gather buffer.
  std::vector<State> run(const Call& c) override {
    const Direction dir = c.direction;
    const std::size_t n = part_count();
    std::vector<std::size_t> held(size_, 0), local(n), slot_of(n);
    for (std::size_t j = 0; j < n; ++j) local[j] = held[owner(j)]++;
    const std::size_t k = *std::max_element(held.begin(), held.end());
    for (std::size_t j = 0; j < n; ++j) slot_of[j] = owner(j) * k + local[j];
    PackedSlots gathered(c.shape, size_ * k);
    for (std::size_t i = 0; i < c.parts.size(); ++i)
      gathered.pack(rank_ * k + i, c.parts[i].offset, c.parts[i].transfer, c.parts[i].flags.cut);
    comm_->all_gather(gathered.bytes());
    const Slots slots = gathered.slots();
    const std::vector<std::size_t>& own = own_parts();
    std::vector<State> result(own.size());
    // A rank's parts in the direction's order: a later part continues from
    // the state entering the earlier one when no cut lies between them (the
    // same steps from the same state, so the same bits), and the rank folds
    // each step once. The slots a part folds are those of positions [start, j)
    // in chain order, so no two of a rank's parts consume the same offsets.
    std::optional<std::size_t> last;
    State temp;  // the other half of a ping-pong with the result
    for (std::size_t t = 0; t < own.size(); ++t) {
      const std::size_t i = dir == Direction::forward ? t : own.size() - 1 - t;
      const std::size_t j = own[i];
      // The nearest cut on the way, the previous own part, or the chain's first part.
      std::size_t start = j;
      bool from_last = false;
      while (auto prev = chain_prev(start, n, dir)) {
        start = *prev;
        if (gathered.cut(slot_of[start])) break;
        if (last && start == own[*last]) {
          from_last = chain_prev(start, n, dir).has_value();
          break;
        }
      }
      // The positions start .. j (exclusive) as stretches of consecutive slots.
      std::vector<std::pair<std::size_t, std::size_t>> stretches;  // first slot, steps
      for (std::size_t u = start; u != j; u = *chain_next(u, n, dir)) {
        const std::size_t slot = slot_of[u];
        const bool continues = !stretches.empty() &&
                               (dir == Direction::forward
                                    ? slot == stretches.back().first + stretches.back().second
                                    : slot + stretches.back().second == stretches.back().first);
        if (continues)
          ++stretches.back().second;
        else
          stretches.emplace_back(slot, 1);
      }
      // The chain's first part receives the zero state.
      result[i] = make_state(c.shape, stretches.empty() ? Buffer::Init::zero : Buffer::Init::uninitialized);
      if (stretches.size() >= 2 && temp.size() == 0)
        temp = make_state(c.shape, Buffer::Init::uninitialized);  // a fold writes it all
      StateView from;
      const StateView* in = nullptr;
      if (from_last) {
        from = result[*last].view();
        in = &from;
      }
      for (std::size_t q = 0; q < stretches.size(); ++q) {
        // Alternate so that the last stretch lands in the result.
        const StateView dst = (stretches.size() - 1 - q) % 2 == 0 ? result[i].view() : temp.view();
        // From no incoming state the first step is the slot's offset itself, exactly.
        scan(slots, stretches[q].first, stretches[q].second, dir, in, dst, std::nullopt, nullptr,
             options().exec, FoldFlags::consume_offsets);
        from = dst;
        in = &from;
      }
      last = i;
    }
    return result;
  }
};

CostTerms allgather_cost(const ProblemShape& s, const ProtocolConfig&, StreamWaitsCache*) {
  CostTerms t;
  const ChainProfile chain = chain_profile(s, 1);
  // The gather crosses the network: its terms count as network terms. With
  // a layout every rank contributes k slots to the one collective, whose
  // members are still ranks: on nodes it splits like one part per rank's
  // (rank_node_width), each member's slot k packed pairs. Priced at network
  // speed for every member, the simulated zigzag gather at P = 256 on
  // nvlink-ib took 1.44x the model (docs/scale.md).
  if (s.ranks > 1) {
    if (const std::size_t node = rank_node_width(s)) {
      // On nodes: the slots of the node's ranks over it, the others across.
      add_group_all_gather(t, s.ranks, chain.per_rank * packed_bytes(s), node, &s);
    } else {
      // The gather's rounds and its agreement's (add_agreement), all across.
      t.messages = 2 * dbl(ceil_log2(s.ranks));
      t.bytes = dbl(s.ranks - 1) * dbl(chain.per_rank) * dbl(packed_bytes(s));
    }
  }
  // Folds start at the last cut before a part: the longest stretch between
  // cuts (the first step a copy). Without cuts rank r folds r-1.
  t.folds = stretch_folds(chain.steps);
  t.work_folds = chain.parts >= 3 ? dbl(chain.parts - 1) * dbl(chain.parts - 2) / 2 : 0;
  t.peak_extra_bytes = s.ranks * chain.per_rank * packed_bytes(s);
  // A fold over two or more stretches of consecutive slots alternates
  // between the result and one temporary (never for one part per rank:
  // slot j is position j).
  if (chain.split_folds) t.peak_extra_bytes += state_bytes(s);
  return t;
}

}  // namespace

const ProtocolDescriptor allgather_protocol{
    .name = "allgather",
    .kind = ProtocolClass::exact,
    .takes_layouts = true,
    .memory = "P packed slots",
    .use_when = "small P on fast links with memory to spare",
    .cost = allgather_cost,
    .build = [](const ProtocolContext& ctx) -> std::unique_ptr<StateExchange> {
      return std::make_unique<AllGatherExchange>(ctx);
    },
};

}  // namespace kdacp::detail
