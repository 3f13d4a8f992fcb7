// FP64 reference of the chain (SPEC §3, §4), kept out of the core library: the
// CLI and the tests measure the library against it. Part of kdacp_testing.
#pragma once

#include <cstddef>
#include <vector>

#include "kdacp/kernels.hpp"
#include "kdacp/summary.hpp"

namespace kdacp::reference {

// Per rank r: incoming_r (forward) or out_r (backward), dense [B,H,K,V] in
// double, evaluated in the chain's order. offsets[r] / maps[r] are dense
// [B,H,K,V] / [B,H,K,K] float arrays of rank r.
std::vector<std::vector<double>> chain(const std::vector<const float*>& offsets,
                                       const std::vector<const float*>& maps,
                                       const SummaryShape& shape, Direction dir);

struct ErrorStats {
  double max_abs = 0;  // NaN when any difference is NaN
  double rel_fro = 0;  // ||x - ref||_F / ||ref||_F (||x - ref||_F when ref is zero)
};

// x has ref.size() elements.
ErrorStats compare(const float* x, const std::vector<double>& ref);

}  // namespace kdacp::reference
