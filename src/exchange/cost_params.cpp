// The cost model's parameters (CostParams): their checks and their JSON
// form, the file `kdacp calibrate` writes and `--calibration` reads.
#include <cmath>
#include <fstream>
#include <sstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "exchange/cost_terms.hpp"
#include "kdacp/cost_model.hpp"
#include "kdacp/error.hpp"
#include "kdacp/npy.hpp"

namespace kdacp {

namespace detail {

void check_cost_params(const CostParams& c) {
  auto positive = [](double v, const char* key) {
    if (!(v > 0) || !std::isfinite(v)) {
      throw InvalidArgument(fmt::format("cost parameter {} is {}, expected a positive finite number", key, v));
    }
  };
  auto non_negative = [](double v, const char* key) {
    if (!(v >= 0) || !std::isfinite(v)) {
      throw InvalidArgument(
          fmt::format("cost parameter {} is {}, expected >= 0 (0: as the network)", key, v));
    }
  };
  positive(c.alpha_s, "alpha_s");
  positive(c.beta_s_per_byte, "beta_s_per_byte");
  positive(c.gflops, "gflops");
  non_negative(c.group_alpha_s, "group_alpha_s");
  non_negative(c.group_beta_s_per_byte, "group_beta_s_per_byte");
  if (!(c.oversubscription >= 1) || !std::isfinite(c.oversubscription))
    throw InvalidArgument(fmt::format(
        "cost parameter oversubscription is {}, expected a finite number >= 1 (1: non-blocking)", c.oversubscription));
  if (c.leaf_ranks > 0 && c.node_ranks > 0 && c.leaf_ranks % c.node_ranks != 0)
    throw InvalidArgument(fmt::format("cost parameter leaf_ranks is {}, expected a multiple of node_ranks = {}",
                                      c.leaf_ranks, c.node_ranks));
}

void check_cost_shape(const ProblemShape& s) {
  if (s.ranks == 0 || s.slabs == 0 || s.key_dim == 0 || s.value_dim == 0 || s.elem_bytes == 0) {
    throw InvalidArgument(fmt::format("cost model shape P={} B*H={} K={} V={}, expected every size positive",
                                      s.ranks, s.slabs, s.key_dim, s.value_dim));
  }
}

}  // namespace detail

using detail::check_cost_params;

std::string to_json(const CostParams& c) {
  nlohmann::json j;
  j["source"] = c.source;
  j["alpha_s"] = c.alpha_s;
  j["beta_s_per_byte"] = c.beta_s_per_byte;
  j["gflops"] = c.gflops;
  j["group_alpha_s"] = c.group_alpha_s;
  j["group_beta_s_per_byte"] = c.group_beta_s_per_byte;
  j["concurrent_ranks"] = c.concurrent_ranks;
  if (c.node_ranks > 0) j["node_ranks"] = c.node_ranks;
  if (c.leaf_ranks > 0) j["leaf_ranks"] = c.leaf_ranks;
  if (c.oversubscription != 1) j["oversubscription"] = c.oversubscription;
  return j.dump(2);
}

CostParams cost_params_from_json(const std::string& text) {
  const nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
  if (j.is_discarded())
    throw InvalidArgument("cost parameters are not valid JSON (or hold a number out of double's range)");
  if (!j.is_object()) throw InvalidArgument("cost parameters are not a JSON object");
  CostParams c;
  auto number = [&j](const char* key, double& out) {
    if (!j.contains(key)) return;
    if (!j[key].is_number())
      throw InvalidArgument(fmt::format("cost parameter {} is {}, expected a number", key, j[key].dump()));
    out = j[key].get<double>();
  };
  if (j.contains("source") && j["source"].is_string()) c.source = j["source"].get<std::string>();
  number("alpha_s", c.alpha_s);
  number("beta_s_per_byte", c.beta_s_per_byte);
  number("gflops", c.gflops);
  number("group_alpha_s", c.group_alpha_s);
  number("group_beta_s_per_byte", c.group_beta_s_per_byte);
  auto count = [&j](const char* key, const char* zero, std::size_t& out) {
    if (!j.contains(key)) return;
    const nlohmann::json& v = j[key];
    if (!v.is_number_unsigned() && !(v.is_number_integer() && v.get<long long>() >= 0))
      throw InvalidArgument(
          fmt::format("cost parameter {} is {}, expected an integer >= 0 (0: {})", key, v.dump(), zero));
    out = v.get<std::size_t>();
  };
  count("concurrent_ranks", "every rank", c.concurrent_ranks);
  count("node_ranks", "unknown", c.node_ranks);
  count("leaf_ranks", "no leaf switch", c.leaf_ranks);
  number("oversubscription", c.oversubscription);
  check_cost_params(c);
  return c;
}

CostParams load_cost_params(const std::string& path) {
  try {
    require_regular_file(path);
  } catch (const IoError& e) {
    throw IoError(std::string("cannot read cost parameters: ") + e.what());
  }
  std::ifstream in(path);
  if (!in) throw IoError(fmt::format("cannot read cost parameters from '{}'", path));
  std::stringstream ss;
  ss << in.rdbuf();
  return cost_params_from_json(ss.str());
}

void save_cost_params(const CostParams& params, const std::string& path) {
  check_cost_params(params);
  std::ofstream out(path);
  out << to_json(params) << "\n";
  if (!out) throw IoError(fmt::format("cannot write cost parameters to '{}'", path));
}

}  // namespace kdacp
