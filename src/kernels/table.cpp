// The kernel table's reference entries, its one init function and the
// process's copy (table.hpp); the step's choice between them.
#include "kernels/table.hpp"

#include <hwy/targets.h>

#include <fmt/format.h>

#include "core/simulation.hpp"
#include "kdacp/error.hpp"

namespace kdacp::detail {

const KernelTable& reference_kernel_table() {
  static const KernelTable table = [] {
    KernelTable t;
    t.f32.step = step_scalar;
    t.f64.step = step_scalar_f64;
    kda::detail::install_recurrent_reference(t);
    kda::detail::install_chunk_reference(t);
    return t;
  }();
  return table;
}

KernelTable make_kernel_table() {
  KernelTable t = reference_kernel_table();
  const std::int64_t step = install_step_target(t);
  const std::int64_t recurrent = kda::detail::install_recurrent_target(t);
  const std::int64_t chunk = kda::detail::install_chunk_target(t);
  // One target set (per_target.h) for every file, so one choice; a table
  // mixing targets would still compute the same bits, but not what it names.
  if (recurrent != step || chunk != step)
    throw Error(fmt::format("kernel table: the step's target {} differs from the recurrent "
                            "kernels' {} or the chunk kernels' {}",
                            hwy::TargetName(step), hwy::TargetName(recurrent),
                            hwy::TargetName(chunk)));
  t.target = hwy::TargetName(step);
  return t;
}

const KernelTable& kernel_table() {
  static const KernelTable table = make_kernel_table();
  return table;
}

namespace {
// The shared-memory simulation's step (core/simulation.hpp): its flops, charged.
void step_charged(const float*, std::size_t, const float*, std::size_t, const float*, std::size_t,
                  float*, std::size_t, std::size_t k, std::size_t v, bool) {
  simulation_hooks().compute(2.0 * static_cast<double>(k) * static_cast<double>(k) *
                             static_cast<double>(v));
}
}  // namespace

template <>
StepFn<float> step_kernel<float>(KernelKind kind) {
  if (simulation_hooks().compute != nullptr) return step_charged;
  return (kind == KernelKind::scalar ? reference_kernel_table() : kernel_table()).f32.step;
}

template <>
StepFn<double> step_kernel<double>(KernelKind kind) {
  return (kind == KernelKind::scalar ? reference_kernel_table() : kernel_table()).f64.step;
}

const char* simd_target() { return kernel_table().target; }

}  // namespace kdacp::detail
