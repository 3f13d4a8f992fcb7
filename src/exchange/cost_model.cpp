// The α-β-γ model of every protocol's critical path (docs/protocols.md).
#include "kdacp/cost_model.hpp"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>
#include <sstream>

#include <nlohmann/json.hpp>

#include "kdacp/error.hpp"

namespace kdacp {

namespace {

std::size_t ceil_log2(std::size_t n) {
  std::size_t r = 0;
  while ((std::size_t{1} << r) < n) ++r;
  return r;
}

// The quantities every formula is written in.
struct Terms {
  double alpha, beta, group_alpha, group_beta;
  double n_state, n_packed;  // bytes of one [B,H,K,V] state, one packed [S|M] slot
  double t_fold;             // one K×V step for all slabs
  double t_mm;               // one K×K·K×K product for all slabs
  std::size_t state_bytes, packed_bytes;

  Terms(const CostParams& c, const ProblemShape& s) {
    alpha = c.alpha_s;
    beta = c.beta_s_per_byte;
    group_alpha = c.group_alpha_s > 0 ? c.group_alpha_s : alpha;
    group_beta = c.group_beta_s_per_byte > 0 ? c.group_beta_s_per_byte : beta;
    state_bytes = s.slabs * s.key_dim * s.value_dim * s.elem_bytes;
    packed_bytes = s.slabs * s.key_dim * (s.value_dim + s.key_dim) * s.elem_bytes;
    n_state = static_cast<double>(state_bytes);
    n_packed = static_cast<double>(packed_bytes);
    const double flop_rate = c.gflops * 1e9;
    const double kk = static_cast<double>(s.key_dim) * static_cast<double>(s.key_dim);
    t_fold = 2 * static_cast<double>(s.slabs) * kk * static_cast<double>(s.value_dim) / flop_rate;
    t_mm = 2 * static_cast<double>(s.slabs) * kk * static_cast<double>(s.key_dim) / flop_rate;
  }
  // A latency-optimal, bandwidth-optimal all-gather of m slots of n bytes
  // (Bruck / recursive doubling, what MPI picks for these sizes).
  double all_gather(std::size_t m, double n, bool group) const {
    if (m <= 1) return 0;
    return static_cast<double>(ceil_log2(m)) * (group ? group_alpha : alpha) +
           static_cast<double>(m - 1) * n * (group ? group_beta : beta);
  }
  double broadcast(std::size_t m, double n, bool group) const {
    return static_cast<double>(ceil_log2(m)) *
           ((group ? group_alpha : alpha) + n * (group ? group_beta : beta));
  }
};

double dbl(std::size_t n) { return static_cast<double>(n); }

// Recursive doubling over m positions: round 0 moves a packed pair and
// computes nothing; the middle rounds compose two full pairs each (the
// outgoing aggregate and the received prefix); the last round moves and folds
// states only, because its receivers need no transfer any more.
double rd_compute(const Terms& t, std::size_t m) {
  const std::size_t rounds = ceil_log2(m);
  double s = 0;
  if (rounds >= 3) s += dbl(rounds - 2) * 2 * (t.t_fold + t.t_mm);
  if (rounds >= 2) s += 2 * t.t_fold;
  return s;
}

double rd_time(const Terms& t, std::size_t m) {
  const std::size_t rounds = ceil_log2(m);
  if (rounds == 0) return 0;
  double s = dbl(rounds) * t.alpha + dbl(rounds - 1) * t.beta * t.n_packed + t.beta * t.n_state;
  return s + rd_compute(t, m);
}

// All positions' compute of recursive_doubling over m positions (what the
// cores must do in total; approximate: every receiver of a middle round
// composes two pairs, every receiver of the last round folds two states, as
// on the critical path above).
double rd_work(const Terms& t, std::size_t m) {
  const std::size_t rounds = ceil_log2(m);
  double w = 0;
  for (std::size_t k = 1; k < rounds; ++k) {
    const double receivers = dbl(m - (std::size_t{1} << k));
    w += receivers * (k + 1 == rounds ? 2 * t.t_fold : 2 * (t.t_fold + t.t_mm));
  }
  return w;
}

std::size_t rd_memory(const Terms& t, std::size_t m) {
  if (m <= 1) return 0;
  // The prefix, the outgoing aggregate and the receive buffer, one pair each.
  return m == 2 ? t.packed_bytes : 3 * t.packed_bytes;
}

void check_params(const CostParams& c) {
  auto positive = [](double v, const char* key) {
    if (!(v > 0) || !std::isfinite(v)) {
      std::ostringstream os;
      os << "cost parameter " << key << " is " << v << ", expected a positive finite number";
      throw InvalidArgument(os.str());
    }
  };
  auto non_negative = [](double v, const char* key) {
    if (!(v >= 0) || !std::isfinite(v)) {
      std::ostringstream os;
      os << "cost parameter " << key << " is " << v << ", expected >= 0 (0: as the network)";
      throw InvalidArgument(os.str());
    }
  };
  positive(c.alpha_s, "alpha_s");
  positive(c.beta_s_per_byte, "beta_s_per_byte");
  positive(c.gflops, "gflops");
  non_negative(c.group_alpha_s, "group_alpha_s");
  non_negative(c.group_beta_s_per_byte, "group_beta_s_per_byte");
}

void check_shape(const ProblemShape& s) {
  if (s.ranks == 0 || s.slabs == 0 || s.key_dim == 0 || s.value_dim == 0 || s.elem_bytes == 0) {
    std::ostringstream os;
    os << "cost model shape P=" << s.ranks << " B*H=" << s.slabs << " K=" << s.key_dim
       << " V=" << s.value_dim << ", expected every size positive";
    throw InvalidArgument(os.str());
  }
}

std::vector<std::size_t> proper_divisors(std::size_t p) {
  std::vector<std::size_t> out;
  for (std::size_t w = 2; w < p; ++w)
    if (p % w == 0) out.push_back(w);
  return out;
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
  return j.dump(2);
}

CostParams cost_params_from_json(const std::string& text) {
  const nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
  if (j.is_discarded() || !j.is_object())
    throw InvalidArgument("cost parameters are not a JSON object");
  CostParams c;
  auto number = [&j](const char* key, double& out) {
    if (!j.contains(key)) return;
    if (!j[key].is_number())
      throw InvalidArgument(std::string("cost parameter ") + key + " is " + j[key].dump() +
                            ", expected a number");
    out = j[key].get<double>();
  };
  if (j.contains("source") && j["source"].is_string()) c.source = j["source"].get<std::string>();
  number("alpha_s", c.alpha_s);
  number("beta_s_per_byte", c.beta_s_per_byte);
  number("gflops", c.gflops);
  number("group_alpha_s", c.group_alpha_s);
  number("group_beta_s_per_byte", c.group_beta_s_per_byte);
  if (j.contains("concurrent_ranks")) {
    const nlohmann::json& v = j["concurrent_ranks"];
    if (!v.is_number_unsigned() &&
        !(v.is_number_integer() && v.get<long long>() >= 0))
      throw InvalidArgument("cost parameter concurrent_ranks is " + v.dump() +
                            ", expected an integer >= 0 (0: every rank)");
    c.concurrent_ranks = v.get<std::size_t>();
  }
  check_params(c);
  return c;
}

CostParams load_cost_params(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw IoError("cannot read cost parameters from '" + path + "'");
  std::stringstream ss;
  ss << in.rdbuf();
  return cost_params_from_json(ss.str());
}

void save_cost_params(const CostParams& params, const std::string& path) {
  check_params(params);
  std::ofstream out(path);
  out << to_json(params) << "\n";
  if (!out) throw IoError("cannot write cost parameters to '" + path + "'");
}

std::size_t max_segments(std::size_t value_dim) { return std::max<std::size_t>(1, value_dim / 16); }

namespace {

// Pipelined chain with c segments: the first segment crosses P-1 hops and is
// folded on P-2 of them; every further segment arrives one stage later, a
// stage being the slowest rank's per-segment work (receive, fold, send).
double pipelined_time(const Terms& t, std::size_t p, std::size_t c) {
  if (p <= 1) return 0;
  const double cd = dbl(c);
  const double hop = t.alpha + t.beta * t.n_state / cd;
  const double fold = t.t_fold / cd;
  const double folds_on_path = p >= 3 ? dbl(p - 2) : 0;
  const double stage = hop + (p >= 3 ? fold : 0);
  return dbl(p - 1) * hop + folds_on_path * fold + (cd - 1) * stage;
}

}  // namespace

std::size_t best_segments(const CostParams& params, const ProblemShape& shape) {
  check_params(params);
  check_shape(shape);
  const Terms t(params, shape);
  std::size_t best = 1;
  double best_time = std::numeric_limits<double>::infinity();
  for (std::size_t c = 1; c <= max_segments(shape.value_dim); ++c) {
    const double time = pipelined_time(t, shape.ranks, c);
    if (time < best_time) best = c, best_time = time;
  }
  return best;
}

Prediction predict(const CostParams& params, const ProblemShape& shape,
                   const ProtocolConfig& config) {
  check_params(params);
  check_shape(shape);
  const Terms t(params, shape);
  const std::size_t p = shape.ranks;
  Prediction out;
  out.config = config;
  const std::string& m = config.method;
  const std::size_t w = config.group_size;
  const bool grouped = m == "grouped_allgather_p2p" || m == "grouped_allgather_rd";
  if (grouped && (w == 0 || p % w != 0)) {
    std::ostringstream os;
    os << "cost model: group size " << w << " for " << m << " does not divide P = " << p
       << ", expected a divisor";
    throw InvalidArgument(os.str());
  }
  if (!grouped) out.config.group_size = 1;
  if (m != "pipelined_p2p") out.config.segments = 0;
  // Each branch sets the critical path (seconds, communication and compute
  // on it) and `work`: the fold seconds of all ranks together, which bounds
  // the time from below when the ranks share fewer cores than there are ranks.
  const double between = p >= 3 ? dbl(p - 2) : 0;  // folds on the chain's path
  double work = 0, path = 0;
  if (m == "p2p") {
    out.seconds = p <= 1 ? 0 : dbl(p - 1) * (t.alpha + t.beta * t.n_state) + between * t.t_fold;
    work = path = between * t.t_fold;
    out.peak_extra_bytes = p >= 3 ? t.state_bytes : 0;
  } else if (m == "pipelined_p2p") {
    const std::size_t c = config.segments == 0 ? best_segments(params, shape) : config.segments;
    if (c > max_segments(shape.value_dim)) {
      std::ostringstream os;
      os << "cost model: segments " << c << " for V = " << shape.value_dim
         << ", expected at most V/16 = " << max_segments(shape.value_dim);
      throw InvalidArgument(os.str());
    }
    out.config.segments = c;
    out.seconds = pipelined_time(t, p, c);
    work = between * t.t_fold;
    path = (p >= 3 ? between + dbl(c - 1) : 0) * t.t_fold / dbl(c);
    out.peak_extra_bytes = p >= 3 ? 2 * t.state_bytes : (p == 2 ? t.state_bytes : 0);
  } else if (m == "allgather") {
    out.seconds = t.all_gather(p, t.n_packed, false) + between * t.t_fold;
    // Rank r folds r-1 slots.
    work = (p >= 3 ? dbl(p - 1) * dbl(p - 2) / 2 : 0) * t.t_fold;
    path = between * t.t_fold;
    out.peak_extra_bytes = p * t.packed_bytes;
  } else if (m == "grouped_allgather_p2p") {
    const std::size_t blocks = p / w;
    out.seconds = t.all_gather(w, t.n_packed, true) +
                  dbl(blocks - 1) * (t.alpha + t.beta * t.n_state + dbl(w) * t.t_fold) +
                  (blocks > 1 ? t.broadcast(w, t.n_state, true) : 0) + dbl(w - 1) * t.t_fold;
    // Local position l of the first block folds l-1 slots, of a later block
    // l+1 (its incoming state first); the owners of every block but the
    // last fold their whole block.
    for (std::size_t r = 0; r < p; ++r) {
      const std::size_t l = r % w, b = r / w;
      std::size_t steps = b > 0 ? l : (l >= 2 ? l - 1 : 0);
      if (l == w - 1 && b + 1 < blocks) steps = b > 0 ? w : w - 1;
      work += dbl(steps) * t.t_fold;
    }
    path = (dbl(blocks - 1) * dbl(w) + dbl(w - 1)) * t.t_fold;
    out.peak_extra_bytes = w * t.packed_bytes + 2 * t.state_bytes;
  } else if (m == "recursive_doubling") {
    out.exact = false;
    out.seconds = rd_time(t, p);
    work = rd_work(t, p);
    path = rd_compute(t, p);
    out.peak_extra_bytes = rd_memory(t, p);
  } else if (m == "grouped_allgather_rd") {
    const std::size_t blocks = p / w;
    out.exact = false;
    // Owners fold their group into one pair (w-1 state folds and w-1 K×K
    // products), scan across the blocks, broadcast; everyone folds its prefix.
    out.seconds = t.all_gather(w, t.n_packed, true) +
                  (blocks > 1 ? dbl(w - 1) * (t.t_fold + t.t_mm) + rd_time(t, blocks) +
                                    t.broadcast(w, t.n_state, true)
                              : 0) +
                  dbl(w - 1) * t.t_fold;
    work = (blocks > 1 ? dbl(blocks) * dbl(w - 1) * (t.t_fold + t.t_mm) + rd_work(t, blocks) : 0) +
           dbl(p) * dbl(w - 1) / 2 * t.t_fold;
    path = (blocks > 1 ? dbl(w - 1) * (t.t_fold + t.t_mm) + rd_compute(t, blocks) : 0) +
           dbl(w - 1) * t.t_fold;
    out.peak_extra_bytes = w * t.packed_bytes + (blocks > 1 ? t.packed_bytes : 0) +
                           rd_memory(t, blocks) + t.state_bytes;
  } else {
    throw InvalidArgument("cost model: unknown method '" + m + "'");
  }
  // Shared cores: the ranks' total fold work spread over the ranks that can
  // fold at once, when that exceeds the critical path's compute.
  const std::size_t slots = params.concurrent_ranks;
  if (slots > 0 && slots < p) {
    out.seconds += std::max(0.0, work / dbl(slots) - path);
  }
  return out;
}

std::vector<Prediction> predict_all(const CostParams& params, const ProblemShape& shape,
                                    bool include_reassociating) {
  std::vector<Prediction> out;
  out.push_back(predict(params, shape, {"p2p", 1, 0}));
  out.push_back(predict(params, shape, {"pipelined_p2p", 1, 0}));
  out.push_back(predict(params, shape, {"allgather", 1, 0}));
  const auto widths = proper_divisors(shape.ranks);
  for (std::size_t w : widths) out.push_back(predict(params, shape, {"grouped_allgather_p2p", w, 0}));
  if (include_reassociating) {
    out.push_back(predict(params, shape, {"recursive_doubling", 1, 0}));
    for (std::size_t w : widths) out.push_back(predict(params, shape, {"grouped_allgather_rd", w, 0}));
  }
  return out;
}

Prediction choose_protocol(const CostParams& params, const ProblemShape& shape,
                           std::size_t memory_budget_bytes, bool allow_reassociation) {
  const auto all = predict_all(params, shape, allow_reassociation);
  const Prediction* best = nullptr;
  std::size_t least_memory = std::numeric_limits<std::size_t>::max();
  for (const Prediction& p : all) {
    least_memory = std::min(least_memory, p.peak_extra_bytes);
    if (memory_budget_bytes != 0 && p.peak_extra_bytes > memory_budget_bytes) continue;
    if (best == nullptr || p.seconds < best->seconds) best = &p;
  }
  if (best == nullptr) {
    std::ostringstream os;
    os << "memory_budget_bytes is " << memory_budget_bytes
       << ", expected at least the smallest protocol's need of " << least_memory << " bytes";
    throw InvalidArgument(os.str());
  }
  return *best;
}

}  // namespace kdacp
