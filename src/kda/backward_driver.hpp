// Internal to the KDA module: the backward's loop over (batch, value head)
// pairs, shared by the recurrent (recurrent.cpp) and chunkwise (chunk.cpp)
// algorithms, which differ only in how they compute one pair.
#pragma once

#include <algorithm>
#include <cstddef>
#include <vector>

#include "kda/kda_kernels.hpp"
#include "kdacp/thread_pool.hpp"

namespace kdacp::kda::detail {

// dq, dk of every (b, key head h) at tokens [lo, lo + count) of the
// [B,T,H,K] gradients: the sum of its value heads' partials
// ([B·HV][count][K] each) in value-head order, per token, so the bits do not
// depend on the thread count. Split over (b, h, block of tokens).
template <class T>
void sum_group_partials(const Shape& s, const Grads<T>& grads, std::size_t lo, std::size_t count,
                        const T* partial_dq, const T* partial_dk, ThreadPool* pool) {
  constexpr std::size_t kBlock = 256;
  const std::size_t group = s.group(), head_qk = count * s.key_dim;
  const std::size_t blocks = (count + kBlock - 1) / kBlock;
  parallel_ranges(pool, s.batch * s.heads * blocks,
                  [&](std::size_t begin, std::size_t end, std::size_t) {
    for (std::size_t p = begin; p < end; ++p) {
      const std::size_t b = p / (s.heads * blocks), h = p / blocks % s.heads;
      const std::size_t t0 = p % blocks * kBlock, t1 = std::min(count, t0 + kBlock);
      for (std::size_t t = t0; t < t1; ++t) {
        T* dq = grads.dq + ((b * s.tokens + lo + t) * s.heads + h) * s.key_dim;
        T* dk = grads.dk + ((b * s.tokens + lo + t) * s.heads + h) * s.key_dim;
        for (std::size_t i = 0; i < s.key_dim; ++i) dq[i] = dk[i] = 0;
        for (std::size_t j = h * group; j < (h + 1) * group; ++j) {
          const T* pq = partial_dq + (b * s.value_heads + j) * head_qk + t * s.key_dim;
          const T* pk = partial_dk + (b * s.value_heads + j) * head_qk + t * s.key_dim;
          for (std::size_t i = 0; i < s.key_dim; ++i) {
            dq[i] += pq[i];
            dk[i] += pk[i];
          }
        }
      }
    }
  });
}

// Runs head(in_head, out, d_o_head, p, scratch) for every pair p = b·HV + j
// on exec.pool, with `out` pointing at that pair's gradients and one Scratch
// per thread range. With grouped value heads several value heads feed one
// dq/dk slice: each writes its own partial, so the pairs stay independent,
// and the partials are summed afterwards in value-head order, so the result
// does not depend on the thread count.
template <class Scratch, class T, class Head>
void backward_over_heads(const Inputs<T>& in, const T* d_o, const Grads<T>& grads,
                         const ExecPolicy& exec, Head&& head) {
  const Shape& s = in.shape;
  const std::size_t kv = s.key_dim * s.value_dim, group = s.group();
  const std::size_t head_qk = s.tokens * s.key_dim;
  std::vector<T> partial_dq(group > 1 ? s.batch * s.value_heads * head_qk : 0);
  std::vector<T> partial_dk(partial_dq.size());
  parallel_ranges(exec.pool, s.batch * s.value_heads,
                  [&](std::size_t begin, std::size_t end, std::size_t) {
    Scratch scratch;
    for (std::size_t p = begin; p < end; ++p) {
      const std::size_t b = p / s.value_heads, j = p % s.value_heads, h = j / group;
      HeadGrads<T> out{};
      if (group > 1) {
        out.dq = partial_dq.data() + p * head_qk;
        out.dk = partial_dk.data() + p * head_qk;
        out.qk_stride = s.key_dim;
      } else {
        out.dq = grads.dq + (b * s.tokens * s.heads + h) * s.key_dim;
        out.dk = grads.dk + (b * s.tokens * s.heads + h) * s.key_dim;
        out.qk_stride = s.heads * s.key_dim;
      }
      out.dv = grads.dv + token_major_offset(s, b, j, s.value_dim);
      out.v_stride = s.value_heads * s.value_dim;
      out.dg = grads.dg + token_major_offset(s, b, j, s.key_dim);
      out.g_stride = s.value_heads * s.key_dim;
      out.dbeta = grads.dbeta + token_major_offset(s, b, j, 1);
      out.beta_stride = s.value_heads;
      out.d_incoming = grads.d_incoming ? grads.d_incoming + p * kv : nullptr;
      head(head_inputs(in, b, j), out, d_o + token_major_offset(s, b, j, s.value_dim), p, scratch);
    }
  });
  if (group > 1) sum_group_partials(s, grads, 0, s.tokens, partial_dq.data(), partial_dk.data(), exec.pool);
}

}  // namespace kdacp::kda::detail
