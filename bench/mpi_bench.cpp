// MPI benchmark, run under mpirun: each protocol's exchange time
// beside raw MPI baselines moving the same bytes, as ratios.
//
//   mpirun -np 4 kdacp_mpi_bench [--batch 1] [--heads 16] [--key-dim 128]
//                                [--value-dim 128] [--iters 30]
//
// Baselines, all measured in the same run on the same buffers:
//   gather      raw MPI_Allgather (in place) of the P packed [S|M] slots
//   igather     the same as MPI_Iallgather + MPI_Wait
//   fold        the allgather protocol's local merge alone (kdacp::merge)
//   gather+fold the two back to back: what the allgather protocol must match
// plus the kdacp MPI communicator's own all_gather of the same buffer, to
// separate the backend's overhead from the protocol's local work.
//   barrier     raw MPI_Barrier, beside the kdacp communicator's barrier (its
//               collective agreement alone: one all-reduce of 6 words) and
//               the raw header exchange it replaced (P - 1 Isend/Irecv of
//               3 words each way per rank)
//   chain       raw MPI_Recv/MPI_Send along the P-1 hops, one K×V state per head
//   chain+step  the same with each hop's local affine step (kdacp::scan)
// One sample = the slowest rank's time for one call, after a barrier; the
// table shows the median over the iterations.
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "inputs.hpp"
#include "kdacp/exchange.hpp"
#include "kdacp/kernels.hpp"
#include "kdacp/mpi.hpp"

namespace {

using namespace kdacp;

// Median over iterations of the slowest rank's seconds for fn().
double time_op(std::size_t iters, const std::function<void()>& fn) {
  std::vector<double> samples;
  fn();  // warm-up: first-touch, connection setup
  for (std::size_t i = 0; i < iters; ++i) {
    MPI_Barrier(MPI_COMM_WORLD);
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    double mine = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    double slowest = 0;
    MPI_Allreduce(&mine, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    samples.push_back(slowest);
  }
  std::sort(samples.begin(), samples.end());
  return samples[samples.size() / 2];
}

// P packed [S|M] slots laid out like the allgather protocol's gather buffer.
Slots packed_slots(float* data, const SummaryShape& sh, std::size_t p) {
  const std::size_t k = sh.key_dim, v = sh.value_dim, cols = sh.packed_cols();
  StateView off;
  off.data = data;
  off.batch = sh.batch;
  off.heads = sh.heads;
  off.rows = k;
  off.cols = v;
  off.row_stride = cols;
  off.head_stride = k * cols;
  off.batch_stride = sh.heads * k * cols;
  StateView tr = off;
  tr.data = data + v;
  tr.cols = k;
  return Slots{StackView{off, p, sh.packed_elems()}, StackView{tr, p, sh.packed_elems()}};
}

std::size_t arg(int argc, char** argv, const char* name, std::size_t fallback) {
  for (int i = 1; i + 1 < argc; ++i)
    if (std::strcmp(argv[i], name) == 0) return std::strtoull(argv[i + 1], nullptr, 10);
  return fallback;
}

}  // namespace

int main(int argc, char** argv) {
  MpiSession session(&argc, &argv);
  const SummaryShape sh{arg(argc, argv, "--batch", 1), arg(argc, argv, "--heads", 16),
                        arg(argc, argv, "--key-dim", 128), arg(argc, argv, "--value-dim", 128)};
  const std::size_t iters = arg(argc, argv, "--iters", 30);
  auto world = mpi_world();
  const std::size_t p = world->size(), r = world->rank();
  const DeviceMesh mesh = DeviceMesh::create(world, {p}, {"cp"});
  const mpitest::Inputs in = mpitest::make_inputs(sh, p, 42);
  const StateView s = in.s[r].view(), m = in.m[r].view();

  // Raw collective baseline on a buffer shaped like the protocol's.
  Buffer gathered(p * sh.packed_elems() * sizeof(float));
  const Slots slots = packed_slots(gathered.as<float>(), sh, p);
  for (std::size_t slab = 0; slab < sh.slabs(); ++slab)
    for (std::size_t i = 0; i < sh.key_dim; ++i) {
      std::memcpy(slots.offsets.slot(r).slab(slab) + i * sh.packed_cols(),
                  s.slab(slab) + i * sh.value_dim, sh.value_dim * sizeof(float));
      std::memcpy(slots.transfers.slot(r).slab(slab) + i * sh.packed_cols(),
                  m.slab(slab) + i * sh.key_dim, sh.key_dim * sizeof(float));
    }
  const int slot_bytes = static_cast<int>(sh.packed_elems() * sizeof(float));
  State out(sh.batch, sh.heads, sh.key_dim, sh.value_dim);
  auto gather = [&] {
    MPI_Allgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, gathered.data(), slot_bytes, MPI_BYTE,
                  MPI_COMM_WORLD);
  };
  // The non-blocking form the kdacp communicator uses (so that its waits can
  // be bounded): Open MPI serves it from a different component (libnbc).
  auto igather = [&] {
    MPI_Request req = MPI_REQUEST_NULL;
    MPI_Iallgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, gathered.data(), slot_bytes, MPI_BYTE,
                   MPI_COMM_WORLD, &req);
    MPI_Wait(&req, MPI_STATUS_IGNORE);
  };
  auto fold = [&] {
    merge(slots, r, Direction::forward, out.view(), {}, FoldFlags::consume_offsets);
  };
  // Raw chain: the same P-1 messages as p2p, with and without the hop's step.
  State incoming(sh.batch, sh.heads, sh.key_dim, sh.value_dim);
  State next(sh.batch, sh.heads, sh.key_dim, sh.value_dim);
  const int state_bytes = static_cast<int>(incoming.bytes());
  const Slots own{StackView{s, 1, 0}, StackView{m, 1, 0}};
  auto chain = [&](bool step) {
    const int me = static_cast<int>(r);
    if (r > 0)
      MPI_Recv(incoming.data(), state_bytes, MPI_BYTE, me - 1, 7, MPI_COMM_WORLD,
               MPI_STATUS_IGNORE);
    if (r + 1 < p) {
      const void* payload = s.data;
      if (r > 0 && step) {
        const StateView inc = incoming.view();
        scan(own, 0, 1, Direction::forward, &inc, next.view(), std::nullopt, nullptr);
        payload = next.data();
      } else if (r > 0) {
        payload = incoming.data();
      }
      MPI_Send(payload, state_bytes, MPI_BYTE, me + 1, 7, MPI_COMM_WORLD);
    }
  };

  const double t_gather = time_op(iters, gather);
  const double t_igather = time_op(iters, igather);
  const std::span<std::byte> gathered_bytes(reinterpret_cast<std::byte*>(gathered.data()),
                                            gathered.bytes());
  const double t_comm_gather = time_op(iters, [&] { world->all_gather(gathered_bytes); });
  auto header_exchange = [&] {
    std::uint64_t mine[3] = {1, 2, 3};
    std::vector<std::uint64_t> theirs(3 * p);
    std::vector<MPI_Request> reqs;
    for (std::size_t q = 0; q < p; ++q) {
      if (q == r) continue;
      reqs.emplace_back();
      MPI_Irecv(theirs.data() + 3 * q, 3, MPI_UINT64_T, static_cast<int>(q), 9, MPI_COMM_WORLD, &reqs.back());
      reqs.emplace_back();
      MPI_Isend(mine, 3, MPI_UINT64_T, static_cast<int>(q), 9, MPI_COMM_WORLD, &reqs.back());
    }
    MPI_Waitall(static_cast<int>(reqs.size()), reqs.data(), MPI_STATUSES_IGNORE);
  };
  const double t_barrier = time_op(iters, [] { MPI_Barrier(MPI_COMM_WORLD); });
  const double t_comm_barrier = time_op(iters, [&] { world->barrier(); });
  const double t_headers = time_op(iters, header_exchange);
  const double t_fold = time_op(iters, fold);
  const double t_gather_fold = time_op(iters, [&] { gather(); fold(); });
  const double t_chain = time_op(iters, [&] { chain(false); });
  const double t_chain_step = time_op(iters, [&] { chain(true); });

  struct Row {
    std::string name;
    double fwd, bwd;
  };
  std::vector<Row> rows;
  for (const ProtocolDescriptor* row : protocol_registry()) {
    if (row->chooser()) continue;  // auto is one of the rows below
    const std::string method(row->name);
    std::vector<std::size_t> widths = {1};
    if (row->takes_group_size) {
      widths.clear();
      for (std::size_t w = 2; w < p; ++w)
        if (p % w == 0) widths.push_back(w);
    }
    for (std::size_t w : widths) {
      auto ex = make_state_exchange(mesh, method, static_cast<long long>(w));
      const double f = time_op(iters, [&] { (void)ex->forward(s, m); });
      const double b = time_op(iters, [&] { (void)ex->backward(in.g[r].view(), m); });
      rows.push_back({protocol_label({method, w, 0}), f, b});
    }
  }

  if (r == 0) {
    std::printf("kdacp MPI benchmark: P=%zu B=%zu H=%zu K=%zu V=%zu, median of %zu, slowest rank\n",
                p, sh.batch, sh.heads, sh.key_dim, sh.value_dim, iters);
    std::printf("  packed slot %.2f MiB, state %.2f MiB\n", slot_bytes / 1048576.0,
                state_bytes / 1048576.0);
    std::printf("communicator all_gather %.3f ms = %.3f x raw gather (size agreement + "
                "bounded polling)\n", t_comm_gather * 1e3, t_comm_gather / t_gather);
    std::printf("communicator barrier %.3f ms = %.3f x raw MPI_Barrier %.3f ms; raw P-1 header exchange "
                "%.3f ms\n", t_comm_barrier * 1e3, t_comm_barrier / t_barrier, t_barrier * 1e3, t_headers * 1e3);
    std::printf("baselines (ms): gather %.3f  igather %.3f  fold %.3f  gather+fold %.3f  "
                "chain %.3f  chain+step %.3f\n",
                t_gather * 1e3, t_igather * 1e3, t_fold * 1e3, t_gather_fold * 1e3, t_chain * 1e3,
                t_chain_step * 1e3);
    std::printf("%-26s %10s %10s %14s %14s %12s\n", "protocol", "fwd ms", "bwd ms",
                "fwd/(gath+fold)", "fwd/(chain+st)", "fwd/gather");
    for (const Row& row : rows)
      std::printf("%-26s %10.3f %10.3f %14.3f %14.3f %12.3f\n", row.name.c_str(), row.fwd * 1e3,
                  row.bwd * 1e3, row.fwd / t_gather_fold, row.fwd / t_chain_step,
                  row.fwd / t_gather);
  }
  world.reset();
  return 0;
}
