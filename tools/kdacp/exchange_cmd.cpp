// `kdacp exchange`: runs forward + backward of one protocol on P ranks,
// checks every rank against the FP64 chain and, for the exact protocols, bit
// for bit against the p2p chain, and reports time, traffic and memory per
// rank. The default method is auto: the cost model's choice, reported.
#include <memory>

#include "backend.hpp"
#include "commands.hpp"
#include "exchange_flags.hpp"
#include "flags.hpp"
#include "kdacp/error.hpp"
#include "kdacp/report/exchange_check.hpp"

namespace kdacp::cli {

void add_exchange_command(CLI::App& app) {
  auto cfg = std::make_shared<report::ExchangeCheckFlags>();
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
  add_mapped_choice(*cmd, "--kernel", cfg->kernel, "fold kernel",
                    {{"best", KernelKind::best}, {"simd", KernelKind::simd}, {"scalar", KernelKind::scalar}});
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
    cfg->given_batch = shape_flags[0]->count() > 0;
    cfg->given_heads = shape_flags[1]->count() > 0;
    cfg->given_k = shape_flags[2]->count() > 0;
    cfg->given_v = shape_flags[3]->count() > 0;
    report::run_exchange_check(*cfg, launcher());
  });
}

}  // namespace kdacp::cli
