// The recurrent KDA kernels (kda_recurrent-inl.h,
// kda_recurrent_backward-inl.h), compiled once per Highway target, and their
// installers for the kernel table (table.hpp).
#define KDACP_PER_TARGET_FILE "kernels/kda_recurrent_hwy.cpp"
#include "kernels/per_target.h"

#include "kernels/kda_recurrent-inl.h"
#include "kernels/kda_recurrent_backward-inl.h"
#include "kernels/table.hpp"

KDACP_TARGET_BEGIN;
namespace kdacp::kda::detail::HWY_NAMESPACE {

template <class T>
constexpr Kernels<T> kernels_of() {
  return {&sweep<T>, &summary_head<T>, &backward_head<T>, &incoming_grad_head<T>};
}

std::int64_t InstallRecurrent(kdacp::detail::KernelTable* table) {
  table->f32.recurrent = kernels_of<float>();
  table->f64.recurrent = kernels_of<double>();
  return HWY_TARGET;
}

}  // namespace kdacp::kda::detail::HWY_NAMESPACE
KDACP_TARGET_END;

#if HWY_ONCE
namespace kdacp::kda::detail {

HWY_EXPORT(InstallRecurrent);

std::int64_t install_recurrent_target(kdacp::detail::KernelTable& table) {
  return HWY_DYNAMIC_DISPATCH(InstallRecurrent)(&table);
}

void install_recurrent_reference(kdacp::detail::KernelTable& table) {
  HWY_STATIC_DISPATCH(InstallRecurrent)(&table);
}

}  // namespace kdacp::kda::detail
#endif
