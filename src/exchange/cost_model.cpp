// The α-β-γ model: prices the registry rows' cost terms (protocol.hpp) with
// a machine's parameters, and auto's rule.
#include "kdacp/cost_model.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <fstream>
#include <cstdint>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <queue>
#include <sstream>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "exchange/cost_terms.hpp"
#include "exchange/runs.hpp"
#include "kdacp/error.hpp"
#include "kdacp/npy.hpp"
#include "kdacp/protocol.hpp"

namespace kdacp {

namespace {

void check_params(const CostParams& c) {
  auto positive = [](double v, const char* key) {
    if (!(v > 0) || !std::isfinite(v)) {
      throw InvalidArgument(fmt::format("cost parameter {} is {}, expected a positive finite number", key, v));
    }
  };
  auto non_negative = [](double v, const char* key) {
    if (!(v >= 0) || !std::isfinite(v)) {
      throw InvalidArgument(
          fmt::format("cost parameter {} is {}, expected >= 0 (0: as the network)", key, v));
    }
  };
  positive(c.alpha_s, "alpha_s");
  positive(c.beta_s_per_byte, "beta_s_per_byte");
  positive(c.gflops, "gflops");
  non_negative(c.group_alpha_s, "group_alpha_s");
  non_negative(c.group_beta_s_per_byte, "group_beta_s_per_byte");
  if (!(c.oversubscription >= 1) || !std::isfinite(c.oversubscription))
    throw InvalidArgument(fmt::format(
        "cost parameter oversubscription is {}, expected a finite number >= 1 (1: non-blocking)", c.oversubscription));
  if (c.leaf_ranks > 0 && c.node_ranks > 0 && c.leaf_ranks % c.node_ranks != 0)
    throw InvalidArgument(fmt::format("cost parameter leaf_ranks is {}, expected a multiple of node_ranks = {}",
                                      c.leaf_ranks, c.node_ranks));
}

void check_shape(const ProblemShape& s) {
  if (s.ranks == 0 || s.slabs == 0 || s.key_dim == 0 || s.value_dim == 0 || s.elem_bytes == 0) {
    throw InvalidArgument(fmt::format("cost model shape P={} B*H={} K={} V={}, expected every size positive",
                                      s.ranks, s.slabs, s.key_dim, s.value_dim));
  }
}

// The machine facts a shape leaves unset (0), from the parameters.
void fill_machine(const CostParams& params, ProblemShape& shape) {
  if (shape.ranks_per_node == 0) shape.ranks_per_node = params.node_ranks;
  if (shape.ranks_per_leaf == 0) shape.ranks_per_leaf = params.leaf_ranks;
  if (shape.leaf_oversubscription == 0) shape.leaf_oversubscription = params.oversubscription;
}

}  // namespace

std::string to_json(const CostParams& c) {
  nlohmann::json j;
  j["source"] = c.source;
  j["alpha_s"] = c.alpha_s;
  j["beta_s_per_byte"] = c.beta_s_per_byte;
  j["gflops"] = c.gflops;
  j["group_alpha_s"] = c.group_alpha_s;
  j["group_beta_s_per_byte"] = c.group_beta_s_per_byte;
  j["concurrent_ranks"] = c.concurrent_ranks;
  if (c.node_ranks > 0) j["node_ranks"] = c.node_ranks;
  if (c.leaf_ranks > 0) j["leaf_ranks"] = c.leaf_ranks;
  if (c.oversubscription != 1) j["oversubscription"] = c.oversubscription;
  return j.dump(2);
}

CostParams cost_params_from_json(const std::string& text) {
  const nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
  if (j.is_discarded())
    throw InvalidArgument("cost parameters are not valid JSON (or hold a number out of double's range)");
  if (!j.is_object()) throw InvalidArgument("cost parameters are not a JSON object");
  CostParams c;
  auto number = [&j](const char* key, double& out) {
    if (!j.contains(key)) return;
    if (!j[key].is_number())
      throw InvalidArgument(fmt::format("cost parameter {} is {}, expected a number", key, j[key].dump()));
    out = j[key].get<double>();
  };
  if (j.contains("source") && j["source"].is_string()) c.source = j["source"].get<std::string>();
  number("alpha_s", c.alpha_s);
  number("beta_s_per_byte", c.beta_s_per_byte);
  number("gflops", c.gflops);
  number("group_alpha_s", c.group_alpha_s);
  number("group_beta_s_per_byte", c.group_beta_s_per_byte);
  auto count = [&j](const char* key, const char* zero, std::size_t& out) {
    if (!j.contains(key)) return;
    const nlohmann::json& v = j[key];
    if (!v.is_number_unsigned() && !(v.is_number_integer() && v.get<long long>() >= 0))
      throw InvalidArgument(
          fmt::format("cost parameter {} is {}, expected an integer >= 0 (0: {})", key, v.dump(), zero));
    out = v.get<std::size_t>();
  };
  count("concurrent_ranks", "every rank", c.concurrent_ranks);
  count("node_ranks", "unknown", c.node_ranks);
  count("leaf_ranks", "no leaf switch", c.leaf_ranks);
  number("oversubscription", c.oversubscription);
  check_params(c);
  return c;
}

CostParams load_cost_params(const std::string& path) {
  try {
    require_regular_file(path);
  } catch (const IoError& e) {
    throw IoError(std::string("cannot read cost parameters: ") + e.what());
  }
  std::ifstream in(path);
  if (!in) throw IoError(fmt::format("cannot read cost parameters from '{}'", path));
  std::stringstream ss;
  ss << in.rdbuf();
  return cost_params_from_json(ss.str());
}

void save_cost_params(const CostParams& params, const std::string& path) {
  check_params(params);
  std::ofstream out(path);
  out << to_json(params) << "\n";
  if (!out) throw IoError(fmt::format("cannot write cost parameters to '{}'", path));
}

PartOwners owners_of(const ProblemShape& s) {
  if (!s.part_owners) return PartOwners::one_per_rank(s.ranks);
  if (s.part_owners->ranks() != s.ranks) {
    throw InvalidArgument(fmt::format("cost model: part_owners spans {} ranks, expected P = {}",
                                      s.part_owners->ranks(), s.ranks));
  }
  return *s.part_owners;
}

namespace {

// The shape's cuts, checked against its n parts (empty: none).
void check_cuts(const ProblemShape& s, std::size_t n) {
  if (!s.part_cuts.empty() && s.part_cuts.size() != n) {
    throw InvalidArgument(fmt::format("cost model: part_cuts has {} entries, expected one per part ({})",
                                      s.part_cuts.size(), n));
  }
}

// Whether the step into part j (j >= 1) joins ranks of two nodes of `node`
// consecutive ranks (every step when node is 0: the nodes unknown).
bool crosses_nodes(const PartOwners& owners, std::size_t node, std::size_t j) {
  return node == 0 || owners[j] / node != owners[j - 1] / node;
}

// For each relay j (the step into part j that changes run, leaving in
// slot[j]): how many other relays hold one of its two ports in that slot, the
// port it leaves through and the one it arrives at (a rank's node port for
// relays inside a node, its NIC for those where across(j)). chain_profile's
// ports.
template <class Across>
std::vector<std::size_t> port_sharing(const PartOwners& owners, const std::vector<std::size_t>& run_of,
                                      const Across& across, const std::vector<std::size_t>& slot) {
  const std::size_t n = owners.size();
  using Port = std::array<std::size_t, 4>;  // rank, across nodes, leaving, slot
  auto ports = [&](std::size_t j) {
    const std::size_t a = across(j) ? 1 : 0;
    return std::array{Port{owners[j - 1], a, 1, slot[j]}, Port{owners[j], a, 0, slot[j]}};
  };
  std::map<Port, std::size_t> held;
  for (std::size_t j = 1; j < n; ++j)
    if (run_of[j] != run_of[j - 1])
      for (const Port& port : ports(j)) ++held[port];
  std::vector<std::size_t> shared(n, 0);
  for (std::size_t j = 1; j < n; ++j)
    if (run_of[j] != run_of[j - 1])
      for (const Port& port : ports(j)) shared[j] = std::max(shared[j], held[port] - 1);
  return shared;
}

}  // namespace

ChainProfile chain_profile(const ProblemShape& s, std::size_t width, std::size_t order_weight) {
  const std::size_t p = s.ranks;
  const PartOwners owners = owners_of(s);
  const std::size_t n = owners.size();
  check_cuts(s, n);
  const std::size_t w = std::max<std::size_t>(1, width);
  ChainProfile out;
  out.parts = n;
  out.per_rank = owners.max_per_rank();
  std::vector<std::size_t> run_of(n, 0), block_runs(p / w + 1, 0);
  std::size_t run_len = 0;
  out.runs = 0;
  out.longest_run = 0;
  for (std::size_t j = 0; j < n; ++j) {
    if (j == 0 || owners[j] / w != owners[j - 1] / w) {
      ++out.runs;
      ++block_runs[owners[j] / w];
      run_len = 0;
    }
    run_of[j] = out.runs - 1;
    out.longest_run = std::max(out.longest_run, ++run_len);
  }
  out.runs_per_block = *std::max_element(block_runs.begin(), block_runs.end());
  // Stretches start at the chain's start and at every cut and end at the
  // next cut, which receives but need not wait (the backward chain has the
  // same stretches, mirrored). A rank (a block, for width w) handles its
  // parts one after the other in chain order, waiting for each part's state
  // (p2p.cpp, runs.cpp): a stretch that passes a rank also waits for that
  // rank's earlier parts. The critical path is the longest path over both
  // kinds of edges (chain order is a topological order of them): by relays,
  // (plus order_weight per edge of the second kind), then relays across
  // nodes; and, apart, by steps.
  auto cut = [&](std::size_t j) { return !s.part_cuts.empty() && s.part_cuts[j]; };
  const std::size_t node = detail::rank_node_width(s);  // for any layout
  auto across = [&](std::size_t j) { return crosses_nodes(owners, node, j); };
  struct Path {
    std::size_t relays = 0, node_relays = 0, order_waits = 0;
    std::size_t port_waits = 0, node_port_waits = 0;
  };
  auto key = [&](const Path& a) { return a.relays + a.port_waits + order_weight * a.order_waits; };
  auto worse = [&](const Path& a, const Path& b) {
    const bool less = key(a) != key(b) ? key(a) < key(b) : a.node_relays < b.node_relays;
    return less ? b : a;
  };
  std::vector<Path> done(n);
  // The longest paths to every part, a relay into part j costing 1 + shared[j]
  // (its port's other messages, below; none on the first walk).
  auto walk = [&](const std::vector<std::size_t>& shared) {
    std::fill(done.begin(), done.end(), Path{});
    std::vector<std::size_t> done_steps(n, 0);
    std::vector<std::size_t> last_of_block(p / w + 1, n);  // n: none yet
    Path worst;
    out.steps = 0;
    for (std::size_t j = 0; j < n; ++j) {
      const std::size_t block = owners[j] / w;
      const std::size_t before = last_of_block[block];
      last_of_block[block] = j;
      if (j == 0) continue;
      // The step into j: its incoming state, a message when the run changes.
      Path in = done[j - 1];
      if (run_of[j] != run_of[j - 1]) {
        ++in.relays;
        if (across(j)) ++in.node_relays;
        if (!shared.empty()) {
          in.port_waits += shared[j];
          if (across(j)) in.node_port_waits += shared[j];
        }
      } else {
        ++in.order_waits;  // the block's previous part, on the same block
      }
      const std::size_t in_steps = done_steps[j - 1] + 1;
      worst = worse(worst, in);
      out.steps = std::max(out.steps, in_steps);
      // A cut hands its own offset on without waiting: a new stretch.
      if (cut(j)) continue;
      done[j] = in;
      done_steps[j] = in_steps;
      // The block's previous part, when it is not the chain's previous one.
      if (before != n && before + 1 != j) {
        Path wait = done[before];
        ++wait.order_waits;
        done[j] = worse(done[j], wait);
        done_steps[j] = std::max(done_steps[j], done_steps[before] + 1);
        worst = worse(worst, done[j]);
        out.steps = std::max(out.steps, done_steps[j]);
      }
    }
    return worst;
  };
  Path worst = walk({});
  // Ports (p2p: ranks, one state per relay): stretches run side by side, and
  // a rank's port carries one state at a time at full speed. A relay leaves
  // when its part is done (the first walk's key, in relays) and holds the
  // port of the rank it leaves and of the one it reaches (inside a node the
  // rank's node port, across nodes its NIC) for one relay time: relays that
  // hold one port in the same slot share it, and each takes one more relay
  // time per relay beside it. One chain without cuts never shares (its
  // relays leave one after the other). The second walk finds the worst path
  // with these costs. Not for blocks (w > 1: a block's carrier sends its
  // runs) nor pipelined_p2p's streams (order_weight > 0): c segments that
  // overlap in part, which relay counts do not time (stream_nic_waits).
  if (w == 1 && order_weight == 0 && n >= 2 && !s.part_cuts.empty()) {
    std::vector<std::size_t> slot(n, 0);
    for (std::size_t j = 1; j < n; ++j) slot[j] = key(done[j - 1]);
    const std::vector<std::size_t> shared = port_sharing(owners, run_of, across, slot);
    const bool any = std::any_of(shared.begin(), shared.end(), [](std::size_t k) { return k > 0; });
    if (any) worst = walk(shared);
  }
  out.relays = worst.relays;
  out.node_relays = worst.node_relays;
  out.order_waits = worst.order_waits;
  out.port_waits = worst.port_waits;
  out.node_port_waits = worst.node_port_waits;
  return out;
}

namespace {

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

// The last shapes priced, with their waits per segment count (NaN: not yet):
// auto and plan price every segment count of one shape several times over.
struct StreamWaitsCache {
  struct Entry {
    std::size_t ranks, node;
    std::vector<std::size_t> owners;
    std::vector<bool> cuts;
    std::vector<double> waits;  // by c
  };
  std::mutex mutex;
  std::vector<Entry> entries;
  std::size_t next = 0;
  static constexpr std::size_t kSize = 4;
};

}  // namespace

double stream_nic_waits(const ProblemShape& s, std::size_t segments) {
  const PartOwners owners = owners_of(s);
  const std::size_t n = owners.size();
  check_cuts(s, n);
  if (segments < 2 || n < 2 || s.part_cuts.empty()) return 0;
  // Segment hops are counted in 32 bits: past 2^31 of them (2^28 parts at
  // c = 8) the NICs are not priced.
  if (n > (std::size_t{1} << 31) / segments) return 0;
  const std::size_t node = detail::rank_node_width(s);
  static StreamWaitsCache cache;
  auto same = [&](const StreamWaitsCache::Entry& e) {
    return e.ranks == s.ranks && e.node == node && e.cuts == s.part_cuts && e.owners == owners.list();
  };
  {
    const std::lock_guard lock(cache.mutex);
    for (const auto& e : cache.entries)
      if (same(e) && segments < e.waits.size() && !std::isnan(e.waits[segments])) return e.waits[segments];
  }
  std::vector<bool> across(n, true);
  for (std::size_t j = 1; j < n; ++j) across[j] = crosses_nodes(owners, node, j);
  const auto alone = stream_makespan(owners.list(), s.part_cuts, segments, s.ranks, across, false);
  const auto shared = stream_makespan(owners.list(), s.part_cuts, segments, s.ranks, across, true);
  const double waits = alone && shared && *shared > *alone ? double(*shared - *alone) : 0.0;
  const std::lock_guard lock(cache.mutex);
  auto it = std::find_if(cache.entries.begin(), cache.entries.end(), same);
  if (it == cache.entries.end()) {
    StreamWaitsCache::Entry entry{s.ranks, node, owners.list(), s.part_cuts, {}};
    if (cache.entries.size() < StreamWaitsCache::kSize) {
      it = cache.entries.insert(cache.entries.end(), std::move(entry));
    } else {
      it = cache.entries.begin() + static_cast<std::ptrdiff_t>(cache.next);
      *it = std::move(entry);
      cache.next = (cache.next + 1) % StreamWaitsCache::kSize;
    }
  }
  if (it->waits.size() <= segments) it->waits.resize(segments + 1, std::numeric_limits<double>::quiet_NaN());
  it->waits[segments] = waits;
  return waits;
}

std::size_t max_segments(std::size_t value_dim) { return std::max<std::size_t>(1, value_dim / 16); }

namespace {

// The terms priced with the machine's parameters. `work` and `path` are the
// compute seconds of all ranks together and of the critical path: with fewer
// cores than ranks (concurrent_ranks < P) the cores, not the dependency
// chain, bound the time.
double seconds_of(const CostParams& c, const ProblemShape& s, const CostTerms& t) {
  const double group_alpha = c.group_alpha_s > 0 ? c.group_alpha_s : c.alpha_s;
  const double group_beta = c.group_beta_s_per_byte > 0 ? c.group_beta_s_per_byte : c.beta_s_per_byte;
  const double flop_rate = c.gflops * 1e9;
  const double kk = static_cast<double>(s.key_dim) * static_cast<double>(s.key_dim);
  const double slabs = static_cast<double>(s.slabs);
  const double t_fold = 2 * slabs * kk * static_cast<double>(s.value_dim) / flop_rate;
  const double t_mm = 2 * slabs * kk * static_cast<double>(s.key_dim) / flop_rate;
  const double path = t.folds * t_fold + t.products * t_mm;
  double seconds = t.messages * c.alpha_s + (t.bytes + t.contention_bytes) * c.beta_s_per_byte +
                   t.group_messages * group_alpha + t.group_bytes * group_beta + path;
  const std::size_t slots = c.concurrent_ranks;
  if (slots > 0 && slots < s.ranks) {
    const double work = t.work_folds * t_fold + t.work_products * t_mm;
    seconds += std::max(0.0, work / static_cast<double>(slots) - path);
  }
  return seconds;
}

// The row of `config`, with its knobs checked and normalised: the group size
// 1 and segments 0 for rows without those knobs, segments 0 resolved to the
// model's choice.
const ProtocolDescriptor& checked_row(const ProtocolConfig& config, const ProblemShape& shape,
                                      ProtocolConfig& out) {
  const ProtocolDescriptor& row = find_protocol(config.method);
  if (row.chooser())
    throw InvalidArgument(fmt::format(
        "cost model: '{}' chooses among the protocols (choose_protocol), it has no cost of its own", config.method));
  out = config;
  if (!row.takes_group_size) out.group_size = 1;
  if (!row.takes_segments) out.segments = 0;
  if (out.group_size == 0 || shape.ranks % out.group_size != 0) {
    throw InvalidArgument(fmt::format("cost model: group size {} for {} does not divide P = {}, expected a divisor",
                                      out.group_size, config.method, shape.ranks));
  }
  if (out.segments > max_segments(shape.value_dim)) {
    throw InvalidArgument(fmt::format("cost model: segments {} for V = {}, expected at most V/16 = {}",
                                      out.segments, shape.value_dim, max_segments(shape.value_dim)));
  }
  return row;
}

}  // namespace

std::size_t best_segments(const CostParams& params, const ProblemShape& given,
                          const std::string& method) {
  check_params(params);
  check_shape(given);
  ProblemShape shape = given;
  fill_machine(params, shape);
  ProtocolConfig config;
  const ProtocolDescriptor& row = checked_row({method, 1, 0}, shape, config);
  if (!row.takes_segments) return 0;
  std::size_t best = 1;
  double best_time = std::numeric_limits<double>::infinity();
  for (std::size_t c = 1; c <= max_segments(shape.value_dim); ++c) {
    config.segments = c;
    const double time = seconds_of(params, shape, row.cost(shape, config));
    if (time < best_time) best = c, best_time = time;
  }
  return best;
}

Prediction predict(const CostParams& params, const ProblemShape& given,
                   const ProtocolConfig& config) {
  check_params(params);
  check_shape(given);
  ProblemShape shape = given;
  fill_machine(params, shape);
  Prediction out;
  const ProtocolDescriptor& row = checked_row(config, shape, out.config);
  if (row.takes_segments && out.config.segments == 0)
    out.config.segments = best_segments(params, shape, out.config.method);
  const CostTerms terms = row.cost(shape, out.config);
  out.exact = row.exact();
  out.seconds = seconds_of(params, shape, terms);
  out.peak_extra_bytes = terms.peak_extra_bytes;
  return out;
}

std::vector<Prediction> predict_all(const CostParams& params, const ProblemShape& shape,
                                    bool include_reassociating) {
  check_shape(shape);
  std::vector<Prediction> out;
  for (const ProtocolDescriptor* row : protocol_registry()) {
    if (row->chooser() || (!row->exact() && !include_reassociating)) continue;
    if (row->takes_group_size) {
      // w = 1 and w = P are the chain and the allgather: weighed as themselves.
      for (std::size_t w = 2; w < shape.ranks; ++w)
        if (shape.ranks % w == 0) out.push_back(predict(params, shape, {std::string(row->name), w, 0}));
    } else {
      out.push_back(predict(params, shape, {std::string(row->name), 1, 0}));
    }
  }
  return out;
}

std::vector<Prediction> best_per_protocol(const CostParams& params, const ProblemShape& shape) {
  std::vector<Prediction> best;
  // predict_all lists a row's configurations next to each other.
  for (const Prediction& p : predict_all(params, shape, true)) {
    if (best.empty() || best.back().config.method != p.config.method) best.push_back(p);
    else if (p.seconds < best.back().seconds) best.back() = p;
  }
  return best;
}

Prediction choose_protocol(const CostParams& params, const ProblemShape& shape,
                           std::size_t memory_budget_bytes, bool allow_reassociation,
                           bool layouts_only) {
  const auto all = predict_all(params, shape, allow_reassociation);
  const Prediction* best = nullptr;
  std::size_t least_memory = std::numeric_limits<std::size_t>::max();
  for (const Prediction& p : all) {
    if (layouts_only && !find_protocol(p.config.method).takes_layouts) continue;
    least_memory = std::min(least_memory, p.peak_extra_bytes);
    if (memory_budget_bytes != 0 && p.peak_extra_bytes > memory_budget_bytes) continue;
    if (best == nullptr || p.seconds < best->seconds) best = &p;
  }
  if (best == nullptr) {
    throw InvalidArgument(fmt::format(
        "memory_budget_bytes is {}, expected at least the smallest protocol's need of {} bytes",
        memory_budget_bytes, least_memory));
  }
  return *best;
}

double all_to_all_seconds(const CostParams& params, std::size_t width, double bytes, std::size_t node_size) {
  check_params(params);
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
  check_params(params);
  check_shape(shape);
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
    p.exchange = choose_protocol(sub_params, sub, options.memory_budget_bytes, false, has_layout(sub));
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
  // folds and products (compose(): a cut outer pair costs nothing, a cut
  // inner one no product).
  std::vector<std::array<std::size_t, 4>> count(s.ranks);
  std::vector<std::array<std::size_t, 2>> across(leaves), work(s.ranks);
  for (std::size_t k = 0; k < rounds; ++k) {
    const std::size_t d = std::size_t{1} << k;
    auto final_round = [d](std::size_t q) { return d <= q && q < 2 * d; };
    std::fill(count.begin(), count.end(), std::array<std::size_t, 4>{});
    std::fill(across.begin(), across.end(), std::array<std::size_t, 2>{});
    std::fill(work.begin(), work.end(), std::array<std::size_t, 2>{});
    for (std::size_t q = 0; q + d < m; ++q) {
      const std::size_t a = carrier(q), b = carrier(q + d);
      if (have[q]) {
        if (!cut[q]) {
          ++work[a][0];
          if (!final_round(q + d) && !prefix_cut[q]) ++work[a][1];
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
        ++work[carrier(q)][0];
        if (!final_round(q) && !src_cut) ++work[carrier(q)][1];
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
      // port: its messages at leaf/o ports' bandwidth (as the plain scan's
      // add_leaf_contention, which is this with one message per rank).
      const double uplinks = dbl(most_across) * s.leaf_oversubscription / dbl(leaf > 0 ? leaf : 1);
      if (uplinks > dbl(most_net)) t.contention_bytes += (uplinks - dbl(most_net)) * bytes;
    } else if (most_group > 0) {
      add_messages(t, true, 1, dbl(most_group) * bytes);
    }
    // The round's compute on the critical path: its busiest carrier's, all
    // of it after the round's messages (a carrier composes a position's
    // aggregate before sending it, and a prefix after receiving it).
    const std::array<std::size_t, 2>* busiest = &work.front();
    for (const auto& c : work) {
      t.work_folds += dbl(c[0]);
      t.work_products += dbl(c[1]);
      if (dbl(c[0]) * fold_weight + dbl(c[1]) * product_weight >
          dbl((*busiest)[0]) * fold_weight + dbl((*busiest)[1]) * product_weight)
        busiest = &c;
    }
    t.folds += dbl((*busiest)[0]);
    t.products += dbl((*busiest)[1]);
  }
}

}  // namespace

// cost_terms.hpp
void add_layout_runs(CostTerms& t, const ProblemShape& s, std::size_t w) {
  const Runs runs(LayoutIndex(owners_of(s).list(), s.ranks), w);
  add_run_scan(t, s, runs, w);
  add_run_folds(t, s, runs);
}

}  // namespace kdacp::detail
