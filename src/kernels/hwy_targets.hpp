// The one place that sets which Highway targets kdacp compiles. Every file
// that includes hwy/foreach_target.h includes this first, so that every
// module (and every test of one) has the same target set.
//
// SVE targets are excluded: their vectors are sizeless and cannot live in the
// kernels' accumulator arrays; Arm hosts use NEON.
#pragma once

#ifndef HWY_DISABLED_TARGETS
#define HWY_DISABLED_TARGETS (HWY_SVE | HWY_SVE2 | HWY_SVE_256 | HWY_SVE2_128)
#endif
