// `kdacp exchange`: runs forward + backward of one protocol on P ranks,
// checks every rank against the FP64 chain and, for the exact protocols, bit
// for bit against the p2p chain, and reports time, traffic and memory per
// rank. The default method is auto: the cost model's choice, reported.
#include <cmath>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "backend.hpp"
#include "commands.hpp"
#include "exchange_flags.hpp"
#include "flags.hpp"
#include "kdacp/admission.hpp"
#include "kdacp/error.hpp"
#include "kdacp/exchange.hpp"
#include "kdacp/protocol.hpp"
#include "kdacp/testing/exchange_check.hpp"

namespace kdacp::cli {
namespace {

struct Config {
  LaunchOptions backend;
  ExchangeFlags exchange;
  std::size_t batch = 1, heads = 4, key_dim = 128, value_dim = 128;
  std::uint64_t seed = 0;
  std::size_t repeat = 5;
  std::size_t threads = 0;
  std::string kernel = "best";
  bool json = false;
  std::string summaries, out, max_memory;
  // Flags given explicitly; they must agree with --summaries files.
  bool given_ranks = false, given_batch = false, given_heads = false, given_k = false,
       given_v = false;
};

using testing::ExchangeCheckResult;

// Errors of every rank against the FP64 chain, the table or JSON, and the
// verdict: an exact protocol that differs from p2p fails the command.
void report(const Config& cfg, const ExchangeCheckResult& run) {
  const auto out = cfg.out.empty() ? nullptr : testing::stage_runs_npy(cfg.out, run.shape, run.runs);
  if (cfg.json) std::printf("%s\n", testing::to_json(run).c_str());
  else testing::print_exchange_check(run, describe_method(std::string(run.protocol->name), run.prediction, cfg.exchange));
  if (!std::isfinite(run.max_abs_error) || !std::isfinite(run.max_rel_error))
    throw Error(fmt::format("results are not finite (max abs error {:g})", run.max_abs_error));
  if (run.protocol->exact() && !run.equal_to_p2p) throw Error("results differ from the p2p chain");
  if (out) out->commit();
}

// In-process, --summaries is read before the ranks start, so that without
// --ranks the world takes the files' P; rank 0 makes the inputs and reports.
void run_exchange(Config& cfg) {
  // Bad --memory-budget / --calibration fail here, before any rank starts.
  const SummaryShape shape{cfg.batch, cfg.heads, cfg.key_dim, cfg.value_dim};
  testing::ExchangeCheck check{cfg.exchange.protocol, cfg.exchange.group_size, exchange_options(cfg.exchange, shape),
                               cfg.kernel == "scalar" ? KernelKind::scalar
                               : cfg.kernel == "simd" ? KernelKind::simd
                                                      : KernelKind::best,
                               cfg.threads, 1, cfg.repeat, cfg.max_memory};
  testing::SummarySource source({cfg.summaries, shape, cfg.seed, cfg.given_batch, cfg.given_heads, cfg.given_k,
                                 cfg.given_v, cfg.max_memory});
  if (!cfg.summaries.empty() && resolved_backend(cfg.backend) == "inprocess") {
    const std::size_t p = source.read_ahead(cfg.given_ranks ? std::nullopt : std::optional(kRanksRange));
    if (!cfg.given_ranks) cfg.backend.ranks = p;
  }
  check.ranks_here = ranks_per_process(cfg.backend);
  check_threads(check.ranks_here, cfg.threads);
  // In-process the whole world is this process: admit it before its P
  // threads start (thousands of them take seconds under a sanitizer).
  if (resolved_backend(cfg.backend) == "inprocess" && source.shape())
    testing::admit_exchange_check(check, *source.shape(), cfg.backend.ranks);
  run_ranks(cfg.backend, [&](const std::shared_ptr<Communicator>& world) {
    const auto make = [&] { return source(world->size()); };
    if (const auto result = testing::check_exchange(world, check, make, source.shape())) report(cfg, *result);
  });
}

}  // namespace

void add_exchange_command(CLI::App& app) {
  auto cfg = std::make_shared<Config>();
  CLI::App* cmd = app.add_subcommand(
      "exchange",
      "run one protocol's forward + backward on P ranks (default: auto, the cost model's "
      "choice) and check it against the FP64 chain and, when exact, the p2p chain bit for bit");
  add_backend_flags(*cmd, cfg->backend);
  add_exchange_flags(*cmd, cfg->exchange);
  const auto shape_flags = add_bhkv_flags(*cmd, cfg->batch, cfg->heads, cfg->key_dim, cfg->value_dim);
  add_int(*cmd, "--seed", cfg->seed, "seed of the synthetic summaries", IntRange{});
  add_int(*cmd, "--repeat", cfg->repeat, "timed repetitions (median reported)", IntRange{1, 100000});
  add_int(*cmd, "--threads", cfg->threads, "kernel threads per rank (0: hardware threads divided among the ranks)",
          kThreadsRange);
  cmd->add_option("--kernel", cfg->kernel, "fold kernel: best, simd or scalar")
      ->check(CLI::IsMember({"best", "simd", "scalar"}))
      ->capture_default_str();
  add_path(*cmd, "--summaries", cfg->summaries,
                  "read S.npy [P,B,H,K,V], M.npy [P,B,H,K,K] and optional G.npy (float32, finite) from DIR; "
                  "in-process without --ranks, P is the files' P; otherwise it must equal the ranks of the run",
           "a directory");
  add_path(*cmd, "--out", cfg->out,
                  "write incoming.npy and final_grad.npy [P,B,H,K,V] to DIR (created if needed) once the run "
                  "succeeded; other files in DIR are left alone",
           "a directory");
  add_max_memory(*cmd, cfg->max_memory);
  cmd->add_flag("--json", cfg->json, "print JSON instead of a table");
  cmd->callback([cfg, shape_flags] {
    cfg->given_ranks = cfg->backend.ranks_given;
    cfg->given_batch = shape_flags[0]->count() > 0;
    cfg->given_heads = shape_flags[1]->count() > 0;
    cfg->given_k = shape_flags[2]->count() > 0;
    cfg->given_v = shape_flags[3]->count() > 0;
    run_exchange(*cfg);
  });
}

}  // namespace kdacp::cli
