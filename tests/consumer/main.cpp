// A downstream project: installs nothing of its own, uses kdacp through
// find_package and checks a 3-rank allgather against the chain by hand and
// against kdacp_testing's FP64 reference.
#include <kdacp/exchange.hpp>
#include <kdacp/inprocess.hpp>
#include <kdacp/testing/reference.hpp>

#include <cstdio>
#include <vector>

int main() {
  constexpr std::size_t P = 3, K = 16, V = 16;
  std::vector<float> got(P * K * V), want(P * K * V);
  kdacp::run_in_process(P, [&](const std::shared_ptr<kdacp::Communicator>& world) {
    const kdacp::Communicator& comm = *world;
    auto mesh = kdacp::DeviceMesh::create(world, {P}, {"cp"});
    auto ex = kdacp::make_state_exchange(mesh, "allgather");
    kdacp::State s(1, 1, K, V), m(1, 1, K, K);
    for (std::size_t i = 0; i < K * V; ++i) s.data()[i] = float(comm.rank() + 1);
    for (std::size_t i = 0; i < K; ++i) m.data()[i * K + i] = 0.5f;
    kdacp::State in = ex->forward(s.view(), m.view());
    for (std::size_t i = 0; i < K * V; ++i) got[comm.rank() * K * V + i] = in.data()[i];
  });
  // incoming_0 = 0, incoming_1 = 1, incoming_2 = 0.5*1 + 2 = 2.5
  const float expect[P] = {0.f, 1.f, 2.5f};
  for (std::size_t r = 0; r < P; ++r)
    for (std::size_t i = 0; i < K * V; ++i)
      if (got[r * K * V + i] != expect[r]) {
        std::printf("rank %zu element %zu: %g, expected %g\n", r, i, got[r * K * V + i], expect[r]);
        return 1;
      }
  std::vector<float> s(P * K * V), m(P * K * K);
  std::vector<const float*> offsets, maps;
  for (std::size_t r = 0; r < P; ++r) {
    for (std::size_t i = 0; i < K * V; ++i) s[r * K * V + i] = float(r + 1);
    for (std::size_t i = 0; i < K; ++i) m[r * K * K + i * K + i] = 0.5f;
    offsets.push_back(s.data() + r * K * V);
    maps.push_back(m.data() + r * K * K);
  }
  const auto ref = kdacp::reference::chain(offsets, maps, kdacp::SummaryShape{1, 1, K, V},
                                           kdacp::Direction::forward);
  for (std::size_t r = 0; r < P; ++r)
    if (kdacp::reference::compare(got.data() + r * K * V, ref[r]).max_abs != 0) {
      std::printf("rank %zu differs from the FP64 reference\n", r);
      return 1;
    }
  std::printf("consumer ok\n");
  return 0;
}
