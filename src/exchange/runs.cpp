#include "exchange/runs.hpp"

#include <algorithm>
#include <cstring>
#include <utility>

namespace kdacp::detail {

LayoutIndex::LayoutIndex(std::span<const std::size_t> owners, std::size_t ranks)
    : owner(owners.begin(), owners.end()), local(owners.size()) {
  std::vector<std::size_t> held(ranks, 0);
  for (std::size_t j = 0; j < owner.size(); ++j) local[j] = held[owner[j]]++;
  per_rank = std::max<std::size_t>(1, *std::max_element(held.begin(), held.end()));
}

Runs::Runs(const LayoutIndex& layout, std::size_t width) : run_of(layout.size()) {
  for (std::size_t j = 0; j < layout.size(); ++j) {
    const std::size_t b = layout.owner[j] / width;
    if (j == 0 || block.back() != b) {
      first.push_back(j);
      last.push_back(j);
      block.push_back(b);
    }
    last.back() = j;
    run_of[j] = first.size() - 1;
  }
}

std::optional<std::size_t> Runs::prev(std::size_t run, Direction d) const {
  return chain_prev(run, size(), d);
}

std::optional<std::size_t> Runs::next(std::size_t run, Direction d) const {
  return chain_next(run, size(), d);
}

std::vector<std::size_t> Runs::positions(std::size_t run, Direction d) const {
  std::vector<std::size_t> out;
  for (std::size_t j = first[run]; j <= last[run]; ++j) out.push_back(j);
  if (d == Direction::backward) std::reverse(out.begin(), out.end());
  return out;
}

std::vector<std::size_t> Runs::of_block(std::size_t b, Direction d) const {
  std::vector<std::size_t> out;
  for (std::size_t run = 0; run < size(); ++run)
    if (block[run] == b) out.push_back(run);
  if (d == Direction::backward) std::reverse(out.begin(), out.end());
  return out;
}

std::optional<std::size_t> last_cut_in(const PackedSlots& gathered, std::span<const std::size_t> order) {
  for (std::size_t t = order.size(); t > 0; --t)
    if (gathered.cut(order[t - 1])) return t - 1;
  return std::nullopt;
}

void fold_run(const PackedSlots& gathered, std::span<const std::size_t> order,
              std::span<const FoldTarget> targets, Direction direction, const StateView* in,
              const ExecPolicy& exec, FoldFlags flags) {
  const Slots slots = gathered.slots();
  const bool consume = flags == FoldFlags::consume_offsets;
  const bool fwd = direction == Direction::forward;
  StateView held;                // the state after `done` steps, when `from` points to it
  const StateView* from = in;    // nullptr: the zero state
  std::size_t done = 0;
  State temp;                    // without consuming: the other half of a ping-pong with the target
  std::vector<std::pair<std::size_t, std::size_t>> stretches;  // first index in order, steps
  for (const FoldTarget& target : targets) {
    // From the last cut among the target's slots not yet folded, whose
    // offset is the state after it exactly.
    std::size_t start = done;
    for (std::size_t u = target.steps; u > done; --u)
      if (gathered.cut(order[u - 1])) {
        start = u - 1;
        from = nullptr;
        break;
      }
    stretches.clear();
    for (std::size_t t = start; t < target.steps; ++t) {
      if (!stretches.empty() && (fwd ? order[t] == order[t - 1] + 1 : order[t] + 1 == order[t - 1]))
        ++stretches.back().second;
      else
        stretches.emplace_back(t, 1);
    }
    // From no state a first stretch of one slot is that slot's offset itself.
    std::size_t q = 0;
    if (!from && stretches.size() >= 2 && stretches[0].second == 1) {
      held = slots.offsets.slot(order[stretches[0].first]);
      from = &held;
      q = 1;
    }
    if (!consume && stretches.size() - q >= 2 && temp.size() == 0)
      temp = State(target.out.batch, target.out.heads, target.out.rows, target.out.cols, target.out.dtype,
                   Buffer::Init::uninitialized);  // a scan writes it all
    for (; q < stretches.size(); ++q) {
      const auto [first, steps] = stretches[q];
      const std::size_t last_slot = order[first + steps - 1];
      // The last stretch lands in the target; consuming, an earlier one in
      // its last slot's offset (a step may write its own offset), else it
      // alternates with the target so that the last lands there.
      StateView dst = target.out;
      if (q + 1 < stretches.size())
        dst = consume ? slots.offsets.slot(last_slot)
                      : (stretches.size() - 1 - q) % 2 == 0 ? target.out : temp.view();
      scan(slots, order[first], steps, direction, from, dst, std::nullopt, nullptr, exec, flags);
      held = dst;
      from = &held;
    }
    if (stretches.empty()) {
      // No step: the state so far.
      scan(slots, 0, 0, direction, from, target.out, std::nullopt, nullptr, exec, flags);
    }
    held = target.out;
    from = &held;
    done = target.steps;
  }
}

void run_pair(const PackedSlots& gathered, std::span<const std::size_t> ascending_slots,
              Direction direction, const PairBuffer& pair, const ExecPolicy& exec) {
  std::vector<std::size_t> order(ascending_slots.begin(), ascending_slots.end());
  if (direction == Direction::backward) std::reverse(order.begin(), order.end());
  bool cut = false;
  for (std::size_t s : order) cut = cut || gathered.cut(s);
  pair.set_cut(cut);
  const FoldTarget whole{order.size(), pair.offset()};
  fold_run(gathered, order, std::span(&whole, 1), direction, nullptr, exec, FoldFlags::none);
  if (cut) return;
  const Slots slots = gathered.slots();
  const std::size_t n = ascending_slots.size();
  if (n == 1) {
    copy_view(slots.transfers.slot(ascending_slots[0]), pair.transfer());
    return;
  }
  const StateView t = pair.transfer();
  State tmp(t.batch, t.heads, t.rows, t.cols, t.dtype, Buffer::Init::uninitialized);
  StateView cur = slots.transfers.slot(ascending_slots[0]);
  for (std::size_t j = 1; j < n; ++j) {
    // Alternate so that the last product lands in the pair.
    const StateView dst = (n - 1 - j) % 2 == 0 ? t : tmp.view();
    apply_step(slots.transfers.slot(ascending_slots[j]), cur, nullptr, dst, false, exec);
    cur = dst;
  }
}

std::vector<State> rd_exclusive_scan_parts(Communicator& comm, std::span<const std::size_t> owner_of,
                                           std::span<const PairView> own, const SummaryShape& shape,
                                           Direction direction, const ExecPolicy& policy) {
  const std::size_t n = owner_of.size(), me = comm.rank();
  const bool fwd = direction == Direction::forward;
  // q: a position's place in the direction's order.
  auto chain_pos = [&](std::size_t q) { return fwd ? q : n - 1 - q; };
  auto holder = [&](std::size_t q) { return owner_of[chain_pos(q)]; };
  auto final_round = [](std::size_t q, std::size_t d) { return d <= q && q < 2 * d; };
  std::vector<std::size_t> mine;       // own positions, ascending q
  std::vector<std::size_t> index_of(n, 0);  // q -> index into own (ascending chain position)
  {
    std::size_t i = 0;
    for (std::size_t j = 0; j < n; ++j)
      if (owner_of[j] == me) index_of[j] = i++;
    for (std::size_t q = 0; q < n; ++q)
      if (holder(q) == me) mine.push_back(q);
  }
  const std::size_t m = mine.size();
  std::vector<PairBuffer> prefix(m), outgoing(m), incoming(m);
  std::vector<char> have(m, 0);
  // The composition's destination, swapped with a prefix after each compose,
  // allocated only when a position's outgoing pair cannot serve (below).
  PairBuffer tmp;
  bool have_tmp = false;
  for (std::size_t i = 0; i < m; ++i) {
    const std::size_t q = mine[i];
    if (q > 0) prefix[i] = PairBuffer(shape);
    if (q > 0) incoming[i] = PairBuffer(shape);
    if (q + 1 < n) outgoing[i] = PairBuffer(shape);
  }
  auto own_of = [&](std::size_t i) -> const PairView& { return own[index_of[chain_pos(mine[i])]]; };
  // mine is ascending in q, so the local index of position q is found by search.
  auto local_index = [&](std::size_t q) {
    return static_cast<std::size_t>(std::lower_bound(mine.begin(), mine.end(), q) - mine.begin());
  };
  for (std::size_t d = 1; d < n; d *= 2) {
    std::vector<std::unique_ptr<Request>> recvs(m), sends(m);
    for (std::size_t i = 0; i < m; ++i) {
      const std::size_t q = mine[i];
      if (q >= d && holder(q - d) != me) {
        recvs[i] = comm.irecv(incoming[i].bytes(!final_round(q, d)), holder(q - d),
                              part_tag(chain_pos(q), direction));
      }
    }
    for (std::size_t i = 0; i < m; ++i) {
      const std::size_t q = mine[i];
      if (q + d >= n) continue;
      const bool send_pair = !final_round(q + d, d);
      const PairView& o = own_of(i);
      if (!have[i]) {
        copy_view(o.offset, outgoing[i].offset());
        if (send_pair && !o.cut) copy_view(o.transfer, outgoing[i].transfer());
        outgoing[i].set_cut(o.cut);
      } else {
        compose(o, prefix[i].view(), outgoing[i], send_pair, direction, policy);
      }
      if (holder(q + d) != me)
        sends[i] = comm.isend(outgoing[i].bytes(send_pair), holder(q + d),
                              part_tag(chain_pos(q + d), direction));
    }
    for (std::size_t i = 0; i < m; ++i) {
      const std::size_t q = mine[i];
      if (q < d) continue;
      const bool recv_pair = !final_round(q, d);
      const PairBuffer* src = &incoming[i];
      if (recvs[i]) {
        recvs[i]->wait();
      } else {
        src = &outgoing[local_index(q - d)];
      }
      if (!have[i]) {
        const auto from = src->bytes(recv_pair);
        std::memcpy(prefix[i].bytes(recv_pair).data(), from.data(), from.size());
        have[i] = 1;
      } else if (!recv_pair) {
        // prefix∘src, offset only, in place; a cut prefix does not depend on
        // what came before it.
        if (!prefix[i].cut()) {
          const StateView po = prefix[i].offset();
          apply_step(prefix[i].transfer(), src->offset(), &po, po, !fwd, policy);
          prefix[i].set_cut(src->cut());
        }
      } else {
        // The composed pair goes to the position's outgoing pair once its
        // send is done, unless an own position reads that pair later this
        // round or there is none (the last position).
        const bool outgoing_free = q + 1 < n && !(q + d < n && holder(q + d) == me);
        if (!outgoing_free && !have_tmp) tmp = PairBuffer(shape), have_tmp = true;
        PairBuffer& dest = outgoing_free ? outgoing[i] : tmp;
        if (outgoing_free && sends[i]) sends[i]->wait(), sends[i].reset();
        compose(prefix[i].view(), src->view(), dest, true, direction, policy);
        std::swap(prefix[i], dest);
      }
    }
    for (auto& s : sends)
      if (s) s->wait();
  }
  std::vector<State> result(m);
  for (std::size_t i = 0; i < m; ++i) {
    State r = make_state(shape);
    if (have[i]) copy_view(prefix[i].offset(), r.view());
    result[index_of[chain_pos(mine[i])]] = std::move(r);
  }
  return result;
}

RunLayout::RunLayout(std::span<const std::size_t> owners, std::size_t ranks, std::size_t width)
    : index(owners, ranks), width(width), runs(index, width) {}

namespace {

// What run_layout_in_runs folds in one of its block's runs: its parts' results
// and, as the chain's carrier, the run's outgoing state, all in one pass over
// the run's slots. The targets past the run's last cut do not depend on its
// incoming state; the others do. A target's state is allocated when its pass
// runs, so that the results are not held beside the scan.
constexpr std::size_t kSent = static_cast<std::size_t>(-1);
struct RunFold {
  std::size_t run = 0;
  std::vector<std::size_t> order;  // the run's slots in the direction's order
  std::vector<std::pair<std::size_t, std::size_t>> wanted;  // steps, part index (kSent: the outgoing state)
  std::size_t independent = 0;     // wanted[independent..] lie past the last cut
  bool has_cut = false;
  bool sends = false;              // the chain carrier sends the run's outgoing state on
  State sent;
};

// The gathered slot of part j: its owner's place in the block, then its own.
std::size_t slot_of(const RunLayout& l, std::size_t j) {
  return (l.index.owner[j] % l.width) * l.index.per_rank + l.index.local[j];
}

// The folds of `block_runs` (the direction's order) this rank runs: a direct
// run of one position needs none, nor a run with nothing of this rank's in it
// that it does not send on (`chain_carrier`: it sends every run that has a
// next one).
std::vector<RunFold> plan_run_folds(const RunsCall& c, const std::vector<std::size_t>& block_runs,
                                    const PackedSlots& gathered, bool direct, bool chain_carrier) {
  const LayoutIndex& layout = c.layout->index;
  const Runs& runs = c.layout->runs;
  std::vector<RunFold> folds;
  folds.reserve(block_runs.size());
  for (std::size_t run : block_runs) {
    if (direct && runs.first[run] == runs.last[run]) continue;
    RunFold f;
    f.run = run;
    f.sends = chain_carrier && runs.next(run, c.direction);
    const std::vector<std::size_t> positions = runs.positions(run, c.direction);
    for (std::size_t t = 0; t < positions.size(); ++t) {
      const std::size_t j = positions[t];
      f.order.push_back(slot_of(*c.layout, j));
      if (layout.owner[j] == c.rank) f.wanted.emplace_back(t, layout.local[j]);
    }
    if (f.sends) f.wanted.emplace_back(positions.size(), kSent);
    if (f.wanted.empty()) continue;
    const auto cut = last_cut_in(gathered, f.order);
    f.has_cut = cut.has_value();
    f.independent = f.wanted.size();
    if (cut)
      while (f.independent > 0 && f.wanted[f.independent - 1].first > *cut) --f.independent;
    folds.push_back(std::move(f));
  }
  return folds;
}

// The doubling carrier's scan: each of its block's runs (`ascending`, in
// chain order) as one pair, scanned over the carriers. Returns each run's
// incoming state, in the same order.
std::vector<State> scan_block_runs(const RunsCall& c, const std::vector<std::size_t>& ascending,
                                   const PackedSlots& gathered, bool direct) {
  const Runs& runs = c.layout->runs;
  std::vector<PairBuffer> aggregates;
  aggregates.reserve(ascending.size());
  std::vector<PairView> pairs;
  const Slots slots = gathered.slots();
  for (std::size_t run : ascending) {
    if (direct && runs.first[run] == runs.last[run]) {
      const PartSummary& part = c.parts[c.layout->index.local[runs.first[run]]];
      pairs.push_back({part.offset, part.transfer, part.flags.cut});
      continue;
    }
    std::vector<std::size_t> s;
    for (std::size_t j = runs.first[run]; j <= runs.last[run]; ++j) s.push_back(slot_of(*c.layout, j));
    if (s.size() == 1) {
      pairs.push_back({slots.offsets.slot(s[0]), slots.transfers.slot(s[0]), gathered.cut(s[0])});
    } else {
      aggregates.emplace_back(c.shape);
      run_pair(gathered, s, c.direction, aggregates.back(), *c.exec);
      pairs.push_back(aggregates.back().view());
    }
  }
  return rd_exclusive_scan_parts(*c.cross, runs.block, pairs, c.shape, c.direction, *c.exec);
}

}  // namespace

std::vector<State> run_layout_in_runs(const RunsCall& c) {
  const LayoutIndex& layout = c.layout->index;
  const Runs& runs = c.layout->runs;
  const std::size_t w = c.layout->width;
  const Direction dir = c.direction;
  const ExecPolicy& exec = *c.exec;
  constexpr auto kConsume = FoldFlags::consume_offsets;
  const std::size_t block = c.rank / w, local = c.rank % w;
  const bool carrier = local + 1 == w;
  const bool chain = c.relay == RunRelay::chain;
  // The chain position a run starts at in the direction's order.
  auto entry = [&](std::size_t run) { return dir == Direction::forward ? runs.first[run] : runs.last[run]; };
  const std::vector<std::size_t> block_runs = runs.of_block(block, dir);
  // The scan at width 1 needs no slots for a run of one position (its pair
  // is the part itself) and hands each run's incoming state straight to its
  // parts: one part per rank is then recursive doubling over the ranks,
  // nothing packed, nothing copied.
  const bool direct = w == 1 && !chain;
  bool need_slots = !direct;
  for (std::size_t run : block_runs) need_slots = need_slots || runs.first[run] != runs.last[run];

  // This rank's parts' results in chain order (a direct run of one
  // position returns the scan's own state).
  std::vector<State> result(c.parts.size());

  // The block's runs that have an incoming state, in the direction's order;
  // their states are one stack, broadcast in one message (direct: the
  // scan's own states, one per run in ascending chain order). The chain's
  // carrier receives into it, the doubling carrier fills it from its scan.
  std::vector<std::size_t> slice_of(runs.size(), 0);
  std::size_t fed = 0;
  for (std::size_t run : block_runs)
    if (runs.prev(run, dir)) slice_of[run] = fed++;
  State incoming;
  auto make_stack = [&] {
    return State(fed * c.shape.batch, c.shape.heads, c.shape.key_dim, c.shape.value_dim, c.shape.dtype,
                 Buffer::Init::uninitialized);  // received, broadcast or scanned whole
  };
  if (fed > 0 && !direct && !(carrier && !chain)) incoming = make_stack();
  auto incoming_of = [&](std::size_t run) { return state_slice(incoming, c.shape, slice_of[run]); };

  // The chain's carrier posts its receives before the block's gather.
  auto carrier_of = [&](std::size_t run) { return runs.block[run] * w + w - 1; };
  std::vector<std::unique_ptr<Request>> recvs(runs.size()), sends;
  if (carrier && chain)
    for (std::size_t run : block_runs)
      if (auto prev = runs.prev(run, dir))
        recvs[run] = c.cross->irecv(state_slice_bytes(incoming, c.shape, slice_of[run]), carrier_of(*prev),
                                    part_tag(entry(run), dir));

  PackedSlots gathered(c.shape, need_slots ? w * layout.per_rank : 0);
  if (need_slots)
    for (std::size_t i = 0; i < c.parts.size(); ++i)
      gathered.pack(local * layout.per_rank + i, c.parts[i].offset, c.parts[i].transfer, c.parts[i].flags.cut);
  if (c.intra) c.intra->all_gather(gathered.bytes());

  std::vector<RunFold> folds = plan_run_folds(c, block_runs, gathered, direct, carrier && chain);
  std::vector<FoldTarget> targets;
  auto fold = [&](RunFold& f, std::size_t begin, std::size_t end, const StateView* in) {
    targets.clear();
    for (std::size_t i = begin; i < end; ++i) {
      const auto [steps, part] = f.wanted[i];
      State& out = part == kSent ? f.sent : result[part];
      out = make_state(c.shape, Buffer::Init::uninitialized);  // the fold writes it all
      targets.push_back({steps, out.view()});
    }
    fold_run(gathered, f.order, targets, dir, in, exec, kConsume);
  };
  auto fold_independent = [&](RunFold& f) { fold(f, f.independent, f.wanted.size(), nullptr); };
  auto fold_dependent = [&](RunFold& f, const StateView* in) { fold(f, 0, f.independent, in); };
  auto send_on = [&](RunFold& f) {
    const std::size_t next = *runs.next(f.run, dir);
    sends.push_back(c.cross->isend(bytes_of(f.sent), carrier_of(next), part_tag(entry(next), dir)));
  };

  std::vector<State> scanned;  // direct: each of the block's runs' incoming state
  std::vector<std::size_t> scanned_of(runs.size(), 0);
  std::vector<char> folded(folds.size(), 0);  // the runs the chain's carrier folded whole
  if (carrier && chain) {
    // After a run's last cut its outgoing state does not depend on the
    // incoming one: those runs send before anything arrives.
    for (RunFold& f : folds)
      if (f.sends && f.has_cut) {
        fold_independent(f);
        send_on(f);
      }
    for (std::size_t i = 0; i < folds.size(); ++i) {
      RunFold& f = folds[i];
      if (!f.sends || f.has_cut) continue;
      StateView in;
      if (recvs[f.run]) {
        recvs[f.run]->wait();
        in = incoming_of(f.run);
      }
      fold_dependent(f, recvs[f.run] ? &in : nullptr);
      folded[i] = 1;
      send_on(f);
    }
    for (auto& r : recvs)
      if (r) r->wait();
    // The chain first: the relay leaves before the carrier broadcasts to its
    // block, which would otherwise share the carrier's link with it (on one
    // Ethernet port each, grouped_allgather_p2p ran 2x the model at P = 64
    // on the simulated cluster of docs/scale.md).
    for (auto& s : sends) s->wait();
  } else if (carrier) {
    const std::vector<std::size_t> ascending = runs.of_block(block, Direction::forward);
    std::vector<State> states = scan_block_runs(c, ascending, gathered, direct);
    if (direct) {
      scanned = std::move(states);
      for (std::size_t i = 0; i < ascending.size(); ++i) scanned_of[ascending[i]] = i;
    } else if (fed == 1) {
      // One run fed: its scanned state is the stack.
      for (std::size_t i = 0; i < ascending.size(); ++i)
        if (runs.prev(ascending[i], dir)) incoming = std::move(states[i]);
    } else if (fed > 1) {
      incoming = make_stack();
      for (std::size_t i = 0; i < ascending.size(); ++i)
        if (runs.prev(ascending[i], dir)) copy_view(states[i].view(), incoming_of(ascending[i]));
    }
  }
  if (c.intra && fed > 0) c.intra->broadcast(bytes_of(incoming), w - 1);

  // The outgoing states are no longer needed once sent.
  for (auto& s : sends) s->wait();
  for (RunFold& f : folds) f.sent = State();
  for (std::size_t i = 0; i < folds.size(); ++i) {
    RunFold& f = folds[i];
    if (folded[i]) continue;
    if (!f.sends) fold_independent(f);  // the carrier's went with its send
    StateView in;
    const bool fed_run = runs.prev(f.run, dir).has_value();
    if (fed_run) in = direct ? scanned[scanned_of[f.run]].view() : incoming_of(f.run);
    fold_dependent(f, fed_run ? &in : nullptr);
  }
  if (direct)
    for (std::size_t run : block_runs)
      if (runs.first[run] == runs.last[run] && layout.owner[runs.first[run]] == c.rank)
        result[layout.local[runs.first[run]]] = std::move(scanned[scanned_of[run]]);
  return result;
}

StateView state_slice(const State& stack, const SummaryShape& shape, std::size_t index) {
  StateView v = StateView::dense(nullptr, shape.batch, shape.heads, shape.key_dim, shape.value_dim);
  v.dtype = shape.dtype;
  v.data = static_cast<char*>(stack.view().data) + index * shape.state_elems() * dtype_size(shape.dtype);
  return v;
}

std::span<std::byte> state_slice_bytes(const State& stack, const SummaryShape& shape,
                                       std::size_t index) {
  const std::size_t n = shape.state_elems() * dtype_size(shape.dtype);
  return bytes_of(stack).subspan(index * n, n);
}

}  // namespace kdacp::detail
