// The summary contract (SPEC §2, §8). Each check throws InvalidArgument with
// a message naming the field, the value, the expectation and the rank.
#pragma once

#include <cstddef>
#include <string>

#include "kdacp/tensor.hpp"

namespace kdacp {

// Head sizes K and V: any integer in [kMinDim, kMaxDim] (flash-linear-attention
// takes K <= 256).
inline constexpr std::size_t kMinDim = 1;
inline constexpr std::size_t kMaxDim = 256;
// pipelined_p2p cuts V into units of this many columns (the last unit holds
// the remainder V mod 16 when 16 does not divide V): at most max_segments(V)
// = ceil(V/16) segments.
inline constexpr std::size_t kSegmentColumns = 16;

// Shape of one rank's summaries: S/G [B,H,K,V], M [B,H,K,K].
struct SummaryShape {
  std::size_t batch = 0, heads = 0, key_dim = 0, value_dim = 0;
  // float32 in production; float64 runs the same protocols for verification.
  DType dtype = DType::f32;
  friend bool operator==(const SummaryShape&, const SummaryShape&) = default;
  std::size_t slabs() const { return batch * heads; }
  std::size_t state_elems() const { return batch * heads * key_dim * value_dim; }
  std::size_t packed_cols() const { return value_dim + key_dim; }
  std::size_t packed_elems() const { return batch * heads * key_dim * packed_cols(); }
};
std::string to_string(const SummaryShape& shape);

// Checks one view against the generic layout rules: FP32 (or FP64), supported device,
// non-empty B/H, unit column stride, batch stride == heads * head_stride,
// rows/cols inside their slab. `field` names the argument ("S", "M", "G").
void validate_view(const StateView& view, const std::string& field, std::size_t rank);

// Checks an offset (S or G) and a transfer M as one rank's summary and returns
// the shape. `offset_name` is "S" (forward) or "G" (backward).
SummaryShape validate_summary(const StateView& offset, const StateView& transfer,
                              const std::string& offset_name, std::size_t rank);

// Checks a rank-stacked pair (offsets [P,B,H,K,V], transfers [P,B,H,K,K]).
SummaryShape validate_stack(const StackView& offsets, const StackView& transfers,
                            std::size_t rank);

}  // namespace kdacp
