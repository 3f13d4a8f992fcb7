#include "comm/smpi/shared_memory.hpp"

#include <mpi.h>
#include <simgrid/s4u/Actor.hpp>
#include <smpi_helpers_internal.h>

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>

#include "core/simulation.hpp"
#include "kdacp/error.hpp"

namespace kdacp::smpi {

namespace {

// The value of KDACP_SMPI_SHARED_MEMORY seen at load: 0 off, 1 on, -1 invalid.
int g_setting = 0;
std::string g_text;

// Flops charged by each rank since its last MPI call. Ranks are actors
// that the simulator runs one at a time, on one thread or several
// (contexts/factory), so they are kept per actor, not per thread. The
// actor's id, not MPI_Comm_rank: SMPI ends and restarts the measured burst
// around every MPI call, whose cost on this host would be charged too.
std::mutex g_mu;
std::vector<double> g_pending;

std::size_t actor() { return static_cast<std::size_t>(simgrid::s4u::this_actor::get_pid()); }

// SMPI's global shared malloc maps one file that it creates in /tmp, and on
// a disk file system every first write to a page after the kernel wrote it
// back faults (dirty tracking): 15 % of a shared-memory run's host time,
// charged to the simulated clock (P = 16, nvlink-ib). The blocks are therefore
// mapped again, in place, from one memory file (tmpfs, no write-back): SMPI
// still knows them as shared (it skips copying them in messages and frees
// them), their pages are memory. kMemoryFileBytes equals the
// smpi/shared-malloc-blocksize that scripts/simulate.py passes.
constexpr std::size_t kMemoryFileBytes = std::size_t{1} << 30;
int g_memfd = -1;

int memory_file() {
  std::lock_guard lock(g_mu);
  if (g_memfd < 0) {
    const int fd = memfd_create("kdacp-shared-memory", 0);
    if (fd < 0) return -1;
    if (ftruncate(fd, static_cast<off_t>(kMemoryFileBytes)) != 0) {
      close(fd);
      return -1;
    }
    g_memfd = fd;
  }
  return g_memfd;
}

void* allocate(std::size_t bytes) {
  void* p = smpi_shared_malloc(bytes, "kdacp-buffer", 0);
  static const auto page = static_cast<std::uintptr_t>(sysconf(_SC_PAGESIZE));
  const int fd = memory_file();
  if (p == nullptr || fd < 0 || reinterpret_cast<std::uintptr_t>(p) % page != 0) return p;
  for (std::size_t at = 0; at < bytes; at += kMemoryFileBytes) {
    const std::size_t len = std::min(kMemoryFileBytes, bytes - at);
    if (mmap(static_cast<char*>(p) + at, len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, 0) ==
        MAP_FAILED)
      break;  // the rest stays on SMPI's file: slower first writes, the same data
  }
  return p;
}
void deallocate(void* p, std::size_t) { smpi_shared_free(p); }

// A block whose flag stripes stay each rank's own (core/flagged_buffer.hpp):
// SMPI's partial shared malloc shares the stretches between the stripes
// (whole pages of them; the pages at their edges stay private) and copies
// the private bytes of a message, so every rank reads the flags it wrote or
// received. SMPI maps each stretch's whole pages from its file with
// MAP_POPULATE: page tables for every page at once (16 MiB per rank for a
// P = 1024 zigzag all-gather's 8 GiB), and the disk file's write faults.
// They are mapped again, in place, from the memory file as allocate() does,
// without populating: the same pages, the same number of mappings.
void* allocate_flagged(std::size_t bytes, std::size_t stride, std::size_t offset, std::size_t length) {
  std::vector<std::size_t> shared;  // start, stop pairs
  std::size_t from = 0;
  for (std::size_t at = offset; stride > 0 && length > 0 && at < bytes; at += stride) {
    if (at > from) shared.insert(shared.end(), {from, at});
    from = std::min(bytes, at + length);
  }
  if (from < bytes) shared.insert(shared.end(), {from, bytes});
  if (shared.empty()) {
    // All flags: this rank's own memory (smpi_shared_free frees what it did
    // not map with free()).
    void* p = nullptr;
    return posix_memalign(&p, 64, std::max<std::size_t>(bytes, 64)) == 0 ? p : nullptr;
  }
  void* p = smpi_shared_malloc_partial(bytes, shared.data(), static_cast<int>(shared.size() / 2));
  static const auto page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  const int fd = memory_file();
  if (p == nullptr || fd < 0) return p;
  for (std::size_t i = 0; i + 1 < shared.size(); i += 2) {
    // The whole pages SMPI shared: [start rounded up, stop rounded down),
    // in pieces no longer than the memory file.
    const std::size_t begin = (shared[i] + page - 1) / page * page;
    const std::size_t end = shared[i + 1] == bytes ? bytes : shared[i + 1] / page * page;
    for (std::size_t at = begin; at < end; at += kMemoryFileBytes) {
      const std::size_t len = std::min(kMemoryFileBytes, end - at);
      if (mmap(static_cast<char*>(p) + at, len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, 0) ==
          MAP_FAILED)
        return p;  // the rest stays on SMPI's file: slower first writes, the same data
    }
  }
  return p;
}

void charge(double flops) {
  const std::size_t r = actor();
  std::lock_guard lock(g_mu);
  if (g_pending.size() <= r) g_pending.resize(r + 1, 0.0);
  g_pending[r] += flops;
}

// Installed when smpirun loads the program, before any rank allocates.
const bool g_installed = [] {
  const char* env = std::getenv("KDACP_SMPI_SHARED_MEMORY");
  const std::string_view v = env ? env : "0";
  g_text = std::string(v);
  g_setting = v == "1" ? 1 : v == "0" ? 0 : -1;
  if (g_setting == 1) {
    detail::SimulationHooks hooks;
    hooks.allocate = allocate;
    hooks.deallocate = deallocate;
    hooks.allocate_flagged = allocate_flagged;
    hooks.compute = charge;
    detail::set_simulation_hooks(hooks);
  }
  return true;
}();

}  // namespace

bool shared_memory() {
  (void)g_installed;
  if (g_setting < 0)
    throw InvalidArgument(fmt::format("KDACP_SMPI_SHARED_MEMORY is '{}', expected 0 (ranks compute real data) or 1 "
                                      "(the shared-memory mode: shared buffers, compute charged as flops; "
                                      "docs/scale.md)",
                                      g_text));
  return g_setting == 1;
}

void charge_pending_compute() {
  if (g_setting != 1) return;
  const std::size_t r = actor();
  double flops = 0;
  {
    std::lock_guard lock(g_mu);
    if (r < g_pending.size()) std::swap(flops, g_pending[r]);
  }
  if (flops > 0) smpi_execute_flops(flops);
}

}  // namespace kdacp::smpi
