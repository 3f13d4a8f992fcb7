#include "kdacp/report/exchange_check.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <span>
#include <string_view>
#include <type_traits>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "kdacp/admission.hpp"
#include "kdacp/error.hpp"
#include "kdacp/finite.hpp"
#include "kdacp/npy.hpp"
#include "kdacp/protocol.hpp"
#include "kdacp/report/table.hpp"
#include "kdacp/testing/synthetic.hpp"
#include "kdacp/thread_pool.hpp"

namespace kdacp::report {

namespace {

namespace fs = std::filesystem;

constexpr int kTagInputs = 1000;
constexpr int kTagResults = 2000;

// Fixed-size header rank 0 broadcasts after making the inputs, so that a bad
// input fails every rank with the same message instead of hanging them.
struct Header {
  std::uint64_t ok = 1, p = 0, b = 0, h = 0, k = 0, v = 0;
  char message[456] = {};
};

static_assert(std::is_trivially_copyable_v<ExchangeRecord>, "gather_runs sends records as bytes");

std::span<std::byte> raw(void* p, std::size_t n) { return {static_cast<std::byte*>(p), n}; }

std::vector<float> as_vector(const State& st) {
  return std::vector<float>(st.data(), st.data() + st.size());
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

std::optional<NpyArray> load_summary(const fs::path& dir, const char* name, bool required) {
  const fs::path p = dir / name;
  if (!fs::exists(p)) {
    if (required) throw IoError(p.string() + ": missing (required with --summaries)");
    return std::nullopt;
  }
  NpyArray a = read_npy(p.string());
  require_finite(a, p.string());
  if (a.dtype != DType::f32 || a.half)
    throw IoError(p.string() + ": dtype " + a.file_dtype() + ", expected float32 (summaries are FP32)");
  if (a.shape.size() != 5)
    throw IoError(fmt::format("{}: {}-d array, expected 5-d [P,B,H,rows,cols]", p.string(), a.shape.size()));
  return a;
}

void expect_shape(const std::string& file, const std::vector<std::size_t>& got,
                  const std::vector<std::size_t>& want) {
  if (got == want) return;
  // Each entry is followed by a comma: "(2,1,4,32,32,)" (the text since the first release).
  throw IoError(fmt::format("{}: shape ({},) does not match ({},) implied by S.npy", file, fmt::join(got, ","),
                            fmt::join(want, ",")));
}

// Splits a [P, n] array into P per-rank vectors.
std::vector<std::vector<float>> per_rank(const std::vector<float>& all, std::size_t p, std::size_t n) {
  std::vector<std::vector<float>> out;
  for (std::size_t r = 0; r < p; ++r) out.emplace_back(all.begin() + r * n, all.begin() + (r + 1) * n);
  return out;
}

// The larger error; a NaN wins, so that no report hides one.
double worst(double a, double b) { return std::isnan(a) || std::isnan(b) ? NAN : std::max(a, b); }

ExchangeOptions options_for(const ExchangeCheck& check, const SummaryShape& shape) {
  ExchangeOptions o = check.options;
  o.expected_shape = shape;
  return o;
}

}  // namespace

WorldSummaries synthetic_world(const SummaryShape& shape, std::size_t ranks, std::uint64_t seed) {
  WorldSummaries w;
  w.shape = shape;
  w.seed = seed;
  for (std::size_t r = 0; r < ranks; ++r) {
    auto f = synthetic_summary(shape, seed, r, false);
    w.s.push_back(as_vector(f.offset));
    w.m.push_back(as_vector(f.transfer));
    w.g.push_back(as_vector(synthetic_summary(shape, seed, r, true).offset));
  }
  return w;
}

double world_npy_bytes(const std::string& dir) {
  double bytes = 0;
  for (const char* name : {"S.npy", "M.npy", "G.npy"}) {
    std::error_code ec;
    const auto size = fs::file_size(fs::path(dir) / name, ec);
    if (!ec) bytes += double(size);
  }
  // The file's bytes, their float32 copy and the per-rank split.
  return 3 * bytes;
}

double exchange_check_bytes(const SummaryShape& shape, std::size_t world, std::size_t ranks_here,
                            double rank_call_bytes) {
  const double state = double(shape.state_elems()) * sizeof(float);
  const double transfer = double(shape.slabs()) * double(shape.key_dim) * double(shape.key_dim) * sizeof(float);
  const double p = double(world);
  // Per rank: its summaries, the call, the last results and the p2p chain's.
  const double per_rank = 2 * state + transfer + rank_call_bytes + 4 * state;
  // Rank 0: every rank's summaries and results, the FP64 chain of both
  // directions and the buffer of the .npy output.
  const double root = p * (2 * state + transfer) + p * 2 * state + 2 * p * 2 * state + p * state;
  return double(ranks_here) * per_rank + root;
}

WorldSummaries read_world_npy(const std::string& dir, std::uint64_t seed) {
  if (!fs::is_directory(dir)) throw IoError(dir + ": not a directory");
  const NpyArray s = *load_summary(dir, "S.npy", true);
  const NpyArray m = *load_summary(dir, "M.npy", true);
  const std::optional<NpyArray> g = load_summary(dir, "G.npy", false);
  WorldSummaries w;
  w.shape = {s.shape[1], s.shape[2], s.shape[3], s.shape[4]};
  w.seed = seed;
  const std::size_t p = s.shape[0], k = w.shape.key_dim;
  expect_shape("M.npy", m.shape, {p, w.shape.batch, w.shape.heads, k, k});
  if (g) expect_shape("G.npy", g->shape, s.shape);
  const std::size_t ns = w.shape.state_elems(), nm = w.shape.slabs() * k * k;
  w.s = per_rank(s.to_f32(false), p, ns);
  w.m = per_rank(m.to_f32(false), p, nm);
  if (g) {
    w.g = per_rank(g->to_f32(false), p, ns);
  } else {
    for (std::size_t r = 0; r < p; ++r) w.g.push_back(as_vector(synthetic_summary(w.shape, seed, r, true).offset));
  }
  return w;
}

SummarySource::SummarySource(SummarySpec spec) : spec_(std::move(spec)) {
  if (spec_.dir.empty()) shape_ = spec_.shape;
}

WorldSummaries SummarySource::read() const {
  require_memory(world_npy_bytes(spec_.dir), max_memory_bytes(spec_.max_memory),
                 "reading the summaries of " + spec_.dir, max_memory_name(spec_.max_memory));
  return read_world_npy(spec_.dir, spec_.seed);
}

std::size_t SummarySource::read_ahead(const std::optional<IntRange>& world_ranks) {
  if (spec_.dir.empty()) return 0;
  ahead_ = read();
  shape_ = ahead_->shape;
  const std::size_t p = ahead_->ranks();
  if (world_ranks && (p < world_ranks->min || p > world_ranks->max))
    throw InvalidArgument(
        fmt::format("{}/S.npy has P = {}, expected {} in-process ranks", spec_.dir, p, describe(*world_ranks)));
  return p;
}

WorldSummaries SummarySource::operator()(std::size_t ranks) {
  if (spec_.dir.empty()) return synthetic_world(spec_.shape, ranks, spec_.seed);
  WorldSummaries w = ahead_ ? std::move(*ahead_) : read();
  ahead_.reset();
  if (ranks != w.ranks())
    throw InvalidArgument(fmt::format("the summaries have P = {} (first dimension of S.npy) but the run has {} ranks "
                                      "(--ranks, or the processes under mpirun)",
                                      w.ranks(), ranks));
  auto fixed = [](bool given, std::size_t value, std::size_t file, const char* name) {
    if (given && value != file)
      throw InvalidArgument(fmt::format("--{} is {} but the summaries have {}", name, value, file));
  };
  fixed(spec_.fixed_batch, spec_.shape.batch, w.shape.batch, "batch");
  fixed(spec_.fixed_heads, spec_.shape.heads, w.shape.heads, "heads");
  fixed(spec_.fixed_key_dim, spec_.shape.key_dim, w.shape.key_dim, "key-dim");
  fixed(spec_.fixed_value_dim, spec_.shape.value_dim, w.shape.value_dim, "value-dim");
  return w;
}

std::optional<RankSummaries> scatter_summaries(Communicator& comm,
                                               const std::function<WorldSummaries()>& make,
                                               WorldSummaries* world) {
  const std::size_t p = comm.size(), r = comm.rank();
  Header hdr;
  if (r == 0) {
    try {
      *world = make();
      hdr.p = p;
      hdr.b = world->shape.batch, hdr.h = world->shape.heads;
      hdr.k = world->shape.key_dim, hdr.v = world->shape.value_dim;
    } catch (const Error& e) {
      hdr.ok = 0;
      std::snprintf(hdr.message, sizeof hdr.message, "%s", e.what());
    }
  }
  comm.broadcast(raw(&hdr, sizeof hdr), 0);
  if (!hdr.ok) {
    if (r == 0) throw InvalidArgument(hdr.message);
    return std::nullopt;
  }
  const SummaryShape shape{hdr.b, hdr.h, hdr.k, hdr.v};
  RankSummaries in{shape, State(shape.batch, shape.heads, shape.key_dim, shape.value_dim),
                   State(shape.batch, shape.heads, shape.key_dim, shape.key_dim),
                   State(shape.batch, shape.heads, shape.key_dim, shape.value_dim)};
  if (r == 0) {
    std::vector<std::unique_ptr<Request>> sends;
    for (std::size_t q = 1; q < p; ++q) {
      sends.push_back(comm.isend(std::as_bytes(std::span(world->s[q])), q, kTagInputs));
      sends.push_back(comm.isend(std::as_bytes(std::span(world->m[q])), q, kTagInputs));
      sends.push_back(comm.isend(std::as_bytes(std::span(world->g[q])), q, kTagInputs));
    }
    for (auto& req : sends) req->wait();
    std::memcpy(in.s.data(), world->s[0].data(), in.s.bytes());
    std::memcpy(in.m.data(), world->m[0].data(), in.m.bytes());
    std::memcpy(in.g.data(), world->g[0].data(), in.g.bytes());
  } else {
    comm.irecv(raw(in.s.data(), in.s.bytes()), 0, kTagInputs)->wait();
    comm.irecv(raw(in.m.data(), in.m.bytes()), 0, kTagInputs)->wait();
    comm.irecv(raw(in.g.data(), in.g.bytes()), 0, kTagInputs)->wait();
  }
  return in;
}

RankRun time_exchange(Communicator& comm, StateExchange& ex, const RankSummaries& in,
                      std::size_t repeat) {
  RankRun run;
  ExchangeRecord& rec = run.record;
  std::vector<double> tf, tb;
  for (std::size_t it = 0; it < repeat; ++it) {
    comm.barrier();
    const double t0 = comm.now_seconds();
    run.incoming = ex.forward(in.s.view(), in.m.view());
    const double t1 = comm.now_seconds();
    const ExchangeStats fs = ex.last_stats();
    comm.barrier();
    const double t2 = comm.now_seconds();
    run.final_grad = ex.backward(in.g.view(), in.m.view());
    const double t3 = comm.now_seconds();
    const ExchangeStats bs = ex.last_stats();
    tf.push_back(t1 - t0);
    tb.push_back(t3 - t2);
    rec.forward_bytes_sent = double(fs.bytes_sent), rec.forward_bytes_received = double(fs.bytes_received);
    rec.backward_bytes_sent = double(bs.bytes_sent), rec.backward_bytes_received = double(bs.bytes_received);
    rec.peak_extra_bytes = double(std::max(fs.peak_extra_bytes, bs.peak_extra_bytes));
  }
  rec.forward_seconds = median(tf);
  rec.backward_seconds = median(tb);
  return run;
}

void compare_with_p2p(const DeviceMesh& mesh, const StateExchange& ex, const ExecPolicy& exec,
                      const RankSummaries& in, RankRun& run) {
  if (ex.method() == kChainProtocol || !ex.exact()) return;
  ExchangeOptions chain_opts;
  chain_opts.exec = exec;
  auto chain = make_state_exchange(mesh, std::string(kChainProtocol), 1, chain_opts);
  State ci = chain->forward(in.s.view(), in.m.view());
  State cg = chain->backward(in.g.view(), in.m.view());
  run.record.equal_to_p2p = std::memcmp(ci.data(), run.incoming.data(), ci.bytes()) == 0 &&
                            std::memcmp(cg.data(), run.final_grad.data(), cg.bytes()) == 0;
}

std::vector<RankRun> gather_runs(Communicator& comm, const SummaryShape& shape, RankRun mine) {
  if (comm.rank() != 0) {
    comm.isend(std::as_bytes(std::span(&mine.record, 1)), 0, kTagResults)->wait();
    comm.isend(raw(mine.incoming.data(), mine.incoming.bytes()), 0, kTagResults)->wait();
    comm.isend(raw(mine.final_grad.data(), mine.final_grad.bytes()), 0, kTagResults)->wait();
    return {};
  }
  std::vector<RankRun> all(comm.size());
  all[0] = std::move(mine);
  for (std::size_t q = 1; q < all.size(); ++q) {
    RankRun& r = all[q];
    r.incoming = State(shape.batch, shape.heads, shape.key_dim, shape.value_dim);
    r.final_grad = State(shape.batch, shape.heads, shape.key_dim, shape.value_dim);
    comm.irecv(raw(&r.record, sizeof(ExchangeRecord)), q, kTagResults)->wait();
    comm.irecv(raw(r.incoming.data(), r.incoming.bytes()), q, kTagResults)->wait();
    comm.irecv(raw(r.final_grad.data(), r.final_grad.bytes()), q, kTagResults)->wait();
  }
  return all;
}

std::vector<RankErrors> chain_errors(const WorldSummaries& world, const std::vector<RankRun>& runs) {
  std::vector<const float*> sp, mp, gp;
  for (std::size_t q = 0; q < world.ranks(); ++q) {
    sp.push_back(world.s[q].data());
    mp.push_back(world.m[q].data());
    gp.push_back(world.g[q].data());
  }
  const auto ref_f = reference::chain(sp, mp, world.shape, Direction::forward);
  const auto ref_b = reference::chain(gp, mp, world.shape, Direction::backward);
  std::vector<RankErrors> errors;
  for (std::size_t q = 0; q < runs.size(); ++q)
    errors.push_back({reference::compare(runs[q].incoming.data(), ref_f[q]),
                      reference::compare(runs[q].final_grad.data(), ref_b[q])});
  return errors;
}

void require_finite_runs(const SummaryShape& shape, const std::vector<RankRun>& runs) {
  const std::size_t p = runs.size(), n = shape.state_elems();
  const std::vector<std::size_t> dims{p, shape.batch, shape.heads, shape.key_dim, shape.value_dim};
  for (const char* name : {"incoming.npy", "final_grad.npy"})
    for (std::size_t q = 0; q < p; ++q) {
      const State& st = std::string_view(name) == "incoming.npy" ? runs[q].incoming : runs[q].final_grad;
      const std::span<const float> data(st.data<float>(), st.size());
      if (const auto bad = find_non_finite(data))
        throw Error(std::string("the run produced a non-finite result from finite inputs: ") + name + " element " +
                    index_string(q * n + *bad, dims) + " is " + exact_string(data[*bad]) + " (float32)");
    }
}

void write_runs_npy(const std::string& dir, const SummaryShape& shape, const std::vector<RankRun>& runs) {
  const std::size_t p = runs.size(), n = shape.state_elems();
  fs::create_directories(dir);
  std::vector<float> buf(p * n);
  const std::vector<std::size_t> dims{p, shape.batch, shape.heads, shape.key_dim, shape.value_dim};
  for (std::size_t q = 0; q < p; ++q) std::memcpy(buf.data() + q * n, runs[q].incoming.data(), runs[q].incoming.bytes());
  write_npy((fs::path(dir) / "incoming.npy").string(), buf.data(), dims);
  for (std::size_t q = 0; q < p; ++q) std::memcpy(buf.data() + q * n, runs[q].final_grad.data(), runs[q].final_grad.bytes());
  write_npy((fs::path(dir) / "final_grad.npy").string(), buf.data(), dims);
}

void admit_exchange_check(const ExchangeCheck& check, const SummaryShape& shape, std::size_t world) {
  const ProblemShape ps{world, shape.slabs(), shape.key_dim, shape.value_dim, sizeof(float)};
  const Prediction pred = predict_exchange(ps, check.method, check.group_size, options_for(check, shape));
  const std::size_t here = check.ranks_here;
  require_memory(exchange_check_bytes(shape, world, here, exchange_rank_bytes(ps, pred)),
                 max_memory_bytes(check.max_memory),
                 fmt::format("kdacp exchange with {} on {} of {} ranks in this process, {}", protocol_label(pred.config),
                             here, world, to_string(shape)),
                 max_memory_name(check.max_memory));
}

std::optional<ExchangeCheckResult> check_exchange(const std::shared_ptr<Communicator>& world,
                                                  const ExchangeCheck& check,
                                                  const std::function<WorldSummaries()>& make,
                                                  const std::optional<SummaryShape>& shape) {
  Communicator& comm = *world;
  if (shape) admit_exchange_check(check, *shape, comm.size());
  ExchangeCheckResult res;
  const auto in = scatter_summaries(comm, make, &res.world);
  if (!in) return std::nullopt;
  if (!shape) admit_exchange_check(check, in->shape, comm.size());
  res.threads = check.threads ? check.threads : ThreadPool::default_threads(check.ranks_here);
  ThreadPool pool(res.threads);
  res.options = options_for(check, in->shape);
  res.options.exec.pool = &pool;
  res.options.exec.kernel = check.kernel;
  const DeviceMesh mesh = DeviceMesh::create(world, {comm.size()}, {"cp"});
  auto ex = make_state_exchange(mesh, check.method, check.group_size, res.options);
  RankRun mine = time_exchange(comm, *ex, *in, check.repeat);
  compare_with_p2p(mesh, *ex, res.options.exec, *in, mine);
  res.runs = gather_runs(comm, in->shape, std::move(mine));
  if (comm.rank() != 0) return std::nullopt;
  res.options.exec.pool = nullptr;  // the pool ends with this call
  res.backend = comm.backend();
  res.kernel = check.kernel == KernelKind::scalar ? "scalar" : "simd(" + simd_target_name() + ")";
  res.ranks = comm.size();
  res.shape = in->shape;
  res.protocol = &ex->descriptor();
  res.prediction = ex->prediction();
  res.errors = chain_errors(res.world, res.runs);
  res.requested_method = check.method;
  res.group_size = check.group_size;
  res.repeat = check.repeat;
  for (std::size_t q = 0; q < res.runs.size(); ++q) {
    res.equal_to_p2p = res.equal_to_p2p && res.runs[q].record.equal_to_p2p != 0;
    for (double e : {res.errors[q].forward.max_abs, res.errors[q].backward.max_abs})
      res.max_abs_error = worst(res.max_abs_error, e);
    for (double e : {res.errors[q].forward.rel_fro, res.errors[q].backward.rel_fro})
      res.max_rel_error = worst(res.max_rel_error, e);
  }
  return res;
}

std::string to_json(const ExchangeCheckResult& run) {
  using nlohmann::json;
  const bool exact = run.protocol->exact();
  json ranks = json::array();
  for (std::size_t q = 0; q < run.runs.size(); ++q) {
    const ExchangeRecord& rc = run.runs[q].record;
    const auto& ef = run.errors[q].forward;
    const auto& eb = run.errors[q].backward;
    ranks.push_back({{"rank", q},
                     {"forward_seconds", rc.forward_seconds}, {"backward_seconds", rc.backward_seconds},
                     {"forward_bytes_sent", rc.forward_bytes_sent},
                     {"forward_bytes_received", rc.forward_bytes_received},
                     {"backward_bytes_sent", rc.backward_bytes_sent},
                     {"backward_bytes_received", rc.backward_bytes_received},
                     {"peak_extra_bytes", rc.peak_extra_bytes}, {"forward_max_abs_error", ef.max_abs},
                     {"forward_rel_error", ef.rel_fro}, {"backward_max_abs_error", eb.max_abs},
                     {"backward_rel_error", eb.rel_fro},
                     {"bitwise_equal_to_p2p", exact ? json(rc.equal_to_p2p != 0) : json()}});
  }
  const SummaryShape& shape = run.shape;
  json j = {{"command", "exchange"},
            {"backend", run.backend}, {"protocol", std::string(run.protocol->name)},
            {"requested_protocol", run.requested_method}, {"group_size", run.group_size},
            {"exact", exact}, {"P", run.ranks}, {"B", shape.batch}, {"H", shape.heads},
            {"K", shape.key_dim}, {"V", shape.value_dim}, {"seed", run.world.seed}, {"repeat", run.repeat},
            {"threads_per_rank", run.threads}, {"kernel", run.kernel}, {"ranks", ranks},
            {"max_abs_error", run.max_abs_error}, {"max_rel_error", run.max_rel_error},
            {"bitwise_equal_to_p2p", exact ? json(run.equal_to_p2p) : json()}};
  if (const auto& pred = run.prediction) {
    j["auto"] = {{"method", pred->config.method},
                 {"group_size", pred->config.group_size}, {"segments", pred->config.segments},
                 {"exact", pred->exact}, {"predicted_seconds", pred->seconds},
                 {"predicted_peak_extra_bytes", pred->peak_extra_bytes},
                 {"cost_source", run.options.cost.source}};
  }
  return j.dump(2);
}

std::unique_ptr<StagedOutput> stage_runs_npy(const std::string& dir, const SummaryShape& shape,
                                             const std::vector<RankRun>& runs) {
  // A NaN or Inf is a failure, not a result: checked before any file is staged.
  try {
    require_finite_runs(shape, runs);
  } catch (const Error& e) {
    throw Error(fmt::format("{}; nothing was written to {}", e.what(), dir));
  }
  auto out = std::make_unique<StagedOutput>(dir, std::vector<std::string>{"incoming.npy", "final_grad.npy"});
  write_runs_npy(out->staging_dir(), shape, runs);
  return out;
}

void print_exchange_check(const ExchangeCheckResult& run, const std::string& method) {
  const SummaryShape& shape = run.shape;
  const bool exact = run.protocol->exact();
  Table table({"rank", "fwd ms", "bwd ms", "sent/call", "recv/call", "peak extra", "fwd max abs", "fwd rel",
               "bwd max abs", "bwd rel", "== p2p"});
  for (std::size_t q = 0; q < run.runs.size(); ++q) {
    const auto& ef = run.errors[q].forward;
    const auto& eb = run.errors[q].backward;
    const ExchangeRecord& rc = run.runs[q].record;
    table.add({fmt::format("{}", q), fmt::format("{:.3f}", rc.forward_seconds * 1e3),
               fmt::format("{:.3f}", rc.backward_seconds * 1e3),
               format_bytes((rc.forward_bytes_sent + rc.backward_bytes_sent) / 2),
               format_bytes((rc.forward_bytes_received + rc.backward_bytes_received) / 2),
               format_bytes(rc.peak_extra_bytes), fmt::format("{:.2e}", ef.max_abs), fmt::format("{:.2e}", ef.rel_fro),
               fmt::format("{:.2e}", eb.max_abs), fmt::format("{:.2e}", eb.rel_fro),
               !exact ? "n/a" : rc.equal_to_p2p ? "yes" : "NO"});
  }
  std::printf("kdacp exchange: backend=%s protocol=%s", run.backend.c_str(), method.c_str());
  if (run.group_size > 1) std::printf(" (group size %lld)", run.group_size);
  std::printf(" P=%zu B=%zu H=%zu K=%zu V=%zu kernel=%s threads/rank=%zu repeat=%zu\n\n", run.ranks, shape.batch,
              shape.heads, shape.key_dim, shape.value_dim, run.kernel.c_str(), run.threads, run.repeat);
  table.print();
  std::printf("\ntimes: median per call; errors: against the FP64 chain (rel = relative Frobenius)\n");
  std::printf("max abs error %.3e, max rel error %.3e\n", run.max_abs_error, run.max_rel_error);
  if (exact) {
    std::printf("bitwise equal to p2p: %s\n", run.equal_to_p2p ? "yes" : "NO");
  } else {
    // The registry row's documented bound (transfers of spectral norm <= 1).
    std::printf("bitwise equal to p2p: not applicable (%.*s reassociates); documented bound %.2e\n",
                int(run.protocol->name.size()), run.protocol->name.data(),
                error_bound(*run.protocol, run.ranks, shape.key_dim));
  }
}

}  // namespace kdacp::report

namespace kdacp::report {

namespace {

// Errors of every rank against the FP64 chain, the table or JSON, and the
// verdict: an exact protocol that differs from p2p fails the command.
void report_check(const ExchangeCheckFlags& cfg, const ExchangeCheckResult& run) {
  const auto out = cfg.out.empty() ? nullptr : stage_runs_npy(cfg.out, run.shape, run.runs);
  if (cfg.json) std::printf("%s\n", to_json(run).c_str());
  else print_exchange_check(run, describe_method(std::string(run.protocol->name), run.prediction, cfg.exchange));
  if (!std::isfinite(run.max_abs_error) || !std::isfinite(run.max_rel_error))
    throw Error(fmt::format("results are not finite (max abs error {:g})", run.max_abs_error));
  if (run.protocol->exact() && !run.equal_to_p2p) throw Error("results differ from the p2p chain");
  if (out) out->commit();
}

}  // namespace

void run_exchange_check(ExchangeCheckFlags cfg, const ProcessLauncher* launcher) {
  // Bad --memory-budget / --calibration fail here, before any rank starts.
  const SummaryShape shape{cfg.batch, cfg.heads, cfg.key_dim, cfg.value_dim};
  ExchangeCheck check{cfg.exchange.protocol, cfg.exchange.group_size, exchange_options(cfg.exchange, shape),
                      cfg.kernel, cfg.threads, 1, cfg.repeat, cfg.max_memory};
  SummarySource source({cfg.summaries, shape, cfg.seed, cfg.given_batch, cfg.given_heads, cfg.given_k, cfg.given_v,
                        cfg.max_memory});
  const bool in_process = resolve_backend(cfg.backend, launcher) == "inprocess";
  if (!cfg.summaries.empty() && in_process) {
    const bool given_ranks = cfg.backend.ranks_given;
    const std::size_t p = source.read_ahead(given_ranks ? std::nullopt : std::optional(kRanksRange));
    if (!given_ranks) cfg.backend.ranks = p;
  }
  check.ranks_here = ranks_per_process(cfg.backend, launcher);
  check_threads(check.ranks_here, cfg.threads);
  // In-process the whole world is this process: admit it before its P
  // threads start (thousands of them take seconds under a sanitizer).
  if (in_process && source.shape()) admit_exchange_check(check, *source.shape(), cfg.backend.ranks);
  launch(
      cfg.backend,
      [&](const std::shared_ptr<Communicator>& world) {
        const auto make = [&] { return source(world->size()); };
        if (const auto result = check_exchange(world, check, make, source.shape())) report_check(cfg, *result);
      },
      launcher);
}

}  // namespace kdacp::report
