// Every C++ default of the algorithm, keep_forward and the timeout is
// kdacp/defaults.hpp's (tests/interop/defaults_agree.py checks the CLI and
// Python against the same constants).
#include <gtest/gtest.h>

#include "kdacp/defaults.hpp"
#include "kdacp/inprocess.hpp"
#include "kdacp/job.hpp"
#include "kdacp/kda_cp.hpp"
#include "kdacp/launch.hpp"
#include "kdacp/mesh.hpp"
#include "kdacp/report/layer_bench.hpp"

namespace kdacp {
namespace {

TEST(Defaults, TheValuesTheDocsState) {
  EXPECT_EQ(defaults::kAlgorithm, kda::Algorithm::chunk);
  EXPECT_TRUE(defaults::kKeepForward);
  EXPECT_EQ(defaults::kTimeoutSeconds, 120.0);
  EXPECT_EQ(defaults::kTimeout, std::chrono::seconds(120));
}

TEST(Defaults, EveryCppDefaultIsTheHeaders) {
  EXPECT_EQ(kda::Exec{}.algorithm, defaults::kAlgorithm);
  EXPECT_EQ(job::LayerJob<float>{}.algorithm, defaults::kAlgorithm);
  EXPECT_EQ(job::LayerJob<double>{}.keep_forward, defaults::kKeepForward);
  EXPECT_EQ(report::LayerBenchConfig{}.keep_forward, defaults::kKeepForward);
  EXPECT_EQ(report::LayerBenchConfig{}.timeout_s, defaults::kTimeoutSeconds);
  EXPECT_EQ(LaunchOptions{}.timeout_s, defaults::kTimeoutSeconds);
  EXPECT_EQ(InProcessOptions{}.timeout, defaults::kTimeout);
  InProcessWorld world(1);
  EXPECT_EQ(world.communicator(0)->timeout(), defaults::kTimeout);
  run_in_process(1, [](const std::shared_ptr<Communicator>& comm) {
    const DeviceMesh mesh = DeviceMesh::create(comm, {1}, {"cp"});
    const kda::ContextParallelLayer<float> layer(mesh, "p2p");
    EXPECT_EQ(layer.keeps_forward(), defaults::kKeepForward);
    EXPECT_EQ(layer.algorithm(), defaults::kAlgorithm);
  });
}

}  // namespace
}  // namespace kdacp
