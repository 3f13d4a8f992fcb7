// `kdacp exchange`: runs forward + backward of one protocol on P ranks,
// checks every rank against the FP64 chain and, for the exact protocols, bit
// for bit against the p2p chain, and reports time, traffic and memory per
// rank. The default method is auto: the cost model's choice, reported.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>

#include "backend.hpp"
#include "commands.hpp"
#include "exchange_flags.hpp"
#include "kdacp/error.hpp"
#include "kdacp/exchange.hpp"
#include "kdacp/npy.hpp"
#include "kdacp/synthetic.hpp"
#include "kdacp/thread_pool.hpp"
#include "reference.hpp"
#include "table.hpp"

namespace kdacp::cli {
namespace {

struct Config {
  BackendOptions backend;
  ExchangeFlags exchange;
  std::size_t batch = 1, heads = 4, key_dim = 128, value_dim = 128;
  std::uint64_t seed = 0;
  std::size_t repeat = 5;
  std::size_t threads = 0;
  std::string kernel = "best";
  bool json = false;
  std::string summaries, out;
  // Flags given explicitly; they must agree with --summaries files.
  bool given_ranks = false, given_batch = false, given_heads = false, given_k = false,
       given_v = false;
};

constexpr int kTagInputs = 1000;
constexpr int kTagResults = 2000;

// Fixed-size header rank 0 broadcasts after reading the inputs, so that a bad
// file fails every rank with the same message instead of hanging them.
struct Header {
  std::uint64_t ok = 1, p = 0, b = 0, h = 0, k = 0, v = 0, has_g = 0;
  char message[456] = {};
};

// Everything rank 0 holds about the inputs: dense per-rank arrays.
struct Inputs {
  SummaryShape shape;
  std::vector<std::vector<float>> s, m, g;  // per rank
};

std::vector<float> as_vector(const State& st) {
  return std::vector<float>(st.data(), st.data() + st.size());
}

Inputs load_files(const Config& cfg, std::size_t world) {
  namespace fs = std::filesystem;
  const fs::path dir(cfg.summaries);
  if (!fs::is_directory(dir)) throw IoError(cfg.summaries + ": not a directory");
  auto load = [&](const char* name, bool required) -> std::optional<NpyArray> {
    const fs::path p = dir / name;
    if (!fs::exists(p)) {
      if (required) throw IoError(p.string() + ": missing (required with --summaries)");
      return std::nullopt;
    }
    NpyArray a = read_npy(p.string());
    if (a.dtype != DType::f32)
      throw IoError(p.string() + ": dtype " + to_string(a.dtype) +
                    ", expected float32 (summaries are FP32)");
    if (a.shape.size() != 5)
      throw IoError(p.string() + ": " + std::to_string(a.shape.size()) +
                    "-d array, expected 5-d [P,B,H,rows,cols]");
    return a;
  };
  NpyArray s = *load("S.npy", true);
  NpyArray m = *load("M.npy", true);
  std::optional<NpyArray> g = load("G.npy", false);
  Inputs in;
  in.shape = {s.shape[1], s.shape[2], s.shape[3], s.shape[4]};
  const std::size_t p = s.shape[0];
  auto expect = [&](const std::string& file, const std::vector<std::size_t>& got,
                    const std::vector<std::size_t>& want) {
    if (got != want) {
      std::string a, b;
      for (auto x : got) a += std::to_string(x) + ",";
      for (auto x : want) b += std::to_string(x) + ",";
      throw IoError(file + ": shape (" + a + ") does not match (" + b + ") implied by S.npy");
    }
  };
  expect("M.npy", m.shape, {p, in.shape.batch, in.shape.heads, in.shape.key_dim, in.shape.key_dim});
  if (g) expect("G.npy", g->shape, s.shape);
  auto flag = [&](bool given, std::size_t value, std::size_t file, const char* name) {
    if (given && value != file)
      throw InvalidArgument(std::string("--") + name + " is " + std::to_string(value) +
                            " but the summaries have " + std::to_string(file));
  };
  flag(cfg.given_ranks || world != cfg.backend.ranks, world, p, "ranks");
  flag(cfg.given_batch, cfg.batch, in.shape.batch, "batch");
  flag(cfg.given_heads, cfg.heads, in.shape.heads, "heads");
  flag(cfg.given_k, cfg.key_dim, in.shape.key_dim, "key-dim");
  flag(cfg.given_v, cfg.value_dim, in.shape.value_dim, "value-dim");
  const std::size_t ns = in.shape.state_elems(), nm = in.shape.slabs() * in.shape.key_dim * in.shape.key_dim;
  const auto sf = s.to_f32(false), mf = m.to_f32(false);
  for (std::size_t r = 0; r < p; ++r) {
    in.s.emplace_back(sf.begin() + r * ns, sf.begin() + (r + 1) * ns);
    in.m.emplace_back(mf.begin() + r * nm, mf.begin() + (r + 1) * nm);
  }
  if (g) {
    const auto gf = g->to_f32(false);
    for (std::size_t r = 0; r < p; ++r) in.g.emplace_back(gf.begin() + r * ns, gf.begin() + (r + 1) * ns);
  } else {
    for (std::size_t r = 0; r < p; ++r)
      in.g.push_back(as_vector(synthetic_summary(in.shape, cfg.seed, r, true).offset));
  }
  return in;
}

Inputs synthetic_inputs(const Config& cfg, std::size_t p) {
  Inputs in;
  in.shape = {cfg.batch, cfg.heads, cfg.key_dim, cfg.value_dim};
  for (std::size_t r = 0; r < p; ++r) {
    auto f = synthetic_summary(in.shape, cfg.seed, r, false);
    in.s.push_back(as_vector(f.offset));
    in.m.push_back(as_vector(f.transfer));
    in.g.push_back(as_vector(synthetic_summary(in.shape, cfg.seed, r, true).offset));
  }
  return in;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// Per-rank results sent to rank 0.
struct RankRecord {
  double fwd_s = 0, bwd_s = 0;
  double fwd_sent = 0, fwd_recv = 0, bwd_sent = 0, bwd_recv = 0;
  double peak_extra = 0;
  double equal_p2p = 1;
};

std::span<std::byte> raw(void* p, std::size_t n) { return {static_cast<std::byte*>(p), n}; }

void run_rank(const Config& cfg, const std::shared_ptr<Communicator>& world) {
  Communicator& comm = *world;
  const std::size_t p = comm.size(), r = comm.rank();
  Header hdr;
  Inputs all;
  if (r == 0) {
    try {
      all = cfg.summaries.empty() ? synthetic_inputs(cfg, p) : load_files(cfg, p);
      hdr.p = p;
      hdr.b = all.shape.batch, hdr.h = all.shape.heads;
      hdr.k = all.shape.key_dim, hdr.v = all.shape.value_dim;
    } catch (const Error& e) {
      hdr.ok = 0;
      std::snprintf(hdr.message, sizeof hdr.message, "%s", e.what());
    }
  }
  comm.broadcast(raw(&hdr, sizeof hdr), 0);
  if (!hdr.ok) {
    if (r == 0) throw InvalidArgument(hdr.message);
    return;  // rank 0 reports; the others stop cleanly
  }
  const SummaryShape shape{hdr.b, hdr.h, hdr.k, hdr.v};
  State s(shape.batch, shape.heads, shape.key_dim, shape.value_dim);
  State m(shape.batch, shape.heads, shape.key_dim, shape.key_dim);
  State g(shape.batch, shape.heads, shape.key_dim, shape.value_dim);
  if (r == 0) {
    // Rank 0 scatters the inputs; each rank holds only its own summary.
    std::vector<std::unique_ptr<Request>> sends;
    for (std::size_t q = 1; q < p; ++q) {
      sends.push_back(comm.isend(std::as_bytes(std::span(all.s[q])), q, kTagInputs));
      sends.push_back(comm.isend(std::as_bytes(std::span(all.m[q])), q, kTagInputs));
      sends.push_back(comm.isend(std::as_bytes(std::span(all.g[q])), q, kTagInputs));
    }
    for (auto& req : sends) req->wait();
    std::memcpy(s.data(), all.s[0].data(), s.bytes());
    std::memcpy(m.data(), all.m[0].data(), m.bytes());
    std::memcpy(g.data(), all.g[0].data(), g.bytes());
  } else {
    comm.irecv(raw(s.data(), s.bytes()), 0, kTagInputs)->wait();
    comm.irecv(raw(m.data(), m.bytes()), 0, kTagInputs)->wait();
    comm.irecv(raw(g.data(), g.bytes()), 0, kTagInputs)->wait();
  }

  const std::size_t threads =
      cfg.threads ? cfg.threads : ThreadPool::default_threads(ranks_per_process(cfg.backend));
  ThreadPool pool(threads);
  ExchangeOptions opts = exchange_options(cfg.exchange, shape);
  opts.exec.pool = &pool;
  opts.exec.kernel = cfg.kernel == "scalar" ? KernelKind::scalar
                     : cfg.kernel == "simd" ? KernelKind::simd
                                            : KernelKind::best;
  const DeviceMesh mesh = DeviceMesh::create(world, {p}, {"cp"});
  auto ex = make_state_exchange(mesh, cfg.exchange.protocol, cfg.exchange.group_size, opts);

  RankRecord rec;
  std::vector<double> tf, tb;
  State incoming, grad;
  for (std::size_t it = 0; it < cfg.repeat; ++it) {
    comm.barrier();
    auto t0 = std::chrono::steady_clock::now();
    incoming = ex->forward(s.view(), m.view());
    auto t1 = std::chrono::steady_clock::now();
    const ExchangeStats fs = ex->last_stats();
    comm.barrier();
    auto t2 = std::chrono::steady_clock::now();
    grad = ex->backward(g.view(), m.view());
    auto t3 = std::chrono::steady_clock::now();
    const ExchangeStats bs = ex->last_stats();
    tf.push_back(std::chrono::duration<double>(t1 - t0).count());
    tb.push_back(std::chrono::duration<double>(t3 - t2).count());
    rec.fwd_sent = double(fs.bytes_sent), rec.fwd_recv = double(fs.bytes_received);
    rec.bwd_sent = double(bs.bytes_sent), rec.bwd_recv = double(bs.bytes_received);
    rec.peak_extra = double(std::max(fs.peak_extra_bytes, bs.peak_extra_bytes));
  }
  rec.fwd_s = median(tf);
  rec.bwd_s = median(tb);
  // Only the exact protocols promise the chain's bits; the reassociating ones
  // are judged by their error against the FP64 chain below.
  if (ex->method() != "p2p" && ex->exact()) {
    ExchangeOptions chain_opts;
    chain_opts.exec = opts.exec;
    auto chain = make_state_exchange(mesh, "p2p", 1, chain_opts);
    State ci = chain->forward(s.view(), m.view());
    State cg = chain->backward(g.view(), m.view());
    rec.equal_p2p = std::memcmp(ci.data(), incoming.data(), ci.bytes()) == 0 &&
                    std::memcmp(cg.data(), grad.data(), cg.bytes()) == 0;
  }

  if (r != 0) {
    comm.isend(std::as_bytes(std::span(&rec, 1)), 0, kTagResults)->wait();
    comm.isend(raw(incoming.data(), incoming.bytes()), 0, kTagResults)->wait();
    comm.isend(raw(grad.data(), grad.bytes()), 0, kTagResults)->wait();
    return;
  }
  std::vector<RankRecord> recs(p);
  std::vector<State> inc(p), grd(p);
  recs[0] = rec;
  inc[0] = std::move(incoming);
  grd[0] = std::move(grad);
  for (std::size_t q = 1; q < p; ++q) {
    inc[q] = State(shape.batch, shape.heads, shape.key_dim, shape.value_dim);
    grd[q] = State(shape.batch, shape.heads, shape.key_dim, shape.value_dim);
    comm.irecv(raw(&recs[q], sizeof(RankRecord)), q, kTagResults)->wait();
    comm.irecv(raw(inc[q].data(), inc[q].bytes()), q, kTagResults)->wait();
    comm.irecv(raw(grd[q].data(), grd[q].bytes()), q, kTagResults)->wait();
  }

  std::vector<const float*> sp, mp, gp;
  for (std::size_t q = 0; q < p; ++q) {
    sp.push_back(all.s[q].data());
    mp.push_back(all.m[q].data());
    gp.push_back(all.g[q].data());
  }
  const auto ref_f = reference::chain(sp, mp, shape, Direction::forward);
  const auto ref_b = reference::chain(gp, mp, shape, Direction::backward);
  const bool exact = ex->exact();
  bool all_equal = true;
  double max_abs = 0, max_rel = 0;
  nlohmann::json ranks = nlohmann::json::array();
  Table table({"rank", "fwd ms", "bwd ms", "sent/call", "recv/call", "peak extra", "fwd max abs",
               "fwd rel", "bwd max abs", "bwd rel", "== p2p"});
  for (std::size_t q = 0; q < p; ++q) {
    const auto ef = reference::compare(inc[q].data(), ref_f[q]);
    const auto eb = reference::compare(grd[q].data(), ref_b[q]);
    all_equal = all_equal && recs[q].equal_p2p != 0;
    max_abs = std::max({max_abs, ef.max_abs, eb.max_abs});
    max_rel = std::max({max_rel, ef.rel_fro, eb.rel_fro});
    const auto& rc = recs[q];
    table.add({std::to_string(q), fmt("%.3f", rc.fwd_s * 1e3), fmt("%.3f", rc.bwd_s * 1e3),
               fmt_bytes((rc.fwd_sent + rc.bwd_sent) / 2), fmt_bytes((rc.fwd_recv + rc.bwd_recv) / 2),
               fmt_bytes(rc.peak_extra), fmt("%.2e", ef.max_abs), fmt("%.2e", ef.rel_fro),
               fmt("%.2e", eb.max_abs), fmt("%.2e", eb.rel_fro),
               !exact ? "n/a" : rc.equal_p2p ? "yes" : "NO"});
    ranks.push_back({{"rank", q},
                     {"forward_seconds", rc.fwd_s},
                     {"backward_seconds", rc.bwd_s},
                     {"forward_bytes_sent", rc.fwd_sent},
                     {"forward_bytes_received", rc.fwd_recv},
                     {"backward_bytes_sent", rc.bwd_sent},
                     {"backward_bytes_received", rc.bwd_recv},
                     {"peak_extra_bytes", rc.peak_extra},
                     {"forward_max_abs_error", ef.max_abs},
                     {"forward_rel_error", ef.rel_fro},
                     {"backward_max_abs_error", eb.max_abs},
                     {"backward_rel_error", eb.rel_fro},
                     {"bitwise_equal_to_p2p", exact ? nlohmann::json(rc.equal_p2p != 0) : nlohmann::json()}});
  }

  if (!cfg.out.empty()) {
    std::filesystem::create_directories(cfg.out);
    std::vector<float> buf(p * shape.state_elems());
    const std::vector<std::size_t> dims{p, shape.batch, shape.heads, shape.key_dim, shape.value_dim};
    for (std::size_t q = 0; q < p; ++q) std::memcpy(buf.data() + q * shape.state_elems(), inc[q].data(), inc[q].bytes());
    write_npy((std::filesystem::path(cfg.out) / "incoming.npy").string(), buf.data(), dims);
    for (std::size_t q = 0; q < p; ++q) std::memcpy(buf.data() + q * shape.state_elems(), grd[q].data(), grd[q].bytes());
    write_npy((std::filesystem::path(cfg.out) / "final_grad.npy").string(), buf.data(), dims);
  }

  const std::string kernel_name =
      opts.exec.kernel == KernelKind::scalar ? "scalar" : "simd(" + simd_target_name() + ")";
  if (cfg.json) {
    nlohmann::json j = {{"command", "exchange"},
                        {"backend", comm.backend()},
                        {"protocol", ex->method()},
                        {"requested_protocol", cfg.exchange.protocol},
                        {"group_size", cfg.exchange.group_size},
                        {"exact", exact},
                        {"P", p},
                        {"B", shape.batch},
                        {"H", shape.heads},
                        {"K", shape.key_dim},
                        {"V", shape.value_dim},
                        {"seed", cfg.seed},
                        {"repeat", cfg.repeat},
                        {"threads_per_rank", threads},
                        {"kernel", kernel_name},
                        {"ranks", ranks},
                        {"max_abs_error", max_abs},
                        {"max_rel_error", max_rel},
                        {"bitwise_equal_to_p2p", exact ? nlohmann::json(all_equal) : nlohmann::json()}};
    if (const auto pred = ex->prediction()) {
      j["auto"] = {{"method", pred->config.method},
                   {"group_size", pred->config.group_size},
                   {"segments", pred->config.segments},
                   {"exact", pred->exact},
                   {"predicted_seconds", pred->seconds},
                   {"predicted_peak_extra_bytes", pred->peak_extra_bytes},
                   {"cost_source", opts.cost.source}};
    }
    std::printf("%s\n", j.dump(2).c_str());
  } else {
    std::printf("kdacp exchange: backend=%s protocol=%s", comm.backend().c_str(),
                describe_method(*ex, cfg.exchange).c_str());
    if (cfg.exchange.group_size > 1) std::printf(" (group size %lld)", cfg.exchange.group_size);
    std::printf(" P=%zu B=%zu H=%zu K=%zu V=%zu kernel=%s threads/rank=%zu repeat=%zu\n\n", p,
                shape.batch, shape.heads, shape.key_dim, shape.value_dim, kernel_name.c_str(),
                threads, cfg.repeat);
    table.print();
    std::printf("\ntimes: median per call; errors: against the FP64 chain (rel = relative Frobenius)\n");
    std::printf("max abs error %.3e, max rel error %.3e\n", max_abs, max_rel);
    if (exact) {
      std::printf("bitwise equal to p2p: %s\n", all_equal ? "yes" : "NO");
    } else {
      // docs/protocols.md: relative error <= (ceil(log2 P) + 2) K 2^-24 for
      // transfers of spectral norm <= 1.
      std::size_t rounds = 0;
      while ((std::size_t{1} << rounds) < p) ++rounds;
      const double bound = double(rounds + 2) * double(shape.key_dim) * 0x1p-24;
      std::printf("bitwise equal to p2p: not applicable (%s reassociates); documented bound %.2e\n",
                  ex->method().c_str(), bound);
    }
  }
  if (exact && !all_equal) throw Error("results differ from the p2p chain");
}

}  // namespace

void add_exchange_command(CLI::App& app) {
  auto cfg = std::make_shared<Config>();
  CLI::App* cmd = app.add_subcommand(
      "exchange",
      "run one protocol's forward + backward on P ranks (default: auto, the cost model's "
      "choice) and check it against the FP64 chain and, when exact, the p2p chain bit for bit");
  add_backend_flags(*cmd, cfg->backend);
  add_exchange_flags(*cmd, cfg->exchange);
  auto* ob = cmd->add_option("--batch,-B", cfg->batch, "batch size B")->check(CLI::PositiveNumber)->capture_default_str();
  auto* oh = cmd->add_option("--heads,-H", cfg->heads, "heads H")->check(CLI::PositiveNumber)->capture_default_str();
  auto* ok = cmd->add_option("--key-dim,-K", cfg->key_dim, "key dim K (multiple of 16 in [16,256])")->capture_default_str();
  auto* ov = cmd->add_option("--value-dim,-V", cfg->value_dim, "value dim V (multiple of 16 in [16,256])")->capture_default_str();
  cmd->add_option("--seed", cfg->seed, "seed of the synthetic summaries")->capture_default_str();
  cmd->add_option("--repeat", cfg->repeat, "timed repetitions (median reported)")
      ->check(CLI::Range(1, 100000))
      ->capture_default_str();
  cmd->add_option("--threads", cfg->threads,
                  "kernel threads per rank (0: hardware threads divided among the ranks)")
      ->capture_default_str();
  cmd->add_option("--kernel", cfg->kernel, "fold kernel: best, simd or scalar")
      ->check(CLI::IsMember({"best", "simd", "scalar"}))
      ->capture_default_str();
  cmd->add_option("--summaries", cfg->summaries,
                  "read S.npy [P,B,H,K,V], M.npy [P,B,H,K,K] and optional G.npy from DIR");
  cmd->add_option("--out", cfg->out, "write incoming.npy and final_grad.npy [P,B,H,K,V] to DIR");
  cmd->add_flag("--json", cfg->json, "print JSON instead of a table");
  cmd->callback([cfg, ob, oh, ok, ov] {
    cfg->given_ranks = cfg->backend.ranks_given;
    cfg->given_batch = ob->count() > 0;
    cfg->given_heads = oh->count() > 0;
    cfg->given_k = ok->count() > 0;
    cfg->given_v = ov->count() > 0;
    // Bad --memory-budget / --calibration fail here, before any rank starts.
    (void)exchange_options(cfg->exchange, SummaryShape{cfg->batch, cfg->heads, cfg->key_dim, cfg->value_dim});
    run_ranks(cfg->backend, [cfg](const std::shared_ptr<Communicator>& world) { run_rank(*cfg, world); });
  });
}

}  // namespace kdacp::cli
