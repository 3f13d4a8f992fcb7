// Size agreement: MPI collectives with mismatched counts are erroneous
// (undefined behaviour, in practice a hang or a corrupted buffer), so each
// collective first agrees on a 3-word header (operation, byte count, root):
// one non-blocking all-reduce of each word's minimum and maximum, O(log P)
// messages per member, which proves every member entered a collective with
// the same header (so it is the barrier itself, and it makes split() bounded
// before the blocking MPI_Comm_split). Only when it shows a difference, or
// does not complete by the deadline, do the members exchange their headers
// whole as point-to-point messages on a reserved tag (P - 1 each way): that
// NAMES the disagreeing rank, which the all-reduce cannot, and, after a
// second deadline, the members that never arrived (the ones whose header is
// missing).
#include <algorithm>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "comm/mpi/internal.hpp"
#include "kdacp/error.hpp"

namespace kdacp::mpi {

namespace {

using Header = std::vector<std::uint64_t>;

// The members (group ranks, ascending) that sent each header.
std::map<Header, std::vector<std::size_t>> by_header(const std::vector<std::uint64_t>& headers, std::size_t size) {
  std::map<Header, std::vector<std::size_t>> members;
  for (std::size_t r = 0; r < size; ++r) {
    const auto* h = headers.data() + r * kHeaderWords;
    members[Header(h, h + kHeaderWords)].push_back(r);
  }
  return members;
}

}  // namespace

const char* op_name(std::uint64_t op) {
  switch (static_cast<Op>(op)) {
    case Op::all_gather: return "all_gather";
    case Op::broadcast: return "broadcast";
    case Op::barrier: return "barrier";
    case Op::split: return "split";
  }
  return "unknown collective";
}

// The member whose (op, bytes, root) differs from the most common one gets
// InvalidArgument, the others RemoteError; both messages list who passed
// what, by global rank. A member that does not join in time is a Timeout
// naming it. Every member sees the same all-reduce result, so all of them
// take the same path.
void MpiComm::agree(Op op, std::size_t bytes, std::size_t root) {
  charge_compute();
  const char* name = op_name(static_cast<std::uint64_t>(op));
  const std::string what =
      op == Op::barrier || op == Op::split ? std::string(name) : fmt::format("{} of {} bytes", name, bytes);
  auto probe = std::make_unique<Abandoned>();
  probe->send = {static_cast<std::uint64_t>(op), bytes, root};
  for (std::size_t i = 0; i < kHeaderWords; ++i) probe->send.push_back(~probe->send[i]);
  probe->recv.assign(2 * kHeaderWords, 0);
  const bool joined = probe_headers(*probe, what);
  if (joined) {
    bool same = true;
    for (std::size_t i = 0; i < kHeaderWords; ++i) same = same && probe->recv[i] == ~probe->recv[kHeaderWords + i];
    if (same) return;
  } else {
    // MPI may still complete it: its buffers stay with the communicator.
    abandoned_.push_back(std::move(probe));
  }
  exchange_headers(op, bytes, root, joined, what);
}

// One all-reduce of each header word's minimum and its complement's minimum
// (the maximum). Returns whether it completed within the timeout.
bool MpiComm::probe_headers(Abandoned& probe, const std::string& what) {
#if defined(KDACP_SMPI)
  // Simulated: the blocking all-reduce (a deadlock is SimGrid's to report;
  // SMPI charges every MPI_Test to the simulated clock).
  check(MPI_Allreduce(probe.send.data(), probe.recv.data(), 2 * kHeaderWords, MPI_UINT64_T, MPI_MIN, comm_), what);
  return true;
#else
  probe.requests.assign(1, MPI_REQUEST_NULL);
  check(MPI_Iallreduce(probe.send.data(), probe.recv.data(), 2 * kHeaderWords, MPI_UINT64_T, MPI_MIN, comm_,
                       probe.requests.data()),
        what);
  int rc = MPI_SUCCESS;
  const bool joined = complete(1, probe.requests.data(), MPI_STATUSES_IGNORE, Clock::now() + options_.timeout, &rc);
  if (joined && rc != MPI_SUCCESS) throw RemoteError(who() + what + ": " + error_text(rc));
  return joined;
#endif
}

// Every member sends its header whole to every other one, after the
// all-reduce saw a difference (joined) or timed out (not joined), and this
// member throws what the headers show: who disagrees, or who is missing.
void MpiComm::exchange_headers(Op op, std::size_t bytes, std::size_t root, bool joined, const std::string& what) {
  auto pending = std::make_unique<Abandoned>();
  pending->send = {static_cast<std::uint64_t>(op), bytes, root};
  pending->recv.assign(kHeaderWords * size_, 0);
  std::copy(pending->send.begin(), pending->send.end(),
            pending->recv.begin() + static_cast<std::ptrdiff_t>(rank_ * kHeaderWords));
  // Receives first, in group order (request q - (q > rank) is member q's),
  // then the sends.
  pending->requests.assign(2 * (size_ - 1), MPI_REQUEST_NULL);
  for (std::size_t q = 0, i = 0; q < size_; ++q) {
    if (q == rank_) continue;
    check(MPI_Irecv(pending->recv.data() + q * kHeaderWords, kHeaderWords, MPI_UINT64_T, static_cast<int>(q),
                    header_tag_, comm_, &pending->requests[i]),
          what);
    check(MPI_Isend(pending->send.data(), kHeaderWords, MPI_UINT64_T, static_cast<int>(q), header_tag_, comm_,
                    &pending->requests[size_ - 1 + i]),
          what);
    ++i;
  }
  // After a difference every member is here: the timeout bounds the
  // exchange. After the all-reduce's timeout the exchange only names who
  // is missing, and the members present reach it as their own deadlines
  // pass: a shorter window (at most 1 s), so that this rank's diagnosis
  // comes out before the peers it did not reach give up waiting for it in
  // other operations and end the job (the launcher's grace: up to 2 s).
  const auto window = joined ? options_.timeout : std::min(options_.timeout, std::chrono::milliseconds(1000));
  int rc = MPI_SUCCESS;
  const bool done = complete(static_cast<int>(pending->requests.size()), pending->requests.data(),
                             MPI_STATUSES_IGNORE, Clock::now() + window, &rc);
  // Without the all-reduce, a member named here never joined, or joined
  // after this one's first deadline and went on.
  const std::string late = joined ? "" : fmt::format(" (and {} ms more for the members' headers)", window.count());
  if (!done) {
    std::vector<std::size_t> missing;
    for (std::size_t q = 0, i = 0; q < size_; ++q) {
      if (q == rank_) continue;
      int arrived = 0;
      MPI_Request_get_status(pending->requests[i++], &arrived, MPI_STATUS_IGNORE);
      if (!arrived) missing.push_back(global_[q]);
    }
    abandoned_.push_back(std::move(pending));
    throw Timeout(fmt::format(
        "{}{}: timed out after {} ms {}{}", who(), what, options_.timeout.count(),
        missing.empty() ? fmt::format("waiting for the group's members (global ranks [{}]) to take this rank's header",
                                      fmt::join(global_, ","))
                        : fmt::format("waiting for peer rank(s) {} to join", fmt::join(missing, " ")),
        late));
  }
  if (rc != MPI_SUCCESS) throw RemoteError(who() + what + ": " + error_text(rc));
  if (by_header(pending->recv, size_).size() > 1) throw_disagreement(pending->recv, what);
  if (joined) return;  // not reached: the all-reduce saw a difference
  // The same header from every member, after this one gave up on the
  // all-reduce: some member joined late, and the others may have completed
  // the all-reduce this one abandoned. Out of step for good.
  throw Timeout(fmt::format("{}{}: timed out after {} ms waiting for the group's members (global ranks [{}]) "
                            "to join; every member's header arrived within {} ms more, so one joined late",
                            who(), what, options_.timeout.count(), fmt::join(global_, ","), window.count()));
}

void MpiComm::throw_disagreement(const std::vector<std::uint64_t>& headers, const std::string& what) const {
  const auto members = by_header(headers, size_);
  // The most common header is "expected"; ties go to the one that includes
  // the lowest group rank, so every member picks the same.
  auto expected = members.begin();
  for (auto it = members.begin(); it != members.end(); ++it) {
    if (it->second.size() > expected->second.size() ||
        (it->second.size() == expected->second.size() && it->second.front() < expected->second.front()))
      expected = it;
  }
  std::string text = fmt::format("{}{}: the group's members disagree:", who(), what);
  for (const auto& [h, ranks] : members) {
    std::vector<std::size_t> globals;
    for (std::size_t r : ranks) globals.push_back(global_[r]);
    text += fmt::format(" global rank(s) [{}] called {}", fmt::join(globals, ","), op_name(h[0]));
    if (h[0] == static_cast<std::uint64_t>(Op::all_gather) || h[0] == static_cast<std::uint64_t>(Op::broadcast))
      text += fmt::format(" of {} bytes", h[1]);
    if (h[0] == static_cast<std::uint64_t>(Op::broadcast)) text += fmt::format(" from group rank {}", h[2]);
    text += ";";
  }
  const auto& mine = expected->second;
  const bool odd_one = std::find(mine.begin(), mine.end(), rank_) == mine.end();
  text += odd_one ? " this rank differs from the majority, expected the same buffer size, "
                    "operation and root on every member"
                  : " expected the same buffer size, operation and root on every member";
  if (odd_one) throw InvalidArgument(text);
  throw RemoteError(text);
}

}  // namespace kdacp::mpi
