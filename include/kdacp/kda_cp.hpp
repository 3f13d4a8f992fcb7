// The context-parallel KDA layer: each rank holds consecutive tokens of one
// sequence; forward = local summary -> exchange.forward -> local forward from
// the incoming state; backward = local G -> exchange.backward(G, saved M) ->
// local backward with that final-state gradient. Equals one device (SPEC §9).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kdacp/exchange.hpp"
#include "kdacp/kda.hpp"
#include "kdacp/tensor.hpp"

namespace kdacp::kda {

// Tokens [begin, begin + count) of rank `rank`: the first T mod P ranks take
// one more. P > T is an InvalidArgument (a rank would hold no token).
struct TokenSplit {
  std::size_t begin = 0, count = 0;
};
TokenSplit split_tokens(std::size_t tokens, std::size_t ranks, std::size_t rank);

// Copies tokens [begin, begin+count) of a [B,T,inner] tensor into a dense
// [B,count,inner] one (and back, for outputs).
template <class T>
void slice_tokens(const T* full, std::size_t batch, std::size_t tokens, std::size_t inner,
                  TokenSplit range, T* local);
template <class T>
void unslice_tokens(const T* local, std::size_t batch, std::size_t tokens, std::size_t inner,
                    TokenSplit range, T* full);

// What forward hands the caller to keep until backward.
struct Saved {
  State transfer;  // M [B,HV,K,K]
  State incoming;  // the incoming state [B,HV,K,V] (backward recomputes from it)
};

// Seconds spent in each phase of the last call.
struct PhaseTimes {
  double local = 0;     // summary / G pass and the local recurrence
  double exchange = 0;  // the state exchange
};

template <class T>
class ContextParallelLayer {
 public:
  // Builds the layer's exchange with make_state_exchange(mesh, method,
  // allgather_group_size, options), collective over the mesh as that is, and
  // hands it `exec` in place of options.exec: one policy (one pool) runs this
  // rank's KDA math and its exchange. exec.pool, when set, must outlive the
  // layer and is used by one call at a time.
  ContextParallelLayer(const DeviceMesh& mesh, const std::string& method,
                       long long allgather_group_size = 1, ExchangeOptions options = {},
                       const ExecPolicy& exec = {});

  // in: this rank's chunk, dense [B,T_r,...]; writes o [B,T_r,HV,V].
  Saved forward(const Inputs<T>& in, Elem<T>* o);
  // Gradients of this rank's chunk; grads.d_incoming (optional) receives the
  // gradient w.r.t. this rank's incoming state.
  void backward(const Inputs<T>& in, const Saved& saved, const Elem<T>* d_o,
                const Grads<Elem<T>>& grads);

  const PhaseTimes& forward_times() const { return fwd_; }
  const PhaseTimes& backward_times() const { return bwd_; }
  const StateExchange& exchange() const { return *exchange_; }

 private:
  std::unique_ptr<StateExchange> exchange_;
  ExecPolicy exec_;
  PhaseTimes fwd_, bwd_;
};

// Owning layer inputs in the layout of SPEC §9.
template <class T>
struct LayerData {
  Shape shape;
  std::vector<T> q, k, v, g, beta;
  Inputs<T> inputs(T scale) const { return Inputs<T>{q.data(), k.data(), v.data(), g.data(), beta.data(), shape, scale}; }
  // This rank's tokens as a dense chunk.
  LayerData slice(TokenSplit range) const;
};

}  // namespace kdacp::kda
