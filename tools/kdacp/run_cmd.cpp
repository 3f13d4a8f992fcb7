// `kdacp run`: the main job. The context-parallel KDA layer, forward and
// backward, for every protocol on in-process ranks or one process per rank
// under mpirun, over one sequence per row or packed sequences with initial
// and final states, in a contiguous or zigzag layout, against the layer on
// one device: time, the exchange's share, errors of o, every gradient, ht
// and dh0, and whether results are bitwise equal across exact protocols.
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "backend.hpp"
#include "commands.hpp"
#include "flags.hpp"
#include "kdacp/admission.hpp"
#include "kdacp/job.hpp"
#include "kdacp/report/run_report.hpp"
#include "kdacp/thread_pool.hpp"
#include "layer_flags.hpp"

namespace kdacp::cli {
namespace {

// Untimed forward+backward steps before each timed one (LayerJob::warmup_steps).
constexpr std::size_t kWarmupSteps = 1;

struct RunConfig {
  LaunchOptions backend;
  kda::Shape shape{1, 8192, 4, 0, 128, 128};
  std::size_t value_heads = 0;  // 0: --heads
  bool tokens_given = false;
  report::Packing packing;
  LayoutFlags layout;
  kda::Algorithm algorithm = defaults::kAlgorithm;
  std::uint64_t seed = 0;
  std::size_t threads = 0;
  bool json = false, recompute = !defaults::kKeepForward;
  bool deterministic = defaults::kDeterministic;
  std::size_t ulysses = 1;  // job::kUlyssesAuto: the cost model's
  std::string max_memory;
};

void run(RunConfig& cfg) {
  check_layout_flags(cfg.layout);
  kda::Shape shape = cfg.shape;
  shape.tokens = report::packed_tokens(cfg.packing, shape.tokens, cfg.tokens_given, std::size_t{1} << 24);
  check_value_heads(shape.heads, cfg.value_heads);
  shape.value_heads = cfg.value_heads ? cfg.value_heads : shape.heads;
  kda::validate(shape);
  job::LayerJob<float> job;
  // N is known from the flags: the memory admission comes before the
  // packing is drawn (16M --docs take seconds and a GiB to draw).
  const std::size_t sequences = report::packed_sequences(cfg.packing, shape.batch, shape.tokens);
  const std::string backend = resolved_backend(cfg.backend);
  const bool in_process = backend == "inprocess";
  if (in_process) layout_of(cfg.layout, shape.tokens, cfg.backend.ranks);
  const std::size_t here = ranks_per_process(cfg.backend);
  check_threads(here, cfg.threads);
  // In-process, all P ranks' runs are this process's. Under a launcher P is
  // known only in the world, where each process counts its own rank's share
  // (below, before any message).
  // An explicit --ulysses is checked against P, H and HV before anything
  // starts; auto is resolved on the job (its packing's cuts weigh in), and
  // admitted with the widest buffers of any width it could pick.
  if (cfg.ulysses > 1 && in_process) {
    const kda::Layout layout = layout_of(cfg.layout, shape.tokens, cfg.backend.ranks);
    resolve_ulysses_flag(cfg.ulysses, "auto", shape, layout, kda::Sequences(shape.batch, shape.tokens), {}, 4);
  }
  auto admit = [&](const kda::Layout& layout, bool one_rank_per_process) {
    require_memory(job::compare_protocols_bytes(shape, sequences, layout, one_rank_per_process,
                                                !cfg.recompute && cfg.algorithm == kda::Algorithm::chunk,
                                                cfg.ulysses),
                   max_memory_bytes(cfg.max_memory),
                   fmt::format("kdacp run on {} ranks{}", layout.ranks(),
                               one_rank_per_process ? " (one per process, this process's share)" : ""),
                   max_memory_name(cfg.max_memory));
  };
  if (in_process) admit(layout_of(cfg.layout, shape.tokens, cfg.backend.ranks), false);
  const std::size_t hw = ThreadPool::default_threads(1);
  const std::size_t per_rank = cfg.threads ? cfg.threads : ThreadPool::default_threads(here);
  // The job's inputs, generated once admitted: before the ranks start
  // in-process, in the world (one rank, one call per process) under a launcher.
  auto generate = [&] {
    job = report::synthetic_layer_job(
        shape, report::packed_cu_seqlens(cfg.packing, shape.batch, shape.tokens, cfg.seed), cfg.seed);
    job.algorithm = cfg.algorithm;
    job.keep_forward = !cfg.recompute;
    job.deterministic = cfg.deterministic;
    // Steady state: every configuration (one device, each protocol) times
    // its second step, as `kdacp bench layer` does; the first faults in
    // pages and fills the forward cache.
    job.warmup_steps = kWarmupSteps;
  };
  if (in_process) generate();

  run_ranks(cfg.backend, [&](const std::shared_ptr<Communicator>& world) {
    const job::Progress progress("kdacp run");
    job::LayerRunOptions base;
    base.threads_per_rank = per_rank;
    // The layout as the flags say it (each rank builds and agrees on it by
    // --layout and --split), checked here in the flags' terms first.
    const kda::Layout layout = layout_of(cfg.layout, shape.tokens, world->size());
    base.layout_kind = parse_layout_kind(cfg.layout.layout, "--layout");
    base.split = cfg.layout.split;
    // Under a launcher each process generates the whole job from its seed:
    // every layer built compares it (with the shape, packing and layout the
    // layer compares itself) before its first message.
    base.agree.add_int("--seed", static_cast<long long>(cfg.seed));
    if (!in_process) {
      admit(layout, true);
      generate();
    }
    base.ulysses = resolve_ulysses_flag(cfg.ulysses, "auto", shape, layout, job.sequences(), {}, 4);
    report::run_layer_comparison(world, job, base, layout_name(cfg.layout), cfg.json, hw, progress);
  });
}

}  // namespace

void add_run_command(CLI::App& app) {
  auto cfg = std::make_shared<RunConfig>();
  CLI::App* cmd = app.add_subcommand(
      "run", "the main job: the context-parallel KDA layer for every protocol vs one device");
  add_backend_flags(*cmd, cfg->backend);
  auto* tokens = add_layer_shape_flags(*cmd, cfg->shape, cfg->value_heads, "sequence length (with --seqlens: their sum)");
  add_packing_flags(*cmd, cfg->packing, std::size_t{1} << 24, ", with random h0 and dht, and report ht and dh0 too");
  add_layout_flags(*cmd, cfg->layout);
  add_algorithm_flag(*cmd, cfg->algorithm);
  add_recompute_flag(*cmd, cfg->recompute);
  add_deterministic_flag(*cmd, cfg->deterministic);
  add_ulysses_flag(*cmd, cfg->ulysses);
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
