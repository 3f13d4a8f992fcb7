// `kdacp bench exchange`: one protocol configuration timed on the ranks of
// the chosen backend beside the cost model (kdacp/report/exchange_bench.hpp).
// It is what the simulated-cluster sweep runs on every simulated rank
// (scripts/simulate.py, docs/scale.md).
#include <array>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>

#include "backend.hpp"
#include "commands.hpp"
#include "exchange_flags.hpp"
#include "flags.hpp"
#include "kdacp/admission.hpp"
#include "kdacp/error.hpp"
#include "kdacp/report/exchange_bench.hpp"
#include "kdacp/thread_pool.hpp"

namespace kdacp::cli {
namespace {

struct Args {
  LaunchOptions backend;
  ExchangeFlags exchange;
  report::ExchangeBenchConfig bench;
  std::size_t batch = 1, heads = 32, key_dim = 128, value_dim = 128;
  std::size_t threads = 1;
  bool json = false;
};

void run(Args& a) {
  a.backend.timing_only = true;  // only times are printed: a simulation may fold (docs/scale.md)
  a.bench.method = a.exchange.protocol;
  a.bench.group_size = a.exchange.group_size;
  a.bench.shape = SummaryShape{a.batch, a.heads, a.key_dim, a.value_dim};
  a.bench.options = exchange_options(a.exchange, a.bench.shape);
  check_threads(ranks_per_process(a.backend), a.threads);
  run_ranks(a.backend, [&](const std::shared_ptr<Communicator>& world) {
    report::ExchangeBenchConfig cfg = a.bench;
    std::optional<ThreadPool> pool;
    if (a.threads != 1) {
      pool.emplace(a.threads == 0 ? ThreadPool::default_threads(ranks_per_process(a.backend)) : a.threads);
      cfg.options.exec.pool = &*pool;
    }
    const report::ExchangeBenchResult result = report::bench_exchange(world, cfg);
    if (world->rank() != 0) return;
    if (a.json) std::printf("%s\n", report::to_json(result).c_str());
    else report::print_exchange_bench(result);
    std::fflush(stdout);
  });
}

}  // namespace

void add_bench_exchange_command(CLI::App& bench) {
  auto a = std::make_shared<Args>();
  CLI::App* cmd = bench.add_subcommand(
      "exchange",
      "one protocol's forward and backward time on the ranks of the backend (the slowest rank per call, median "
      "over calls) beside the cost model's prediction; each rank makes its own synthetic summaries, nothing is "
      "gathered: the command of the simulated-cluster sweep (scripts/simulate.py)");
  add_backend_flags(*cmd, a->backend);
  add_exchange_flags(*cmd, a->exchange);
  add_bhkv_flags(*cmd, a->batch, a->heads, a->key_dim, a->value_dim);
  add_choice(*cmd, "--layout", a->bench.layout, "parts per rank: contiguous (one) or zigzag (two: r and 2P-1-r)",
             {"contiguous", "zigzag"});
  add_int(*cmd, "--docs-mean", a->bench.docs_mean_tokens,
          "cut the stream where documents of this mean length in tokens start (parts of 4096 tokens per rank, "
          "seeded by --seed); 0: no cuts",
          IntRange{0, 1 << 30});
  add_int(*cmd, "--seed", a->bench.cut_seed, "seed of the documents' lengths", IntRange{});
  add_int(*cmd, "--ulysses", a->bench.ulysses,
          "Ulysses x state CP: an all-to-all over groups of U consecutive ranks, the exchange over the P/U ranks of "
          "each head slice with H/U heads (the model's exact choice: --protocol auto), the all-to-all back; 1: off",
          IntRange{1, 65536});
  const std::array<CLI::Option*, 2> ulysses_only{
      add_int(*cmd, "--tokens-per-rank", a->bench.tokens_per_rank, "T/P, the tokens whose activations --ulysses moves",
              IntRange{1, 1 << 24}),
      add_int(*cmd, "--activation-bytes", a->bench.activation_bytes,
              "bytes per activation element --ulysses moves (bf16: 2)", IntRange{1, 8})};
  add_int(*cmd, "--warmup", a->bench.warmup, "untimed forward+backward pairs first", IntRange{0, 1000});
  add_int(*cmd, "--repeat", a->bench.calls, "timed forward+backward pairs (median reported)", IntRange{1, 100000});
  add_int(*cmd, "--threads", a->threads, "kernel threads per rank (0: hardware threads divided among the ranks)",
          kThreadsRange);
  cmd->add_flag("--json", a->json, "print one JSON object instead of a table");
  cmd->callback([a, ulysses_only] {
    // Both price only the all-to-alls: without --ulysses they would be ignored.
    for (const CLI::Option* o : ulysses_only)
      if (o->count() > 0 && a->bench.ulysses < 2)
        throw InvalidArgument(o->get_name() + " needs --ulysses U > 1, the all-to-alls it prices");
    run(*a);
  });
}

}  // namespace kdacp::cli
