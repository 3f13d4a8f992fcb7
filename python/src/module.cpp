// kdacp._kdacp: the binding module. All logic lives in the kdacp library; this
// module converts arguments, forwards calls and maps kdacp's typed errors to
// Python's: InvalidArgument -> ValueError, Timeout / RemoteError ->
// RuntimeError subclasses, IoError -> OSError, the message unchanged.
#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <fmt/format.h>

#include "binding.hpp"
#include "kdacp/defaults.hpp"
#include "kdacp/error.hpp"
#include "kdacp/kda.hpp"
#include "kdacp/finite.hpp"
#include "kdacp/summary.hpp"
#include "kdacp/units.hpp"

namespace py = pybind11;

namespace kdacp::python {

void bind_fla(py::module_& m);  // fla_binding.cpp

TensorDesc to_desc(const py::tuple& t) {
  if (t.size() != 4) throw InvalidArgument("tensor descriptor needs 4 fields");
  TensorDesc d;
  d.data = t[0].cast<std::uintptr_t>();
  d.shape = t[1].cast<std::vector<std::size_t>>();
  d.strides = t[2].cast<std::vector<std::size_t>>();
  const auto name = t[3].cast<std::string>();
  if (name == "float32")
    d.dtype = DType::f32;
  else if (name == "float64")
    d.dtype = DType::f64;
  else
    throw InvalidArgument(fmt::format("tensor dtype {}, expected float32 or float64", name));
  return d;
}

StateView state_view(const TensorDesc& d, const char* field) {
  if (d.shape.size() != 4 || d.strides.size() != 4)
    throw InvalidArgument(
        fmt::format("{} has {} dims, expected 4 ([B,H,rows,cols])", field, d.shape.size()));
  StateView v;
  v.data = reinterpret_cast<void*>(d.data);
  v.dtype = d.dtype;
  v.batch = d.shape[0];
  v.heads = d.shape[1];
  v.rows = d.shape[2];
  v.cols = d.shape[3];
  v.batch_stride = d.strides[0];
  v.head_stride = d.strides[1];
  v.row_stride = d.strides[2];
  v.col_stride = d.strides[3];
  return v;
}

StackView stack_view(const TensorDesc& d, const char* field) {
  if (d.shape.size() != 5 || d.strides.size() != 5)
    throw InvalidArgument(
        fmt::format("{} has {} dims, expected 5 ([P,B,H,rows,cols])", field, d.shape.size()));
  TensorDesc slot = d;
  slot.shape.erase(slot.shape.begin());
  slot.strides.erase(slot.strides.begin());
  StackView s;
  s.base = state_view(slot, field);
  s.ranks = d.shape[0];
  s.rank_stride = d.strides[0];
  return s;
}

py::array state_array(State&& state) {
  auto* owned = new State(std::move(state));
  py::capsule owner(owned, [](void* p) { delete static_cast<State*>(p); });
  const std::vector<py::ssize_t> shape{
      static_cast<py::ssize_t>(owned->batch()), static_cast<py::ssize_t>(owned->heads()),
      static_cast<py::ssize_t>(owned->rows()), static_cast<py::ssize_t>(owned->cols())};
  if (owned->dtype() == DType::f64) return py::array_t<double>(shape, owned->data<double>(), owner);
  return py::array_t<float>(shape, owned->data<float>(), owner);
}

namespace {

// An uninitialised array of E whose storage is a kdacp::Buffer (from the
// process's large-buffer cache, huge pages from 2 MiB) owned by the array:
// when the tensor viewing it dies, the block goes back to the cache and the
// next call's result of the same size reuses its pages instead of faulting
// fresh ones in (on this project's hosts a first touch costs more than the
// kernel that writes it).
template <class E>
py::array cached_array(const std::vector<std::size_t>& shape) {
  std::size_t n = 1;
  for (std::size_t d : shape) n *= d;
  auto owner = std::make_unique<Buffer>(std::max<std::size_t>(n, 1) * sizeof(E), Buffer::Init::uninitialized);
  E* data = owner->as<E>();
  py::capsule base(owner.get(), [](void* p) { delete static_cast<Buffer*>(p); });
  owner.release();  // the capsule owns it now
  return py::array_t<E>(std::vector<py::ssize_t>(shape.begin(), shape.end()), data, base);
}

}  // namespace

py::array new_array(DType dtype, const std::vector<std::size_t>& shape) {
  if (dtype == DType::f64) return cached_array<double>(shape);
  return cached_array<float>(shape);
}

template <class T>
std::optional<Half> storage_of(std::string_view dtype, std::string_view name) {
  if constexpr (std::is_same_v<T, double>) {
    if (dtype == "float64") return std::nullopt;
    throw InvalidArgument(fmt::format("{} has dtype {}, expected float64 (the call's dtype)", name, dtype));
  } else {
    if (dtype == "float32") return std::nullopt;
    if (auto half = parse_half(dtype)) return half;
    throw InvalidArgument(
        fmt::format("{} has dtype {}, expected float32, bfloat16 or float16 (the call computes in float32)",
                    name, dtype));
  }
}
template std::optional<Half> storage_of<float>(std::string_view, std::string_view);
template std::optional<Half> storage_of<double>(std::string_view, std::string_view);

template <class T>
OutputOf<T>::OutputOf(std::string_view dtype, const std::vector<std::size_t>& shape, std::string name)
    : half_(storage_of<T>(dtype, name)), shape_(shape), name_(std::move(name)) {
  n_ = 1;
  for (std::size_t d : shape) n_ *= d;
  if (!half_) {
    array = new_array(std::is_same_v<T, double> ? DType::f64 : DType::f32, shape);
    return;
  }
  array = cached_array<std::int16_t>(shape);  // torch has no uint16
  if constexpr (std::is_same_v<T, float>) wide_ = Buffer(n_ * sizeof(float), Buffer::Init::uninitialized);
}

template <class T>
void OutputOf<T>::finish(const char* op) {
  if constexpr (std::is_same_v<T, float>) {
    if (!half_) return;
    auto* bits = static_cast<std::uint16_t*>(array.mutable_data());
    if (const auto at = narrow(*half_, wide_.as<float>(), n_, bits))
      throw InvalidArgument(fmt::format(
          "{}: {} element {} is {} in float32, beyond {}'s range (its largest value is {}); "
          "use float32 inputs or rescale",
          op, name_, index_string(*at, shape_), exact_string(wide_.as<float>()[*at]), half_name(*half_),
          exact_string(half_max(*half_))));
    wide_ = Buffer();
  }
}
template class OutputOf<float>;
template class OutputOf<double>;

namespace {

// kdacp/finite.hpp on a contiguous tensor's memory: the rule by name
// ("finite", "gate": g <= 0, "beta": beta in [0, 1], "beta_neg_eigval": beta
// in [0, 2], allow_neg_eigval's domain), the same checks and
// messages as the CLI's on .npy files. The scan runs without the GIL.
void check_tensor(std::uintptr_t data, const std::vector<std::size_t>& shape, const std::string& dtype,
                  const std::string& name, const std::string& rule) {
  TensorRef t{name, shape, reinterpret_cast<const void*>(data), DType::f32};
  const std::optional<Half> half = parse_half(dtype);
  if (dtype == "float64") {
    t.dtype = DType::f64;
  } else if (!half && dtype != "float32") {
    throw InvalidArgument(fmt::format("{} has dtype {}, expected float32, float64, bfloat16 or float16",
                                      name, dtype));
  }
  void (*check)(const TensorRef&) = nullptr;
  if (rule == "finite")
    check = [](const TensorRef& x) { require_finite(x); };
  else if (rule == "gate")
    check = &require_kda_gate;
  else if (rule == "beta")
    check = &require_kda_beta;
  else if (rule == "beta_neg_eigval")
    check = [](const TensorRef& x) { require_within(x, 0, 2, "beta in [0, 2] (allow_neg_eigval=True)"); };
  else
    throw InvalidArgument(fmt::format(
        "check_tensor: rule '{}', expected 'finite', 'gate', 'beta' or 'beta_neg_eigval'", rule));
  py::gil_scoped_release release;
  if (!half) return check(t);
  // A 16-bit tensor is checked as its exact float32 values, a block at a
  // time (no widened copy of the tensor); a block that fails is checked
  // again with the tensor widened whole, so the message names its element.
  constexpr std::size_t kBlock = 1 << 14;
  const auto* bits = static_cast<const std::uint16_t*>(t.data);
  std::vector<float> block(std::min(kBlock, t.elements()));
  bool failed = false;
  for (std::size_t lo = 0; lo < t.elements() && !failed; lo += kBlock) {
    const std::size_t n = std::min(kBlock, t.elements() - lo);
    widen(*half, bits + lo, n, block.data());
    try {
      check(TensorRef{name, {n}, block.data(), DType::f32});
    } catch (const InvalidArgument&) {
      failed = true;
    }
  }
  if (!failed) return;
  std::vector<float> wide(t.elements());
  widen(*half, bits, wide.size(), wide.data());
  t.data = wide.data();
  check(t);
}

}  // namespace

void bind_checks(py::module_& m) {
  m.def("check_tensor", &check_tensor, py::arg("data"), py::arg("shape"), py::arg("dtype"),
        py::arg("name"), py::arg("rule"));
  // kdacp/units.hpp: the CLI's parsers of numbers and sizes, one for both.
  m.def(
      "parse_integer",
      [](const std::string& text, const std::string& what, std::uint64_t min, std::uint64_t max) {
        return parse_integer(text, IntRange{min, max, 1}, what);
      },
      py::arg("text"), py::arg("what"), py::arg("min"), py::arg("max"));
  m.def(
      "parse_bytes", [](const std::string& text, const std::string& what) { return parse_bytes(text, what); },
      py::arg("text"), py::arg("what"));
  m.def(
      "parse_timeout",
      [](const std::string& text, const std::string& what) { return parse_real(text, kTimeoutRange, what); },
      py::arg("text"), py::arg("what"));
  m.attr("threads_range") = py::make_tuple(kThreadsRange.min, kThreadsRange.max);
  // pipelined_p2p's column segments: at most ceil(V/16) (the CLI's --segments).
  m.attr("segments_range") = py::make_tuple(0, kMaxDim / kSegmentColumns);
  // An uninitialised uint8 array of `bytes` from the buffer cache (huge pages
  // from 2 MiB, reused by the next call of the size): kdacp.torch copies a
  // non-contiguous gradient into it (_common.contiguous_cached) instead of
  // into a fresh torch allocation faulted in 4 KiB pages on every call.
  m.def(
      "cached_bytes", [](std::size_t bytes) { return cached_array<std::uint8_t>({bytes}); },
      py::arg("bytes"));
  // kdacp/defaults.hpp: the defaults kdacp.torch uses, the library's and the CLI's.
  m.def("defaults", [] {
    py::dict d;
    d["algorithm"] = kda::algorithm_name(defaults::kAlgorithm);
    d["keep_forward"] = defaults::kKeepForward;
    d["deterministic"] = defaults::kDeterministic;
    d["timeout"] = defaults::kTimeoutSeconds;
    return d;
  });
}

}  // namespace kdacp::python

PYBIND11_MODULE(_kdacp, m) {
  m.doc() = "kdacp: context-parallel state exchange of Kimi Delta Attention (C++ binding)";
  // The exception types live as long as the process: never destroyed, so no
  // Py_DECREF runs after the interpreter has finalised. One translator, most
  // derived types first.
  static auto* error = new py::exception<kdacp::Error>(m, "Error", PyExc_RuntimeError);
  static auto* invalid =
      new py::exception<kdacp::InvalidArgument>(m, "InvalidArgument", PyExc_ValueError);
  static auto* timeout = new py::exception<kdacp::Timeout>(m, "Timeout", PyExc_RuntimeError);
  static auto* remote =
      new py::exception<kdacp::RemoteError>(m, "RemoteError", PyExc_RuntimeError);
  static auto* io = new py::exception<kdacp::IoError>(m, "IoError", PyExc_OSError);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const kdacp::InvalidArgument& e) {
      (*invalid)(e.what());
    } catch (const kdacp::Timeout& e) {
      (*timeout)(e.what());
    } catch (const kdacp::RemoteError& e) {
      (*remote)(e.what());
    } catch (const kdacp::IoError& e) {
      (*io)(e.what());
    } catch (const kdacp::Error& e) {
      (*error)(e.what());
    }
  });
  kdacp::python::bind_exchange(m);
  kdacp::python::bind_kda(m);
  kdacp::python::bind_kda_layer(m);
  kdacp::python::bind_checks(m);
  kdacp::python::bind_conv(m);
  kdacp::python::bind_fla(m);
}
