// 16-bit floating-point storage: bfloat16 and IEEE binary16 (float16), the
// types flash-linear-attention trains in. kdacp computes in float32 and
// stores in these types at the edges: a 16-bit value is widened exactly
// (every 16-bit value is a float32 value), by the kernels as they load it
// (HalfField) or into a widened copy, and a float32 result is narrowed
// once, rounding to nearest, ties to even, as PyTorch and NumPy do.
//
// The values are raw bits (std::uint16_t), so no compiler support for
// _Float16 or __bf16 is needed and every target gives the same bits.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

namespace kdacp {

enum class Half : std::uint8_t { bf16, f16 };

// "bfloat16" / "float16".
const char* half_name(Half type);
// Parses half_name's spelling; nullopt for anything else.
std::optional<Half> parse_half(std::string_view name);

// The largest finite value: 65504 (float16), 2^127·(2 − 2^−7) (bfloat16).
float half_max(Half type);

// Exact widening of one value (NaN stays NaN, ±Inf stays ±Inf).
float bf16_to_float(std::uint16_t bits);
float f16_to_float(std::uint16_t bits);

// Round to nearest, ties to even. Beyond the type's range a finite value
// becomes ±Inf (float16: |x| ≥ 65520; bfloat16: |x| ≥ 2^128·(1 − 2^−9));
// NaN becomes the quiet NaN 0x7FC0 (bf16) / 0x7E00 (f16) with x's sign
// dropped, as PyTorch does.
std::uint16_t float_to_bf16(float x);
std::uint16_t float_to_f16(float x);

// dst[i] = widened src[i], for i < n.
void widen(Half type, const std::uint16_t* src, std::size_t n, float* dst);

// A tensor stored as 16-bit, read in place (null bits: not stored so).
struct HalfField {
  const std::uint16_t* bits = nullptr;
  Half type = Half::bf16;

  // Element i widened; n elements from element i into dst (the same values
  // as widen's: bfloat16 inline, float16 through widen).
  float at(std::size_t i) const {
    return type == Half::bf16 ? std::bit_cast<float>(std::uint32_t{bits[i]} << 16) : f16_to_float(bits[i]);
  }
  void load(std::size_t i, std::size_t n, float* dst) const {
    if (type != Half::bf16) return widen(type, bits + i, n, dst);
    for (std::size_t j = 0; j < n; ++j) dst[j] = std::bit_cast<float>(std::uint32_t{bits[i + j]} << 16);
  }
};

// dst[i] = narrowed src[i], for i < n. Returns the index of the first
// element whose input is finite but whose result is ±Inf (it overflowed the
// 16-bit type), or nullopt; every element is written either way.
std::optional<std::size_t> narrow(Half type, const float* src, std::size_t n, std::uint16_t* dst);

}  // namespace kdacp
