// The chunkwise KDA kernels (kda_chunk-inl.h), compiled once per Highway
// target, and their installers for the kernel table (table.hpp).
#define KDACP_PER_TARGET_FILE "kernels/kda_chunk_hwy.cpp"
#include "kernels/per_target.h"

#include "kernels/kda_chunk-inl.h"
#include "kernels/table.hpp"

KDACP_TARGET_BEGIN;
namespace kdacp::kda::detail::HWY_NAMESPACE {

template <class T>
constexpr ChunkKernels<T> chunk_kernels_of() {
  return {&chunk_forward_head<T>, &chunk_summary_head<T>, &chunk_incoming_grad_head<T>,
          &chunk_backward_head<T>};
}

std::int64_t InstallChunk(kdacp::detail::KernelTable* table) {
  table->f32.chunk = chunk_kernels_of<float>();
  table->f64.chunk = chunk_kernels_of<double>();
  return HWY_TARGET;
}

}  // namespace kdacp::kda::detail::HWY_NAMESPACE
KDACP_TARGET_END;

#if HWY_ONCE
namespace kdacp::kda::detail {

HWY_EXPORT(InstallChunk);

std::int64_t install_chunk_target(kdacp::detail::KernelTable& table) {
  return HWY_DYNAMIC_DISPATCH(InstallChunk)(&table);
}

void install_chunk_reference(kdacp::detail::KernelTable& table) {
  HWY_STATIC_DISPATCH(InstallChunk)(&table);
}

}  // namespace kdacp::kda::detail
#endif
