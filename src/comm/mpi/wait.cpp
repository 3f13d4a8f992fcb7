// Bounded waits. MPI cannot bound a blocking call, so every operation is
// non-blocking (MPI_Iallgather, MPI_Ibcast, MPI_Isend/Irecv, MPI_Comm_idup)
// and completed here by polling MPI_Test until the communicator's deadline.
// Simulated (KDACP_SMPI), one MPI_Wait(all) and then the deadline on the
// simulated clock (internal.hpp).
#include <algorithm>
#include <chrono>
#include <string>
#include <thread>

#include <fmt/format.h>

#include "comm/mpi/internal.hpp"

namespace kdacp::mpi {

std::string error_text(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, text, &len) != MPI_SUCCESS) return fmt::format("MPI error {}", code);
  return std::string(text, static_cast<std::size_t>(len));
}

bool mpi_running() {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  return initialized && !finalized;
}

// Large messages move in pipelined fragments that advance only while a
// process is inside MPI, so the first 20 ms poll continuously, yielding the
// core between tests (with more ranks than cores, as in CI, the peer we wait
// for needs it: a spinning waiter would starve it). Only a wait longer than
// that (a peer that is far behind) backs off to sleeps doubling up to 1 ms,
// so idle ranks stop burning CPU, at the price of at most ~1 ms added
// latency for such long waits.
// One request goes through MPI_Test / MPI_Wait, whose return code is the
// request's own error (MPI_ERR_TRUNCATE...), not MPI_ERR_IN_STATUS.
bool complete(int count, MPI_Request* requests, MPI_Status* statuses, Clock::time_point deadline, int* rc) {
#if defined(KDACP_SMPI)
  charge_compute();
  *rc = count == 1 ? MPI_Wait(requests, statuses == MPI_STATUSES_IGNORE ? MPI_STATUS_IGNORE : statuses)
                   : MPI_Waitall(count, requests, statuses);
  return *rc != MPI_SUCCESS || Clock::now() <= deadline;
#else
  const auto busy_until = std::chrono::steady_clock::now() + std::chrono::milliseconds(20);
  std::chrono::microseconds pause{20};
  for (;;) {
    int flag = 0;
    *rc = count == 1 ? MPI_Test(requests, &flag, statuses == MPI_STATUSES_IGNORE ? MPI_STATUS_IGNORE : statuses)
                     : MPI_Testall(count, requests, &flag, statuses);
    if (*rc != MPI_SUCCESS || flag) return true;
    const auto now = Clock::now();
    if (now >= deadline) return false;
    if (now < busy_until) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::microseconds(1000));
    }
  }
#endif
}

bool poll(MPI_Request* req, MPI_Status* status, Clock::time_point deadline, int* rc) {
  return complete(1, req, status == MPI_STATUS_IGNORE ? MPI_STATUSES_IGNORE : status, deadline, rc);
}

}  // namespace kdacp::mpi
