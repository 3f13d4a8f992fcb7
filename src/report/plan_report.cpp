#include "kdacp/report/plan_report.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "kdacp/admission.hpp"
#include "kdacp/error.hpp"
#include "kdacp/job_plan.hpp"
#include "kdacp/protocol.hpp"
#include "kdacp/report/plot.hpp"
#include "kdacp/report/table.hpp"
#include "kdacp/units.hpp"

namespace kdacp::report {

namespace {

// Predicted time of each protocol's best configuration against P = 2, 4, ...
void write_plot(const PlanRequest& request, const CostParams& params, const ProblemShape& base,
                const std::string& plot, bool say) {
  PlotPanel panel{fmt::format("kdacp plan: B*H={} K={} V={} ({})", base.slabs, base.key_dim, base.value_dim,
                              params.source),
                  "P (ranks)", "predicted time (ms)", true, true, false, {}, NAN, ""};
  for (job::PlanSeries& s :
       job::plan_series(params, base.ranks, [&](std::size_t p) { return plan_shape_at(request, p); }))
    panel.series.push_back({s.method, std::move(s.points), false});
  draw_plot({panel}, plot, 900, 600, true);
  if (say)
    std::printf("plot written to %s (gnuplot script with the data: %s.gp)\n", plot.c_str(), plot.c_str());
}

// The layout line: parts, parts per rank, cuts and the critical stretch.
void print_chain(const PlanRequest& request, const ProblemShape& shape) {
  const ChainProfile prof = chain_profile(shape, 1);
  std::string stream;
  if (!request.cu_seqlens.empty())
    stream = fmt::format("; {} packed sequences in T={}, {} parts are cuts", request.cu_seqlens.size() - 1,
                         request.tokens, std::count(shape.part_cuts.begin(), shape.part_cuts.end(), true));
  else if (request.tokens > 0)
    stream = fmt::format("; T={}, one sequence per row", request.tokens);
  fmt::print("layout: {}, {} parts (at most {} per rank){}; critical stretch {} steps (of {} without cuts)\n",
             request.zigzag ? "zigzag" : "contiguous", prof.parts, prof.per_rank, stream, prof.steps,
             prof.parts - 1);
}

// Ulysses × state CP for the request: every U with the model's pick.
struct UlyssesPlan {
  UlyssesOptions options;
  std::vector<UlyssesPrediction> widths;
  UlyssesPrediction pick;
};

std::optional<UlyssesPlan> ulysses_plan(const PlanRequest& request, const CostParams& params,
                                        const ProblemShape& shape, std::size_t budget) {
  if (!request.ulysses) return std::nullopt;
  UlyssesPlan u{*request.ulysses, {}, {}};
  u.options.heads = request.heads;
  u.options.memory_budget_bytes = budget;
  u.widths = predict_ulysses(params, shape, u.options,
                             [&request](std::size_t ranks) { return plan_shape_at(request, ranks); });
  u.pick = best_ulysses(u.widths);
  return u;
}

void print_ulysses(const PlanRequest& request, const UlyssesPlan& u) {
  const UlyssesPrediction& plain = u.widths.front();
  std::printf("\nUlysses x state CP: T/P=%zu tokens per rank, %zu-byte activations, islands of %zu ranks; per forward "
              "an all-to-all over U ranks in (q, k, v, g, beta: %s per rank) and one back (o: %s), a backward the same\n",
              u.options.tokens_per_rank, u.options.activation_bytes, u.options.node_size,
              format_bytes(plain.in_bytes).c_str(), format_bytes(plain.out_bytes).c_str());
  Table t({"U", "state ranks", "heads/rank", "all-to-all", "state exchange", "protocol", "total", "vs U=1"});
  for (const UlyssesPrediction& p : u.widths) {
    t.add({fmt::format("{}", p.width), fmt::format("{}", p.state_ranks), fmt::format("{}", request.heads / p.width),
           format_seconds(p.all_to_all_seconds), format_seconds(p.exchange.seconds),
           protocol_label(p.exchange.config), format_seconds(p.seconds),
           p.seconds > 0 ? fmt::format("{:.2f}x", plain.seconds / p.seconds) : "-"});
  }
  t.print();
  if (u.pick.width == 1) {
    std::printf("Ulysses: the model picks U=1 (plain state CP), predicted %s per forward\n",
                format_seconds(u.pick.seconds).c_str());
  } else {
    std::printf("Ulysses: the model picks U=%zu (state exchange over %zu ranks), predicted %s per forward, %.2fx "
                "faster than plain state CP (U=1); run it with kdacp kda --ulysses %zu (or auto), kdacp.torch "
                "ulysses=%zu\n",
                u.pick.width, u.pick.state_ranks, format_seconds(u.pick.seconds).c_str(),
                u.pick.seconds > 0 ? plain.seconds / u.pick.seconds : 1.0, u.pick.width, u.pick.width);
  }
}

nlohmann::ordered_json ulysses_json(const PlanRequest& request, const UlyssesPlan& u) {
  using json = nlohmann::ordered_json;
  const UlyssesPrediction& plain = u.widths.front();
  json widths = json::array();
  for (const UlyssesPrediction& p : u.widths)
    widths.push_back({{"U", p.width},
                      {"state_ranks", p.state_ranks},
                      {"heads_per_rank", request.heads / p.width},
                      {"all_to_all_seconds", p.all_to_all_seconds},
                      {"exchange_seconds", p.exchange.seconds},
                      {"exchange_protocol", protocol_label(p.exchange.config)},
                      {"exchange_peak_extra_bytes", p.exchange.peak_extra_bytes},
                      {"seconds", p.seconds},
                      {"speedup_vs_plain", p.seconds > 0 ? json(plain.seconds / p.seconds) : json()}});
  return {{"tokens_per_rank", u.options.tokens_per_rank},
          {"activation_bytes", u.options.activation_bytes},
          {"node_size", u.options.node_size},
          {"in_bytes_per_rank", plain.in_bytes},
          {"out_bytes_per_rank", plain.out_bytes},
          {"options", widths},
          {"pick", u.pick.width}};
}

}  // namespace

ProblemShape plan_shape_at(const PlanRequest& request, std::size_t ranks) {
  const std::size_t slabs = request.batch * request.heads;
  if (request.tokens == 0) {
    ProblemShape shape{ranks, slabs, request.key_dim, request.value_dim, 4};
    if (request.zigzag) shape.part_owners = PartOwners::zigzag(ranks);
    return shape;
  }
  return job::plan_problem_shape(slabs, request.key_dim, request.value_dim, request.layout_at(ranks),
                                 request.cu_seqlens.empty() ? Sequences(request.batch, request.tokens)
                                                            : Sequences(1, request.tokens, request.cu_seqlens));
}

std::string format_seconds(double s) {
  if (s == 0) return "0";
  if (s < 1e-3) return fmt::format("{:.1f} us", s * 1e6);
  if (s < 1) return fmt::format("{:.2f} ms", s * 1e3);
  return fmt::format("{:.3f} s", s);
}

void print_plan(const PlanRequest& request, const CostParams& params, std::size_t budget,
                const std::string& plot, bool json) {
  if (json) {
    const std::string text = plan_json(request, params, budget);
    if (!plot.empty()) write_plot(request, params, plan_shape_at(request, request.ranks), plot, false);
    std::printf("%s\n", text.c_str());
    return;
  }
  const ProblemShape shape = plan_shape_at(request, request.ranks);
  std::printf("cluster: P=%zu, B*H=%zu, K=%zu, V=%zu; alpha %s, bandwidth %.3g GB/s, %.6g GFLOP/s (%s)\n",
              shape.ranks, shape.slabs, shape.key_dim, shape.value_dim, format_seconds(params.alpha_s).c_str(),
              1e-9 / params.beta_s_per_byte, params.gflops, params.source.c_str());
  print_chain(request, shape);
  // With a layout only the rows that take one run it (auto chooses among them).
  const job::PlanPredictions plan = job::plan_predictions(params, shape, budget);
  const double allgather = plan.allgather_seconds;
  Table t({"protocol", "exact", "time", "vs allgather", "peak memory/rank", "within budget"});
  for (const auto& p : plan.rows) {
    t.add({protocol_label(p.config), p.exact ? "yes" : "no", format_seconds(p.seconds),
           p.seconds > 0 ? fmt::format("{:.2f}x", allgather / p.seconds) : "-",
           format_bytes(static_cast<double>(p.peak_extra_bytes)),
           budget == 0 || p.peak_extra_bytes <= budget ? "yes" : "no"});
  }
  t.print();
  if (!plan.without_layouts.empty())
    std::printf("not listed: %s (do not take layouts with several parts per rank or parts out of rank order)\n",
                fmt::format("{}", fmt::join(plan.without_layouts, ", ")).c_str());
  for (const auto& [label, p] : {std::pair{"\nauto (exact)", plan.exact}, std::pair{"auto --allow-reassociation", plan.any}})
    std::printf("%s: %s, predicted %s, %.2fx faster than allgather\n", label, protocol_label(p.config).c_str(),
                format_seconds(p.seconds).c_str(), p.seconds > 0 ? allgather / p.seconds : 1.0);
  if (const auto u = ulysses_plan(request, params, shape, budget)) print_ulysses(request, *u);
  if (!plot.empty()) write_plot(request, params, shape, plot, true);
}

std::string plan_json(const PlanRequest& request, const CostParams& params, std::size_t budget) {
  using json = nlohmann::ordered_json;
  const ProblemShape shape = plan_shape_at(request, request.ranks);
  const ChainProfile prof = chain_profile(shape, 1);
  const job::PlanPredictions plan = job::plan_predictions(params, shape, budget);
  const double allgather = plan.allgather_seconds;
  auto vs_allgather = [allgather](const Prediction& p) { return p.seconds > 0 ? json(allgather / p.seconds) : json(); };
  json rows = json::array();
  for (const Prediction& p : plan.rows)
    rows.push_back({{"protocol", protocol_label(p.config)},
                    {"method", p.config.method},
                    {"group_size", p.config.group_size},
                    {"segments", p.config.segments},
                    {"exact", p.exact},
                    {"seconds", p.seconds},
                    {"vs_allgather", vs_allgather(p)},
                    {"peak_extra_bytes", p.peak_extra_bytes},
                    {"within_budget", budget == 0 || p.peak_extra_bytes <= budget}});
  auto choice = [&](const Prediction& p) {
    return json{{"protocol", protocol_label(p.config)}, {"seconds", p.seconds}, {"vs_allgather", vs_allgather(p)}};
  };
  json out = {
      {"cluster",
       {{"P", shape.ranks},
        {"B", request.batch},
        {"H", request.heads},
        {"BH", shape.slabs},
        {"K", shape.key_dim},
        {"V", shape.value_dim},
        {"alpha_s", params.alpha_s},
        {"beta_s_per_byte", params.beta_s_per_byte},
        {"gflops", params.gflops},
        {"group_alpha_s", params.group_alpha_s},
        {"group_beta_s_per_byte", params.group_beta_s_per_byte},
        {"concurrent_ranks", params.concurrent_ranks},
        {"source", params.source}}},
      {"layout",
       {{"zigzag", request.zigzag},
        {"parts", prof.parts},
        {"max_parts_per_rank", prof.per_rank},
        {"tokens", request.tokens},
        {"cuts", static_cast<std::size_t>(std::count(shape.part_cuts.begin(), shape.part_cuts.end(), true))},
        {"critical_steps", prof.steps}}},
      {"memory_budget_bytes", budget},
      {"rows", rows},
      {"not_listed", plan.without_layouts},
      {"auto_exact", choice(plan.exact)},
      {"auto_any", choice(plan.any)}};
  if (const auto u = ulysses_plan(request, params, shape, budget)) out["ulysses"] = ulysses_json(request, *u);
  return out.dump(2);
}

}  // namespace kdacp::report

namespace kdacp::report {

PlanRequest plan_request(const PlanFlags& c) {
  check_layout_flags(c.layout);
  if (!c.tokens_per_rank_given) {
    if (c.activation_bytes_given)
      throw InvalidArgument("--activation-bytes needs --tokens-per-rank N, the activations it prices");
    if (c.node_size_given) throw InvalidArgument("--node-size needs --tokens-per-rank N, the all-to-alls it prices");
  } else {
    if (!c.layout.split.empty())
      throw InvalidArgument("--split describes P ranks, expected no --split with --tokens-per-rank (Ulysses' state "
                            "exchange runs over P/U ranks)");
    if (c.tokens_given && (c.tokens % c.ranks != 0 || c.tokens / c.ranks != c.tokens_per_rank))
      // Both at most 2^40 and P at most 2^20: the product fits.
      throw InvalidArgument(fmt::format("--tokens-per-rank {} with --tokens {} on P = {} ranks, expected --tokens {} "
                                        "(or no --tokens)",
                                        c.tokens_per_rank, c.tokens, c.ranks, c.tokens_per_rank * c.ranks));
  }
  PlanRequest r{c.ranks, c.batch, c.heads, c.key_dim, c.value_dim, c.layout.layout == "zigzag", 0, {}, {}};
  r.tokens = packed_tokens(c.packing, c.tokens, c.tokens_given, kPlanMaxTokens);
  if (r.tokens == 0) {
    if (c.packing.docs > 0)
      throw InvalidArgument(
          fmt::format("--docs {} needs --tokens T, the stream the documents are packed into", c.packing.docs));
    if (!c.layout.split.empty()) throw InvalidArgument("--split needs --tokens T (or --seqlens), the tokens it splits");
  }
  if (r.tokens > 0) r.cu_seqlens = packed_cu_seqlens(c.packing, c.batch, r.tokens, c.seed);
  r.layout_at = [layout = c.layout, tokens = r.tokens](std::size_t p) { return layout_of(layout, tokens, p); };
  if (c.tokens_per_rank_given) {
    UlyssesOptions u;
    u.tokens_per_rank = c.tokens_per_rank;
    u.activation_bytes = c.activation_bytes;
    u.node_size = c.node_size;
    r.ulysses = u;
  }
  return r;
}

CostParams plan_params(const PlanFlags& c) {
  CostParams p = c.calibration.empty() ? CostParams{} : load_cost_params(c.calibration);
  if (!c.alpha.empty()) p.alpha_s = parse_seconds(c.alpha, "--alpha");
  if (!c.bandwidth.empty()) p.beta_s_per_byte = 1 / parse_rate(c.bandwidth, "--bandwidth");
  if (!c.group_alpha.empty()) p.group_alpha_s = parse_seconds(c.group_alpha, "--group-alpha");
  if (!c.group_bandwidth.empty()) p.group_beta_s_per_byte = 1 / parse_rate(c.group_bandwidth, "--group-bandwidth");
  if (c.gflops > 0) p.gflops = c.gflops;
  if (!c.alpha.empty() || !c.bandwidth.empty() || c.gflops > 0) p.source = "command line";
  return p;
}

void run_plan(const PlanFlags& flags) {
  const CostParams params = plan_params(flags);
  PlanRequest request = plan_request(flags);
  const std::size_t budget = flags.memory_budget.empty() ? 0 : parse_bytes(flags.memory_budget, "--memory-budget");
  // Nodes the cost parameters name (node_ranks) are the all-to-alls' islands
  // unless --node-size says otherwise (then predict_ulysses refuses the mismatch).
  if (request.ulysses && !flags.node_size_given && params.node_ranks > 0)
    request.ulysses->node_size = params.node_ranks;
  print_plan(request, params, budget, flags.plot, flags.json);
}

}  // namespace kdacp::report
