// libFuzzer target: the parser every numeric command-line flag goes through
// (kdacp/units.hpp). The first byte picks the parser and the range; the rest
// is the flag's text. Accepted values must lie in the promised range; bad
// text must be an InvalidArgument, never a wrap, an overflow or a crash.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "kdacp/error.hpp"
#include "kdacp/units.hpp"

namespace {

constexpr kdacp::IntRange kIntRanges[] = {
    {16, 256, 16}, {1, 4096, 1}, {0, 1024, 1}, {1, UINT64_MAX, 1}, {0, UINT64_MAX, 7}};
constexpr kdacp::RealRange kRealRanges[] = {
    {0, 1e300, true}, kdacp::kTimeoutRange, {-1, 1, false}};

void check(bool ok) {
  if (!ok) __builtin_trap();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const std::uint8_t pick = data[0];
  const std::string_view text(reinterpret_cast<const char*>(data + 1), size - 1);
  try {
    switch (pick % 5) {
      case 0: {
        const kdacp::IntRange& r = kIntRanges[(pick / 5) % std::size(kIntRanges)];
        const std::uint64_t v = kdacp::parse_integer(text, r, "--int");
        check(v >= r.min && v <= r.max && v % r.multiple == 0);
        break;
      }
      case 1: {
        const kdacp::RealRange& r = kRealRanges[(pick / 5) % std::size(kRealRanges)];
        const double v = kdacp::parse_real(text, r, "--real");
        check(std::isfinite(v) && v <= r.max && (r.min_exclusive ? v > r.min : v >= r.min));
        break;
      }
      case 2: {
        const double v = kdacp::parse_seconds(text, "--alpha");
        check(std::isfinite(v) && v > 0);
        break;
      }
      case 3: {
        const double v = kdacp::parse_rate(text, "--bandwidth");
        check(std::isfinite(v) && v > 0);
        break;
      }
      default: {
        const std::size_t v = kdacp::parse_bytes(text, "--memory-budget");
        check(v > 0);
        break;
      }
    }
  } catch (const kdacp::Error&) {
  }
  return 0;
}
