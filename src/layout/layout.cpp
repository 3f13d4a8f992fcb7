// The layout value (kdacp/layout.hpp): token splits, part owners, sequences
// and their cuts, each rule written once.
#include "kdacp/layout.hpp"

#include <algorithm>
#include <string>
#include <string_view>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "kdacp/error.hpp"

namespace kdacp {
namespace {

std::string list_text(const std::vector<std::size_t>& xs) {
  return fmt::format("{{{}}}", fmt::join(xs, ", "));
}

template <class Int>
std::vector<std::size_t> checked_bounds(std::span<const Int> cu, std::size_t batch,
                                        std::size_t tokens) {
  constexpr std::string_view what = "kda::Sequences: ";
  if (batch != 1)
    throw InvalidArgument(fmt::format(
        "{}cu_seqlens given with batch (B) = {}, expected B = 1 (packed sequences share one row)",
        what, batch));
  if (cu.size() < 2)
    throw InvalidArgument(
        fmt::format("{}cu_seqlens has {} entries, expected N + 1 >= 2", what, cu.size()));
  if (cu[0] != 0)
    throw InvalidArgument(fmt::format("{}cu_seqlens[0] is {}, expected 0", what, cu[0]));
  for (std::size_t i = 1; i < cu.size(); ++i)
    if (cu[i] <= cu[i - 1])
      throw InvalidArgument(fmt::format("{}cu_seqlens[{}] is {}, expected > cu_seqlens[{}] = {}",
                                        what, i, cu[i], i - 1, cu[i - 1]));
  if (static_cast<std::int64_t>(cu.back()) != static_cast<std::int64_t>(tokens))
    throw InvalidArgument(fmt::format("{}cu_seqlens[{}] (the last entry) is {}, expected T = {}",
                                      what, cu.size() - 1, cu.back(), tokens));
  return std::vector<std::size_t>(cu.begin(), cu.end());
}

// Segments [first, first + count) as sequences.
SequenceRange as_sequences(const Sequences& seqs, std::size_t first, std::size_t count) {
  if (seqs.packed()) return {first, count};
  return count > 0 ? SequenceRange{0, seqs.batch()} : SequenceRange{};
}

}  // namespace

TokenSplit split_tokens(std::size_t tokens, std::size_t ranks, std::size_t rank) {
  if (ranks == 0 || ranks > tokens)
    throw InvalidArgument(fmt::format(
        "context-parallel size P is {} for {} tokens, expected 1 <= P <= T (every rank needs a "
        "token)",
        ranks, tokens));
  if (rank >= ranks) throw InvalidArgument(fmt::format("rank {} outside P = {}", rank, ranks));
  const std::size_t base = tokens / ranks, extra = tokens % ranks;
  return {rank * base + std::min(rank, extra), base + (rank < extra ? 1 : 0)};
}

PartOwners::PartOwners(std::size_t ranks, std::vector<std::size_t> owners)
    : ranks_(ranks), owners_(std::move(owners)) {
  std::vector<std::size_t> held(ranks, 0);
  for (std::size_t j = 0; j < owners_.size(); ++j) {
    const std::size_t r = owners_[j];
    if (r >= ranks)
      throw InvalidArgument(fmt::format(
          "part_owners[{}] is {}, expected a rank below the CP size {}", j, r, ranks));
    ++held[r];
  }
  for (std::size_t r = 0; r < ranks; ++r)
    if (held[r] == 0)
      throw InvalidArgument(fmt::format(
          "part_owners gives rank {} no part, expected every rank to hold at least one", r));
}

PartOwners PartOwners::one_per_rank(std::size_t ranks) {
  std::vector<std::size_t> owners(ranks);
  for (std::size_t r = 0; r < ranks; ++r) owners[r] = r;
  return PartOwners(ranks, std::move(owners));
}

PartOwners PartOwners::zigzag(std::size_t ranks) {
  std::vector<std::size_t> owners;
  for (std::size_t r = 0; r < ranks; ++r) owners.push_back(r);
  for (std::size_t r = ranks; r-- > 0;) owners.push_back(r);
  return PartOwners(ranks, std::move(owners));
}

bool PartOwners::is_one_per_rank() const {
  if (owners_.size() != ranks_) return false;
  for (std::size_t j = 0; j < ranks_; ++j)
    if (owners_[j] != j) return false;
  return true;
}

std::size_t PartOwners::max_per_rank() const {
  std::vector<std::size_t> held(ranks_, 0);
  std::size_t most = 0;
  for (std::size_t r : owners_) most = std::max(most, ++held[r]);
  return most;
}

std::vector<std::size_t> PartOwners::parts_of(std::size_t rank) const {
  std::vector<std::size_t> out;
  for (std::size_t j = 0; j < owners_.size(); ++j)
    if (owners_[j] == rank) out.push_back(j);
  return out;
}

std::string PartOwners::str() const { return list_text(owners_); }

Sequences::Sequences(std::size_t batch, std::size_t tokens) : batch_(batch) {
  if (batch == 0) throw InvalidArgument("kda::Sequences: batch (B) = 0, expected >= 1");
  if (tokens == 0) throw InvalidArgument("kda::Sequences: tokens (T) = 0, expected >= 1");
  bounds_ = {0, tokens};
}

Sequences::Sequences(std::size_t batch, std::size_t tokens,
                     std::span<const std::int64_t> cu_seqlens)
    : bounds_(checked_bounds(cu_seqlens, batch, tokens)), batch_(batch), packed_(true) {}

Sequences::Sequences(std::size_t batch, std::size_t tokens,
                     std::span<const std::int32_t> cu_seqlens)
    : bounds_(checked_bounds(cu_seqlens, batch, tokens)), batch_(batch), packed_(true) {}

std::vector<Piece> pieces(const Sequences& seqs, const Part& part) {
  if (!(part.begin < part.end) || part.end > seqs.tokens())
    throw InvalidArgument(fmt::format(
        "kda::part_info: part [begin, end) = [{}, {}), expected begin < end <= T = {}",
        part.begin, part.end, seqs.tokens()));
  const std::vector<std::size_t>& c = seqs.boundaries();
  std::size_t n = static_cast<std::size_t>(std::upper_bound(c.begin(), c.end(), part.begin) -
                                           c.begin()) - 1;
  std::vector<Piece> out;
  for (std::size_t lo = part.begin; lo < part.end; ++n) {
    Piece p{lo, std::min(part.end, c[n + 1]), std::nullopt, std::nullopt};
    if (p.begin == c[n]) p.starts = n;
    if (p.end == c[n + 1]) p.ends = n;
    out.push_back(p);
    lo = p.end;
  }
  return out;
}

PartInfo part_info(const Sequences& seqs, const Part& part) {
  const std::vector<Piece> ps = pieces(seqs, part);
  PartInfo info;
  info.starts_sequence = ps.front().starts.has_value();
  info.ends_sequence = ps.back().ends.has_value();
  // Pieces after the first start consecutive segments, so the segments a
  // part starts (ends) are a run beginning at the first one it starts (ends).
  std::optional<std::size_t> first_start, first_end;
  std::size_t started = 0, ended = 0;
  for (const Piece& p : ps) {
    if (p.starts && started++ == 0) first_start = p.starts;
    if (p.ends && ended++ == 0) first_end = p.ends;
  }
  info.cut = started > 0;
  info.started = as_sequences(seqs, first_start.value_or(0), started);
  info.ended = as_sequences(seqs, first_end.value_or(0), ended);
  return info;
}

Layout::Layout(std::size_t ranks, std::vector<LayoutPart> parts)
    : ranks_(ranks), parts_(std::move(parts)) {
  constexpr std::string_view what = "kda::Layout: ";
  if (ranks == 0) throw InvalidArgument(fmt::format("{}ranks (P) = 0, expected >= 1", what));
  if (parts_.empty())
    throw InvalidArgument(fmt::format("{}no parts, expected at least one per rank", what));
  std::vector<bool> held(ranks, false);
  std::size_t next = 0;
  for (std::size_t j = 0; j < parts_.size(); ++j) {
    const LayoutPart& p = parts_[j];
    if (p.begin != next)
      throw InvalidArgument(fmt::format(
          "{}part {} begins at token {}, expected {} (parts tile the stream in token order)",
          what, j, p.begin, next));
    if (p.end <= p.begin)
      throw InvalidArgument(fmt::format("{}part {} is [{}, {}), expected a non-empty token range",
                                        what, j, p.begin, p.end));
    if (p.rank >= ranks)
      throw InvalidArgument(
          fmt::format("{}part {} is on rank {}, expected < P = {}", what, j, p.rank, ranks));
    held[p.rank] = true;
    next = p.end;
  }
  for (std::size_t r = 0; r < ranks; ++r)
    if (!held[r])
      throw InvalidArgument(fmt::format(
          "{}rank {} holds no part, expected every rank to hold tokens", what, r));
}

Layout Layout::contiguous(std::size_t tokens, std::size_t ranks,
                          std::span<const std::size_t> counts) {
  if (!counts.empty()) return uneven(tokens, ranks, counts);
  split_tokens(tokens, ranks, 0);  // 1 <= P <= T
  std::vector<LayoutPart> parts;
  for (std::size_t r = 0; r < ranks; ++r) {
    const TokenSplit range = split_tokens(tokens, ranks, r);
    parts.push_back({r, range.begin, range.begin + range.count});
  }
  return Layout(ranks, std::move(parts));
}

Layout Layout::uneven(std::size_t tokens, std::size_t ranks, std::span<const std::size_t> counts) {
  constexpr std::string_view what = "kda::Layout::contiguous: ";
  if (counts.size() != ranks)
    throw InvalidArgument(fmt::format("{}counts has {} entries, expected one per rank, P = {}",
                                      what, counts.size(), ranks));
  std::vector<LayoutPart> parts;
  std::size_t begin = 0;
  for (std::size_t r = 0; r < ranks; ++r) {
    if (counts[r] == 0)
      throw InvalidArgument(fmt::format(
          "{}counts[{}] = 0, expected >= 1 (every rank needs a token)", what, r));
    parts.push_back({r, begin, begin + counts[r]});
    begin += counts[r];
  }
  if (begin != tokens)
    throw InvalidArgument(
        fmt::format("{}counts sum to {}, expected T = {}", what, begin, tokens));
  return Layout(ranks, std::move(parts));
}

Layout Layout::zigzag(std::size_t tokens, std::size_t ranks) {
  constexpr std::string_view what = "kda::Layout::zigzag: ";
  if (ranks == 0) throw InvalidArgument(fmt::format("{}ranks (P) = 0, expected >= 1", what));
  const std::size_t count = 2 * ranks;
  if (tokens < count)
    throw InvalidArgument(fmt::format(
        "{}{} tokens for P = {}, expected T >= 2P = {} (every part needs a token)", what, tokens,
        ranks, count));
  const PartOwners owners = PartOwners::zigzag(ranks);
  const std::size_t base = tokens / count, extra = tokens % count;
  std::vector<LayoutPart> parts;
  std::size_t begin = 0;
  for (std::size_t j = 0; j < count; ++j) {
    const std::size_t end = begin + base + (j < extra ? 1 : 0);
    parts.push_back({owners[j], begin, end});
    begin = end;
  }
  return Layout(ranks, std::move(parts));
}

PartOwners Layout::owners() const {
  std::vector<std::size_t> out;
  for (const LayoutPart& p : parts_) out.push_back(p.rank);
  return PartOwners(ranks_, std::move(out));
}

std::vector<std::size_t> Layout::part_lengths() const {
  std::vector<std::size_t> out;
  for (const LayoutPart& p : parts_) out.push_back(p.end - p.begin);
  return out;
}

std::vector<Part> Layout::local_parts(std::size_t rank) const {
  std::vector<Part> out;
  std::size_t local = 0;
  for (const LayoutPart& p : parts_)
    if (p.rank == rank) {
      out.push_back({p.begin, p.end, local});
      local += p.end - p.begin;
    }
  return out;
}

std::size_t Layout::local_tokens(std::size_t rank) const {
  std::size_t n = 0;
  for (const LayoutPart& p : parts_)
    if (p.rank == rank) n += p.end - p.begin;
  return n;
}

std::vector<bool> Layout::cuts(const Sequences& seqs) const {
  if (seqs.tokens() != tokens())
    throw InvalidArgument(fmt::format("the sequences span T = {} tokens, expected the layout's {}",
                                      seqs.tokens(), tokens()));
  std::vector<bool> out;
  for (const LayoutPart& p : parts_) out.push_back(part_info(seqs, Part{p.begin, p.end, 0}).cut);
  return out;
}

std::string Layout::str() const {
  const PartOwners owners = this->owners();
  const std::vector<std::size_t> lengths = part_lengths();
  if (owners.is_one_per_rank()) {
    if (tokens() >= ranks_ && lengths == Layout::contiguous(tokens(), ranks_).part_lengths())
      return "contiguous";
    return fmt::format("uneven {}", list_text(lengths));
  }
  if (tokens() >= 2 * ranks_) {
    const Layout zig = Layout::zigzag(tokens(), ranks_);
    if (owners == zig.owners() && lengths == zig.part_lengths()) return "zigzag";
  }
  std::vector<std::string> each;
  for (const LayoutPart& p : parts_) each.push_back(fmt::format("[{},{})@{}", p.begin, p.end, p.rank));
  return fmt::format("{}", fmt::join(each, " "));
}

}  // namespace kdacp
