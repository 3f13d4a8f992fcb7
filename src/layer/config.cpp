// LayerConfig: its layout, its one validation in the caller's names, the
// fingerprint every rank agrees on, and a context's agreement (kdacp/layer.hpp).
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
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
#include "kdacp/protocol.hpp"

namespace kdacp {

LayerNames LayerNames::cli() {
  LayerNames n;
  n.tokens = "--tokens";
  n.shape = "--batch,--heads,--value-heads,--key-dim,--value-dim";
  n.cu_seqlens = "--seqlens";
  n.layout = "--layout";
  n.split = "--split";
  n.protocol = "--protocol";
  n.group_size = "--group-size";
  n.segments = "--segments";
  n.memory_budget = "--memory-budget";
  n.allow_reassociation = "--allow-reassociation";
  n.calibration = "--calibration";
  n.ulysses = "--ulysses";
  n.algorithm = "--algorithm";
  n.deterministic = "--deterministic";
  n.keep_forward = "forward kept (no --recompute)";
  n.dtype = "input dtype";
  n.storage = "input dtypes q,k,v,g,beta";
  n.timeout = "--timeout";
  n.scale = "--scale";
  n.h0 = "h0 given";
  n.ht = "ht requested";
  n.d_o = "d_o dtype";
  n.dht = "dht given";
  n.dh0 = "dh0 requested";
  n.conv = "convolution width";
  n.transforms = "input transforms";
  n.gate = "gate from raw g";
  n.lower_bound = "gate lower bound";
  return n;
}

const char* layout_kind_name(LayoutKind kind) { return kind == LayoutKind::zigzag ? "zigzag" : "contiguous"; }

LayoutKind parse_layout_kind(const std::string& value, const std::string& name) {
  if (value == "contiguous") return LayoutKind::contiguous;
  if (value == "zigzag") return LayoutKind::zigzag;
  throw InvalidArgument(fmt::format("{} \"{}\": expected contiguous or zigzag", name, value));
}

namespace {

std::string join(std::span<const std::size_t> v) { return fmt::format("{}", fmt::join(v, ",")); }

// The stream's boundaries: the config's cu_seqlens, checked in its names.
void check_cu_seqlens(const LayerConfig& c) {
  const LayerNames& n = c.names;
  const std::vector<std::int64_t>& cu = c.cu_seqlens;
  if (cu.empty()) return;
  if (c.shape.batch != 1)
    throw InvalidArgument(fmt::format("{} given with B = {}: packed sequences need B = 1", n.cu_seqlens,
                                      c.shape.batch));
  if (cu.size() < 2 || cu.front() != 0)
    throw InvalidArgument(fmt::format("{} [{}]: expected at least 2 entries starting at 0", n.cu_seqlens,
                                      fmt::join(cu, ",")));
  for (std::size_t i = 1; i < cu.size(); ++i)
    if (cu[i] <= cu[i - 1])
      throw InvalidArgument(fmt::format("{}: entry {} ({}) is not above entry {} ({}): expected strictly "
                                        "increasing boundaries (no empty sequence)",
                                        n.cu_seqlens, i, cu[i], i - 1, cu[i - 1]));
  if (static_cast<std::uint64_t>(cu.back()) != c.shape.tokens)
    throw InvalidArgument(fmt::format("{} ends at {}, expected {} = {} (the stream's tokens)", n.cu_seqlens, cu.back(),
                                      n.tokens, c.shape.tokens));
}

void check_shape(const LayerConfig& c) {
  const kda::Shape& s = c.shape;
  const LayerNames& n = c.names;
  if (s.tokens == 0) throw InvalidArgument(fmt::format("{} = 0: expected at least one token", n.tokens));
  if (s.batch == 0 || s.heads == 0 || s.value_heads == 0 || s.key_dim == 0 || s.value_dim == 0 ||
      s.value_heads % s.heads != 0)
    throw InvalidArgument(fmt::format("{} = {},{},{},{},{}: expected each at least 1 and HV a multiple of H", n.shape,
                                      s.batch, s.heads, s.value_heads, s.key_dim, s.value_dim));
}

// The deterministic mode's chunk rule on the user's layout: its ranks, its
// token positions (kda::check::chunk_boundaries says the same of the
// layer's own parts, which under Ulysses are head groups).
void check_deterministic(const LayerConfig& c, const Layout& layout, const kda::Sequences& seqs) {
  if (!c.deterministic || c.algorithm != kda::Algorithm::chunk) return;
  const std::vector<std::size_t>& bounds = seqs.boundaries();
  for (const LayoutPart& p : layout.parts()) {
    const std::size_t start = *(std::upper_bound(bounds.begin(), bounds.end(), p.begin) - 1);
    if ((p.begin - start) % kda::kChunkSize != 0)
      throw InvalidArgument(fmt::format(
          "{} with {} chunk: rank {}'s tokens [{}, {}) start {} tokens into their sequence (which starts at "
          "token {}), expected a multiple of {}: choose {} so that every cut inside a sequence falls on a "
          "{}-token boundary of it (docs/determinism.md), or {} recurrent",
          c.names.deterministic, c.names.algorithm, p.rank, p.begin, p.end, p.begin - start, start,
          kda::kChunkSize, c.names.split, kda::kChunkSize, c.names.algorithm));
  }
}

void check_ulysses(const LayerConfig& c, std::size_t ranks) {
  const LayerNames& n = c.names;
  if (c.ulysses == kLayerUlyssesAuto) {
    if (!find_protocol(c.protocol).chooser())
      throw InvalidArgument(fmt::format("{} auto prices each width with the exact protocol auto chooses: expected "
                                        "{} auto, got {}",
                                        n.ulysses, n.protocol, c.protocol));
    return;
  }
  const kda::Shape& s = c.shape;
  if (ranks % c.ulysses != 0 || s.heads % c.ulysses != 0 || s.value_heads % c.ulysses != 0)
    throw InvalidArgument(fmt::format("{} {}: expected a divisor of the {} ranks, of H = {} and of HV = {}",
                                      n.ulysses, c.ulysses, ranks, s.heads, s.value_heads));
}

void check_transforms(const LayerConfig& c) {
  const InputTransforms& t = c.transforms;
  const LayerNames& n = c.names;
  if (!t.gate && (t.lower_bound || t.a_log || t.dt_bias))
    throw InvalidArgument(fmt::format("{}, A_log or dt_bias without {}: g is then the ready log-decay and they "
                                      "would be ignored",
                                      n.lower_bound, n.gate));
  if (t.lower_bound && !(std::isfinite(*t.lower_bound) && *t.lower_bound < 0))
    throw InvalidArgument(fmt::format("{} {}: expected a finite number < 0 (the gate then lies in [{}, 0])",
                                      n.lower_bound, *t.lower_bound, n.lower_bound));
}

// One field: the flags and the lower bound's exact bits, shown compactly.
void add_transform_fields(Fingerprint& f, const LayerConfig& c) {
  const InputTransforms& t = c.transforms;
  std::vector<std::string> shown;
  if (t.qk_l2norm) shown.emplace_back("l2");
  if (t.gate) shown.emplace_back("gate");
  if (t.a_log) shown.emplace_back("A");
  if (t.dt_bias) shown.emplace_back("dt");
  if (t.lower_bound) shown.push_back(fmt::format("lb={}", *t.lower_bound));
  if (t.beta_sigmoid) shown.emplace_back("sig");
  if (t.allow_neg_eigval) shown.emplace_back("neg");
  const double lb = t.lower_bound ? *t.lower_bound : 0.0;
  const std::uint8_t flags[6] = {t.qk_l2norm, t.gate, t.a_log, t.dt_bias, t.lower_bound.has_value(), t.beta_sigmoid};
  std::uint64_t h = fnv1a64(std::as_bytes(std::span(flags)));
  h = fnv1a64(std::as_bytes(std::span(&lb, 1)), h);
  if (t.allow_neg_eigval) {  // hashed only when set: the other configs keep their hashes
    const std::uint8_t neg = 1;
    h = fnv1a64(std::as_bytes(std::span(&neg, 1)), h);
  }
  f.add_hash(c.names.transforms, h, shown.empty() ? std::string("none") : fmt::format("{}", fmt::join(shown, ",")));
}

}  // namespace

Layout make_layer_layout(const LayerConfig& c, std::size_t ranks) {
  const LayerNames& n = c.names;
  const std::size_t tokens = c.shape.tokens;
  if (ranks == 0) throw InvalidArgument("a layer needs at least one rank");
  if (tokens < ranks)
    throw InvalidArgument(fmt::format("{} = {} tokens on {} ranks: expected at least one token per rank", n.tokens,
                                      tokens, ranks));
  if (c.parts) {
    if (c.parts->tokens() != tokens || c.parts->ranks() != ranks)
      throw InvalidArgument(fmt::format("the layout {} is for {} tokens on {} ranks, expected {} = {} on {}",
                                        c.parts->str(), c.parts->tokens(), c.parts->ranks(), n.tokens, tokens, ranks));
    return *c.parts;
  }
  if (c.layout == LayoutKind::zigzag) {
    if (tokens < 2 * ranks)
      throw InvalidArgument(fmt::format("{} zigzag on {} ranks needs {} >= 2 x {} = {}, got {}", n.layout, ranks,
                                        n.tokens, ranks, 2 * ranks, tokens));
    Layout z = Layout::zigzag(tokens, ranks);
    if (!c.split.empty()) {
      std::vector<std::size_t> own(ranks);
      for (std::size_t r = 0; r < ranks; ++r) own[r] = z.local_tokens(r);
      if (own != c.split)
        throw InvalidArgument(fmt::format("{} {}: {} zigzag over {} ranks of {} tokens holds {} per rank", n.split,
                                          join(c.split), n.layout, ranks, tokens, join(own)));
    }
    return z;
  }
  if (c.split.empty()) return Layout::contiguous(tokens, ranks);
  if (c.split.size() != ranks)
    throw InvalidArgument(fmt::format("{} {}: {} entries, expected one per rank ({})", n.split, join(c.split),
                                      c.split.size(), ranks));
  std::size_t sum = 0;
  for (std::size_t r = 0; r < ranks; ++r) {
    if (c.split[r] == 0)
      throw InvalidArgument(fmt::format("{} {}: rank {} holds no token, expected at least one per rank", n.split,
                                        join(c.split), r));
    sum += c.split[r];
  }
  if (sum != tokens)
    throw InvalidArgument(fmt::format("{} {} sums to {} tokens, expected {} = {}", n.split, join(c.split), sum,
                                      n.tokens, tokens));
  return Layout::contiguous(tokens, ranks, c.split);
}

namespace {

void check_protocol(const LayerConfig& c) {
  try {
    find_protocol(c.protocol);
  } catch (const InvalidArgument&) {
    throw InvalidArgument(fmt::format("{} \"{}\": expected one of {}", c.names.protocol, c.protocol, protocol_names()));
  }
  if (c.group_size < 1)
    throw InvalidArgument(fmt::format("{} {}: expected at least 1", c.names.group_size, c.group_size));
}

}  // namespace

Layout validate_layer_context(const LayerConfig& c, std::size_t ranks) {
  const LayerNames& n = c.names;
  check_cu_seqlens(c);  // first: a cu_seqlens of one entry is its own error, not "T = 0"
  if (c.shape.tokens == 0)
    throw InvalidArgument(fmt::format("{} = 0: expected at least one token ({} or {})", n.tokens, n.cu_seqlens,
                                      n.split));
  check_protocol(c);
  if (c.ulysses == kLayerUlyssesAuto) {
    check_ulysses(c, ranks);
  } else if (c.ulysses == 0 || ranks % c.ulysses != 0) {
    throw InvalidArgument(fmt::format("{}={}: expected a divisor of the group's {} ranks", n.ulysses, c.ulysses,
                                      ranks));
  }
  return make_layer_layout(c, ranks);
}

void validate_layer_config(const LayerConfig& c, std::size_t ranks) {
  check_shape(c);
  check_cu_seqlens(c);
  check_protocol(c);
  check_ulysses(c, ranks);
  const Layout layout = make_layer_layout(c, ranks);
  const kda::Sequences seqs = c.cu_seqlens.empty()
                                  ? kda::Sequences(c.shape.batch, c.shape.tokens)
                                  : kda::Sequences(1, c.shape.tokens, std::span<const std::int64_t>(c.cu_seqlens));
  check_deterministic(c, layout, seqs);
  check_transforms(c);
}

namespace {

// The state exchange's settings, in c.names' terms: the construction's and
// a context's fingerprints share them.
void add_exchange_fields(Fingerprint& f, const LayerConfig& c) {
  const LayerNames& n = c.names;
  f.add_text(n.protocol, c.protocol);
  f.add_int(n.group_size, c.group_size);
  f.add_int(n.segments, static_cast<long long>(c.exchange.segments));
  f.add_int(n.memory_budget, static_cast<long long>(c.exchange.memory_budget_bytes));
  f.add_flag(n.allow_reassociation, c.exchange.allow_reassociation);
  f.add_hash(n.calibration, fnv1a64(to_json(c.exchange.cost)));
}

void add_expected_fields(Fingerprint& f, const LayerConfig& c);

// What the caller set beside the stream and the exchange: auto's inputs
// when given, Ulysses, the convolution, the timeout, config.extra.
void add_caller_fields(Fingerprint& f, const LayerConfig& c, std::chrono::milliseconds timeout) {
  const LayerNames& n = c.names;
  add_expected_fields(f, c);
  f.add_text(n.ulysses, c.ulysses == kLayerUlyssesAuto ? "auto" : std::to_string(c.ulysses));
  f.add_text(n.conv, c.conv_width ? std::to_string(*c.conv_width) : "None");
  f.add_real(n.timeout + " (s)", static_cast<double>(timeout.count()) / 1000.0);
  f.append(c.extra);
}

// auto's inputs when the caller gives them.
void add_expected_fields(Fingerprint& f, const LayerConfig& c) {
  const std::optional<SummaryShape>& es = c.exchange.expected_shape;
  const std::size_t shape[4] = {es ? es->batch : 0, es ? es->heads : 0, es ? es->key_dim : 0, es ? es->value_dim : 0};
  f.add_bytes("expected_shape", std::as_bytes(std::span(shape)),
              es ? list_text(std::span<const std::size_t>(shape)) : std::string("None"));
  std::vector<std::size_t> cuts;
  for (bool cut : c.exchange.expected_cuts) cuts.push_back(cut ? 1 : 0);
  f.add_bytes("expected_cuts", std::as_bytes(std::span(cuts)),
              cuts.empty() ? std::string("None") : list_text(std::span<const std::size_t>(cuts)));
}

// "bfloat16,compute,...": q, k, v, g, beta's storage, then o's.
std::string storage_text(const LayerConfig& c) {
  std::string storage;
  for (const std::optional<Half>& h : c.storage) storage += std::string(h ? half_name(*h) : "compute") + ",";
  return storage + (c.out_storage ? half_name(*c.out_storage) : "compute");
}

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
  add_caller_fields(f, c, timeout);
  return f;
}

// The fields of a call whose split is gathered (agree_layer_call).
Fingerprint call_fingerprint(const LayerConfig& c, std::size_t ranks, std::chrono::milliseconds timeout,
                             const char* dtype, const Fingerprint& call) {
  const LayerNames& n = c.names;
  const kda::Shape& s = c.shape;
  Fingerprint f;
  f.add_text("call", "layer call");
  f.add_int("world size", static_cast<long long>(ranks));
  const std::size_t dims[5] = {s.batch, s.heads, s.value_heads, s.key_dim, s.value_dim};
  f.add_bytes(n.shape, std::as_bytes(std::span(dims)), list_text(std::span<const std::size_t>(dims)));
  f.add_text(n.dtype, dtype);
  f.add_text(n.storage, storage_text(c));
  f.add_text(n.algorithm, kda::algorithm_name(c.algorithm));
  f.add_flag(n.deterministic, c.deterministic);
  f.add_flag(n.keep_forward, c.keep_forward);
  f.add_bytes(n.cu_seqlens, std::as_bytes(std::span(c.cu_seqlens)),
              c.cu_seqlens.empty() ? "None" : list_text(std::span<const std::int64_t>(c.cu_seqlens)));
  f.add_text(n.layout, layout_kind_name(c.layout));
  add_exchange_fields(f, c);
  add_transform_fields(f, c);
  add_caller_fields(f, c, timeout);
  f.append(call);
  return f;
}

}  // namespace

Fingerprint layer_fingerprint(const LayerConfig& c, std::size_t ranks, std::size_t width) {
  const LayerNames& n = c.names;
  const kda::Shape& s = c.shape;
  Fingerprint f;
  f.add_text("call", "layer construction");
  const std::size_t dims[5] = {s.batch, s.heads, s.value_heads, s.key_dim, s.value_dim};
  f.add_bytes(n.shape, std::as_bytes(std::span(dims)), list_text(std::span<const std::size_t>(dims)));
  f.add_int(n.tokens, static_cast<long long>(s.tokens));
  f.add_bytes(n.cu_seqlens, std::as_bytes(std::span(c.cu_seqlens)),
              c.cu_seqlens.empty() ? "none" : list_text(std::span<const std::int64_t>(c.cu_seqlens)));
  f.add_text(n.layout, layout_kind_name(c.layout));
  f.add_bytes(n.split, std::as_bytes(std::span(c.split)),
              c.split.empty() ? "default" : list_text(std::span<const std::size_t>(c.split)));
  f.add_int("ranks", static_cast<long long>(ranks));
  if (c.parts) {
    const std::vector<std::size_t> owners = c.parts->owners().list(), lengths = c.parts->part_lengths();
    f.add_bytes("layout part owners", std::as_bytes(std::span(owners)), list_text(std::span<const std::size_t>(owners)));
    f.add_bytes("layout part lengths", std::as_bytes(std::span(lengths)),
                list_text(std::span<const std::size_t>(lengths)));
  }
  f.add_text(n.storage, storage_text(c));
  f.add_text(n.algorithm, kda::algorithm_name(c.algorithm));
  f.add_flag(n.deterministic, c.deterministic);
  f.add_flag(n.keep_forward, c.keep_forward);
  add_exchange_fields(f, c);
  f.add_int(n.ulysses + " (as given)", static_cast<long long>(c.ulysses));
  f.add_int(n.ulysses, static_cast<long long>(width));
  f.add_int(n.conv, c.conv_width ? static_cast<long long>(*c.conv_width) : -1);
  f.add_flag("check_finite", c.check_finite);
  add_transform_fields(f, c);
  f.append(c.extra);
  return f;
}

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

Fingerprint exchange_fingerprint(const LayerConfig& c, std::chrono::milliseconds timeout) {
  Fingerprint f;
  f.add_text("call", "state exchange");
  add_exchange_fields(f, c);
  add_expected_fields(f, c);
  f.add_real(c.names.timeout + " (s)", static_cast<double>(timeout.count()) / 1000.0);
  return f;
}

LayerConfig agree_layer_call(const std::shared_ptr<Communicator>& world, LayerConfig config, const char* dtype,
                             const Fingerprint& call, const std::string& what, const std::string& local_error) {
  const std::size_t local = config.shape.tokens;
  if (!world) {
    if (!local_error.empty()) throw InvalidArgument(local_error);
    config.split.clear();
    return config;
  }
  const Fingerprint f = call_fingerprint(config, world->size(), world->timeout(), dtype, call);
  const std::vector<std::uint64_t> counts = agree_gather(*world, f, what, local, local_error);
  config.split.assign(counts.begin(), counts.end());
  config.shape.tokens = 0;
  for (std::size_t n : config.split) config.shape.tokens += n;
  return config;
}

}  // namespace kdacp
