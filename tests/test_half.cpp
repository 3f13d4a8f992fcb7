// bfloat16 / float16 conversions (kdacp/half.hpp) against a reference that
// shares no code with them: the 16-bit values' exact doubles, sorted, and a
// search for the nearest (ties to the even bit pattern).
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "kdacp/half.hpp"

namespace kdacp {
namespace {

// The exact value of a bf16 / f16 bit pattern, by the format's definition.
double exact_value(Half type, std::uint16_t bits) {
  const int mantissa_bits = type == Half::bf16 ? 7 : 10;
  const int exponent_bits = 15 - mantissa_bits;
  const int bias = (1 << (exponent_bits - 1)) - 1;
  const int e = (bits >> mantissa_bits) & ((1 << exponent_bits) - 1);
  const int m = bits & ((1 << mantissa_bits) - 1);
  const double sign = (bits & 0x8000) ? -1.0 : 1.0;
  if (e == (1 << exponent_bits) - 1) return m ? std::numeric_limits<double>::quiet_NaN() : sign * INFINITY;
  if (e == 0) return sign * std::ldexp(m, 1 - bias - mantissa_bits);
  return sign * std::ldexp(m + (1 << mantissa_bits), e - bias - mantissa_bits);
}

// Round x to the type by search: the finite non-negative patterns in value
// order, the nearest one (a tie goes to the even pattern); beyond the
// largest finite value plus half an ulp, Inf.
std::uint16_t reference_round(Half type, float xf) {
  const double x = xf;
  if (std::isnan(x)) return type == Half::bf16 ? 0x7fc0 : 0x7e00;
  const std::uint16_t sign = std::signbit(x) ? 0x8000 : 0;
  const double a = std::fabs(x);
  const std::uint16_t inf = type == Half::bf16 ? 0x7f80 : 0x7c00;
  const std::uint16_t max_bits = inf - 1;
  const double max = exact_value(type, max_bits);
  const double ulp = max - exact_value(type, max_bits - 1);
  if (a >= max + ulp / 2) return sign | inf;  // the tie at max + ulp/2 goes to Inf (even)
  // Finite patterns 0..max_bits increase with their value.
  std::uint16_t lo = 0, hi = max_bits;
  while (hi - lo > 1) {
    const std::uint16_t mid = static_cast<std::uint16_t>((lo + hi) / 2);
    (exact_value(type, mid) <= a ? lo : hi) = mid;
  }
  if (exact_value(type, hi) <= a) lo = hi;
  if (lo == max_bits) return sign | lo;
  const double below = a - exact_value(type, lo), above = exact_value(type, lo + 1) - a;
  if (below < above) return sign | lo;
  if (above < below) return sign | static_cast<std::uint16_t>(lo + 1);
  return sign | ((lo & 1) ? static_cast<std::uint16_t>(lo + 1) : lo);
}

class HalfTest : public ::testing::TestWithParam<Half> {};

TEST_P(HalfTest, WideningIsExactForEveryPattern) {
  const Half type = GetParam();
  std::vector<std::uint16_t> all(65536);
  for (std::uint32_t i = 0; i < 65536; ++i) all[i] = static_cast<std::uint16_t>(i);
  std::vector<float> wide(all.size());
  widen(type, all.data(), all.size(), wide.data());
  for (std::uint32_t i = 0; i < 65536; ++i) {
    const double want = exact_value(type, static_cast<std::uint16_t>(i));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(wide[i])) << std::hex << i;
      continue;
    }
    ASSERT_EQ(static_cast<double>(wide[i]), want) << std::hex << i;
    ASSERT_EQ(std::signbit(wide[i]), (i & 0x8000) != 0) << std::hex << i;
    // And back: every non-NaN pattern survives the round trip.
    std::uint16_t back = 0;
    EXPECT_FALSE(narrow(type, &wide[i], 1, &back).has_value());
    ASSERT_EQ(back, i) << std::hex << i;
  }
}

TEST_P(HalfTest, NarrowingRoundsToNearestEven) {
  const Half type = GetParam();
  std::vector<float> xs;
  // Every midpoint between neighbours and one float either side of it: the
  // cases a wrong tie rule or an off-by-one shift gets wrong.
  for (std::uint32_t i = 0; i < 0x7fff; ++i) {
    const double a = exact_value(type, static_cast<std::uint16_t>(i));
    const double b = exact_value(type, static_cast<std::uint16_t>(i + 1));
    if (!std::isfinite(a)) break;
    const double mid = std::isfinite(b) ? (a + b) / 2 : a + (a - exact_value(type, i - 1)) / 2;
    const float m = static_cast<float>(mid);
    if (static_cast<double>(m) != mid) continue;  // the midpoint is not a float (tiny f16 ones are)
    for (float x : {m, std::nextafter(m, 0.0f), std::nextafter(m, INFINITY)}) {
      xs.push_back(x);
      xs.push_back(-x);
    }
  }
  // Random bit patterns over the whole float range, subnormals included.
  std::mt19937 rng(7);
  for (int i = 0; i < 200000; ++i) xs.push_back(std::bit_cast<float>(static_cast<std::uint32_t>(rng())));
  for (float x : {0.0f, -0.0f, INFINITY, -INFINITY, std::numeric_limits<float>::max(),
                  std::numeric_limits<float>::denorm_min(), std::numeric_limits<float>::min()})
    xs.push_back(x);
  std::vector<std::uint16_t> got(xs.size());
  narrow(type, xs.data(), xs.size(), got.data());
  for (std::size_t i = 0; i < xs.size(); ++i)
    ASSERT_EQ(got[i], reference_round(type, xs[i])) << half_name(type) << " of " << xs[i] << " (bits "
                                                     << std::hex << std::bit_cast<std::uint32_t>(xs[i]) << ")";
}

TEST_P(HalfTest, NarrowReportsTheFirstFiniteValueThatOverflows) {
  const Half type = GetParam();
  const float big = type == Half::bf16 ? std::numeric_limits<float>::max() : 65520.0f;
  const float just_below = type == Half::bf16 ? 3.38953e38f : 65519.0f;
  std::vector<float> xs = {1.0f, INFINITY, just_below, NAN, -big, big};
  std::vector<std::uint16_t> out(xs.size());
  const auto first = narrow(type, xs.data(), xs.size(), out.data());
  ASSERT_TRUE(first.has_value());
  EXPECT_EQ(*first, 4u);  // Inf and NaN inputs are not overflows; the finite -big is
  EXPECT_FALSE(narrow(type, xs.data(), 4, out.data()).has_value());
  EXPECT_EQ(parse_half(half_name(type)), type);
  EXPECT_EQ(static_cast<double>(half_max(type)), type == Half::f16 ? 65504.0 : std::ldexp(255.0, 120));
}

INSTANTIATE_TEST_SUITE_P(Types, HalfTest, ::testing::Values(Half::bf16, Half::f16),
                         [](const auto& info) { return std::string(half_name(info.param)); });

}  // namespace
}  // namespace kdacp
