// The token-by-token KDA recurrence (SPEC §9) and its reverse sweep.
//
// Work is O(T·K·V) per (batch, value head), all of it row operations on the
// K×V state (V contiguous elements a row): scale a row, axpy a row into a
// V-vector, dot a row with a V-vector, rank-1 update. Each token makes one
// pass over the rows, doing all of a row's work for the end of one token and
// the start of the next. Columns are independent in the recurrence, so the
// forward-direction passes (sweep, the transfer M, incoming_grad) walk the
// rows once per strip of columns (kStripVecs vectors) with the per-column
// accumulators in registers; backward's step walks the columns once per pair
// of rows (kStepRows) with its per-row dots in registers. Neither changes any
// element's operations or their order, so results are the same bits as the
// plain row loops. Dots keep kLanes partial sums so they vectorise without
// reassociation flags and still sum in a fixed order.
//
// Recomputed states must equal the forward's bit for bit (backward's
// checkpoint interval may not change results), so every forward state comes
// from one function, sweep().
//
// ISA dispatch: the library is built without -march flags, which would leave
// these loops at SSE2. Highway compiles the per-(batch, value head) kernels
// (recurrent-inl.h, reverse-inl.h) once per target (kernels/hwy_targets.hpp
// says which) and this file picks the best one the CPU supports, once per
// process. The kernels are the same scalar source in every target; only the
// vector width the compiler uses changes. Results are bitwise identical
// across targets because
//  - every element-wise loop computes each element with the same operations
//    in the same order whatever the vector width,
//  - dots sum into kLanes<T> fixed partial sums (64 bytes: 16 floats, one
//    AVX-512 vector, two AVX2 or four SSE4 ones), then tree_sum's fixed
//    pairwise order, the same association for every width, and
//  - nothing is contracted into FMA (see the pragmas below and in the -inl.h
//    files): an FMA rounds once where a*b+c rounds twice, and only some
//    targets have FMA.
// tests/test_kda_dispatch.cpp runs every compiled target and compares bitwise.
//
// Validation (kda/validate.hpp), threading and the public templates live once, outside the
// per-target section (the HWY_ONCE block).
#ifdef __clang__
#pragma clang fp contract(off)
#endif

#include "kernels/hwy_targets.hpp"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kda/kda_math.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include "kda/recurrent-inl.h"
#include "kda/reverse-inl.h"

HWY_BEFORE_NAMESPACE();
// g++ contracts a*b+c into an FMA by default even with -std=c++20
// (-ffp-contract=fast; only ISO C turns it off), and the AVX2/AVX-512 targets
// have FMA while the baseline does not. Contraction would make results depend
// on the CPU, so it is off for the kernels; HWY_AFTER_NAMESPACE's
// pop_options ends this with the per-target section.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=off")
#endif
namespace kdacp::kda::detail::HWY_NAMESPACE {

template <class T>
constexpr Kernels<T> kernels_of() {
  return {&sweep<T>, &summary_head<T>, &backward_head<T>, &incoming_grad_head<T>};
}

constexpr KernelSet kKernels{kernels_of<float>(), kernels_of<double>()};

// What HWY_DYNAMIC_DISPATCH picks: this target's kernels for both types.
const KernelSet* ChooseKernels() { return &kKernels; }

}  // namespace kdacp::kda::detail::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include <cmath>
#include <new>
#include <string>
#include <type_traits>
#include <vector>

#include "kda/backward_driver.hpp"
#include <fmt/format.h>

#include "core/buffer_allocator.hpp"
#include "kda/chunk.hpp"
#include "kda/validate.hpp"
#include "kdacp/error.hpp"
#include "kdacp/thread_pool.hpp"

namespace kdacp::kda {
namespace detail {

HWY_EXPORT(ChooseKernels);

// The best target's kernels, chosen once per process: every call runs every
// head with the same code.
template <class T>
const Kernels<T>& chosen_kernels() {
  static const KernelSet* const set = HWY_DYNAMIC_DISPATCH(ChooseKernels)();
  if constexpr (std::is_same_v<T, float>) {
    return set->f32;
  } else {
    return set->f64;
  }
}
template const Kernels<float>& chosen_kernels<float>();
template const Kernels<double>& chosen_kernels<double>();

// Each participant of the pool takes a contiguous range of (batch, value
// head) pairs and allocates its scratch once for them; a pair's result does
// not depend on which participant computes it. The *_on calls trust their
// arguments: the public calls below validate them first.
template <class T>
void chunk_summary_on(const Kernels<T>& kern, const Inputs<T>& in, T* state, T* transfer,
                      const ExecPolicy& exec) {
  if (exec.algorithm == Algorithm::chunk)
    return chunk_summary_chunked(chosen_chunk_kernels<T>(), in, state, transfer, exec);
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
void forward_on(const Kernels<T>& kern, const Inputs<T>& in, const T* incoming, T* o,
                T* final_state, const ExecPolicy& exec, ForwardCache<T>* keep) {
  if (exec.algorithm == Algorithm::chunk)
    return forward_chunked(chosen_chunk_kernels<T>(), in, incoming, o, final_state, exec,
                           keep ? keep->append(ForwardCache<T>::record_elems(in.shape, exec.algorithm))
                                : nullptr);
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
void backward_on(const Kernels<T>& kern, const Inputs<T>& in, const T* incoming, const T* d_o,
                 const T* d_final, const Grads<T>& grads, const ExecPolicy& exec,
                 std::size_t checkpoint_interval, ForwardCache<T>* kept) {
  if (exec.algorithm == Algorithm::chunk)
    return backward_chunked(
        chosen_chunk_kernels<T>(), in, incoming, d_o, d_final, grads, exec,
        kept ? kept->take(ForwardCache<T>::record_elems(in.shape, exec.algorithm), "backward") : nullptr);
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
void incoming_grad_on(const Kernels<T>& kern, const Inputs<T>& in, const T* d_o, T* g_state,
                      const ExecPolicy& exec) {
  if (exec.algorithm == Algorithm::chunk)
    return incoming_grad_chunked(chosen_chunk_kernels<T>(), in, d_o, g_state, exec);
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

#define KDACP_KDA_INSTANTIATE(T)                                                              \
  template void chunk_summary_on<T>(const Kernels<T>&, const Inputs<T>&, T*, T*,              \
                                    const ExecPolicy&);                                       \
  template void forward_on<T>(const Kernels<T>&, const Inputs<T>&, const T*, T*, T*,          \
                              const ExecPolicy&, ForwardCache<T>*);                           \
  template void backward_on<T>(const Kernels<T>&, const Inputs<T>&, const T*, const T*,       \
                               const T*, const Grads<T>&, const ExecPolicy&, std::size_t,     \
                               ForwardCache<T>*);                                             \
  template void incoming_grad_on<T>(const Kernels<T>&, const Inputs<T>&, const T*, T*,        \
                                    const ExecPolicy&);

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
                   const ExecPolicy& exec) {
  check::inputs(in, "kda::chunk_summary: ");
  check::algorithm(exec.algorithm, "kda::chunk_summary: ");
  check::pointer(state, "kda::chunk_summary: ", "state");
  check::pointer(transfer, "kda::chunk_summary: ", "transfer");
  detail::chunk_summary_on(detail::chosen_kernels<T>(), in, state, transfer, exec);
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
             const ExecPolicy& exec, ForwardCache<Elem<T>>* keep) {
  check::inputs(in, "kda::forward: ");
  check::algorithm(exec.algorithm, "kda::forward: ");
  check::pointer(o, "kda::forward: ", "o");
  detail::forward_on(detail::chosen_kernels<T>(), in, incoming, o, final_state, exec, keep);
}

template <class T>
void backward(const Inputs<T>& in, const Elem<T>* incoming, const Elem<T>* d_o,
              const Elem<T>* d_final, const Grads<Elem<T>>& grads, const ExecPolicy& exec,
              std::size_t checkpoint_interval, ForwardCache<Elem<T>>* kept) {
  const std::string_view where = "kda::backward: ";
  check::inputs(in, where);
  check::algorithm(exec.algorithm, where);
  check::pointer(d_o, where, "d_o");
  check::grads(grads, where);
  check::checkpoint_interval(checkpoint_interval, where);
  detail::backward_on(detail::chosen_kernels<T>(), in, incoming, d_o, d_final, grads, exec,
                      checkpoint_interval, kept);
}

template <class T>
void incoming_grad(const Inputs<T>& in, const Elem<T>* d_o, Elem<T>* g_state,
                   const ExecPolicy& exec) {
  check::inputs(in, "kda::incoming_grad: ");
  check::algorithm(exec.algorithm, "kda::incoming_grad: ");
  check::pointer(d_o, "kda::incoming_grad: ", "d_o");
  check::pointer(g_state, "kda::incoming_grad: ", "g_state");
  detail::incoming_grad_on(detail::chosen_kernels<T>(), in, d_o, g_state, exec);
}

#define KDACP_KDA_INSTANTIATE(T)                                                             \
  template T default_scale<T>(std::size_t);                                                  \
  template void chunk_summary<T>(const Inputs<T>&, T*, T*, const ExecPolicy&);               \
  template class ForwardCache<T>;                                                            \
  template class ForwardCachePool<T>;                                                        \
  template void forward<T>(const Inputs<T>&, const T*, T*, T*, const ExecPolicy&,            \
                           ForwardCache<T>*);                                                \
  template void backward<T>(const Inputs<T>&, const T*, const T*, const T*, const Grads<T>&, \
                            const ExecPolicy&, std::size_t, ForwardCache<T>*);               \
  template void incoming_grad<T>(const Inputs<T>&, const T*, T*, const ExecPolicy&);

KDACP_KDA_INSTANTIATE(float)
KDACP_KDA_INSTANTIATE(double)
#undef KDACP_KDA_INSTANTIATE

}  // namespace kdacp::kda
#endif  // HWY_ONCE
