// Memory admission: a command estimates what it will allocate and refuses a
// need larger than its limit before the first large allocation, instead of
// being killed by the kernel halfway through.
#pragma once

#include <cstddef>
#include <string>

#include "kdacp/cost_model.hpp"
#include "kdacp/error.hpp"

namespace kdacp {

// A need above the memory limit; raised before anything is allocated.
class OutOfMemory : public Error {
 public:
  using Error::Error;
};

// Bytes this process may still allocate: the smaller of MemAvailable in
// /proc/meminfo and the room left under the cgroup's memory.max (a container's
// limit, which MemAvailable does not show); sysconf's available pages where
// /proc is absent.
std::size_t available_memory_bytes();

// "1.5 GiB", for messages.
std::string format_bytes(double bytes);

// The limit a command's --max-memory text sets: parse_bytes(text) or, when
// text is empty, available_memory_bytes() read now (so that every check sees
// what earlier allocations left).
std::size_t max_memory_bytes(const std::string& text);
// How messages name that limit: "--max-memory <text>", or for empty text
// "memory available now; --max-memory sets another limit".
std::string max_memory_name(const std::string& text);

// Ranks of one process times their threads: beyond this, thread creation
// fails on an ordinary host.
inline constexpr std::size_t kMaxThreadsPerProcess = 16384;

// Throws InvalidArgument "--threads T on R ranks of this process is N
// threads, expected at most kMaxThreadsPerProcess" when ranks_in_process ×
// threads_per_rank (0 counts as 1) is larger; starts nothing.
void check_threads(std::size_t ranks_in_process, std::size_t threads_per_rank);

// Throws OutOfMemory "<what> needs N, more than the limit of L (<limit_name>)"
// when need_bytes > limit_bytes.
void require_memory(double need_bytes, std::size_t limit_bytes, const std::string& what,
                    const std::string& limit_name);

// Bytes one rank holds during a call of an exchange (predict_exchange,
// exchange.hpp): its offset,
// transfer and returned state for each of its parts (the most parts a rank
// holds in owners_of(shape)) and the protocol's peak extra bytes.
double exchange_rank_bytes(const ProblemShape& shape, const Prediction& prediction);

}  // namespace kdacp
