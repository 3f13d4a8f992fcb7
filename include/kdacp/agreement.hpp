// Ranks agree before any message: every argument that must be the same on
// every rank (shape, dtype, scale, algorithm, layout, cu_seqlens, protocol
// and its knobs, timeouts, ...) goes into a Fingerprint of named fields, and
// agree() compares the ranks' fingerprints with ONE all-gather of a small
// fixed-size record (kAgreementRecordBytes per rank, whatever the fields), so
// it completes on every backend (in-process, MPI, torch.distributed) even
// when the ranks disagree, and every rank throws the same error naming each
// field that differs and which ranks hold which value, e.g.
//
//   scale: ranks 0,2 have 0.0883883, rank 1 has 0.1
//
// Each field is compared by a stable 64-bit FNV-1a hash of its exact value
// (the bits of a double, the bytes of an array), never by a sum or a
// rounded text; the text only shows the value in the message.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace kdacp {

class Communicator;

// 64-bit FNV-1a of `bytes`, continuing from `hash` (the offset basis by
// default): the same value on every platform and build.
inline constexpr std::uint64_t kFnvOffset = 14695981039346656037ull;
std::uint64_t fnv1a64(std::span<const std::byte> bytes, std::uint64_t hash = kFnvOffset);
std::uint64_t fnv1a64(std::string_view text, std::uint64_t hash = kFnvOffset);

// Fields compared by one agree(); more are folded into the last one.
inline constexpr std::size_t kAgreementFields = 32;
// Characters of a field's value that the message can show.
inline constexpr std::size_t kAgreementTextChars = 23;
// Bytes each rank contributes to agree()'s all-gather.
inline constexpr std::size_t kAgreementRecordBytes = 32 + kAgreementFields * (16 + kAgreementTextChars + 1);

// Named fields, each a 64-bit hash of its exact value and a short text that
// shows it. Field names are part of the comparison: ranks that build
// different fingerprints (another call, another build) are told so.
class Fingerprint {
 public:
  struct Field {
    std::string name;
    std::uint64_t hash = 0;
    std::string text;  // what the message shows (truncated to kAgreementTextChars)
  };

  // The value's exact bits; shown in the shortest form that reads back exactly.
  Fingerprint& add_real(std::string name, double value);
  Fingerprint& add_real(std::string name, float value);
  Fingerprint& add_int(std::string name, long long value);
  Fingerprint& add_flag(std::string name, bool value);  // "yes" / "no"
  Fingerprint& add_text(std::string name, std::string_view value);
  // The bytes' hash; shown as `shown` when that fits, else as the hash.
  Fingerprint& add_bytes(std::string name, std::span<const std::byte> bytes,
                         std::string_view shown = {});
  // A hash computed by the caller (for example of a file's bytes).
  Fingerprint& add_hash(std::string name, std::uint64_t hash, std::string_view shown = {});
  // Another fingerprint's fields after these.
  Fingerprint& append(const Fingerprint& other);

  const std::vector<Field>& fields() const { return fields_; }
  bool empty() const { return fields_.empty(); }

 private:
  std::vector<Field> fields_;
};

// "[0,1,5,6,24]" for a short list, "25 entries #1a2b3c4d" for a long one.
std::string list_text(std::span<const std::int64_t> values);
std::string list_text(std::span<const std::size_t> values);

// Collective over `comm` (every member calls it, in the same order as its
// other collectives): one all_gather of kAgreementRecordBytes per rank.
// `what` names the call for the message ("kda::ContextParallelLayer::forward").
// `local_error`, when not empty, is this rank's own argument error found
// before the call: it is shared too, so that the other ranks fail with it
// instead of waiting for this one. Throws InvalidArgument on every rank when
// any field differs or any rank had an error: the message names each field
// and the ranks (positions in `comm`; the message gives a subgroup's global
// ranks) holding each value; the rank with a
// local error gets that error's text first. A group of one rank returns at once
// (after throwing its own local error).
void agree(Communicator& comm, const Fingerprint& fingerprint, const std::string& what,
           const std::string& local_error = {});

// agree() that also gathers one value per rank, not compared (each rank's
// own token count, say): every rank's `value` in rank order, returned once
// the ranks agree (the same record, the same one all_gather).
std::vector<std::uint64_t> agree_gather(Communicator& comm, const Fingerprint& fingerprint, const std::string& what,
                                        std::uint64_t value, const std::string& local_error = {});

// The message agree() throws for these records (one per rank, in rank order),
// or "" when they agree; exposed for tests of the message itself.
std::string agreement_error(std::span<const std::byte> records, std::size_t ranks,
                            const Fingerprint& local);

}  // namespace kdacp
