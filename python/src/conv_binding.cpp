// kdacp._kdacp.CausalConv: the causal short convolution of kdacp/conv.hpp on
// tensor memory, one device or over a torch group (TorchCommunicator) in a
// Layout. kdacp._conv wires it into autograd; this file checks nothing that
// Python checked already, runs the C++ calls with the GIL released (the
// communicator takes it back per message) and returns NumPy arrays owning
// fresh memory.
#include <pybind11/stl.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include <fmt/format.h>

#include "binding.hpp"
#include "kdacp/conv.hpp"
#include "kdacp/error.hpp"
#include "kdacp/layout.hpp"
#include "torch_comm.hpp"

namespace py = pybind11;

namespace kdacp::python {
namespace {

// What the forward keeps for the backward (the history of each local part).
struct ConvSaved {
  std::variant<conv::Saved<float>, conv::Saved<double>> saved;
};

Sequences sequences(std::size_t batch, std::size_t tokens,
                    const std::optional<std::vector<std::int64_t>>& cu) {
  return cu ? Sequences(batch, tokens, *cu) : Sequences(batch, tokens);
}

class ConvOp {
 public:
  // backend None: one device, the whole stream [B,T,D] local. Otherwise a
  // kdacp._comm.GroupBackend and the global Layout; x is then this rank's
  // [B,T_local,D].
  ConvOp(py::object backend, const std::optional<Layout>& layout, std::size_t batch,
         std::size_t tokens, const std::optional<std::vector<std::int64_t>>& cu, std::size_t dim,
         std::size_t width) {
    if (backend.is_none()) {
      conv_ = std::make_unique<conv::CausalConv>(sequences(batch, tokens, cu), dim, width);
      return;
    }
    if (!layout) throw InvalidArgument("causal_conv1d: a CP convolution needs its layout");
    comm_ = std::make_shared<TorchCommunicator>(std::move(backend));
    Sequences seqs = sequences(batch, tokens, cu);
    conv_ = std::make_unique<conv::CausalConv>(comm_, *layout, seqs, dim, width);
    if (layout->ranks() > 1) started_.emplace(*layout, std::move(seqs));
  }
  std::size_t local_tokens() const { return conv_->local_tokens(); }
  std::size_t sequences_count() const { return conv_->sequences(); }

  // `dtype`: the compute dtype (float32 or float64); `dtypes`: the storage
  // of x, weight, bias, initial_state (each float64 with float64, else
  // float32, bfloat16 or float16). y and the final state are stored as x.
  py::tuple forward(const std::string& dtype, const std::vector<std::string>& dtypes, std::uintptr_t x,
                    std::uintptr_t weight, std::uintptr_t bias, std::uintptr_t h0, const std::string& activation,
                    bool want_ht) {
    if (dtype == "float64") return forward_t<double>(dtypes, x, weight, bias, h0, activation, want_ht);
    if (dtype == "float32") return forward_t<float>(dtypes, x, weight, bias, h0, activation, want_ht);
    throw InvalidArgument(fmt::format("causal_conv1d: dtype {}, expected float32 or float64", dtype));
  }

  // The gradients are stored as their inputs; dy as x, dht as x.
  py::tuple backward(const ConvSaved& saved, const std::string& dtype, const std::vector<std::string>& dtypes,
                     std::uintptr_t x, std::uintptr_t weight, std::uintptr_t bias, std::uintptr_t h0,
                     const std::string& activation, std::uintptr_t dy, std::uintptr_t dht) {
    if (dtype == "float64") return backward_t<double>(saved, dtypes, x, weight, bias, h0, activation, dy, dht);
    if (dtype == "float32") return backward_t<float>(saved, dtypes, x, weight, bias, h0, activation, dy, dht);
    throw InvalidArgument(fmt::format("causal_conv1d: dtype {}, expected float32 or float64", dtype));
  }

 private:
  // x, weight, bias, initial_state as T (16-bit ones widened on first use).
  template <class T>
  struct Inputs {
    Inputs(const conv::CausalConv& c, const std::vector<std::string>& dtypes, std::uintptr_t x,
           std::uintptr_t weight, std::uintptr_t bias, std::uintptr_t h0)
        : x(x, at(dtypes, 0), c.batch() * c.local_tokens() * c.dim(), "x"),
          weight(weight, at(dtypes, 1), c.dim() * c.width(), "weight"),
          bias(bias, at(dtypes, 2), c.dim(), "bias"),
          h0(h0, at(dtypes, 3), c.sequences() * c.dim() * c.width(), "initial_state") {}
    static const std::string& at(const std::vector<std::string>& d, std::size_t i) {
      if (d.size() != 4)
        throw InvalidArgument("causal_conv1d needs the dtypes of x, weight, bias and initial_state");
      return d[i];
    }
    conv::Tensors<T> get(const std::string& activation) {
      conv::Tensors<T> in;
      in.x = x.get();
      in.weight = weight.get();
      in.bias = bias.get();
      in.initial_state = h0.get();
      in.activation = conv::parse_activation(activation);
      return in;
    }
    InputOf<T> x, weight, bias, h0;
  };

  template <class T>
  py::tuple forward_t(const std::vector<std::string>& dtypes, std::uintptr_t x, std::uintptr_t weight,
                      std::uintptr_t bias, std::uintptr_t h0, const std::string& activation, bool want_ht) {
    Inputs<T> in(*conv_, dtypes, x, weight, bias, h0);
    conv::parse_activation(activation);  // a bad name throws before any work
    const std::size_t B = conv_->batch(), D = conv_->dim(), W = conv_->width();
    OutputOf<T> y(dtypes[0], {B, conv_->local_tokens(), D}, "y");
    std::optional<OutputOf<T>> ht;
    if (want_ht) ht.emplace(dtypes[0], std::vector<std::size_t>{conv_->sequences(), D, W}, "final_state");
    auto box = std::make_shared<ConvSaved>();
    {
      py::gil_scoped_release release;
      box->saved = conv_->forward(in.get(activation), y.get(), ht ? ht->get() : nullptr);
      y.finish("causal_conv1d");
      if (ht) ht->finish("causal_conv1d");
    }
    return py::make_tuple(y.array, ht ? py::object(ht->array) : py::none(), box);
  }

  template <class T>
  py::tuple backward_t(const ConvSaved& box, const std::vector<std::string>& dtypes, std::uintptr_t x,
                       std::uintptr_t weight, std::uintptr_t bias, std::uintptr_t h0,
                       const std::string& activation, std::uintptr_t dy, std::uintptr_t dht) {
    const auto* saved = std::get_if<conv::Saved<T>>(&box.saved);
    if (!saved) throw InvalidArgument("causal_conv1d backward: the saved forward has another dtype");
    Inputs<T> in(*conv_, dtypes, x, weight, bias, h0);
    const std::size_t B = conv_->batch(), D = conv_->dim(), W = conv_->width();
    InputOf<T> dy_in(dy, dtypes[0], B * conv_->local_tokens() * D, "dy");
    InputOf<T> dht_in(dht, dtypes[0], conv_->sequences() * D * W, "d final_state");
    OutputOf<T> dx(dtypes[0], {B, conv_->local_tokens(), D}, "dx");
    OutputOf<T> dw(dtypes[1], {D, W}, "dweight");
    std::optional<OutputOf<T>> db, dh0;
    if (bias) db.emplace(dtypes[2], std::vector<std::size_t>{D}, "dbias");
    if (h0) dh0.emplace(dtypes[3], std::vector<std::size_t>{conv_->sequences(), D, W}, "dinitial_state");
    {
      py::gil_scoped_release release;
      conv::Grads<T> g{dx.get(), dw.get(), db ? db->get() : nullptr, dh0 ? dh0->get() : nullptr};
      conv_->backward(in.get(activation), *saved, dy_in.get(), dht_in.get(), g);
      // conv::CausalConv's dinitial_state is complete on every rank; each
      // rank keeps its share (keep_started_rows), before any narrowing.
      if (dh0 && started_)
        keep_started_rows(g.dinitial_state, D * W, started_->first, conv_->rank(), started_->second);
      for (OutputOf<T>* out : {&dx, &dw}) out->finish("causal_conv1d backward");
      if (db) db->finish("causal_conv1d backward");
      if (dh0) dh0->finish("causal_conv1d backward");
    }
    return py::make_tuple(dx.array, dw.array, db ? py::object(db->array) : py::none(),
                          dh0 ? py::object(dh0->array) : py::none());
  }

  std::shared_ptr<Communicator> comm_;
  std::unique_ptr<conv::CausalConv> conv_;
  std::optional<std::pair<Layout, Sequences>> started_;  // under CP: where each sequence starts
};

}  // namespace

void bind_conv(py::module_& m) {
  py::class_<ConvSaved, std::shared_ptr<ConvSaved>>(m, "ConvSaved");
  py::class_<ConvOp>(m, "CausalConv")
      .def(py::init<py::object, const std::optional<Layout>&, std::size_t, std::size_t,
                    const std::optional<std::vector<std::int64_t>>&, std::size_t, std::size_t>(),
           py::arg("backend"), py::arg("layout"), py::arg("batch"), py::arg("tokens"),
           py::arg("cu_seqlens"), py::arg("dim"), py::arg("width"))
      .def_property_readonly("local_tokens", &ConvOp::local_tokens)
      .def_property_readonly("sequences", &ConvOp::sequences_count)
      .def("forward", &ConvOp::forward, py::arg("dtype"), py::arg("dtypes"), py::arg("x"), py::arg("weight"),
           py::arg("bias"), py::arg("initial_state"), py::arg("activation"), py::arg("want_ht"))
      .def("backward", &ConvOp::backward, py::arg("saved"), py::arg("dtype"), py::arg("dtypes"), py::arg("x"),
           py::arg("weight"), py::arg("bias"), py::arg("initial_state"), py::arg("activation"),
           py::arg("dy"), py::arg("dht"));
  m.attr("conv_max_width") = conv::kMaxWidth;
}

}  // namespace kdacp::python
