// Internal: affine pairs (O, N) per (b,h) and their composition, what the
// reassociating protocols' recursive-doubling scan (runs.hpp) combines.
//
// A pair is the map x -> op(N)·x + O, op = identity forward and transpose
// backward (SPEC §3, §4). Composing outer∘inner (inner first in chain order):
//   forward:  O = N_o·O_i + O_o,   N = N_o·N_i
//   backward: O = N_oᵀ·O_i + O_o,  N = N_i·N_o   (so that op(N) = N_oᵀ·N_iᵀ)
// Every product is one affine step of the library's kernel, so a pair
// composition costs a K×K·K×V and a K×K·K×K step per (b,h).
#pragma once

#include <cstddef>
#include <span>

#include "core/flagged_buffer.hpp"
#include "exchange/cost_terms.hpp"
#include "kdacp/comm.hpp"
#include "kdacp/kernels.hpp"
#include "kdacp/summary.hpp"
#include "kdacp/tensor.hpp"

namespace kdacp::detail {

// c = op(m)·x + s for every (b,h) slab of [B,H,K,cols] views, m [B,H,K,K];
// s == nullptr is a zero offset. c may alias s, never x or m.
void apply_step(const StateView& m, const StateView& x, const StateView* s, const StateView& c,
                bool transpose, const ExecPolicy& policy);

// Copies a (possibly strided) [B,H,rows,cols] view into another of the same shape.
void copy_view(const StateView& src, const StateView& dst);

// An affine pair as views. A cut pair (SPEC §10) is the constant map
// x -> offset: its transfer is zero and never read.
struct PairView {
  StateView offset;
  StateView transfer;
  bool cut = false;
};

// One pair per (b,h): its flags (kSlotTailBytes), all offsets [B,H,K,V], then
// all transfers [B,H,K,K], dense, so that the flags and offsets alone are one
// contiguous message.
class PairBuffer {
 public:
  PairBuffer() = default;
  explicit PairBuffer(const SummaryShape& shape);
  StateView offset() const;
  StateView transfer() const;
  bool cut() const;
  void set_cut(bool cut) const;
  PairView view() const { return {offset(), transfer(), cut()}; }
  // The message: flags and offsets, or flags, offsets and transfers.
  std::span<std::byte> bytes(bool with_transfer) const;

 private:
  SummaryShape shape_{};
  FlaggedBuffer buf_;  // the flags first (kSlotTailBytes), then S and M
};

// dest = outer∘inner; only dest's offset when !with_transfer. A cut outer is
// copied; a cut inner makes a cut result. dest must not share storage with
// either operand.
void compose(const PairView& outer, const PairView& inner, const PairBuffer& dest,
             bool with_transfer, Direction direction, const ExecPolicy& policy);

// The recursive-doubling exclusive scan itself is rd_exclusive_scan_parts
// (runs.hpp): one position per member is the scan over the ranks.
//
// The documented bound of a recursive-doubling scan over P positions: the
// relative Frobenius error against the FP64 chain is at most
// (ceil(log2 P) + 2) · K · 2^-24 for transfers of spectral norm <= 1
// (docs/protocols.md derives it; the protocol tests hold every P to it).
inline double reassociation_bound(std::size_t ranks, std::size_t key_dim) {
  std::size_t rounds = 0;
  while ((std::size_t{1} << rounds) < ranks) ++rounds;
  return static_cast<double>(rounds + 2) * static_cast<double>(key_dim) * 0x1p-24;
}

}  // namespace kdacp::detail
