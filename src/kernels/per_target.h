// The prologue of every file that Highway compiles once per SIMD target, and
// the bracket around per-target code: the one place that sets which targets
// kdacp compiles and how their arithmetic is compiled.
//
// A file compiled per target (a kernel table's installer, a per-target test)
// starts with
//   #define KDACP_PER_TARGET_FILE "kernels/step_hwy.cpp"  // itself, as included
//   #include "kernels/per_target.h"
// Highway requires HWY_TARGET_INCLUDE to name the file before
// hwy/foreach_target.h, which then includes that file again once per target;
// this header does both, and its include guard makes those inclusions skip
// all of it but highway.h. A -inl.h file of per-target templates includes it without the define.
// Per-target code, in either, sits between
//   KDACP_TARGET_BEGIN;
//   namespace kdacp::...::HWY_NAMESPACE { ... }
//   KDACP_TARGET_END;
// which compiles it for the target (HWY_BEFORE_NAMESPACE) with the
// compiler's contraction of a*b+c into fused multiply-adds off: the FMA
// policy (kernels/table.hpp) fuses only where the code says so, and a
// contraction would make results depend on which targets have FMA.
//
// SVE targets are excluded: their vectors are sizeless and cannot live in the
// kernels' accumulator arrays; Arm hosts use NEON.
#ifndef KDACP_KERNELS_PER_TARGET_H_
#define KDACP_KERNELS_PER_TARGET_H_

#ifndef HWY_DISABLED_TARGETS
#define HWY_DISABLED_TARGETS (HWY_SVE | HWY_SVE2 | HWY_SVE_256 | HWY_SVE2_128)
#endif

#if defined(__clang__)
// Clang's contraction pragma holds to the end of the file (every per-target
// section of it).
#define KDACP_TARGET_BEGIN \
  _Pragma("clang fp contract(off)") HWY_BEFORE_NAMESPACE()
#define KDACP_TARGET_END HWY_AFTER_NAMESPACE()
#elif defined(__GNUC__)
// g++ contracts by default even with -std=c++20 (-ffp-contract=fast; only ISO
// C turns it off). Pushed inside Highway's target options and popped before
// them, so that it ends with the section on the baseline target too, where
// HWY_BEFORE_NAMESPACE pushes nothing.
#define KDACP_TARGET_BEGIN                                              \
  HWY_BEFORE_NAMESPACE();                                               \
  _Pragma("GCC push_options") _Pragma("GCC optimize(\"fp-contract=off\")") \
      static_assert(true, "requires a trailing semicolon")
#define KDACP_TARGET_END      \
  _Pragma("GCC pop_options") \
  HWY_AFTER_NAMESPACE()
#else
#define KDACP_TARGET_BEGIN HWY_BEFORE_NAMESPACE()
#define KDACP_TARGET_END HWY_AFTER_NAMESPACE()
#endif

// Last: foreach_target.h includes the file again from here, once per target,
// and those inclusions find the macros above already defined.
#ifdef KDACP_PER_TARGET_FILE
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE KDACP_PER_TARGET_FILE
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#endif

#endif  // KDACP_KERNELS_PER_TARGET_H_

// Outside the guard: every inclusion, one per target, sets up highway.h for
// the target being compiled.
#include <hwy/highway.h>
