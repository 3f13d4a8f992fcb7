// The one parser behind every numeric flag (kdacp/units.hpp), the input
// checks (kdacp/finite.hpp), memory admission (kdacp/admission.hpp) and
// staged outputs (kdacp/output.hpp).
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>

#include <gtest/gtest.h>

#include "kdacp/admission.hpp"
#include "kdacp/error.hpp"
#include "kdacp/finite.hpp"
#include "kdacp/output.hpp"
#include "kdacp/units.hpp"

namespace kdacp {
namespace {

namespace fs = std::filesystem;

TEST(CliFlags, IntegersNeverWrap) {
  const IntRange dims{16, 256, 16};
  EXPECT_EQ(parse_integer("128", dims, "--key-dim"), 128u);
  for (const char* bad : {"-16", "17", "0", "272", "1e2", "0x10", "", " 16", "16 ", "+16", "99999999999999999999999"})
    EXPECT_THROW(parse_integer(bad, dims, "--key-dim"), InvalidArgument) << bad;
  EXPECT_EQ(parse_integer("18446744073709551615", IntRange{}, "--seed"), std::numeric_limits<std::uint64_t>::max());
  try {
    parse_integer("-16", dims, "--key-dim");
  } catch (const InvalidArgument& e) {
    EXPECT_STREQ(e.what(), "--key-dim is '-16', expected an integer in [16, 256] that is a multiple of 16");
  }
}

TEST(CliFlags, RealsAreFiniteAndInRange) {
  const RealRange positive{0, std::numeric_limits<double>::max(), true};
  EXPECT_DOUBLE_EQ(parse_real("0.125", positive, "--scale"), 0.125);
  for (const char* bad : {"0", "-1", "nan", "inf", "-inf", "1e999", "1x", "", "abc"})
    EXPECT_THROW(parse_real(bad, positive, "--scale"), InvalidArgument) << bad;
  EXPECT_DOUBLE_EQ(parse_real("86400", kTimeoutRange, "--timeout"), 86400);
  for (const char* bad : {"86401", "1e10", "1e300", "nan", "0"})
    EXPECT_THROW(parse_real(bad, kTimeoutRange, "--timeout"), InvalidArgument) << bad;
}

TEST(CliFlags, QuantitiesWithUnits) {
  EXPECT_DOUBLE_EQ(parse_seconds("5us", "--alpha"), 5e-6);
  EXPECT_DOUBLE_EQ(parse_rate("50GB/s", "--bandwidth"), 50e9);
  EXPECT_EQ(parse_bytes("2GiB", "--memory-budget"), std::size_t{2} << 30);
  EXPECT_EQ(parse_bytes("1.5KiB", "--memory-budget"), 1536u);
  // A fraction of a byte would truncate to 0, the "unlimited" budget (found by fuzz/units_fuzz.cpp).
  for (const char* bad : {"1e30GiB", "-1GiB", "0", "nanMiB", "5parsecs", "1e400", ".81", "0.5B"})
    EXPECT_THROW(parse_bytes(bad, "--memory-budget"), InvalidArgument) << bad;
  EXPECT_THROW(parse_seconds("inf", "--alpha"), InvalidArgument);
  EXPECT_THROW(parse_rate("-5GB/s", "--bandwidth"), InvalidArgument);
}

TEST(CliFlags, FindsTheFirstNonFiniteValue) {
  const std::vector<float> v{1.f, 2.f, NAN, INFINITY};
  EXPECT_EQ(find_non_finite(std::span<const float>(v)), std::optional<std::size_t>(2));
  const std::vector<double> ok{0.0, -1.0};
  EXPECT_EQ(find_non_finite(std::span<const double>(ok)), std::nullopt);
  EXPECT_EQ(find_outside(std::span<const double>(ok), -0.5, 1.0), std::optional<std::size_t>(1));
  EXPECT_EQ(index_string(7, {2, 2, 2}), "[1,1,1]");
  NpyArray a;
  a.shape = {2, 2};
  const std::vector<float> data{0.f, 0.5f, -INFINITY, 0.f};
  a.data.resize(sizeof(float) * data.size());
  std::memcpy(a.data.data(), data.data(), a.data.size());
  EXPECT_THROW(require_finite(a, "S.npy"), InvalidArgument);
  try {
    require_finite(a, "S.npy");
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("S.npy: element [1,0] is -inf"), std::string::npos) << e.what();
  }
}

TEST(CliFlags, MemoryAdmission) {
  EXPECT_GT(available_memory_bytes(), 0u);
  EXPECT_NO_THROW(require_memory(1024, 1024, "x", "--max-memory"));
  EXPECT_THROW(require_memory(1025, 1024, "x", "--max-memory"), OutOfMemory);
  const ProblemShape shape{4096, 1, 16, 16, 4};
  const Prediction ag = predict_exchange(shape, "allgather", 1, ExchangeOptions{});
  // allgather holds every rank's S and M: 4096 · (16·16 + 16·16) floats.
  EXPECT_GE(exchange_rank_bytes(shape, ag), 4096.0 * 512 * 4);
  EXPECT_THROW(predict_exchange(shape, "ring", 1, ExchangeOptions{}), InvalidArgument);
}

TEST(CliOutput, AppearsOnlyOnCommitAndRemovesStaleFiles) {
  const fs::path dir = fs::temp_directory_path() / ("kdacp_output_test_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  {
    StagedOutput out(dir.string(), {"a.npy", "b.npy"});
    std::ofstream(out.path("a.npy")) << "partial";
  }
  EXPECT_FALSE(fs::exists(dir)) << "an uncommitted output leaves nothing behind";
  fs::create_directories(dir);
  std::ofstream(dir / "b.npy") << "old run";
  std::ofstream(dir / "keep.txt") << "not ours";
  {
    StagedOutput out(dir.string(), {"a.npy", "b.npy"});
    std::ofstream(out.path("a.npy")) << "new";
    out.commit();
  }
  EXPECT_TRUE(fs::exists(dir / "a.npy"));
  EXPECT_FALSE(fs::exists(dir / "b.npy")) << "an earlier run's output this run did not write";
  EXPECT_TRUE(fs::exists(dir / "keep.txt"));
  EXPECT_EQ(std::distance(fs::directory_iterator(dir), fs::directory_iterator{}), 2);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace kdacp
