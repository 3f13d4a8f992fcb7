// The MPI communicator: the semantics of the in-process backend over MPI.
//
// Bounded waits: MPI cannot bound a blocking call, so every operation is
// non-blocking (MPI_Iallgather, MPI_Ibcast, MPI_Isend/Irecv, MPI_Comm_idup)
// and completed by polling MPI_Test until the communicator's deadline (see
// poll() for the backoff: it yields the core, since with more processes than
// cores, as in CI, a spinning waiter would starve the peer it waits for).
//
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
// missing). Until 2026-12-06 every collective exchanged the headers whole:
// O(P²) messages per collective in all.
// Point-to-point sizes are checked on the receiver from the status
// (MPI_ERR_TRUNCATE when longer, MPI_Get_elements_x when shorter).
//
// Simulation (the SMPI build, KDACP_SMPI; docs/scale.md): the same code runs
// on SimGrid's SMPI, where ranks are simulated actors and time is simulated.
// There the deadlines follow MPI_Wtime (simulated seconds) and a wait is one
// MPI_Waitall: polling would charge SMPI's per-MPI_Test cost to the
// simulated clock and blur every completion time. A wait that ends after its
// deadline is the same Timeout as on a real cluster; a wait that can never
// end is a deadlock, which the simulator detects at once and reports with
// every blocked rank before it stops the run.
//
// Large buffers: MPI counts are int. A buffer over max_message_bytes
// (INT_MAX by default) is described as ONE element of a derived datatype
// (q chunks of max_message_bytes, then the remainder), resized to the exact
// byte extent, so the in-place all-gather still places slot i at i × slot.
#include <mpi.h>
#if defined(KDACP_SMPI)
#include <simgrid/s4u/Actor.hpp>

#include "comm/smpi/shared_memory.hpp"
#endif

#include <algorithm>
#include <climits>
#include <cstdlib>
#include <cstdint>
#include <list>
#include <map>
#include <thread>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "kdacp/error.hpp"
#include "kdacp/mpi.hpp"

namespace kdacp {

namespace {

// Shared-memory mode (comm/smpi/shared_memory.hpp): the flops a rank's fold steps
// charged since its last MPI call go on its clock before the next one.
inline void charge_compute() {
#if defined(KDACP_SMPI)
  smpi::charge_pending_compute();
#endif
}

#if defined(KDACP_SMPI)
// Simulated seconds, as a std::chrono clock so that deadlines read the same.
struct Clock {
  using duration = std::chrono::duration<double>;
  using rep = duration::rep;
  using period = duration::period;
  using time_point = std::chrono::time_point<Clock, duration>;
  static constexpr bool is_steady = true;
  static time_point now() {
    charge_compute();
    return time_point(duration(MPI_Wtime()));
  }
};
#else
using Clock = std::chrono::steady_clock;
#endif

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

// Completes `count` requests or gives up at `deadline`; returns false then
// (the requests may still be active), true with the MPI return code in `rc`
// otherwise. Large messages move in pipelined fragments that advance only
// while a process is inside MPI, so the first 20 ms poll continuously,
// yielding the core between tests (with more ranks than cores the peer we
// wait for needs it). Only a wait longer than that (a peer that is far
// behind) backs off to sleeps doubling up to 1 ms, so idle ranks stop burning
// CPU, at the price of at most ~1 ms added latency for such long waits.
// Simulated (KDACP_SMPI): one MPI_Waitall, then the deadline on the
// simulated clock (see the top of this file).
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

// Completes one request (see complete()).
bool poll(MPI_Request* req, MPI_Status* status, Clock::time_point deadline, int* rc) {
  return complete(1, req, status == MPI_STATUS_IGNORE ? MPI_STATUSES_IGNORE : status, deadline, rc);
}

// `bytes` contiguous bytes as (count, datatype) within MPI's int counts.
class ByteType {
 public:
  // words: a buffer of whole 8-byte words as that many MPI_UINT64_T, a
  // predefined type, so that a collective's counts are 8 times smaller.
  ByteType(std::size_t bytes, std::size_t max_chunk, bool words = false) {
    if (words && bytes % 8 == 0 && bytes <= max_chunk) {
      type_ = MPI_UINT64_T;
      count_ = static_cast<int>(bytes / 8);
      return;
    }
    if (bytes <= max_chunk) {
      count_ = static_cast<int>(bytes);
      return;
    }
    const std::size_t chunks = bytes / max_chunk, rest = bytes % max_chunk;
    if (chunks > static_cast<std::size_t>(INT_MAX))
      throw InvalidArgument(
          fmt::format("MPI message of {} bytes, expected at most INT_MAX chunks of {} bytes", bytes, max_chunk));
    MPI_Datatype chunk = MPI_DATATYPE_NULL, body = MPI_DATATYPE_NULL;
    MPI_Type_contiguous(static_cast<int>(max_chunk), MPI_BYTE, &chunk);
    const int lengths[2] = {static_cast<int>(chunks), static_cast<int>(rest)};
    const MPI_Aint displs[2] = {0, static_cast<MPI_Aint>(chunks * max_chunk)};
    const MPI_Datatype types[2] = {chunk, MPI_BYTE};
    MPI_Type_create_struct(rest ? 2 : 1, lengths, displs, types, &body);
    // The extent must be exactly `bytes` so that slot i of a gather lands at
    // i × bytes whatever padding rules the struct constructor applies.
    MPI_Type_create_resized(body, 0, static_cast<MPI_Aint>(bytes), &type_);
    MPI_Type_commit(&type_);
    MPI_Type_free(&body);
    MPI_Type_free(&chunk);
    count_ = 1;
  }
  ~ByteType() {
    if (type_ != MPI_BYTE && type_ != MPI_UINT64_T && mpi_running()) MPI_Type_free(&type_);
  }
  ByteType(const ByteType&) = delete;
  ByteType& operator=(const ByteType&) = delete;

  int count() const { return count_; }
  MPI_Datatype type() const { return type_; }

 private:
  MPI_Datatype type_ = MPI_BYTE;
  int count_ = 0;
};

// The collective header every member contributes before the data moves.
enum class Op : std::uint64_t { all_gather = 1, broadcast, barrier, split };
constexpr std::size_t kHeaderWords = 3;  // op, bytes, root

const char* op_name(std::uint64_t op) {
  switch (static_cast<Op>(op)) {
    case Op::all_gather: return "all_gather";
    case Op::broadcast: return "broadcast";
    case Op::barrier: return "barrier";
    case Op::split: return "split";
  }
  return "unknown collective";
}

// Operations whose deadline passed while MPI still owns their buffers: kept
// alive with them until the communicator goes away.
struct Abandoned {
  std::vector<MPI_Request> requests;
  std::vector<std::uint64_t> send, recv;
};

class MpiComm final : public Communicator, public std::enable_shared_from_this<MpiComm> {
 public:
  MpiComm(MPI_Comm comm, MpiOptions options, std::size_t world_size)
      : comm_(comm), options_(options), world_size_(world_size) {
    MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
    int rank = 0, size = 0;
    MPI_Comm_rank(comm_, &rank);
    MPI_Comm_size(comm_, &size);
    rank_ = static_cast<std::size_t>(rank);
    size_ = static_cast<std::size_t>(size);
    MPI_Group mine = MPI_GROUP_NULL, world = MPI_GROUP_NULL;
    MPI_Comm_group(comm_, &mine);
    MPI_Comm_group(MPI_COMM_WORLD, &world);
    std::vector<int> local(size_), global(size_);
    for (std::size_t i = 0; i < size_; ++i) local[i] = static_cast<int>(i);
    MPI_Group_translate_ranks(mine, size, local.data(), world, global.data());
    MPI_Group_free(&mine);
    MPI_Group_free(&world);
    global_.assign(global.begin(), global.end());
    int tag_ub_flag = 0;
    int* tag_ub = nullptr;
    MPI_Comm_get_attr(comm_, MPI_TAG_UB, &tag_ub, &tag_ub_flag);
    // The standard guarantees at least 32767; the top tag carries the
    // collective headers, so user tags end one below it.
    header_tag_ = tag_ub_flag ? *tag_ub : 32767;
  }

  ~MpiComm() override {
    if (!mpi_running()) return;
    for (auto& a : abandoned_) {
      int flag = 0;
      MPI_Testall(static_cast<int>(a->requests.size()), a->requests.data(), &flag,
                  MPI_STATUSES_IGNORE);
      // Still active: MPI may write into its buffers at any time, so they
      // must never be freed. Only happens after a Timeout, when the process
      // is expected to abort anyway.
      if (!flag) a.release();
    }
    MPI_Comm_free(&comm_);
  }

  MpiComm(const MpiComm&) = delete;
  MpiComm& operator=(const MpiComm&) = delete;

  std::size_t rank() const override { return rank_; }
  std::size_t size() const override { return size_; }
  const std::vector<std::size_t>& global_ranks() const override { return global_; }
  std::size_t world_size() const override { return world_size_; }
  std::string backend() const override { return "mpi"; }
  std::chrono::milliseconds timeout() const override { return options_.timeout; }
  CommStats stats() const override { return stats_; }
#if defined(KDACP_SMPI)
  double now_seconds() const override {
    charge_compute();
    return MPI_Wtime();
  }
#endif

  void all_gather(std::span<std::byte> buffer) override {
    const std::size_t n = size_;
    if (buffer.size() % n != 0)
      throw InvalidArgument(fmt::format("{}all_gather buffer of {} bytes, expected a multiple of the group size {}",
                                        who(), buffer.size(), n));
    const std::size_t slot = buffer.size() / n;
    agree(Op::all_gather, slot, 0);
#if defined(KDACP_SMPI)
    // Simulated: the blocking collective, whose algorithm smpirun selects
    // (scripts/simulate.py: recursive doubling, one of Open MPI's
    // MPI_Iallgather algorithms and the one the cost model prices). SMPI's
    // MPI_Iallgather posts all P - 1 sends at once, O(P²) simulated flows:
    // 21 minutes of real time for one P = 256 sweep row (docs/scale.md).
    // A slot is counted in 8-byte words: SMPI 3.32's recursive doubling
    // counts a round's message in an int of elements, which in bytes
    // overflowed at P/2 slots of 4 MiB (P = 1024, H = 32). Not a derived
    // type: SMPI copies those through a buffer it allocates per message,
    // which at that size took all of this host's memory.
    if (n > 1 && (n & (n - 1)) == 0 && (n / 2) * slot >= own_all_gather_from() && slot % 8 == 0) {
      doubling_all_gather(buffer, slot);
    } else {
      const ByteType type(slot, options_.max_message_bytes, /*words=*/true);
      check(MPI_Allgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, buffer.data(), type.count(), type.type(), comm_),
            "all_gather");
    }
#else
    const ByteType type(slot, options_.max_message_bytes);
    MPI_Request req = MPI_REQUEST_NULL;
    check(MPI_Iallgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, buffer.data(), type.count(),
                         type.type(), comm_, &req),
          "all_gather");
    wait_collective(req, fmt::format("all_gather of {} bytes per slot", slot));
#endif
    stats_.bytes_received += slot * (n - 1);
    stats_.bytes_sent += slot * (n - 1);
    ++stats_.messages_sent;
  }

#if defined(KDACP_SMPI)
  // SMPI 3.32's own recursive doubling fails once a round's message reaches
  // 2 GiB (P = 1024 at H = 32: the host ran out of memory inside SMPI). Past
  // kSmpiLargeMessage this is the same algorithm, round for round (the
  // member q ^ 2^k exchanges the 2^k slots each side holds), with every
  // message of a round cut into pieces under 1 GiB that travel together.
  static constexpr std::size_t kSmpiLargeMessage = std::size_t{1} << 31;
  static constexpr std::size_t kSmpiPiece = std::size_t{1} << 30;

  // The last round's message size from which the own algorithm runs:
  // kSmpiLargeMessage, or KDACP_SMPI_OWN_ALLGATHER_FROM (bytes, at least 1),
  // with which make test's small simulation runs it on every all-gather to
  // check its bytes and its time against SMPI's (scripts/simulate.py --check).
  static std::size_t own_all_gather_from() {
    static const std::size_t from = [] {
      const char* env = std::getenv("KDACP_SMPI_OWN_ALLGATHER_FROM");
      if (env == nullptr || *env == '\0') return kSmpiLargeMessage;
      char* end = nullptr;
      const unsigned long long v = std::strtoull(env, &end, 10);
      if (*end != '\0' || v == 0 || env[0] == '-')
        throw InvalidArgument(fmt::format("KDACP_SMPI_OWN_ALLGATHER_FROM is '{}', expected a byte count of at least 1",
                                          env));
      return static_cast<std::size_t>(v);
    }();
    return from;
  }

  void doubling_all_gather(std::span<std::byte> buffer, std::size_t slot) {
    const std::size_t n = size_, me = rank_;
    std::vector<MPI_Request> reqs;
    for (std::size_t mask = 1; mask < n; mask <<= 1) {
      const std::size_t peer = me ^ mask;
      const std::size_t mine = me & ~(mask - 1), theirs = peer & ~(mask - 1);
      const std::size_t bytes = mask * slot;
      reqs.clear();
      for (std::size_t at = 0; at < bytes; at += kSmpiPiece) {
        const std::size_t len = std::min(kSmpiPiece, bytes - at);
        reqs.push_back(MPI_REQUEST_NULL);
        check(MPI_Irecv(buffer.data() + theirs * slot + at, static_cast<int>(len / 8), MPI_UINT64_T,
                        static_cast<int>(peer), header_tag_, comm_, &reqs.back()),
              "all_gather");
        reqs.push_back(MPI_REQUEST_NULL);
        check(MPI_Isend(buffer.data() + mine * slot + at, static_cast<int>(len / 8), MPI_UINT64_T,
                        static_cast<int>(peer), header_tag_, comm_, &reqs.back()),
              "all_gather");
      }
      check(MPI_Waitall(static_cast<int>(reqs.size()), reqs.data(), MPI_STATUSES_IGNORE), "all_gather");
    }
  }
#endif

  void broadcast(std::span<std::byte> buffer, std::size_t root) override {
    check_peer(root, "broadcast");
    agree(Op::broadcast, buffer.size(), root);
    const ByteType type(buffer.size(), options_.max_message_bytes);
#if defined(KDACP_SMPI)
    // Simulated: the blocking collective, a binomial tree (smpirun's
    // selection in scripts/simulate.py, what the model prices); SMPI's
    // MPI_Ibcast sends from the root to every member in turn.
    check(MPI_Bcast(buffer.data(), type.count(), type.type(), static_cast<int>(root), comm_), "broadcast");
#else
    MPI_Request req = MPI_REQUEST_NULL;
    check(MPI_Ibcast(buffer.data(), type.count(), type.type(), static_cast<int>(root), comm_, &req),
          "broadcast");
    wait_collective(req, fmt::format("broadcast of {} bytes from rank {}", buffer.size(), global_[root]));
#endif
    if (root == rank_) stats_.bytes_sent += buffer.size() * (size_ - 1);
    else stats_.bytes_received += buffer.size();
    ++stats_.messages_sent;
  }

  // The agreement's all-reduce completing proves every member arrived.
  // Simulated, every member also leaves at the same instant (below).
  void barrier() override {
    agree(Op::barrier, 0, 0);
#if defined(KDACP_SMPI)
    leave_together();
#endif
  }

  std::unique_ptr<Request> isend(std::span<const std::byte> data, std::size_t peer,
                                 int tag) override;
  std::unique_ptr<Request> irecv(std::span<std::byte> data, std::size_t peer, int tag) override;

  std::shared_ptr<Communicator> split(int color, int key) override {
    // The agreement bounds the wait for the members; once it completed,
    // every member is inside split() and MPI_Comm_split cannot hang on one.
    agree(Op::split, 0, 0);
    MPI_Comm out = MPI_COMM_NULL;
    check(MPI_Comm_split(comm_, color < 0 ? MPI_UNDEFINED : color, key, &out), "split");
    if (out == MPI_COMM_NULL) return nullptr;
    return std::make_shared<MpiComm>(out, options_, world_size_);
  }

  std::string who() const {
    const std::string group = size_ <= 16 ? fmt::format("[{}]", fmt::join(global_, ","))
                                          : fmt::format("{} ranks from {}", size_, global_.front());
    return fmt::format("rank {} (mpi group {}): ", global_[rank_], group);
  }

  // Throws Error naming the operation for a failed MPI call.
  void check(int rc, const std::string& op) const {
    if (rc != MPI_SUCCESS) throw Error(who() + op + ": " + error_text(rc));
  }

  void check_peer(std::size_t peer, const char* op) const {
    if (peer >= size_)
      throw InvalidArgument(fmt::format("{}{} peer {} outside the group of size {}", who(), op, peer, size_));
  }
  void check_tag(int tag, const char* op) const {
    if (tag < 0 || tag >= header_tag_)
      throw InvalidArgument(fmt::format("{}{} tag {}, expected 0..{}", who(), op, tag, header_tag_ - 1));
  }

  const MpiOptions& options() const { return options_; }
  MPI_Comm handle() const { return comm_; }
  const std::vector<std::size_t>& globals() const { return global_; }
  CommStats& counters() { return stats_; }

 private:
  // Compares the members' headers and throws when they disagree: the member
  // whose (op, bytes, root) differs from the most common one gets
  // InvalidArgument, the others RemoteError; both messages list who passed
  // what, by global rank. A member that does not join in time is a Timeout
  // naming it.
  //
  // First one all-reduce of each word's minimum and its complement's minimum
  // (the maximum): O(log P) messages, and when every member passed the same
  // header, the only ones. Only when the headers differ, or the all-reduce
  // did not complete by the deadline, do the members exchange them whole
  // (P - 1 each way per member): that names who disagrees, or, after a
  // second deadline, whose header never came. Every member sees the same
  // all-reduce result, so all of them take the same path.
  void agree(Op op, std::size_t bytes, std::size_t root) {
    charge_compute();
    const char* name = op_name(static_cast<std::uint64_t>(op));
    const std::string what =
        op == Op::barrier || op == Op::split ? std::string(name) : fmt::format("{} of {} bytes", name, bytes);
    auto probe = std::make_unique<Abandoned>();
    probe->send = {static_cast<std::uint64_t>(op), bytes, root};
    for (std::size_t i = 0; i < kHeaderWords; ++i) probe->send.push_back(~probe->send[i]);
    probe->recv.assign(2 * kHeaderWords, 0);
#if defined(KDACP_SMPI)
    // Simulated: the blocking all-reduce (a deadlock is SimGrid's to report;
    // SMPI charges every MPI_Test to the simulated clock).
    check(MPI_Allreduce(probe->send.data(), probe->recv.data(), 2 * kHeaderWords, MPI_UINT64_T, MPI_MIN, comm_),
          what);
    const bool joined = true;
#else
    probe->requests.assign(1, MPI_REQUEST_NULL);
    check(MPI_Iallreduce(probe->send.data(), probe->recv.data(), 2 * kHeaderWords, MPI_UINT64_T, MPI_MIN, comm_,
                         probe->requests.data()),
          what);
    int probe_rc = MPI_SUCCESS;
    const bool joined =
        complete(1, probe->requests.data(), MPI_STATUSES_IGNORE, Clock::now() + options_.timeout, &probe_rc);
    if (joined && probe_rc != MPI_SUCCESS) throw RemoteError(who() + what + ": " + error_text(probe_rc));
#endif
    if (joined) {
      bool same = true;
      for (std::size_t i = 0; i < kHeaderWords; ++i)
        same = same && probe->recv[i] == ~probe->recv[kHeaderWords + i];
      if (same) return;
    } else {
      // MPI may still complete it: its buffers stay with the communicator.
      abandoned_.push_back(std::move(probe));
    }
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
      check(MPI_Irecv(pending->recv.data() + q * kHeaderWords, kHeaderWords, MPI_UINT64_T,
                      static_cast<int>(q), header_tag_, comm_, &pending->requests[i]),
            what);
      check(MPI_Isend(pending->send.data(), kHeaderWords, MPI_UINT64_T, static_cast<int>(q),
                      header_tag_, comm_, &pending->requests[size_ - 1 + i]),
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
          missing.empty()
              ? fmt::format("waiting for the group's members (global ranks [{}]) to take this rank's header",
                            fmt::join(global_, ","))
              : fmt::format("waiting for peer rank(s) {} to join", fmt::join(missing, " ")),
          late));
    }
    if (rc != MPI_SUCCESS) throw RemoteError(who() + what + ": " + error_text(rc));
    using Header = std::vector<std::uint64_t>;
    std::map<Header, std::vector<std::size_t>> by_header;
    for (std::size_t r = 0; r < size_; ++r) {
      const auto* h = pending->recv.data() + r * kHeaderWords;
      by_header[Header(h, h + kHeaderWords)].push_back(r);
    }
    if (by_header.size() == 1) {
      if (joined) return;  // not reached: the all-reduce saw a difference
      // The same header from every member, after this one gave up on the
      // all-reduce: some member joined late, and the others may have
      // completed the all-reduce this one abandoned. Out of step for good.
      throw Timeout(fmt::format("{}{}: timed out after {} ms waiting for the group's members (global ranks [{}]) "
                                "to join; every member's header arrived within {} ms more, so one joined late",
                                who(), what, options_.timeout.count(), fmt::join(global_, ","), window.count()));
    }

    // The most common header is "expected"; ties go to the one that includes
    // the lowest group rank, so every member picks the same.
    auto expected = by_header.begin();
    for (auto it = by_header.begin(); it != by_header.end(); ++it) {
      if (it->second.size() > expected->second.size() ||
          (it->second.size() == expected->second.size() &&
           it->second.front() < expected->second.front()))
        expected = it;
    }
    std::string text = fmt::format("{}{}: the group's members disagree:", who(), what);
    for (const auto& [h, members] : by_header) {
      std::vector<std::size_t> globals;
      for (std::size_t r : members) globals.push_back(global_[r]);
      text += fmt::format(" global rank(s) [{}] called {}", fmt::join(globals, ","), op_name(h[0]));
      if (h[0] == static_cast<std::uint64_t>(Op::all_gather) ||
          h[0] == static_cast<std::uint64_t>(Op::broadcast))
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

#if defined(KDACP_SMPI)
  // A barrier lets its members go at different times (an all-reduce's last
  // round reaches some before others), and a call timed after it would count
  // that skew: simulated, each member learns the latest entry and the latest
  // exit of an all-reduce, and all sleep until the same instant beyond the
  // next one's end (twice that all-reduce's span later), so that timed calls
  // start together, as the cost model assumes.
  void leave_together() {
    const double entry = MPI_Wtime();
    double latest_entry = entry, latest_exit = entry;
    check(MPI_Allreduce(&entry, &latest_entry, 1, MPI_DOUBLE, MPI_MAX, comm_), "barrier");
    const double exit = MPI_Wtime();
    check(MPI_Allreduce(&exit, &latest_exit, 1, MPI_DOUBLE, MPI_MAX, comm_), "barrier");
    simgrid::s4u::this_actor::sleep_until(latest_exit + 2 * (latest_exit - latest_entry) + 1e-6);
  }
#endif

  // Completes a collective's data transfer within the deadline. Every member
  // joined (the agreement proved it), so a timeout here means one
  // stopped answering in the middle of the transfer, which MPI cannot
  // attribute to a member.
  void wait_collective(MPI_Request& req, const std::string& what) {
    MPI_Status status;
    int rc = MPI_SUCCESS;
    if (!poll(&req, &status, Clock::now() + options_.timeout, &rc)) {
      throw Timeout(fmt::format("{}{}: timed out after {} ms in the data transfer with the group's members (global "
                                "ranks [{}]), which all joined it",
                                who(), what, options_.timeout.count(), fmt::join(global_, ",")));
    }
    if (rc != MPI_SUCCESS) throw RemoteError(who() + what + ": " + error_text(rc));
  }

  MPI_Comm comm_;
  MpiOptions options_;
  std::size_t world_size_;
  std::size_t rank_ = 0, size_ = 0;
  std::vector<std::size_t> global_;
  int header_tag_ = 32767;
  CommStats stats_;
  std::list<std::unique_ptr<Abandoned>> abandoned_;
};

// A posted MPI_Isend / MPI_Irecv. wait() polls within the communicator's
// timeout; a receive then checks that exactly the posted size arrived.
class MpiRequest final : public Request {
 public:
  MpiRequest(std::shared_ptr<MpiComm> comm, bool is_recv, std::size_t peer, int tag,
             std::size_t bytes)
      : comm_(std::move(comm)),
        type_(bytes, comm_->options().max_message_bytes),
        is_recv_(is_recv),
        peer_(peer),
        tag_(tag),
        bytes_(bytes) {}

  ~MpiRequest() override {
    if (req_ == MPI_REQUEST_NULL || !mpi_running()) return;
    // Dropped before completion (an exception unwound past it). A receive
    // can be cancelled; a send cannot portably, so it is left to complete.
#if !defined(KDACP_SMPI)  // simulated: a wait on a cancelled receive could block for good
    if (is_recv_) {
      MPI_Cancel(&req_);
      int rc = MPI_SUCCESS;
      if (poll(&req_, MPI_STATUS_IGNORE, Clock::now() + std::chrono::milliseconds(100), &rc))
        return;
    }
#endif
    MPI_Request_free(&req_);
  }
  MpiRequest(const MpiRequest&) = delete;
  MpiRequest& operator=(const MpiRequest&) = delete;

  void post(const void* data) {
    charge_compute();
    const int peer = static_cast<int>(peer_);
    const std::string op = describe();
    if (is_recv_)
      comm_->check(MPI_Irecv(const_cast<void*>(data), type_.count(), type_.type(), peer, tag_,
                             comm_->handle(), &req_),
                   op);
    else
      comm_->check(MPI_Isend(data, type_.count(), type_.type(), peer, tag_, comm_->handle(), &req_),
                   op);
  }

  void wait() override {
    if (req_ == MPI_REQUEST_NULL) return;
    MPI_Status status;
    int rc = MPI_SUCCESS;
    if (!poll(&req_, &status, Clock::now() + comm_->timeout(), &rc))
      throw Timeout(fmt::format("{}{}: timed out after {} ms waiting for peer rank {}", comm_->who(), describe(),
                                comm_->timeout().count(), comm_->globals()[peer_]));
    if (rc != MPI_SUCCESS) {
      int cls = 0;
      MPI_Error_class(rc, &cls);
      if (cls == MPI_ERR_TRUNCATE)
        throw RemoteError(fmt::format("{}{}: the message from rank {} is longer than the {} bytes expected ({})",
                                      comm_->who(), describe(), comm_->globals()[peer_], bytes_, error_text(rc)));
      throw RemoteError(comm_->who() + describe() + ": " + error_text(rc));
    }
    if (is_recv_) {
#if defined(KDACP_SMPI)
      // SMPI lacks MPI_Get_elements_x; its statuses count bytes, and a
      // simulated message never needs a count beyond int.
      int received = 0;
      MPI_Get_count(&status, MPI_BYTE, &received);
      const MPI_Count elements = received;
#else
      MPI_Count elements = 0;
      MPI_Get_elements_x(&status, type_.type(), &elements);
#endif
      if (elements != static_cast<MPI_Count>(bytes_))
        throw RemoteError(fmt::format("{}{}: message of {} bytes from rank {}, expected {}", comm_->who(), describe(),
                                      elements, comm_->globals()[peer_], bytes_));
    }
  }

 private:
  std::string describe() const {
    return fmt::format("{} rank {} (tag {}, {} bytes)", is_recv_ ? "irecv from" : "isend to",
                       comm_->globals()[peer_], tag_, bytes_);
  }

  std::shared_ptr<MpiComm> comm_;
  ByteType type_;
  bool is_recv_;
  std::size_t peer_;
  int tag_;
  std::size_t bytes_;
  MPI_Request req_ = MPI_REQUEST_NULL;
};

std::unique_ptr<Request> MpiComm::isend(std::span<const std::byte> data, std::size_t peer,
                                        int tag) {
  check_peer(peer, "isend");
  check_tag(tag, "isend");
  auto req = std::make_unique<MpiRequest>(shared_from_this(), false, peer, tag, data.size());
  req->post(data.data());
  stats_.bytes_sent += data.size();
  ++stats_.messages_sent;
  return req;
}

std::unique_ptr<Request> MpiComm::irecv(std::span<std::byte> data, std::size_t peer, int tag) {
  check_peer(peer, "irecv");
  check_tag(tag, "irecv");
  auto req = std::make_unique<MpiRequest>(shared_from_this(), true, peer, tag, data.size());
  req->post(data.data());
  stats_.bytes_received += data.size();
  return req;
}

}  // namespace

std::shared_ptr<Communicator> mpi_world(MpiOptions options) {
  if (!mpi_running())
    throw Error("mpi_world: MPI is not running, expected an initialised MPI (create an "
                "MpiSession first, and keep it alive while communicators exist)");
  if (options.max_message_bytes < 1 || options.max_message_bytes > static_cast<std::size_t>(INT_MAX))
    throw InvalidArgument(
        fmt::format("mpi_world: max_message_bytes is {}, expected 1..{}", options.max_message_bytes, INT_MAX));
  if (options.timeout.count() <= 0)
    throw InvalidArgument(fmt::format("mpi_world: timeout is {} ms, expected > 0", options.timeout.count()));
  int world_rank = 0, world_size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world_size);
  // Our own context: kdacp's tags can never match the application's.
  MPI_Comm dup = MPI_COMM_NULL;
#if defined(KDACP_SMPI)
  // SMPI lacks MPI_Comm_idup; a simulated rank that never arrives is a
  // deadlock the simulator reports.
  int rc = MPI_Comm_dup(MPI_COMM_WORLD, &dup);
#else
  MPI_Request req = MPI_REQUEST_NULL;
  int rc = MPI_Comm_idup(MPI_COMM_WORLD, &dup, &req);
  if (rc == MPI_SUCCESS) {
    if (!poll(&req, MPI_STATUS_IGNORE, Clock::now() + options.timeout, &rc))
      throw Timeout(fmt::format("rank {}: mpi_world: duplicating MPI_COMM_WORLD timed out after {} ms waiting for the "
                                "other {} processes",
                                world_rank, options.timeout.count(), world_size - 1));
  }
#endif
  if (rc != MPI_SUCCESS)
    throw Error(fmt::format("rank {}: mpi_world: MPI_Comm_idup failed: {}", world_rank, error_text(rc)));
  return std::make_shared<MpiComm>(dup, options, static_cast<std::size_t>(world_size));
}

}  // namespace kdacp
