// The KDA layer behind kdacp.torch.kda: ContextParallelLayer over a torch
// group, or forward_sequences / backward_sequences on one process. The
// autograd wiring is Python's (torch.autograd.Function); this file runs the
// C++ forward and backward on the tensors' memory with the GIL released.
#include <pybind11/stl.h>

#include <array>
#include <cstdint>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>

#include <fmt/format.h>

#include "binding.hpp"
#include "kda/sequences.hpp"
#include "kdacp/error.hpp"
#include "kdacp/job.hpp"
#include "kdacp/kda.hpp"
#include "kdacp/kda_cp.hpp"
#include "kdacp/half.hpp"
#include "kdacp/kda_ulysses.hpp"
#include "kdacp/layout.hpp"
#include "kdacp/mesh.hpp"
#include "torch_comm.hpp"

namespace py = pybind11;

namespace kdacp::python {
namespace {

// What forward keeps for backward: the layer's Saved (M and the incoming state
// of each part, and with keep_forward its forward cache); on one process
// nothing, or with keep_forward a Saved holding the forward cache alone.
// The first backward lets the forward cache go (release_kept): its layer's
// pool hands it to the next forward while autograd still holds this box
// (the previous step's graph lives until its output is dropped), so a
// training loop reuses one cache instead of faulting a second one in. A
// second backward (retain_graph=True) recomputes what the cache held: the
// same bits.
// The 16-bit storage types of q, k, v, g, beta (nullopt: float32/float64).
std::array<std::optional<Half>, 5> wire_of(const std::vector<std::string>& dtypes) {
  std::array<std::optional<Half>, 5> out{};
  for (std::size_t i = 0; i < out.size() && i < dtypes.size(); ++i) out[i] = parse_half(dtypes[i]);
  return out;
}

struct SavedBox {
  std::optional<kda::Saved> saved;
  // The Ulysses layer's (kda::UlyssesSaved): its state-CP layer's Saved and
  // the head slice of the group's inputs.
  std::optional<kda::UlyssesSaved<float>> ulysses_f32;
  std::optional<kda::UlyssesSaved<double>> ulysses_f64;

  template <class T>
  std::optional<kda::UlyssesSaved<T>>& ulysses() {
    if constexpr (std::is_same_v<T, double>)
      return ulysses_f64;
    else
      return ulysses_f32;
  }
  // The Saved holding the forward cache, if any.
  template <class T>
  const kda::Saved* base() const {
    if (saved) return &*saved;
    if constexpr (std::is_same_v<T, double>)
      return ulysses_f64 ? &ulysses_f64->saved : nullptr;
    else
      return ulysses_f32 ? &ulysses_f32->saved : nullptr;
  }

  // The forward cache (rewound for the backward), or null.
  template <class T>
  kda::ForwardCache<T>* kept() const {
    const kda::Saved* b = base<T>();
    kda::ForwardCache<T>* c = b ? b->kept<T>().get() : nullptr;
    if (c) c->rewind();
    return c;
  }
  template <class T>
  void release_kept() {
    if (saved) saved->kept<T>().reset();
    if (ulysses<T>()) ulysses<T>()->saved.template kept<T>().reset();
  }
};

kda::Shape to_shape(const std::vector<std::size_t>& s) {
  if (s.size() != 6) throw InvalidArgument("kda shape needs 6 entries (B, T, H, HV, K, V)");
  return kda::Shape{s[0], s[1], s[2], s[3], s[4], s[5]};
}

template <class T>
const T* ptr(std::uintptr_t p) {
  return reinterpret_cast<const T*>(p);
}

template <class T>
T* mut(py::array& a) {
  return static_cast<T*>(a.mutable_data());
}

class KdaLayer {
 public:
  // backend None: one process, the whole stream local. Otherwise the CP layer
  // over the group with `layout` (kdacp.Layout, built by the caller once per
  // context, spanning the group's ranks).
  // ulysses > 1: kda::UlyssesLayer of that width over the group (head
  // groups of U consecutive ranks, the state exchange over P/U).
  KdaLayer(py::object backend, const std::string& method, long long group_size,
           const std::optional<Layout>& layout, const std::string& dtype, ExchangeOptions options,
           std::size_t threads, std::size_t ulysses)
      : pool_(threads), f64_(dtype == "float64") {
    if (backend.is_none()) {
      if (ulysses != 1) throw InvalidArgument(fmt::format("ulysses={} needs a group, got one process", ulysses));
      return;
    }
    if (!layout) throw InvalidArgument("KdaLayer over a group needs its layout, got None");
    comm_ = std::make_shared<TorchCommunicator>(std::move(backend));
    py::gil_scoped_release release;  // building the exchange may split: collective
    mesh_ = DeviceMesh::from_group(comm_, comm_->global_ranks(), "cp");
    layout_ = *layout;
    if (ulysses > 1) {
      if (f64_)
        ulysses_f64_ = std::make_unique<kda::UlyssesLayer<double>>(*mesh_, ulysses, method, *layout_, group_size,
                                                                   options, pool_.exec());
      else
        ulysses_f32_ = std::make_unique<kda::UlyssesLayer<float>>(*mesh_, ulysses, method, *layout_, group_size,
                                                                  options, pool_.exec());
      return;
    }
    if (f64_)
      layer_f64_ = std::make_unique<kda::ContextParallelLayer<double>>(
          *mesh_, method, *layout_, group_size, options, pool_.exec());
    else
      layer_f32_ = std::make_unique<kda::ContextParallelLayer<float>>(
          *mesh_, method, *layout_, group_size, options, pool_.exec());
  }

  // `algorithm`: kda::Algorithm by name ("recurrent" or "chunk"), per call.
  // keep_forward: the chunk forward keeps what its backward would recompute
  // (kda::ForwardCache) in the returned saved object. deterministic: the CP
  // layer's deterministic mode for this forward (and its backward,
  // kda::ContextParallelLayer::deterministic); one process ignores it: its
  // forward_sequences / backward_sequences are that mode's bytes (P = 1).
  // `dtypes`: the storage of q, k, v, g, beta (o is stored as v); the
  // states are in the layer's dtype (float32 for 16-bit inputs).
  py::tuple forward(const std::vector<std::uintptr_t>& inputs, const std::vector<std::string>& dtypes,
                    const std::vector<std::size_t>& shape, double scale,
                    const std::optional<std::vector<std::int64_t>>& cu_seqlens, std::uintptr_t h0,
                    bool want_ht, const std::string& algorithm, bool keep_forward, bool deterministic) {
    const kda::Algorithm a = kda::parse_algorithm(algorithm.c_str());
    return f64_ ? forward_t<double>(inputs, dtypes, shape, scale, cu_seqlens, h0, want_ht, a, keep_forward,
                                    deterministic)
                : forward_t<float>(inputs, dtypes, shape, scale, cu_seqlens, h0, want_ht, a, keep_forward,
                                   deterministic);
  }

  // The gradients of q, k, v, g, beta are stored as those inputs; d_o as
  // `d_o_dtype`.
  py::tuple backward(const std::shared_ptr<SavedBox>& saved, const std::vector<std::uintptr_t>& inputs,
                     const std::vector<std::string>& dtypes, const std::vector<std::size_t>& shape,
                     double scale, const std::optional<std::vector<std::int64_t>>& cu_seqlens,
                     std::uintptr_t h0, std::uintptr_t d_o, const std::string& d_o_dtype, std::uintptr_t dht,
                     bool want_dh0, const std::string& algorithm) {
    const kda::Algorithm a = kda::parse_algorithm(algorithm.c_str());
    return f64_ ? backward_t<double>(*saved, inputs, dtypes, shape, scale, cu_seqlens, h0, d_o, d_o_dtype,
                                     dht, want_dh0, a)
                : backward_t<float>(*saved, inputs, dtypes, shape, scale, cu_seqlens, h0, d_o, d_o_dtype,
                                    dht, want_dh0, a);
  }

  // Bytes of the forward caches this layer holds for reuse and in use (the
  // CP layer's, or those of the one-process path).
  std::size_t forward_cache_bytes() const {
    if (layer_f32_) return layer_f32_->forward_cache_bytes();
    if (layer_f64_) return layer_f64_->forward_cache_bytes();
    if (ulysses_f32_) return ulysses_f32_->state_layer().forward_cache_bytes();
    if (ulysses_f64_) return ulysses_f64_->state_layer().forward_cache_bytes();
    return caches_f32_.bytes() + caches_f64_.bytes();
  }

  // Off: the layer's forward and backward skip their per-call agreement
  // (kda::ContextParallelLayer::agree_per_call): a CpContext agreed once.
  void agree_per_call(bool on) {
    if (layer_f32_) layer_f32_->agree_per_call(on);
    if (layer_f64_) layer_f64_->agree_per_call(on);
    if (ulysses_f32_) ulysses_f32_->agree_per_call(on);
    if (ulysses_f64_) ulysses_f64_->agree_per_call(on);
  }

  // The state exchange ("none" on one process): the plain layer's or the
  // Ulysses layer's (over P/U ranks).
  const StateExchange* exchange() const {
    if (layer_f32_) return &layer_f32_->exchange();
    if (layer_f64_) return &layer_f64_->exchange();
    if (ulysses_f32_) return &ulysses_f32_->exchange();
    if (ulysses_f64_) return &ulysses_f64_->exchange();
    return nullptr;
  }
  // The exchange's method ("none" on one process) and whether it is exact.
  std::string method() const { return exchange() ? exchange()->method() : "none"; }
  bool exact() const { return exchange() ? exchange()->exact() : true; }
  // The Ulysses layer's wire types of the last call (q, k, v, g, beta, then
  // o or d_o): "bfloat16", "float16" or None (as computed); empty without
  // Ulysses.
  std::vector<std::optional<std::string>> wire_types() const {
    std::vector<std::optional<std::string>> out;
    if (!ulysses_f32_) return out;
    for (const auto& w : ulysses_f32_->wire_inputs())
      out.push_back(w ? std::optional<std::string>(half_name(*w)) : std::nullopt);
    const auto o = ulysses_f32_->wire_out();
    out.push_back(o ? std::optional<std::string>(half_name(*o)) : std::nullopt);
    return out;
  }

  // The Ulysses width (1: the plain layer or one process).
  std::size_t ulysses_width() const {
    if (ulysses_f32_) return ulysses_f32_->width();
    if (ulysses_f64_) return ulysses_f64_->width();
    return 1;
  }
  // Seconds of the last forward / backward on a group: (local, exchange);
  // with Ulysses the exchange includes the all-to-alls.
  py::tuple times(bool forward) const {
    const kda::PhaseTimes* t = nullptr;
    if (layer_f32_) t = forward ? &layer_f32_->forward_times() : &layer_f32_->backward_times();
    if (layer_f64_) t = forward ? &layer_f64_->forward_times() : &layer_f64_->backward_times();
    if (ulysses_f32_) t = forward ? &ulysses_f32_->forward_times() : &ulysses_f32_->backward_times();
    if (ulysses_f64_) t = forward ? &ulysses_f64_->forward_times() : &ulysses_f64_->backward_times();
    return t ? py::make_tuple(t->local, t->exchange) : py::make_tuple(0.0, 0.0);
  }

 private:
  template <class T>
  kda::ContextParallelLayer<T>* layer() const {
    if constexpr (std::is_same_v<T, double>)
      return layer_f64_.get();
    else
      return layer_f32_.get();
  }
  template <class T>
  kda::UlyssesLayer<T>* ulysses() const {
    if constexpr (std::is_same_v<T, double>)
      return ulysses_f64_.get();
    else
      return ulysses_f32_.get();
  }
  template <class T>
  kda::ForwardCachePool<T>& caches() {
    if constexpr (std::is_same_v<T, double>)
      return caches_f64_;
    else
      return caches_f32_;
  }

  // q, k, v, g, beta as T (16-bit ones widened on first use, without the GIL).
  template <class T>
  struct Tensors {
    Tensors(const std::vector<std::uintptr_t>& p, const std::vector<std::string>& dtypes, const kda::Shape& s)
        : q(at(p, 0), dtype(dtypes, 0), s.qk_elems(), "q"),
          k(at(p, 1), dtype(dtypes, 1), s.qk_elems(), "k"),
          v(at(p, 2), dtype(dtypes, 2), s.v_elems(), "v"),
          g(at(p, 3), dtype(dtypes, 3), s.g_elems(), "g"),
          beta(at(p, 4), dtype(dtypes, 4), s.beta_elems(), "beta") {}
    kda::Inputs<T> get(const kda::Shape& s, double scale) {
      return kda::Inputs<T>{q.get(), k.get(), v.get(), g.get(), beta.get(), s, static_cast<T>(scale)};
    }
    static std::uintptr_t at(const std::vector<std::uintptr_t>& p, std::size_t i) {
      if (p.size() != 5) throw InvalidArgument("kda needs 5 input tensors (q, k, v, g, beta)");
      return p[i];
    }
    static const std::string& dtype(const std::vector<std::string>& d, std::size_t i) {
      if (d.size() != 5) throw InvalidArgument("kda needs the dtypes of its 5 input tensors");
      return d[i];
    }
    InputOf<T> q, k, v, g, beta;
  };

  // The pool's policy running `algorithm`.
  ExecPolicy exec_of(kda::Algorithm algorithm) const {
    ExecPolicy exec = pool_.exec();
    exec.algorithm = algorithm;
    return exec;
  }

  // The stream's sequences: the whole stream is `tokens` long (the layout's
  // on a group, the local tensors' on one process).
  kda::Sequences sequences(std::size_t batch, std::size_t tokens,
                           const std::optional<std::vector<std::int64_t>>& cu) const {
    if (cu) return kda::Sequences(batch, tokens, std::span<const std::int64_t>(*cu));
    return kda::Sequences(batch, tokens);
  }

  std::size_t stream_tokens(const kda::Shape& s) const {
    return layout_ ? layout_->tokens() : s.tokens;
  }

  template <class T>
  py::tuple forward_t(const std::vector<std::uintptr_t>& p, const std::vector<std::string>& dtypes,
                      const std::vector<std::size_t>& shape, double scale,
                      const std::optional<std::vector<std::int64_t>>& cu, std::uintptr_t h0p, bool want_ht,
                      kda::Algorithm algorithm, bool keep_forward, bool deterministic) {
    const kda::Shape s = to_shape(shape);
    Tensors<T> tensors(p, dtypes, s);
    // Shape, pointers and scale, before any widening reads the memory.
    kda::validate(kda::Inputs<T>{ptr<T>(p[0]), ptr<T>(p[1]), ptr<T>(p[2]), ptr<T>(p[3]), ptr<T>(p[4]), s,
                                 static_cast<T>(scale)},
                  "kdacp.torch.kda");
    const kda::Sequences seqs = sequences(s.batch, stream_tokens(s), cu);
    const std::size_t n = seqs.count();
    const DType dt = f64_ ? DType::f64 : DType::f32;
    OutputOf<T> o(dtypes[2], {s.batch, s.tokens, s.value_heads, s.value_dim}, "o");
    py::object ht = py::none();
    T* ht_data = nullptr;
    if (want_ht) {
      py::array a = new_array(dt, {n, s.value_heads, s.key_dim, s.value_dim});
      ht_data = mut<T>(a);
      ht = a;
    }
    auto box = std::make_shared<SavedBox>();
    {
      py::gil_scoped_release release;
      const kda::Inputs<T> in = tensors.get(s, scale);
      const auto h0 = kda::sequence_states(ptr<T>(h0p), seqs, s);
      const auto hts = kda::sequence_states(ht_data, seqs, s);
      if (auto* u = ulysses<T>()) {
        // 16-bit inputs travel the all-to-alls as 16 bits, o as v's type.
        if constexpr (std::is_same_v<T, float>) u->wire_types(wire_of(dtypes), parse_half(dtypes[2]));
        u->state_layer().keep_forward(keep_forward);
        u->state_layer().algorithm(algorithm);
        u->state_layer().deterministic(deterministic);
        box->ulysses<T>() = u->forward(in, kda::Stream{seqs, *layout_}, h0, o.get(), hts);
      } else if (auto* l = layer<T>()) {
        l->keep_forward(keep_forward);
        l->algorithm(algorithm);
        l->deterministic(deterministic);
        box->saved = l->forward(in, kda::Stream{seqs, *layout_}, h0, o.get(), hts);
      } else {
        std::shared_ptr<kda::ForwardCache<T>> cache;
        if (keep_forward && algorithm == kda::Algorithm::chunk) cache = caches<T>().acquire();
        kda::forward_sequences(in, seqs, h0, o.get(), hts, exec_of(algorithm), cache.get());
        if (cache) box->saved.emplace().kept<T>() = cache;
      }
      o.finish("kdacp.torch.kda");
    }
    return py::make_tuple(o.array, ht, box);
  }

  template <class T>
  py::tuple backward_t(SavedBox& box, const std::vector<std::uintptr_t>& p,
                       const std::vector<std::string>& dtypes, const std::vector<std::size_t>& shape,
                       double scale, const std::optional<std::vector<std::int64_t>>& cu, std::uintptr_t h0p,
                       std::uintptr_t d_op, const std::string& d_o_dtype, std::uintptr_t dhtp, bool want_dh0,
                       kda::Algorithm algorithm) {
    const kda::Shape s = to_shape(shape);
    Tensors<T> tensors(p, dtypes, s);
    InputOf<T> d_o(d_op, d_o_dtype, s.v_elems(), "d_o");
    const kda::Sequences seqs = sequences(s.batch, stream_tokens(s), cu);
    const std::size_t n = seqs.count();
    const DType dt = f64_ ? DType::f64 : DType::f32;
    OutputOf<T> dq(dtypes[0], {s.batch, s.tokens, s.heads, s.key_dim}, "dq");
    OutputOf<T> dk(dtypes[1], {s.batch, s.tokens, s.heads, s.key_dim}, "dk");
    OutputOf<T> dv(dtypes[2], {s.batch, s.tokens, s.value_heads, s.value_dim}, "dv");
    OutputOf<T> dg(dtypes[3], {s.batch, s.tokens, s.value_heads, s.key_dim}, "dg");
    OutputOf<T> dbeta(dtypes[4], {s.batch, s.tokens, s.value_heads}, "dbeta");
    py::object dh0 = py::none();
    T* dh0_data = nullptr;
    if (want_dh0) {
      py::array a = new_array(dt, {n, s.value_heads, s.key_dim, s.value_dim});
      dh0_data = mut<T>(a);
      dh0 = a;
    }
    const kda::Grads<T> grads{dq.get(), dk.get(), dv.get(), dg.get(), dbeta.get(), nullptr};
    {
      py::gil_scoped_release release;
      const kda::Inputs<T> in = tensors.get(s, scale);
      const auto h0 = kda::sequence_states(ptr<T>(h0p), seqs, s);
      const auto dht = kda::sequence_states(ptr<T>(dhtp), seqs, s);
      const auto dh0s = kda::sequence_states(dh0_data, seqs, s);
      if (auto* u = ulysses<T>()) {
        if (!box.ulysses<T>()) throw InvalidArgument("kda backward without the forward's saved state");
        // The gradients travel as their inputs' types, d_o as its own.
        if constexpr (std::is_same_v<T, float>) u->wire_types(wire_of(dtypes), parse_half(d_o_dtype));
        u->state_layer().algorithm(algorithm);
        u->backward(in, *box.ulysses<T>(), h0, d_o.get(), dht, grads, dh0s);
      } else if (auto* l = layer<T>()) {
        if (!box.saved) throw InvalidArgument("kda backward without the forward's saved state");
        l->algorithm(algorithm);
        l->backward(in, *box.saved, h0, d_o.get(), dht, grads, dh0s);
      } else {
        kda::backward_sequences(in, seqs, h0, d_o.get(), dht, grads, dh0s, exec_of(algorithm),
                                kda::kDefaultCheckpointInterval, box.kept<T>());
      }
      box.release_kept<T>();
      for (OutputOf<T>* out : {&dq, &dk, &dv, &dg, &dbeta}) out->finish("kdacp.torch.kda backward");
    }
    return py::make_tuple(dq.array, dk.array, dv.array, dg.array, dbeta.array, dh0);
  }

  Pool pool_;
  bool f64_;
  std::shared_ptr<Communicator> comm_;
  std::optional<DeviceMesh> mesh_;
  std::optional<kda::Layout> layout_;
  std::unique_ptr<kda::ContextParallelLayer<float>> layer_f32_;
  std::unique_ptr<kda::ContextParallelLayer<double>> layer_f64_;
  std::unique_ptr<kda::UlyssesLayer<float>> ulysses_f32_;
  std::unique_ptr<kda::UlyssesLayer<double>> ulysses_f64_;
  kda::ForwardCachePool<float> caches_f32_;  // the one-process path's
  kda::ForwardCachePool<double> caches_f64_;
};

// The in-kernel input transforms of chunk_kda (kdacp/kda.hpp), on contiguous
// tensors' memory (addresses and storage dtypes from Python), results in new
// arrays: T = float64 for float64 inputs, else float32 (16-bit inputs
// widened). A transform's result feeds the layer, so it is stored as T; the
// gradient of an input is stored as that input. The loops run without the GIL.
bool is_f64(const std::string& dtype) {
  if (dtype == "float64") return true;
  if (dtype == "float32") return false;
  throw InvalidArgument(fmt::format("kda transform dtype {}, expected float32 or float64", dtype));
}

const char* name_of(bool f64) { return f64 ? "float64" : "float32"; }

template <class T>
py::tuple gate_t(std::uintptr_t raw, const std::string& raw_dtype, std::uintptr_t a_log,
                 const std::string& a_log_dtype, std::uintptr_t dt_bias, const std::string& dt_bias_dtype,
                 std::size_t tokens, std::size_t heads, std::size_t key_dim, std::optional<double> lower_bound,
                 std::uintptr_t d_g) {
  const char* t_name = name_of(std::is_same_v<T, double>);
  InputOf<T> raw_in(raw, raw_dtype, tokens * heads * key_dim, "g");
  InputOf<T> a_in(a_log, a_log ? a_log_dtype : t_name, heads, "A_log");
  InputOf<T> b_in(dt_bias, dt_bias ? dt_bias_dtype : t_name, heads * key_dim, "dt_bias");
  auto params = [&] {
    return kda::GateParams<T>{a_in.get(), b_in.get(), lower_bound.has_value(), lower_bound.value_or(0.0)};
  };
  if (d_g == 0) {
    OutputOf<T> g(t_name, {tokens, heads, key_dim}, "g");
    {
      py::gil_scoped_release release;
      kda::gate_forward(raw_in.get(), params(), tokens, heads, key_dim, g.get());
    }
    return py::make_tuple(g.array);
  }
  OutputOf<T> d_raw(raw_dtype, {tokens, heads, key_dim}, "dg");
  std::optional<OutputOf<T>> da, db;
  if (a_log) da.emplace(a_log_dtype, std::vector<std::size_t>{heads}, "dA_log");
  if (dt_bias) db.emplace(dt_bias_dtype, std::vector<std::size_t>{heads * key_dim}, "ddt_bias");
  {
    py::gil_scoped_release release;
    kda::gate_backward(raw_in.get(), params(), tokens, heads, key_dim, ptr<T>(d_g), d_raw.get(),
                       da ? da->get() : nullptr, db ? db->get() : nullptr);
    d_raw.finish("chunk_kda backward");
    if (da) da->finish("chunk_kda backward");
    if (db) db->finish("chunk_kda backward");
  }
  return py::make_tuple(d_raw.array, da ? py::object(da->array) : py::none(),
                        db ? py::object(db->array) : py::none());
}

py::tuple kda_gate(std::uintptr_t raw, const std::string& raw_dtype, std::uintptr_t a_log,
                   const std::string& a_log_dtype, std::uintptr_t dt_bias, const std::string& dt_bias_dtype,
                   std::size_t tokens, std::size_t heads, std::size_t key_dim, std::optional<double> lower_bound,
                   const std::string& dtype, std::uintptr_t d_g) {
  return is_f64(dtype) ? gate_t<double>(raw, raw_dtype, a_log, a_log_dtype, dt_bias, dt_bias_dtype, tokens,
                                        heads, key_dim, lower_bound, d_g)
                       : gate_t<float>(raw, raw_dtype, a_log, a_log_dtype, dt_bias, dt_bias_dtype, tokens,
                                       heads, key_dim, lower_bound, d_g);
}

template <class T>
py::tuple l2norm_t(std::uintptr_t x, const std::string& x_dtype, std::size_t rows, std::size_t dim) {
  const char* t_name = name_of(std::is_same_v<T, double>);
  InputOf<T> in(x, x_dtype, rows * dim, "x");
  OutputOf<T> y(t_name, {rows, dim}, "y");
  OutputOf<T> rstd(t_name, {rows}, "rstd");
  {
    py::gil_scoped_release release;
    kda::l2norm_forward(in.get(), rows, dim, y.get(), rstd.get());
  }
  return py::make_tuple(y.array, rstd.array);
}

template <class T>
py::array l2norm_backward_t(std::uintptr_t y, std::uintptr_t rstd, std::uintptr_t d_y, std::size_t rows,
                            std::size_t dim, const std::string& dx_dtype) {
  OutputOf<T> dx(dx_dtype, {rows, dim}, "dx");
  {
    py::gil_scoped_release release;
    kda::l2norm_backward(ptr<T>(y), ptr<T>(rstd), ptr<T>(d_y), rows, dim, dx.get());
    dx.finish("chunk_kda backward (l2norm)");
  }
  return dx.array;
}

template <class T>
py::array sigmoid_t(std::uintptr_t x, const std::string& x_dtype, std::uintptr_t d_y, std::size_t n) {
  InputOf<T> in(x, x_dtype, n, "beta");
  OutputOf<T> out(d_y == 0 ? name_of(std::is_same_v<T, double>) : x_dtype.c_str(), {n}, "beta");
  {
    py::gil_scoped_release release;
    if (d_y == 0)
      kda::sigmoid_forward(in.get(), n, out.get());
    else
      kda::sigmoid_backward(in.get(), ptr<T>(d_y), n, out.get());
    out.finish("chunk_kda backward (beta sigmoid)");
  }
  return out.array;
}

}  // namespace

void bind_kda(py::module_& m) {
  // The C++ layout value (kdacp/layout.hpp): Python reads its parts instead
  // of restating the zigzag or contiguous rule.
  py::class_<Layout>(m, "Layout")
      .def_static(
          "contiguous",
          [](std::size_t tokens, std::size_t ranks, const std::vector<std::size_t>& counts) {
            return Layout::contiguous(tokens, ranks, counts);
          },
          py::arg("tokens"), py::arg("ranks"), py::arg("counts") = std::vector<std::size_t>{})
      .def_static("zigzag", &Layout::zigzag, py::arg("tokens"), py::arg("ranks"))
      .def_property_readonly("ranks", &Layout::ranks)
      .def_property_readonly("tokens", &Layout::tokens)
      .def_property_readonly("owners", [](const Layout& l) { return l.owners().list(); })
      .def_property_readonly("parts",
                             [](const Layout& l) {
                               std::vector<std::tuple<std::size_t, std::size_t, std::size_t>> out;
                               for (const LayoutPart& p : l.parts()) out.emplace_back(p.rank, p.begin, p.end);
                               return out;
                             })
      .def(
          "cuts",
          [](const Layout& l, const std::vector<std::int64_t>& cu_seqlens) {
            return l.cuts(kda::Sequences(1, l.tokens(), std::span<const std::int64_t>(cu_seqlens)));
          },
          py::arg("cu_seqlens"))
      .def("local_tokens", &Layout::local_tokens, py::arg("rank"))
      .def("local_parts",
           [](const Layout& l, std::size_t rank) {
             std::vector<std::pair<std::size_t, std::size_t>> out;
             for (const Part& p : l.local_parts(rank)) out.emplace_back(p.begin, p.end);
             return out;
           },
           py::arg("rank"))
      .def("__str__", &Layout::str)
      .def("__repr__", [](const Layout& l) { return fmt::format("<kdacp Layout {}>", l.str()); });
  // ulysses="auto": the cost model's width for the layer of `shape` (B, H,
  // HV, K, V) on `layout` with `options` (job::choose_ulysses, as `kdacp kda
  // --ulysses auto` and `kdacp plan --tokens-per-rank`).
  m.def(
      "choose_ulysses",
      [](const std::vector<std::size_t>& shape, const Layout& layout, const ExchangeOptions& options,
         std::size_t elem_bytes) {
        if (shape.size() != 5) throw InvalidArgument("choose_ulysses shape needs 5 entries (B, H, HV, K, V)");
        const kda::Shape s{shape[0], layout.tokens(), shape[1], shape[2], shape[3], shape[4]};
        kda::validate(s);
        return job::choose_ulysses(s, layout, options, elem_bytes);
      },
      py::arg("shape"), py::arg("layout"), py::arg("options"), py::arg("elem_bytes"));
  py::class_<SavedBox, std::shared_ptr<SavedBox>>(m, "KdaSaved");
  py::class_<KdaLayer>(m, "KdaLayer")
      .def(py::init<py::object, const std::string&, long long, const std::optional<Layout>&,
                    const std::string&, ExchangeOptions, std::size_t, std::size_t>(),
           py::arg("backend"), py::arg("method"), py::arg("group_size"), py::arg("layout"),
           py::arg("dtype"), py::arg("options"), py::arg("threads"), py::arg("ulysses") = 1)
      .def("forward", &KdaLayer::forward, py::arg("inputs"), py::arg("dtypes"), py::arg("shape"), py::arg("scale"),
           py::arg("cu_seqlens"), py::arg("h0"), py::arg("want_ht"),
           py::arg("algorithm") = kda::algorithm_name(defaults::kAlgorithm),
           py::arg("keep_forward") = defaults::kKeepForward,
           py::arg("deterministic") = defaults::kDeterministic)
      .def("backward", &KdaLayer::backward, py::arg("saved"), py::arg("inputs"), py::arg("dtypes"),
           py::arg("shape"), py::arg("scale"), py::arg("cu_seqlens"), py::arg("h0"), py::arg("d_o"),
           py::arg("d_o_dtype"), py::arg("dht"),
           py::arg("want_dh0"), py::arg("algorithm") = kda::algorithm_name(defaults::kAlgorithm))
      .def("agree_per_call", &KdaLayer::agree_per_call, py::arg("on"))
      .def_property_readonly("method", &KdaLayer::method)
      .def_property_readonly("exact", &KdaLayer::exact)
      .def_property_readonly("ulysses", &KdaLayer::ulysses_width)
      .def_property_readonly("wire_types", &KdaLayer::wire_types)
      .def("times", &KdaLayer::times, py::arg("forward"))
      .def_property_readonly("forward_cache_bytes", &KdaLayer::forward_cache_bytes);
  // d_g 0: the gate (one array); otherwise its backward: (d_raw, d_a_log or
  // None, d_dt_bias or None). a_log / dt_bias 0: not given. `dtype`: the
  // compute dtype (float32 or float64); the *_dtype arguments: storage.
  m.def("kda_gate", &kda_gate, py::arg("raw"), py::arg("raw_dtype"), py::arg("a_log"), py::arg("a_log_dtype"),
        py::arg("dt_bias"), py::arg("dt_bias_dtype"), py::arg("tokens"), py::arg("heads"), py::arg("key_dim"),
        py::arg("lower_bound"), py::arg("dtype"), py::arg("d_g") = 0);
  m.def(
      "kda_l2norm",
      [](std::uintptr_t x, const std::string& x_dtype, std::size_t rows, std::size_t dim,
         const std::string& dtype) {
        return is_f64(dtype) ? l2norm_t<double>(x, x_dtype, rows, dim) : l2norm_t<float>(x, x_dtype, rows, dim);
      },
      py::arg("x"), py::arg("x_dtype"), py::arg("rows"), py::arg("dim"), py::arg("dtype"));
  // y, rstd and d_y in the compute dtype; d_x stored as dx_dtype (x's).
  m.def(
      "kda_l2norm_backward",
      [](std::uintptr_t y, std::uintptr_t rstd, std::uintptr_t d_y, std::size_t rows, std::size_t dim,
         const std::string& dtype, const std::string& dx_dtype) {
        return is_f64(dtype) ? l2norm_backward_t<double>(y, rstd, d_y, rows, dim, dx_dtype)
                             : l2norm_backward_t<float>(y, rstd, d_y, rows, dim, dx_dtype);
      },
      py::arg("y"), py::arg("rstd"), py::arg("d_y"), py::arg("rows"), py::arg("dim"), py::arg("dtype"),
      py::arg("dx_dtype"));
  // d_y 0: sigmoid(x) in the compute dtype; otherwise d_y · sigmoid'(x)
  // stored as x.
  m.def(
      "kda_sigmoid",
      [](std::uintptr_t x, const std::string& x_dtype, std::size_t n, const std::string& dtype,
         std::uintptr_t d_y) {
        return is_f64(dtype) ? sigmoid_t<double>(x, x_dtype, d_y, n) : sigmoid_t<float>(x, x_dtype, d_y, n);
      },
      py::arg("x"), py::arg("x_dtype"), py::arg("n"), py::arg("dtype"), py::arg("d_y") = 0);
}

}  // namespace kdacp::python
