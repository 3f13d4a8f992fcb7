// `kdacp bench protocols`: forward and backward time of every exact protocol
// on in-process ranks, beside its floor and its peak extra memory beside the
// theoretical one.
//
// Floor. Every exact protocol performs the chain's operations in the chain's
// order (SPEC §5), so P-2 affine steps over all B·H slabs are sequenced on its
// critical path, whoever computes them (the last rank's merge for allgather,
// one hop per rank for p2p, the block owners then the last block for grouped).
// pipelined_p2p cuts the columns into c independent segments, so its path is
// (P-2 + c-1) steps of 1/c of the columns. The floor is those steps at the
// kernel speed measured in the same run, plus the bytes received on the
// critical path at the memcpy speed measured on exactly that many bytes (the
// in-process transport is a memcpy):
//   allgather  (P-1) packed [S|M] slots
//   p2p        (P-1) states, one per hop (pipelined: the same bytes)
//   grouped w  (w-1) packed slots (the group gather) + P/w states (the
//              owners' relay and the broadcast inside the last block)
// The floor assumes a core per rank. With more ranks than cores (P = 4 or
// more on a 2-core host) the ranks' total work — every rank's fold steps and
// every rank's received bytes, each a memcpy in-process — spread over the
// host's cores is the bound instead when larger; it is reported as
// host_floor_seconds. The reassociating protocols perform other
// operations (a log-depth scan) and are measured against the cost model by
// `kdacp calibrate`/`kdacp plan`, not here.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <span>
#include <thread>

#include "bench.hpp"
#include "kdacp/exchange.hpp"
#include "kdacp/inprocess.hpp"
#include "kdacp/mesh.hpp"
#include "kdacp/synthetic.hpp"
#include "kdacp/thread_pool.hpp"

namespace kdacp::cli {
namespace {

using clock = std::chrono::steady_clock;

// pipelined_p2p's column segments in this bench (at most V/16).
constexpr std::size_t kBenchSegments = 4;

struct Variant {
  std::string method;
  std::size_t width;     // allgather group size (1 except for grouped)
  std::size_t segments;  // pipelined_p2p's c (0 otherwise)
  std::string label() const {
    if (method == "grouped_allgather_p2p") return method + "(w=" + std::to_string(width) + ")";
    if (segments) return method + "(c=" + std::to_string(segments) + ")";
    return method;
  }
};

// Every exact protocol of the factory table; grouped with w = 2 and w = P/2
// when those are proper divisors (w = 1 and w = P are the chain and allgather).
std::vector<Variant> variants(std::size_t p, std::size_t v) {
  const std::size_t c = std::min(kBenchSegments, v / 16);
  std::vector<Variant> out;
  for (const MethodInfo& info : exchange_method_info()) {
    if (info.chooser || !info.exact) continue;
    const std::string& m = info.name;
    if (!info.takes_group_size) {
      out.push_back({m, 1, info.takes_segments ? c : 0});
      continue;
    }
    for (std::size_t w : {std::size_t{2}, p / 2})
      if (w > 1 && w < p && p % w == 0 &&
          std::none_of(out.begin(), out.end(), [&](const Variant& v) { return v.method == m && v.width == w; }))
        out.push_back({m, w, 0});
  }
  return out;
}

// Affine steps each rank computes in one forward call (backward mirrors it).
std::size_t steps_of_rank(const Variant& var, std::size_t p, std::size_t r) {
  if (var.method == "p2p" || var.method == "pipelined_p2p") return r >= 1 && r + 1 < p ? 1 : 0;
  if (var.method == "allgather") return r >= 2 ? r - 1 : 0;
  const std::size_t w = var.width, block = r / w, local = r % w, blocks = p / w;
  const bool has_incoming = block > 0;
  if (local == w - 1 && block + 1 < blocks) return has_incoming ? w : w - 1;
  return has_incoming ? local : (local >= 2 ? local - 1 : 0);
}

// Seconds of one affine step over `slabs` slabs with `threads` threads: the
// kernel speed the floor is built from, measured on a short chain.
double step_seconds(std::size_t k, std::size_t slabs, std::size_t threads, Direction dir, double min_time) {
  constexpr std::size_t kSteps = 4;
  const SummaryShape shape{1, slabs, k, k};
  Buffer offsets(kSteps * shape.state_elems()), transfers(kSteps * shape.state_elems());
  Rng rng(slabs);
  for (std::size_t i = 0; i < transfers.size(); ++i) transfers.data()[i] = rng.uniform(-1, 1) / float(2 * k);
  for (std::size_t i = 0; i < offsets.size(); ++i) offsets.data()[i] = rng.uniform(-1, 1);
  State in(1, slabs, k, k), out(1, slabs, k, k);
  Slots slots;
  slots.offsets = {StateView::dense(offsets.data(), 1, slabs, k, k), kSteps, shape.state_elems()};
  slots.transfers = {StateView::dense(transfers.data(), 1, slabs, k, k), kSteps, shape.state_elems()};
  ThreadPool pool(threads);
  const ExecPolicy policy{&pool, KernelKind::best};
  const StateView iv = in.view();
  const std::size_t first = dir == Direction::forward ? 0 : kSteps - 1;
  auto run = [&] { scan(slots, first, kSteps, dir, &iv, out.view(), std::nullopt, nullptr, policy); };
  run();
  const auto runs = time_runs(min_time, 3, run);
  return *std::min_element(runs.begin(), runs.end()) / double(kSteps);
}

// Seconds to memcpy `bytes` once (best of several), the in-process transport's cost.
double memcpy_seconds(std::size_t bytes, double min_time) {
  if (bytes == 0) return 0;
  Buffer src((bytes + sizeof(float) - 1) / sizeof(float)), dst(src.size());
  std::memset(src.data(), 1, bytes);
  const auto runs = time_runs(min_time, 3, [&] { std::memcpy(dst.data(), src.data(), bytes); });
  return *std::min_element(runs.begin(), runs.end());
}

struct Measured {
  double fwd_s = 0, bwd_s = 0;
  std::size_t fwd_peak = 0, bwd_peak = 0;
  // Bytes received by all ranks together in one call (each a memcpy in-process).
  std::size_t fwd_recv_all = 0, bwd_recv_all = 0;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// One protocol on P in-process ranks: per iteration the slowest rank's time
// (every rank starts after a barrier), median over the iterations; peak
// extra bytes are the largest of any rank.
Measured measure(const Variant& var, std::size_t p, const SummaryShape& shape, double min_time) {
  std::vector<std::vector<double>> fwd(p), bwd(p);
  std::vector<std::size_t> peak_f(p), peak_b(p), recv_f(p), recv_b(p);
  const std::size_t threads = ThreadPool::default_threads(p);
  run_in_process(p, [&](const std::shared_ptr<Communicator>& comm) {
    const std::size_t r = comm->rank();
    const SyntheticSummary sm = synthetic_summary(shape, 0, r, false);
    const SyntheticSummary gm = synthetic_summary(shape, 0, r, true);
    ThreadPool pool(threads);
    ExchangeOptions opts;
    opts.exec.pool = &pool;
    opts.segments = var.segments;
    const DeviceMesh mesh = DeviceMesh::create(comm, {p}, {"cp"});
    auto ex = make_state_exchange(mesh, var.method, static_cast<long long>(var.width), opts);
    auto once = [&](bool record) {
      comm->barrier();
      const auto t0 = clock::now();
      State in = ex->forward(sm.offset.view(), sm.transfer.view());
      const auto t1 = clock::now();
      peak_f[r] = std::max(peak_f[r], ex->last_stats().peak_extra_bytes);
      recv_f[r] = ex->last_stats().bytes_received;
      comm->barrier();
      const auto t2 = clock::now();
      State g = ex->backward(gm.offset.view(), sm.transfer.view());
      const auto t3 = clock::now();
      peak_b[r] = std::max(peak_b[r], ex->last_stats().peak_extra_bytes);
      recv_b[r] = ex->last_stats().bytes_received;
      const double f = std::chrono::duration<double>(t1 - t0).count();
      const double b = std::chrono::duration<double>(t3 - t2).count();
      if (record) fwd[r].push_back(f), bwd[r].push_back(b);
      return f + b;
    };
    // Rank 0 sizes the run from a warm-up call; every rank must make the
    // same number of collective calls.
    std::uint64_t iters = 0;
    const double warm = once(false);
    if (r == 0) iters = std::clamp<std::uint64_t>(std::uint64_t(min_time / std::max(warm, 1e-6)), 3, 200);
    comm->broadcast(std::as_writable_bytes(std::span(&iters, 1)), 0);
    for (std::uint64_t it = 0; it < iters; ++it) once(true);
  });
  Measured m;
  std::vector<double> slow_f(fwd[0].size()), slow_b(bwd[0].size());
  for (std::size_t it = 0; it < slow_f.size(); ++it)
    for (std::size_t r = 0; r < p; ++r) {
      slow_f[it] = std::max(slow_f[it], fwd[r][it]);
      slow_b[it] = std::max(slow_b[it], bwd[r][it]);
    }
  m.fwd_s = median(slow_f);
  m.bwd_s = median(slow_b);
  m.fwd_peak = *std::max_element(peak_f.begin(), peak_f.end());
  m.bwd_peak = *std::max_element(peak_b.begin(), peak_b.end());
  for (std::size_t r = 0; r < p; ++r) m.fwd_recv_all += recv_f[r], m.bwd_recv_all += recv_b[r];
  return m;
}

}  // namespace

nlohmann::json run_protocol_bench(const BenchConfig& cfg) {
  const std::size_t hw = std::max<std::size_t>(std::thread::hardware_concurrency(), 1);
  const std::size_t k = cfg.key_dim;
  std::size_t total = 0, done = 0;
  for (std::size_t p : cfg.ranks) total += variants(p, k).size() * cfg.bhs.size();
  nlohmann::json records = nlohmann::json::array();
  for (std::size_t bh : cfg.bhs) {
    const SummaryShape shape{1, bh, k, k};
    const std::size_t state_bytes = shape.state_elems() * sizeof(float);
    const std::size_t packed_bytes = shape.packed_elems() * sizeof(float);
    for (std::size_t p : cfg.ranks) {
      const std::size_t threads = ThreadPool::default_threads(p);
      double step_s[2];
      step_s[0] = step_seconds(k, bh, threads, Direction::forward, cfg.min_time / 4);
      step_s[1] = step_seconds(k, bh, threads, Direction::backward, cfg.min_time / 4);
      for (const Variant& var : variants(p, k)) {
        const Measured got = measure(var, p, shape, cfg.min_time);
        const std::size_t w = var.width;
        std::size_t recv = 0, theory = 0;
        if (var.method == "allgather") {
          recv = (p - 1) * packed_bytes;
          theory = p * packed_bytes;
        } else if (var.method == "p2p" || var.method == "pipelined_p2p") {
          recv = (p - 1) * state_bytes;
          theory = 2 * state_bytes;
        } else {
          recv = (w - 1) * packed_bytes + (p / w) * state_bytes;
          theory = w * packed_bytes + 2 * state_bytes;
        }
        const double copy_s = memcpy_seconds(recv, cfg.min_time / 8);
        std::size_t all_steps = 0;
        for (std::size_t r = 0; r < p; ++r) all_steps += steps_of_rank(var, p, r);
        double path_steps = p >= 2 ? double(p - 2) : 0.0;
        if (var.segments > 1 && p >= 3)
          path_steps = double(p - 2 + var.segments - 1) / double(var.segments);
        for (std::size_t di = 0; di < 2; ++di) {
          const std::string dname = di == 0 ? "forward" : "backward";
          if (std::find(cfg.directions.begin(), cfg.directions.end(), dname) == cfg.directions.end()) continue;
          const double seconds = di == 0 ? got.fwd_s : got.bwd_s;
          const std::size_t peak = di == 0 ? got.fwd_peak : got.bwd_peak;
          const double floor_s = path_steps * step_s[di] + copy_s;
          // Core-seconds of all ranks' steps and of all ranks' copies (every
          // received byte is one memcpy in-process, at the speed measured on
          // the critical path's bytes) spread over the host's cores.
          const std::size_t recv_all = di == 0 ? got.fwd_recv_all : got.bwd_recv_all;
          const double copy_all_s = recv > 0 ? copy_s * double(recv_all) / double(recv) : 0.0;
          const double host_s = std::max(
              floor_s, (double(all_steps) * step_s[di] * double(threads) + copy_all_s) /
                           double(std::min(hw, p * threads)));
          records.push_back({{"mode", "protocols"},
                             {"protocol", var.label()},
                             {"method", var.method},
                             {"group_size", w},
                             {"P", p},
                             {"BH", bh},
                             {"K", k},
                             {"V", k},
                             {"threads_per_rank", threads},
                             {"direction", dname},
                             {"seconds", seconds},
                             {"floor_seconds", floor_s},
                             {"ratio_to_floor", floor_s > 0 ? seconds / floor_s : 0.0},
                             {"host_floor_seconds", host_s},
                             {"ratio_to_host_floor", host_s > 0 ? seconds / host_s : 0.0},
                             {"peak_extra_bytes", peak},
                             {"theoretical_extra_bytes", theory},
                             {"memory_ratio", double(peak) / double(theory)}});
        }
        ++done;
        if (cfg.progress)
          std::fprintf(stderr, "kdacp bench: [%zu/%zu] P=%zu B·H=%zu %s: fwd %.3f ms, bwd %.3f ms\n", done,
                       total, p, bh, var.label().c_str(), got.fwd_s * 1e3, got.bwd_s * 1e3);
      }
    }
  }
  return records;
}

}  // namespace kdacp::cli
