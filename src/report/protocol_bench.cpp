#include "kdacp/report/protocol_bench.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <thread>

#include "kdacp/calibrate.hpp"
#include "kdacp/exchange.hpp"
#include "kdacp/inprocess.hpp"
#include "kdacp/mesh.hpp"
#include "kdacp/protocol.hpp"
#include "kdacp/testing/synthetic.hpp"
#include "kdacp/thread_pool.hpp"

namespace kdacp::report {
namespace {

// pipelined_p2p's column segments in this bench (at most ceil(V/16)).
constexpr std::size_t kBenchSegments = 4;

// Every exact row of the registry; a group size of 2 and of P/2 when those
// are proper divisors (w = 1 and w = P are the chain and allgather), and
// kBenchSegments segments for rows that take them.
std::vector<ProtocolConfig> variants(std::size_t p, std::size_t v) {
  const std::size_t c = std::min(kBenchSegments, max_segments(v));
  std::vector<ProtocolConfig> out;
  for (const ProtocolDescriptor* row : protocol_registry()) {
    if (!row->exact()) continue;
    const std::string m(row->name);
    if (!row->takes_group_size) {
      out.push_back({m, 1, row->takes_segments ? c : 0});
      continue;
    }
    for (std::size_t w : {std::size_t{2}, p / 2})
      if (w > 1 && w < p && p % w == 0 && std::none_of(out.begin(), out.end(), [&](const ProtocolConfig& x) {
            return x.method == m && x.group_size == w;
          }))
        out.push_back({m, w, 0});
  }
  return out;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

}  // namespace

double step_seconds(std::size_t k, std::size_t slabs, std::size_t threads, Direction dir, double min_time) {
  constexpr std::size_t kSteps = 4;
  const SummaryShape shape{1, slabs, k, k};
  const std::size_t elems = kSteps * shape.state_elems();
  Buffer offsets(elems * sizeof(float)), transfers(elems * sizeof(float));
  Rng rng(slabs);
  for (std::size_t i = 0; i < elems; ++i) transfers.as<float>()[i] = rng.uniform(-1, 1) / float(2 * k);
  for (std::size_t i = 0; i < elems; ++i) offsets.as<float>()[i] = rng.uniform(-1, 1);
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

double memcpy_seconds(std::size_t bytes, double min_time) {
  if (bytes == 0) return 0;
  Buffer src(bytes), dst(bytes);
  std::memset(src.data(), 1, bytes);
  const auto runs = time_runs(min_time, 3, [&] { std::memcpy(dst.data(), src.data(), bytes); });
  return *std::min_element(runs.begin(), runs.end());
}

std::vector<bool> document_cuts(std::size_t parts, std::size_t part_tokens, std::size_t mean_tokens,
                                std::uint64_t seed) {
  std::vector<bool> cuts(parts, false);
  Rng rng(seed);
  std::size_t start = 0;
  while (start < parts * part_tokens) {
    cuts[start / part_tokens] = true;
    // Exponential gaps rounded down, at least one token: geometric lengths.
    const double u = std::max(1e-12, static_cast<double>(rng.uniform(0, 1)));
    start += 1 + static_cast<std::size_t>(-std::log(u) * double(mean_tokens - 1));
  }
  return cuts;
}

RankTimes time_rank(const std::shared_ptr<Communicator>& comm, const ProtocolConfig& var, const SummaryShape& shape,
                    const PartOwners& part_owners, const std::vector<bool>& cuts, ExchangeOptions options,
                    std::size_t warmup, std::size_t calls, double min_time) {
  const std::size_t p = comm->size();
  options.part_owners = part_owners;
  const DeviceMesh mesh = DeviceMesh::create(comm, {p}, {"cp"});
  auto ex = make_state_exchange(mesh, var.method, static_cast<long long>(var.group_size), options);
  RankTimes out;
  out.method = ex->method();
  // This rank's parts (one without a layout), their summaries and flags.
  std::vector<SyntheticSummary> sm, gm;
  std::vector<PartSummary> fparts, bparts;
  for (std::size_t j : ex->own_parts()) {
    sm.push_back(synthetic_summary(shape, 0, j, false));
    gm.push_back(synthetic_summary(shape, 0, j, true));
  }
  for (std::size_t i = 0; i < sm.size(); ++i) {
    const PartFlags flags{!cuts.empty() && cuts[ex->own_parts()[i]]};
    fparts.push_back({sm[i].offset.view(), sm[i].transfer.view(), flags});
    bparts.push_back({gm[i].offset.view(), sm[i].transfer.view(), flags});
  }
  auto once = [&](bool record) {
    comm->barrier();
    const double t0 = comm->now_seconds();
    ex->forward(fparts);
    const double t1 = comm->now_seconds();
    out.forward_peak = std::max(out.forward_peak, ex->last_stats().peak_extra_bytes);
    out.forward_received = ex->last_stats().bytes_received;
    comm->barrier();
    const double t2 = comm->now_seconds();
    ex->backward(bparts);
    const double t3 = comm->now_seconds();
    out.backward_peak = std::max(out.backward_peak, ex->last_stats().peak_extra_bytes);
    out.backward_received = ex->last_stats().bytes_received;
    if (record) out.forward.push_back(t1 - t0), out.backward.push_back(t3 - t2);
    return (t1 - t0) + (t3 - t2);
  };
  double last = 0;
  for (std::size_t it = 0; it < std::max<std::size_t>(warmup, calls == 0 ? 1 : 0); ++it) last = once(false);
  // Every rank must make the same number of collective calls: rank 0 decides.
  std::uint64_t iters = calls;
  if (calls == 0) {
    if (comm->rank() == 0) iters = std::clamp<std::uint64_t>(std::uint64_t(min_time / std::max(last, 1e-6)), 3, 200);
    comm->broadcast(std::as_writable_bytes(std::span(&iters, 1)), 0);
  }
  for (std::uint64_t it = 0; it < iters; ++it) once(true);
  return out;
}

ProtocolTiming slowest_rank(Communicator& comm, const RankTimes& mine) {
  const std::size_t p = comm.size(), calls = mine.forward.size();
  // Per rank: its calls' forward and backward times, then peaks and bytes,
  // gathered on rank 0 by point-to-point messages (an all-gather of P rows
  // costs O(P²) in SMPI's simulation kernel: P = 256 did not finish), which
  // broadcasts the result.
  const std::size_t row = 2 * calls + 4;
  std::vector<double> me(row);
  std::copy(mine.forward.begin(), mine.forward.end(), me.begin());
  std::copy(mine.backward.begin(), mine.backward.end(), me.begin() + static_cast<std::ptrdiff_t>(calls));
  me[2 * calls] = double(mine.forward_peak), me[2 * calls + 1] = double(mine.backward_peak);
  me[2 * calls + 2] = double(mine.forward_received), me[2 * calls + 3] = double(mine.backward_received);
  constexpr int kTag = 1;
  double result[6] = {0, 0, 0, 0, 0, 0};
  if (comm.rank() != 0) {
    comm.isend(std::as_bytes(std::span(me)), 0, kTag)->wait();
  } else {
    std::vector<double> slow_f(calls), slow_b(calls), x(row);
    for (std::size_t r = 0; r < p; ++r) {
      if (r == 0) x = me;
      else comm.irecv(std::as_writable_bytes(std::span(x)), r, kTag)->wait();
      for (std::size_t it = 0; it < calls; ++it) {
        slow_f[it] = std::max(slow_f[it], x[it]);
        slow_b[it] = std::max(slow_b[it], x[calls + it]);
      }
      result[2] = std::max(result[2], x[2 * calls]);
      result[3] = std::max(result[3], x[2 * calls + 1]);
      result[4] += x[2 * calls + 2];
      result[5] += x[2 * calls + 3];
    }
    result[0] = median(slow_f);
    result[1] = median(slow_b);
  }
  comm.broadcast(std::as_writable_bytes(std::span(result)), 0);
  ProtocolTiming m;
  m.forward_seconds = result[0];
  m.backward_seconds = result[1];
  m.forward_peak = std::size_t(result[2]);
  m.backward_peak = std::size_t(result[3]);
  m.forward_received_all = std::size_t(result[4]);
  m.backward_received_all = std::size_t(result[5]);
  return m;
}

ProtocolTiming time_protocol(const ProtocolConfig& var, std::size_t p, const SummaryShape& shape, double min_time,
                             const PartOwners& part_owners, const std::vector<bool>& cuts) {
  ProtocolTiming m;
  const std::size_t threads = ThreadPool::default_threads(p);
  run_in_process(p, [&](const std::shared_ptr<Communicator>& comm) {
    ThreadPool pool(threads);
    ExchangeOptions opts;
    opts.exec.pool = &pool;
    opts.segments = var.segments;
    opts.expected_cuts = cuts;
    const RankTimes mine = time_rank(comm, var, shape, part_owners, cuts, opts, 1, 0, min_time);
    const ProtocolTiming all = slowest_rank(*comm, mine);
    if (comm->rank() == 0) m = all;
  });
  return m;
}

std::vector<ProtocolRecord> bench_protocols(const ProtocolBenchConfig& cfg, const ProtocolBenchProgress& progress) {
  const std::size_t hw = std::max<std::size_t>(std::thread::hardware_concurrency(), 1);
  const std::size_t k = cfg.key_dim;
  std::size_t total = 0, done = 0;
  const std::size_t per_variant = cfg.layouts ? 4 : 1;
  for (std::size_t p : cfg.ranks) total += variants(p, k).size() * cfg.slabs.size() * per_variant;
  std::vector<ProtocolRecord> records;
  for (std::size_t bh : cfg.slabs) {
    const SummaryShape shape{1, bh, k, k};
    for (std::size_t p : cfg.ranks) {
      const std::size_t threads = ThreadPool::default_threads(p);
      const double step_s[2] = {step_seconds(k, bh, threads, Direction::forward, cfg.min_time / 4),
                                step_seconds(k, bh, threads, Direction::backward, cfg.min_time / 4)};
      struct Layout {
        std::string name;
        PartOwners owners;
        std::vector<bool> cuts;
      };
      std::vector<Layout> layouts{{"contiguous", PartOwners::one_per_rank(p), {}}};
      if (cfg.layouts) {
        // T = P·4096 tokens, documents of mean T/(2P) = 2048 tokens.
        constexpr std::size_t kPart = 4096;
        layouts.push_back({"cuts", PartOwners::one_per_rank(p), document_cuts(p, kPart, kPart / 2, cfg.cut_seed + p)});
        layouts.push_back({"zigzag", PartOwners::zigzag(p), {}});
        layouts.push_back({"zigzag+cuts", PartOwners::zigzag(p),
                           document_cuts(2 * p, kPart / 2, kPart / 2, cfg.cut_seed + p)});
      }
      for (const ProtocolConfig& var : variants(p, k)) {
        double contiguous[2] = {0, 0};
        for (const Layout& layout : layouts) {
          if (!layout.owners.is_one_per_rank() && !find_protocol(var.method).takes_layouts) continue;
          const ProtocolTiming got = time_protocol(var, p, shape, cfg.min_time, layout.owners, layout.cuts);
          ProblemShape ps{p, bh, k, k, sizeof(float)};
          ps.part_owners = layout.owners;
          ps.part_cuts = layout.cuts;
          const CostTerms terms = find_protocol(var.method).cost(ps, var);
          const auto recv = static_cast<std::size_t>(terms.bytes + terms.group_bytes);
          const double copy_s = memcpy_seconds(recv, cfg.min_time / 8);
          for (Direction dir : cfg.directions) {
            const bool fw = dir == Direction::forward;
            ProtocolRecord rec{var, p, bh, k, threads, dir};
            rec.seconds = fw ? got.forward_seconds : got.backward_seconds;
            rec.peak_extra_bytes = fw ? got.forward_peak : got.backward_peak;
            rec.theoretical_extra_bytes = terms.peak_extra_bytes;
            rec.floor_seconds = terms.folds * step_s[fw ? 0 : 1] + copy_s;
            // Core-seconds of all ranks' steps and of all ranks' copies (every
            // received byte is one memcpy in-process, at the speed measured on
            // the critical path's bytes) spread over the host's cores.
            const std::size_t recv_all = fw ? got.forward_received_all : got.backward_received_all;
            const double copy_all_s = recv > 0 ? copy_s * double(recv_all) / double(recv) : 0.0;
            rec.host_floor_seconds =
                std::max(rec.floor_seconds, (terms.work_folds * step_s[fw ? 0 : 1] * double(threads) + copy_all_s) /
                                                double(std::min(hw, p * threads)));
            rec.layout = layout.name;
            rec.chain_steps = chain_profile(ps, 1).steps;
            if (layout.name == "contiguous") contiguous[fw ? 0 : 1] = rec.seconds;
            rec.vs_contiguous = contiguous[fw ? 0 : 1] > 0 ? rec.seconds / contiguous[fw ? 0 : 1] : 0.0;
            records.push_back(rec);
          }
          ++done;
          if (progress) progress(var, p, bh, got.forward_seconds, got.backward_seconds, done, total);
        }
      }
    }
  }
  return records;
}

}  // namespace kdacp::report
