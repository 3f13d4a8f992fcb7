// `kdacp kda`: the context-parallel KDA layer on .npy inputs (packed
// sequences, initial and final states, any layout), for comparison with any
// other implementation (flash-linear-attention's layout, SPEC §9, §10), on
// in-process ranks or one process per rank under mpirun.
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "backend.hpp"
#include "commands.hpp"
#include "exchange_flags.hpp"
#include "flags.hpp"
#include "kdacp/admission.hpp"
#include "kdacp/error.hpp"
#include "kdacp/job_npy.hpp"
#include "kdacp/thread_pool.hpp"
#include "layer_flags.hpp"

namespace kdacp::cli {
namespace {

struct KdaConfig {
  LaunchOptions backend;
  std::string inputs, out, max_memory;
  ExchangeFlags exchange;
  LayoutFlags layout;
  kda::Algorithm algorithm = defaults::kAlgorithm;
  double scale = 0;  // 0: 1/sqrt(K)
  std::size_t threads = 0;
  bool recompute = !defaults::kKeepForward;
  bool deterministic = defaults::kDeterministic;
  std::size_t ulysses = 1;
};

// What every rank runs with on `ranks` ranks, after the memory admission
// (job::admit_layer_job) of the whole run in-process, of this process's rank
// under a launcher. Throws, naming the flag, for a layout that does not fit.
template <class T>
job::LayerRunOptions run_options(const KdaConfig& cfg, const job::LayerNpy& in, const job::LayerJob<T>& job,
                                 std::size_t ranks, double input_bytes) {
  // Checked in the flags' terms; the layer builds it from --layout and --split.
  const kda::Layout layout = layout_of(cfg.layout, job.data.shape.tokens, ranks);
  SummaryShape summary = job::layer_summary_shape(job.data.shape);
  summary.dtype = std::is_same_v<T, double> ? DType::f64 : DType::f32;
  job::LayerRunOptions opts;
  opts.method = cfg.exchange.protocol;
  opts.group_size = cfg.exchange.group_size;
  opts.threads_per_rank = cfg.threads ? cfg.threads : ThreadPool::default_threads(ranks_per_process(cfg.backend));
  opts.exchange = exchange_options(cfg.exchange, summary);
  opts.layout_kind = parse_layout_kind(cfg.layout.layout, "--layout");
  opts.split = cfg.layout.split;
  opts.ulysses = cfg.ulysses;
  resolve_ulysses_flag(cfg.ulysses, opts.method, job.data.shape, layout, job.sequences(), opts.exchange,
                       sizeof(T));
  job::admit_layer_job(in, job, opts, ranks, input_bytes, cfg.max_memory,
                       resolved_backend(cfg.backend) != "inprocess");
  return opts;
}

// `shared`: in-process, the whole outputs every rank writes into.
template <class T>
void run_rank(const KdaConfig& cfg, const std::shared_ptr<Communicator>& world, const job::LayerNpy& in,
              const job::LayerJob<T>& job, const job::LayerRunOptions& opts, job::LayerOutputs<T>* shared) {
  const kda::Shape& s = job.data.shape;
  const std::size_t ranks = world->size();
  auto out = job::run_context_parallel(world, job, opts, shared);
  if (world->rank() != 0) return;  // rank 0 writes and reports
  if (shared) out = std::move(*shared);
  job::save_layer_outputs(cfg.out, in, *out);
  const std::string dtype = in.q.half ? in.q.file_dtype() + " (computed in float32)"
                                      : std::is_same_v<T, double> ? "float64" : "float32";
  const std::string exchange =
      out->ulysses > 1 ? fmt::format("Ulysses U={}{}{} + {} over P/U={}", out->ulysses,
                                     cfg.ulysses == job::kUlyssesAuto ? " (auto)" : "",
                                     job.storage && std::is_same_v<T, float>
                                         ? fmt::format(" (all-to-alls in {})", half_name(*job.storage))
                                         : "",
                                     out->method, ranks / out->ulysses)
                       : out->method + (cfg.ulysses == job::kUlyssesAuto ? " (Ulysses auto: U=1)" : "");
  std::printf("kdacp kda: %s B=%zu T=%zu H=%zu HV=%zu K=%zu V=%zu N=%zu%s, %s algorithm, on P=%zu %s ranks (%s, %s "
              "layout): wrote %s to %s\n",
              dtype.c_str(), s.batch, s.tokens, s.heads, s.value_heads,
              s.key_dim, s.value_dim, in.sequences, in.cu_seqlens.empty() ? "" : " packed",
              kda::algorithm_name(job.algorithm), ranks,
              out->backend.c_str(), exchange.c_str(), layout_name(cfg.layout).c_str(),
              job.grads() ? "o, ht, dq, dk, dv, dg, dbeta, dh0" : "o, ht", cfg.out.c_str());
}

template <class T>
void run_typed(const KdaConfig& cfg, job::LayerNpy& in, double input_bytes) {
  const T scale = cfg.scale > 0 ? static_cast<T>(cfg.scale) : kda::default_scale<T>(in.q.shape[3]);
  const bool in_process = resolved_backend(cfg.backend) == "inprocess";
  // Under a launcher each process read the whole job itself: the layer's
  // construction compares what they read, hashed before the job takes it.
  const Fingerprint agree = in_process ? Fingerprint{} : job::layer_npy_fingerprint(in);
  job::LayerJob<T> job = job::take_layer_job<T>(in, scale);
  job.algorithm = cfg.algorithm;
  job.keep_forward = !cfg.recompute && job.grads();
  job.deterministic = cfg.deterministic;
  job.sequences();  // every check of the job before any rank starts
  // In-process, P is known here: check once before the ranks start. Under a
  // launcher every process checks with its world's P before any message.
  // In-process, the ranks share one whole outputs (run_context_parallel's
  // `shared`), which outlives their threads.
  std::optional<job::LayerRunOptions> opts;
  job::LayerOutputs<T> shared;
  if (in_process) {
    opts = run_options(cfg, in, job, cfg.backend.ranks, input_bytes);
    shared = job::allocate_outputs(job);
  }
  run_ranks(cfg.backend, [&](const std::shared_ptr<Communicator>& world) {
    if (opts) return run_rank<T>(cfg, world, in, job, *opts, &shared);
    job::LayerRunOptions mine = run_options(cfg, in, job, world->size(), input_bytes);
    mine.agree = agree;
    run_rank<T>(cfg, world, in, job, mine, nullptr);
  });
}

void run(const KdaConfig& cfg) {
  check_layout_flags(cfg.layout);
  check_threads(ranks_per_process(cfg.backend), cfg.threads);
  const double input_bytes = job::layer_npy_bytes(cfg.inputs);
  require_memory(input_bytes, max_memory_bytes(cfg.max_memory), "reading the inputs of " + cfg.inputs,
                 max_memory_name(cfg.max_memory));
  job::LayerNpy in = job::read_layer_npy(cfg.inputs);
  if (in.q.dtype == DType::f64) {
    run_typed<double>(cfg, in, input_bytes);
  } else {
    run_typed<float>(cfg, in, input_bytes);  // float32, or float16 widened as it was read
  }
}

}  // namespace

void add_kda_command(CLI::App& app) {
  auto cfg = std::make_shared<KdaConfig>();
  cfg->backend.ranks = 1;
  CLI::App* cmd = app.add_subcommand(
      "kda",
      "run the context-parallel KDA layer on q/k/v/g/beta(.npy) [cu_seqlens, h0, dht, do] and write o, ht "
      "(and gradients, dh0)");
  add_path(*cmd, "--inputs", cfg->inputs,
                  "DIR with q.npy, k.npy [B,T,H,K], v.npy [B,T,HV,V], g.npy [B,T,HV,K], beta.npy [B,T,HV], "
                  "optional do.npy [B,T,HV,V] (float16, float32 or float64, all alike; float16 is computed in float32 "
                  "and o and the gradients are written in float16; bfloat16 has no .npy dtype: kdacp.torch only), "
                  "optional cu_seqlens.npy (int32/int64, 1-D, 0 = c_0 < ... < c_N = T, B = 1), optional h0.npy "
                  "and dht.npy [N,HV,K,V] (N: sequences, or B rows without cu_seqlens; q's dtype, float32 with "
                  "float16 inputs); NaN or Inf anywhere, g > 0 or beta outside [0, 1] is an error",
           "a directory")
      ->required();
  add_path(*cmd, "--out", cfg->out,
                  "DIR for o.npy, ht.npy and, with do.npy, dq/dk/dv/dg/dbeta.npy and dh0.npy (in the inputs' dtype; "
                  "ht and dh0 float32 with float16 inputs), written (by rank 0) once the run succeeded (a "
                  "float16 output that overflows float16 is an error); those of an earlier run that this one does not write are removed, "
                  "other files are left alone",
           "a directory")
      ->required();
  add_backend_flags(*cmd, cfg->backend);
  add_exchange_flags(*cmd, cfg->exchange);
  add_layout_flags(*cmd, cfg->layout);
  add_algorithm_flag(*cmd, cfg->algorithm);
  add_recompute_flag(*cmd, cfg->recompute);
  add_deterministic_flag(*cmd, cfg->deterministic);
  add_ulysses_flag(*cmd, cfg->ulysses);
  add_real(*cmd, "--scale", cfg->scale, "output scale (default 1/sqrt(K))", kPositive)->default_str("1/sqrt(K)");
  add_int(*cmd, "--threads", cfg->threads, "threads per rank (0: hardware threads / ranks)", kThreadsRange);
  add_max_memory(*cmd, cfg->max_memory);
  cmd->callback([cfg] { run(*cfg); });
}

}  // namespace kdacp::cli
