// The .npy reader against hostile files: every malformed file is an IoError
// naming what is wrong, decided from the header and the file's size before
// any large allocation. The files are the fuzz regression inputs
// (fuzz/regressions/npy), so a crash the fuzzer finds stays tested here too.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "kdacp/error.hpp"
#include "kdacp/npy.hpp"

namespace kdacp {
namespace {

const std::filesystem::path kRegressions =
    std::filesystem::path(KDACP_SOURCE_DIR) / "fuzz" / "regressions" / "npy";

std::string error_of(const std::filesystem::path& file) {
  try {
    (void)read_npy(file.string());
  } catch (const IoError& e) {
    return e.what();
  }
  return "";
}

TEST(Npy, HostileFilesAreClearErrors) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"claims_4gib.npy", "needs 4294967296 bytes, the file holds 64"},
      {"negative_dim.npy", "shape entry '-2' is not a non-negative integer"},
      {"overflow_dims.npy", "is too large"},
      {"huge_dim_text.npy", "is not a non-negative integer"},
      {"trailing_bytes.npy", "4 bytes after the data of shape (2,)"},
      {"unterminated_shape.npy", "is not a tuple"},
      {"bad_version.npy", "format version 7.0"},
      {"header_len_past_end.npy", "truncated header"},
  };
  for (const auto& [file, fragment] : cases) {
    const std::string what = error_of(kRegressions / file);
    EXPECT_NE(what.find(fragment), std::string::npos) << file << ": " << what;
    EXPECT_NE(what.find(file), std::string::npos) << file << ": " << what;
  }
}

TEST(Npy, ZeroSizedArraysRoundTrip) {
  const NpyArray arr = read_npy((kRegressions / "zero_dim.npy").string());
  EXPECT_EQ(arr.shape, (std::vector<std::size_t>{0, 16}));
  EXPECT_EQ(arr.elements(), 0u);
  EXPECT_TRUE(arr.to_f32(false).empty());
  const auto dir = std::filesystem::temp_directory_path() / "kdacp_npy_test";
  std::filesystem::create_directories(dir);
  const std::string path = (dir / "empty.npy").string();
  write_npy(path, static_cast<const float*>(nullptr), {3, 0});
  EXPECT_EQ(read_npy(path).shape, (std::vector<std::size_t>{3, 0}));
  std::filesystem::remove_all(dir);
}

TEST(Npy, WrittenFilesReadBackBitForBit) {
  const auto dir = std::filesystem::temp_directory_path() / "kdacp_npy_roundtrip";
  std::filesystem::create_directories(dir);
  const std::vector<double> d = {1.0, -0.0, 3.25, 1e-300, std::nan("")};
  write_npy((dir / "d.npy").string(), d.data(), {5});
  const NpyArray back = read_npy((dir / "d.npy").string());
  ASSERT_EQ(back.dtype, DType::f64);
  ASSERT_EQ(back.data.size(), sizeof(double) * d.size());
  EXPECT_EQ(std::memcmp(back.data.data(), d.data(), back.data.size()), 0);
  EXPECT_THROW((void)back.to_f32(false), IoError);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace kdacp
