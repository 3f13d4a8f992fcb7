// Memory estimates of a layer job (kdacp/job.hpp): what the admission asks
// before a run allocates, per process and per rank.
#include "kdacp/job.hpp"

#include <algorithm>
#include <cmath>

#include <fmt/format.h>

#include "kdacp/admission.hpp"
#include "kdacp/cost_model.hpp"
#include "kdacp/error.hpp"
#include "kdacp/kda_ulysses.hpp"
#include "kdacp/protocol.hpp"

namespace kdacp::job {
double layer_output_bytes(const kda::Shape& s, bool grads, std::size_t elem_bytes) {
  // In double: a shape too large for size_t products must still be refused.
  const double bt = double(s.batch) * double(s.tokens), hv = double(s.value_heads);
  const double qk = bt * double(s.heads) * double(s.key_dim), v = bt * hv * double(s.value_dim);
  const double g = bt * hv * double(s.key_dim), beta = bt * hv;
  return (v + (grads ? 2 * qk + v + g + beta : 0.0)) * double(elem_bytes);
}



double layer_rank_bytes(const kda::Shape& s, std::size_t sequences, const kda::Layout& layout, bool grads,
                        std::size_t elem_bytes, double rank_exchange_bytes) {
  std::size_t local = 0;
  const std::size_t parts = layout.owners().max_per_rank();
  for (std::size_t r = 0; r < layout.ranks(); ++r) local = std::max(local, layout.local_tokens(r));
  const double share = double(local) / double(s.tokens);
  const double kv = double(s.value_heads) * double(s.key_dim) * double(s.value_dim);
  const double state = double(s.batch) * kv;
  // The largest rank's slices of the inputs and of its outputs, and rank 0's
  // outputs gathered in the global layout.
  const double tensors = share * (layer_output_bytes(s, true, elem_bytes) + layer_output_bytes(s, grads, elem_bytes)) +
                         layer_output_bytes(s, grads, elem_bytes);
  const double states = state * (double(local) / 64 + 5 * double(parts)) * double(elem_bytes);
  const double sequence_states = double(sequences) * kv * 5 * double(elem_bytes);
  return tensors + states + sequence_states + rank_exchange_bytes;
}


std::size_t resolve_ulysses(std::size_t given, const std::string& method, const kda::Shape& s,
                            const kda::Layout& layout, const ExchangeOptions& eo, std::size_t elem_bytes) {
  if (given != kUlyssesAuto) return given;
  if (!find_protocol(method).chooser())
    throw InvalidArgument(fmt::format("Ulysses width auto prices each U with the exact protocol auto chooses, "
                                      "expected protocol auto, got {}",
                                      method));
  return choose_ulysses(s, layout, eo, elem_bytes);
}

void check_ulysses(std::size_t width, std::size_t ranks, const kda::Shape& s) {
  if (width == 0 || ranks % width != 0 || s.heads % width != 0 || s.value_heads % width != 0)
    throw InvalidArgument(fmt::format("Ulysses width U = {}: expected a divisor of P = {}, H = {} and HV = {}", width,
                                      ranks, s.heads, s.value_heads));
}

double ulysses_rank_bytes(const kda::Shape& s, std::size_t sequences, const kda::Layout& layout, std::size_t width,
                          bool grads, std::size_t elem_bytes) {
  if (width <= 1) return 0;
  const kda::Layout group = kda::ulysses_group_layout(layout, width);
  std::size_t own = 0, together = 0;  // the most tokens of one rank, of one group
  for (std::size_t r = 0; r < layout.ranks(); ++r) own = std::max(own, layout.local_tokens(r));
  for (std::size_t c = 0; c < group.ranks(); ++c) together = std::max(together, group.local_tokens(c));
  const double per_token_in = double(s.heads) * 2 * double(s.key_dim) +
                              double(s.value_heads) * (double(s.value_dim) + double(s.key_dim) + 1);
  const double per_token_out = double(s.value_heads) * double(s.value_dim);
  const double b = double(s.batch), u = double(width), e = double(elem_bytes);
  const double slice_in = b * double(together) * per_token_in / u, rank_in = b * double(own) * per_token_in;
  const double slice_out = b * double(together) * per_token_out / u;
  // Kept inputs (and gradients), o (and d_o) slices, send + receive buffers
  // (the largest all-to-all: the inputs'), and per sequence the h0 slice,
  // the ht / dh0 slots and dht's blocks.
  const double tensors = (grads ? 2 : 1) * (slice_in + slice_out) + 2 * std::max(rank_in, slice_in);
  const double states = double(sequences) * double(s.value_heads) * double(s.key_dim) * double(s.value_dim) * 4;
  return (tensors + states) * e;
}

double layer_run_bytes(const kda::Shape& s, std::size_t sequences, std::size_t ranks, bool grads,
                       std::size_t elem_bytes, double rank_exchange_bytes, std::size_t parts, bool in_place) {
  const double kv = double(s.value_heads) * double(s.key_dim) * double(s.value_dim);
  const double state = double(s.batch) * kv;
  // The ranks' slices of the inputs (as large as the gradients) and of the
  // outputs unless in place, the outputs, checkpoints every 64 tokens, per
  // rank S, M, the incoming state and G, and per rank its dht, ht and dh0
  // [N,HV,K,V] beside the job's h0 and dht.
  const double slices =
      in_place ? 0.0 : layer_output_bytes(s, true, elem_bytes) + layer_output_bytes(s, grads, elem_bytes);
  const double tensors = slices + layer_output_bytes(s, grads, elem_bytes);
  const double states = state * (double(s.tokens) / 64 + 5 * double(parts ? parts : ranks)) * double(elem_bytes);
  const double sequence_states = double(sequences) * kv * (3 * double(ranks) + 2) * double(elem_bytes);
  return tensors + states + sequence_states + double(ranks) * rank_exchange_bytes;
}

double layer_cache_bytes(const kda::Shape& s, kda::Algorithm algorithm, std::size_t tokens, std::size_t pieces,
                         std::size_t elem_bytes) {
  if (algorithm != kda::Algorithm::chunk) return 0;
  // A piece of t tokens keeps ⌈t/C⌉ - 1 < t/C states and L, P of c×c per
  // chunk of c ≤ C tokens (≤ 2·C·t in all): however the tokens are cut.
  (void)pieces;
  const double c = double(kda::kChunkSize);
  const double per_pair = std::ceil(double(tokens) / c) * double(s.key_dim) * double(s.value_dim) +
                          2 * c * double(tokens) + 2 * double(tokens) * double(s.value_dim);
  return double(s.batch) * double(s.value_heads) * per_pair * double(elem_bytes);
}

double layer_backward_records_bytes(const kda::Shape& s, kda::Algorithm algorithm, std::size_t tokens,
                                    std::size_t pieces, std::size_t elem_bytes, bool keep_forward,
                                    std::size_t threads) {
  const double cache = layer_cache_bytes(s, algorithm, tokens, pieces, elem_bytes);
  if (keep_forward) return cache;
  // One record per (row, value head) in flight: a thread's scratch.
  const double pairs = double(s.batch) * double(s.value_heads);
  return cache * std::min(double(std::max<std::size_t>(threads, 1)), pairs) / pairs;
}

double compare_protocols_bytes(const kda::Shape& shape, std::size_t sequences, const kda::Layout& layout,
                               bool one_rank_per_process, bool keep_forward, std::size_t ulysses) {
  const std::size_t ranks = layout.ranks();
  const ProblemShape ps = layer_problem_shape(shape, sizeof(float), layout);
  // compare_protocols runs only the rows that take the layout when it is not
  // the plain one.
  const bool plain = !needs_layout_rows(ps);
  Prediction hungriest;
  std::size_t protocols = 0;
  for (const Prediction& p : predict_all(CostParams{}, ps, true)) {
    if (!plain && !find_protocol(p.config.method).takes_layouts) continue;
    ++protocols;
    if (p.peak_extra_bytes >= hungriest.peak_extra_bytes) hungriest = p;
  }
  const double kept_states =
      2 * double(sequences) * double(shape.value_heads) * double(shape.key_dim) * double(shape.value_dim);
  const double kept = double(protocols + 2) * (layer_output_bytes(shape, true, sizeof(float)) + kept_states * sizeof(float));
  const double exchange = exchange_rank_bytes(ps, hungriest);
  // The single-rank run's cache (the whole stream) is as large as all P
  // ranks' together, and never held at the same time as theirs.
  const std::size_t pieces = sequences + layout.parts().size();
  const double cache =
      keep_forward ? layer_cache_bytes(shape, kda::Algorithm::chunk, shape.tokens, pieces, sizeof(float)) : 0.0;
  // The Ulysses layer's buffers per rank: of the width given, or the widest
  // of any width auto may pick (a width that does not divide P, H and HV is
  // refused by the run, naming it).
  double ulysses_extra = 0;
  for (std::size_t u = 2; u <= ranks; ++u) {
    if (ulysses != kUlyssesAuto && u != ulysses) continue;
    if (ranks % u != 0 || shape.heads % u != 0 || shape.value_heads % u != 0) continue;
    ulysses_extra = std::max(ulysses_extra, ulysses_rank_bytes(shape, sequences, layout, u, true, sizeof(float)));
  }
  if (one_rank_per_process)
    return kept + cache + layer_rank_bytes(shape, sequences, layout, true, sizeof(float), exchange) + ulysses_extra;
  return kept + cache + layer_run_bytes(shape, sequences, ranks, true, sizeof(float), exchange, layout.parts().size()) +
         double(ranks) * ulysses_extra;
}

}  // namespace kdacp::job
