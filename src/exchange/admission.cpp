#include "kdacp/admission.hpp"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <limits>
#include <optional>

#include <fmt/format.h>

#include "kdacp/units.hpp"

namespace kdacp {
namespace {

// A number from the first line of a cgroup file; nullopt for "max" or no file.
std::optional<double> cgroup_value(const char* path) {
  std::ifstream in(path);
  double v = 0;
  if (in >> v) return v;
  return std::nullopt;
}

}  // namespace

std::size_t available_memory_bytes() {
  double avail = std::numeric_limits<double>::infinity();
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  double kib = 0;
  while (meminfo >> key >> kib) {
    if (key == "MemAvailable:") {
      avail = kib * 1024;
      break;
    }
    meminfo.ignore(std::numeric_limits<std::streamsize>::max(), '\n');
  }
  if (avail == std::numeric_limits<double>::infinity()) {
    const long pages = ::sysconf(_SC_AVPHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
    if (pages > 0 && page > 0) avail = double(pages) * double(page);
  }
  const auto max = cgroup_value("/sys/fs/cgroup/memory.max");
  const auto current = cgroup_value("/sys/fs/cgroup/memory.current");
  if (max && current) avail = std::min(avail, std::max(*max - *current, 0.0));
  if (!(avail < 9.2e18)) return std::numeric_limits<std::size_t>::max();
  return static_cast<std::size_t>(avail);
}

std::string format_bytes(double bytes) {
  const char* unit[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  int u = 0;
  while (bytes >= 1024 && u < 6) {
    bytes /= 1024;
    ++u;
  }
  char buf[64];
  std::snprintf(buf, sizeof buf, u == 0 ? "%.0f %s" : "%.1f %s", bytes, unit[u]);
  return buf;
}

std::size_t max_memory_bytes(const std::string& text) {
  return text.empty() ? available_memory_bytes() : parse_bytes(text, "--max-memory");
}

std::string max_memory_name(const std::string& text) {
  return text.empty() ? "memory available now; --max-memory sets another limit" : "--max-memory " + text;
}

void check_threads(std::size_t ranks_in_process, std::size_t threads_per_rank) {
  const double total = double(ranks_in_process) * double(std::max<std::size_t>(threads_per_rank, 1));
  if (total > double(kMaxThreadsPerProcess))
    throw InvalidArgument(fmt::format("--threads {} on {} ranks of this process is {} threads, expected at most {}",
                                      threads_per_rank, ranks_in_process, std::size_t(total),
                                      kMaxThreadsPerProcess));
}

void require_memory(double need_bytes, std::size_t limit_bytes, const std::string& what,
                    const std::string& limit_name) {
  if (need_bytes <= double(limit_bytes)) return;
  throw OutOfMemory(fmt::format("{} needs {}, more than the limit of {} ({})", what, format_bytes(need_bytes),
                                format_bytes(double(limit_bytes)), limit_name));
}

double exchange_rank_bytes(const ProblemShape& shape, const Prediction& prediction) {
  const double state = double(shape.slabs) * double(shape.key_dim) * double(shape.value_dim);
  const double transfer = double(shape.slabs) * double(shape.key_dim) * double(shape.key_dim);
  // Per part the rank holds (zigzag: two).
  const double parts = double(chain_profile(shape, 1).per_rank);
  return parts * (2 * state + transfer) * double(shape.elem_bytes) + double(prediction.peak_extra_bytes);
}

}  // namespace kdacp
