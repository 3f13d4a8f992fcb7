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
  State run(const Call& c) override {
    PackedSlots gathered(c.shape, size_);
    gathered.pack(rank_, c.offset, c.transfer, c.cut);
    comm_->all_gather(gathered.bytes());
    State result = make_state(c.shape);
    const Slots slots = gathered.slots();
    const bool fwd = c.direction == Direction::forward;
    // Fold only from the nearest cut on the way (forward: the last one
    // before this rank, backward: the first one after it): its offset is the
    // state there exactly.
    const std::optional<std::size_t> cut =
        fwd ? gathered.last_cut(0, rank_) : gathered.first_cut(rank_ + 1, size_);
    if (!cut) {
      merge(slots, rank_, c.direction, result.view(), options().exec, FoldFlags::consume_offsets);
    } else {
      // From the zero state, the scan's first step is the cut's offset itself.
      const std::size_t steps = fwd ? rank_ - *cut : *cut - rank_;
      scan(slots, *cut, steps, c.direction, nullptr, result.view(), std::nullopt, nullptr,
           options().exec, FoldFlags::consume_offsets);
    }
    return result;
  }

  // Each rank gathers its parts as k slots (k: the most parts a rank
  // holds), one collective for all; every part then folds the chain over
  // parts from the nearest cut, one step at a time in chain order.
  std::vector<State> run_parts(const PartsCall& c) override {
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
    std::vector<State> result;
    for (std::size_t j : own_parts()) {
      // The nearest cut on the way, or the chain's first part.
      std::size_t start = j;
      while (auto prev = chain_prev(start, n, dir)) {
        start = *prev;
        if (gathered.cut(slot_of[start])) break;
      }
      State cur = make_state(c.shape);  // the chain's first part receives the zero state
      bool have = false;
      for (std::size_t t = start; t != j; t = *chain_next(t, n, dir)) {
        const std::size_t slot = slot_of[t];
        State next = make_state(c.shape, Buffer::Init::uninitialized);  // the step writes it all
        const StateView in = cur.view();
        // From no incoming state the step is the slot's offset itself, exactly.
        scan(single_slot(slots.offsets.slot(slot), slots.transfers.slot(slot)), 0, 1, dir,
             have ? &in : nullptr, next.view(), std::nullopt, nullptr, options().exec);
        cur = std::move(next);
        have = true;
      }
      result.push_back(std::move(cur));
    }
    return result;
  }
};

CostTerms allgather_cost(const ProblemShape& s, const ProtocolConfig&) {
  CostTerms t;
  // The gather crosses the network: its terms count as network terms.
  if (s.ranks > 1) {
    t.messages = dbl(ceil_log2(s.ranks));
    t.bytes = dbl(s.ranks - 1) * dbl(packed_bytes(s));
  }
  // The last rank folds P-1 slots (the first a copy); rank r folds r-1.
  t.folds = chain_folds(s.ranks);
  t.work_folds = s.ranks >= 3 ? dbl(s.ranks - 1) * dbl(s.ranks - 2) / 2 : 0;
  t.peak_extra_bytes = s.ranks * packed_bytes(s);
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
