#include "kdacp/kda_cp.hpp"

#include <chrono>
#include <cstring>
#include <type_traits>
#include <utility>

#include "kdacp/error.hpp"

namespace kdacp::kda {

TokenSplit split_tokens(std::size_t tokens, std::size_t ranks, std::size_t rank) {
  if (ranks == 0 || ranks > tokens)
    throw InvalidArgument("context-parallel size P is " + std::to_string(ranks) + " for " +
                          std::to_string(tokens) +
                          " tokens, expected 1 <= P <= T (every rank needs a token)");
  if (rank >= ranks)
    throw InvalidArgument("rank " + std::to_string(rank) + " outside P = " + std::to_string(ranks));
  const std::size_t base = tokens / ranks, extra = tokens % ranks;
  return {rank * base + std::min(rank, extra), base + (rank < extra ? 1 : 0)};
}

template <class T>
void slice_tokens(const T* full, std::size_t batch, std::size_t tokens, std::size_t inner,
                  TokenSplit range, T* local) {
  for (std::size_t b = 0; b < batch; ++b)
    std::memcpy(local + b * range.count * inner, full + (b * tokens + range.begin) * inner,
                range.count * inner * sizeof(T));
}

template <class T>
void unslice_tokens(const T* local, std::size_t batch, std::size_t tokens, std::size_t inner,
                    TokenSplit range, T* full) {
  for (std::size_t b = 0; b < batch; ++b)
    std::memcpy(full + (b * tokens + range.begin) * inner, local + b * range.count * inner,
                range.count * inner * sizeof(T));
}

namespace {
template <class T>
constexpr DType dtype_of() {
  return std::is_same_v<T, double> ? DType::f64 : DType::f32;
}
double since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}
}  // namespace

template <class T>
ContextParallelLayer<T>::ContextParallelLayer(const DeviceMesh& mesh, const std::string& method,
                                              long long allgather_group_size,
                                              ExchangeOptions options, const ExecPolicy& exec)
    : exec_(exec) {
  options.exec = exec;
  exchange_ = make_state_exchange(mesh, method, allgather_group_size, std::move(options));
}

template <class T>
Saved ContextParallelLayer<T>::forward(const Inputs<T>& in, Elem<T>* o) {
  validate(in.shape);
  const Shape& s = in.shape;
  auto t0 = std::chrono::steady_clock::now();
  State offset(s.batch, s.value_heads, s.key_dim, s.value_dim, dtype_of<T>());
  State transfer(s.batch, s.value_heads, s.key_dim, s.key_dim, dtype_of<T>());
  chunk_summary(in, offset.data<T>(), transfer.data<T>(), exec_);
  fwd_.local = since(t0);
  t0 = std::chrono::steady_clock::now();
  State incoming = exchange_->forward(offset.view(), transfer.view());
  fwd_.exchange = since(t0);
  t0 = std::chrono::steady_clock::now();
  kda::forward(in, incoming.data<T>(), o, nullptr, exec_);
  fwd_.local += since(t0);
  return Saved{std::move(transfer), std::move(incoming)};
}

template <class T>
void ContextParallelLayer<T>::backward(const Inputs<T>& in, const Saved& saved, const Elem<T>* d_o,
                                       const Grads<Elem<T>>& grads) {
  validate(in.shape);
  const Shape& s = in.shape;
  auto t0 = std::chrono::steady_clock::now();
  State g(s.batch, s.value_heads, s.key_dim, s.value_dim, dtype_of<T>());
  incoming_grad(in, d_o, g.data<T>(), exec_);
  bwd_.local = since(t0);
  t0 = std::chrono::steady_clock::now();
  State d_final = exchange_->backward(g.view(), saved.transfer.view());
  bwd_.exchange = since(t0);
  t0 = std::chrono::steady_clock::now();
  kda::backward(in, saved.incoming.data<T>(), d_o, d_final.data<T>(), grads, exec_);
  bwd_.local += since(t0);
}

template <class T>
LayerData<T> LayerData<T>::slice(TokenSplit range) const {
  LayerData<T> out;
  out.shape = shape;
  out.shape.tokens = range.count;
  const std::size_t b = shape.batch, t = shape.tokens;
  auto cut = [&](const std::vector<T>& full, std::size_t inner, std::vector<T>& local) {
    local.resize(b * range.count * inner);
    slice_tokens(full.data(), b, t, inner, range, local.data());
  };
  cut(q, shape.heads * shape.key_dim, out.q);
  cut(k, shape.heads * shape.key_dim, out.k);
  cut(v, shape.value_heads * shape.value_dim, out.v);
  cut(g, shape.value_heads * shape.key_dim, out.g);
  cut(beta, shape.value_heads, out.beta);
  return out;
}

template struct LayerData<float>;
template struct LayerData<double>;
template class ContextParallelLayer<float>;
template class ContextParallelLayer<double>;
template void slice_tokens<float>(const float*, std::size_t, std::size_t, std::size_t, TokenSplit, float*);
template void slice_tokens<double>(const double*, std::size_t, std::size_t, std::size_t, TokenSplit, double*);
template void unslice_tokens<float>(const float*, std::size_t, std::size_t, std::size_t, TokenSplit, float*);
template void unslice_tokens<double>(const double*, std::size_t, std::size_t, std::size_t, TokenSplit, double*);

}  // namespace kdacp::kda
