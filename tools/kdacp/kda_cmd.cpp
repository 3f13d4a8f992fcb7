// `kdacp kda`: the context-parallel KDA layer on .npy inputs, for comparison
// with any other implementation (flash-linear-attention's layout, SPEC §9).
#include <cmath>
#include <cstring>
#include <filesystem>
#include <optional>

#include "commands.hpp"
#include "exchange_flags.hpp"
#include "kdacp/error.hpp"
#include "kdacp/exchange.hpp"
#include "kdacp/npy.hpp"
#include "kdacp/thread_pool.hpp"
#include "layer_runner.hpp"

namespace kdacp::cli {
namespace {

namespace fs = std::filesystem;

struct KdaConfig {
  std::string inputs, out;
  std::size_t ranks = 1;
  ExchangeFlags exchange;
  double scale = 0;  // 0: 1/sqrt(K)
  std::size_t threads = 0;
  double timeout_s = 120;
};

std::string dims_str(const std::vector<std::size_t>& d) {
  std::string s = "(";
  for (std::size_t i = 0; i < d.size(); ++i) s += (i ? "," : "") + std::to_string(d[i]);
  return s + ")";
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

template <class T>
void write(const fs::path& dir, const char* name, const std::vector<T>& data,
           const std::vector<std::size_t>& dims) {
  write_npy((dir / name).string(), data.data(), dims);
}

template <class T>
void run_typed(const KdaConfig& cfg, const NpyArray& q, const NpyArray& k, const NpyArray& v,
               const NpyArray& g, const NpyArray& beta, const std::optional<NpyArray>& d_o) {
  kda::LayerData<T> data;
  data.shape = kda::Shape{q.shape[0], q.shape[1], q.shape[2], v.shape[2], q.shape[3], v.shape[3]};
  data.q = values<T>(q);
  data.k = values<T>(k);
  data.v = values<T>(v);
  data.g = values<T>(g);
  data.beta = values<T>(beta);
  const kda::Shape& s = data.shape;
  kda::validate(s);
  const T scale = cfg.scale > 0 ? static_cast<T>(cfg.scale) : kda::default_scale<T>(s.key_dim);
  std::vector<T> dov;
  if (d_o) dov = values<T>(*d_o);
  const std::size_t threads = cfg.threads ? cfg.threads : ThreadPool::default_threads(cfg.ranks);
  SummaryShape summary = layer_summary_shape(s);
  summary.dtype = std::is_same_v<T, double> ? DType::f64 : DType::f32;
  const auto out = run_context_parallel(data, scale, d_o ? &dov : nullptr, cfg.ranks, cfg.exchange.protocol,
                                        cfg.exchange.group_size, threads, cfg.timeout_s,
                                        exchange_options(cfg.exchange, summary));
  fs::create_directories(cfg.out);
  const fs::path dir(cfg.out);
  write(dir, "o.npy", out.o, v.shape);
  if (d_o) {
    write(dir, "dq.npy", out.dq, q.shape);
    write(dir, "dk.npy", out.dk, k.shape);
    write(dir, "dv.npy", out.dv, v.shape);
    write(dir, "dg.npy", out.dg, g.shape);
    write(dir, "dbeta.npy", out.dbeta, beta.shape);
  }
  std::printf("kdacp kda: %s B=%zu T=%zu H=%zu HV=%zu K=%zu V=%zu on P=%zu ranks (%s): wrote %s to %s\n",
              std::is_same_v<T, double> ? "float64" : "float32", s.batch, s.tokens, s.heads, s.value_heads,
              s.key_dim, s.value_dim, cfg.ranks, out.method.c_str(),
              d_o ? "o, dq, dk, dv, dg, dbeta" : "o", cfg.out.c_str());
}

void run(const KdaConfig& cfg) {
  const fs::path dir(cfg.inputs);
  if (!fs::is_directory(dir)) throw IoError(cfg.inputs + ": not a directory");
  const NpyArray q = load(dir, "q.npy", 4), k = load(dir, "k.npy", 4), v = load(dir, "v.npy", 4),
                 g = load(dir, "g.npy", 4), beta = load(dir, "beta.npy", 3);
  std::optional<NpyArray> d_o;
  if (fs::exists(dir / "do.npy")) d_o = load(dir, "do.npy", 4);
  const std::size_t b = q.shape[0], t = q.shape[1], h = q.shape[2], kd = q.shape[3];
  const std::size_t hv = v.shape[2], vd = v.shape[3];
  auto expect = [&](const char* name, const NpyArray& a, const std::vector<std::size_t>& want) {
    if (a.shape != want)
      throw IoError(std::string(name) + ": shape " + dims_str(a.shape) + ", expected " + dims_str(want) +
                    " from q.npy (B,T,H,K) and v.npy (B,T,HV,V)");
    if (a.dtype != q.dtype)
      throw IoError(std::string(name) + ": dtype " + to_string(a.dtype) + ", expected " + to_string(q.dtype) +
                    " like q.npy");
  };
  expect("k.npy", k, {b, t, h, kd});
  expect("v.npy", v, {b, t, hv, vd});
  expect("g.npy", g, {b, t, hv, kd});
  expect("beta.npy", beta, {b, t, hv});
  if (d_o) expect("do.npy", *d_o, {b, t, hv, vd});
  if (q.dtype == DType::f64) {
    run_typed<double>(cfg, q, k, v, g, beta, d_o);
  } else {
    run_typed<float>(cfg, q, k, v, g, beta, d_o);
  }
}

}  // namespace

void add_kda_command(CLI::App& app) {
  auto cfg = std::make_shared<KdaConfig>();
  CLI::App* cmd = app.add_subcommand(
      "kda",
      "run the context-parallel KDA layer on q/k/v/g/beta(.npy) [and do.npy] and write o (and gradients)");
  cmd->add_option("--inputs", cfg->inputs,
                  "DIR with q.npy, k.npy [B,T,H,K], v.npy [B,T,HV,V], g.npy [B,T,HV,K], beta.npy [B,T,HV], "
                  "optional do.npy (float32 or float64)")
      ->required();
  cmd->add_option("--out", cfg->out, "DIR for o.npy and, with do.npy, dq/dk/dv/dg/dbeta.npy")->required();
  cmd->add_option("--ranks,-P", cfg->ranks, "in-process ranks")->check(CLI::Range(1, 1024))->capture_default_str();
  add_exchange_flags(*cmd, cfg->exchange);
  cmd->add_option("--scale", cfg->scale, "output scale (default 1/sqrt(K))");
  cmd->add_option("--threads", cfg->threads, "threads per rank (0: hardware threads / ranks)")->capture_default_str();
  cmd->add_option("--timeout", cfg->timeout_s, "seconds a rank waits for a peer")->check(CLI::PositiveNumber)->capture_default_str();
  cmd->callback([cfg] { run(*cfg); });
}

}  // namespace kdacp::cli
