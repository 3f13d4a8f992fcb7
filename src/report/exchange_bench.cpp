#include "kdacp/report/exchange_bench.hpp"

#include <algorithm>
#include <cstdio>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "kdacp/error.hpp"
#include "kdacp/mesh.hpp"
#include "kdacp/protocol.hpp"
#include "kdacp/tensor.hpp"
#include "kdacp/testing/synthetic.hpp"
#include "kdacp/report/table.hpp"
#include "kdacp/admission.hpp"
#include "core/simulation.hpp"

namespace kdacp::report {

namespace {

constexpr std::size_t kPartTokens = 4096;

PartOwners owners_for(const std::string& layout, std::size_t p) {
  if (layout == "contiguous") return PartOwners::one_per_rank(p);
  if (layout == "zigzag") return PartOwners::zigzag(p);
  throw InvalidArgument(fmt::format("layout '{}', expected contiguous or zigzag", layout));
}

// One pairwise all-to-all over `group` (what all_to_all_seconds prices): a
// rank's `send` holds one block of `block` bytes per member; in U - 1 steps
// it sends block (r + s) % U to that member and receives member (r - s) % U's
// into `recv`, one peer at a time. Its own block stays where it is.
void all_to_all(Communicator& group, const Buffer& send, const Buffer& recv, std::size_t block) {
  const std::size_t u = group.size(), r = group.rank();
  for (std::size_t s = 1; s < u; ++s) {
    const std::size_t to = (r + s) % u, from = (r + u - s) % u;
    auto in = group.irecv({recv.data() + from * block, block}, from, 0);
    auto out = group.isend({send.data() + to * block, block}, to, 0);
    out->wait();
    in->wait();
  }
}

ExchangeBenchResult bench_ulysses(const std::shared_ptr<Communicator>& world, const ExchangeBenchConfig& cfg) {
  const std::size_t p = world->size(), u = cfg.ulysses, r = world->rank();
  const SummaryShape& shape = cfg.shape;
  if (!find_protocol(cfg.method).chooser() || cfg.group_size != 1 || cfg.options.segments != 0)
    throw InvalidArgument(fmt::format("--ulysses {}: the state exchange runs the cost model's exact choice over "
                                      "P/U ranks, expected --protocol auto without --group-size or --segments, got "
                                      "--protocol {}",
                                      u, cfg.method));
  if (cfg.layout != "contiguous" || cfg.docs_mean_tokens != 0)
    throw InvalidArgument(fmt::format("--ulysses {}: expected the contiguous layout without documents, got {}{}", u,
                                      cfg.layout, cfg.docs_mean_tokens ? " with documents" : ""));
  if (p % u != 0 || shape.heads % u != 0)
    throw InvalidArgument(fmt::format("--ulysses {}: expected a divisor of both P = {} and H = {}", u, p, shape.heads));
  UlyssesOptions uo;
  uo.heads = shape.heads;
  uo.tokens_per_rank = cfg.tokens_per_rank;
  uo.activation_bytes = cfg.activation_bytes;
  uo.node_size = cfg.options.cost.node_ranks > 0 ? cfg.options.cost.node_ranks : 1;
  uo.memory_budget_bytes = cfg.options.memory_budget_bytes;
  const ProblemShape ps{p, shape.slabs(), shape.key_dim, shape.value_dim, dtype_size(shape.dtype)};
  const std::vector<UlyssesPrediction> options = predict_ulysses(cfg.options.cost, ps, uo);
  const auto want = std::find_if(options.begin(), options.end(), [u](const UlyssesPrediction& o) { return o.width == u; });
  if (want == options.end()) throw Error(fmt::format("--ulysses {}: the cost model did not price U = {}", u, u));
  // Every rank sends and receives its activations and its output.
  const double rank_bytes = 2 * (want->in_bytes + want->out_bytes);
  const bool folded = detail::simulation_hooks().allocate != nullptr;
  if (!(rank_bytes < 0x1p50))  // before any cast to size_t (a folded run admits no memory)
    throw InvalidArgument(fmt::format("--ulysses {}: {} of activations per rank, expected less than 1 PiB",
                                      u, format_bytes(rank_bytes)));
  if (!folded) {
    const double in_process = world->backend() == "inprocess" ? double(p) : 1.0;
    require_memory(in_process * rank_bytes, max_memory_bytes(""), fmt::format("kdacp bench exchange --ulysses {}", u),
                   max_memory_name(""));
  }
  const auto in_block = static_cast<std::size_t>(want->in_bytes) / u;
  const auto out_block = static_cast<std::size_t>(want->out_bytes) / u;
  const Buffer in_send(in_block * u, Buffer::Init::uninitialized), in_recv(in_block * u, Buffer::Init::uninitialized);
  const Buffer out_send(out_block * u, Buffer::Init::uninitialized),
      out_recv(out_block * u, Buffer::Init::uninitialized);
  // A P/U x U mesh over the world: along "hp" the head group of U
  // consecutive ranks, along "cp" the P/U ranks of one head slice, U apart,
  // in chronological order (attached to the world, so that a grouped
  // protocol can split it further).
  const DeviceMesh grid = DeviceMesh::create(world, {p / u, u}, {"cp", "hp"});
  const std::shared_ptr<Communicator> heads = grid.group(grid.dim_index("hp"));
  const DeviceMesh mesh = grid["cp"];
  const ProtocolConfig& config = want->exchange.config;
  ExchangeOptions eo = cfg.options;
  eo.segments = config.segments;
  auto ex = make_state_exchange(mesh, config.method, static_cast<long long>(config.group_size), eo);
  const SummaryShape sub{shape.batch, shape.heads / u, shape.key_dim, shape.value_dim, shape.dtype};
  const std::size_t position = r / u;
  const SyntheticSummary f = synthetic_summary(sub, 0, position, false), b = synthetic_summary(sub, 0, position, true);
  RankTimes total, a2a;
  auto once = [&](bool record) {
    world->barrier();
    const double t0 = world->now_seconds();
    all_to_all(*heads, in_send, in_recv, in_block);
    const double t1 = world->now_seconds();
    ex->forward(f.offset.view(), f.transfer.view());
    const double t2 = world->now_seconds();
    all_to_all(*heads, out_send, out_recv, out_block);
    const double t3 = world->now_seconds();
    total.forward_peak = std::max(total.forward_peak, ex->last_stats().peak_extra_bytes);
    total.forward_received = ex->last_stats().bytes_received;
    world->barrier();
    const double t4 = world->now_seconds();
    all_to_all(*heads, out_send, out_recv, out_block);  // dO in
    const double t5 = world->now_seconds();
    ex->backward(b.offset.view(), f.transfer.view());
    const double t6 = world->now_seconds();
    all_to_all(*heads, in_send, in_recv, in_block);  // the gradients out
    const double t7 = world->now_seconds();
    total.backward_peak = std::max(total.backward_peak, ex->last_stats().peak_extra_bytes);
    total.backward_received = ex->last_stats().bytes_received;
    if (record) {
      total.forward.push_back(t3 - t0), total.backward.push_back(t7 - t4);
      a2a.forward.push_back((t1 - t0) + (t3 - t2)), a2a.backward.push_back((t5 - t4) + (t7 - t6));
    }
    return t7 - t0;
  };
  for (std::size_t i = 0; i < cfg.warmup; ++i) once(false);
  double spent = 0;
  for (std::size_t i = 0; i < cfg.calls || (cfg.calls == 0 && (i == 0 || spent < cfg.min_time)); ++i) spent += once(true);
  ExchangeBenchResult res;
  res.config = cfg;
  res.backend = world->backend();
  res.ranks = p;
  res.parts = p;
  res.calls = total.forward.size();
  res.method_run = ex->method();
  res.prediction = want->exchange;
  res.prediction.seconds = want->seconds;
  res.predicted_all_to_all_seconds = want->all_to_all_seconds;
  res.predicted_exchange_seconds = want->exchange.seconds;
  res.timing = slowest_rank(*world, total);
  res.all_to_all = slowest_rank(*world, a2a);
  res.folded = folded;
  return res;
}

}  // namespace

ExchangeBenchResult bench_exchange(const std::shared_ptr<Communicator>& world, const ExchangeBenchConfig& cfg) {
  if (cfg.ulysses > 1) return bench_ulysses(world, cfg);
  const std::size_t p = world->size();
  const PartOwners owners = owners_for(cfg.layout, p);
  const std::size_t parts = owners.size();
  std::vector<bool> cuts;
  if (cfg.docs_mean_tokens > 0)
    cuts = document_cuts(parts, kPartTokens * p / parts, cfg.docs_mean_tokens, cfg.cut_seed);
  ExchangeBenchResult r;
  r.config = cfg;
  r.backend = world->backend();
  r.ranks = p;
  r.parts = parts;
  r.cuts = static_cast<std::size_t>(std::count(cuts.begin(), cuts.end(), true));
  ProblemShape shape{p, cfg.shape.slabs(), cfg.shape.key_dim, cfg.shape.value_dim, sizeof(float)};
  shape.part_owners = owners;
  shape.part_cuts = cuts;
  // The calls' cuts are the expected ones: auto weighs them, as the layer's
  // does (layer_exchange_options).
  ExchangeOptions options = cfg.options;
  if (options.expected_cuts.empty()) options.expected_cuts = cuts;
  r.prediction = predict_exchange(shape, cfg.method, cfg.group_size, options);
  const ProtocolConfig config{cfg.method, static_cast<std::size_t>(cfg.group_size), cfg.options.segments};
  const RankTimes mine =
      time_rank(world, config, cfg.shape, owners, cuts, options, cfg.warmup, cfg.calls, cfg.min_time);
  r.method_run = mine.method;
  if (r.method_run != r.prediction.config.method)
    throw Error(fmt::format("bench exchange: {} ran {}, but the model priced {}", cfg.method, r.method_run,
                            protocol_label(r.prediction.config)));
  r.calls = mine.forward.size();
  r.timing = slowest_rank(*world, mine);
  r.folded = detail::simulation_hooks().compute != nullptr;
  return r;
}

std::string to_json(const ExchangeBenchResult& r) {
  using nlohmann::json;
  const auto& c = r.config;
  const Prediction& pred = r.prediction;
  json j{{"backend", r.backend},
         {"method", c.method},
         {"protocol", r.method_run},
         {"label", protocol_label(pred.config)},
         {"group_size", pred.config.group_size},
         {"segments", pred.config.segments},
         {"ranks", r.ranks},
         {"batch", c.shape.batch},
         {"heads", c.shape.heads},
         {"key_dim", c.shape.key_dim},
         {"value_dim", c.shape.value_dim},
         {"layout", c.layout},
         {"parts", r.parts},
         {"cuts", r.cuts},
         {"calls", r.calls},
         {"forward_seconds", r.timing.forward_seconds},
         {"backward_seconds", r.timing.backward_seconds},
         {"forward_peak_bytes", r.timing.forward_peak},
         {"backward_peak_bytes", r.timing.backward_peak},
         {"forward_received_bytes_all", r.timing.forward_received_all},
         {"backward_received_bytes_all", r.timing.backward_received_all},
         {"predicted_seconds", pred.seconds},
         {"predicted_peak_bytes", pred.peak_extra_bytes},
         {"cost_source", c.options.cost.source},
         {"folded", r.folded}};
  if (c.ulysses > 1) {
    j["label"] = fmt::format("ulysses U={} + {}", c.ulysses, protocol_label(pred.config));
    j["ulysses"] = c.ulysses;
    j["tokens_per_rank"] = c.tokens_per_rank;
    j["activation_bytes"] = c.activation_bytes;
    j["all_to_all_forward_seconds"] = r.all_to_all.forward_seconds;
    j["all_to_all_backward_seconds"] = r.all_to_all.backward_seconds;
    j["predicted_all_to_all_seconds"] = r.predicted_all_to_all_seconds;
    j["predicted_exchange_seconds"] = r.predicted_exchange_seconds;
  }
  j["forward_over_predicted"] = pred.seconds > 0 ? r.timing.forward_seconds / pred.seconds : 0.0;
  j["backward_over_predicted"] = pred.seconds > 0 ? r.timing.backward_seconds / pred.seconds : 0.0;
  return j.dump();
}

void print_exchange_bench(const ExchangeBenchResult& r) {
  const auto& c = r.config;
  std::printf("kdacp bench exchange: backend=%s P=%zu B=%zu H=%zu K=%zu V=%zu layout=%s parts=%zu cuts=%zu calls=%zu\n"
              "cost model: %s\n\n",
              r.backend.c_str(), r.ranks, c.shape.batch, c.shape.heads, c.shape.key_dim, c.shape.value_dim,
              c.layout.c_str(), r.parts, r.cuts, r.calls, c.options.cost.source.c_str());
  Table table({"protocol", "direction", "measured ms", "model ms", "measured/model", "peak extra", "model peak"});
  const std::string label = c.ulysses > 1       ? fmt::format("ulysses U={} + {}", c.ulysses, protocol_label(r.prediction.config))
                            : c.method == "auto" ? "auto -> " + protocol_label(r.prediction.config)
                                                 : protocol_label(r.prediction.config);
  for (const bool fwd : {true, false}) {
    const double s = fwd ? r.timing.forward_seconds : r.timing.backward_seconds;
    table.add({label, fwd ? "forward" : "backward", fmt::format("{:.4f}", s * 1e3),
               fmt::format("{:.4f}", r.prediction.seconds * 1e3),
               r.prediction.seconds > 0 ? fmt::format("{:.2f}", s / r.prediction.seconds) : "n/a",
               format_bytes(double(fwd ? r.timing.forward_peak : r.timing.backward_peak)),
               format_bytes(double(r.prediction.peak_extra_bytes))});
  }
  table.print(stdout);
  std::printf("\ntimes: per call the slowest rank (each call starts after a barrier), median over the calls, on "
              "the backend's clock%s\n",
              r.backend == "mpi" ? " (simulated seconds under smpirun)" : "");
  if (c.ulysses > 1)
    std::printf("Ulysses U=%zu (T/P = %zu tokens, %zu-byte activations): each direction's two all-to-alls %.4f / "
                "%.4f ms (forward / backward), model %.4f ms; the exchange over P/U = %zu ranks, model %.4f ms\n",
                c.ulysses, c.tokens_per_rank, c.activation_bytes, r.all_to_all.forward_seconds * 1e3,
                r.all_to_all.backward_seconds * 1e3, r.predicted_all_to_all_seconds * 1e3, r.ranks / c.ulysses,
                r.predicted_exchange_seconds * 1e3);
  if (r.folded)
    std::printf("folded (KDACP_SMPI_FOLD=1): every fold step charged as its flops at the platform's speed, no data "
                "computed\n");
}

}  // namespace kdacp::report
