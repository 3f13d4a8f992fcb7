// `kdacp bench exchange`: one protocol configuration timed on the ranks of
// any backend (in-process threads, MPI processes, or simulated ranks of the
// SMPI build, docs/scale.md) beside the cost model's prediction for the same
// configuration. Part of kdacp_report.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kdacp/comm.hpp"
#include "kdacp/cost_model.hpp"
#include "kdacp/exchange.hpp"
#include "kdacp/report/protocol_bench.hpp"

namespace kdacp::report {

struct ExchangeBenchConfig {
  std::string method = "auto";
  long long group_size = 1;
  SummaryShape shape{1, 32, 128, 128};
  // "contiguous" (one part per rank) or "zigzag" (2P parts, rank r holding r
  // and 2P-1-r).
  std::string layout = "contiguous";
  // Documents of this mean length in tokens packed into parts of 4096
  // tokens make the cuts (document_cuts, seeded by cut_seed); 0: no cuts.
  std::size_t docs_mean_tokens = 0;
  std::uint64_t cut_seed = 1;
  std::size_t warmup = 1;  // untimed forward+backward pairs
  std::size_t calls = 3;   // timed pairs (0: as many as fill min_time)
  double min_time = 0.2;
  ExchangeOptions options;  // exec, segments, cost parameters, memory budget
  // Ulysses × state CP (predict_ulysses, docs/protocols.md): with U > 1 each
  // call runs a pairwise all-to-all over groups of U consecutive ranks of the
  // activations (tokens_per_rank tokens of B·H heads, activation_bytes per
  // element: q, k, g, v, β), the exact exchange the model picks over the P/U
  // ranks of each head slice with B·H/U heads, and the all-to-all of o back;
  // the backward mirrors it (dO in, the gradients out). Needs method auto,
  // the contiguous layout and no documents. 1: the plain exchange.
  std::size_t ulysses = 1;
  std::size_t tokens_per_rank = 4096;
  std::size_t activation_bytes = 2;
};

struct ExchangeBenchResult {
  ExchangeBenchConfig config;
  std::string backend;
  std::size_t ranks = 0, parts = 0, cuts = 0, calls = 0;
  std::string method_run;  // the protocol that ran (auto: its choice)
  Prediction prediction;   // the model's, for the configuration that ran
  ProtocolTiming timing;   // slowest rank per call, median over calls
  // A folded simulation (docs/scale.md): fold steps charged as flops, not
  // computed; the times are the simulation's, the data were not computed.
  bool folded = false;
  // With config.ulysses > 1: the two all-to-alls of a direction (slowest rank
  // per call, median over calls; forward_seconds holds them too) and the
  // model's figures; `prediction` is then the exchange's configuration with
  // seconds = the all-to-alls' and the exchange's.
  ProtocolTiming all_to_all;
  double predicted_all_to_all_seconds = 0, predicted_exchange_seconds = 0;
};

// Collective over `world`; every rank returns the result.
ExchangeBenchResult bench_exchange(const std::shared_ptr<Communicator>& world, const ExchangeBenchConfig& config);

std::string to_json(const ExchangeBenchResult& result);
void print_exchange_bench(const ExchangeBenchResult& result);

}  // namespace kdacp::report
