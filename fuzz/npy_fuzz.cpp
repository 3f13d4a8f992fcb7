// libFuzzer target: the .npy reader must turn any byte string into an array or
// an IoError, never a crash, a huge allocation or a read out of bounds.
#include <cstddef>
#include <cstdint>
#include <span>

#include "kdacp/error.hpp"
#include "kdacp/npy.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  try {
    const kdacp::NpyArray arr =
        kdacp::parse_npy(std::as_bytes(std::span(data, size)), "fuzz.npy");
    // A parsed array is consistent: its data is exactly its shape's bytes.
    if (arr.data.size() != arr.elements() * kdacp::dtype_size(arr.dtype)) __builtin_trap();
    (void)arr.to_f32(true);
  } catch (const kdacp::Error&) {
  }
  return 0;
}
