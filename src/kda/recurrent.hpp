// Internal to the KDA module: the token-by-token recurrence,
// Algorithm::recurrent, over the heads of a call (recurrent.cpp); its
// per-head kernels are the kernel table's (kernels/kda_heads.hpp, the math
// in kernels/kda_recurrent-inl.h). kda.cpp calls the entry points below
// when kda::Exec::algorithm is recurrent.
#pragma once

#include <cstddef>

#include "kda/kda_kernels.hpp"
#include "kdacp/kda.hpp"

namespace kdacp::kda::detail {

// kda.hpp's entry points on the recurrent algorithm, after their validation.
template <class T>
void chunk_summary_recurrent(const Kernels<T>& kern, const Inputs<T>& in, T* state, T* transfer,
                             const ExecPolicy& exec);
template <class T>
void forward_recurrent(const Kernels<T>& kern, const Inputs<T>& in, const T* incoming, T* o,
                       T* final_state, const ExecPolicy& exec);
template <class T>
void backward_recurrent(const Kernels<T>& kern, const Inputs<T>& in, const T* incoming,
                        const T* d_o, const T* d_final, const Grads<T>& grads,
                        const ExecPolicy& exec, std::size_t checkpoint_interval);
template <class T>
void incoming_grad_recurrent(const Kernels<T>& kern, const Inputs<T>& in, const T* d_o,
                             T* g_state, const ExecPolicy& exec);

}  // namespace kdacp::kda::detail
