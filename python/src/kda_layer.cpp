// kdacp._kdacp.KdaLayer, the layer behind kdacp.torch.kda and chunk_kda: it
// turns each call's arguments into a LayerConfig (kdacp/layer.hpp) and runs
// the layer make_layer builds for it (one process, state CP or Ulysses ×
// state CP: the binding never chooses). A layer is built once per distinct
// config and reused; building one is collective on a group (it agrees on
// the config), so every rank makes the same calls in the same order: a
// group call without a context first agrees on its arguments here
// (agree_layer_call), a context's calls are held to its first one.
// The autograd wiring is Python's; this file runs the C++ forward and
// backward on the tensors' memory with the GIL released.
#include <pybind11/stl.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstring>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "binding.hpp"
#include "kda/sequences.hpp"
#include "kdacp/agreement.hpp"
#include "kdacp/error.hpp"
#include "kdacp/half.hpp"
#include "kdacp/kda.hpp"
#include "kdacp/layer.hpp"
#include "kdacp/layout.hpp"
#include "torch_comm.hpp"

namespace py = pybind11;

namespace kdacp::python {
namespace {

kda::Shape to_shape(const std::vector<std::size_t>& s) {
  if (s.size() != 6) throw InvalidArgument("kda shape needs 6 entries (B, T, H, HV, K, V)");
  return kda::Shape{s[0], s[1], s[2], s[3], s[4], s[5]};
}

template <class T>
T* mut(py::array& a) {
  return static_cast<T*>(a.mutable_data());
}

// What forward keeps for backward: the layer that ran it (the backward runs
// on the same one) and its saved state. The first backward lets the forward
// cache go (release_forward_cache): the layer's pool hands it to the next
// forward while autograd still holds this box (the previous step's graph
// lives until its output is dropped), so a training loop reuses one cache.
struct SavedBox {
  std::shared_ptr<void> layer;  // Layer<float> or Layer<double>
  std::shared_ptr<LayerSaved> saved;
  bool in_place = false;  // 16-bit inputs read in place (reads_in_place)
};

// Whether a layer's kernels read 16-bit inputs in place: the chunk kernels
// do; the recurrent ones and the Ulysses all-to-all take T (widened).
template <class T>
bool reads_in_place(const Layer<T>& layer, kda::Algorithm algorithm) {
  return std::is_same_v<T, float> && algorithm == kda::Algorithm::chunk && layer.ulysses_width() == 1;
}

// q, k, v, g, beta as T: 16-bit ones read in place by the chunk kernels
// (`in_place`), else widened on first use (without the GIL).
template <class T>
struct Tensors {
  Tensors(const std::vector<std::uintptr_t>& p, const std::vector<std::string>& dtypes, const kda::Shape& s)
      : q(at(p, 0), dtype(dtypes, 0), s.qk_elems(), "q"),
        k(at(p, 1), dtype(dtypes, 1), s.qk_elems(), "k"),
        v(at(p, 2), dtype(dtypes, 2), s.v_elems(), "v"),
        g(at(p, 3), dtype(dtypes, 3), s.g_elems(), "g"),
        beta(at(p, 4), dtype(dtypes, 4), s.beta_elems(), "beta") {}
  kda::Inputs<T> get(const kda::Shape& s, double scale, bool in_place) {
    kda::Inputs<T> in{nullptr, nullptr, nullptr, nullptr, nullptr, s, static_cast<T>(scale)};
    const auto field = [&](InputOf<T>& from, const T*& wide, HalfField& half) {
      half = in_place ? from.half() : HalfField{};
      if (!half.bits) wide = from.get();
    };
    field(q, in.q, in.half.q);
    field(k, in.k, in.half.k);
    field(v, in.v, in.half.v);
    field(g, in.g, in.half.g);
    field(beta, in.beta, in.half.beta);
    return in;
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

// A key for `config`: the hashes of the fields make_layer agrees on.
std::uint64_t config_key(const LayerConfig& config, std::size_t ranks) {
  std::uint64_t h = kFnvOffset;
  const Fingerprint fields = layer_fingerprint(config, ranks, config.ulysses);
  for (const Fingerprint::Field& f : fields.fields()) {
    h = fnv1a64(f.name, h);
    h = fnv1a64(std::as_bytes(std::span(&f.hash, 1)), h);
  }
  return h;
}

class KdaLayer {
 public:
  // backend None: one process, the whole stream local. Otherwise the layer
  // over the group: with `layout` (kdacp.Layout, built by the caller once
  // per context, spanning the group's ranks), or, without one, a layout of
  // kind `layout_kind` whose split is each call's tokens per rank, agreed on
  // with the call's arguments (kda(group=...)). ulysses: the Ulysses width
  // (1: state CP alone; 0: the cost model's). method, group_size, options:
  // the state exchange's.
  KdaLayer(py::object backend, std::string method, long long group_size, const std::optional<Layout>& layout,
           const std::string& dtype, ExchangeOptions options, std::size_t threads, std::size_t ulysses,
           const std::string& layout_kind)
      : pool_(threads), f64_(dtype == "float64") {
    base_.protocol = std::move(method);
    base_.group_size = group_size;
    base_.exchange = std::move(options);
    base_.ulysses = ulysses;
    base_.names = LayerNames::python();
    base_.layout = parse_layout_kind(layout_kind, base_.names.layout);
    base_.pool = pool_.pool.get();
    if (backend.is_none()) {
      base_.protocol = "auto";  // one process exchanges nothing (kdacp.torch passes "none")
      if (ulysses != 1) throw InvalidArgument(fmt::format("ulysses={} needs a group, got one process", ulysses));
      return;
    }
    comm_ = std::make_shared<TorchCommunicator>(std::move(backend));
    if (layout) {
      base_.parts = *layout;
    } else {
      // The layout's messages then speak of what the user passed.
      base_.names.tokens = "the group's tokens (each rank's T summed)";
      base_.names.split = "tokens per rank (each rank's T)";
    }
  }

  // `algorithm`: "recurrent" or "chunk". keep_forward: the chunk forward
  // keeps what its backward would recompute. deterministic: the CP layer's
  // deterministic mode (one process runs that mode's bytes anyway).
  // `dtypes`: the storage of q, k, v, g, beta (o is stored as v); the
  // states are in the layer's dtype (float32 for 16-bit inputs).
  py::tuple forward(const std::vector<std::uintptr_t>& inputs, const std::vector<std::string>& dtypes,
                    const std::vector<std::size_t>& shape, double scale,
                    const std::optional<std::vector<std::int64_t>>& cu_seqlens, std::uintptr_t h0, bool want_ht,
                    const std::string& algorithm, bool keep_forward, bool deterministic) {
    return f64_ ? forward_t<double>(inputs, dtypes, shape, scale, cu_seqlens, h0, want_ht, algorithm, keep_forward,
                                    deterministic)
                : forward_t<float>(inputs, dtypes, shape, scale, cu_seqlens, h0, want_ht, algorithm, keep_forward,
                                   deterministic);
  }

  // The gradients of q, k, v, g, beta are stored as those inputs; d_o as
  // `d_o_dtype`. The layer is the forward's (`saved`).
  py::tuple backward(const std::shared_ptr<SavedBox>& saved, const std::vector<std::uintptr_t>& inputs,
                     const std::vector<std::string>& dtypes, const std::vector<std::size_t>& shape, double scale,
                     std::uintptr_t h0, std::uintptr_t d_o, const std::string& d_o_dtype, std::uintptr_t dht,
                     bool want_dh0) {
    return f64_ ? backward_t<double>(*saved, inputs, dtypes, shape, scale, h0, d_o, d_o_dtype, dht, want_dh0)
                : backward_t<float>(*saved, inputs, dtypes, shape, scale, h0, d_o, d_o_dtype, dht, want_dh0);
  }

  // chunk_kda's in-kernel transforms of the following calls' inputs (run
  // by kdacp.torch around the layer): part of their layer's config, agreed
  // with its construction.
  void transforms(bool qk_l2norm, bool gate, std::optional<double> lower_bound, bool a_log, bool dt_bias,
                  bool beta_sigmoid, bool allow_neg_eigval) {
    base_.transforms =
        InputTransforms{qk_l2norm, gate, lower_bound, a_log, dt_bias, beta_sigmoid, allow_neg_eigval};
  }

  // Off: the layers' first forward and first backward agree on the call's
  // arguments, later ones send nothing (a cp_context holds its calls to its
  // first call's arguments, checked locally).
  void agree_per_call(bool on) {
    base_.agree_calls = on ? LayerConfig::CallAgreement::every_call : LayerConfig::CallAgreement::first_call;
    layers_f32_.clear();
    layers_f64_.clear();
    order_.clear();
  }

  // Of the layer of the last call ("none", exact, width 1 before any).
  std::string method() const { return with_last([](const auto& l) { return l.method(); }, std::string("none")); }
  bool exact() const { return with_last([](const auto& l) { return l.exact(); }, true); }
  std::size_t ulysses_width() const { return with_last([](const auto& l) { return l.ulysses_width(); }, 1); }
  // "bfloat16", "float16" or None per tensor on the Ulysses all-to-alls (q,
  // k, v, g, beta, then o / d_o); empty without Ulysses.
  std::vector<std::optional<std::string>> wire_types() const {
    std::vector<std::optional<std::string>> out;
    for (const auto& w : with_last([](const auto& l) { return l.wire_types(); }, std::vector<std::optional<Half>>{}))
      out.push_back(w ? std::optional<std::string>(half_name(*w)) : std::nullopt);
    return out;
  }
  // Seconds of the last forward / backward: (local, exchange).
  py::tuple times(bool forward) const {
    return with_last(
        [&](const auto& l) {
          const kda::PhaseTimes& t = forward ? l.forward_times() : l.backward_times();
          return py::make_tuple(t.local, t.exchange);
        },
        py::make_tuple(0.0, 0.0));
  }
  // Bytes of the forward caches every layer holds (in use or for reuse).
  std::size_t forward_cache_bytes() const {
    std::size_t n = 0;
    for (const auto& [key, l] : layers_f32_) n += l->forward_cache_bytes();
    for (const auto& [key, l] : layers_f64_) n += l->forward_cache_bytes();
    return n;
  }

 private:
  template <class T>
  std::map<std::uint64_t, std::shared_ptr<Layer<T>>>& layers() {
    if constexpr (std::is_same_v<T, double>) return layers_f64_;
    else return layers_f32_;
  }

  template <class F, class R>
  R with_last(F&& f, R none) const {
    if (last_f32_) return f(*last_f32_);
    if (last_f64_) return f(*last_f64_);
    return none;
  }

  // The config of a call on this layer's settings (T: this rank's tokens
  // until agree_layer_call, or the context's).
  LayerConfig call_config(const kda::Shape& local, const std::vector<std::string>& dtypes,
                          const std::optional<std::vector<std::int64_t>>& cu, kda::Algorithm algorithm,
                          bool keep_forward, bool deterministic) const {
    LayerConfig c = base_;
    c.shape = local;
    if (c.parts) c.shape.tokens = c.parts->tokens();
    if (cu) c.cu_seqlens = *cu;
    for (std::size_t i = 0; i < 5; ++i) c.storage[i] = parse_half(dtypes[i]);
    c.out_storage = c.storage[2];  // o (and d_o) as v
    c.algorithm = algorithm;
    c.keep_forward = keep_forward;
    c.deterministic = deterministic;
    return c;
  }

  template <class T>
  void forget(std::uint64_t key) {
    layers<T>().erase(key);
    order_.erase(std::remove(order_.begin(), order_.end(), key), order_.end());
  }

  // The layer of config `c`: built (collectively on a group) the first
  // time the config is seen.
  template <class T>
  std::shared_ptr<Layer<T>> layer_for(const LayerConfig& c, std::optional<std::uint64_t>& built) {
    const std::uint64_t key = config_key(c, comm_ ? comm_->size() : 1);
    std::shared_ptr<Layer<T>>& slot = layers<T>()[key];
    if (!slot) {
      built = key;
      try {
        slot = make_layer<T>(comm_, c);
      } catch (...) {
        layers<T>().erase(key);
        throw;
      }
      // At most kMaxLayers configs (a packing per batch would otherwise keep
      // one per step): the oldest goes first, the same one on every rank, as
      // every rank builds the same configs in the same order. A forward's
      // saved box keeps its layer alive for its backward.
      order_.push_back(key);
      if (order_.size() > kMaxLayers) {
        layers<T>().erase(order_.front());
        order_.erase(order_.begin());
      }
    }
    if constexpr (std::is_same_v<T, double>) last_f64_ = slot, last_f32_.reset();
    else last_f32_ = slot, last_f64_.reset();
    return slot;
  }

  template <class T>
  py::tuple forward_t(const std::vector<std::uintptr_t>& p, const std::vector<std::string>& dtypes,
                      const std::vector<std::size_t>& shape, double scale,
                      const std::optional<std::vector<std::int64_t>>& cu, std::uintptr_t h0p, bool want_ht,
                      const std::string& algorithm, bool keep_forward, bool deterministic) {
    const kda::Shape s = to_shape(shape);
    // A group call without a layout agrees on its arguments and gathers the
    // ranks' token counts (agree_layer_call) before its layer is chosen;
    // this rank's own errors travel in that agreement.
    const bool per_call = comm_ && !base_.parts;
    std::optional<Tensors<T>> tensors;
    LayerConfig c;
    std::string error;
    try {
      tensors.emplace(p, dtypes, s);
      // Shape, pointers and scale, before any widening reads the memory.
      kda::validate(kda::Inputs<T>{ptr<T>(p[0]), ptr<T>(p[1]), ptr<T>(p[2]), ptr<T>(p[3]), ptr<T>(p[4]), s,
                                   static_cast<T>(scale)},
                    "kdacp.torch.kda");
      c = call_config(s, dtypes, cu, kda::parse_algorithm(algorithm.c_str()), keep_forward, deterministic);
    } catch (const InvalidArgument& e) {
      if (!per_call) throw;
      error = e.what();
    }
    auto box = std::make_shared<SavedBox>();
    std::shared_ptr<Layer<T>> layer;
    std::optional<std::uint64_t> built;  // the key of a layer built by this call
    {
      py::gil_scoped_release release;  // the agreement and a layer's construction are collective
      if (per_call) {
        Fingerprint call;
        call.add_real(base_.names.scale, scale);
        call.add_flag(base_.names.h0, h0p != 0);
        call.add_flag(base_.names.ht, want_ht);
        c = agree_layer_call(comm_, std::move(c), f64_ ? "float64" : "float32", call, "kdacp.torch.kda", error);
      }
      layer = layer_for<T>(c, built);
    }
    box->layer = layer;
    const kda::Sequences& seqs = layer->sequences();
    OutputOf<T> o(dtypes[2], {s.batch, s.tokens, s.value_heads, s.value_dim}, "o");
    py::object ht = py::none();
    T* ht_data = nullptr;
    if (want_ht) {
      py::array arr = new_array(f64_ ? DType::f64 : DType::f32, {seqs.count(), s.value_heads, s.key_dim, s.value_dim});
      ht_data = mut<T>(arr);
      ht = arr;
    }
    {
      py::gil_scoped_release release;
      try {
        box->in_place = reads_in_place(*layer, c.algorithm);
        box->saved = layer->forward(tensors->get(s, scale, box->in_place), kda::sequence_states(ptr<T>(h0p), seqs, s), o.get(),
                                    kda::sequence_states(ht_data, seqs, s));
      } catch (...) {
        // Every rank built it in this call (its construction agreed), and
        // every rank's first forward failed alike: dropping it on each keeps
        // the caches in step, so the next call builds (and agrees) on every
        // rank instead of one rank building while another runs.
        if (built) forget<T>(*built);
        throw;
      }
      o.finish("kdacp.torch.kda");
    }
    return py::make_tuple(o.array, ht, box);
  }

  template <class T>
  py::tuple backward_t(SavedBox& box, const std::vector<std::uintptr_t>& p, const std::vector<std::string>& dtypes,
                       const std::vector<std::size_t>& shape, double scale, std::uintptr_t h0p, std::uintptr_t d_op,
                       const std::string& d_o_dtype, std::uintptr_t dhtp, bool want_dh0) {
    if (!box.layer || !box.saved) throw InvalidArgument("kda backward without the forward's saved state");
    Layer<T>& layer = *std::static_pointer_cast<Layer<T>>(box.layer);
    const kda::Shape s = to_shape(shape);
    Tensors<T> tensors(p, dtypes, s);
    InputOf<T> d_o(d_op, d_o_dtype, s.v_elems(), "d_o");
    const kda::Sequences& seqs = layer.sequences();
    OutputOf<T> dq(dtypes[0], {s.batch, s.tokens, s.heads, s.key_dim}, "dq");
    OutputOf<T> dk(dtypes[1], {s.batch, s.tokens, s.heads, s.key_dim}, "dk");
    OutputOf<T> dv(dtypes[2], {s.batch, s.tokens, s.value_heads, s.value_dim}, "dv");
    OutputOf<T> dg(dtypes[3], {s.batch, s.tokens, s.value_heads, s.key_dim}, "dg");
    OutputOf<T> dbeta(dtypes[4], {s.batch, s.tokens, s.value_heads}, "dbeta");
    py::object dh0 = py::none();
    T* dh0_data = nullptr;
    if (want_dh0) {
      py::array arr = new_array(f64_ ? DType::f64 : DType::f32, {seqs.count(), s.value_heads, s.key_dim, s.value_dim});
      dh0_data = mut<T>(arr);
      dh0 = arr;
    }
    const kda::Grads<T> grads{dq.get(), dk.get(), dv.get(), dg.get(), dbeta.get(), nullptr};
    {
      py::gil_scoped_release release;
      layer.backward(tensors.get(s, scale, box.in_place), *box.saved, kda::sequence_states(ptr<T>(h0p), seqs, s), d_o.get(),
                     kda::sequence_states(ptr<T>(dhtp), seqs, s), grads, kda::sequence_states(dh0_data, seqs, s));
      release_forward_cache(*box.saved);
      // The layer's dh0 is complete on every rank (its C++ contract, the
      // CLI's); kdacp.torch hands each rank its share (keep_started_rows).
      if (dh0_data && layer.ranks() > 1)
        keep_started_rows(dh0_data, s.value_heads * s.key_dim * s.value_dim, layer.layout(), layer.rank(), seqs);
      for (OutputOf<T>* out : {&dq, &dk, &dv, &dg, &dbeta}) out->finish("kdacp.torch.kda backward");
    }
    return py::make_tuple(dq.array, dk.array, dv.array, dg.array, dbeta.array, dh0);
  }

  static constexpr std::size_t kMaxLayers = 8;
  Pool pool_;
  bool f64_;
  std::vector<std::uint64_t> order_;  // the layers' keys, oldest first
  LayerConfig base_;  // the settings every call shares
  std::shared_ptr<Communicator> comm_;
  std::map<std::uint64_t, std::shared_ptr<Layer<float>>> layers_f32_;
  std::map<std::uint64_t, std::shared_ptr<Layer<double>>> layers_f64_;
  std::shared_ptr<Layer<float>> last_f32_;
  std::shared_ptr<Layer<double>> last_f64_;
};

}  // namespace

void bind_kda_layer(py::module_& m) {
  // kdacp.torch.build_cp_context's one validation and agreement
  // (agree_layer_context): backend None for one process; ulysses 0: auto;
  // local_error: this rank's own argument error, shared with the others.
  // A rank whose call's arguments failed its own checks before reaching the
  // layer: one agreement with that error, which its peers (in their layer's
  // construction or first call) fail with instead of waiting for it.
  m.def(
      "reject_call",
      [](py::object backend, const std::string& what, const std::string& error) {
        const auto comm = std::make_shared<TorchCommunicator>(std::move(backend));
        Fingerprint f;
        f.add_text("call", "rejected");
        py::gil_scoped_release release;
        agree(*comm, f, what, error);
      },
      py::arg("backend"), py::arg("what"), py::arg("error"));
  m.def(
      "agree_context",
      [](py::object backend, std::size_t tokens, const std::optional<std::vector<std::int64_t>>& cu_seqlens,
         const std::string& layout, const std::vector<std::size_t>& split, const std::string& protocol,
         long long group_size, ExchangeOptions options, std::size_t ulysses, std::optional<std::size_t> conv,
         const std::string& local_error) {
        LayerConfig c;
        c.names = LayerNames::python();
        c.shape.batch = 1;  // cu_seqlens packs one row; B is a call's, not the context's
        c.shape.tokens = tokens;
        if (cu_seqlens) c.cu_seqlens = *cu_seqlens;
        c.layout = parse_layout_kind(layout, c.names.layout);
        c.split = split;
        c.protocol = protocol;
        c.group_size = group_size;
        c.exchange = std::move(options);
        c.ulysses = ulysses;
        c.conv_width = conv;
        std::shared_ptr<Communicator> comm;
        if (!backend.is_none()) comm = std::make_shared<TorchCommunicator>(std::move(backend));
        py::gil_scoped_release release;
        return agree_layer_context(comm, c, "build_cp_context", local_error);
      },
      py::arg("backend"), py::arg("tokens"), py::arg("cu_seqlens"), py::arg("layout"), py::arg("split"),
      py::arg("protocol"), py::arg("group_size"), py::arg("options"), py::arg("ulysses"), py::arg("conv"),
      py::arg("local_error") = std::string());
  py::class_<SavedBox, std::shared_ptr<SavedBox>>(m, "KdaSaved")
      // The state entering each of this rank's parts (chain order), copied:
      // [B,HV,K,V] arrays in the layer's dtype (incoming_states).
      .def("incoming", [](const SavedBox& box) {
        if (!box.saved) throw InvalidArgument("KdaSaved.incoming: no forward ran");
        py::list out;
        for (const State& st : incoming_states(*box.saved)) {
          py::array a = new_array(st.dtype(), {st.batch(), st.heads(), st.rows(), st.cols()});
          std::memcpy(a.mutable_data(), st.data<std::byte>(), st.bytes());
          out.append(a);
        }
        return out;
      });
  py::class_<KdaLayer>(m, "KdaLayer")
      .def(py::init<py::object, std::string, long long, const std::optional<Layout>&, const std::string&,
                    ExchangeOptions, std::size_t, std::size_t, const std::string&>(),
           py::arg("backend"), py::arg("method"), py::arg("group_size"), py::arg("layout"), py::arg("dtype"),
           py::arg("options"), py::arg("threads"), py::arg("ulysses") = 1, py::arg("layout_kind") = "contiguous")
      .def("forward", &KdaLayer::forward, py::arg("inputs"), py::arg("dtypes"), py::arg("shape"), py::arg("scale"),
           py::arg("cu_seqlens"), py::arg("h0"), py::arg("want_ht"),
           py::arg("algorithm") = kda::algorithm_name(defaults::kAlgorithm),
           py::arg("keep_forward") = defaults::kKeepForward, py::arg("deterministic") = defaults::kDeterministic)
      .def("transforms", &KdaLayer::transforms, py::arg("qk_l2norm"), py::arg("gate"), py::arg("lower_bound"),
           py::arg("a_log"), py::arg("dt_bias"), py::arg("beta_sigmoid"), py::arg("allow_neg_eigval") = false)
      .def("backward", &KdaLayer::backward, py::arg("saved"), py::arg("inputs"), py::arg("dtypes"), py::arg("shape"),
           py::arg("scale"), py::arg("h0"), py::arg("d_o"), py::arg("d_o_dtype"), py::arg("dht"), py::arg("want_dh0"))
      .def("agree_per_call", &KdaLayer::agree_per_call, py::arg("on"))
      .def_property_readonly("method", &KdaLayer::method)
      .def_property_readonly("exact", &KdaLayer::exact)
      .def_property_readonly("ulysses", &KdaLayer::ulysses_width)
      .def_property_readonly("wire_types", &KdaLayer::wire_types)
      .def("times", &KdaLayer::times, py::arg("forward"))
      .def_property_readonly("forward_cache_bytes", &KdaLayer::forward_cache_bytes);
}

}  // namespace kdacp::python
