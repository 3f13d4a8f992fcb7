// Runs the context-parallel KDA layer on in-process ranks over a whole
// sequence and collects outputs and gradients in the global layout, to compare
// it with one device or another implementation (`kdacp run`, `kdacp kda`).
// Part of kdacp_testing.
#pragma once

#include <chrono>
#include <optional>
#include <string>
#include <vector>

#include "kdacp/kda_cp.hpp"

namespace kdacp::testing {

template <class T>
struct LayerOutputs {
  std::vector<T> o, dq, dk, dv, dg, dbeta;
  double forward_seconds = 0, backward_seconds = 0;  // slowest rank
  double exchange_seconds = 0;                       // slowest rank, forward + backward
  std::string method;
  bool exact = true;  // the protocol performs the chain's operations (SPEC §5)
};

// Zeroed outputs of `s`; the gradients stay empty unless `grads`.
template <class T>
LayerOutputs<T> allocate_outputs(const kda::Shape& s, bool grads);

// One device: the whole sequence on this process with `threads` threads.
template <class T>
LayerOutputs<T> run_single(const kda::LayerData<T>& data, T scale, const std::vector<T>* d_o,
                           std::size_t threads);

// P in-process ranks, each holding its tokens, each with its own exchange
// made by make_state_exchange(mesh, method, group_size, options) and
// `threads_per_rank` threads; d_o == nullptr: forward only. A rank that waits
// longer than timeout_s for a peer fails the run; the first error is
// rethrown.
template <class T>
LayerOutputs<T> run_context_parallel(const kda::LayerData<T>& data, T scale,
                                     const std::vector<T>* d_o, std::size_t ranks,
                                     const std::string& method, long long group_size,
                                     std::size_t threads_per_rank, double timeout_s,
                                     ExchangeOptions options = {});

// Bytes of o and, with grads, of the gradients (as large as the inputs
// q, k, v, g, beta) of `s` in T of elem_bytes.
double layer_output_bytes(const kda::Shape& s, bool grads, std::size_t elem_bytes);

// Bytes run_context_parallel allocates for `s` on `ranks` ranks with T of
// elem_bytes: the ranks' slices, the outputs (gradients too when `grads`),
// the checkpoints and the summaries, and rank_exchange_bytes per rank for its
// exchange (exchange_rank_bytes in kdacp/admission.hpp). The caller's inputs
// are not counted.
double layer_run_bytes(const kda::Shape& s, std::size_t ranks, bool grads, std::size_t elem_bytes,
                       double rank_exchange_bytes);

// Relative Frobenius errors of o, dq, dk, dv, dg and dbeta of `got` against
// `want` (reference::relative_error), in that order.
std::vector<double> relative_errors(const LayerOutputs<float>& got, const LayerOutputs<float>& want);

// Whether o and every gradient are bitwise equal.
bool same_bits(const LayerOutputs<float>& a, const LayerOutputs<float>& b);

// The summary shape of the layer's state exchange: [B, HV, K, V].
SummaryShape layer_summary_shape(const kda::Shape& s);

// Progress lines "<prefix>: <what> (<t> s elapsed)" on stderr, only once
// more than `quiet_seconds` have passed since construction, so that a short
// run prints none.
class Progress {
 public:
  explicit Progress(std::string prefix, double quiet_seconds = 2.0);
  void note(const std::string& what) const;

 private:
  std::string prefix_;
  double quiet_seconds_;
  std::chrono::steady_clock::time_point t0_ = std::chrono::steady_clock::now();
};

// One protocol's run in compare_protocols.
struct ProtocolRun {
  LayerOutputs<float> out;
  long long group_size = 1;
  std::string label;             // the method, with " w=<group size>" when it takes one
  std::optional<bool> bitwise;   // exact protocols: same_bits with the first exact run
};

struct ProtocolComparison {
  std::vector<ProtocolRun> runs;  // in registry order
  bool all_bitwise = true;        // every exact run's `bitwise`
};

// The layer, forward and backward against d_o, with every protocol of the
// registry but auto on `ranks` in-process ranks of threads_per_rank threads
// each (run_context_parallel). A protocol that takes a group size runs at
// w = P/2, and only when that is a proper divisor of P (even P >= 4).
// progress.note("running <method>") precedes each run.
ProtocolComparison compare_protocols(const kda::LayerData<float>& data, float scale, const std::vector<float>& d_o,
                                     std::size_t ranks, std::size_t threads_per_rank, double timeout_s,
                                     const Progress& progress);

// Bytes run_single and compare_protocols allocate for float `shape` on
// `ranks` ranks beside the inputs: every run's outputs and gradients, kept
// for the comparison, and one context-parallel run at a time with the
// hungriest protocol of the cost model.
double compare_protocols_bytes(const kda::Shape& shape, std::size_t ranks);

}  // namespace kdacp::testing
