// pipelined_p2p (exact): the chain with the V columns cut into c segments
// of whole 16-column units (the last unit V mod 16 wide when 16 does not
// divide V). M acts on every column alike and the step
// kernel computes each element independently of the column blocking
// (kernels.hpp), so each segment folds with exactly the chain's operations:
// bitwise identical to p2p. Rank r+1 folds segment j while rank r computes
// segment j+1, so the P-1 hops overlap: about (P + c - 2) stages of 1/c of a
// hop instead of P-1 whole hops.
//
// Messages are contiguous: the send and receive buffers are segment-major
// (segment j is a dense [B,H,K,w_j] block), the fold reads and writes those
// blocks directly, and only the received blocks are copied into the
// row-major result. Memory: two states per rank (receive and send buffers).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <queue>
#include <vector>

#include <fmt/format.h>

#include "exchange/affine_pairs.hpp"
#include "exchange/common.hpp"
#include "exchange/cost_terms.hpp"
#include "kdacp/error.hpp"

namespace kdacp::detail {
namespace {

class PipelinedExchange final : public CommExchange {
 public:
  explicit PipelinedExchange(const ProtocolContext& ctx) : CommExchange(ctx, pipelined_p2p_protocol) {}

 private:
  // Column ranges of the segments: ceil(V/16) units of 16 columns (the last
  // one V mod 16 wide when 16 does not divide V) dealt as evenly as
  // possible, the first segments one unit wider.
  std::vector<std::pair<std::size_t, std::size_t>> segments(const SummaryShape& shape) const {
    const std::size_t units = max_segments(shape.value_dim);
    std::size_t c = config().segments;
    if (c == 0) {
      // Priced as predict() prices it: this exchange's layout and the cuts
      // its calls are expected to carry (not this call's: each rank knows
      // only its own, and every rank must cut the columns alike).
      ProblemShape priced{size_, shape.slabs(), shape.key_dim, shape.value_dim, dtype_size(shape.dtype)};
      priced.part_owners = part_owners();
      priced.part_cuts = options().expected_cuts;
      c = best_segments(options().cost, priced, config().method);
    } else if (c > units) {
      throw InvalidArgument(fmt::format(
          "rank {}: segments is {} for value dim V = {}, expected at most ceil(V/16) = {} (segments are "
          "whole units of 16 columns, the last unit the remainder)",
          rank_, c, shape.value_dim, units));
    }
    std::vector<std::pair<std::size_t, std::size_t>> out;
    std::size_t col = 0;
    for (std::size_t j = 0; j < c; ++j) {
      const std::size_t width =
          std::min((units / c + (j < units % c ? 1 : 0)) * kSegmentColumns, shape.value_dim - col);
      out.emplace_back(col, width);
      col += width;
    }
    return out;
  }

  // Columns [col, col+width) of a [B,H,K,V] view.
  static StateView columns(StateView v, std::size_t col, std::size_t width) {
    v.data = static_cast<char*>(v.data) + col * dtype_size(v.dtype);
    v.cols = width;
    return v;
  }
  // Segment block of a segment-major buffer: dense [B,H,K,width].
  static StateView block(const State& buf, const SummaryShape& shape, std::size_t col,
                         std::size_t width) {
    StateView v = StateView::dense(buf.data(), shape.batch, shape.heads, shape.key_dim, width);
    v.dtype = shape.dtype;
    v.data = static_cast<char*>(buf.view().data) +
             shape.slabs() * shape.key_dim * col * dtype_size(shape.dtype);
    return v;
  }
  static std::span<std::byte> block_bytes(const StateView& b) {
    return {static_cast<std::byte*>(b.data), b.slabs() * b.rows * b.cols * dtype_size(b.dtype)};
  }

  // The chain over parts, segment by segment: each part receives its
  // segments from the rank holding the part before it (or finds them handed
  // on locally), folds and hands each on at once. A rank works through its
  // parts in chain order, so zigzag's second half pipelines like the first.
  // One part per rank is the chain over ranks: rank r receives each segment
  // from r-1, folds it into its send buffer and sends it to r+1 (the first
  // rank and a cut send their offset's columns); with one segment the
  // receive lands in the result itself, so c = 1 costs what p2p costs.
  std::vector<State> run(const Call& c) override {
    const SummaryShape& shape = c.shape;
    const Direction dir = c.direction;
    const auto segs = segments(shape);  // may throw: still before any message
    const bool single = segs.size() == 1;
    const std::size_t n = part_count();
    const std::vector<std::size_t>& own = own_parts();
    const std::size_t m = own.size();
    constexpr auto kWhole = Buffer::Init::uninitialized;
    auto index_of = [&](std::size_t j) {
      return static_cast<std::size_t>(std::lower_bound(own.begin(), own.end(), j) - own.begin());
    };
    // Each part's input, segment-major (with one segment: the result itself).
    std::vector<State> result(m), in_buf(m), out_buf(m);
    for (std::size_t i = 0; i < m; ++i) {
      const bool has_prev = chain_prev(own[i], n, dir).has_value();
      result[i] = make_state(shape, has_prev ? kWhole : Buffer::Init::zero);
      if (has_prev && !single) in_buf[i] = make_state(shape, kWhole);
    }
    auto input = [&](std::size_t i) -> const State& { return single ? result[i] : in_buf[i]; };
    std::vector<std::vector<std::unique_ptr<Request>>> recvs(m);
    for (std::size_t i = 0; i < m; ++i) {
      const auto prev = chain_prev(own[i], n, dir);
      if (prev && owner(*prev) != rank_)
        for (const auto& [col, width] : segs)
          recvs[i].push_back(comm_->irecv(block_bytes(block(input(i), shape, col, width)), owner(*prev),
                                          part_tag(own[i], dir)));
    }
    // Where part i's outgoing segments go: the next part's input when this
    // rank holds it, a send buffer otherwise.
    auto target = [&](std::size_t i) -> const State& {
      const std::size_t next = *chain_next(own[i], n, dir);
      if (owner(next) == rank_) return input(index_of(next));
      if (out_buf[i].size() == 0) out_buf[i] = make_state(shape, kWhole);
      return out_buf[i];
    };
    // A part's segments leave one after the other: each send waits for the
    // part's previous one. Posted together, segments that are ready at once
    // (the chain's first part, a cut) share the link and all arrive at the
    // end, so the next rank could not start before the whole state was there
    // and the pipeline fell back to store-and-forward (the simulated clusters
    // of docs/scale.md showed c = 2 no faster than c = 1).
    std::vector<std::unique_ptr<Request>> sends;
    std::vector<Request*> last_send(m, nullptr);
    auto hand_on = [&](std::size_t i, const StateView& out) {
      const std::size_t next = *chain_next(own[i], n, dir);
      if (owner(next) == rank_) return;
      if (last_send[i] != nullptr) last_send[i]->wait();
      sends.push_back(comm_->isend(block_bytes(out), owner(next), part_tag(next, dir)));
      last_send[i] = sends.back().get();
    };
    std::vector<std::size_t> order(m);
    for (std::size_t i = 0; i < m; ++i) order[i] = dir == Direction::forward ? i : m - 1 - i;
    // The chain's first part and every cut hand on their offset itself, the
    // cuts before their own state arrives.
    for (std::size_t i : order) {
      const PartSummary& part = c.parts[i];
      if (!chain_next(own[i], n, dir) || (chain_prev(own[i], n, dir) && !part.flags.cut)) continue;
      const State& to = target(i);
      for (const auto& [col, width] : segs) {
        const StateView out = block(to, shape, col, width);
        copy_view(columns(part.offset, col, width), out);
        hand_on(i, out);
      }
    }
    for (std::size_t i : order) {
      const PartSummary& part = c.parts[i];
      if (!chain_next(own[i], n, dir) || !chain_prev(own[i], n, dir) || part.flags.cut) continue;
      const State& to = target(i);
      for (std::size_t j = 0; j < segs.size(); ++j) {
        const auto [col, width] = segs[j];
        if (!recvs[i].empty()) recvs[i][j]->wait();
        const StateView in = block(input(i), shape, col, width);
        const StateView out = block(to, shape, col, width);
        scan(single_slot(columns(part.offset, col, width), part.transfer), 0, 1, dir, &in, out,
             std::nullopt, nullptr, options().exec);
        hand_on(i, out);
      }
    }
    for (std::size_t i = 0; i < m; ++i) {
      for (auto& r : recvs[i]) r->wait();
      if (!single && chain_prev(own[i], n, dir))
        for (const auto& [col, width] : segs)
          copy_view(block(in_buf[i], shape, col, width), columns(result[i].view(), col, width));
    }
    for (auto& s : sends) s->wait();
    return result;
  }
};

// The first segment crosses P-1 hops and is folded on P-2 of them; every
// further segment arrives one stage later, a stage being the slowest rank's
// per-segment work (receive, fold, send).
// With cuts, the longest stretch between them; with a layout, its steps
// that change rank are the messages (zigzag's middle step is local), and a
// rank streams all c segments of a part before its next part: where the
// worst path waits for the rank's earlier part (ChainProfile::order_waits),
// c - 1 more segments.
// Segments are whole units of 16 columns (segments() above, the last unit
// the remainder): where c does not divide ceil(V/16) the first ones are a unit wider, and a pipeline of
// unequal segments takes the sum of their times plus the widest one's on
// every further hop (a proportionate flow shop), so the hops carry the
// widest segment and the c - 1 others share the rest. (Simulated at P = 8
// and 64 on Ethernet, c = 7 of 8 units ran 1.19x the model that priced
// every segment V/c wide.)
CostTerms pipelined_cost(const ProblemShape& s, const ProtocolConfig& config, StreamWaitsCache* waits) {
  CostTerms t;
  const std::size_t c = config.segments;
  const std::size_t more = c > 0 ? c - 1 : 0;  // segments after the first
  const ChainProfile chain = chain_profile(s, 1, more);
  if (chain.parts <= 1) return t;
  const double extra = dbl(more) * dbl(1 + chain.order_waits);
  // The first segment is the widest: whole units, or all of V when it holds
  // the remainder unit too.
  const std::size_t units = max_segments(s.value_dim);
  const std::size_t v = std::max<std::size_t>(1, s.value_dim);
  const double wide_share =
      c > 0 ? dbl(std::min((units + c - 1) / c * kSegmentColumns, v)) / dbl(v) : 1.0;
  const double rest_share = more > 0 ? (1 - wide_share) / dbl(more) : 0.0;
  const double wide = dbl(state_bytes(s)) * wide_share, rest = dbl(state_bytes(s)) * rest_share;
  // Every hop once, then the extra segments at the pace of the slowest hop
  // (on nodes: the network's when any hop crosses it).
  if (chain.node_relays < chain.relays) {
    const double crossings = dbl(chain.node_relays);
    add_messages(t, false, crossings, wide);
    add_messages(t, true, dbl(chain.relays) - crossings, wide);
    add_messages(t, crossings == 0, extra, rest);
  } else {
    t.messages = chain.relays > 0 ? dbl(chain.relays) + extra : 0;
    t.bytes = chain.relays > 0 ? dbl(chain.relays) * wide + extra * rest : 0;
  }
  // Ports that stretches share. c = 1 is p2p: a relay that shares its port
  // carries the other state too (ChainProfile::port_waits; whole states
  // share a port's bandwidth, so both arrive late). Streams of c >= 2
  // segments overlap in part and interleave their segments: the hops the
  // NICs add when the protocol's steps run segment by segment
  // (stream_nic_waits; 0 for c = 1, as the profile's are for c >= 2), each
  // one more widest segment on the network.
  add_port_waits(t, chain, wide);
  t.contention_bytes += stream_nic_waits(s, c, waits) * wide;
  t.folds = stretch_folds(chain.steps) * wide_share + (chain.steps >= 2 ? extra * rest_share : 0);
  t.work_folds = chain_folds(chain.parts);
  // Receive and send buffers (one part per rank: two on a middle rank, one
  // at the chain's ends), priced for c >= 2 (c = 1 receives into the result).
  t.peak_extra_bytes = chain.stream_buffers * state_bytes(s);
  return t;
}

}  // namespace

const ProtocolDescriptor pipelined_p2p_protocol{
    .name = "pipelined_p2p",
    .kind = ProtocolClass::exact,
    .takes_segments = true,
    .takes_layouts = true,
    .memory = "2 states",
    .use_when = "the exact default from P = 8 to a few hundred, any network",
    .cost = pipelined_cost,
    .build = [](const ProtocolContext& ctx) -> std::unique_ptr<StateExchange> {
      return std::make_unique<PipelinedExchange>(ctx);
    },
};

}  // namespace kdacp::detail

namespace kdacp {

namespace {

using detail::check_part_cuts;
using detail::crosses_nodes;
using detail::rank_node_width;

// One run of pipelined_p2p's forward chain in segment hops (a hop: one
// segment's message; folds free), each rank doing what the protocol does
// (pipelined_p2p.cpp): first the chain's first part and every cut hand on
// their offsets, a part's segments one after the other (a segment leaves once
// the part's previous one has arrived); then its other parts in chain order,
// each segment once it has arrived. With `nics`, a message between nodes
// (`across[j]` for the one into part j) holds the sender's NIC out and the
// receiver's NIC in for its hop, first posted first served (segments of two
// streams interleave, as they share a link's bandwidth); without, every
// message moves at once. Returns the last arrival, in hops; nullopt if a
// rank waits for ever (not for a valid chain).
// Cost: O(n c log n) time, 8 n c bytes (P = 65536 with zigzag, c = 8: 8 MiB).
std::optional<std::uint32_t> stream_makespan(const std::vector<std::size_t>& owners,
                                             const std::vector<bool>& cuts, std::size_t c,
                                             std::size_t ranks, const std::vector<bool>& across, bool nics) {
  const std::size_t n = owners.size();
  constexpr std::uint32_t kUnknown = std::numeric_limits<std::uint32_t>::max();
  std::vector<std::uint32_t> arrival(n * c, kUnknown);  // part j's input segment k: j * c + k
  for (std::size_t k = 0; k < c; ++k) arrival[k] = 0;
  // The ranks' programs, one after the other: each rank's parts that hand on
  // offsets, then those that fold, in chain order (part j: 2j + 1 hands on
  // its offset, 2j folds).
  std::vector<std::size_t> first(ranks + 1, 0);
  auto offset = [&](std::size_t j) { return j + 1 < n && (j == 0 || cuts[j]); };
  auto folds = [&](std::size_t j) { return j > 0 && j + 1 < n && !cuts[j]; };
  for (std::size_t j = 0; j < n; ++j)
    if (offset(j) || folds(j)) ++first[owners[j] + 1];
  for (std::size_t r = 0; r < ranks; ++r) first[r + 1] += first[r];
  std::vector<std::size_t> steps(first[ranks]), pc(first.begin(), first.end() - 1);
  for (std::size_t j = 0; j < n; ++j)
    if (offset(j)) steps[pc[owners[j]]++] = 2 * j + 1;
  for (std::size_t j = 0; j < n; ++j)
    if (folds(j)) steps[pc[owners[j]]++] = 2 * j;
  std::copy(first.begin(), first.end() - 1, pc.begin());
  std::vector<std::uint32_t> seg(ranks, 0), clock(ranks, 0);
  constexpr std::size_t kNone = std::numeric_limits<std::size_t>::max();
  std::vector<std::size_t> waits_for(ranks, kNone);  // the arrival a rank waits for
  // Posted messages by (time, order posted); key_of[order] is the message's
  // arrival key. Without NICs the order does not matter (each arrives a hop
  // after it was posted): a stack.
  std::priority_queue<std::uint64_t, std::vector<std::uint64_t>, std::greater<>> queued;
  std::vector<std::uint64_t> stacked;
  auto post = [&](std::uint64_t m) { nics ? queued.push(m) : stacked.push_back(m); };
  auto take = [&] {
    std::uint64_t m = 0;
    if (nics) {
      m = queued.top();
      queued.pop();
    } else {
      m = stacked.back();
      stacked.pop_back();
    }
    return m;
  };
  std::vector<std::uint32_t> key_of;
  auto advance = [&](std::size_t r) {
    waits_for[r] = kNone;
    while (pc[r] < first[r + 1]) {
      const std::size_t j = steps[pc[r]] / 2, k = seg[r], next = j + 1;
      const bool hands_offset = steps[pc[r]] % 2 == 1, remote = owners[next] != r;
      // Its input segment (an offset needs none) and, before a send, the
      // part's previous segment arrived at the next part.
      if (!hands_offset && arrival[j * c + k] == kUnknown) {
        waits_for[r] = j * c + k;
        return;
      }
      if (remote && k > 0 && arrival[next * c + k - 1] == kUnknown) {
        waits_for[r] = next * c + k - 1;
        return;
      }
      std::uint32_t t = clock[r];
      if (!hands_offset) t = std::max(t, arrival[j * c + k]);
      if (remote && k > 0) t = std::max(t, arrival[next * c + k - 1]);
      clock[r] = t;
      if (remote) {
        post(std::uint64_t{t} << 32 | key_of.size());
        key_of.push_back(static_cast<std::uint32_t>(next * c + k));
      } else {
        arrival[next * c + k] = t;
      }
      if (++seg[r] == c) {
        seg[r] = 0;
        ++pc[r];
      }
    }
  };
  std::vector<std::uint32_t> out_free(ranks, 0), in_free(ranks, 0);
  for (std::size_t r = 0; r < ranks; ++r) advance(r);
  while (!queued.empty() || !stacked.empty()) {
    const std::uint64_t top = take();
    const std::uint32_t time = static_cast<std::uint32_t>(top >> 32);
    const std::size_t key = key_of[top & 0xffffffffu], j = key / c;
    const std::size_t from = owners[j - 1], to = owners[j];
    const bool held = nics && across[j];
    const std::uint32_t start = held ? std::max({time, out_free[from], in_free[to]}) : time;
    if (held) out_free[from] = in_free[to] = start + 1;
    arrival[key] = start + 1;
    // Only the receiver (its input) and the sender (its next segment) wait
    // for this arrival.
    if (waits_for[to] == key) advance(to);
    if (waits_for[from] == key) advance(from);
  }
  for (std::size_t r = 0; r < ranks; ++r)
    if (pc[r] < first[r + 1]) return std::nullopt;
  return *std::max_element(arrival.begin(), arrival.end());
}

}  // namespace

double stream_nic_waits(const ProblemShape& s, std::size_t segments, StreamWaitsCache* cache) {
  const PartOwners owners = owners_of(s);
  const std::size_t n = owners.size();
  check_part_cuts(s, n);
  if (segments < 2 || n < 2 || s.part_cuts.empty()) return 0;
  // Segment hops are counted in 32 bits: past 2^31 of them (2^28 parts at
  // c = 8) the NICs are not priced.
  if (n > (std::size_t{1} << 31) / segments) return 0;
  const std::size_t node = rank_node_width(s);
  auto same = [&](const StreamWaitsCache::Entry& e) {
    return e.ranks == s.ranks && e.node == node && e.cuts == s.part_cuts && e.owners == owners.list();
  };
  if (cache != nullptr) {
    const std::lock_guard lock(cache->mutex_);
    for (const auto& e : cache->entries_)
      if (same(e) && segments < e.waits.size() && !std::isnan(e.waits[segments])) return e.waits[segments];
  }
  std::vector<bool> across(n, true);
  for (std::size_t j = 1; j < n; ++j) across[j] = crosses_nodes(owners, node, j);
  const auto alone = stream_makespan(owners.list(), s.part_cuts, segments, s.ranks, across, false);
  const auto shared = stream_makespan(owners.list(), s.part_cuts, segments, s.ranks, across, true);
  const double waits = alone && shared && *shared > *alone ? double(*shared - *alone) : 0.0;
  if (cache == nullptr) return waits;
  const std::lock_guard lock(cache->mutex_);
  auto& entries = cache->entries_;
  auto it = std::find_if(entries.begin(), entries.end(), same);
  if (it == entries.end()) {
    StreamWaitsCache::Entry entry{s.ranks, node, owners.list(), s.part_cuts, {}};
    if (entries.size() < StreamWaitsCache::kSize) {
      it = entries.insert(entries.end(), std::move(entry));
    } else {
      it = entries.begin() + static_cast<std::ptrdiff_t>(cache->next_);
      *it = std::move(entry);
      cache->next_ = (cache->next_ + 1) % StreamWaitsCache::kSize;
    }
  }
  if (it->waits.size() <= segments) it->waits.resize(segments + 1, std::numeric_limits<double>::quiet_NaN());
  it->waits[segments] = waits;
  return waits;
}

}  // namespace kdacp