#include "kdacp/agreement.hpp"

#include <algorithm>
#include <charconv>
#include <cstring>
#include <map>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "kdacp/comm.hpp"
#include "kdacp/error.hpp"

namespace kdacp {

std::uint64_t fnv1a64(std::span<const std::byte> bytes, std::uint64_t hash) {
  for (std::byte b : bytes) {
    hash ^= static_cast<std::uint64_t>(b);
    hash *= 1099511628211ull;
  }
  return hash;
}

std::uint64_t fnv1a64(std::string_view text, std::uint64_t hash) {
  return fnv1a64(std::as_bytes(std::span(text.data(), text.size())), hash);
}

namespace {

// The top `digits` hex digits of h: "#1f0c...".
std::string hex(std::uint64_t h, int digits) { return fmt::format("#{:0{}x}", h >> (64 - 4 * digits), digits); }

template <class V>
std::uint64_t hash_of(const V& value) {
  return fnv1a64(std::as_bytes(std::span(&value, 1)));
}

// A text that fits the record, cut with ".." when too long.
std::string fitted(std::string_view text) {
  if (text.size() <= kAgreementTextChars) return std::string(text);
  return std::string(text.substr(0, kAgreementTextChars - 2)) + "..";
}

template <class Real>
std::string shortest(Real value) {
  char buf[64];
  const auto r = std::to_chars(buf, buf + sizeof buf, value);
  return std::string(buf, r.ptr);
}

template <class Int>
std::string list_of(std::span<const Int> values) {
  std::string out = fmt::format("[{}]", fmt::join(values, ","));
  if (out.size() <= kAgreementTextChars) return out;
  return fmt::format("{} entries {}", values.size(), hex(fnv1a64(std::as_bytes(values)), 8));
}

constexpr std::uint64_t kMagic = 0x314545524741444bull;  // "KDAGREE1"
constexpr std::size_t kHeaderBytes = 32;
constexpr std::size_t kSlotBytes = 16 + kAgreementTextChars + 1;

struct Header {
  std::uint64_t magic, count, failed, value;  // value: agree_gather's, not compared
};
struct Slot {
  std::uint64_t name, value;
  std::string text;
};

// The record: header, then kAgreementFields slots of (name hash, value hash,
// NUL-terminated text). Fields beyond the last slot are folded into it.
std::vector<std::byte> encode(const Fingerprint& fp, bool failed, std::uint64_t value) {
  std::vector<std::byte> rec(kAgreementRecordBytes);
  const auto& f = fp.fields();
  const std::size_t count = std::min(f.size(), kAgreementFields);
  const Header h{kMagic, count, failed ? 1u : 0u, value};
  std::memcpy(rec.data(), &h, sizeof h);
  for (std::size_t i = 0; i < count; ++i) {
    std::uint64_t name = fnv1a64(f[i].name), value = f[i].hash;
    std::string text = f[i].text;
    if (i + 1 == kAgreementFields && f.size() > kAgreementFields) {
      for (std::size_t j = i + 1; j < f.size(); ++j) {
        name = fnv1a64(f[j].name, name);
        value = fnv1a64(std::as_bytes(std::span(&f[j].hash, 1)), value);
      }
      text = hex(value, 16);
    }
    std::byte* slot = rec.data() + kHeaderBytes + i * kSlotBytes;
    std::memcpy(slot, &name, 8);
    std::memcpy(slot + 8, &value, 8);
    text = fitted(text);
    std::memcpy(slot + 16, text.data(), text.size());  // the rest stays NUL
  }
  return rec;
}

Header header_of(std::span<const std::byte> rec) {
  Header h;
  std::memcpy(&h, rec.data(), sizeof h);
  return h;
}

Slot slot_of(std::span<const std::byte> rec, std::size_t i) {
  Slot s;
  const std::byte* p = rec.data() + kHeaderBytes + i * kSlotBytes;
  std::memcpy(&s.name, p, 8);
  std::memcpy(&s.value, p + 8, 8);
  const char* text = reinterpret_cast<const char*>(p + 16);
  s.text.assign(text, strnlen(text, kAgreementTextChars));
  return s;
}

// "rank 1", "ranks 0,2", "ranks 0-3,5".
std::string ranks_text(const std::vector<std::size_t>& ranks) {
  std::vector<std::string> runs;  // "0-3" for three or more in a row, "5,6" for two, "9" alone
  for (std::size_t i = 0; i < ranks.size();) {
    std::size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    runs.push_back(j >= i + 2   ? fmt::format("{}-{}", ranks[i], ranks[j])
                   : j == i + 1 ? fmt::format("{},{}", ranks[i], ranks[j])
                                : fmt::to_string(ranks[i]));
    i = j + 1;
  }
  return fmt::format("{} {}", ranks.size() == 1 ? "rank" : "ranks", fmt::join(runs, ","));
}

}  // namespace

Fingerprint& Fingerprint::add_real(std::string name, double value) {
  fields_.push_back({std::move(name), hash_of(value), fitted(shortest(value))});
  return *this;
}

Fingerprint& Fingerprint::add_real(std::string name, float value) {
  const double exact = value;
  fields_.push_back({std::move(name), hash_of(exact), fitted(shortest(value))});
  return *this;
}

Fingerprint& Fingerprint::add_int(std::string name, long long value) {
  const std::int64_t v = value;
  fields_.push_back({std::move(name), hash_of(v), fmt::to_string(value)});
  return *this;
}

Fingerprint& Fingerprint::add_flag(std::string name, bool value) {
  const std::uint8_t v = value ? 1 : 0;
  fields_.push_back({std::move(name), hash_of(v), value ? "yes" : "no"});
  return *this;
}

Fingerprint& Fingerprint::add_text(std::string name, std::string_view value) {
  fields_.push_back({std::move(name), fnv1a64(value), fitted(value)});
  return *this;
}

Fingerprint& Fingerprint::add_bytes(std::string name, std::span<const std::byte> bytes,
                                    std::string_view shown) {
  return add_hash(std::move(name), fnv1a64(bytes), shown);
}

Fingerprint& Fingerprint::add_hash(std::string name, std::uint64_t hash, std::string_view shown) {
  std::string text = !shown.empty() && shown.size() <= kAgreementTextChars
                         ? std::string(shown)
                         : std::string("hash ").append(hex(hash, 16));
  fields_.push_back({std::move(name), hash, std::move(text)});
  return *this;
}

Fingerprint& Fingerprint::append(const Fingerprint& other) {
  fields_.insert(fields_.end(), other.fields_.begin(), other.fields_.end());
  return *this;
}

std::string list_text(std::span<const std::int64_t> values) { return list_of(values); }
std::string list_text(std::span<const std::size_t> values) { return list_of(values); }

std::string agreement_error(std::span<const std::byte> records, std::size_t ranks,
                            const Fingerprint& local) {
  if (records.size() != ranks * kAgreementRecordBytes)
    throw InvalidArgument(fmt::format("agreement_error: {} bytes of records for {} ranks, expected {}",
                                      records.size(), ranks, ranks * kAgreementRecordBytes));
  auto rec = [&](std::size_t r) { return records.subspan(r * kAgreementRecordBytes, kAgreementRecordBytes); };
  std::vector<std::string> parts;
  std::vector<std::size_t> failed, foreign;
  std::size_t slots = 0;
  for (std::size_t r = 0; r < ranks; ++r) {
    const Header h = header_of(rec(r));
    if (h.magic != kMagic || h.count > kAgreementFields) {
      foreign.push_back(r);
      continue;
    }
    if (h.failed) failed.push_back(r);
    else slots = std::max<std::size_t>(slots, h.count);
  }
  if (!failed.empty())
    parts.push_back(fmt::format("{0} rejected {1} own arguments (see {1} error)", ranks_text(failed),
                                failed.size() == 1 ? "its" : "their"));
  if (!foreign.empty())
    parts.push_back(ranks_text(foreign) + " sent no agreement record (another collective or "
                                          "another kdacp build at the same point)");
  // A rank whose own checks failed sent fields that mean nothing: it is
  // named as such, its fields are not compared.
  auto counted = [&](std::size_t r) {
    const Header h = header_of(rec(r));
    return h.magic == kMagic && h.count <= kAgreementFields && !h.failed;
  };
  for (std::size_t i = 0; i < slots; ++i) {
    // Ranks by the name hash of field i (0: none), then by its value hash.
    std::map<std::uint64_t, std::vector<std::size_t>> by_name;
    std::map<std::uint64_t, std::vector<std::size_t>> by_value;
    std::map<std::uint64_t, std::string> shown;
    for (std::size_t r = 0; r < ranks; ++r) {
      if (!counted(r)) continue;
      const Header h = header_of(rec(r));
      if (i >= h.count) {
        by_name[0].push_back(r);
        continue;
      }
      const Slot s = slot_of(rec(r), i);
      by_name[s.name].push_back(r);
      by_value[s.value].push_back(r);
      shown.emplace(s.value, s.text);
    }
    const std::string name = i < local.fields().size()
                                 ? (i + 1 == kAgreementFields && local.fields().size() > kAgreementFields
                                        ? "fields " + local.fields()[i].name + " and later"
                                        : local.fields()[i].name)
                                 : std::string("(none)");
    if (by_name.size() > 1) {
      // Different checks from here on: another call, or another build.
      std::vector<std::string> checks;
      for (const auto& [h, rs] : by_name) {
        const bool mine = i < local.fields().size() && h == fnv1a64(local.fields()[i].name);
        checks.push_back(fmt::format("{} {} {}", ranks_text(rs), rs.size() == 1 ? "checks" : "check",
                                     h == 0 ? std::string("nothing more") : mine ? "'" + name + "'" : "another"));
      }
      parts.push_back(fmt::format("the ranks check different arguments from field {}: {} (a different call, or "
                                  "another kdacp build)",
                                  i + 1, fmt::join(checks, ", ")));
      break;
    }
    if (by_value.size() <= 1) continue;
    // Groups in order of their first rank; texts that read the same get hashes.
    std::vector<std::pair<std::uint64_t, std::vector<std::size_t>>> groups(by_value.begin(), by_value.end());
    std::sort(groups.begin(), groups.end(), [](const auto& a, const auto& b) { return a.second[0] < b.second[0]; });
    std::map<std::string, int> seen;
    for (const auto& g : groups) ++seen[shown[g.first]];
    std::vector<std::string> values;
    for (const auto& [h, rs] : groups) {
      std::string value = shown[h];
      if (seen[value] > 1) value += fmt::format(" ({})", hex(h, 16));
      values.push_back(fmt::format("{} {} {}", ranks_text(rs), rs.size() == 1 ? "has" : "have", value));
    }
    parts.push_back(fmt::format("{}: {}", name, fmt::join(values, ", ")));
  }
  return fmt::format("{}", fmt::join(parts, "; "));
}

namespace {

// "; ranks are positions in the group of global ranks [2,3]" when they are
// not the global ranks themselves.
std::string group_note(const Communicator& comm) {
  const std::vector<std::size_t>& global = comm.global_ranks();
  bool identity = global.size() == comm.size();
  for (std::size_t r = 0; identity && r < global.size(); ++r) identity = global[r] == r;
  if (identity) return {};
  return fmt::format(" (ranks are positions in the group of global ranks {})",
                     list_text(std::span<const std::size_t>(global)));
}

}  // namespace

std::vector<std::uint64_t> agree_gather(Communicator& comm, const Fingerprint& fingerprint, const std::string& what,
                                        std::uint64_t value, const std::string& local_error) {
  const std::size_t ranks = comm.size(), rank = comm.rank();
  if (ranks <= 1) {
    if (!local_error.empty()) throw InvalidArgument(local_error);
    return {value};
  }
  std::vector<std::byte> all(ranks * kAgreementRecordBytes);
  const std::vector<std::byte> mine = encode(fingerprint, !local_error.empty(), value);
  std::copy(mine.begin(), mine.end(), all.begin() + static_cast<std::ptrdiff_t>(rank * kAgreementRecordBytes));
  comm.all_gather(all);
  const std::string diff = agreement_error(all, ranks, fingerprint);
  if (!local_error.empty())
    throw InvalidArgument(diff.empty() || diff.find(';') == std::string::npos
                              ? local_error
                              : local_error + " [also, across ranks: " + diff + "]" + group_note(comm));
  if (!diff.empty())
    throw InvalidArgument(fmt::format("{} on rank {} of {}: the ranks disagree (checked before any message): {}{}",
                                      what, rank, ranks, diff, group_note(comm)));
  std::vector<std::uint64_t> values(ranks);
  for (std::size_t r = 0; r < ranks; ++r)
    values[r] = header_of(std::span<const std::byte>(all).subspan(r * kAgreementRecordBytes, kAgreementRecordBytes)).value;
  return values;
}

void agree(Communicator& comm, const Fingerprint& fingerprint, const std::string& what,
           const std::string& local_error) {
  agree_gather(comm, fingerprint, what, 0, local_error);
}

}  // namespace kdacp
