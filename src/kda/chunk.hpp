// Internal to the KDA module: the chunkwise (WY/UT) algorithm,
// Algorithm::chunk, over the heads of a call (chunk.cpp); its per-head
// kernels are the kernel table's (kernels/kda_chunk.hpp, the math in
// kernels/kda_chunk-inl.h). kda.cpp calls the entry points below when
// kda::Exec::algorithm is chunk.
#pragma once

#include <cstddef>

#include "kda/kda_kernels.hpp"
#include "kdacp/kda.hpp"
#include "kernels/kda_chunk.hpp"

namespace kdacp::kda::detail {

static_assert(kChunk == kChunkSize, "the kernels' chunk is kda.hpp's");

// The kernel table's chunk kernels (kernel_table(): the best target's,
// chosen once per process).
template <class T>
const ChunkKernels<T>& chosen_chunk_kernels();

// kda.hpp's entry points on the chunk algorithm, after their validation.
template <class T>
void chunk_summary_chunked(const ChunkKernels<T>& kern, const Inputs<T>& in, T* state,
                           T* transfer, const ExecPolicy& exec);
// keep / kept (or null): B·HV records of chunk_saved_layout, pair p at
// p·total (ForwardCache's record of the call).
template <class T>
void forward_chunked(const ChunkKernels<T>& kern, const Inputs<T>& in, const T* incoming, T* o,
                     T* final_state, const ExecPolicy& exec, T* keep = nullptr);
template <class T>
void backward_chunked(const ChunkKernels<T>& kern, const Inputs<T>& in, const T* incoming,
                      const T* d_o, const T* d_final, const Grads<T>& grads,
                      const ExecPolicy& exec, const T* kept = nullptr);
template <class T>
void incoming_grad_chunked(const ChunkKernels<T>& kern, const Inputs<T>& in, const T* d_o,
                           T* g_state, const ExecPolicy& exec);

}  // namespace kdacp::kda::detail
