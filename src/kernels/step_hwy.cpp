// Dispatch of the SIMD affine step (step-inl.h): compiled once per target by
// Highway, the best target for this CPU chosen once per process.
#include "kernels/hwy_targets.hpp"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/step_hwy.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include "kernels/step-inl.h"
#include "kernels/step.hpp"
#include "core/simulation.hpp"

HWY_BEFORE_NAMESPACE();
namespace kdacp::detail::HWY_NAMESPACE {

// What HWY_DYNAMIC_DISPATCH picks: this target's step and name.
StepTarget ChooseStep() { return {&Step, hwy::TargetName(HWY_TARGET)}; }

}  // namespace kdacp::detail::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace kdacp::detail {

HWY_EXPORT(ChooseStep);

namespace {
const StepTarget& chosen() {
  static const StepTarget target = HWY_DYNAMIC_DISPATCH(ChooseStep)();
  return target;
}

// The folded simulation's step (core/simulation.hpp): its flops, charged.
void step_charged(const float*, std::size_t, const float*, std::size_t, const float*, std::size_t,
                  float*, std::size_t, std::size_t k, std::size_t v, bool) {
  simulation_hooks().compute(2.0 * static_cast<double>(k) * static_cast<double>(k) *
                             static_cast<double>(v));
}
}  // namespace

template <>
StepFn<float> step_kernel<float>(KernelKind kind) {
  if (simulation_hooks().compute != nullptr) return step_charged;
  return kind == KernelKind::scalar ? step_scalar : chosen().step;
}

template <>
StepFn<double> step_kernel<double>(KernelKind) {
  return step_scalar_f64;
}

const char* simd_target() { return chosen().name; }

}  // namespace kdacp::detail
#endif
