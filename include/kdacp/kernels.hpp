// Fold kernels: the local arithmetic of every protocol.
//
// One step per (b,h) slab is C = op(M)·X + S with op(M) = M (forward) or Mᵀ
// (backward, read by index, never materialised). Every implementation
// computes each element as acc = S[i][j]; acc = fma(op(M)[i][k], X[k][j], acc)
// for k = 0..K-1 in order, so the value of an element never depends on
// blocking, thread count or protocol (SPEC §5), and the scalar and SIMD
// kernels agree bit for bit on every CPU.
#pragma once

#include <cstddef>
#include <optional>
#include <string>

#include "kdacp/defaults.hpp"
#include "kdacp/tensor.hpp"

namespace kdacp {

class ThreadPool;

enum class Direction { forward, backward };
std::string to_string(Direction direction);

enum class KernelKind { best, scalar, simd };
std::string to_string(KernelKind kind);
// Name of the instruction set the SIMD kernel dispatches to on this host.
std::string simd_target_name();

// How a call runs: over (b,h) slabs on `pool` (the caller's, used by one call
// at a time), with the `kernel` fold step. The KDA math (kda.hpp), the layer
// (kda_cp.hpp) and the exchange (ExchangeOptions::exec) all take it.
// Where and with which kernels a call runs. The KDA math adds its algorithm
// (kda::Exec, kdacp/kda.hpp); the layer's deterministic mode is the layer's.
struct ExecPolicy {
  ThreadPool* pool = nullptr;  // nullptr: the calling thread only
  KernelKind kernel = KernelKind::best;
};

// One slab step: C[K×V] = op(M)[K×K]·X[K×V] + S[K×V]; leading dimensions in
// elements. C may alias S exactly (same pointer and ld); C must not overlap X
// or M.
void affine_step(const float* m, std::size_t ldm, const float* x, std::size_t ldx,
                 const float* s, std::size_t lds, float* c, std::size_t ldc, std::size_t k,
                 std::size_t v, Direction direction, KernelKind kernel = KernelKind::best);

// Rank-stacked summaries as the kernels see them: offsets (S forward, G
// backward) [P,B,H,K,V] and transfers M [P,B,H,K,K], typically two views into
// packed [S|M] storage.
struct Slots {
  StackView offsets;
  StackView transfers;
};

// Flags a caller states about its slots.
enum class FoldFlags : unsigned {
  none = 0,
  // The offsets of slots the fold consumes may be overwritten with
  // intermediate states. Lets a protocol fold inside its gather buffer
  // without scratch memory.
  consume_offsets = 1,
};

// Folds `count` slots starting at `first`, stepping +1 (forward) or -1
// (backward), starting from `incoming` (nullptr: the zero state; the first
// step then yields that slot's offset exactly, never a product with zero).
// Writes the result to `out` [B,H,K,V]. When `prefix_steps` is set, the state
// after that many steps is also written to `prefix_out` (0: the incoming
// state). count == 0 yields the incoming state (or zeros).
void scan(const Slots& slots, std::size_t first, std::size_t count, Direction direction,
          const StateView* incoming, const StateView& out, std::optional<std::size_t> prefix_steps,
          const StateView* prefix_out, const ExecPolicy& policy = {},
          FoldFlags flags = FoldFlags::none);

// The allgather merge: exclusive prefix for `rank` (slots 0..rank-1 from the
// zero state) forward, or transposed suffix (slots P-1 down to rank+1)
// backward, one fused pass per (b,h).
void merge(const Slots& slots, std::size_t rank, Direction direction, const StateView& out,
           const ExecPolicy& policy = {}, FoldFlags flags = FoldFlags::none);

}  // namespace kdacp
