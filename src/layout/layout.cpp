// The layout value (kdacp/layout.hpp): token splits, part owners, sequences
// and their cuts, each rule written once.
#include "kdacp/layout.hpp"

#include <algorithm>
#include <string>
#include <utility>

#include "kdacp/error.hpp"

namespace kdacp {
namespace {

std::string num(std::size_t x) { return std::to_string(x); }

std::string list_text(const std::vector<std::size_t>& xs) {
  std::string out(1, '{');
  for (std::size_t j = 0; j < xs.size(); ++j) out.append(j ? ", " : "").append(num(xs[j]));
  return out.append("}");
}

template <class Int>
std::vector<std::size_t> checked_bounds(std::span<const Int> cu, std::size_t batch,
                                        std::size_t tokens) {
  const std::string what = "kda::Sequences: ";
  if (batch != 1)
    throw InvalidArgument(what + "cu_seqlens given with batch (B) = " + num(batch) +
                          ", expected B = 1 (packed sequences share one row)");
  if (cu.size() < 2)
    throw InvalidArgument(what + "cu_seqlens has " + num(cu.size()) +
                          " entries, expected N + 1 >= 2");
  if (cu[0] != 0)
    throw InvalidArgument(what + "cu_seqlens[0] is " + std::to_string(cu[0]) + ", expected 0");
  for (std::size_t i = 1; i < cu.size(); ++i)
    if (cu[i] <= cu[i - 1])
      throw InvalidArgument(what + "cu_seqlens[" + num(i) + "] is " + std::to_string(cu[i]) +
                            ", expected > cu_seqlens[" + num(i - 1) +
                            "] = " + std::to_string(cu[i - 1]));
  if (static_cast<std::int64_t>(cu.back()) != static_cast<std::int64_t>(tokens))
    throw InvalidArgument(what + "cu_seqlens[" + num(cu.size() - 1) + "] (the last entry) is " +
                          std::to_string(cu.back()) + ", expected T = " + num(tokens));
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
    throw InvalidArgument("context-parallel size P is " + num(ranks) + " for " + num(tokens) +
                          " tokens, expected 1 <= P <= T (every rank needs a token)");
  if (rank >= ranks) throw InvalidArgument("rank " + num(rank) + " outside P = " + num(ranks));
  const std::size_t base = tokens / ranks, extra = tokens % ranks;
  return {rank * base + std::min(rank, extra), base + (rank < extra ? 1 : 0)};
}

PartOwners::PartOwners(std::size_t ranks, std::vector<std::size_t> owners)
    : ranks_(ranks), owners_(std::move(owners)) {
  std::vector<std::size_t> held(ranks, 0);
  for (std::size_t j = 0; j < owners_.size(); ++j) {
    const std::size_t r = owners_[j];
    if (r >= ranks)
      throw InvalidArgument("part_owners[" + num(j) + "] is " + num(r) +
                            ", expected a rank below the CP size " + num(ranks));
    ++held[r];
  }
  for (std::size_t r = 0; r < ranks; ++r)
    if (held[r] == 0)
      throw InvalidArgument("part_owners gives rank " + num(r) +
                            " no part, expected every rank to hold at least one");
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
    throw InvalidArgument("kda::part_info: part [begin, end) = [" + num(part.begin) + ", " +
                          num(part.end) + "), expected begin < end <= T = " + num(seqs.tokens()));
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
  const std::string what = "kda::Layout: ";
  if (ranks == 0) throw InvalidArgument(what + "ranks (P) = 0, expected >= 1");
  if (parts_.empty()) throw InvalidArgument(what + "no parts, expected at least one per rank");
  std::vector<bool> held(ranks, false);
  std::size_t next = 0;
  for (std::size_t j = 0; j < parts_.size(); ++j) {
    const LayoutPart& p = parts_[j];
    const std::string at = what + "part " + num(j) + " ";
    if (p.begin != next)
      throw InvalidArgument(at + "begins at token " + num(p.begin) + ", expected " + num(next) +
                            " (parts tile the stream in token order)");
    if (p.end <= p.begin)
      throw InvalidArgument(at + "is [" + num(p.begin) + ", " + num(p.end) +
                            "), expected a non-empty token range");
    if (p.rank >= ranks)
      throw InvalidArgument(at + "is on rank " + num(p.rank) + ", expected < P = " + num(ranks));
    held[p.rank] = true;
    next = p.end;
  }
  for (std::size_t r = 0; r < ranks; ++r)
    if (!held[r])
      throw InvalidArgument(what + "rank " + num(r) +
                            " holds no part, expected every rank to hold tokens");
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
  const std::string what = "kda::Layout::contiguous: ";
  if (counts.size() != ranks)
    throw InvalidArgument(what + "counts has " + num(counts.size()) +
                          " entries, expected one per rank, P = " + num(ranks));
  std::vector<LayoutPart> parts;
  std::size_t begin = 0;
  for (std::size_t r = 0; r < ranks; ++r) {
    if (counts[r] == 0)
      throw InvalidArgument(what + "counts[" + num(r) +
                            "] = 0, expected >= 1 (every rank needs a token)");
    parts.push_back({r, begin, begin + counts[r]});
    begin += counts[r];
  }
  if (begin != tokens)
    throw InvalidArgument(what + "counts sum to " + num(begin) + ", expected T = " + num(tokens));
  return Layout(ranks, std::move(parts));
}

Layout Layout::zigzag(std::size_t tokens, std::size_t ranks) {
  const std::string what = "kda::Layout::zigzag: ";
  if (ranks == 0) throw InvalidArgument(what + "ranks (P) = 0, expected >= 1");
  const std::size_t count = 2 * ranks;
  if (tokens < count)
    throw InvalidArgument(what + num(tokens) + " tokens for P = " + num(ranks) +
                          ", expected T >= 2P = " + num(count) + " (every part needs a token)");
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
    throw InvalidArgument("the sequences span T = " + num(seqs.tokens()) +
                          " tokens, expected the layout's " + num(tokens()));
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
    return "uneven " + list_text(lengths);
  }
  if (tokens() >= 2 * ranks_) {
    const Layout zig = Layout::zigzag(tokens(), ranks_);
    if (owners == zig.owners() && lengths == zig.part_lengths()) return "zigzag";
  }
  std::string out;
  for (const LayoutPart& p : parts_) {
    if (!out.empty()) out += ' ';
    out += '[';
    out += num(p.begin);
    out += ',';
    out += num(p.end);
    out += ")@";
    out += num(p.rank);
  }
  return out;
}

}  // namespace kdacp
