// `kdacp bench protocols`: forward and backward time of every exact protocol
// on in-process ranks beside its floor, and its peak extra memory beside the
// theoretical one. Part of kdacp_report.
//
// Floor. Each protocol's registry row states its critical path as counts
// (protocol.hpp CostTerms: fold steps, bytes, messages). The floor prices them
// with this host's speeds measured in the same run: the fold steps at the
// kernel speed, the bytes at the memcpy speed measured on exactly that many
// bytes (the in-process transport is a memcpy), messages free. It is the cost
// model's prediction with α = 0, β = memcpy and γ = the kernel, so the bench
// and the model cannot disagree about what a protocol must do. The floor
// assumes a core per rank; with more ranks than cores the ranks' total work
// (every rank's fold steps and received bytes) spread over the host's cores
// is the bound instead when larger: the host floor. The reassociating
// protocols perform other operations (a log-depth scan) and are measured
// against the cost model by `kdacp calibrate`, not here.
//
// Layouts (SPEC §10). Besides one part per rank without cuts, every
// configuration also runs (layouts = true) with cuts, the parts that contain
// a document start when documents of mean length T/(2P) are packed into the
// stream (seeded), and on the zigzag layout (2P parts, rank r holding parts r
// and 2P-1-r), without and with the same documents' cuts. Each such record states the chain steps its longest stretch
// between cuts spans and its time relative to the same configuration on one
// part per rank without cuts: a chain's should approach the longest stretch
// over P-1, zigzag's stays under flash-linear-attention's 2× where a rank's
// two parts travel together.
#pragma once

#include <cstdint>
#include <string>

#include <cstddef>
#include <functional>
#include <memory>
#include <vector>

#include "kdacp/comm.hpp"
#include "kdacp/cost_model.hpp"
#include "kdacp/exchange.hpp"
#include "kdacp/kernels.hpp"
#include "kdacp/summary.hpp"

namespace kdacp::report {

struct ProtocolBenchConfig {
  std::vector<std::size_t> ranks;  // in-process P values
  std::vector<std::size_t> slabs;  // B·H values (B = 1, H = B·H)
  std::size_t key_dim = 128;       // K = V
  std::vector<Direction> directions;
  double min_time = 0.2;  // seconds of timed calls per configuration (median kept)
  bool layouts = true;    // also the cut pattern and zigzag (above)
  std::uint64_t cut_seed = 1;
};

// The bench's cut pattern: `parts` parts of `part_tokens` tokens in chain
// order, documents of mean length `mean_tokens` drawn from `seed` (geometric
// lengths; the same documents for every split of the same stream); part j is
// a cut when a document starts inside it. Part 0 always is.
std::vector<bool> document_cuts(std::size_t parts, std::size_t part_tokens, std::size_t mean_tokens,
                                std::uint64_t seed);

struct ProtocolRecord {
  ProtocolConfig config;
  std::size_t ranks = 0, slabs = 0, key_dim = 0, threads_per_rank = 0;
  Direction direction = Direction::forward;
  double seconds = 0;             // median over calls of the slowest rank
  double floor_seconds = 0;       // critical path at the measured speeds, a core per rank
  double host_floor_seconds = 0;  // >= floor: all ranks' work over this host's cores
  std::size_t peak_extra_bytes = 0, theoretical_extra_bytes = 0;
  // "contiguous" (one part per rank), "cuts" (the same with document_cuts
  // of mean length T/(2P)), "zigzag" or "zigzag+cuts" (the same documents); the longest stretch between cuts in chain steps (P-1, or
  // 2P-1 for zigzag, without cuts); time over the same configuration's
  // contiguous time in the same direction (1 for contiguous records).
  std::string layout = "contiguous";
  std::size_t chain_steps = 0;
  double vs_contiguous = 1;
};

// After each protocol configuration: its forward and backward time and how
// many of the sweep's configurations are done.
using ProtocolBenchProgress = std::function<void(const ProtocolConfig& config, std::size_t ranks,
                                                 std::size_t slabs, double forward_seconds,
                                                 double backward_seconds, std::size_t done,
                                                 std::size_t total)>;

// Every exact registry row at each P (group sizes 2 and P/2 where they are
// proper divisors, a few column segments for rows that take them) and B·H.
std::vector<ProtocolRecord> bench_protocols(const ProtocolBenchConfig& cfg,
                                            const ProtocolBenchProgress& progress = {});

// Seconds of one affine step over `slabs` K×K slabs with `threads` threads,
// best of repeated runs for about min_time: the kernel speed of the floor.
double step_seconds(std::size_t key_dim, std::size_t slabs, std::size_t threads, Direction dir,
                    double min_time);
// Seconds to memcpy `bytes` once (best of repeated runs): the in-process
// transport's cost.
double memcpy_seconds(std::size_t bytes, double min_time);

// One configuration on P in-process ranks: per call the slowest rank's time
// (every rank starts after a barrier), median over the calls; peak extra
// bytes are the largest of any rank; received bytes are all ranks' together.
struct ProtocolTiming {
  double forward_seconds = 0, backward_seconds = 0;
  std::size_t forward_peak = 0, backward_peak = 0;
  std::size_t forward_received_all = 0, backward_received_all = 0;
};
// Every rank passes its parts of `part_owners`; `cuts` (empty: none) are per
// part in chain order.
ProtocolTiming time_protocol(const ProtocolConfig& config, std::size_t ranks, const SummaryShape& shape,
                             double min_time, const PartOwners& part_owners, const std::vector<bool>& cuts = {});

// One rank's share of timing one configuration on any backend (the in-process
// sweep above; `kdacp bench exchange` on MPI or simulated by SMPI): the rank
// makes its own parts' synthetic summaries (the same values on every backend),
// runs `warmup` untimed forward+backward pairs, then timed pairs, each call
// after a barrier and timed on the communicator's clock
// (Communicator::now_seconds: simulated seconds under SMPI). `calls` timed
// pairs, or with calls = 0 as many as fill `min_time` (3..200, sized by rank
// 0 from the last untimed pair; warmup is then at least 1). `options` are the
// factory's (exec, segments, cost parameters...); its part_owners are
// replaced by `part_owners`. Collective over `comm`.
struct RankTimes {
  std::vector<double> forward, backward;  // per timed call
  std::size_t forward_peak = 0, backward_peak = 0;
  std::size_t forward_received = 0, backward_received = 0;  // bytes, last call
  std::string method;                                         // what ran (auto: its choice)
};
RankTimes time_rank(const std::shared_ptr<Communicator>& comm, const ProtocolConfig& config,
                    const SummaryShape& shape, const PartOwners& part_owners, const std::vector<bool>& cuts,
                    ExchangeOptions options, std::size_t warmup, std::size_t calls, double min_time);

// The configuration's timing over all ranks of `comm` from each rank's
// time_rank(): per call the slowest rank, median over calls. Collective;
// every rank gets the result.
ProtocolTiming slowest_rank(Communicator& comm, const RankTimes& mine);

}  // namespace kdacp::report
