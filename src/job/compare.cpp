// Comparing a job's outputs: errors against a reference, the tolerance of a
// protocol, and every protocol of the registry on one job (kdacp/job.hpp).
#include "kdacp/job.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>

#include <fmt/format.h>

#include "kdacp/error.hpp"
#include "kdacp/kda_ulysses.hpp"
#include "kdacp/protocol.hpp"

namespace kdacp::job {
namespace {

// ||a - b||_F / ||b||_F (||a - b||_F when b is zero); a and b have one size.
double relative_error(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const double d = double(a[i]) - double(b[i]);
    num += d * d;
    den += double(b[i]) * double(b[i]);
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

}  // namespace

std::vector<double> relative_errors(const LayerOutputs<float>& got, const LayerOutputs<float>& want) {
  std::vector<double> errs;
  for (auto [a, b] : {std::pair{&got.o, &want.o}, {&got.dq, &want.dq}, {&got.dk, &want.dk},
                      {&got.dv, &want.dv}, {&got.dg, &want.dg}, {&got.dbeta, &want.dbeta}})
    errs.push_back(relative_error(*a, *b));
  if (!got.ht.empty() && !want.ht.empty()) errs.push_back(relative_error(got.ht, want.ht));
  if (!got.dh0.empty() && !want.dh0.empty()) errs.push_back(relative_error(got.dh0, want.dh0));
  return errs;
}

double layer_error_tolerance(const std::string& method, std::size_t ranks, std::size_t key_dim) {
  double bound = 0;
  for (const ProtocolDescriptor* row : protocol_registry())
    if (row->name == method) bound = error_bound(*row, ranks, key_dim);
  return kLayerFloat32Tolerance + bound;
}

std::vector<std::string> errors_above(const std::vector<double>& errors, double tolerance) {
  std::vector<std::string> out;
  for (std::size_t i = 0; i < errors.size(); ++i) {
    if (errors[i] <= tolerance) continue;  // false for NaN
    const std::string name = i < kLayerErrorNames.size() ? kLayerErrorNames[i] : "?";
    char value[32] = "nan";
    if (!std::isnan(errors[i])) std::snprintf(value, sizeof value, "%.3g", errors[i]);
    out.push_back(name + " " + value);
  }
  return out;
}

bool same_bits(const LayerOutputs<float>& a, const LayerOutputs<float>& b) {
  auto eq = [](const std::vector<float>& x, const std::vector<float>& y) {
    // memcmp must not see the null data() of an empty vector (ht, dh0 without sequences).
    return x.size() == y.size() &&
           (x.empty() || std::memcmp(x.data(), y.data(), x.size() * sizeof(float)) == 0);
  };
  return eq(a.o, b.o) && eq(a.dq, b.dq) && eq(a.dk, b.dk) && eq(a.dv, b.dv) && eq(a.dg, b.dg) &&
         eq(a.dbeta, b.dbeta) && eq(a.ht, b.ht) && eq(a.dh0, b.dh0);
}


Progress::Progress(std::string prefix, double quiet_seconds)
    : prefix_(std::move(prefix)), quiet_seconds_(quiet_seconds) {}

void Progress::note(const std::string& what) const {
  const double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
  if (t > quiet_seconds_) std::fprintf(stderr, "%s: %s (%.1f s elapsed)\n", prefix_.c_str(), what.c_str(), t);
}

std::optional<ProtocolComparison> compare_protocols(const std::shared_ptr<Communicator>& world,
                                                    const LayerJob<float>& job, const LayerRunOptions& base,
                                                    const Progress& progress) {
  const bool lead = world->rank() == 0;
  if (!job.grads()) throw InvalidArgument("compare_protocols: the job has no d_o (it compares gradients too)");
  if (base.ulysses == kUlyssesAuto)
    throw InvalidArgument("compare_protocols: Ulysses width auto, expected a width (resolve_ulysses)");
  check_ulysses(base.ulysses, world->size(), job.data.shape);
  // The exchange runs over the head groups (P/U ranks; U = 1: the world).
  const std::size_t ranks = world->size() / base.ulysses;
  const kda::Layout layout = make_layer_layout(layer_config(job, base), world->size());
  // A layout with several parts on a rank, or parts out of rank order, runs
  // only on protocols whose registry row takes layouts.
  const bool plain = kda::ulysses_group_layout(layout, base.ulysses).owners().is_one_per_rank();
  ProtocolComparison cmp;
  for (const ProtocolDescriptor* row : protocol_registry()) {
    if (row->chooser()) continue;
    const std::string method(row->name);
    long long width = 1;
    if (row->takes_group_size) {
      if (ranks < 4 || ranks % 2 != 0) continue;  // needs 1 < w < P dividing P
      width = static_cast<long long>(ranks / 2);
    }
    std::string label = method;
    if (width > 1) label += fmt::format(" w={}", width);
    if (!plain && !row->takes_layouts) {
      cmp.runs.push_back({{}, width, label, {}, "n/a: protocol does not take layouts"});
      continue;
    }
    if (lead) progress.note("running " + method);
    LayerRunOptions opts = base;
    opts.method = method;
    opts.group_size = width;
    auto out = run_context_parallel(world, job, opts);
    cmp.runs.push_back({out ? std::move(*out) : LayerOutputs<float>{}, width, label, {}, {}});
  }
  if (!lead) return std::nullopt;
  const LayerOutputs<float>* first_exact = nullptr;
  for (ProtocolRun& r : cmp.runs) {
    if (!r.skipped.empty() || !r.out.exact) continue;
    if (!first_exact) first_exact = &r.out;
    r.bitwise = same_bits(r.out, *first_exact);
    cmp.all_bitwise = cmp.all_bitwise && *r.bitwise;
  }
  return cmp;
}

}  // namespace kdacp::job
