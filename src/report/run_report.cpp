#include "kdacp/report/run_report.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "kdacp/error.hpp"
#include "kdacp/report/bench.hpp"
#include "kdacp/testing/synthetic.hpp"
#include "kdacp/report/table.hpp"

namespace kdacp::report {
namespace {

using job::LayerOutputs;

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
    const double seconds = o.forward_seconds + o.backward_seconds;
    const double gflops = (is_single ? one_flops : cp_flops) / seconds / 1e9;
    const double share = is_single ? 0.0 : o.exchange_seconds / seconds;
    const std::vector<double> errs = job::relative_errors(o, single);
    const double tolerance = is_single ? 0.0 : job::layer_error_tolerance(o.method, o.ranks, key_dim);
    if (!is_single) {
      for (double e : errs) worst = std::isnan(e) || std::isnan(worst) ? e + worst : std::max(worst, e);
      const std::vector<std::string> above = job::errors_above(errs, tolerance);
      if (!above.empty()) failures.push_back(fmt::format("{}: {}", name, fmt::join(above, ", ")));
    }
    std::vector<std::string> row{name, fmt::format("{:.1f}", o.forward_seconds * 1e3),
                                 fmt::format("{:.1f}", o.backward_seconds * 1e3),
                                 is_single ? "-" : fmt::format("{:.1f}%", share * 100), fmt::format("{:.1f}", gflops),
                                 fmt::format("{:.1f}%", 100 * gflops / peak.gflops)};
    for (double e : errs) row.push_back(is_single ? "-" : fmt::format("{:.1e}", e));
    row.push_back(bitwise);
    table.add(row);
    nlohmann::json rel;
    for (std::size_t i = 0; i < errs.size() && i < (states ? 8u : 6u); ++i) rel[job::kLayerErrorNames[i]] = errs[i];
    records.push_back({{"protocol", name},
                       {"forward_seconds", o.forward_seconds}, {"backward_seconds", o.backward_seconds},
                       {"exchange_share", share}, {"gflops", gflops}, {"peak_fraction", gflops / peak.gflops},
                       {"rel_error", rel}, {"tolerance", tolerance},
                       {"bitwise_equal_across_exact", bitwise == "yes"}});
  }
};

// "12, 7, 30, ..." : the first eight lengths of a long packing.
std::string lengths(const std::vector<std::int64_t>& cu) {
  std::vector<std::int64_t> lens;
  for (std::size_t n = 0; n + 1 < cu.size() && (n < 8 || cu.size() <= 11); ++n) lens.push_back(cu[n + 1] - cu[n]);
  return fmt::format("{}{}", fmt::join(lens, ", "), lens.size() + 1 < cu.size() ? ", ..." : "");
}

void print(const kda::Shape& shape, const LayerRunSetup& setup, const Report& rep, bool all_bitwise, bool json) {
  const PeakResult& peak = rep.peak;
  if (json) {
    nlohmann::json j = {{"command", "run"}, {"algorithm", setup.algorithm}, {"backend", setup.backend},
                        {"layout", setup.layout},
                        {"P", setup.ranks}, {"B", shape.batch}, {"T", shape.tokens}, {"H", shape.heads},
                        {"HV", shape.value_heads}, {"K", shape.key_dim}, {"V", shape.value_dim},
                        {"threads_per_rank", setup.per_rank}, {"peak_gflops", peak.gflops},
                        {"peak_threads", peak.threads}, {"simd_target", peak.target},
                        {"layer_flops_context_parallel", rep.cp_flops}, {"layer_flops_single", rep.one_flops},
                        {"protocols", rep.records},
                        {"max_rel_error", std::isnan(rep.worst) ? nlohmann::json(nullptr) : nlohmann::json(rep.worst)},
                        {"within_tolerance", rep.failures.empty()}, {"warmup_steps", setup.warmup_steps},
                        {"bitwise_equal_across_exact", all_bitwise}, {"ulysses", setup.ulysses}};
    if (!setup.cu_seqlens.empty()) j["cu_seqlens"] = setup.cu_seqlens;
    std::printf("%s\n", j.dump(2).c_str());
    return;
  }
  std::printf("kdacp run: KDA layer forward+backward, %s algorithm, float32, B=%zu T=%zu H=%zu HV=%zu K=%zu "
              "V=%zu, P=%zu %s ranks x %zu threads, %s layout; times: steady state, each configuration's "
              "timed step after %zu untimed step%s on the same layer\n",
              setup.algorithm.c_str(), shape.batch, shape.tokens, shape.heads, shape.value_heads, shape.key_dim,
              shape.value_dim, setup.ranks, setup.backend == "inprocess" ? "in-process" : setup.backend.c_str(),
              setup.per_rank, setup.layout.c_str(), setup.warmup_steps, setup.warmup_steps == 1 ? "" : "s");
  if (setup.ulysses > 1)
    std::printf("Ulysses x state CP: head groups of U=%zu ranks trade the activations by all-to-all; each "
                "protocol's state exchange runs over the P/U=%zu ranks of a head slice, %zu of the %zu value heads\n",
                setup.ulysses, setup.ranks / setup.ulysses, shape.value_heads / setup.ulysses, shape.value_heads);
  if (!setup.cu_seqlens.empty())
    std::printf("%zu packed sequences of lengths %s; random h0 and dht; ht and dh0 against one device\n",
                setup.cu_seqlens.size() - 1, lengths(setup.cu_seqlens).c_str());
  std::printf("\n");
  rep.table.print();
  std::printf("\nerrors: relative Frobenius vs the single-rank layer (same algorithm); exchange: share of layer "
              "time in the state exchange%s;\nGFLOP/s: the recurrent algorithm's flops per forward+backward (%.2f "
              "GFLOP on one device, %.2f with the CP summaries and G pass) / wall time, for either algorithm;\n"
              "%% peak: of the FP32 FMA peak measured in this run, %.1f GFLOP/s on %zu threads (%s)\n",
              setup.ulysses > 1 ? " and the all-to-alls" : "", rep.one_flops / 1e9, rep.cp_flops / 1e9, peak.gflops, peak.threads, peak.target.c_str());
  std::printf("tolerance: %.0e relative (float32) plus a reassociating protocol's documented bound; an error "
              "above it, or NaN, fails the run\n",
              job::kLayerFloat32Tolerance);
  std::printf("max rel error %.3e; outputs and gradients bitwise equal across exact protocols: %s\n", rep.worst,
              all_bitwise ? "yes" : "NO");
}

}  // namespace

namespace {
// Every output's bytes equal (o, ht, the gradients, dh0).
bool same_bytes(const job::LayerOutputs<float>& a, const job::LayerOutputs<float>& b) {
  for (auto field : {&job::LayerOutputs<float>::o, &job::LayerOutputs<float>::dq, &job::LayerOutputs<float>::dk,
                     &job::LayerOutputs<float>::dv, &job::LayerOutputs<float>::dg, &job::LayerOutputs<float>::dbeta,
                     &job::LayerOutputs<float>::ht, &job::LayerOutputs<float>::dh0}) {
    const std::vector<float>& x = a.*field;
    const std::vector<float>& y = b.*field;
    if (x.size() != y.size() || (!x.empty() && std::memcmp(x.data(), y.data(), x.size() * sizeof(float)) != 0))
      return false;
  }
  return true;
}
}  // namespace

job::LayerJob<float> synthetic_layer_job(const kda::Shape& shape, std::vector<std::int64_t> cu_seqlens,
                                         std::uint64_t seed) {
  job::LayerJob<float> job;
  job.cu_seqlens = std::move(cu_seqlens);
  job.data = kda::synthetic_layer<float>(shape, seed);
  job.scale = kda::default_scale<float>(shape.key_dim);
  job.d_o = kda::synthetic_tensor<float>(shape.v_elems(), seed + 1);
  job.final_states = !job.cu_seqlens.empty();
  if (job.final_states) {
    const std::size_t states = (job.cu_seqlens.size() - 1) * shape.value_heads * shape.key_dim * shape.value_dim;
    job.h0 = kda::synthetic_tensor<float>(states, seed + 3);
    job.dht = kda::synthetic_tensor<float>(states, seed + 4);
  }
  job.sequences();
  return job;
}

std::vector<std::string> report_layer_run(const kda::Shape& shape, const LayerRunSetup& setup,
                                          const job::LayerOutputs<float>& single,
                                          const job::ProtocolComparison& cmp, bool states, bool json,
                                          std::size_t peak_threads) {
  // The machine's FP32 FMA peak with every hardware thread, measured in this
  // run, so the layer's speed reads as a share of what the cores can do.
  Report rep{single, kda::forward_flops(shape, false) + kda::backward_flops(shape, false),
             kda::forward_flops(shape, true) + kda::backward_flops(shape, true), measure_fma_peak(peak_threads, 0.2),
             states, shape.key_dim};
  rep.add("single (1 rank)", single, true, "-");
  for (const auto& r : cmp.runs) {
    if (!r.skipped.empty()) rep.skip(r.label, r.skipped);
    else rep.add(r.label, r.out, false, !r.bitwise ? "n/a" : *r.bitwise ? "yes" : "NO");
  }
  print(shape, setup, rep, cmp.all_bitwise, json);
  return rep.failures;
}

void run_layer_comparison(const std::shared_ptr<Communicator>& world, const job::LayerJob<float>& job,
                          const job::LayerRunOptions& base, const std::string& layout, bool json,
                          std::size_t peak_threads, const job::Progress& progress) {
  const auto cmp = job::compare_protocols(world, job, base, progress);
  if (!cmp) return;  // rank 0 reports
  const auto single = job::run_single(job, peak_threads);
  progress.note("single-rank layer done");
  const LayerRunSetup setup{world->backend(), layout, kda::algorithm_name(job.algorithm), world->size(),
                            base.threads_per_rank, job.cu_seqlens, job.warmup_steps, base.ulysses};
  const std::vector<std::string> failures =
      report_layer_run(job.data.shape, setup, single, *cmp, !job.cu_seqlens.empty(), json, peak_threads);
  if (!failures.empty())
    throw Error(fmt::format("errors against one device are NaN or above their tolerance ({:.0e} plus a "
                            "reassociating protocol's bound); {}",
                            job::kLayerFloat32Tolerance, fmt::join(failures, "; ")));
  if (!cmp->all_bitwise) throw Error("exact protocols disagree bitwise");
  if (!job.deterministic) return;
  // The deterministic mode's promise: every configuration is the single-rank
  // layer's bytes, whatever the protocol (exact or not).
  std::vector<std::string> differ;
  for (const auto& r : cmp->runs)
    if (r.skipped.empty() && !same_bytes(r.out, single)) differ.push_back(r.label);
  if (!json)
    std::printf("deterministic mode: outputs and gradients bitwise equal to the single-rank layer: %s\n",
                differ.empty() ? "yes (every configuration)" : fmt::format("NO ({})", fmt::join(differ, ", ")).c_str());
  if (!differ.empty())
    throw Error(fmt::format("--deterministic: {} not bitwise equal to the single-rank layer", fmt::join(differ, ", ")));
}

}  // namespace kdacp::report
