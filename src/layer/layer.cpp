// make_layer and the layer's strategies (kdacp/layer.hpp): one process
// (kda::forward_sequences), state CP (kda::ContextParallelLayer) and
// Ulysses × state CP (kda::UlyssesLayer). The deterministic mode is a
// setting of both CP strategies. Each strategy's engine agrees on nothing
// per call itself: the layer has agreed on the config at construction, and
// agrees on each call's arguments, named as the caller's user spells them.
#include <fmt/format.h>

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>

#include "kda/sequences.hpp"
#include "kda/validate.hpp"
#include "kdacp/error.hpp"
#include "kdacp/kda_ulysses.hpp"
#include "kdacp/layer.hpp"
#include "kdacp/mesh.hpp"
#include "kdacp/protocol.hpp"
#include "kdacp/thread_pool.hpp"

namespace kdacp {

struct LayerSaved {
  kda::Saved saved;  // state CP; one process: its kept forward cache only
  std::shared_ptr<kda::UlyssesSaved<float>> ulysses_f32;
  std::shared_ptr<kda::UlyssesSaved<double>> ulysses_f64;

  template <class T>
  std::shared_ptr<kda::UlyssesSaved<T>>& ulysses() {
    if constexpr (std::is_same_v<T, float>) return ulysses_f32;
    else return ulysses_f64;
  }
  template <class T>
  const std::shared_ptr<kda::UlyssesSaved<T>>& ulysses() const {
    if constexpr (std::is_same_v<T, float>) return ulysses_f32;
    else return ulysses_f64;
  }
};

namespace {

kda::Sequences sequences_of(const LayerConfig& c) {
  if (c.cu_seqlens.empty()) return kda::Sequences(c.shape.batch, c.shape.tokens);
  return kda::Sequences(1, c.shape.tokens, std::span<const std::int64_t>(c.cu_seqlens));
}

template <class T>
constexpr DType dtype_of() {
  return std::is_same_v<T, double> ? DType::f64 : DType::f32;
}

// The call's local checks: this rank's inputs are its tokens of the stream.
template <class T>
void check_call(const Layer<T>& layer, const kda::Inputs<T>& in, kda::SequenceStates<const T> a, const char* a_name,
                kda::SequenceStates<const T> b, const char* b_name) {
  kda::check::inputs(in, "");
  const kda::Shape want = layer.local_shape();
  const kda::Shape& s = in.shape;
  if (s.batch != want.batch || s.tokens != want.tokens || s.heads != want.heads ||
      s.value_heads != want.value_heads || s.key_dim != want.key_dim || s.value_dim != want.value_dim)
    throw InvalidArgument(fmt::format("rank {}'s inputs are B,T,H,HV,K,V = {},{},{},{},{},{}, expected "
                                      "{},{},{},{},{},{}: its {} tokens of the layer's layout {}",
                                      layer.rank(), s.batch, s.tokens, s.heads, s.value_heads, s.key_dim,
                                      s.value_dim, want.batch, want.tokens, want.heads, want.value_heads,
                                      want.key_dim, want.value_dim, want.tokens, layer.layout().str()));
  kda::check::states(a, layer.sequences(), s, "", a_name);
  kda::check::states(b, layer.sequences(), s, "", b_name);
}

// The call's fields every rank must share, named as the user spells them.
Fingerprint call_fingerprint(const LayerNames& n, const char* call, double scale, bool a, const std::string& a_name,
                             bool b, const std::string& b_name) {
  Fingerprint f;
  f.add_text("call", call);
  f.add_real(n.scale, scale);
  f.add_flag(a_name, a);
  f.add_flag(b_name, b);
  return f;
}

// Runs this rank's `checks`, then agrees over `comm` on `fields` (and on
// every rank's check error): every rank throws, or none. first_call: once
// `agreed`, this rank's checks alone.
void agree_call(Communicator& comm, LayerConfig::CallAgreement mode, bool& agreed, const Fingerprint& fields,
                const char* what, const std::function<void()>& checks) {
  if (mode == LayerConfig::CallAgreement::first_call && agreed) return checks();
  std::string local_error;
  try {
    checks();
  } catch (const InvalidArgument& e) {
    local_error = e.what();
  }
  agree(comm, fields, what, local_error);
  agreed = true;
}

template <class T>
class OneProcessLayer final : public Layer<T> {
 public:
  OneProcessLayer(LayerConfig c, Layout layout) : Layer<T>(std::move(c), std::move(layout), 0) {}

  std::shared_ptr<LayerSaved> forward(const kda::Inputs<T>& in, kda::SequenceStates<const T> h0, T* o,
                                      kda::SequenceStates<T> ht) override {
    check_call<T>(*this, in, h0, this->config_.names.h0.c_str(), ht, this->config_.names.ht.c_str());
    auto saved = std::make_shared<LayerSaved>();
    std::shared_ptr<kda::ForwardCache<T>> cache;
    if (this->config_.keep_forward && this->config_.algorithm == kda::Algorithm::chunk) cache = caches_.acquire();
    kda::forward_sequences(in, this->sequences(), h0, o, ht, exec(), cache.get());
    saved->saved.kept<T>() = std::move(cache);
    return saved;
  }

  void backward(const kda::Inputs<T>& in, const LayerSaved& saved, kda::SequenceStates<const T> h0, const T* d_o,
                kda::SequenceStates<const T> dht, const kda::Grads<T>& grads, kda::SequenceStates<T> dh0) override {
    check_call<T>(*this, in, h0, this->config_.names.h0.c_str(), dht, this->config_.names.dht.c_str());
    if (kda::ForwardCache<T>* kept = saved.saved.kept<T>().get()) kept->rewind();  // a second backward reads it again
    kda::backward_sequences(in, this->sequences(), h0, d_o, dht, grads, dh0, exec(), kda::kDefaultCheckpointInterval,
                            saved.saved.kept<T>().get());
  }

  const StateExchange* exchange() const override { return nullptr; }
  const kda::PhaseTimes& forward_times() const override { return times_; }
  const kda::PhaseTimes& backward_times() const override { return times_; }
  std::size_t forward_cache_bytes() const override { return caches_.bytes(); }

 private:
  kda::Exec exec() const {
    kda::Exec e;
    e.pool = this->config_.pool;
    e.kernel = this->config_.exchange.exec.kernel;
    e.algorithm = this->config_.algorithm;
    return e;
  }
  kda::ForwardCachePool<T> caches_;
  kda::PhaseTimes times_;
};

// State CP (width 1) or Ulysses × state CP over `world`.
template <class T>
class ParallelLayer final : public Layer<T> {
 public:
  ParallelLayer(const std::shared_ptr<Communicator>& world, LayerConfig c, Layout layout, std::size_t width,
                ExchangeOptions eo)
      : Layer<T>(std::move(c), std::move(layout), world->rank()),
        comm_(world),
        mesh_(DeviceMesh::create(world, {world->size()}, {"cp"})) {
    const LayerConfig& cfg = this->config_;
    const kda::Exec exec{{cfg.pool, eo.exec.kernel}, cfg.algorithm};
    kda::LayerChecks checks;
    checks.check_finite = cfg.check_finite;
    if (width > 1) {
      ulysses_.emplace(mesh_, width, cfg.protocol, this->layout_, cfg.group_size, std::move(eo), exec, checks);
      ulysses_->agree_per_call(false);
      ulysses_->state_layer().keep_forward(cfg.keep_forward);
      ulysses_->state_layer().deterministic(cfg.deterministic);
      if constexpr (std::is_same_v<T, float>) ulysses_->wire_types(cfg.storage, cfg.out_storage);
    } else {
      plain_.emplace(mesh_, cfg.protocol, this->layout_, cfg.group_size, std::move(eo), exec, checks);
      plain_->agree_per_call(false);
      plain_->keep_forward(cfg.keep_forward);
      plain_->deterministic(cfg.deterministic);
    }
  }

  std::shared_ptr<LayerSaved> forward(const kda::Inputs<T>& in, kda::SequenceStates<const T> h0, T* o,
                                      kda::SequenceStates<T> ht) override {
    const LayerNames& n = this->config_.names;
    agree_call(*comm_, this->config_.agree_calls, forward_agreed_,
               call_fingerprint(n, "forward", in.scale, h0.data != nullptr, n.h0, ht.data != nullptr, n.ht),
               "the KDA layer's forward", [&] {
                 check_call<T>(*this, in, h0, n.h0.c_str(), ht, n.ht.c_str());
                 kda::check::pointer(o, "", "o");
               });
    auto saved = std::make_shared<LayerSaved>();
    if (ulysses_) {
      saved->ulysses<T>() = std::make_shared<kda::UlyssesSaved<T>>(ulysses_->forward(in, this->stream_, h0, o, ht));
    } else {
      saved->saved = plain_->forward(in, this->stream_, h0, o, ht);
    }
    return saved;
  }

  void backward(const kda::Inputs<T>& in, const LayerSaved& saved, kda::SequenceStates<const T> h0, const T* d_o,
                kda::SequenceStates<const T> dht, const kda::Grads<T>& grads, kda::SequenceStates<T> dh0) override {
    const LayerNames& n = this->config_.names;
    agree_call(*comm_, this->config_.agree_calls, backward_agreed_,
               call_fingerprint(n, "backward", in.scale, dht.data != nullptr, n.dht, dh0.data != nullptr, n.dh0),
               "the KDA layer's backward", [&] {
                 check_call<T>(*this, in, h0, n.h0.c_str(), dht, n.dht.c_str());
                 kda::check::states(dh0, this->sequences(), in.shape, "", n.dh0);
                 kda::check::pointer(d_o, "", "d_o");
                 kda::check::grads(grads, "");
                 if (ulysses_ ? !saved.ulysses<T>() : saved.ulysses<T>() != nullptr)
                   throw InvalidArgument("backward given a saved forward of another layer");
               });
    if (ulysses_) ulysses_->backward(in, *saved.ulysses<T>(), h0, d_o, dht, grads, dh0);
    else plain_->backward(in, saved.saved, h0, d_o, dht, grads, dh0);
  }

  const StateExchange* exchange() const override {
    return ulysses_ ? &ulysses_->exchange() : &plain_->exchange();
  }
  std::size_t ulysses_width() const override { return ulysses_ ? ulysses_->width() : 1; }
  const kda::PhaseTimes& forward_times() const override {
    return ulysses_ ? ulysses_->forward_times() : plain_->forward_times();
  }
  const kda::PhaseTimes& backward_times() const override {
    return ulysses_ ? ulysses_->backward_times() : plain_->backward_times();
  }
  std::size_t forward_cache_bytes() const override {
    return ulysses_ ? ulysses_->state_layer().forward_cache_bytes() : plain_->forward_cache_bytes();
  }
  std::vector<std::optional<Half>> wire_types() const override {
    std::vector<std::optional<Half>> out;
    if constexpr (std::is_same_v<T, float>) {
      if (!ulysses_) return out;
      for (const auto& w : ulysses_->wire_inputs()) out.push_back(w);
      out.push_back(ulysses_->wire_out());
    }
    return out;
  }

 private:
  std::shared_ptr<Communicator> comm_;
  DeviceMesh mesh_;
  std::optional<kda::ContextParallelLayer<T>> plain_;
  std::optional<kda::UlyssesLayer<T>> ulysses_;
  bool forward_agreed_ = false, backward_agreed_ = false;  // CallAgreement::first_call
};

}  // namespace

const std::vector<State>& incoming_states(const LayerSaved& s) {
  if (s.ulysses_f32 || s.ulysses_f64)
    throw InvalidArgument("the incoming states of a Ulysses layer's forward: its parts are head groups' "
                          "(run without ulysses)");
  return s.saved.incoming;
}

void release_forward_cache(LayerSaved& s) {
  s.saved.kept<float>().reset();
  s.saved.kept<double>().reset();
  if (s.ulysses_f32) s.ulysses_f32->saved.kept<float>().reset();
  if (s.ulysses_f64) s.ulysses_f64->saved.kept<double>().reset();
}

template <class T>
Layer<T>::Layer(LayerConfig config, Layout layout, std::size_t rank)
    : config_(std::move(config)),
      layout_(std::move(layout)),
      stream_{sequences_of(config_), layout_},
      rank_(rank) {}

template <class T>
kda::Shape Layer<T>::local_shape() const {
  kda::Shape s = config_.shape;
  s.tokens = layout_.local_tokens(rank_);
  return s;
}

template <class T>
std::string Layer<T>::method() const {
  const StateExchange* ex = exchange();
  return ex ? ex->method() : "none";
}

template <class T>
bool Layer<T>::exact() const {
  const StateExchange* ex = exchange();
  return ex ? ex->exact() : true;
}

template <class T>
std::unique_ptr<Layer<T>> make_layer(const std::shared_ptr<Communicator>& world, const LayerConfig& config) {
  const std::size_t ranks = world ? world->size() : 1;
  std::string local_error;
  std::optional<Layout> layout;
  ExchangeOptions eo;
  std::size_t width = 1;
  try {
    validate_layer_config(config, ranks);
    layout.emplace(make_layer_layout(config, ranks));
    eo = layer_exchange_options(config.exchange, config.shape, dtype_of<T>(), *layout, sequences_of(config));
    width = config.ulysses == kLayerUlyssesAuto
                ? choose_ulysses(config.shape, *layout, eo, layer_activation_bytes(config, sizeof(T)))
                : config.ulysses;
  } catch (const InvalidArgument& e) {
    local_error = e.what();
  }
  if (!world) {
    if (!local_error.empty()) throw InvalidArgument(local_error);
    return std::make_unique<OneProcessLayer<T>>(config, std::move(*layout));
  }
  Fingerprint fields = layer_fingerprint(config, ranks, width);
  fields.add_text(config.names.dtype, std::is_same_v<T, double> ? "float64" : "float32");
  fields.add_int(config.names.timeout + " (ms)", static_cast<long long>(world->timeout().count()));
  // Before the engine's own construction, which splits the mesh and builds
  // the exchange: ranks that asked for different layers would otherwise wait
  // in different collectives.
  agree(*world, fields, "the KDA layer's construction", local_error);
  return std::make_unique<ParallelLayer<T>>(world, config, std::move(*layout), width, std::move(eo));
}

std::size_t layer_activation_bytes(const LayerConfig& c, std::size_t compute_bytes) {
  const kda::Shape& s = c.shape;
  const std::size_t per[5] = {s.heads * s.key_dim, s.heads * s.key_dim, s.value_heads * s.value_dim,
                              s.value_heads * s.key_dim, s.value_heads};
  std::size_t elems = 0, bytes = 0;
  for (std::size_t i = 0; i < 5; ++i) {
    elems += per[i];
    bytes += per[i] * (c.storage[i] ? 2 : compute_bytes);
  }
  return elems == 0 ? compute_bytes : (bytes + elems - 1) / elems;
}

template class Layer<float>;
template class Layer<double>;
template std::unique_ptr<Layer<float>> make_layer<float>(const std::shared_ptr<Communicator>&, const LayerConfig&);
template std::unique_ptr<Layer<double>> make_layer<double>(const std::shared_ptr<Communicator>&, const LayerConfig&);

}  // namespace kdacp
