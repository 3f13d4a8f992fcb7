// The token-by-token KDA recurrence (SPEC §9, Algorithm::recurrent) over the
// heads of a call, as chunk.cpp does for the chunkwise algorithm: each
// participant of the pool takes a contiguous range of (batch, value head)
// pairs and allocates its scratch once for them; every pair is computed by
// one thread with the same per-head kernel of the kernel table
// (kernels/kda_recurrent-inl.h), so a pair's result does not depend on
// which participant computes it or on the pool size.
#include "kda/recurrent.hpp"

#include <vector>

#include "kda/backward_driver.hpp"
#include "kdacp/thread_pool.hpp"

namespace kdacp::kda::detail {

template <class T>
void chunk_summary_recurrent(const Kernels<T>& kern, const Inputs<T>& in, T* state, T* transfer,
                             const ExecPolicy& exec) {
  require_wide(in, "kda (Algorithm::recurrent)");
  const Shape& s = in.shape;
  const std::size_t kv = s.key_dim * s.value_dim, kk = s.key_dim * s.key_dim;
  parallel_ranges(exec.pool, s.batch * s.value_heads,
                  [&](std::size_t begin, std::size_t end, std::size_t) {
                    SweepScratch<T> ws;
                    std::vector<T> vecs;
                    for (std::size_t p = begin; p < end; ++p)
                      kern.summary(head_inputs(in, p / s.value_heads, p % s.value_heads),
                                   s.tokens, s.key_dim, s.value_dim, state + p * kv,
                                   transfer + p * kk, ws, vecs);
                  });
}

template <class T>
void forward_recurrent(const Kernels<T>& kern, const Inputs<T>& in, const T* incoming, T* o,
                       T* final_state, const ExecPolicy& exec) {
  require_wide(in, "kda (Algorithm::recurrent)");
  const Shape& s = in.shape;
  const std::size_t kv = s.key_dim * s.value_dim;
  parallel_ranges(exec.pool, s.batch * s.value_heads,
                  [&](std::size_t begin, std::size_t end, std::size_t) {
    SweepScratch<T> ws;
    for (std::size_t p = begin; p < end; ++p) {
      std::size_t b = p / s.value_heads, j = p % s.value_heads;
      SweepOut<T> out;
      out.o = o + token_major_offset(s, b, j, s.value_dim);
      out.o_stride = s.value_heads * s.value_dim;
      out.scale = in.scale;
      out.final_state = final_state ? final_state + p * kv : nullptr;
      kern.sweep(head_inputs(in, b, j), 0, s.tokens, s.key_dim, s.value_dim,
                 incoming ? incoming + p * kv : nullptr, out, ws);
    }
  });
}

template <class T>
void backward_recurrent(const Kernels<T>& kern, const Inputs<T>& in, const T* incoming,
                        const T* d_o, const T* d_final, const Grads<T>& grads,
                        const ExecPolicy& exec, std::size_t checkpoint_interval) {
  require_wide(in, "kda (Algorithm::recurrent)");
  const Shape& s = in.shape;
  const std::size_t kv = s.key_dim * s.value_dim;
  backward_over_heads<BackwardScratch<T>>(
      in, d_o, grads, exec,
      [&](const HeadInputs<T>& head, const HeadGrads<T>& out, const T* head_do, std::size_t p,
          BackwardScratch<T>& ws) {
        kern.backward(head, s.tokens, s.key_dim, s.value_dim, in.scale, incoming ? incoming + p * kv : nullptr,
                      head_do, s.value_heads * s.value_dim, d_final ? d_final + p * kv : nullptr, out,
                      checkpoint_interval, ws);
      });
}

template <class T>
void incoming_grad_recurrent(const Kernels<T>& kern, const Inputs<T>& in, const T* d_o,
                             T* g_state, const ExecPolicy& exec) {
  require_wide(in, "kda (Algorithm::recurrent)");
  const Shape& s = in.shape;
  const std::size_t kv = s.key_dim * s.value_dim;
  parallel_ranges(exec.pool, s.batch * s.value_heads,
                  [&](std::size_t begin, std::size_t end, std::size_t) {
    std::vector<T> scratch;
    for (std::size_t p = begin; p < end; ++p) {
      std::size_t b = p / s.value_heads, j = p % s.value_heads;
      kern.incoming_grad(head_inputs(in, b, j), s.tokens, s.key_dim, s.value_dim, in.scale,
                         d_o + token_major_offset(s, b, j, s.value_dim),
                         s.value_heads * s.value_dim, g_state + p * kv, scratch);
    }
  });
}

#define KDACP_KDA_RECURRENT_INSTANTIATE(T)                                                    \
  template void chunk_summary_recurrent<T>(const Kernels<T>&, const Inputs<T>&, T*, T*,       \
                                           const ExecPolicy&);                                \
  template void forward_recurrent<T>(const Kernels<T>&, const Inputs<T>&, const T*, T*, T*,   \
                                     const ExecPolicy&);                                      \
  template void backward_recurrent<T>(const Kernels<T>&, const Inputs<T>&, const T*,          \
                                      const T*, const T*, const Grads<T>&, const ExecPolicy&, \
                                      std::size_t);                                           \
  template void incoming_grad_recurrent<T>(const Kernels<T>&, const Inputs<T>&, const T*, T*, \
                                           const ExecPolicy&);

KDACP_KDA_RECURRENT_INSTANTIATE(float)
KDACP_KDA_RECURRENT_INSTANTIATE(double)
#undef KDACP_KDA_RECURRENT_INSTANTIATE

}  // namespace kdacp::kda::detail
