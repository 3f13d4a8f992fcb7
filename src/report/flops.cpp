#include "kdacp/report/bench.hpp"

namespace kdacp::kda {

double forward_flops(const Shape& s, bool context_parallel) {
  const double tokens = double(s.batch) * double(s.tokens) * double(s.value_heads);
  const double kv = double(s.key_dim) * double(s.value_dim), kk = double(s.key_dim) * double(s.key_dim);
  // forward 7·K·V per token; summary: state 5·K·V + transfer 5·K² per token.
  return tokens * (7 * kv + (context_parallel ? 5 * kv + 5 * kk : 0));
}

double backward_flops(const Shape& s, bool context_parallel) {
  const double tokens = double(s.batch) * double(s.tokens) * double(s.value_heads);
  const double kv = double(s.key_dim) * double(s.value_dim);
  // backward 27·K·V per token (recompute included); G pass 7·K·V per token.
  return tokens * (27 * kv + (context_parallel ? 7 * kv : 0));
}

}  // namespace kdacp::kda
