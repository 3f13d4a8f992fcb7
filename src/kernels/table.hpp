// The kernel table: every compute kernel of kdacp — the affine step of the
// exchange's folds, the recurrent KDA kernels, the chunkwise KDA kernels —
// reached through one struct, BLIS-style. The reference entries are
// installed first; then, in one init function (make_kernel_table), the
// entries of the Highway target Highway's dispatch picks for this CPU
// override them. Each kernel has one signature for its reference and every
// target (StepFn, kda::detail::Kernels, kda::detail::ChunkKernels), and an
// entry a target does not provide keeps the reference's (the step in
// double).
//
// The library is built without -march flags, which would leave every loop
// at the baseline instruction set (SSE2 on x86-64): Highway compiles each
// kernel once per target (per_target.h says which), and the table takes the
// best one the CPU supports.
//
// The reference entries: step_scalar (plain loops) for the step; for the KDA
// kernels, their per-target source compiled for the baseline target
// (HWY_STATIC_TARGET: no instruction set beyond the compiler's default).
// Every target's entries give the same bits as the reference's; the tests
// run every compiled target through make_kernel_table and compare
// (test_kernels_targets.cpp, test_kda_dispatch.cpp, test_kda_chunk.cpp).
//
// The FMA policy, for every kernel in the table:
//   - Fused: each multiply-add of a matrix product's accumulation chain,
//     acc = fma(a_k, b_k, acc) for k in order from acc = S (the step,
//     step-inl.h) or acc = 0 (the chunk kernels' tile GEMM, gemm-inl.h), and
//     the Horner steps of exp_vec — always through fused_mul_add
//     (simd-inl.h), which rounds once on every target: the hardware FMA where
//     the target has one (HWY_NATIVE_FMA), std::fma per lane where it does
//     not. So every target equals the reference (std::fma) bit for bit, on
//     CPUs with and without FMA; the price, on CPUs without (x86 before
//     Haswell), is a library fma per lane: the step tens of times slower.
//     Fused, a term is one instruction and one rounding instead of two.
//   - Not fused: everything else — element-wise updates, the recurrent
//     kernels' row and rank-1 updates and their partial-sum dots, lane_dot:
//     each product is rounded, then added. The recurrent kernels stay so
//     because fusing them would change every recurrent output's bits.
//   - The compiler fuses nothing on its own: contraction is off in every
//     per-target section (KDACP_TARGET_BEGIN, per_target.h); it would fuse
//     on the targets with FMA and not on the others.
// The exact exchange protocols and the chain fold with the same step entry,
// so they agree bit for bit under any policy followed by that entry.
#pragma once

#include <cstdint>
#include <type_traits>

#include "kernels/kda_chunk.hpp"
#include "kernels/kda_heads.hpp"
#include "kernels/step.hpp"

namespace kdacp::detail {

// The entries for one element type.
template <class T>
struct KernelSet {
  StepFn<T> step = nullptr;
  kda::detail::Kernels<T> recurrent{};
  kda::detail::ChunkKernels<T> chunk{};
};

struct KernelTable {
  // Whose entries override the reference: a Highway target's name, or
  // "reference" for the reference alone.
  const char* target = "reference";
  KernelSet<float> f32;
  KernelSet<double> f64;

  template <class T>
  const KernelSet<T>& of() const {
    if constexpr (std::is_same_v<T, float>) {
      return f32;
    } else {
      return f64;
    }
  }
};

// The reference entries alone.
const KernelTable& reference_kernel_table();

// The one init function: the reference entries, overridden by those of the
// target Highway's dispatch picks now. Not cached: the tests narrow the
// targets with hwy::SetSupportedTargetsForTest and call it once per target.
KernelTable make_kernel_table();

// make_kernel_table's result, made once per process (thread-safe): every
// call of every kernel in the process runs the same code.
const KernelTable& kernel_table();

// The per-target halves of make_kernel_table, one per file compiled per
// target: each installs its kernels of the target Highway's dispatch picks
// (step_hwy.cpp, kda_recurrent_hwy.cpp, kda_chunk_hwy.cpp) and returns that
// target (HWY_TARGET); the reference installers install the baseline
// target's KDA kernels.
std::int64_t install_step_target(KernelTable& table);

}  // namespace kdacp::detail

namespace kdacp::kda::detail {
std::int64_t install_recurrent_target(kdacp::detail::KernelTable& table);
std::int64_t install_chunk_target(kdacp::detail::KernelTable& table);
void install_recurrent_reference(kdacp::detail::KernelTable& table);
void install_chunk_reference(kdacp::detail::KernelTable& table);
}  // namespace kdacp::kda::detail
