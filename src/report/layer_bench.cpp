#include "kdacp/report/layer_bench.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <sstream>

#include <fmt/format.h>

#include "kdacp/admission.hpp"
#include "kdacp/error.hpp"
#include "kdacp/job.hpp"
#include "kdacp/report/packing.hpp"
#include "kdacp/testing/synthetic.hpp"
#include "kdacp/thread_pool.hpp"

namespace kdacp::report {

using job::LayerJob;
using job::LayerOutputs;
using job::LayerRunOptions;

namespace {

struct Timing {
  double forward = 0, backward = 0, exchange = 0, summary = 0;
  job::LayerPhases phases;
  double total() const { return forward + backward; }
};

// The run with the median forward+backward time (the lower one of an even count).
Timing median(std::vector<Timing> runs) {
  std::sort(runs.begin(), runs.end(), [](const Timing& a, const Timing& b) { return a.total() < b.total(); });
  return runs[(runs.size() - 1) / 2];
}

void check(const LayerBenchConfig& c) {
  kda::validate(c.shape);
  if (c.algorithms.empty()) throw InvalidArgument("bench_layer: no algorithms, expected at least one");
  if (c.repeats == 0) throw InvalidArgument("bench_layer: repeats = 0, expected >= 1");
  if (!c.single && c.ranks == 0)
    throw InvalidArgument("bench_layer: neither the one-rank run nor a context-parallel one (ranks = 0)");
  if (c.ranks > c.shape.tokens) {
    std::ostringstream what;
    what << "bench_layer: P = " << c.ranks << " ranks for T = " << c.shape.tokens
         << " tokens, expected at most one rank per token";
    throw InvalidArgument(what.str());
  }
  packed_sequences(Packing{{}, c.docs}, c.shape.batch, c.shape.tokens);
  if (c.ulysses != 1 && c.ranks == 0)
    throw InvalidArgument("bench_layer: a Ulysses width without context-parallel runs (ranks = 0)");
}

// The sweep's layout and the exchange options of its runs
// (layer_exchange_options: the contiguous layout, the cuts of the packing).
struct CpSetup {
  std::vector<std::int64_t> cu;
  kda::Layout layout;
  ExchangeOptions options;
};
CpSetup cp_setup(const LayerBenchConfig& c) {
  const kda::Shape& s = c.shape;
  CpSetup out{c.docs > 0 ? packed_cu_seqlens(Packing{{}, c.docs}, s.batch, s.tokens, c.seed)
                         : std::vector<std::int64_t>{},
              kda::Layout::contiguous(s.tokens, c.ranks), {}};
  const kda::Sequences seqs =
      out.cu.empty() ? kda::Sequences(s.batch, s.tokens) : kda::Sequences(s.batch, s.tokens, std::span(out.cu));
  out.options = job::layer_exchange_options(c.exchange, s, DType::f32, out.layout, seqs);
  return out;
}

// The Ulysses width of the "cp ulysses" runs (config.ulysses resolved and
// checked against P, H and HV); 1 when there are none.
std::size_t ulysses_width(const LayerBenchConfig& c) {
  if (c.ulysses == 1) return 1;
  const CpSetup setup = cp_setup(c);
  const std::size_t width = job::resolve_ulysses(c.ulysses, c.method, c.shape, setup.layout, setup.options,
                                                 sizeof(float));
  job::check_ulysses(width, c.ranks, c.shape);
  return width;
}

std::size_t cp_threads(const LayerBenchConfig& c) {
  return c.threads_per_rank ? c.threads_per_rank : ThreadPool::default_threads(c.ranks);
}

}  // namespace

std::string layer_run_label(const std::string& mode, std::size_t ulysses) {
  if (mode == "single") return "one rank";
  if (mode == "cp") return "context-parallel";
  if (mode == "cp deterministic") return "deterministic CP";
  return fmt::format("Ulysses U={} x CP", ulysses);
}

LayerBenchResult bench_layer(const LayerBenchConfig& c, const LayerBenchProgress& progress) {
  check(c);
  const std::size_t width = ulysses_width(c);
  const kda::Shape& s = c.shape;
  LayerJob<float> job;
  job.data = kda::synthetic_layer<float>(s, c.seed);
  job.scale = kda::default_scale<float>(s.key_dim);
  job.d_o = kda::synthetic_tensor<float>(s.v_elems(), c.seed + 1);
  job.final_states = false;
  job.keep_forward = c.keep_forward;
  job.warmup_steps = c.warmup_steps;
  if (c.docs > 0) job.cu_seqlens = packed_cu_seqlens(Packing{{}, c.docs}, s.batch, s.tokens, c.seed);
  job.sequences();

  const std::size_t hw = ThreadPool::default_threads(1);
  const std::size_t single_threads = c.threads ? c.threads : hw;
  LayerBenchResult result;
  result.peak = measure_fma_peak(hw, c.peak_seconds);
  const double flops = kda::forward_flops(s, false) + kda::backward_flops(s, false);

  std::vector<std::string> modes;
  if (c.single) modes.emplace_back("single");
  if (c.ranks > 0) modes.emplace_back("cp");
  if (c.ranks > 0 && c.deterministic) modes.emplace_back("cp deterministic");
  if (c.ulysses != 1) modes.emplace_back("cp ulysses");
  const std::size_t total = modes.size() * c.repeats * c.algorithms.size() * (c.cold ? 2 : 1);
  std::size_t done = 0;
  for (const std::string& mode : modes) {
    const bool cp = mode != "single";
    job.deterministic = mode == "cp deterministic";
    LayerRunOptions opts;
    opts.method = c.method;
    opts.group_size = c.group_size;
    opts.exchange = c.exchange;
    opts.threads_per_rank = cp_threads(c);
    opts.ulysses = mode == "cp ulysses" ? width : 1;
    std::vector<std::vector<Timing>> times(c.algorithms.size());
    std::vector<std::vector<Timing>> cold(c.algorithms.size());
    std::vector<LayerOutputs<float>> outputs(c.algorithms.size());
    std::vector<std::string> methods(c.algorithms.size(), "none");
    // Interleaved, so that a slow spell of a shared machine hits every
    // algorithm alike.
    for (std::size_t rep = 0; rep < c.repeats; ++rep) {
      for (std::size_t a = 0; a < c.algorithms.size(); ++a) {
        job.algorithm = c.algorithms[a];
        const auto run = [&] {
          return cp ? job::run_context_parallel(job, c.ranks, opts, c.timeout_s) : job::run_single(job, single_threads);
        };
        if (c.cold) {
          job.warmup_steps = 0;  // the timed step is the fresh layer's first
          const LayerOutputs<float> first = run();
          job.warmup_steps = c.warmup_steps;
          cold[a].push_back(Timing{first.forward_seconds, first.backward_seconds, 0, 0, first.phases});
          if (progress) progress(mode, c.algorithms[a], cold[a].back().total(), ++done, total);
        }
        LayerOutputs<float> out =
            run();
        const Timing t{out.forward_seconds, out.backward_seconds, out.exchange_seconds, out.summary_seconds,
                       out.phases};
        times[a].push_back(t);
        if (cp) methods[a] = out.method;
        if (rep == 0) outputs[a] = std::move(out);  // results are the same bits every run
        if (progress) progress(mode, c.algorithms[a], t.total(), ++done, total);
      }
    }
    const Timing base = median(times[0]);
    for (std::size_t a = 0; a < c.algorithms.size(); ++a) {
      LayerBenchRecord r;
      r.mode = mode;
      r.algorithm = c.algorithms[a];
      r.ranks = cp ? c.ranks : 1;
      r.threads_per_rank = cp ? opts.threads_per_rank : single_threads;
      r.method = methods[a];
      r.ulysses = opts.ulysses;
      const Timing t = median(times[a]);
      r.forward_seconds = t.forward;
      r.backward_seconds = t.backward;
      r.exchange_seconds = t.exchange;
      r.summary_seconds = t.summary;
      r.phases = t.phases;
      if (c.cold) {
        const Timing first = median(cold[a]);
        r.cold_seconds = first.total();
        r.cold_phases = first.phases;
      }
      r.flops = flops;
      r.gflops = flops / t.total() / 1e9;
      r.peak_fraction = r.gflops / result.peak.gflops;
      r.speedup = base.total() / t.total();
      r.rel_errors = job::relative_errors(outputs[a], outputs[0]);
      r.tolerance = job::layer_error_tolerance(r.method, r.ranks, s.key_dim);
      for (double e : r.rel_errors)
        r.max_rel_error = std::isnan(e) || std::isnan(r.max_rel_error) ? std::numeric_limits<double>::quiet_NaN()
                                                                        : std::max(r.max_rel_error, e);
      result.records.push_back(std::move(r));
    }
  }
  return result;
}

std::vector<std::string> layer_bench_failures(const LayerBenchResult& result) {
  std::vector<std::string> out;
  const std::string baseline =
      result.records.empty() ? "" : kda::algorithm_name(result.records.front().algorithm);
  for (const LayerBenchRecord& r : result.records) {
    std::string what;
    for (const std::string& e : job::errors_above(r.rel_errors, r.tolerance)) what += (what.empty() ? "" : ", ") + e;
    if (!what.empty())
      out.push_back(layer_run_label(r.mode, r.ulysses) + " " + kda::algorithm_name(r.algorithm) + " vs " + baseline +
                    ": " + what);
  }
  return out;
}

double layer_bench_bytes(const LayerBenchConfig& c) {
  const kda::Shape& s = c.shape;
  const double out = job::layer_output_bytes(s, true, sizeof(float));
  // The job: q, k, v, g, beta (as large as their gradients) and d_o.
  const double job = out + double(s.batch) * double(s.tokens) * double(s.value_heads) * double(s.value_dim) * 4;
  const double kept = double(c.algorithms.size() + 1) * out;
  const std::size_t sequences = c.docs > 0 ? c.docs : s.batch;
  double run = c.single ? job::layer_run_bytes(s, sequences, 1, true, sizeof(float), 0) : 0.0;
  if (c.ranks > 0) {
    // The exchange bench_layer's runs build.
    const CpSetup setup = cp_setup(c);
    const ExchangeOptions& eo = setup.options;
    const ProblemShape ps = job::layer_problem_shape(s, sizeof(float), setup.layout, eo.expected_cuts);
    const Prediction pred = predict_exchange(ps, c.method, c.group_size, eo);
    run = std::max(run, job::layer_run_bytes(s, sequences, c.ranks, true, sizeof(float), exchange_rank_bytes(ps, pred)));
    // The Ulysses runs' extra per rank (the widest U that fits, for auto),
    // beside their state CP over P/U ranks, which moves less than P's.
    double extra = 0;
    for (std::size_t u = 2; u <= c.ranks; ++u) {
      if (c.ulysses == 1 || (c.ulysses != job::kUlyssesAuto && u != c.ulysses)) continue;
      if (c.ranks % u != 0 || s.heads % u != 0 || s.value_heads % u != 0) continue;
      extra = std::max(extra, job::ulysses_rank_bytes(s, sequences, setup.layout, u, true, sizeof(float)));
    }
    run += double(c.ranks) * extra;
  }
  // One forward cache at a time (the largest: the one-rank run's whole stream).
  const bool chunk = std::find(c.algorithms.begin(), c.algorithms.end(), kda::Algorithm::chunk) != c.algorithms.end();
  const double cache = c.keep_forward && chunk
                           ? job::layer_cache_bytes(s, kda::Algorithm::chunk, s.tokens, sequences + c.ranks, sizeof(float))
                           : 0.0;
  return job + kept + run + cache;
}

}  // namespace kdacp::report
