// bfloat16 / float16 conversions on raw bits (kdacp/half.hpp). Integer
// arithmetic only, so the results do not depend on the FPU's rounding mode
// or on the instruction set; the loops are simple enough to vectorize.
#include "kdacp/half.hpp"

#include <bit>
#include <cmath>

namespace kdacp {

const char* half_name(Half type) { return type == Half::bf16 ? "bfloat16" : "float16"; }

std::optional<Half> parse_half(std::string_view name) {
  if (name == "bfloat16") return Half::bf16;
  if (name == "float16") return Half::f16;
  return std::nullopt;
}

float half_max(Half type) { return type == Half::bf16 ? bf16_to_float(0x7f7f) : f16_to_float(0x7bff); }

float bf16_to_float(std::uint16_t bits) { return std::bit_cast<float>(std::uint32_t{bits} << 16); }

float f16_to_float(std::uint16_t bits) {
  const std::uint32_t sign = std::uint32_t{bits & 0x8000u} << 16;
  const std::uint32_t exponent = (bits >> 10) & 0x1fu;
  const std::uint32_t mantissa = bits & 0x3ffu;
  if (exponent == 0x1f) return std::bit_cast<float>(sign | 0x7f800000u | (mantissa << 13));
  if (exponent != 0) return std::bit_cast<float>(sign | ((exponent + 112) << 23) | (mantissa << 13));
  // Zero or subnormal: mantissa · 2^−24, exact in float32.
  const float magnitude = std::ldexp(static_cast<float>(mantissa), -24);
  return std::bit_cast<float>(sign | std::bit_cast<std::uint32_t>(magnitude));
}

std::uint16_t float_to_bf16(float x) {
  std::uint32_t u = std::bit_cast<std::uint32_t>(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  u += 0x7fffu + ((u >> 16) & 1u);  // ties to even; a carry rounds up into the exponent
  return static_cast<std::uint16_t>(u >> 16);
}

namespace {

// q = m / 2^shift rounded to nearest, ties to even (1 ≤ shift ≤ 31).
std::uint32_t round_shift(std::uint32_t m, std::uint32_t shift) {
  const std::uint32_t q = m >> shift;
  const std::uint32_t rest = m & ((1u << shift) - 1u);
  const std::uint32_t half = 1u << (shift - 1);
  return q + ((rest > half || (rest == half && (q & 1u))) ? 1u : 0u);
}

}  // namespace

std::uint16_t float_to_f16(float x) {
  const std::uint32_t u = std::bit_cast<std::uint32_t>(x);
  const std::uint32_t sign = (u >> 16) & 0x8000u;
  const std::uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return 0x7e00;                           // NaN
  if (a >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // ≥ 65520 (or Inf): Inf
  const std::uint32_t exponent = a >> 23;
  if (exponent >= 113) {  // a normal float16: rebias, drop 13 mantissa bits (a carry is correct)
    const std::uint32_t h = ((exponent - 112) << 10) | ((a & 0x7fffffu) >> 13);
    const std::uint32_t rest = a & 0x1fffu;
    return static_cast<std::uint16_t>(sign | (h + ((rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ? 1u : 0u)));
  }
  // Below 2^−14: a float16 subnormal (units of 2^−24) or zero. A float32 of
  // biased exponent e is m · 2^(e−150), m with its implicit bit, so it is
  // m / 2^(126−e) units; below 2^−25 (shift > 24) it rounds to zero, and so
  // do float32 subnormals.
  if (exponent < 102) return static_cast<std::uint16_t>(sign);
  const std::uint32_t m = (a & 0x7fffffu) | 0x800000u;
  return static_cast<std::uint16_t>(sign | round_shift(m, 126 - exponent));
}

void widen(Half type, const std::uint16_t* src, std::size_t n, float* dst) {
  if (type == Half::bf16) {
    // The shift itself (bf16_to_float), written out so that it vectorizes.
    for (std::size_t i = 0; i < n; ++i) dst[i] = std::bit_cast<float>(std::uint32_t{src[i]} << 16);
  } else {
    for (std::size_t i = 0; i < n; ++i) dst[i] = f16_to_float(src[i]);
  }
}

std::optional<std::size_t> narrow(Half type, const float* src, std::size_t n, std::uint16_t* dst) {
  // The infinity pattern without the sign: 0x7F80 (bf16) / 0x7C00 (f16).
  const std::uint16_t inf = type == Half::bf16 ? 0x7f80 : 0x7c00;
  bool overflow = true;  // float16: scan for it below
  if (type == Half::bf16) {
    // float_to_bf16 without branches, so that it vectorizes; a finite input
    // overflows exactly when its rounding carries into the Inf exponent.
    std::uint32_t over = 0;
    for (std::size_t i = 0; i < n; ++i) {
      const std::uint32_t u = std::bit_cast<std::uint32_t>(src[i]);
      const std::uint32_t a = u & 0x7fffffffu;
      const std::uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
      dst[i] = static_cast<std::uint16_t>(a > 0x7f800000u ? 0x7fc0u : r);
      over |= static_cast<std::uint32_t>(a < 0x7f800000u && (r & 0x7fffu) == 0x7f80u);
    }
    overflow = over != 0;
  } else {
    for (std::size_t i = 0; i < n; ++i) dst[i] = float_to_f16(src[i]);
  }
  // Overflow is rare: one scan for an Inf result of a finite input.
  if (overflow)
    for (std::size_t i = 0; i < n; ++i)
      if ((dst[i] & 0x7fffu) == inf && std::isfinite(src[i])) return i;
  return std::nullopt;
}

}  // namespace kdacp
