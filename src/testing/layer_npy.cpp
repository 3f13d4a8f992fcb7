#include "kdacp/testing/layer_npy.hpp"

#include <cstring>
#include <filesystem>
#include <limits>
#include <utility>

#include "kdacp/admission.hpp"
#include "kdacp/error.hpp"
#include "kdacp/finite.hpp"
#include "kdacp/protocol.hpp"

namespace kdacp::testing {

namespace {

namespace fs = std::filesystem;

std::string dims_str(const std::vector<std::size_t>& d) {
  std::string s = "(";
  for (std::size_t i = 0; i < d.size(); ++i) {
    if (i) s += ',';
    s += std::to_string(d[i]);
  }
  s += ')';
  return s;
}

NpyArray load(const fs::path& dir, const char* name, std::size_t ndim) {
  const fs::path p = dir / name;
  if (!fs::exists(p)) throw IoError(p.string() + ": missing");
  NpyArray a = read_npy(p.string());
  if (a.shape.size() != ndim)
    throw IoError(p.string() + ": shape " + dims_str(a.shape) + " has " + std::to_string(a.shape.size()) +
                  " dims, expected " + std::to_string(ndim));
  return a;
}

template <class T>
std::vector<T> values(const NpyArray& a) {
  std::vector<T> out(a.elements());
  std::memcpy(out.data(), a.data.data(), out.size() * sizeof(T));
  return out;
}

}  // namespace

LayerNpy read_layer_npy(const std::string& dir_name) {
  const fs::path dir(dir_name);
  if (!fs::is_directory(dir)) throw IoError(dir_name + ": not a directory");
  LayerNpy in{load(dir, "q.npy", 4), load(dir, "k.npy", 4), load(dir, "v.npy", 4), load(dir, "g.npy", 4),
              load(dir, "beta.npy", 3), std::nullopt};
  if (fs::exists(dir / "do.npy")) in.d_o = load(dir, "do.npy", 4);
  const NpyArray& q = in.q;
  const std::size_t b = q.shape[0], t = q.shape[1], h = q.shape[2], kd = q.shape[3];
  const std::size_t hv = in.v.shape[2], vd = in.v.shape[3];
  auto expect = [&](const char* name, const NpyArray& a, const std::vector<std::size_t>& want) {
    if (a.shape != want)
      throw IoError(std::string(name) + ": shape " + dims_str(a.shape) + ", expected " + dims_str(want) +
                    " from q.npy (B,T,H,K) and v.npy (B,T,HV,V)");
    if (a.dtype != q.dtype)
      throw IoError(std::string(name) + ": dtype " + to_string(a.dtype) + ", expected " + to_string(q.dtype) +
                    " like q.npy");
  };
  expect("k.npy", in.k, {b, t, h, kd});
  expect("v.npy", in.v, {b, t, hv, vd});
  expect("g.npy", in.g, {b, t, hv, kd});
  expect("beta.npy", in.beta, {b, t, hv});
  if (in.d_o) expect("do.npy", *in.d_o, {b, t, hv, vd});
  for (const auto& [name, a] : {std::pair<const char*, const NpyArray*>{"q.npy", &in.q}, {"k.npy", &in.k}, {"v.npy", &in.v}})
    require_finite(*a, (dir / name).string());
  if (in.d_o) require_finite(*in.d_o, (dir / "do.npy").string());
  require_within(in.g, (dir / "g.npy").string(), -std::numeric_limits<double>::max(), 0,
                 "g <= 0 (the log of a decay in (0, 1])");
  require_within(in.beta, (dir / "beta.npy").string(), 0, 1, "beta in [0, 1]");
  return in;
}

double layer_npy_bytes(const std::string& dir) {
  double bytes = 0;
  for (const char* name : {"q.npy", "k.npy", "v.npy", "g.npy", "beta.npy", "do.npy"}) {
    std::error_code ec;
    const auto size = fs::file_size(fs::path(dir) / name, ec);
    if (!ec) bytes += double(size);
  }
  return bytes;
}

void admit_layer_run(const kda::Shape& s, const SummaryShape& summary, std::size_t ranks, bool grads,
                     double input_bytes, const std::string& method, long long group_size,
                     const ExchangeOptions& options, const std::string& max_memory) {
  const ProblemShape ps{ranks, summary.slabs(), s.key_dim, s.value_dim, dtype_size(summary.dtype)};
  const Prediction pred = predict_exchange(ps, method, group_size, options);
  const double need =
      2 * input_bytes + layer_run_bytes(s, ranks, grads, ps.elem_bytes, exchange_rank_bytes(ps, pred));
  require_memory(need, max_memory_bytes(max_memory),
                 "kdacp kda on " + std::to_string(ranks) + " ranks with " + protocol_label(pred.config),
                 max_memory_name(max_memory));
}

template <class T>
kda::LayerData<T> layer_data(const LayerNpy& in) {
  kda::LayerData<T> data;
  data.shape = kda::Shape{in.q.shape[0], in.q.shape[1], in.q.shape[2], in.v.shape[2], in.q.shape[3], in.v.shape[3]};
  data.q = values<T>(in.q);
  data.k = values<T>(in.k);
  data.v = values<T>(in.v);
  data.g = values<T>(in.g);
  data.beta = values<T>(in.beta);
  kda::validate(data.shape);
  return data;
}

template <class T>
std::vector<T> output_grad(const LayerNpy& in) {
  return in.d_o ? values<T>(*in.d_o) : std::vector<T>{};
}

template <class T>
void write_layer_outputs_npy(const std::string& dir_name, const LayerNpy& in, const LayerOutputs<T>& out) {
  fs::create_directories(dir_name);
  const fs::path dir(dir_name);
  auto write = [&](const char* name, const std::vector<T>& data, const NpyArray& like) {
    write_npy((dir / name).string(), data.data(), like.shape);
  };
  write("o.npy", out.o, in.v);
  if (!in.d_o) return;
  write("dq.npy", out.dq, in.q);
  write("dk.npy", out.dk, in.k);
  write("dv.npy", out.dv, in.v);
  write("dg.npy", out.dg, in.g);
  write("dbeta.npy", out.dbeta, in.beta);
}

template kda::LayerData<float> layer_data<float>(const LayerNpy&);
template kda::LayerData<double> layer_data<double>(const LayerNpy&);
template std::vector<float> output_grad<float>(const LayerNpy&);
template std::vector<double> output_grad<double>(const LayerNpy&);
template void write_layer_outputs_npy<float>(const std::string&, const LayerNpy&, const LayerOutputs<float>&);
template void write_layer_outputs_npy<double>(const std::string&, const LayerNpy&, const LayerOutputs<double>&);

}  // namespace kdacp::testing
