// Runs the context-parallel KDA layer on in-process ranks over a whole
// sequence and collects outputs and gradients in the global layout. Shared by
// `kdacp run` and `kdacp kda`.
#pragma once

#include <string>
#include <vector>

#include "kdacp/kda_cp.hpp"

namespace kdacp::cli {

template <class T>
struct LayerOutputs {
  std::vector<T> o, dq, dk, dv, dg, dbeta;
  double forward_seconds = 0, backward_seconds = 0;  // slowest rank
  double exchange_seconds = 0;                       // slowest rank, forward + backward
  std::string method;
  bool exact = true;  // the protocol performs the chain's operations (SPEC §5)
};

template <class T>
LayerOutputs<T> allocate_outputs(const kda::Shape& s, bool grads);

// One device: the whole sequence on this process with `threads` threads.
template <class T>
LayerOutputs<T> run_single(const kda::LayerData<T>& data, T scale, const std::vector<T>* d_o,
                           std::size_t threads);

// P in-process ranks, each holding its tokens; d_o == nullptr: forward only.
template <class T>
LayerOutputs<T> run_context_parallel(const kda::LayerData<T>& data, T scale,
                                     const std::vector<T>* d_o, std::size_t ranks,
                                     const std::string& method, long long group_size,
                                     std::size_t threads_per_rank, double timeout_s,
                                     ExchangeOptions options = {});

// The summary shape of the layer's state exchange: [B, HV, K, V].
SummaryShape layer_summary_shape(const kda::Shape& s);

}  // namespace kdacp::cli
