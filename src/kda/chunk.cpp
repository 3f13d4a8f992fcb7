// Dispatch and threading of the chunkwise KDA algorithm (chunk-inl.h), as
// kda_math.cpp does for the recurrent one: the per-head kernels are compiled
// once per Highway target and the best one is chosen once per process; the
// B·HV (batch, value head) pairs are split over the pool, each computed by
// one thread with the same code, so results do not depend on the pool size.
#ifdef __clang__
#pragma clang fp contract(off)
#endif

#include "kernels/hwy_targets.hpp"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kda/chunk.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include "kda/chunk-inl.h"

HWY_BEFORE_NAMESPACE();
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=off")
#endif
namespace kdacp::kda::detail::HWY_NAMESPACE {

template <class T>
constexpr ChunkKernels<T> chunk_kernels_of() {
  return {&chunk_forward_head<T>, &chunk_summary_head<T>, &chunk_incoming_grad_head<T>,
          &chunk_backward_head<T>};
}

constexpr ChunkKernelSet kChunkKernels{chunk_kernels_of<float>(), chunk_kernels_of<double>()};

const ChunkKernelSet* ChooseChunkKernels() { return &kChunkKernels; }

}  // namespace kdacp::kda::detail::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include <type_traits>
#include <vector>

#include "kda/backward_driver.hpp"
#include "kdacp/thread_pool.hpp"

namespace kdacp::kda::detail {

HWY_EXPORT(ChooseChunkKernels);

template <class T>
const ChunkKernels<T>& chosen_chunk_kernels() {
  static const ChunkKernelSet* const set = HWY_DYNAMIC_DISPATCH(ChooseChunkKernels)();
  if constexpr (std::is_same_v<T, float>) {
    return set->f32;
  } else {
    return set->f64;
  }
}

const ChunkKernelSet* dispatched_chunk_kernels() {
  return HWY_DYNAMIC_DISPATCH(ChooseChunkKernels)();
}

template <class T>
void chunk_summary_chunked(const ChunkKernels<T>& kern, const Inputs<T>& in, T* state,
                           T* transfer, const ExecPolicy& exec) {
  const Shape& s = in.shape;
  const std::size_t kv = s.key_dim * s.value_dim, kk = s.key_dim * s.key_dim;
  parallel_ranges(exec.pool, s.batch * s.value_heads,
                  [&](std::size_t begin, std::size_t end, std::size_t) {
                    ChunkWork<T> w;
                    for (std::size_t p = begin; p < end; ++p)
                      kern.summary(head_inputs(in, p / s.value_heads, p % s.value_heads),
                                   s.tokens, s.key_dim, s.value_dim, state + p * kv,
                                   transfer + p * kk, w);
                  });
}

template <class T>
void forward_chunked(const ChunkKernels<T>& kern, const Inputs<T>& in, const T* incoming, T* o,
                     T* final_state, const ExecPolicy& exec, T* keep) {
  const Shape& s = in.shape;
  const std::size_t kv = s.key_dim * s.value_dim;
  const std::size_t rec = chunk_saved_layout(s.tokens, s.key_dim, s.value_dim).total;
  parallel_ranges(exec.pool, s.batch * s.value_heads,
                  [&](std::size_t begin, std::size_t end, std::size_t) {
                    ChunkWork<T> w;
                    for (std::size_t p = begin; p < end; ++p) {
                      const std::size_t b = p / s.value_heads, j = p % s.value_heads;
                      kern.forward(head_inputs(in, b, j), s.tokens, s.key_dim, s.value_dim,
                                   in.scale, incoming ? incoming + p * kv : nullptr,
                                   o + token_major_offset(s, b, j, s.value_dim),
                                   s.value_heads * s.value_dim,
                                   final_state ? final_state + p * kv : nullptr, w,
                                   keep ? keep + p * rec : nullptr);
                    }
                  });
}

template <class T>
void incoming_grad_chunked(const ChunkKernels<T>& kern, const Inputs<T>& in, const T* d_o,
                           T* g_state, const ExecPolicy& exec) {
  const Shape& s = in.shape;
  const std::size_t kv = s.key_dim * s.value_dim;
  parallel_ranges(exec.pool, s.batch * s.value_heads,
                  [&](std::size_t begin, std::size_t end, std::size_t) {
                    ChunkWork<T> w;
                    for (std::size_t p = begin; p < end; ++p) {
                      const std::size_t b = p / s.value_heads, j = p % s.value_heads;
                      kern.incoming_grad(head_inputs(in, b, j), s.tokens, s.key_dim,
                                         s.value_dim, in.scale,
                                         d_o + token_major_offset(s, b, j, s.value_dim),
                                         s.value_heads * s.value_dim, g_state + p * kv, w);
                    }
                  });
}

template <class T>
void backward_chunked(const ChunkKernels<T>& kern, const Inputs<T>& in, const T* incoming,
                      const T* d_o, const T* d_final, const Grads<T>& grads,
                      const ExecPolicy& exec, const T* kept) {
  const Shape& s = in.shape;
  const std::size_t kv = s.key_dim * s.value_dim;
  const std::size_t rec = chunk_saved_layout(s.tokens, s.key_dim, s.value_dim).total;
  backward_over_heads<ChunkBackScratch<T>>(in, d_o, grads, exec,
                               [&](const HeadInputs<T>& head, const HeadGrads<T>& out, const T* head_do,
                                   std::size_t p, ChunkBackScratch<T>& scratch) {
    kern.backward(head, s.tokens, s.key_dim, s.value_dim, in.scale, incoming ? incoming + p * kv : nullptr,
                  head_do, s.value_heads * s.value_dim, d_final ? d_final + p * kv : nullptr, out, scratch.w,
                  scratch.bw, kept ? kept + p * rec : nullptr);
  });
}

#define KDACP_KDA_CHUNK_INSTANTIATE(T)                                                       \
  template const ChunkKernels<T>& chosen_chunk_kernels<T>();                                 \
  template void chunk_summary_chunked<T>(const ChunkKernels<T>&, const Inputs<T>&, T*, T*,   \
                                         const ExecPolicy&);                                 \
  template void forward_chunked<T>(const ChunkKernels<T>&, const Inputs<T>&, const T*, T*,   \
                                   T*, const ExecPolicy&, T*);                               \
  template void incoming_grad_chunked<T>(const ChunkKernels<T>&, const Inputs<T>&, const T*, \
                                         T*, const ExecPolicy&);                             \
  template void backward_chunked<T>(const ChunkKernels<T>&, const Inputs<T>&, const T*,      \
                                    const T*, const T*, const Grads<T>&, const ExecPolicy&,   \
                                    const T*);

KDACP_KDA_CHUNK_INSTANTIATE(float)
KDACP_KDA_CHUNK_INSTANTIATE(double)
#undef KDACP_KDA_CHUNK_INSTANTIATE

}  // namespace kdacp::kda::detail
#endif  // HWY_ONCE
