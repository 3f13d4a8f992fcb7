#include "kda/validate.hpp"

#include <algorithm>
#include <cmath>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "kdacp/error.hpp"

namespace kdacp::kda::check {

void pointer(const void* ptr, std::string_view where, std::string_view field) {
  if (ptr == nullptr)
    throw InvalidArgument(fmt::format("{}{} is null, expected a pointer to its tensor", where, field));
}

template <class T>
void inputs(const Inputs<T>& in, std::string_view where) {
  validate(in.shape);
  // A field may be stored as 16-bit instead (Inputs::half).
  const auto at = [](const void* wide, const HalfField& half) { return wide ? wide : half.bits; };
  pointer(at(in.q, in.half.q), where, "q");
  pointer(at(in.k, in.half.k), where, "k");
  pointer(at(in.v, in.half.v), where, "v");
  pointer(at(in.g, in.half.g), where, "g");
  pointer(at(in.beta, in.half.beta), where, "beta");
  if (!std::isfinite(in.scale) || !(in.scale > 0))
    throw InvalidArgument(fmt::format(
        "{}scale = {}, expected a finite value > 0 (default_scale(K) = 1/sqrt(K))", where, in.scale));
}

template <class T>
void grads(const Grads<T>& g, std::string_view where) {
  pointer(g.dq, where, "dq");
  pointer(g.dk, where, "dk");
  pointer(g.dv, where, "dv");
  pointer(g.dg, where, "dg");
  pointer(g.dbeta, where, "dbeta");
}

void algorithm(Algorithm algorithm, std::string_view where) {
  if (algorithm != Algorithm::recurrent && algorithm != Algorithm::chunk)
    throw InvalidArgument(fmt::format(
        "{}algorithm = {}, expected Algorithm::recurrent or Algorithm::chunk", where,
        static_cast<int>(algorithm)));
}

void checkpoint_interval(std::size_t interval, std::string_view where) {
  if (interval == 0)
    throw InvalidArgument(fmt::format("{}checkpoint_interval = 0, expected >= 1", where));
}

template <class T>
void states(const SequenceStates<T>& st, const Sequences& seqs, const Shape& s,
            std::string_view where, std::string_view field) {
  if (st.data == nullptr) return;
  const std::size_t want[4] = {seqs.count(), s.value_heads, s.key_dim, s.value_dim};
  const std::size_t got[4] = {st.sequences, st.value_heads, st.key_dim, st.value_dim};
  if (std::equal(got, got + 4, want)) return;
  throw InvalidArgument(fmt::format("{}{} has shape [{}], expected [N,HV,K,V] = [{}]", where,
                                    field, fmt::join(got, ","), fmt::join(want, ",")));
}

void batch(const Shape& s, const Sequences& seqs, std::string_view where) {
  if (s.batch != seqs.batch())
    throw InvalidArgument(fmt::format("{}shape.batch (B) = {}, expected the sequences' B = {}",
                                      where, s.batch, seqs.batch()));
}

void whole_stream(const Shape& s, const Sequences& seqs, std::string_view where) {
  if (s.tokens != seqs.tokens())
    throw InvalidArgument(fmt::format("{}shape.tokens (T) = {}, expected the sequences' T = {}",
                                      where, s.tokens, seqs.tokens()));
  batch(s, seqs, where);
}

// The deterministic mode with Algorithm::chunk: one device runs a sequence's
// chunks from its first token, so a part continuing a sequence must start on
// one of those chunk boundaries for its walk to be the same bits. Checks
// every part of the layout (each rank the same), naming the first offender.
void chunk_boundaries(const Sequences& seqs, const Layout& layout) {
  const std::vector<std::size_t>& bounds = seqs.boundaries();
  for (const LayoutPart& p : layout.parts()) {
    const std::size_t start = *(std::upper_bound(bounds.begin(), bounds.end(), p.begin) - 1);
    if ((p.begin - start) % kChunkSize != 0)
      throw InvalidArgument(fmt::format(
          "deterministic mode with algorithm chunk: the part [{}, {}) on rank {} starts {} tokens "
          "into its sequence (tokens [{}, ...)), expected a multiple of {} (the chunk size): a "
          "cut inside a sequence must fall on a {}-token boundary of that sequence "
          "(docs/determinism.md), or use algorithm recurrent",
          p.begin, p.end, p.rank, p.begin - start, start, kChunkSize, kChunkSize));
  }
}

#define KDACP_CHECK_INSTANTIATE(T)                                                           \
  template void inputs<T>(const Inputs<T>&, std::string_view);                               \
  template void grads<T>(const Grads<T>&, std::string_view);                                 \
  template void states<T>(const SequenceStates<T>&, const Sequences&, const Shape&,          \
                          std::string_view, std::string_view);                               \
  template void states<const T>(const SequenceStates<const T>&, const Sequences&,            \
                                const Shape&, std::string_view, std::string_view);

KDACP_CHECK_INSTANTIATE(float)
KDACP_CHECK_INSTANTIATE(double)
#undef KDACP_CHECK_INSTANTIATE

}  // namespace kdacp::kda::check
