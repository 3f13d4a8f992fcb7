// libFuzzer target: calibration JSON (`kdacp calibrate` output, read by
// --calibration) must become valid cost parameters or an InvalidArgument.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>

#include "kdacp/cost_model.hpp"
#include "kdacp/error.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  try {
    const kdacp::CostParams p =
        kdacp::cost_params_from_json(std::string(reinterpret_cast<const char*>(data), size));
    // Accepted parameters are usable: positive and finite where the model divides by them.
    if (!(p.alpha_s > 0) || !(p.beta_s_per_byte > 0) || !(p.gflops > 0) || !std::isfinite(p.gflops))
      __builtin_trap();
    (void)kdacp::choose_protocol(p, kdacp::ProblemShape{8, 4, 64, 64, 4}, 0, true);
  } catch (const kdacp::Error&) {
  }
  return 0;
}
