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

template <class T>
T* data(py::array& a) {
  return static_cast<T*>(a.mutable_data());
}

template <class T>
const T* ptr(std::uintptr_t p) {
  return reinterpret_cast<const T*>(p);
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
    conv_ = std::make_unique<conv::CausalConv>(comm_, *layout, sequences(batch, tokens, cu), dim,
                                               width);
  }
  std::size_t local_tokens() const { return conv_->local_tokens(); }
  std::size_t sequences_count() const { return conv_->sequences(); }

  py::tuple forward(const std::string& dtype, std::uintptr_t x, std::uintptr_t weight,
                    std::uintptr_t bias, std::uintptr_t h0, const std::string& activation,
                    bool want_ht) {
    if (dtype == "float64") return forward_t<double>(x, weight, bias, h0, activation, want_ht);
    if (dtype == "float32") return forward_t<float>(x, weight, bias, h0, activation, want_ht);
    throw InvalidArgument(
        fmt::format("causal_conv1d: dtype {}, expected float32 or float64", dtype));
  }

  py::tuple backward(const ConvSaved& saved, const std::string& dtype, std::uintptr_t x,
                     std::uintptr_t weight, std::uintptr_t bias, std::uintptr_t h0,
                     const std::string& activation, std::uintptr_t dy, std::uintptr_t dht) {
    if (dtype == "float64")
      return backward_t<double>(saved, x, weight, bias, h0, activation, dy, dht);
    if (dtype == "float32")
      return backward_t<float>(saved, x, weight, bias, h0, activation, dy, dht);
    throw InvalidArgument(
        fmt::format("causal_conv1d: dtype {}, expected float32 or float64", dtype));
  }

 private:
  template <class T>
  conv::Tensors<T> tensors(std::uintptr_t x, std::uintptr_t weight, std::uintptr_t bias,
                           std::uintptr_t h0, const std::string& activation) const {
    conv::Tensors<T> in;
    in.x = ptr<T>(x);
    in.weight = ptr<T>(weight);
    in.bias = bias ? ptr<T>(bias) : nullptr;
    in.initial_state = h0 ? ptr<T>(h0) : nullptr;
    in.activation = conv::parse_activation(activation);
    return in;
  }

  DType dtype_of(const float*) const { return DType::f32; }
  DType dtype_of(const double*) const { return DType::f64; }

  template <class T>
  py::tuple forward_t(std::uintptr_t x, std::uintptr_t weight, std::uintptr_t bias,
                      std::uintptr_t h0, const std::string& activation, bool want_ht) {
    const auto in = tensors<T>(x, weight, bias, h0, activation);
    const DType dt = dtype_of(static_cast<const T*>(nullptr));
    const std::size_t B = conv_->batch(), D = conv_->dim(), W = conv_->width();
    py::array y = new_array(dt, {B, conv_->local_tokens(), D});
    py::object ht = py::none();
    T* ht_ptr = nullptr;
    if (want_ht) {
      py::array a = new_array(dt, {conv_->sequences(), D, W});
      ht_ptr = data<T>(a);
      ht = a;
    }
    auto box = std::make_shared<ConvSaved>();
    T* y_ptr = data<T>(y);
    {
      py::gil_scoped_release release;
      box->saved = conv_->forward(in, y_ptr, ht_ptr);
    }
    return py::make_tuple(y, ht, box);
  }

  template <class T>
  py::tuple backward_t(const ConvSaved& box, std::uintptr_t x, std::uintptr_t weight,
                       std::uintptr_t bias, std::uintptr_t h0, const std::string& activation,
                       std::uintptr_t dy, std::uintptr_t dht) {
    const auto* saved = std::get_if<conv::Saved<T>>(&box.saved);
    if (!saved)
      throw InvalidArgument("causal_conv1d backward: the saved forward has another dtype");
    const auto in = tensors<T>(x, weight, bias, h0, activation);
    const DType dt = dtype_of(static_cast<const T*>(nullptr));
    const std::size_t B = conv_->batch(), D = conv_->dim(), W = conv_->width();
    py::array dx = new_array(dt, {B, conv_->local_tokens(), D});
    py::array dw = new_array(dt, {D, W});
    py::object db = py::none(), dh0 = py::none();
    conv::Grads<T> g{data<T>(dx), data<T>(dw), nullptr, nullptr};
    if (bias) {
      py::array a = new_array(dt, {D});
      g.dbias = data<T>(a);
      db = a;
    }
    if (h0) {
      py::array a = new_array(dt, {conv_->sequences(), D, W});
      g.dinitial_state = data<T>(a);
      dh0 = a;
    }
    {
      py::gil_scoped_release release;
      conv_->backward(in, *saved, ptr<T>(dy), dht ? ptr<T>(dht) : nullptr, g);
    }
    return py::make_tuple(dx, dw, db, dh0);
  }

  std::shared_ptr<Communicator> comm_;
  std::unique_ptr<conv::CausalConv> conv_;
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
      .def("forward", &ConvOp::forward, py::arg("dtype"), py::arg("x"), py::arg("weight"),
           py::arg("bias"), py::arg("initial_state"), py::arg("activation"), py::arg("want_ht"))
      .def("backward", &ConvOp::backward, py::arg("saved"), py::arg("dtype"), py::arg("x"),
           py::arg("weight"), py::arg("bias"), py::arg("initial_state"), py::arg("activation"),
           py::arg("dy"), py::arg("dht"));
  m.attr("conv_max_width") = conv::kMaxWidth;
}

}  // namespace kdacp::python
