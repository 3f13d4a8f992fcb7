// `kdacp run`: the main job. The context-parallel KDA layer, forward and
// backward, for every protocol on in-process ranks or one process per rank
// under mpirun, over one sequence per row or packed sequences with initial
// and final states, in a contiguous or zigzag layout, against the layer on
// one device: time, the exchange's share, errors of o, every gradient, ht
// and dh0, and whether results are bitwise equal across exact protocols.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "backend.hpp"
#include "commands.hpp"
#include "kdacp/error.hpp"
#include "kdacp/testing/bench.hpp"
#include "kdacp/job.hpp"
#include "kdacp/testing/synthetic.hpp"
#include "kdacp/thread_pool.hpp"
#include "flags.hpp"
#include "kdacp/admission.hpp"
#include "layer_flags.hpp"
#include "table.hpp"

namespace kdacp::cli {
namespace {

using job::LayerOutputs;

// Untimed forward+backward steps before each timed one (LayerJob::warmup_steps).
constexpr std::size_t kWarmupSteps = 1;

struct RunConfig {
  LaunchOptions backend;
  std::size_t batch = 1, tokens = 8192, heads = 4, value_heads = 0, key_dim = 128, value_dim = 128;
  bool tokens_given = false;
  PackingFlags packing;
  LayoutFlags layout;
  kda::Algorithm algorithm = defaults::kAlgorithm;
  std::uint64_t seed = 0;
  std::size_t threads = 0;
  bool json = false, recompute = !defaults::kKeepForward;
  std::string max_memory;

  bool packed() const { return packing.packed(); }
};

// The table and the JSON records, one row per run, against the single-rank
// layer; the flop counts turn times into GFLOP/s and a share of the peak.
struct Report {
  const LayerOutputs<float>& single;
  double one_flops, cp_flops;
  PeakResult peak;
  bool states;           // ht and dh0 columns
  std::size_t key_dim;   // K, for a reassociating protocol's error bound
  Table table{header(states)};
  nlohmann::json records = nlohmann::json::array();
  double worst = 0;  // NaN when any error is
  // Rows with an error that is NaN or above its tolerance: "label: dg 1.9".
  std::vector<std::string> failures{};

  static std::vector<std::string> header(bool states) {
    std::vector<std::string> h{"protocol", "fwd ms", "bwd ms", "exchange", "GFLOP/s", "% peak",
                               "o",        "dq",     "dk",     "dv",       "dg",      "dbeta"};
    if (states) h.insert(h.end(), {"ht", "dh0"});
    h.push_back("bitwise");
    return h;
  }

  // A protocol that did not run, with the reason.
  void skip(const std::string& name, const std::string& why) {
    std::vector<std::string> row{name, why};
    row.resize(header(states).size(), "-");
    table.add(row);
    records.push_back({{"protocol", name}, {"skipped", why}});
  }

  void add(const std::string& name, const LayerOutputs<float>& o, bool is_single, const std::string& bitwise) {
    const double gflops = (is_single ? one_flops : cp_flops) / (o.forward_seconds + o.backward_seconds) / 1e9;
    const double share = is_single ? 0.0 : o.exchange_seconds / (o.forward_seconds + o.backward_seconds);
    const std::vector<double> errs = job::relative_errors(o, single);
    const double tolerance = is_single ? 0.0 : job::layer_error_tolerance(o.method, o.ranks, key_dim);
    if (!is_single) {
      for (double e : errs) worst = std::isnan(e) || std::isnan(worst) ? e + worst : std::max(worst, e);
      const std::vector<std::string> above = job::errors_above(errs, tolerance);
      std::string what;
      for (const std::string& a : above) what += (what.empty() ? "" : ", ") + a;
      if (!what.empty()) failures.push_back(name + ": " + what);
    }
    std::vector<std::string> row{name, fmt("%.1f", o.forward_seconds * 1e3), fmt("%.1f", o.backward_seconds * 1e3),
                                 is_single ? "-" : fmt("%.1f%%", share * 100), fmt("%.1f", gflops),
                                 fmt("%.1f%%", 100 * gflops / peak.gflops)};
    for (double e : errs) row.push_back(is_single ? "-" : fmt("%.1e", e));
    row.push_back(bitwise);
    table.add(row);
    nlohmann::json rel = {{"o", errs[0]}, {"dq", errs[1]}, {"dk", errs[2]}, {"dv", errs[3]},
                          {"dg", errs[4]}, {"dbeta", errs[5]}};
    if (states) {
      rel["ht"] = errs.at(6);
      rel["dh0"] = errs.at(7);
    }
    records.push_back({{"protocol", name},
                       {"forward_seconds", o.forward_seconds}, {"backward_seconds", o.backward_seconds},
                       {"exchange_share", share}, {"gflops", gflops}, {"peak_fraction", gflops / peak.gflops},
                       {"rel_error", rel}, {"tolerance", tolerance},
                       {"bitwise_equal_across_exact", bitwise == "yes"}});
  }
};

// How the run is set up, for the header line and the JSON.
struct RunSetup {
  std::string backend, layout, algorithm;
  std::size_t ranks = 1, per_rank = 1;
  std::vector<std::int64_t> cu_seqlens;
  std::size_t warmup_steps = 0;  // untimed steps before each timed one (LayerJob::warmup_steps)
};

void print(const RunConfig& cfg, const kda::Shape& shape, const RunSetup& setup, const Report& rep,
           bool all_bitwise) {
  const PeakResult& peak = rep.peak;
  const std::size_t per_rank = setup.per_rank;
  if (cfg.json) {
    nlohmann::json j = {{"command", "run"}, {"algorithm", setup.algorithm}, {"backend", setup.backend},
                        {"layout", setup.layout},
                        {"P", setup.ranks}, {"B", shape.batch}, {"T", shape.tokens}, {"H", shape.heads},
                        {"HV", shape.value_heads}, {"K", shape.key_dim}, {"V", shape.value_dim},
                        {"threads_per_rank", per_rank}, {"peak_gflops", peak.gflops},
                        {"peak_threads", peak.threads}, {"simd_target", peak.target},
                        {"layer_flops_context_parallel", rep.cp_flops}, {"layer_flops_single", rep.one_flops},
                        {"protocols", rep.records},
                        {"max_rel_error", std::isnan(rep.worst) ? nlohmann::json(nullptr) : nlohmann::json(rep.worst)},
                        {"within_tolerance", rep.failures.empty()}, {"warmup_steps", setup.warmup_steps},
                        {"bitwise_equal_across_exact", all_bitwise}};
    if (!setup.cu_seqlens.empty()) j["cu_seqlens"] = setup.cu_seqlens;
    std::printf("%s\n", j.dump(2).c_str());
    return;
  }
  std::printf("kdacp run: KDA layer forward+backward, %s algorithm, float32, B=%zu T=%zu H=%zu HV=%zu K=%zu "
              "V=%zu, P=%zu %s ranks x %zu threads, %s layout; times: steady state, each configuration's "
              "timed step after %zu untimed step%s on the same layer\n",
              setup.algorithm.c_str(), shape.batch, shape.tokens, shape.heads, shape.value_heads, shape.key_dim,
              shape.value_dim, setup.ranks, setup.backend == "inprocess" ? "in-process" : setup.backend.c_str(),
              per_rank, setup.layout.c_str(), setup.warmup_steps, setup.warmup_steps == 1 ? "" : "s");
  if (!setup.cu_seqlens.empty()) {
    std::ostringstream lens;
    for (std::size_t n = 0; n + 1 < setup.cu_seqlens.size(); ++n) {
      if (n == 8 && setup.cu_seqlens.size() > 11) {
        lens << ", ...";
        break;
      }
      lens << (n ? ", " : "") << setup.cu_seqlens[n + 1] - setup.cu_seqlens[n];
    }
    std::printf("%zu packed sequences of lengths %s; random h0 and dht; ht and dh0 against one device\n",
                setup.cu_seqlens.size() - 1, lens.str().c_str());
  }
  std::printf("\n");
  rep.table.print();
  std::printf("\nerrors: relative Frobenius vs the single-rank layer (same algorithm); exchange: share of layer "
              "time in the state exchange;\nGFLOP/s: the recurrent algorithm's flops per forward+backward (%.2f "
              "GFLOP on one device, %.2f with the CP summaries and G pass) / wall time, for either algorithm;\n"
              "%% peak: of the FP32 FMA peak measured in this run, %.1f GFLOP/s on %zu threads (%s)\n",
              rep.one_flops / 1e9, rep.cp_flops / 1e9, peak.gflops, peak.threads, peak.target.c_str());
  std::printf("tolerance: %.0e relative (float32) plus a reassociating protocol's documented bound; an error "
              "above it, or NaN, fails the run\n",
              job::kLayerFloat32Tolerance);
  std::printf("max rel error %.3e; outputs and gradients bitwise equal across exact protocols: %s\n", rep.worst,
              all_bitwise ? "yes" : "NO");
}

void run(RunConfig& cfg) {
  check_layout_flags(cfg.layout);
  cfg.tokens = packed_tokens(cfg.packing, cfg.tokens, cfg.tokens_given, std::size_t{1} << 24);
  check_value_heads(cfg.heads, cfg.value_heads);
  const kda::Shape shape{cfg.batch, cfg.tokens, cfg.heads,
                         cfg.value_heads ? cfg.value_heads : cfg.heads, cfg.key_dim, cfg.value_dim};
  kda::validate(shape);
  job::LayerJob<float> job;
  // N is known from the flags: the memory admission comes before the
  // packing is drawn (16M --docs take seconds and a GiB to draw).
  const std::size_t sequences = packed_sequences(cfg.packing, shape.batch, shape.tokens);
  const std::string backend = resolved_backend(cfg.backend);
  const bool in_process = backend == "inprocess";
  if (in_process) layout_spec(cfg.layout, shape.tokens, cfg.backend.ranks);
  const std::size_t here = ranks_per_process(cfg.backend);
  check_threads(here, cfg.threads);
  // In-process, all P ranks' runs are this process's. Under a launcher P is
  // known only in the world, where each process counts its own rank's share
  // (below, before any message).
  auto admit = [&](const job::LayoutSpec& layout, std::size_t ranks, bool one_rank_per_process) {
    std::ostringstream what;
    what << "kdacp run on " << ranks << " ranks";
    if (one_rank_per_process) what << " (one per process, this process's share)";
    require_memory(job::compare_protocols_bytes(shape, sequences, ranks, layout, one_rank_per_process,
                                                    !cfg.recompute && cfg.algorithm == kda::Algorithm::chunk),
                   max_memory_bytes(cfg.max_memory), what.str(), max_memory_name(cfg.max_memory));
  };
  if (in_process) admit(layout_spec(cfg.layout, shape.tokens, cfg.backend.ranks), cfg.backend.ranks, false);
  const std::size_t hw = ThreadPool::default_threads(1);
  const std::size_t per_rank = cfg.threads ? cfg.threads : ThreadPool::default_threads(here);
  // The job's inputs, generated once admitted: before the ranks start
  // in-process, in the world (one rank, one call per process) under a launcher.
  auto generate = [&] {
    job.cu_seqlens = packing(cfg.packing, shape.batch, shape.tokens, cfg.seed);
    job.data = kda::synthetic_layer<float>(shape, cfg.seed);
    job.scale = kda::default_scale<float>(shape.key_dim);
    job.d_o = kda::synthetic_tensor<float>(shape.v_elems(), cfg.seed + 1);
    job.final_states = cfg.packed();
    job.algorithm = cfg.algorithm;
    job.keep_forward = !cfg.recompute;
    // Steady state: every configuration (one device, each protocol) times
    // its second step, as `kdacp bench layer` does; the first faults in
    // pages and fills the forward cache.
    job.warmup_steps = kWarmupSteps;
    if (cfg.packed()) {
      const std::size_t states = sequences * shape.value_heads * shape.key_dim * shape.value_dim;
      job.h0 = kda::synthetic_tensor<float>(states, cfg.seed + 3);
      job.dht = kda::synthetic_tensor<float>(states, cfg.seed + 4);
    }
    job.sequences();  // every check of the job before any message
  };
  if (in_process) generate();

  run_ranks(cfg.backend, [&](const std::shared_ptr<Communicator>& world) {
    const job::Progress progress("kdacp run");
    job::LayerRunOptions base;
    base.threads_per_rank = per_rank;
    base.layout = layout_spec(cfg.layout, shape.tokens, world->size());
    // Under a launcher each process generates the whole job from its seed:
    // every layer built compares it (with the shape, packing and layout the
    // layer compares itself) before its first message.
    base.agree.add_int("--seed", static_cast<long long>(cfg.seed));
    if (!in_process) {
      admit(base.layout, world->size(), true);
      generate();
    }
    const auto cmp = job::compare_protocols(world, job, base, progress);
    if (!cmp) return;  // rank 0 reports
    const auto single = job::run_single(job, hw);
    progress.note("single-rank layer done");
    // The machine's FP32 FMA peak with every hardware thread, measured in
    // this run, so the layer's speed reads as a share of what the cores can do.
    Report rep{single, kda::forward_flops(shape, false) + kda::backward_flops(shape, false),
               kda::forward_flops(shape, true) + kda::backward_flops(shape, true), measure_fma_peak(hw, 0.2),
               cfg.packed(), shape.key_dim};
    rep.add("single (1 rank)", single, true, "-");
    for (const auto& r : cmp->runs) {
      if (!r.skipped.empty()) rep.skip(r.label, r.skipped);
      else rep.add(r.label, r.out, false, !r.bitwise ? "n/a" : *r.bitwise ? "yes" : "NO");
    }
    const RunSetup setup{world->backend(), base.layout.name(), kda::algorithm_name(job.algorithm), world->size(),
                         per_rank, job.cu_seqlens, job.warmup_steps};
    print(cfg, shape, setup, rep, cmp->all_bitwise);
    if (!rep.failures.empty()) {
      std::string what;
      for (const std::string& f : rep.failures) what += "; " + f;
      throw Error("errors against one device are NaN or above their tolerance (" +
                  fmt("%.0e", job::kLayerFloat32Tolerance) + " plus a reassociating protocol's bound)" + what);
    }
    if (!cmp->all_bitwise) throw Error("exact protocols disagree bitwise");
  });
}

}  // namespace

void add_run_command(CLI::App& app) {
  auto cfg = std::make_shared<RunConfig>();
  CLI::App* cmd = app.add_subcommand(
      "run", "the main job: the context-parallel KDA layer for every protocol vs one device");
  add_backend_flags(*cmd, cfg->backend);
  add_int(*cmd, "--batch,-B", cfg->batch, "batch size", kSizeRange);
  auto* tokens = add_int(*cmd, "--tokens,-T", cfg->tokens, "sequence length (with --seqlens: their sum)",
                         IntRange{1, 1 << 24});
  add_int(*cmd, "--heads,-H", cfg->heads, "query/key heads", kSizeRange);
  add_int(*cmd, "--value-heads", cfg->value_heads, "value heads (multiple of --heads; 0: same)",
          IntRange{0, kSizeRange.max});
  add_int(*cmd, "--key-dim,-K", cfg->key_dim, "key dim", kDimRange);
  add_int(*cmd, "--value-dim,-V", cfg->value_dim, "value dim", kDimRange);
  add_packing_flags(*cmd, cfg->packing, std::size_t{1} << 24, ", with random h0 and dht, and report ht and dh0 too");
  add_layout_flags(*cmd, cfg->layout);
  add_algorithm_flag(*cmd, cfg->algorithm);
  add_recompute_flag(*cmd, cfg->recompute);
  add_int(*cmd, "--seed", cfg->seed, "input seed", IntRange{});
  add_int(*cmd, "--threads", cfg->threads, "threads per rank (0: hardware threads / ranks)", kThreadsRange);
  add_max_memory(*cmd, cfg->max_memory);
  cmd->add_flag("--json", cfg->json, "print JSON instead of a table");
  cmd->callback([cfg, tokens] {
    cfg->tokens_given = tokens->count() > 0;
    run(*cfg);
  });
}

}  // namespace kdacp::cli
