// kdacp's NVLink + InfiniBand cluster for SimGrid (docs/scale.md): 512 nodes
// of 8 ranks (8 GPUs), 4096 ranks, the nodes joined by a two-level fat tree.
// Built as platforms/nvlink-ib.so (CMake target kdacp_platform_nvlink_ib);
// smpirun -platform loads it and calls load_platform(). It is C++ rather
// than XML: an XML cluster cannot nest the nodes' NVLink switches in a fat
// tree.
//
// Hosts are ranks: "rank-<r>", one core each; node n holds ranks 8n..8n+7
// in a star zone of its own, and is one leaf of the fat tree
// (scripts/simulate.py writes the hostfile). Where the numbers come from:
// - Each rank's NVLink port, a split-duplex link to the node's switch (the
//   star's centre): 370 GB/s per direction, NVLink 4 through NVSwitch
//   (450 GB/s per GPU and direction on paper, ~370 GB/s measured by NCCL's
//   bus-bandwidth tests on H100 SXM nodes); 1.5 us, so that a small message
//   between two GPUs of a node takes 3 us (NCCL / CUDA IPC, 2-4 us).
// - Each rank's NIC (one per GPU, as in DGX H100 and rail designs): a
//   400 Gb/s NDR InfiniBand port (50 GB/s raw, 45 GB/s at ~90 % efficiency),
//   a split-duplex link between the rank and the node's gateway into the
//   tree (on PCIe, not through NVLink), 1.5 us like the NVLink port. A flow
//   that leaves or enters the node goes through its own rank's NIC: one flow
//   gets 45 GB/s and eight get 45 each, as an MPI or NCCL point-to-point
//   transfer between two GPUs does (one rail), which the cost model prices.
//   The first version joined the 8 NICs into one 360 GB/s link shared by
//   the node: a lone flow then ran at up to 360 GB/s (the chain at P = 1024
//   simulated 0.70x the model), and recursive doubling's boundary messages
//   (rank 7 to rank 8 in round 1) hid in it (docs/scale.md).
// - The fat tree: 16 nodes per leaf switch, 32 leaves per spine, each leaf
//   wired to 8 spines; every link 360 GB/s, shared by the flows crossing it.
//   A leaf has 16 links down and 8 up: 2:1 oversubscription, the usual cost
//   cut of large training clusters (1:1 ideal, 2:1 to 4:1 common beyond a
//   few hundred nodes). 0.5 us per link: with the two NVLink hops, four
//   tree links (node, leaf, spine, leaf, node) and the two NICs make the
//   ~5 us of a small message between nodes across the spine (GPUDirect RDMA
//   over NDR: 3-6 us), 4 us under one leaf.
// - 40 TFLOP/s per rank: a GPU-class rank, the cost model's default
//   (kdacp/cost_model.hpp); scripts/simulate.py sets smpi/host-speed to this
//   host's measured fold speed so that a burst measured here is simulated as
//   the same flops at 40 TFLOP/s.
#include <simgrid/s4u.hpp>

#include <string>
#include <utility>
#include <vector>

namespace sg4 = simgrid::s4u;

namespace {

constexpr int kNodes = 512;
constexpr int kRanksPerNode = 8;
constexpr double kRankFlops = 40e12;
constexpr double kNvlinkBw = 370e9, kNvlinkLat = 1.5e-6;
constexpr double kNicBw = 45e9, kNicLat = 1.5e-6;  // per rank
constexpr double kTreeBw = kRanksPerNode * kNicBw, kTreeLat = 0.5e-6;

// Node `id`: its ranks around an NVSwitch, their NICs, and the gateway to
// the tree. A full zone: every route is stated (rank to rank through their
// two NVLink ports, rank to gateway through its NIC).
std::pair<simgrid::kernel::routing::NetPoint*, simgrid::kernel::routing::NetPoint*> make_node(
    const sg4::NetZone* tree, unsigned long id) {
  const std::string name = "node-" + std::to_string(id);
  sg4::NetZone* node = sg4::create_full_zone(name);
  node->set_parent(tree);
  simgrid::kernel::routing::NetPoint* gateway = node->create_router(name + "-gateway");
  std::vector<simgrid::kernel::routing::NetPoint*> hosts;
  std::vector<const sg4::Link*> ports;
  for (int r = 0; r < kRanksPerNode; ++r) {
    const std::string rank = std::to_string(id * kRanksPerNode + static_cast<unsigned long>(r));
    hosts.push_back(node->create_host("rank-" + rank, kRankFlops)->seal()->get_netpoint());
    ports.push_back(node->create_split_duplex_link("nvlink-" + rank, kNvlinkBw)->set_latency(kNvlinkLat)->seal());
    const sg4::Link* nic = node->create_split_duplex_link("nic-" + rank, kNicBw)->set_latency(kNicLat)->seal();
    node->add_route(hosts.back(), gateway, nullptr, nullptr, {sg4::LinkInRoute(nic, sg4::LinkInRoute::Direction::UP)},
                    true);
  }
  for (int a = 0; a < kRanksPerNode; ++a)
    for (int b = a + 1; b < kRanksPerNode; ++b)
      node->add_route(hosts[a], hosts[b], nullptr, nullptr,
                      {sg4::LinkInRoute(ports[a], sg4::LinkInRoute::Direction::UP),
                       sg4::LinkInRoute(ports[b], sg4::LinkInRoute::Direction::DOWN)},
                      true);
  node->seal();
  return {node->get_netpoint(), gateway};
}

}  // namespace

extern "C" void load_platform(const sg4::Engine& /*engine*/) {
  const sg4::ClusterCallbacks callbacks(
      [](sg4::NetZone* tree, const std::vector<unsigned long>& /*coord*/, unsigned long id) {
        return make_node(tree, id);
      });
  // levels; nodes per leaf, leaves per spine; parents per node, spines per
  // leaf; parallel links at each level.
  const sg4::FatTreeParams params(2, {16, 32}, {1, 8}, {1, 1});
  static_assert(16 * 32 == kNodes);
  sg4::NetZone* tree = sg4::create_fatTree_zone("nvlink-ib", nullptr, params, callbacks, kTreeBw, kTreeLat,
                                                sg4::Link::SharingPolicy::SPLITDUPLEX);
  tree->seal();
}
