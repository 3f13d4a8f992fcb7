// The SIMD affine step (step-inl.h), compiled once per Highway target, and
// its installer for the kernel table (table.hpp).
#define KDACP_PER_TARGET_FILE "kernels/step_hwy.cpp"
#include "kernels/per_target.h"

#include "kernels/step-inl.h"
#include "kernels/table.hpp"

KDACP_TARGET_BEGIN;
namespace kdacp::detail::HWY_NAMESPACE {

std::int64_t InstallStep(KernelTable* table) {
  table->f32.step = &Step;
  return HWY_TARGET;
}

}  // namespace kdacp::detail::HWY_NAMESPACE
KDACP_TARGET_END;

#if HWY_ONCE
namespace kdacp::detail {

HWY_EXPORT(InstallStep);

std::int64_t install_step_target(KernelTable& table) {
  return HWY_DYNAMIC_DISPATCH(InstallStep)(&table);
}

}  // namespace kdacp::detail
#endif
