// The library's defaults, defined once: C++ (kda.hpp, kda_cp.hpp, job.hpp,
// launch.hpp, inprocess.hpp, mpi.hpp), the CLI (its --help shows them) and
// Python (kdacp.defaults(), read by kdacp.torch) all take them from here.
// tests/interop/defaults_agree.py fails when any of the three differs.
#pragma once

#include <chrono>

namespace kdacp {

namespace kda {

// How the KDA math computes (SPEC §9). Both give the same results up to
// rounding (tests: ≤ 1e-10 relative in double, 5e-5 in float); each is
// bitwise independent of the thread count and the SIMD target.
//  - recurrent: token by token, rank-1 updates of the K×V state (the reference).
//  - chunk: chunkwise WY/UT form (flash-linear-attention's `chunk_kda`): per
//    chunk of kChunkSize tokens a triangular solve and dense C×K, C×C, K×V products;
//    only one state per chunk crosses chunk boundaries. Every function of
//    kda.hpp has both (see docs/performance.md for their speed).
// Chosen per call by kda::Exec::algorithm (kdacp/kernels.hpp).
enum class Algorithm { recurrent, chunk };

}  // namespace kda

namespace defaults {

// chunk: 1.5–1.8× faster than recurrent (docs/performance.md), the same
// results up to rounding.
inline constexpr kda::Algorithm kAlgorithm = kda::Algorithm::chunk;

// On: with chunk, the layer's forward keeps what its backward would
// recompute (kda::ForwardCache, about 1.25× the inputs' memory at K = V =
// 128) and the backward skips that pass (a quarter of its time). A layer is
// trained, forward then backward, far more often than it runs forward alone,
// and the bits are the same either way; a caller short of memory, or one
// that runs only the forward, turns it off (ContextParallelLayer::
// keep_forward(false), the CLI's --recompute, kdacp.torch's
// keep_forward=False).
inline constexpr bool kKeepForward = true;

// Off: the layer's exchange composes each rank's summary (fast, the bits
// depend on P and the layout). On (LayerConfig::deterministic, the CLI's
// --deterministic, kdacp.torch's deterministic=True): the state walks from
// rank to rank in chain order, every output the same bytes for every CP
// degree, layout and protocol (docs/determinism.md has the rule and cost).
inline constexpr bool kDeterministic = false;

// How long any rank waits for a peer before failing the job (the
// communicators' bound on every blocking wait; under mpirun also MPI
// start-up). A peer may be computing its own part before it sends: at the
// CLI's largest jobs that is tens of seconds, so the bound leaves a margin.
inline constexpr std::chrono::milliseconds kTimeout{120000};
inline constexpr double kTimeoutSeconds = static_cast<double>(kTimeout.count()) / 1000;

}  // namespace defaults

}  // namespace kdacp
