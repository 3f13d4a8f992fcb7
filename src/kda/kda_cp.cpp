#include "kdacp/kda_cp.hpp"

#include <chrono>
#include <cstring>
#include <type_traits>

#include "kdacp/error.hpp"
#include "kdacp/synthetic.hpp"
#include <cmath>

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
ContextParallelLayer<T>::ContextParallelLayer(StateExchange& exchange, std::size_t threads)
    : exchange_(exchange), threads_(threads) {}

template <class T>
Saved ContextParallelLayer<T>::forward(const Inputs<T>& in, Elem<T>* o) {
  validate(in.shape);
  const Shape& s = in.shape;
  auto t0 = std::chrono::steady_clock::now();
  State offset(s.batch, s.value_heads, s.key_dim, s.value_dim, dtype_of<T>());
  State transfer(s.batch, s.value_heads, s.key_dim, s.key_dim, dtype_of<T>());
  chunk_summary(in, offset.data<T>(), transfer.data<T>(), threads_);
  fwd_.local = since(t0);
  t0 = std::chrono::steady_clock::now();
  State incoming = exchange_.forward(offset.view(), transfer.view());
  fwd_.exchange = since(t0);
  t0 = std::chrono::steady_clock::now();
  kda::forward(in, incoming.data<T>(), o, nullptr, threads_);
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
  incoming_grad(in, d_o, g.data<T>(), threads_);
  bwd_.local = since(t0);
  t0 = std::chrono::steady_clock::now();
  State d_final = exchange_.backward(g.view(), saved.transfer.view());
  bwd_.exchange = since(t0);
  t0 = std::chrono::steady_clock::now();
  kda::backward(in, saved.incoming.data<T>(), d_o, d_final.data<T>(), grads, threads_);
  bwd_.local += since(t0);
}

double forward_flops(const Shape& s, bool context_parallel) {
  const double tokens = double(s.batch) * double(s.tokens) * double(s.value_heads);
  const double kv = double(s.key_dim) * double(s.value_dim), kk = double(s.key_dim) * double(s.key_dim);
  // forward 7·K·V per token; summary: state 5·K·V + transfer 5·K² per token.
  return tokens * (7 * kv + (context_parallel ? 5 * kv + 5 * kk : 0));
}

double backward_flops(const Shape& s, bool context_parallel) {
  const double tokens = double(s.batch) * double(s.tokens) * double(s.value_heads);
  const double kv = double(s.key_dim) * double(s.value_dim);
  // backward 27·K·V per token (recompute included); G pass 7·K·V per token.
  return tokens * (27 * kv + (context_parallel ? 7 * kv : 0));
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

template <class T>
LayerData<T> synthetic_layer(const Shape& shape, std::uint64_t seed) {
  validate(shape);
  LayerData<T> d;
  d.shape = shape;
  Rng rng(seed * 0x9E3779B97F4A7C15ull + 17);
  auto fill = [&](std::vector<T>& x, std::size_t n, float lo, float hi) {
    x.resize(n);
    for (auto& e : x) e = static_cast<T>(rng.uniform(lo, hi));
  };
  fill(d.q, shape.qk_elems(), -1, 1);
  fill(d.k, shape.qk_elems(), -1, 1);
  for (std::size_t row = 0; row < shape.qk_elems() / shape.key_dim; ++row) {
    T* kr = d.k.data() + row * shape.key_dim;
    T norm = 0;
    for (std::size_t i = 0; i < shape.key_dim; ++i) norm += kr[i] * kr[i];
    norm = std::sqrt(norm);
    for (std::size_t i = 0; i < shape.key_dim; ++i) kr[i] /= norm;
  }
  fill(d.v, shape.v_elems(), -1, 1);
  fill(d.g, shape.g_elems(), 0.9f, 1.0f);
  for (auto& e : d.g) e = std::log(e);
  fill(d.beta, shape.beta_elems(), 0.1f, 0.9f);
  return d;
}

template <class T>
std::vector<T> synthetic_tensor(std::size_t n, std::uint64_t seed) {
  Rng rng(seed * 0xD1B54A32D192ED03ull + 5);
  std::vector<T> x(n);
  for (auto& e : x) e = static_cast<T>(rng.uniform(-1, 1));
  return x;
}

template struct LayerData<float>;
template struct LayerData<double>;
template LayerData<float> synthetic_layer<float>(const Shape&, std::uint64_t);
template LayerData<double> synthetic_layer<double>(const Shape&, std::uint64_t);
template std::vector<float> synthetic_tensor<float>(std::size_t, std::uint64_t);
template std::vector<double> synthetic_tensor<double>(std::size_t, std::uint64_t);
template class ContextParallelLayer<float>;
template class ContextParallelLayer<double>;
template void slice_tokens<float>(const float*, std::size_t, std::size_t, std::size_t, TokenSplit, float*);
template void slice_tokens<double>(const double*, std::size_t, std::size_t, std::size_t, TokenSplit, double*);
template void unslice_tokens<float>(const float*, std::size_t, std::size_t, std::size_t, TokenSplit, float*);
template void unslice_tokens<double>(const double*, std::size_t, std::size_t, std::size_t, TokenSplit, double*);

}  // namespace kdacp::kda
