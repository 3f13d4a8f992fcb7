// The entry points of kda.hpp: each validates its arguments once, then runs
// the algorithm kda::Exec::algorithm names — the recurrence
// (recurrent.cpp) or the chunkwise algorithm (chunk.cpp) — on the kernel
// table's per-head kernels (kernels/table.hpp); and the forward cache the
// chunkwise backward reads.
#include <cmath>
#include <new>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "core/buffer_allocator.hpp"
#include "kda/chunk.hpp"
#include "kda/recurrent.hpp"
#include "kda/validate.hpp"
#include "kdacp/error.hpp"

namespace kdacp::kda {
namespace detail {

template <class T>
const Kernels<T>& chosen_kernels() {
  return kdacp::detail::kernel_table().of<T>().recurrent;
}
template const Kernels<float>& chosen_kernels<float>();
template const Kernels<double>& chosen_kernels<double>();

// The *_on calls trust their arguments: the public calls below validate them
// first.
template <class T>
void chunk_summary_on(const KernelSet<T>& kern, const Inputs<T>& in, T* state, T* transfer,
                      const Exec& exec) {
  if (exec.algorithm == Algorithm::chunk)
    return chunk_summary_chunked(kern.chunk, in, state, transfer, exec);
  chunk_summary_recurrent(kern.recurrent, in, state, transfer, exec);
}

template <class T>
void forward_on(const KernelSet<T>& kern, const Inputs<T>& in, const T* incoming, T* o,
                T* final_state, const Exec& exec, ForwardCache<T>* keep) {
  if (exec.algorithm == Algorithm::chunk)
    return forward_chunked(kern.chunk, in, incoming, o, final_state, exec,
                           keep ? keep->append(ForwardCache<T>::record_elems(in.shape, exec.algorithm))
                                : nullptr);
  forward_recurrent(kern.recurrent, in, incoming, o, final_state, exec);
}

template <class T>
void backward_on(const KernelSet<T>& kern, const Inputs<T>& in, const T* incoming, const T* d_o,
                 const T* d_final, const Grads<T>& grads, const Exec& exec,
                 std::size_t checkpoint_interval, ForwardCache<T>* kept) {
  if (exec.algorithm == Algorithm::chunk)
    return backward_chunked(
        kern.chunk, in, incoming, d_o, d_final, grads, exec,
        kept ? kept->take(ForwardCache<T>::record_elems(in.shape, exec.algorithm), "backward") : nullptr);
  backward_recurrent(kern.recurrent, in, incoming, d_o, d_final, grads, exec, checkpoint_interval);
}

template <class T>
void incoming_grad_on(const KernelSet<T>& kern, const Inputs<T>& in, const T* d_o, T* g_state,
                      const Exec& exec) {
  if (exec.algorithm == Algorithm::chunk)
    return incoming_grad_chunked(kern.chunk, in, d_o, g_state, exec);
  incoming_grad_recurrent(kern.recurrent, in, d_o, g_state, exec);
}

#define KDACP_KDA_INSTANTIATE(T)                                                              \
  template void chunk_summary_on<T>(const KernelSet<T>&, const Inputs<T>&, T*, T*,            \
                                    const Exec&);                                       \
  template void forward_on<T>(const KernelSet<T>&, const Inputs<T>&, const T*, T*, T*,        \
                              const Exec&, ForwardCache<T>*);                           \
  template void backward_on<T>(const KernelSet<T>&, const Inputs<T>&, const T*, const T*,     \
                               const T*, const Grads<T>&, const Exec&, std::size_t,     \
                               ForwardCache<T>*);                                             \
  template void incoming_grad_on<T>(const KernelSet<T>&, const Inputs<T>&, const T*, T*,      \
                                    const Exec&);

KDACP_KDA_INSTANTIATE(float)
KDACP_KDA_INSTANTIATE(double)
#undef KDACP_KDA_INSTANTIATE

}  // namespace detail

template <class T>
void validate(const Inputs<T>& in, const char* op) {
  check::inputs(in, fmt::format("kda::{}: ", op));
}

const char* algorithm_name(Algorithm algorithm) {
  switch (algorithm) {
    case Algorithm::recurrent:
      return "recurrent";
    case Algorithm::chunk:
      return "chunk";
  }
  return "unknown";
}

Algorithm parse_algorithm(const char* name) {
  const std::string s = name ? name : "";
  if (s == "recurrent") return Algorithm::recurrent;
  if (s == "chunk") return Algorithm::chunk;
  throw InvalidArgument(fmt::format("kda: algorithm '{}', expected 'recurrent' or 'chunk'", s));
}
template void validate<float>(const Inputs<float>&, const char*);
template void validate<double>(const Inputs<double>&, const char*);

void validate(const Shape& shape) {
  auto at_least_one = [](std::size_t value, const char* field) {
    if (value == 0)
      throw InvalidArgument(fmt::format("kda: shape.{} = 0, expected >= 1", field));
  };
  at_least_one(shape.batch, "batch (B)");
  at_least_one(shape.tokens, "tokens (T)");
  at_least_one(shape.heads, "heads (H)");
  at_least_one(shape.value_heads, "value_heads (HV)");
  at_least_one(shape.key_dim, "key_dim (K)");
  at_least_one(shape.value_dim, "value_dim (V)");
  if (shape.value_heads % shape.heads != 0)
    throw InvalidArgument(fmt::format(
        "kda: shape.value_heads (HV) = {}, expected a multiple of heads (H) = {}",
        shape.value_heads, shape.heads));
}

template <class T>
T default_scale(std::size_t key_dim) {
  if (key_dim == 0) throw InvalidArgument("kda: default_scale: key_dim (K) = 0, expected >= 1");
  return T(1) / std::sqrt(static_cast<T>(key_dim));
}

template <class T>
void chunk_summary(const Inputs<T>& in, Elem<T>* state, Elem<T>* transfer,
                   const Exec& exec) {
  check::inputs(in, "kda::chunk_summary: ");
  check::algorithm(exec.algorithm, "kda::chunk_summary: ");
  check::pointer(state, "kda::chunk_summary: ", "state");
  check::pointer(transfer, "kda::chunk_summary: ", "transfer");
  detail::chunk_summary_on(kdacp::detail::kernel_table().of<T>(), in, state, transfer, exec);
}

template <class T>
std::size_t ForwardCache<T>::record_elems(const Shape& shape, Algorithm algorithm) {
  if (algorithm != Algorithm::chunk) return 0;
  return shape.batch * shape.value_heads *
         detail::chunk_saved_layout(shape.tokens, shape.key_dim, shape.value_dim).total;
}

template <class T>
std::size_t ForwardCache<T>::bytes() const {
  std::size_t n = 0;
  for (const Record& r : records_) n += r.capacity * sizeof(T);
  return n;
}

template <class T>
void ForwardCache<T>::release() {
  records_.clear();
  used_ = 0;
  next_ = 0;
}

template <class T>
std::shared_ptr<ForwardCache<T>> ForwardCachePool<T>::acquire() {
  for (const auto& c : caches_)
    if (c.use_count() == 1) {
      c->clear();
      return c;
    }
  return caches_.emplace_back(std::make_shared<ForwardCache<T>>());
}

template <class T>
std::size_t ForwardCachePool<T>::bytes() const {
  std::size_t n = 0;
  for (const auto& c : caches_) n += c->bytes();
  return n;
}

template <class T>
T* ForwardCache<T>::append(std::size_t elems) {
  if (used_ == records_.size()) records_.emplace_back();
  Record& r = records_[used_++];
  if (r.capacity < elems) {
    r.data.reset();
    // Uninitialised: the forward writes the whole record before backward
    // takes it. Huge pages: the first forward faults it in whole.
    const std::size_t bytes = elems * sizeof(T);
    const std::size_t align =
        bytes >= kdacp::detail::kHugePageBytes ? kdacp::detail::kHugePageBytes : std::size_t{64};
    r.data = std::unique_ptr<T[], Free>(static_cast<T*>(::operator new(bytes, std::align_val_t{align})),
                                        Free{align});
    kdacp::detail::advise_huge_pages(r.data.get(), bytes);
    r.capacity = elems;
  }
  r.elems = elems;
  return r.data.get();
}

template <class T>
void ForwardCache<T>::seek(std::size_t record) {
  if (record > used_)
    throw InvalidArgument(
        fmt::format("kda::ForwardCache::seek: record {} of {} kept", record, used_));
  next_ = record;
}

template <class T>
const T* ForwardCache<T>::take(std::size_t elems, const char* op) {
  if (next_ >= used_)
    throw InvalidArgument(fmt::format(
        "kda::{}: the forward cache has no record left ({} kept); pass the cache its forward "
        "filled, rewound, or none",
        op, used_));
  const Record& r = records_[next_];
  if (r.elems != elems)
    throw InvalidArgument(fmt::format(
        "kda::{}: forward cache record {} holds {} elements, this call needs {} (it comes from "
        "a forward of another shape)",
        op, next_, r.elems, elems));
  ++next_;
  return r.data.get();
}

template <class T>
void forward(const Inputs<T>& in, const Elem<T>* incoming, Elem<T>* o, Elem<T>* final_state,
             const Exec& exec, ForwardCache<Elem<T>>* keep) {
  check::inputs(in, "kda::forward: ");
  check::algorithm(exec.algorithm, "kda::forward: ");
  check::pointer(o, "kda::forward: ", "o");
  detail::forward_on(kdacp::detail::kernel_table().of<T>(), in, incoming, o, final_state, exec, keep);
}

template <class T>
void backward(const Inputs<T>& in, const Elem<T>* incoming, const Elem<T>* d_o,
              const Elem<T>* d_final, const Grads<Elem<T>>& grads, const Exec& exec,
              std::size_t checkpoint_interval, ForwardCache<Elem<T>>* kept) {
  const std::string_view where = "kda::backward: ";
  check::inputs(in, where);
  check::algorithm(exec.algorithm, where);
  check::pointer(d_o, where, "d_o");
  check::grads(grads, where);
  check::checkpoint_interval(checkpoint_interval, where);
  detail::backward_on(kdacp::detail::kernel_table().of<T>(), in, incoming, d_o, d_final, grads, exec,
                      checkpoint_interval, kept);
}

template <class T>
void incoming_grad(const Inputs<T>& in, const Elem<T>* d_o, Elem<T>* g_state,
                   const Exec& exec) {
  check::inputs(in, "kda::incoming_grad: ");
  check::algorithm(exec.algorithm, "kda::incoming_grad: ");
  check::pointer(d_o, "kda::incoming_grad: ", "d_o");
  check::pointer(g_state, "kda::incoming_grad: ", "g_state");
  detail::incoming_grad_on(kdacp::detail::kernel_table().of<T>(), in, d_o, g_state, exec);
}

#define KDACP_KDA_INSTANTIATE(T)                                                             \
  template T default_scale<T>(std::size_t);                                                  \
  template void chunk_summary<T>(const Inputs<T>&, T*, T*, const Exec&);               \
  template class ForwardCache<T>;                                                            \
  template class ForwardCachePool<T>;                                                        \
  template void forward<T>(const Inputs<T>&, const T*, T*, T*, const Exec&,            \
                           ForwardCache<T>*);                                                \
  template void backward<T>(const Inputs<T>&, const T*, const T*, const T*, const Grads<T>&, \
                            const Exec&, std::size_t, ForwardCache<T>*);               \
  template void incoming_grad<T>(const Inputs<T>&, const T*, T*, const Exec&);

KDACP_KDA_INSTANTIATE(float)
KDACP_KDA_INSTANTIATE(double)
#undef KDACP_KDA_INSTANTIATE

}  // namespace kdacp::kda
