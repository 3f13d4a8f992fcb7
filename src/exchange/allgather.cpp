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
  // The one run: one part per rank takes the chain-of-ranks algorithm
  // (run_one), several parts per rank or parts out of rank order the
  // layout's (run_layout); both give the chain-with-cuts bits.
  std::vector<State> run(const Call& c) override {
    if (part_owners().is_one_per_rank()) return only(run_one(one_part(c)));
    return run_layout(c);
  }

  State run_one(const OnePart& c) {
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
  // parts from the nearest cut (or the rank's previous part), one step at a
  // time in chain order.
  std::vector<State> run_layout(const Call& c) {
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
    // each step once.
    std::optional<std::size_t> last;
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
      State cur = make_state(c.shape);  // the chain's first part receives the zero state
      StateView from;
      const StateView* in = nullptr;
      if (from_last) {
        from = result[*last].view();
        in = &from;
      }
      for (std::size_t u = start; u != j; u = *chain_next(u, n, dir)) {
        const std::size_t slot = slot_of[u];
        State next = make_state(c.shape, Buffer::Init::uninitialized);  // the step writes it all
        // From no incoming state the step is the slot's offset itself, exactly.
        scan(single_slot(slots.offsets.slot(slot), slots.transfers.slot(slot)), 0, 1, dir, in,
             next.view(), std::nullopt, nullptr, options().exec);
        cur = std::move(next);
        from = cur.view();
        in = &from;
      }
      result[i] = std::move(cur);
      last = i;
    }
    return result;
  }
};

CostTerms allgather_cost(const ProblemShape& s, const ProtocolConfig&) {
  CostTerms t;
  const ChainProfile chain = chain_profile(s, 1);
  // The gather crosses the network: its terms count as network terms. With
  // a layout every rank contributes k slots to the one collective.
  if (s.ranks > 1) {
    t.messages = dbl(ceil_log2(s.ranks));
    t.bytes = dbl(s.ranks - 1) * dbl(chain.per_rank) * dbl(packed_bytes(s));
  }
  // Folds start at the last cut before a part: the longest stretch between
  // cuts (the first step a copy). Without cuts rank r folds r-1.
  t.folds = stretch_folds(chain.steps);
  t.work_folds = chain.parts >= 3 ? dbl(chain.parts - 1) * dbl(chain.parts - 2) / 2 : 0;
  t.peak_extra_bytes = s.ranks * chain.per_rank * packed_bytes(s);
  // A layout folds step by step through two temporaries.
  if (has_layout(s)) t.peak_extra_bytes += 2 * state_bytes(s);
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
