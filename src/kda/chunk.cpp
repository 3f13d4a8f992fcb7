// The chunkwise KDA algorithm (Algorithm::chunk) over the heads of a call,
// as recurrent.cpp does for the recurrence: the B·HV (batch, value head)
// pairs are split over the pool, each computed by one thread with the same
// per-head kernel of the kernel table (kernels/kda_chunk-inl.h), so results
// do not depend on the pool size.
#include "kda/chunk.hpp"

#include "kda/backward_driver.hpp"
#include "kdacp/thread_pool.hpp"

namespace kdacp::kda::detail {

template <class T>
const ChunkKernels<T>& chosen_chunk_kernels() {
  return kdacp::detail::kernel_table().of<T>().chunk;
}
template const ChunkKernels<float>& chosen_chunk_kernels<float>();
template const ChunkKernels<double>& chosen_chunk_kernels<double>();

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
