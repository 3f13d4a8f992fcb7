#include "exchange/layouts.hpp"

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

void fold_slots(const PackedSlots& gathered, std::span<const std::size_t> order, std::size_t steps,
                Direction direction, const StateView* in, const StateView& out,
                const ExecPolicy& exec) {
  const Slots slots = gathered.slots();
  std::size_t start = 0;
  const StateView* from = in;
  for (std::size_t t = steps; t > 0; --t)
    if (gathered.cut(order[t - 1])) {
      start = t - 1;
      from = nullptr;  // the cut's offset is the state after it, exactly
      break;
    }
  if (start == steps) {
    if (in) {
      copy_view(*in, out);
    } else {
      std::memset(out.data, 0, bytes_of(out).size());
    }
    return;
  }
  // Ping-pong between two temporaries; the last step writes `out`.
  State temp[2];
  StateView cur;
  for (std::size_t t = start; t < steps; ++t) {
    StateView dst = out;
    if (t + 1 < steps) {
      State& tmp = temp[t % 2];
      if (tmp.size() == 0)
        tmp = State(out.batch, out.heads, out.rows, out.cols, out.dtype, Buffer::Init::uninitialized);
      dst = tmp.view();
    }
    const std::size_t s = order[t];
    scan(single_slot(slots.offsets.slot(s), slots.transfers.slot(s)), 0, 1, direction, from, dst,
         std::nullopt, nullptr, exec);
    cur = dst;
    from = &cur;
  }
}

void run_pair(const PackedSlots& gathered, std::span<const std::size_t> ascending_slots,
              Direction direction, const PairBuffer& pair, const ExecPolicy& exec) {
  std::vector<std::size_t> order(ascending_slots.begin(), ascending_slots.end());
  if (direction == Direction::backward) std::reverse(order.begin(), order.end());
  bool cut = false;
  for (std::size_t s : order) cut = cut || gathered.cut(s);
  pair.set_cut(cut);
  fold_slots(gathered, order, order.size(), direction, nullptr, pair.offset(), exec);
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

std::vector<State> run_layout_in_runs(const RunsCall& c) {
  const LayoutIndex& layout = *c.layout;
  const std::size_t w = c.width, k = layout.per_rank, n = layout.size();
  const Direction dir = c.direction;
  const ExecPolicy& exec = *c.exec;
  const Runs runs(layout, w);
  const std::size_t block = c.rank / w, local = c.rank % w;
  auto slot_of = [&](std::size_t j) { return (layout.owner[j] % w) * k + layout.local[j]; };
  auto slots_of = [&](const std::vector<std::size_t>& positions) {
    std::vector<std::size_t> out;
    for (std::size_t j : positions) out.push_back(slot_of(j));
    return out;
  };
  const std::vector<std::size_t> block_runs = runs.of_block(block, dir);
  // The scan at width 1 needs no slots for a run of one position (its pair
  // is the part itself) and hands each run's incoming state straight to its
  // parts: one part per rank is then recursive doubling over the ranks,
  // nothing packed, nothing copied.
  const bool direct = w == 1 && c.relay == RunRelay::doubling;
  bool need_slots = !direct;
  for (std::size_t run : block_runs) need_slots = need_slots || runs.first[run] != runs.last[run];
  PackedSlots gathered(c.shape, need_slots ? w * k : 0);
  if (need_slots)
    for (std::size_t i = 0; i < c.parts.size(); ++i)
      gathered.pack(local * k + i, c.parts[i].offset, c.parts[i].transfer, c.parts[i].flags.cut);
  if (c.intra) c.intra->all_gather(gathered.bytes());

  // The block's runs that have an incoming state, in the direction's order;
  // their states are one stack, broadcast in one message (direct: the
  // scan's own states, one per run in ascending chain order).
  std::vector<std::size_t> slice_of(runs.size(), 0);
  std::size_t fed = 0;
  for (std::size_t run : block_runs)
    if (runs.prev(run, dir)) slice_of[run] = fed++;
  std::vector<State> scanned;
  std::vector<std::size_t> scanned_of(runs.size(), 0);
  State incoming;
  if (fed > 0 && !direct)
    incoming = State(fed * c.shape.batch, c.shape.heads, c.shape.key_dim, c.shape.value_dim,
                     c.shape.dtype, Buffer::Init::uninitialized);  // received or scanned whole
  auto has_cut = [&](std::size_t run) {
    for (std::size_t j = runs.first[run]; j <= runs.last[run]; ++j)
      if (gathered.cut(slot_of(j))) return true;
    return false;
  };
  if (local + 1 == w && c.relay == RunRelay::doubling) {
    // Each of the block's runs as one pair, in ascending chain order.
    std::vector<std::size_t> ascending = runs.of_block(block, Direction::forward);
    std::vector<PairBuffer> aggregates;
    std::vector<PairView> pairs;
    const Slots slots = gathered.slots();
    for (std::size_t run : ascending) {
      if (direct && runs.first[run] == runs.last[run]) {
        const PartSummary& part = c.parts[layout.local[runs.first[run]]];
        pairs.push_back({part.offset, part.transfer, part.flags.cut});
        continue;
      }
      const std::vector<std::size_t> s = slots_of(runs.positions(run, Direction::forward));
      if (s.size() == 1) {
        pairs.push_back({slots.offsets.slot(s[0]), slots.transfers.slot(s[0]), gathered.cut(s[0])});
      } else {
        aggregates.emplace_back(c.shape);
        run_pair(gathered, s, dir, aggregates.back(), exec);
        pairs.push_back(aggregates.back().view());
      }
    }
    std::vector<State> states = rd_exclusive_scan_parts(*c.cross, runs.block, pairs, c.shape, dir, exec);
    if (direct) {
      scanned = std::move(states);
      for (std::size_t i = 0; i < ascending.size(); ++i) scanned_of[ascending[i]] = i;
    } else {
      for (std::size_t i = 0; i < ascending.size(); ++i)
        if (runs.prev(ascending[i], dir))
          copy_view(states[i].view(), state_slice(incoming, c.shape, slice_of[ascending[i]]));
    }
  } else if (local + 1 == w && c.relay == RunRelay::chain) {
    auto carrier = [&](std::size_t run) { return runs.block[run] * w + w - 1; };
    auto tag = [&](std::size_t run) { return part_tag(runs.positions(run, dir).front(), dir); };
    std::vector<std::unique_ptr<Request>> recvs(runs.size()), sends;
    std::vector<State> sent;
    for (std::size_t run : block_runs)
      if (auto prev = runs.prev(run, dir))
        recvs[run] = c.cross->irecv(state_slice_bytes(incoming, c.shape, slice_of[run]), carrier(*prev),
                                    tag(run));
    auto send_on = [&](std::size_t run, const StateView* in) {
      const std::size_t next = *runs.next(run, dir);
      const std::vector<std::size_t> order = slots_of(runs.positions(run, dir));
      State out = make_state(c.shape, Buffer::Init::uninitialized);  // the fold writes it all
      fold_slots(gathered, order, order.size(), dir, in, out.view(), exec);
      sends.push_back(c.cross->isend(bytes_of(out), carrier(next), tag(next)));
      sent.push_back(std::move(out));
    };
    // After a run's last cut its outgoing state does not depend on the
    // incoming one: those runs send before anything arrives.
    for (std::size_t run : block_runs)
      if (runs.next(run, dir) && has_cut(run)) send_on(run, nullptr);
    for (std::size_t run : block_runs) {
      if (!runs.next(run, dir) || has_cut(run)) continue;
      if (recvs[run]) {
        recvs[run]->wait();
        const StateView in = state_slice(incoming, c.shape, slice_of[run]);
        send_on(run, &in);
      } else {
        send_on(run, nullptr);
      }
    }
    for (auto& r : recvs)
      if (r) r->wait();
    for (auto& s : sends) s->wait();
  }
  if (c.intra && fed > 0) c.intra->broadcast(bytes_of(incoming), w - 1);

  std::vector<State> result;
  for (std::size_t j = 0; j < n; ++j) {
    if (layout.owner[j] != c.rank) continue;
    const std::size_t run = runs.run_of[j];
    const std::vector<std::size_t> positions = runs.positions(run, dir);
    const std::size_t steps = static_cast<std::size_t>(
        std::find(positions.begin(), positions.end(), j) - positions.begin());
    StateView in;
    if (direct) {
      // A run of one position: its incoming state is the part's result (the
      // scan's zeros for the chain's first).
      if (positions.size() == 1) {
        result.push_back(std::move(scanned[scanned_of[run]]));
        continue;
      }
      in = scanned[scanned_of[run]].view();
    } else if (runs.prev(run, dir)) {
      in = state_slice(incoming, c.shape, slice_of[run]);
    }
    State out = make_state(c.shape, Buffer::Init::uninitialized);  // the fold writes it all
    fold_slots(gathered, slots_of(positions), steps, dir, runs.prev(run, dir) ? &in : nullptr,
               out.view(), exec);
    result.push_back(std::move(out));
  }
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
