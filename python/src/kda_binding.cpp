// kdacp._kdacp's Layout, choose_ulysses and the in-kernel input transforms
// of chunk_kda (gate, l2norm, sigmoid); the layer itself is kda_layer.cpp's.
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
py::array sigmoid_t(std::uintptr_t x, const std::string& x_dtype, std::uintptr_t d_y, std::size_t n,
                    bool allow_neg_eigval) {
  InputOf<T> in(x, x_dtype, n, "beta");
  OutputOf<T> out(d_y == 0 ? name_of(std::is_same_v<T, double>) : x_dtype.c_str(), {n}, "beta");
  {
    py::gil_scoped_release release;
    if (d_y == 0)
      kda::sigmoid_forward(in.get(), n, out.get(), allow_neg_eigval);
    else
      kda::sigmoid_backward(in.get(), ptr<T>(d_y), n, out.get(), allow_neg_eigval);
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
  // stored as x; allow_neg_eigval: both times 2 (beta in [0, 2]).
  m.def(
      "kda_sigmoid",
      [](std::uintptr_t x, const std::string& x_dtype, std::size_t n, const std::string& dtype,
         std::uintptr_t d_y, bool allow_neg_eigval) {
        return is_f64(dtype) ? sigmoid_t<double>(x, x_dtype, d_y, n, allow_neg_eigval)
                             : sigmoid_t<float>(x, x_dtype, d_y, n, allow_neg_eigval);
      },
      py::arg("x"), py::arg("x_dtype"), py::arg("n"), py::arg("dtype"), py::arg("d_y") = 0,
      py::arg("allow_neg_eigval") = false);
}

}  // namespace kdacp::python
