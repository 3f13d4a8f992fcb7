// Where a stream's tokens live over the context-parallel ranks (SPEC §10),
// in one value: its parts (token ranges in chain order), the rank owning
// each part, and, with the stream's sequences (cu_seqlens), which parts are
// cuts. The exchange, the cost model, admission, the layer, the CLI and
// Python all read this one definition; nothing else encodes a layout rule.
//
// Below the exchange in the module DAG: this header includes nothing of
// kdacp but the error types.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace kdacp {

// Tokens [begin, begin + count) of rank `rank`: the first T mod P ranks take
// one more. P > T is an InvalidArgument (a rank would hold no token).
struct TokenSplit {
  std::size_t begin = 0, count = 0;
};
TokenSplit split_tokens(std::size_t tokens, std::size_t ranks, std::size_t rank);

// Copies tokens [begin, begin+count) of a [B,T,inner] tensor into a dense
// [B,count,inner] one (and back, for outputs).
template <class T>
void slice_tokens(const T* full, std::size_t batch, std::size_t tokens, std::size_t inner,
                  TokenSplit range, T* local) {
  for (std::size_t b = 0; b < batch; ++b)
    std::memcpy(local + b * range.count * inner, full + (b * tokens + range.begin) * inner,
                range.count * inner * sizeof(T));
}
template <class T>
void unslice_tokens(const T* local, std::size_t batch, std::size_t tokens, std::size_t inner,
                    TokenSplit range, T* full) {
  for (std::size_t b = 0; b < batch; ++b)
    std::memcpy(full + (b * tokens + range.begin) * inner, local + b * range.count * inner,
                range.count * inner * sizeof(T));
}

// The rank holding each part, in chain order, over P ranks: always explicit
// (one part per rank is PartOwners::one_per_rank(P), the list {0, ..., P-1}).
// Every rank holds at least one part.
class PartOwners {
 public:
  // Throws InvalidArgument naming the entry for an owner >= P, and for a
  // rank holding no part.
  PartOwners(std::size_t ranks, std::vector<std::size_t> owners);
  // Part r on rank r.
  static PartOwners one_per_rank(std::size_t ranks);
  // 2P parts, rank r holding parts r and 2P-1-r (the load-balanced layout
  // of causal softmax-attention CP, flash-linear-attention's zigzag).
  static PartOwners zigzag(std::size_t ranks);

  std::size_t ranks() const { return ranks_; }             // P
  std::size_t size() const { return owners_.size(); }      // parts, n
  std::size_t operator[](std::size_t part) const { return owners_[part]; }
  const std::vector<std::size_t>& list() const { return owners_; }
  // One part per rank in rank order: the layout every protocol runs.
  bool is_one_per_rank() const;
  // The most parts one rank holds (zigzag: 2).
  std::size_t max_per_rank() const;
  // Chain positions of `rank`'s parts, ascending.
  std::vector<std::size_t> parts_of(std::size_t rank) const;
  // "{0, 1, 1, 0}".
  std::string str() const;

  bool operator==(const PartOwners&) const = default;

 private:
  std::size_t ranks_ = 0;
  std::vector<std::size_t> owners_;
};

// The sequences of a stream of B rows of T tokens.
class Sequences {
 public:
  // Each row is one sequence: N = B. Throws unless B, T >= 1.
  Sequences(std::size_t batch, std::size_t tokens);
  // Packed: N = cu_seqlens.size() - 1 sequences in one row, sequence n being
  // tokens [c_n, c_{n+1}). Throws InvalidArgument naming the entry unless
  // B = 1, c_0 = 0, c_n < c_{n+1} and c_N = T.
  Sequences(std::size_t batch, std::size_t tokens, std::span<const std::int64_t> cu_seqlens);
  Sequences(std::size_t batch, std::size_t tokens, std::span<const std::int32_t> cu_seqlens);

  bool packed() const { return packed_; }
  std::size_t batch() const { return batch_; }
  std::size_t tokens() const { return bounds_.back(); }
  // N: the leading dimension of h0, ht, dh0 and dht.
  std::size_t count() const { return packed_ ? bounds_.size() - 1 : batch_; }
  // Where a row's sequences start, then T: cu_seqlens when packed, {0, T}
  // otherwise (every row's sequence spans the whole row).
  const std::vector<std::size_t>& boundaries() const { return bounds_; }

 private:
  std::vector<std::size_t> bounds_;
  std::size_t batch_ = 1;
  bool packed_ = false;
};

// Stream tokens [begin, end) (begin < end <= T), held in the rank's local
// tensors from token local_begin on.
struct Part {
  std::size_t begin = 0, end = 0;
  std::size_t local_begin = 0;
};

// Sequences n in [first, first + count).
struct SequenceRange {
  std::size_t first = 0, count = 0;
};

// A part cut at every sequence start inside it: stream tokens [begin, end)
// and the boundary segments (sequences; without cu_seqlens the one segment
// [0, T) stands for every row) whose first or last token it holds.
struct Piece {
  std::size_t begin = 0, end = 0;
  std::optional<std::size_t> starts, ends;
};
// The part's pieces in token order; throws unless begin < end <= T.
std::vector<Piece> pieces(const Sequences& seqs, const Part& part);

// What the exchange needs to know about a part.
struct PartInfo {
  // The part's first token starts a sequence n: its incoming state is h0[n],
  // it needs nothing from the forward exchange and its G is zero.
  bool starts_sequence = false;
  // A sequence start at any token of the part: its outgoing state is b
  // exactly, whatever enters it (A = 0, SPEC §10).
  bool cut = false;
  // The part's last token ends a sequence n: the gradient at the part's end
  // is dht[n], and the backward exchange's out-gradient for it is zero.
  bool ends_sequence = false;
  // Sequences whose first token lies in the part: the dh0 rows part_backward
  // writes (without cu_seqlens: all B rows when begin = 0).
  SequenceRange started;
  // Sequences whose last token lies in the part: the ht rows part_forward
  // writes and the dht rows the part reads (all B rows when end = T).
  SequenceRange ended;
};

// The part's structure; throws unless begin < end <= T.
PartInfo part_info(const Sequences& seqs, const Part& part);

// One part of a layout: stream tokens [begin, end) held by `rank`.
struct LayoutPart {
  std::size_t rank = 0, begin = 0, end = 0;
};

// Where the stream's tokens live (SPEC §10): parts in chain order (token
// order), each a non-empty token range on one rank. A rank holds its parts
// concatenated in token order in its local tensors.
class Layout {
 public:
  // Throws InvalidArgument unless the parts tile [0, T) in order, each is
  // non-empty, each rank is < ranks and every rank holds a part.
  Layout(std::size_t ranks, std::vector<LayoutPart> parts);
  // Part r on rank r, the first T mod P ranks taking ⌈T/P⌉ tokens, the
  // others ⌊T/P⌋ (split_tokens; P > T throws). With counts (not empty):
  // uneven(tokens, ranks, counts).
  static Layout contiguous(std::size_t tokens, std::size_t ranks,
                           std::span<const std::size_t> counts = {});
  // Part r on rank r with counts[r] tokens: P entries, each >= 1, summing to T.
  static Layout uneven(std::size_t tokens, std::size_t ranks, std::span<const std::size_t> counts);
  // 2P parts, the first T mod 2P of ⌈T/2P⌉ tokens and the others of ⌊T/2P⌋,
  // owned as PartOwners::zigzag(P). T < 2P is an InvalidArgument.
  static Layout zigzag(std::size_t tokens, std::size_t ranks);

  std::size_t ranks() const { return ranks_; }
  std::size_t tokens() const { return parts_.back().end; }
  const std::vector<LayoutPart>& parts() const { return parts_; }
  // The rank of each part in chain order: what the exchange is built with.
  PartOwners owners() const;
  // Each part's token count, in chain order.
  std::vector<std::size_t> part_lengths() const;
  // Rank `rank`'s parts in token order, with where each starts in its local
  // tensors.
  std::vector<Part> local_parts(std::size_t rank) const;
  // T_local of rank `rank`: the sum of its parts' lengths.
  std::size_t local_tokens(std::size_t rank) const;
  // Which parts are cuts (hold a sequence start) for `seqs` (T = tokens(),
  // else InvalidArgument), in chain order.
  std::vector<bool> cuts(const Sequences& seqs) const;
  // "contiguous", "zigzag", or the parts as "[0,3)@0 [3,8)@1 ...".
  std::string str() const;

 private:
  std::size_t ranks_ = 0;
  std::vector<LayoutPart> parts_;
};

}  // namespace kdacp
