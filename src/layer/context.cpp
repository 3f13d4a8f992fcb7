// agree_layer_context (kdacp/layer.hpp): a context's one validation and
// agreement, before any call's shape is known.
#include <chrono>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "kdacp/agreement.hpp"
#include "kdacp/comm.hpp"
#include "kdacp/cost_model.hpp"
#include "kdacp/error.hpp"
#include "kdacp/layer.hpp"

namespace kdacp {

namespace {

// The fields of a context every rank must share, in config.names' terms.
Fingerprint context_fingerprint(const LayerConfig& c, std::size_t ranks, std::chrono::milliseconds timeout) {
  const LayerNames& n = c.names;
  Fingerprint f;
  f.add_text("call", "context");
  f.add_int("world size", static_cast<long long>(ranks));
  f.add_int(n.tokens, static_cast<long long>(c.shape.tokens));
  f.add_bytes(n.cu_seqlens, std::as_bytes(std::span(c.cu_seqlens)),
              c.cu_seqlens.empty() ? "None" : list_text(std::span<const std::int64_t>(c.cu_seqlens)));
  f.add_text(n.layout, layout_kind_name(c.layout));
  f.add_bytes(n.split, std::as_bytes(std::span(c.split)),
              c.split.empty() ? "None" : list_text(std::span<const std::size_t>(c.split)));
  f.add_text(n.protocol, c.protocol);
  f.add_int(n.group_size, c.group_size);
  f.add_int(n.segments, static_cast<long long>(c.exchange.segments));
  f.add_int(n.memory_budget, static_cast<long long>(c.exchange.memory_budget_bytes));
  f.add_flag(n.allow_reassociation, c.exchange.allow_reassociation);
  f.add_hash(n.calibration, fnv1a64(to_json(c.exchange.cost)));
  // auto's inputs when the caller gives them.
  const std::optional<SummaryShape>& es = c.exchange.expected_shape;
  const std::size_t shape[4] = {es ? es->batch : 0, es ? es->heads : 0, es ? es->key_dim : 0, es ? es->value_dim : 0};
  f.add_bytes("expected_shape", std::as_bytes(std::span(shape)),
              es ? list_text(std::span<const std::size_t>(shape)) : std::string("None"));
  std::vector<std::size_t> cuts;
  for (bool cut : c.exchange.expected_cuts) cuts.push_back(cut ? 1 : 0);
  f.add_bytes("expected_cuts", std::as_bytes(std::span(cuts)),
              cuts.empty() ? std::string("None") : list_text(std::span<const std::size_t>(cuts)));
  f.add_text(n.ulysses, c.ulysses == kLayerUlyssesAuto ? "auto" : std::to_string(c.ulysses));
  f.add_text(n.conv, c.conv_width ? std::to_string(*c.conv_width) : "None");
  f.add_real(n.timeout + " (s)", static_cast<double>(timeout.count()) / 1000.0);
  f.append(c.extra);
  return f;
}

}  // namespace

Layout agree_layer_context(const std::shared_ptr<Communicator>& world, const LayerConfig& config,
                           const std::string& what, const std::string& local_error) {
  const std::size_t ranks = world ? world->size() : 1;
  std::string error = local_error;
  std::optional<Layout> layout;
  if (error.empty()) {
    try {
      layout.emplace(validate_layer_context(config, ranks));
    } catch (const InvalidArgument& e) {
      error = e.what();
    }
  }
  if (!world) {
    if (!error.empty()) throw InvalidArgument(error);
    return std::move(*layout);
  }
  agree(*world, context_fingerprint(config, ranks, world->timeout()), what, error);
  return std::move(*layout);
}

}  // namespace kdacp
