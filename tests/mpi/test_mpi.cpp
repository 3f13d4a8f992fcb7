// The MPI backend under mpirun: the communicator's contract (data, sizes,
// errors, bounded waits, stats) and every exchange protocol over MPI,
// bitwise equal to the in-process backend on the same generated inputs.
//
// Every process runs every test; a test is a collective, so all ranks run
// the same tests in the same order (no shuffling). The verdict of the job is
// the AND over ranks, so a failure on any rank fails the ctest.
#include <gtest/gtest.h>
#include <mpi.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <string>
#include <thread>

#include "inputs.hpp"
#include "kdacp/error.hpp"
#include "kdacp/exchange.hpp"
#include "kdacp/inprocess.hpp"
#include "kdacp/mesh.hpp"
#include "kdacp/mpi.hpp"

namespace kdacp {
namespace {

using mpitest::Inputs;
using mpitest::make_inputs;

MpiOptions opts_with(std::chrono::milliseconds timeout, std::size_t max_bytes = 2147483647) {
  MpiOptions o;
  o.timeout = timeout;
  o.max_message_bytes = max_bytes;
  return o;
}

// A generous bound for tests: 8 processes on 2 cores may stall for seconds.
std::shared_ptr<Communicator> world(std::size_t max_bytes = 2147483647) {
  return mpi_world(opts_with(std::chrono::milliseconds(30000), max_bytes));
}

std::byte pattern(std::size_t rank, std::size_t i) {
  return static_cast<std::byte>((rank * 31 + i * 7 + 3) & 0xff);
}

bool same_bits(const State& a, const State& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.bytes()) == 0;
}

bool all_zero(const State& a) {
  for (std::size_t i = 0; i < a.size(); ++i)
    if (a.data()[i] != 0.0f) return false;
  return true;
}

template <class E, class Fn>
std::string expect_throw(Fn&& fn) {
  try {
    fn();
  } catch (const E& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "wrong exception type: " << e.what();
    return e.what();
  }
  ADD_FAILURE() << "no exception";
  return {};
}

// ---------------------------------------------------------------- communicator

TEST(MpiComm, IdentityMatchesTheLauncher) {
  auto comm = world();
  const char* env_rank = std::getenv("OMPI_COMM_WORLD_RANK");
  ASSERT_NE(env_rank, nullptr);
  const std::size_t n = comm->size();
  EXPECT_EQ(comm->backend(), "mpi");
  EXPECT_EQ(comm->rank(), std::stoul(env_rank));
  EXPECT_EQ(comm->world_size(), n);
  std::vector<std::size_t> iota(n);
  std::iota(iota.begin(), iota.end(), std::size_t{0});
  EXPECT_EQ(comm->global_ranks(), iota);
  EXPECT_TRUE(launched_by_mpirun());
  EXPECT_EQ(mpi_world_size_from_env(), n);
}

// Runs the data-moving calls with `max_bytes` as the int-count limit: the
// default takes MPI_BYTE counts, a tiny one the chunked derived datatype
// (with and without a remainder chunk) that > 2 GiB buffers take.
void check_data_paths(std::size_t max_bytes) {
  auto comm = world(max_bytes);
  const std::size_t n = comm->size(), me = comm->rank();
  for (std::size_t slot : {std::size_t{13}, std::size_t{98}, std::size_t{100}}) {
    std::vector<std::byte> buf(slot * n, std::byte{0});
    for (std::size_t i = 0; i < slot; ++i) buf[me * slot + i] = pattern(me, i);
    const CommStats before = comm->stats();
    comm->all_gather(buf);
    for (std::size_t r = 0; r < n; ++r)
      for (std::size_t i = 0; i < slot; ++i)
        ASSERT_EQ(buf[r * slot + i], pattern(r, i)) << "slot " << r << " byte " << i;
    const CommStats after = comm->stats();
    EXPECT_EQ(after.bytes_sent - before.bytes_sent, slot * (n - 1));
    EXPECT_EQ(after.bytes_received - before.bytes_received, slot * (n - 1));
    EXPECT_EQ(after.messages_sent - before.messages_sent, 1u);
  }
  for (std::size_t root = 0; root < n; ++root) {
    const std::size_t bytes = 53;
    std::vector<std::byte> buf(bytes, std::byte{0});
    if (me == root)
      for (std::size_t i = 0; i < bytes; ++i) buf[i] = pattern(root, i);
    const CommStats before = comm->stats();
    comm->broadcast(buf, root);
    for (std::size_t i = 0; i < bytes; ++i) ASSERT_EQ(buf[i], pattern(root, i));
    const CommStats after = comm->stats();
    EXPECT_EQ(after.bytes_sent - before.bytes_sent, me == root ? bytes * (n - 1) : 0);
    EXPECT_EQ(after.bytes_received - before.bytes_received, me == root ? 0 : bytes);
  }
  // A ring with two tags per pair, received in the opposite order of the
  // sends: matching is by (peer, tag), not arrival order.
  const std::size_t bytes = 1001, next = (me + 1) % n, prev = (me + n - 1) % n;
  std::vector<std::byte> out1(bytes), out2(bytes), in1(bytes), in2(bytes);
  for (std::size_t i = 0; i < bytes; ++i) {
    out1[i] = pattern(me, i);
    out2[i] = pattern(me + 100, i);
  }
  const CommStats before = comm->stats();
  auto s1 = comm->isend(out1, next, 1);
  auto s2 = comm->isend(out2, next, 2);
  auto r2 = comm->irecv(in2, prev, 2);
  auto r1 = comm->irecv(in1, prev, 1);
  r2->wait();
  r1->wait();
  s1->wait();
  s2->wait();
  s1->wait();  // again: returns at once
  for (std::size_t i = 0; i < bytes; ++i) {
    ASSERT_EQ(in1[i], pattern(prev, i));
    ASSERT_EQ(in2[i], pattern(prev + 100, i));
  }
  const CommStats after = comm->stats();
  EXPECT_EQ(after.bytes_sent - before.bytes_sent, 2 * bytes);
  EXPECT_EQ(after.bytes_received - before.bytes_received, 2 * bytes);
  EXPECT_EQ(after.messages_sent - before.messages_sent, 2u);
  comm->barrier();
}

TEST(MpiComm, DataPathsWithByteCounts) { check_data_paths(2147483647); }
TEST(MpiComm, DataPathsWithChunkedDatatype) { check_data_paths(7); }

TEST(MpiComm, SplitOrdersByKeyAndTranslatesRanks) {
  auto comm = world();
  const std::size_t n = comm->size(), me = comm->rank();
  // Rank 0 takes no part; the others split by parity, ordered by
  // descending rank (key = -rank).
  const int color = me == 0 ? -1 : static_cast<int>(me % 2);
  auto sub = comm->split(color, -static_cast<int>(me));
  if (me == 0) {
    EXPECT_EQ(sub, nullptr);
    return;
  }
  ASSERT_NE(sub, nullptr);
  std::vector<std::size_t> want;
  for (std::size_t r = n; r-- > 1;)
    if (r % 2 == me % 2) want.push_back(r);
  EXPECT_EQ(sub->global_ranks(), want);
  EXPECT_EQ(sub->global_ranks()[sub->rank()], me);
  EXPECT_EQ(sub->world_size(), n);
  std::vector<std::byte> buf(sub->size() * 4, std::byte{0});
  for (std::size_t i = 0; i < 4; ++i) buf[sub->rank() * 4 + i] = pattern(me, i);
  sub->all_gather(buf);
  for (std::size_t r = 0; r < sub->size(); ++r)
    for (std::size_t i = 0; i < 4; ++i) EXPECT_EQ(buf[r * 4 + i], pattern(want[r], i));
}

TEST(MpiComm, CollectiveSizeMismatchNamesTheRank) {
  auto comm = world();
  const std::size_t n = comm->size(), me = comm->rank(), odd = n - 1;
  const std::size_t slot = me == odd ? 24 : 16;
  std::vector<std::byte> buf(slot * n);
  const std::string odd_list = "global rank(s) [" + std::to_string(odd) + "] called all_gather of 24 bytes";
  // With 2 ranks it is one against one: the side with the lowest rank is
  // taken as expected, so rank 1 is still the odd one.
  if (me == odd) {
    const std::string msg = expect_throw<InvalidArgument>([&] { comm->all_gather(buf); });
    EXPECT_NE(msg.find(odd_list), std::string::npos) << msg;
    EXPECT_NE(msg.find("rank " + std::to_string(me) + " (mpi group"), std::string::npos) << msg;
  } else {
    const std::string msg = expect_throw<RemoteError>([&] { comm->all_gather(buf); });
    EXPECT_NE(msg.find(odd_list), std::string::npos) << msg;
  }
  // A disagreeing root, and a different operation, are caught the same way.
  std::vector<std::byte> b(8);
  {
    const std::string msg = expect_throw<Error>([&] { comm->broadcast(b, me == 0 ? 0 : 1); });
    EXPECT_NE(msg.find("called broadcast of 8 bytes from group rank 0"), std::string::npos) << msg;
    EXPECT_NE(msg.find("called broadcast of 8 bytes from group rank 1"), std::string::npos) << msg;
  }
  const std::string msg = expect_throw<Error>([&] {
    if (me == odd) comm->barrier();
    else comm->broadcast(b, 0);
  });
  EXPECT_NE(msg.find("global rank(s) [" + std::to_string(odd) + "] called barrier"),
            std::string::npos)
      << msg;
  // Nothing moved: the communicator is still consistent.
  std::vector<std::byte> ok(n * 4);
  comm->all_gather(ok);
}

TEST(MpiComm, PointToPointSizeMismatchNamesThePeer) {
  auto comm = world();
  const std::size_t me = comm->rank();
  std::vector<std::byte> big(64), small(16), mid(32);
  if (me == 0) {
    comm->isend(big, 1, 5)->wait();
    comm->isend(small, 1, 6)->wait();
  } else if (me == 1) {
    std::string msg = expect_throw<RemoteError>([&] { comm->irecv(mid, 0, 5)->wait(); });
    EXPECT_NE(msg.find("rank 1 (mpi group"), std::string::npos) << msg;
    EXPECT_NE(msg.find("message from rank 0 is longer than the 32 bytes"), std::string::npos)
        << msg;
    msg = expect_throw<RemoteError>([&] { comm->irecv(mid, 0, 6)->wait(); });
    EXPECT_NE(msg.find("message of 16 bytes from rank 0, expected 32"), std::string::npos) << msg;
  }
  comm->barrier();
}

TEST(MpiComm, EveryWaitIsBounded) {
  auto normal = world();
  auto quick = mpi_world(opts_with(std::chrono::milliseconds(300)));
  const std::size_t me = quick->rank();
  if (me == 0) {
    std::vector<std::byte> buf(8);
    auto t0 = std::chrono::steady_clock::now();
    std::string msg = expect_throw<Timeout>([&] { quick->irecv(buf, 1, 99)->wait(); });
    auto waited = std::chrono::steady_clock::now() - t0;
    EXPECT_GE(waited, std::chrono::milliseconds(300));
    EXPECT_LT(waited, std::chrono::milliseconds(10000));
    for (const char* part : {"rank 0 (mpi group", "irecv from rank 1", "tag 99", "300 ms"})
      EXPECT_NE(msg.find(part), std::string::npos) << part << " in " << msg;
    // A collective the others do not join yet: bounded too. The agreement's
    // all-reduce times out, then the headers are exchanged whole for one
    // more timeout to name who never came.
    t0 = std::chrono::steady_clock::now();
    msg = expect_throw<Timeout>([&] { quick->barrier(); });
    waited = std::chrono::steady_clock::now() - t0;
    EXPECT_GE(waited, std::chrono::milliseconds(600));  // 300 ms, then a window of min(300 ms, 1 s)
    EXPECT_LT(waited, std::chrono::milliseconds(20000));
    std::string others;
    for (std::size_t q = 1; q < quick->size(); ++q) others += (q > 1 ? " " : "") + std::to_string(q);
    for (const std::string& part : {std::string("barrier: timed out after 300 ms waiting for peer rank(s) ") + others +
                                       " to join",
                                   std::string("and 300 ms more for the members' headers")})
      EXPECT_NE(msg.find(part), std::string::npos) << part << " in " << msg;
  }
  normal->barrier();
  // The others now join rank 0's abandoned barrier, which lets it complete
  // so that the communicator can be released cleanly.
  if (me != 0) quick->barrier();
  normal->barrier();
}

TEST(MpiComm, RejectsBadOptions) {
  EXPECT_THROW(mpi_world(opts_with(std::chrono::milliseconds(1000), 0)), InvalidArgument);
  EXPECT_THROW(mpi_world(opts_with(std::chrono::milliseconds(0))), InvalidArgument);
  auto comm = world();
  std::vector<std::byte> b(4);
  EXPECT_THROW(comm->isend(b, comm->size(), 0), InvalidArgument);
  EXPECT_THROW(comm->irecv(b, 0, -1), InvalidArgument);
  EXPECT_THROW(comm->broadcast(b, comm->size()), InvalidArgument);
}

// ------------------------------------------------------------------ protocols

struct Result {
  State fwd, bwd;
  ExchangeStats fwd_stats, bwd_stats;
};

std::vector<std::size_t> divisors(std::size_t p) {
  std::vector<std::size_t> out;
  for (std::size_t w = 1; w <= p; ++w)
    if (p % w == 0) out.push_back(w);
  return out;
}

struct Variant {
  std::string method;
  std::size_t width;
  bool exact;
};

// Every concrete protocol of the factory table, every width of the grouped
// ones (auto is one of these and is tested through choose_protocol in-process).
std::vector<Variant> method_widths(std::size_t p) {
  std::vector<Variant> out;
  for (const ProtocolDescriptor* row : protocol_registry()) {
    if (row->chooser()) continue;
    const std::string name(row->name);
    if (row->takes_group_size)
      for (std::size_t w : divisors(p)) out.push_back({name, w, row->exact()});
    else
      out.push_back({name, 1, row->exact()});
  }
  return out;
}

// Relative Frobenius distance, in double.
double rel_distance(const State& a, const State& b) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const double x = a.data()[i], y = b.data()[i];
    num += (x - y) * (x - y);
    den += y * y;
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

// Cut parts (SPEC §10): none, or every third position from position 1.
std::vector<char> cut_pattern(std::size_t p, bool with_cuts) {
  std::vector<char> out(p, 0);
  for (std::size_t r = 0; r < p; ++r) out[r] = with_cuts && r % 3 == 1;
  return out;
}

// The same protocol on in-process ranks: every rank's result.
std::vector<Result> in_process(const Inputs& in, const std::string& method, std::size_t width,
                               const std::vector<char>& cuts) {
  const std::size_t p = in.size();
  std::vector<Result> out(p);
  run_in_process(p, [&](const std::shared_ptr<Communicator>& comm) {
    const std::size_t r = comm->rank();
    const DeviceMesh mesh = DeviceMesh::create(comm, {p}, {"cp"});
    auto ex = make_state_exchange(mesh, method, static_cast<long long>(width));
    const PartFlags part{cuts[r] != 0};
    out[r].fwd = ex->forward(in.s[r].view(), in.m[r].view(), part);
    out[r].fwd_stats = ex->last_stats();
    out[r].bwd = ex->backward(in.g[r].view(), in.m[r].view(), part);
    out[r].bwd_stats = ex->last_stats();
  });
  return out;
}

// Runs every protocol and width over the 1-D CP mesh `cp` (position r of P)
// and compares with the in-process run of the same protocol and with the
// in-process chain, bit for bit, and the traffic with the in-process counts.
void check_all_protocols(const DeviceMesh& cp, const Inputs& in, const std::string& label,
                         bool with_cuts = false) {
  const std::size_t p = cp.size(), r = cp.local_rank();
  const std::vector<char> cuts = cut_pattern(p, with_cuts);
  const PartFlags part{cuts[r] != 0};
  const std::vector<Result> chain = in_process(in, "p2p", 1, cuts);
  // Guards against a vacuous comparison: the chain's results are not zeros.
  if (r + 1 < p) {
    ASSERT_FALSE(all_zero(chain[r].bwd)) << label;
  }
  if (r > 0) {
    ASSERT_FALSE(all_zero(chain[r].fwd)) << label;
  }
  for (const Variant& v : method_widths(p)) {
    const std::string& method = v.method;
    const std::size_t width = v.width;
    SCOPED_TRACE(label + " " + method + " w=" + std::to_string(width) + " rank " +
                 std::to_string(r) + (with_cuts ? " with cuts" : ""));
    const std::vector<Result> ref = in_process(in, method, width, cuts);
    auto ex = make_state_exchange(cp, method, static_cast<long long>(width));
    const State fwd = ex->forward(in.s[r].view(), in.m[r].view(), part);
    const ExchangeStats fwd_stats = ex->last_stats();
    const State bwd = ex->backward(in.g[r].view(), in.m[r].view(), part);
    const ExchangeStats bwd_stats = ex->last_stats();
    // A reassociating method may reduce to an exact one (grouped_allgather_rd
    // with w = P is the allgather); an exact method never reassociates.
    if (v.exact) {
      EXPECT_TRUE(ex->exact());
    }
    EXPECT_TRUE(same_bits(fwd, ref[r].fwd)) << "forward differs from in-process";
    EXPECT_TRUE(same_bits(bwd, ref[r].bwd)) << "backward differs from in-process";
    if (ex->exact()) {
      EXPECT_TRUE(same_bits(fwd, chain[r].fwd)) << "forward differs from the chain";
      EXPECT_TRUE(same_bits(bwd, chain[r].bwd)) << "backward differs from the chain";
    } else {
      // Reassociating: same operations as in-process (above), within the
      // documented bound of the chain ((ceil(log2 P) + 2) K 2^-24, P <= 8).
      EXPECT_LT(rel_distance(fwd, chain[r].fwd), 1e-5) << "forward far from the chain";
      EXPECT_LT(rel_distance(bwd, chain[r].bwd), 1e-5) << "backward far from the chain";
    }
    EXPECT_EQ(fwd_stats.bytes_sent, ref[r].fwd_stats.bytes_sent);
    EXPECT_EQ(fwd_stats.bytes_received, ref[r].fwd_stats.bytes_received);
    EXPECT_EQ(bwd_stats.bytes_sent, ref[r].bwd_stats.bytes_sent);
    EXPECT_EQ(bwd_stats.bytes_received, ref[r].bwd_stats.bytes_received);
  }
}

// K != V both ways, B·H > 1.
const SummaryShape kShapes[] = {{2, 2, 16, 32}, {1, 3, 32, 16}};

TEST(MpiExchange, EveryProtocolAndWidthIsBitwiseInProcess) {
  auto comm = world();
  const std::size_t p = comm->size();
  const DeviceMesh cp = DeviceMesh::create(comm, {p}, {"cp"});
  std::uint64_t seed = 11;
  for (const SummaryShape& shape : kShapes)
    check_all_protocols(cp, make_inputs(shape, p, seed++), "P=" + std::to_string(p) + " " +
                                                               to_string(shape));
}

TEST(MpiExchange, CutsGiveTheInProcessBits) {
  auto comm = world();
  const std::size_t p = comm->size();
  const DeviceMesh cp = DeviceMesh::create(comm, {p}, {"cp"});
  check_all_protocols(cp, make_inputs(kShapes[0], p, 77), "P=" + std::to_string(p), true);
}

// (cp, dp) meshes on 8 processes: every dp replica exchanges over its own CP
// axis at the same time, with its own inputs, so cross-talk between replicas
// would show as a wrong result.
TEST(MpiExchange, DataParallelReplicasExchangeConcurrently) {
  auto comm = world();
  if (comm->size() != 8) GTEST_SKIP() << "needs 8 processes, got " << comm->size();
  const std::vector<std::vector<std::size_t>> layouts = {{4, 2}, {2, 4}};
  for (const auto& layout : layouts) {
    const DeviceMesh mesh = DeviceMesh::create(comm, layout, {"cp", "dp"});
    const DeviceMesh cp = mesh["cp"];
    const std::size_t replica = mesh.local_rank(1);
    ASSERT_EQ(cp.size(), layout[0]);
    const std::string label = "(cp,dp)=(" + std::to_string(layout[0]) + "," +
                              std::to_string(layout[1]) + ") replica " + std::to_string(replica);
    check_all_protocols(cp, make_inputs(kShapes[0], layout[0], 100 + replica), label);
  }
}

// Quiet ranks: only rank 0 prints the usual gtest output; the others print
// their failures, prefixed with their rank.
class FailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit FailurePrinter(std::size_t rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    if (r.failed())
      std::fprintf(stderr, "[rank %zu] %s:%d: failure\n%s\n", rank_,
                   r.file_name() ? r.file_name() : "?", r.line_number(), r.summary());
  }

 private:
  std::size_t rank_;
};

}  // namespace
}  // namespace kdacp

int main(int argc, char** argv) {
  kdacp::MpiSession session(&argc, &argv);
  ::testing::InitGoogleTest(&argc, argv);
  const std::size_t rank = session.world_rank();
  if (rank != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new kdacp::FailurePrinter(rank));
  }
  int ok = RUN_ALL_TESTS() == 0 ? 1 : 0;
  int all_ok = 0;
  MPI_Allreduce(&ok, &all_ok, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (rank == 0) std::printf("kdacp_mpi_tests: %s on every rank\n", all_ok ? "passed" : "FAILED");
  return all_ok ? 0 : 1;
}
