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

#include "backend.hpp"
#include "commands.hpp"
#include "exchange_flags.hpp"
#include "flags.hpp"
#include "kdacp/admission.hpp"
#include "kdacp/error.hpp"
#include "kdacp/exchange.hpp"
#include "kdacp/output.hpp"
#include "kdacp/protocol.hpp"
#include "kdacp/testing/exchange_check.hpp"
#include "table.hpp"

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

void print_text(const Config& cfg, const ExchangeCheckResult& run, const Table& table) {
  const SummaryShape& shape = run.shape;
  const std::size_t p = run.ranks;
  std::printf("kdacp exchange: backend=%s protocol=%s", run.backend.c_str(),
              describe_method(std::string(run.protocol->name), run.prediction, cfg.exchange).c_str());
  if (cfg.exchange.group_size > 1) std::printf(" (group size %lld)", cfg.exchange.group_size);
  std::printf(" P=%zu B=%zu H=%zu K=%zu V=%zu kernel=%s threads/rank=%zu repeat=%zu\n\n", p,
              shape.batch, shape.heads, shape.key_dim, shape.value_dim, run.kernel.c_str(),
              run.threads, cfg.repeat);
  table.print();
  std::printf("\ntimes: median per call; errors: against the FP64 chain (rel = relative Frobenius)\n");
  std::printf("max abs error %.3e, max rel error %.3e\n", run.max_abs_error, run.max_rel_error);
  if (run.protocol->exact()) {
    std::printf("bitwise equal to p2p: %s\n", run.equal_to_p2p ? "yes" : "NO");
  } else {
    // The registry row's documented bound (transfers of spectral norm <= 1).
    const double bound = error_bound(*run.protocol, p, shape.key_dim);
    std::printf("bitwise equal to p2p: not applicable (%.*s reassociates); documented bound %.2e\n",
                int(run.protocol->name.size()), run.protocol->name.data(), bound);
  }
}

// Errors of every rank against the FP64 chain, the table or JSON, and the
// verdict: an exact protocol that differs from p2p fails the command.
void report(const Config& cfg, const ExchangeCheckResult& run) {
  const auto& runs = run.runs;
  const bool exact = run.protocol->exact();
  Table table({"rank", "fwd ms", "bwd ms", "sent/call", "recv/call", "peak extra", "fwd max abs",
               "fwd rel", "bwd max abs", "bwd rel", "== p2p"});
  for (std::size_t q = 0; q < runs.size(); ++q) {
    const auto& ef = run.errors[q].forward;
    const auto& eb = run.errors[q].backward;
    const testing::ExchangeRecord& rc = runs[q].record;
    table.add({std::to_string(q), fmt("%.3f", rc.forward_seconds * 1e3), fmt("%.3f", rc.backward_seconds * 1e3),
               fmt_bytes((rc.forward_bytes_sent + rc.backward_bytes_sent) / 2),
               fmt_bytes((rc.forward_bytes_received + rc.backward_bytes_received) / 2),
               fmt_bytes(rc.peak_extra_bytes), fmt("%.2e", ef.max_abs), fmt("%.2e", ef.rel_fro),
               fmt("%.2e", eb.max_abs), fmt("%.2e", eb.rel_fro),
               !exact ? "n/a" : rc.equal_to_p2p ? "yes" : "NO"});
  }
  std::optional<StagedOutput> out;
  if (!cfg.out.empty()) {
    // A NaN or Inf is a failure, not a result: checked before any file is staged.
    try {
      testing::require_finite_runs(run.shape, runs);
    } catch (const Error& e) {
      throw Error(std::string(e.what()) + "; nothing was written to " + cfg.out);
    }
    out.emplace(cfg.out, std::vector<std::string>{"incoming.npy", "final_grad.npy"});
    testing::write_runs_npy(out->staging_dir(), run.shape, runs);
  }
  if (cfg.json) std::printf("%s\n", testing::to_json(run).c_str());
  else print_text(cfg, run, table);
  if (!std::isfinite(run.max_abs_error) || !std::isfinite(run.max_rel_error))
    throw Error("results are not finite (max abs error " + fmt("%g", run.max_abs_error) + ")");
  if (exact && !run.equal_to_p2p) throw Error("results differ from the p2p chain");
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
  auto* ob = add_int(*cmd, "--batch,-B", cfg->batch, "batch size B", kSizeRange);
  auto* oh = add_int(*cmd, "--heads,-H", cfg->heads, "heads H", kSizeRange);
  auto* ok = add_int(*cmd, "--key-dim,-K", cfg->key_dim, "key dim K", kDimRange);
  auto* ov = add_int(*cmd, "--value-dim,-V", cfg->value_dim, "value dim V", kDimRange);
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
  cmd->callback([cfg, ob, oh, ok, ov] {
    cfg->given_ranks = cfg->backend.ranks_given;
    cfg->given_batch = ob->count() > 0;
    cfg->given_heads = oh->count() > 0;
    cfg->given_k = ok->count() > 0;
    cfg->given_v = ov->count() > 0;
    run_exchange(*cfg);
  });
}

}  // namespace kdacp::cli
