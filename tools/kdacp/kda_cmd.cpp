// `kdacp kda`: the context-parallel KDA layer on .npy inputs, for comparison
// with any other implementation (flash-linear-attention's layout, SPEC §9).
#include <cstdio>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "commands.hpp"
#include "exchange_flags.hpp"
#include "flags.hpp"
#include "kdacp/admission.hpp"
#include "kdacp/output.hpp"
#include "kdacp/testing/layer_npy.hpp"
#include "kdacp/thread_pool.hpp"

namespace kdacp::cli {
namespace {

struct KdaConfig {
  std::string inputs, out, max_memory;
  std::size_t ranks = 1;
  ExchangeFlags exchange;
  double scale = 0;  // 0: 1/sqrt(K)
  std::size_t threads = 0;
  double timeout_s = 120;
};

template <class T>
void run_typed(const KdaConfig& cfg, const testing::LayerNpy& in, double input_bytes) {
  const kda::LayerData<T> data = testing::layer_data<T>(in);
  const kda::Shape& s = data.shape;
  kda::split_tokens(s.tokens, cfg.ranks, 0);  // P > T is an error before any work
  const T scale = cfg.scale > 0 ? static_cast<T>(cfg.scale) : kda::default_scale<T>(s.key_dim);
  const std::size_t threads = cfg.threads ? cfg.threads : ThreadPool::default_threads(cfg.ranks);
  SummaryShape summary = testing::layer_summary_shape(s);
  summary.dtype = std::is_same_v<T, double> ? DType::f64 : DType::f32;
  const ExchangeOptions opts = exchange_options(cfg.exchange, summary);
  testing::admit_layer_run(s, summary, cfg.ranks, in.d_o.has_value(), input_bytes, cfg.exchange.protocol,
                           cfg.exchange.group_size, opts, cfg.max_memory);
  const std::vector<T> dov = testing::output_grad<T>(in);
  const auto out = testing::run_context_parallel(data, scale, in.d_o ? &dov : nullptr, cfg.ranks,
                                                 cfg.exchange.protocol, cfg.exchange.group_size, threads,
                                                 cfg.timeout_s, opts);
  StagedOutput staged(cfg.out, testing::kLayerOutputFiles);
  testing::write_layer_outputs_npy(staged.staging_dir(), in, out);
  staged.commit();
  std::printf("kdacp kda: %s B=%zu T=%zu H=%zu HV=%zu K=%zu V=%zu on P=%zu ranks (%s): wrote %s to %s\n",
              std::is_same_v<T, double> ? "float64" : "float32", s.batch, s.tokens, s.heads, s.value_heads,
              s.key_dim, s.value_dim, cfg.ranks, out.method.c_str(),
              in.d_o ? "o, dq, dk, dv, dg, dbeta" : "o", cfg.out.c_str());
}

void run(const KdaConfig& cfg) {
  check_threads(cfg.ranks, cfg.threads);
  const double input_bytes = testing::layer_npy_bytes(cfg.inputs);
  require_memory(input_bytes, max_memory_bytes(cfg.max_memory), "reading the inputs of " + cfg.inputs,
                 max_memory_name(cfg.max_memory));
  const testing::LayerNpy in = testing::read_layer_npy(cfg.inputs);
  if (in.q.dtype == DType::f64) {
    run_typed<double>(cfg, in, input_bytes);
  } else {
    run_typed<float>(cfg, in, input_bytes);
  }
}

}  // namespace

void add_kda_command(CLI::App& app) {
  auto cfg = std::make_shared<KdaConfig>();
  CLI::App* cmd = app.add_subcommand(
      "kda",
      "run the context-parallel KDA layer on q/k/v/g/beta(.npy) [and do.npy] and write o (and gradients)");
  cmd->add_option("--inputs", cfg->inputs,
                  "DIR with q.npy, k.npy [B,T,H,K], v.npy [B,T,HV,V], g.npy [B,T,HV,K], beta.npy [B,T,HV], "
                  "optional do.npy (float32 or float64); NaN or Inf anywhere, g > 0 or beta outside [0, 1] "
                  "is an error")
      ->required();
  cmd->add_option("--out", cfg->out,
                  "DIR for o.npy and, with do.npy, dq/dk/dv/dg/dbeta.npy, written once the run succeeded; "
                  "those of an earlier run that this one does not write are removed, other files are left alone")
      ->required();
  add_int(*cmd, "--ranks,-P", cfg->ranks, "in-process ranks", IntRange{1, 1024});
  add_exchange_flags(*cmd, cfg->exchange);
  add_real(*cmd, "--scale", cfg->scale, "output scale (default 1/sqrt(K))", kPositive)->default_str("1/sqrt(K)");
  add_int(*cmd, "--threads", cfg->threads, "threads per rank (0: hardware threads / ranks)", kThreadsRange);
  add_real(*cmd, "--timeout", cfg->timeout_s, "seconds a rank waits for a peer", kTimeoutRange);
  add_max_memory(*cmd, cfg->max_memory);
  cmd->callback([cfg] { run(*cfg); });
}

}  // namespace kdacp::cli
