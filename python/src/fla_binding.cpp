// kdacp._kdacp.kda_chunk_states: the recurrence run chunk by chunk, keeping
// the state that enters every chunk. flash-linear-attention returns these
// states from chunk_kda(return_intermediate_states=True) (chunks of
// chunk_size tokens) and its decode kernel (fused_recurrent_kda_fwd with
// ssm_state_indices) stores the state after every token (chunks of one
// token). Each chunk is one kda::forward call from the state the previous
// chunk left, so the states are the library's own, not a second algorithm.
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include <fmt/format.h>

#include "binding.hpp"
#include "kdacp/error.hpp"
#include "kdacp/kda.hpp"

namespace py = pybind11;

namespace kdacp::python {
namespace {

struct Run {
  std::size_t begin = 0, length = 0;  // tokens of the flattened [B·T] stream
};

// The sequences: B rows of T tokens, or the packed ones of cu_seqlens (B = 1,
// non-decreasing from 0, ending at or before T: empty sequences and a tail of
// unused tokens are allowed, as flash-linear-attention's padded batches have).
std::vector<Run> runs_of(std::size_t batch, std::size_t tokens,
                         const std::optional<std::vector<std::int64_t>>& cu) {
  std::vector<Run> runs;
  if (!cu) {
    for (std::size_t b = 0; b < batch; ++b) runs.push_back({b * tokens, tokens});
    return runs;
  }
  if (batch != 1) throw InvalidArgument(fmt::format("kda_chunk_states: cu_seqlens with B = {}, expected 1", batch));
  if (cu->size() < 2 || cu->front() != 0)
    throw InvalidArgument("kda_chunk_states: cu_seqlens needs at least 2 entries, starting at 0");
  for (std::size_t i = 1; i < cu->size(); ++i) {
    const std::int64_t a = (*cu)[i - 1], b = (*cu)[i];
    if (b < a || static_cast<std::uint64_t>(b) > tokens)
      throw InvalidArgument(fmt::format(
          "kda_chunk_states: cu_seqlens[{}] = {} after {}, expected non-decreasing and at most T = {}", i, b, a,
          tokens));
    runs.push_back({static_cast<std::size_t>(a), static_cast<std::size_t>(b - a)});
  }
  return runs;
}

template <class T>
py::tuple chunk_states_t(std::uintptr_t q, std::uintptr_t k, std::uintptr_t v, std::uintptr_t g,
                         std::uintptr_t beta, const kda::Shape& shape, double scale,
                         const std::optional<std::vector<std::int64_t>>& cu, std::uintptr_t h0,
                         std::size_t chunk, const std::string& algorithm, std::size_t threads) {
  const std::vector<Run> runs = runs_of(shape.batch, shape.tokens, cu);
  std::size_t chunks = 0;
  for (const Run& r : runs) chunks += (r.length + chunk - 1) / chunk;
  const std::size_t hv = shape.value_heads, kd = shape.key_dim, vd = shape.value_dim, h = shape.heads;
  const std::size_t state = hv * kd * vd;
  const DType dtype = std::is_same_v<T, double> ? DType::f64 : DType::f32;
  py::array o = new_array(dtype, {shape.batch, shape.tokens, hv, vd});
  py::array states = new_array(dtype, {chunks, hv, kd, vd});
  py::array finals = new_array(dtype, {runs.size(), hv, kd, vd});
  T* o_p = static_cast<T*>(o.mutable_data());
  T* h_p = static_cast<T*>(states.mutable_data());
  T* f_p = static_cast<T*>(finals.mutable_data());
  const kda::Algorithm how = kda::parse_algorithm(algorithm.c_str());
  {
    py::gil_scoped_release release;
    Pool pool(threads);
    const kda::Exec exec(pool.exec(), how);
    std::fill(o_p, o_p + shape.batch * shape.tokens * hv * vd, T(0));
    std::vector<T> a(state), b(state);
    std::size_t at = 0;
    for (std::size_t n = 0; n < runs.size(); ++n) {
      const Run& r = runs[n];
      if (h0)
        std::memcpy(a.data(), ptr<T>(h0) + n * state, state * sizeof(T));
      else
        std::fill(a.begin(), a.end(), T(0));
      for (std::size_t s = 0; s < r.length; s += chunk) {
        const std::size_t t0 = r.begin + s, len = std::min(chunk, r.length - s);
        std::copy(a.begin(), a.end(), h_p + (at++) * state);
        kda::Inputs<T> in;
        in.q = ptr<T>(q) + t0 * h * kd;
        in.k = ptr<T>(k) + t0 * h * kd;
        in.v = ptr<T>(v) + t0 * hv * vd;
        in.g = ptr<T>(g) + t0 * hv * kd;
        in.beta = ptr<T>(beta) + t0 * hv;
        in.shape = {1, len, h, hv, kd, vd};
        in.scale = static_cast<T>(scale);
        kda::forward(in, a.data(), o_p + t0 * hv * vd, b.data(), exec);
        std::swap(a, b);
      }
      std::copy(a.begin(), a.end(), f_p + n * state);
    }
  }
  return py::make_tuple(o, states, finals);
}

}  // namespace

void bind_fla(py::module_& m) {
  // (o [B,T,HV,V], h [NT,HV,K,V], final [N,HV,K,V]) for contiguous inputs
  // in `dtype` (float32 or float64) at the given addresses; shape (B, T, H,
  // HV, K, V); h0 0 or [N,HV,K,V]; h[i] is the state entering chunk i
  // (sequence by sequence, chunk_size tokens each, the last one shorter);
  // o is zero on tokens no sequence covers.
  m.def(
      "kda_chunk_states",
      [](std::uintptr_t q, std::uintptr_t k, std::uintptr_t v, std::uintptr_t g, std::uintptr_t beta,
         const std::vector<std::size_t>& dims, double scale, std::optional<std::vector<std::int64_t>> cu,
         std::uintptr_t h0, std::size_t chunk_size, const std::string& dtype, const std::string& algorithm,
         std::size_t threads) {
        if (dims.size() != 6) throw InvalidArgument("kda_chunk_states: shape needs 6 entries (B, T, H, HV, K, V)");
        if (chunk_size == 0) throw InvalidArgument("kda_chunk_states: chunk_size must be >= 1");
        const kda::Shape shape{dims[0], dims[1], dims[2], dims[3], dims[4], dims[5]};
        kda::validate(kda::Shape{shape.batch, std::max<std::size_t>(shape.tokens, 1), shape.heads,
                                 shape.value_heads, shape.key_dim, shape.value_dim});
        if (dtype == "float64")
          return chunk_states_t<double>(q, k, v, g, beta, shape, scale, cu, h0, chunk_size, algorithm, threads);
        if (dtype == "float32")
          return chunk_states_t<float>(q, k, v, g, beta, shape, scale, cu, h0, chunk_size, algorithm, threads);
        throw InvalidArgument(fmt::format("kda_chunk_states: dtype {}, expected float32 or float64", dtype));
      },
      py::arg("q"), py::arg("k"), py::arg("v"), py::arg("g"), py::arg("beta"), py::arg("shape"), py::arg("scale"),
      py::arg("cu_seqlens"), py::arg("h0"), py::arg("chunk_size"), py::arg("dtype"), py::arg("algorithm"),
      py::arg("threads"));
}

}  // namespace kdacp::python
