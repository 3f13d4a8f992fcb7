// Checking a state exchange on a live world (`kdacp exchange`): every rank's
// summaries from one process, timed calls on every rank, the bitwise
// comparison with the p2p chain and the errors against the FP64 chain, all
// collected on rank 0. Part of kdacp_report. Calls that take a
// communicator are collective.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kdacp/comm.hpp"
#include "kdacp/exchange.hpp"
#include "kdacp/kernels.hpp"
#include "kdacp/launch.hpp"
#include "kdacp/mesh.hpp"
#include "kdacp/output.hpp"
#include "kdacp/protocol.hpp"
#include "kdacp/report/exchange_flags.hpp"
#include "kdacp/summary.hpp"
#include "kdacp/tensor.hpp"
#include "kdacp/testing/reference.hpp"
#include "kdacp/units.hpp"

namespace kdacp::report {

// Every rank's summaries, dense: S and G [B,H,K,V], M [B,H,K,K] per rank.
struct WorldSummaries {
  SummaryShape shape;
  std::vector<std::vector<float>> s, m, g;
  std::uint64_t seed = 0;  // of the synthetic summaries, or gradients when read without G.npy
  std::size_t ranks() const { return s.size(); }
};

// synthetic_summary(shape, seed, r, ...) of ranks r = 0..ranks-1.
WorldSummaries synthetic_world(const SummaryShape& shape, std::size_t ranks, std::uint64_t seed);

// S.npy [P,B,H,K,V], M.npy [P,B,H,K,K] and optional G.npy [P,B,H,K,V] from
// `dir`, all float32; without G.npy the gradients are synthetic (seed). A
// missing or malformed file throws IoError naming it, a NaN or infinity
// InvalidArgument naming the file and the element.
WorldSummaries read_world_npy(const std::string& dir, std::uint64_t seed);

// What read_world_npy(dir) allocates at most, from the files' sizes.
double world_npy_bytes(const std::string& dir);

// Bytes the check allocates in a process that runs `ranks_here` ranks of a
// world of `world` ranks, rank 0 among them (its gathered world, results and
// FP64 chain), where one call of the exchange holds rank_call_bytes per rank
// (exchange_rank_bytes in kdacp/admission.hpp).
double exchange_check_bytes(const SummaryShape& shape, std::size_t world, std::size_t ranks_here,
                            double rank_call_bytes);

// Where a check takes the world's summaries from: synthetic ones of `shape`
// (synthetic_world), or the files of `dir` (read_world_npy), which must have
// the world's P and the dimensions of `shape` the caller fixed.
struct SummarySpec {
  std::string dir;     // empty: synthetic
  SummaryShape shape;  // synthetic: the shape; files: only its fixed dimensions count
  std::uint64_t seed = 0;
  bool fixed_batch = false, fixed_heads = false, fixed_key_dim = false, fixed_value_dim = false;
  std::string max_memory;  // limit text of max_memory_bytes for reading the files
};

// The source of `kdacp exchange`'s summaries. An in-process run may read the
// files before its ranks start (read_ahead), so that the world can take the
// files' P; otherwise rank 0 reads them inside the check.
class SummarySource {
 public:
  explicit SummarySource(SummarySpec spec);

  // Reads the files now and returns their P (0 for synthetic summaries,
  // nothing read). With `world_ranks` the world will take the files' P: one
  // outside it throws InvalidArgument naming S.npy and the range.
  std::size_t read_ahead(const std::optional<IntRange>& world_ranks);

  // The shape every rank knows before the scatter (check_exchange's
  // `shape`): synthetic, or read ahead; nullopt when rank 0 reads the files.
  // Set before the ranks start and never changed by them.
  const std::optional<SummaryShape>& shape() const { return shape_; }

  // check_exchange's make() on a world of `ranks` ranks: the summaries read
  // ahead (handed over once), or made now. Files are first admitted
  // (world_npy_bytes against max_memory, OutOfMemory naming the directory);
  // a P other than `ranks` or a fixed dimension the files do not have throws
  // InvalidArgument naming both values.
  WorldSummaries operator()(std::size_t ranks);

 private:
  WorldSummaries read() const;

  SummarySpec spec_;
  std::optional<SummaryShape> shape_;
  std::optional<WorldSummaries> ahead_;
};

// This rank's summaries.
struct RankSummaries {
  SummaryShape shape;
  State s, m, g;
};

// Rank 0 calls make() and sends every rank its own summaries; *world (rank
// 0's) keeps what make() returned. When make() throws kdacp::Error, rank 0
// throws InvalidArgument with its message and the other ranks return nullopt
// instead of waiting for inputs that never come.
std::optional<RankSummaries> scatter_summaries(Communicator& comm,
                                               const std::function<WorldSummaries()>& make,
                                               WorldSummaries* world);

// One rank's measurements: medians per call over the repetitions, traffic
// and peak extra bytes of the last one. Plain data: it travels as bytes.
struct ExchangeRecord {
  double forward_seconds = 0, backward_seconds = 0;
  double forward_bytes_sent = 0, forward_bytes_received = 0;
  double backward_bytes_sent = 0, backward_bytes_received = 0;
  double peak_extra_bytes = 0;
  double equal_to_p2p = 1;  // 1 or 0; stays 1 unless compare_with_p2p found a difference
};

struct RankRun {
  ExchangeRecord record;
  State incoming, final_grad;  // of the last repetition
};

// `repeat` forward + backward calls of ex, each started after a barrier.
RankRun time_exchange(Communicator& comm, StateExchange& ex, const RankSummaries& in,
                      std::size_t repeat);

// For an exact protocol other than p2p: runs the p2p chain on the same
// summaries with `exec` and records whether run's results equal it bit for
// bit. Reassociating protocols and p2p itself leave run untouched (every
// rank decides alike, so the call stays collective).
void compare_with_p2p(const DeviceMesh& mesh, const StateExchange& ex, const ExecPolicy& exec,
                      const RankSummaries& in, RankRun& run);

// Every rank's run on rank 0, in rank order; the other ranks get none.
std::vector<RankRun> gather_runs(Communicator& comm, const SummaryShape& shape, RankRun mine);

struct RankErrors {
  reference::ErrorStats forward, backward;
};

// Each run's incoming state and final-state gradient against the FP64 chain
// of `world` (one run per rank of world).
std::vector<RankErrors> chain_errors(const WorldSummaries& world, const std::vector<RankRun>& runs);

// Checks what write_runs_npy would write, before anything is written: the
// first NaN or ±Inf throws Error naming the file (incoming.npy, then
// final_grad.npy), the element's index [P,B,H,K,V] and its value.
void require_finite_runs(const SummaryShape& shape, const std::vector<RankRun>& runs);

// incoming.npy and final_grad.npy [P,B,H,K,V] of the runs into `dir`
// (created if needed).
void write_runs_npy(const std::string& dir, const SummaryShape& shape, const std::vector<RankRun>& runs);

// `kdacp exchange --out DIR`: require_finite_runs (its Error adds "; nothing
// was written to <dir>"), then write_runs_npy into a StagedOutput of `dir`,
// returned uncommitted: the caller commits once the run passed.
std::unique_ptr<StagedOutput> stage_runs_npy(const std::string& dir, const SummaryShape& shape,
                                             const std::vector<RankRun>& runs);

// What check_exchange runs on every rank.
struct ExchangeCheck {
  std::string method = "auto";  // make_state_exchange's method and group size
  long long group_size = 1;
  // The factory's options; the check sets expected_shape and exec (a pool of
  // `threads` threads and `kernel`).
  ExchangeOptions options;
  KernelKind kernel = KernelKind::best;
  std::size_t threads = 0;     // per rank; 0: ThreadPool::default_threads(ranks_here)
  std::size_t ranks_here = 1;  // ranks of the world that run in this process
  std::size_t repeat = 5;
  std::string max_memory;      // limit text of max_memory_bytes (kdacp/admission.hpp)
};

// Throws OutOfMemory before any allocation when exchange_check_bytes of the
// configuration `check` builds for `shape` on `world` ranks exceeds its
// memory limit; the message names the protocol, the ranks and the shape.
void admit_exchange_check(const ExchangeCheck& check, const SummaryShape& shape, std::size_t world);

// Everything a check learns, on rank 0.
struct ExchangeCheckResult {
  std::string backend;  // the communicator's
  std::string kernel;   // "scalar" or "simd(<target>)"
  std::size_t ranks = 0, threads = 0;
  SummaryShape shape;
  const ProtocolDescriptor* protocol = nullptr;  // the one that ran (auto: its choice)
  std::optional<Prediction> prediction;          // auto's
  ExchangeOptions options;                       // as the exchange was built
  WorldSummaries world;                          // every rank's inputs
  std::vector<RankRun> runs;                     // one per rank
  std::vector<RankErrors> errors;                // chain_errors of the runs
  // The worst error of any rank and direction; NaN when any error is NaN.
  double max_abs_error = 0, max_rel_error = 0;
  bool equal_to_p2p = true;  // every rank's record (always true when not exact)
  // As asked of the check.
  std::string requested_method;
  long long group_size = 1;
  std::size_t repeat = 0;
};

// `kdacp exchange --json`: one object with the run's configuration, each
// rank's record and errors under "ranks", the worst errors, the verdict
// ("bitwise_equal_to_p2p", null when not exact) and, for auto, its choice
// under "auto"; as text indented by two spaces, without a final newline.
std::string to_json(const ExchangeCheckResult& result);

// `kdacp exchange`'s text on stdout: a line with the backend, `method` (how
// the caller names what ran, e.g. auto's choice), the group size, the shape,
// kernel, threads and repeat; one table row per rank (times, traffic, peak
// extra memory, errors against the FP64 chain, == p2p); the worst errors and
// the verdict against p2p (or the reassociating protocol's bound).
void print_exchange_check(const ExchangeCheckResult& result, const std::string& method);

// Collective over `world`. Rank 0 calls make() and scatters its summaries
// (scatter_summaries: a kdacp::Error of make() throws on rank 0 and ends the
// others quietly). Every rank admits its share of the run
// (admit_exchange_check), before the scatter when `shape` is known there and
// after it otherwise; then builds the exchange on a ThreadPool of its own,
// times `repeat` calls (time_exchange) and compares them with the p2p chain
// (compare_with_p2p). Rank 0 returns the gathered result; the others nullopt.
std::optional<ExchangeCheckResult> check_exchange(const std::shared_ptr<Communicator>& world,
                                                  const ExchangeCheck& check,
                                                  const std::function<WorldSummaries()>& make,
                                                  const std::optional<SummaryShape>& shape);

// `kdacp exchange`'s flags as given.
struct ExchangeCheckFlags {
  LaunchOptions backend;
  ExchangeFlags exchange;
  std::size_t batch = 1, heads = 4, key_dim = 128, value_dim = 128;
  std::uint64_t seed = 0;
  std::size_t repeat = 5;
  std::size_t threads = 0;
  KernelKind kernel = KernelKind::best;
  bool json = false;
  std::string summaries, out, max_memory;  // empty: synthetic summaries, no files written, the machine's memory
  // Flags given explicitly; they must agree with --summaries files.
  bool given_batch = false, given_heads = false, given_k = false, given_v = false;
};

// `kdacp exchange` on the ranks of `flags.backend` (launch with `launcher`):
// in-process, --summaries is read before the ranks start, so that without
// --ranks the world takes the files' P; check_exchange, then rank 0 prints
// (to_json or print_exchange_check) and writes --out. Throws Error when a
// result is not finite or an exact protocol differs from the p2p chain
// (then nothing is written).
void run_exchange_check(ExchangeCheckFlags flags, const ProcessLauncher* launcher);

}  // namespace kdacp::report
