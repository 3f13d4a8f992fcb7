#include "kdacp/kda_cp.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <span>
#include <sstream>
#include <type_traits>
#include <utility>

#include "kdacp/error.hpp"
#include "kdacp/finite.hpp"
#include "kdacp/thread_pool.hpp"

namespace kdacp::kda {

TokenSplit split_tokens(std::size_t tokens, std::size_t ranks, std::size_t rank) {
  if (ranks == 0 || ranks > tokens)
    throw InvalidArgument("context-parallel size P is " + std::to_string(ranks) + " for " +
                          std::to_string(tokens) +
                          " tokens, expected 1 <= P <= T (every rank needs a token)");
  if (rank >= ranks)
    throw InvalidArgument("rank " + std::to_string(rank) + " outside P = " + std::to_string(ranks));
  const std::size_t base = tokens / ranks, extra = tokens % ranks;
  return {rank * base + std::min(rank, extra), base + (rank < extra ? 1 : 0)};
}

template <class T>
void slice_tokens(const T* full, std::size_t batch, std::size_t tokens, std::size_t inner,
                  TokenSplit range, T* local) {
  for (std::size_t b = 0; b < batch; ++b)
    std::memcpy(local + b * range.count * inner, full + (b * tokens + range.begin) * inner,
                range.count * inner * sizeof(T));
}

template <class T>
void unslice_tokens(const T* local, std::size_t batch, std::size_t tokens, std::size_t inner,
                    TokenSplit range, T* full) {
  for (std::size_t b = 0; b < batch; ++b)
    std::memcpy(full + (b * tokens + range.begin) * inner, local + b * range.count * inner,
                range.count * inner * sizeof(T));
}

Layout::Layout(std::size_t ranks, std::vector<LayoutPart> parts)
    : ranks_(ranks), parts_(std::move(parts)) {
  const std::string what = "kda::Layout: ";
  if (ranks == 0) throw InvalidArgument(what + "ranks (P) = 0, expected >= 1");
  if (parts_.empty()) throw InvalidArgument(what + "no parts, expected at least one per rank");
  std::vector<bool> held(ranks, false);
  std::size_t next = 0;
  for (std::size_t j = 0; j < parts_.size(); ++j) {
    const LayoutPart& p = parts_[j];
    const std::string at = what + "part " + std::to_string(j) + " ";
    if (p.begin != next)
      throw InvalidArgument(at + "begins at token " + std::to_string(p.begin) + ", expected " +
                            std::to_string(next) + " (parts tile the stream in token order)");
    if (p.end <= p.begin)
      throw InvalidArgument(at + "is [" + std::to_string(p.begin) + ", " + std::to_string(p.end) +
                            "), expected a non-empty token range");
    if (p.rank >= ranks)
      throw InvalidArgument(at + "is on rank " + std::to_string(p.rank) + ", expected < P = " +
                            std::to_string(ranks));
    held[p.rank] = true;
    next = p.end;
  }
  for (std::size_t r = 0; r < ranks; ++r)
    if (!held[r])
      throw InvalidArgument(what + "rank " + std::to_string(r) +
                            " holds no part, expected every rank to hold tokens");
}

Layout Layout::contiguous(std::size_t tokens, std::size_t ranks,
                          std::span<const std::size_t> counts) {
  std::vector<LayoutPart> parts;
  if (counts.empty()) {
    split_tokens(tokens, ranks, 0);  // 1 <= P <= T
    for (std::size_t r = 0; r < ranks; ++r) {
      const TokenSplit range = split_tokens(tokens, ranks, r);
      parts.push_back({r, range.begin, range.begin + range.count});
    }
    return Layout(ranks, std::move(parts));
  }
  const std::string what = "kda::Layout::contiguous: ";
  if (counts.size() != ranks)
    throw InvalidArgument(what + "counts has " + std::to_string(counts.size()) +
                          " entries, expected one per rank, P = " + std::to_string(ranks));
  std::size_t begin = 0;
  for (std::size_t r = 0; r < ranks; ++r) {
    if (counts[r] == 0)
      throw InvalidArgument(what + "counts[" + std::to_string(r) +
                            "] = 0, expected >= 1 (every rank needs a token)");
    parts.push_back({r, begin, begin + counts[r]});
    begin += counts[r];
  }
  if (begin != tokens)
    throw InvalidArgument(what + "counts sum to " + std::to_string(begin) + ", expected T = " +
                          std::to_string(tokens));
  return Layout(ranks, std::move(parts));
}

Layout Layout::zigzag(std::size_t tokens, std::size_t ranks) {
  const std::string what = "kda::Layout::zigzag: ";
  if (ranks == 0) throw InvalidArgument(what + "ranks (P) = 0, expected >= 1");
  const std::size_t count = 2 * ranks;
  if (tokens < count)
    throw InvalidArgument(what + std::to_string(tokens) + " tokens for P = " +
                          std::to_string(ranks) + ", expected T >= 2P = " + std::to_string(count) +
                          " (every part needs a token)");
  const std::size_t base = tokens / count, extra = tokens % count;
  std::vector<LayoutPart> parts;
  std::size_t begin = 0;
  for (std::size_t j = 0; j < count; ++j) {
    const std::size_t end = begin + base + (j < extra ? 1 : 0);
    parts.push_back({j < ranks ? j : count - 1 - j, begin, end});
    begin = end;
  }
  return Layout(ranks, std::move(parts));
}

std::vector<std::size_t> Layout::owners() const {
  std::vector<std::size_t> out;
  for (const LayoutPart& p : parts_) out.push_back(p.rank);
  return out;
}

std::vector<Part> Layout::local_parts(std::size_t rank) const {
  std::vector<Part> out;
  std::size_t local = 0;
  for (const LayoutPart& p : parts_)
    if (p.rank == rank) {
      out.push_back({p.begin, p.end, local});
      local += p.end - p.begin;
    }
  return out;
}

std::size_t Layout::local_tokens(std::size_t rank) const {
  std::size_t n = 0;
  for (const LayoutPart& p : parts_)
    if (p.rank == rank) n += p.end - p.begin;
  return n;
}

namespace {
template <class T>
constexpr DType dtype_of() {
  return std::is_same_v<T, double> ? DType::f64 : DType::f32;
}
double since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Runs the checks and local work before a call's first message, naming the
// rank in any InvalidArgument they throw.
void on_rank(std::size_t rank, const char* op, const std::function<void()>& fn) {
  try {
    fn();
  } catch (const InvalidArgument& e) {
    throw InvalidArgument(std::string("kda::ContextParallelLayer::") + op + " on rank " +
                          std::to_string(rank) + ": " + e.what());
  }
}

void require(const void* ptr, const char* field) {
  if (ptr == nullptr)
    throw InvalidArgument(std::string(field) + " is null, expected a pointer to its tensor");
}

template <class T>
void check_inputs(const Inputs<T>& in) {
  validate(in.shape);
  require(in.q, "q");
  require(in.k, "k");
  require(in.v, "v");
  require(in.g, "g");
  require(in.beta, "beta");
  if (!std::isfinite(in.scale) || !(in.scale > 0))
    throw InvalidArgument("scale = " + std::to_string(in.scale) +
                          ", expected a finite value > 0 (default_scale(K) = 1/sqrt(K))");
}

template <class T>
void check_states(const SequenceStates<T>& st, const Sequences& seqs, const Shape& s,
                  const char* field) {
  if (st.data == nullptr) return;
  const std::size_t want[4] = {seqs.count(), s.value_heads, s.key_dim, s.value_dim};
  const std::size_t got[4] = {st.sequences, st.value_heads, st.key_dim, st.value_dim};
  if (std::equal(got, got + 4, want)) return;
  auto dims = [](const std::size_t* d) {
    std::string out(1, '[');
    for (std::size_t i = 0; i < 4; ++i) out.append(i ? "," : "").append(std::to_string(d[i]));
    return out.append("]");
  };
  throw InvalidArgument(std::string(field) + " has shape " + dims(got) +
                        ", expected [N,HV,K,V] = " + dims(want));
}

std::string owners_text(const std::vector<std::size_t>& owners) {
  std::string out(1, '{');
  for (std::size_t j = 0; j < owners.size(); ++j)
    out.append(j ? ", " : "").append(std::to_string(owners[j]));
  return out.append("}");
}

// Part j on rank j for every j < P: the plain exchange, which every method runs.
bool one_part_per_rank(const std::vector<std::size_t>& owners, std::size_t ranks) {
  if (owners.size() != ranks) return false;
  for (std::size_t j = 0; j < ranks; ++j)
    if (owners[j] != j) return false;
  return true;
}

// This rank's parts of the stream in chain order, once the stream is checked
// against the exchange's layout and the local inputs.
std::vector<Part> checked_parts(const Stream& stream, const Shape& local, std::size_t rank,
                                std::size_t ranks, const std::vector<std::size_t>& part_owners) {
  const Layout& layout = stream.layout;
  const Sequences& seqs = stream.sequences;
  if (layout.ranks() != ranks)
    throw InvalidArgument("stream.layout spans " + std::to_string(layout.ranks()) +
                          " ranks, expected the mesh's P = " + std::to_string(ranks));
  // The exchange was built for one assignment of chain positions to ranks.
  if (const std::vector<std::size_t> owners = layout.owners(); owners != part_owners)
    throw InvalidArgument("stream.layout has part owners " + owners_text(owners) +
                          ", expected the exchange's " + owners_text(part_owners) +
                          " (the layout the layer was built with)");
  if (layout.tokens() != seqs.tokens())
    throw InvalidArgument("stream.layout covers " + std::to_string(layout.tokens()) +
                          " tokens, expected the sequences' T = " + std::to_string(seqs.tokens()));
  if (local.batch != seqs.batch())
    throw InvalidArgument("shape.batch (B) = " + std::to_string(local.batch) +
                          ", expected the sequences' B = " + std::to_string(seqs.batch()));
  if (local.tokens != layout.local_tokens(rank))
    throw InvalidArgument("shape.tokens (T_local) = " + std::to_string(local.tokens) +
                          ", expected the layout's " + std::to_string(layout.local_tokens(rank)) +
                          " tokens of rank " + std::to_string(rank));
  return layout.local_parts(rank);
}

// Rows [first, first + count) of [N,HV,K,V] states that each part computes,
// with the part's rank: the sequences ending (ht) or starting (dh0) in it.
struct PartRows {
  std::size_t rank;
  SequenceRange rows;
};
std::vector<PartRows> rows_by_part(const Stream& stream, bool ending) {
  std::vector<PartRows> out;
  for (const LayoutPart& p : stream.layout.parts()) {
    const PartInfo info = part_info(stream.sequences, Part{p.begin, p.end, 0});
    out.push_back({p.rank, ending ? info.ended : info.started});
  }
  return out;
}

// Every part's rows to every rank, each broadcast whole from the rank that
// computed it, in chain order: copies, so every rank holds the same bits.
template <class T>
void share_rows(Communicator& comm, const SequenceStates<T>& st,
                const std::vector<PartRows>& parts) {
  const std::size_t row = st.value_heads * st.key_dim * st.value_dim;
  for (const PartRows& p : parts)
    if (p.rows.count > 0)
      comm.broadcast(std::as_writable_bytes(std::span<T>(st.data + p.rows.first * row,
                                                         p.rows.count * row)),
                     p.rank);
}

// The sum over ranks of their dht: all-gathered, then added in rank order,
// so every rank gets the same bits.
template <class T>
std::vector<T> summed_over_ranks(Communicator& comm, const SequenceStates<const T>& dht) {
  const std::size_t n = dht.sequences * dht.value_heads * dht.key_dim * dht.value_dim;
  const std::size_t ranks = comm.size();
  std::vector<T> slots(ranks * n);
  std::copy_n(dht.data, n, slots.begin() + comm.rank() * n);
  comm.all_gather(std::as_writable_bytes(std::span<T>(slots)));
  std::vector<T> sum(slots.begin(), slots.begin() + n);
  for (std::size_t r = 1; r < ranks; ++r)
    for (std::size_t i = 0; i < n; ++i) sum[i] += slots[r * n + i];
  return sum;
}
}  // namespace

namespace {
ExchangeOptions with_layout(const DeviceMesh& mesh, const Layout& layout,
                            ExchangeOptions options) {
  if (layout.ranks() != mesh.size())
    throw InvalidArgument("kda::ContextParallelLayer: layout spans " +
                          std::to_string(layout.ranks()) + " ranks, expected the mesh's P = " +
                          std::to_string(mesh.size()));
  std::vector<std::size_t> owners = layout.owners();
  // Left empty, the layout is the plain exchange, which every method runs.
  options.part_owners =
      one_part_per_rank(owners, mesh.size()) ? std::vector<std::size_t>{} : std::move(owners);
  return options;
}

std::vector<std::size_t> part_lengths(const Layout& layout) {
  std::vector<std::size_t> out;
  for (const LayoutPart& p : layout.parts()) out.push_back(p.end - p.begin);
  return out;
}

// What every rank must build the layer with (the layer's doc lists it).
template <class T>
Fingerprint construction_fields(const std::string& method, long long group_size,
                                const ExchangeOptions& o, const Layout* layout,
                                std::chrono::milliseconds timeout) {
  Fingerprint f;
  f.add_text("call", "construction");
  f.add_text("dtype", std::is_same_v<T, double> ? "float64" : "float32");
  f.add_text("method", method);
  f.add_int("allgather_group_size", group_size);
  f.add_int("options.segments", static_cast<long long>(o.segments));
  f.add_int("options.memory_budget_bytes", static_cast<long long>(o.memory_budget_bytes));
  f.add_flag("options.allow_reassociation", o.allow_reassociation);
  f.add_hash("options.cost", fnv1a64(to_json(o.cost)));
  f.add_text("options.expected_shape", o.expected_shape ? to_string(*o.expected_shape) : "none");
  f.add_bytes("options.part_owners", std::as_bytes(std::span(o.part_owners)),
              list_text(std::span<const std::size_t>(o.part_owners)));
  const std::vector<std::size_t> lengths = layout ? part_lengths(*layout) : std::vector<std::size_t>{};
  f.add_bytes("layout part lengths", std::as_bytes(std::span(lengths)),
              list_text(std::span<const std::size_t>(lengths)));
  f.add_int("timeout ms", static_cast<long long>(timeout.count()));
  return f;
}

// The arguments of a call that every rank shares: all but T_local (each
// rank's own) and the tensors' contents.
template <class T>
Fingerprint call_fields(const char* call, const Inputs<T>& in, Algorithm algorithm) {
  const Shape& s = in.shape;
  const std::size_t dims[5] = {s.batch, s.heads, s.value_heads, s.key_dim, s.value_dim};
  Fingerprint f;
  f.add_text("call", call);
  f.add_bytes("shape B,H,HV,K,V", std::as_bytes(std::span(dims)), list_text(std::span<const std::size_t>(dims)));
  f.add_real("scale", in.scale);
  f.add_text("algorithm", algorithm_name(algorithm));
  return f;
}

// A stream's fields: its sequences (B, T, the exact cu_seqlens) and layout.
void add_stream(Fingerprint& f, const Stream& stream) {
  const Sequences& seqs = stream.sequences;
  const std::size_t bt[2] = {seqs.batch(), seqs.tokens()};
  f.add_bytes("stream B,T", std::as_bytes(std::span(bt)), list_text(std::span<const std::size_t>(bt)));
  f.add_flag("packed (cu_seqlens given)", seqs.packed());
  const std::vector<std::size_t>& bounds = seqs.boundaries();
  f.add_bytes("cu_seqlens", std::as_bytes(std::span(bounds)), list_text(std::span<const std::size_t>(bounds)));
  const std::vector<std::size_t> owners = stream.layout.owners(), lengths = part_lengths(stream.layout);
  f.add_bytes("layout part owners", std::as_bytes(std::span(owners)), list_text(std::span<const std::size_t>(owners)));
  f.add_bytes("layout part lengths", std::as_bytes(std::span(lengths)),
              list_text(std::span<const std::size_t>(lengths)));
}

// A tensor of this rank for the finite check: its name, data (null: not
// given) and shape.
template <class T>
struct Named {
  const char* name;
  const T* data;
  std::vector<std::size_t> shape;
};
std::string where(std::size_t rank, const char* op) {
  return std::string("kda::ContextParallelLayer::") + op + " on rank " + std::to_string(rank);
}

std::size_t elems_of(const std::vector<std::size_t>& shape) {
  std::size_t n = 1;
  for (std::size_t d : shape) n *= d;
  return n;
}
// Throws NumericalError naming the first of `outputs` that holds a NaN or
// ±Inf, its first such element, and whether this rank's `inputs` were finite.
// find_non_finite over the pool's threads (a memory-bound scan): the first
// non-finite index of `data`, or nullopt.
template <class T>
std::optional<std::size_t> first_non_finite(std::span<const T> data, ThreadPool* pool) {
  constexpr std::size_t kBlock = 1 << 14;  // elements per work item
  if (data.empty()) return std::nullopt;
  const std::size_t blocks = (data.size() + kBlock - 1) / kBlock;
  std::vector<std::size_t> first(participants(pool, blocks), data.size());
  parallel_ranges(pool, blocks, [&](std::size_t begin, std::size_t end, std::size_t part) {
    const std::size_t lo = begin * kBlock, hi = std::min(data.size(), end * kBlock);
    if (const auto i = find_non_finite(data.subspan(lo, hi - lo))) first[part] = lo + *i;
  });
  const std::size_t i = *std::min_element(first.begin(), first.end());
  return i < data.size() ? std::optional<std::size_t>(i) : std::nullopt;
}

template <class T>
void require_finite_results(const std::string& where, const std::vector<Named<T>>& outputs,
                            const std::vector<Named<T>>& inputs, ThreadPool* pool) {
  for (const Named<T>& out : outputs) {
    if (out.data == nullptr) continue;
    const auto bad = first_non_finite(std::span<const T>(out.data, elems_of(out.shape)), pool);
    if (!bad) continue;
    std::ostringstream os;
    os << where << ": " << out.name << index_string(*bad, out.shape) << " = " << out.data[*bad]
       << ", a non-finite result";
    std::string cause = " from finite inputs (" + std::string(std::is_same_v<T, float> ? "float32" : "float64") +
                        " overflow: inputs too large for this dtype?)";
    for (const Named<T>& in : inputs) {
      if (in.data == nullptr) continue;
      if (const auto i = find_non_finite(std::span<const T>(in.data, elems_of(in.shape)))) {
        std::ostringstream c;
        c << "; the input " << in.name << index_string(*i, in.shape) << " is already " << in.data[*i];
        cause = c.str();
        break;
      }
    }
    throw NumericalError(os.str() + cause +
                         " (LayerChecks::check_finite / check_finite(false) turns this check off)");
  }
}

template <class T>
std::vector<Named<T>> input_tensors(const Inputs<T>& in) {
  const Shape& s = in.shape;
  return {{"q", in.q, {s.batch, s.tokens, s.heads, s.key_dim}},
          {"k", in.k, {s.batch, s.tokens, s.heads, s.key_dim}},
          {"v", in.v, {s.batch, s.tokens, s.value_heads, s.value_dim}},
          {"g", in.g, {s.batch, s.tokens, s.value_heads, s.key_dim}},
          {"beta", in.beta, {s.batch, s.tokens, s.value_heads}}};
}

template <class T>
std::vector<std::size_t> states_shape(const SequenceStates<T>& st) {
  return {st.sequences, st.value_heads, st.key_dim, st.value_dim};
}

template <class T>
std::vector<Named<T>> grad_tensors(const Grads<T>& g, const Shape& s) {
  return {{"dq", g.dq, {s.batch, s.tokens, s.heads, s.key_dim}},
          {"dk", g.dk, {s.batch, s.tokens, s.heads, s.key_dim}},
          {"dv", g.dv, {s.batch, s.tokens, s.value_heads, s.value_dim}},
          {"dg", g.dg, {s.batch, s.tokens, s.value_heads, s.key_dim}},
          {"dbeta", g.dbeta, {s.batch, s.tokens, s.value_heads}},
          {"d_incoming", g.d_incoming, {s.batch, s.value_heads, s.key_dim, s.value_dim}}};
}
}  // namespace

template <class T>
ContextParallelLayer<T>::ContextParallelLayer(const DeviceMesh& mesh, const std::string& method,
                                              long long allgather_group_size,
                                              ExchangeOptions options, const ExecPolicy& exec,
                                              LayerChecks checks)
    : comm_(mesh.group(0)), exec_(exec), check_finite_(checks.check_finite) {
  build(mesh, method, allgather_group_size, std::move(options), nullptr, checks.agree);
}

template <class T>
ContextParallelLayer<T>::ContextParallelLayer(const DeviceMesh& mesh, const std::string& method,
                                              const Layout& layout, long long allgather_group_size,
                                              ExchangeOptions options, const ExecPolicy& exec,
                                              LayerChecks checks)
    : comm_(mesh.group(0)), exec_(exec), check_finite_(checks.check_finite) {
  build(mesh, method, allgather_group_size, std::move(options), &layout, checks.agree);
}

template <class T>
void ContextParallelLayer<T>::build(const DeviceMesh& mesh, const std::string& method,
                                    long long allgather_group_size, ExchangeOptions options,
                                    const Layout* layout, const Fingerprint& caller) {
  // The layout's own error (P not the mesh's) is this rank's: shared in the
  // agreement, so that no rank goes on to build the exchange alone.
  std::string local_error;
  if (layout != nullptr) {
    try {
      options = with_layout(mesh, *layout, std::move(options));
    } catch (const InvalidArgument& e) {
      local_error = e.what();
    }
  }
  Fingerprint fields = construction_fields<T>(method, allgather_group_size, options, layout,
                                              comm_->timeout());
  fields.append(caller);
  // Before make_state_exchange, which may split the mesh: ranks that asked
  // for different protocols would otherwise wait in different collectives.
  agree(*comm_, fields, "kda::ContextParallelLayer construction", local_error);
  part_owners_ = options.part_owners;
  if (part_owners_.empty())
    for (std::size_t r = 0; r < mesh.size(); ++r) part_owners_.push_back(r);
  options.exec = exec_;
  exchange_ = make_state_exchange(mesh, method, allgather_group_size, std::move(options));
}

template <class T>
void ContextParallelLayer<T>::agree_on(const char* op, const Fingerprint& fields,
                                       const std::function<void()>& checks) const {
  std::string local_error;
  try {
    on_rank(comm_->rank(), op, checks);
  } catch (const InvalidArgument& e) {
    local_error = e.what();
  }
  agree(*comm_, fields, std::string("kda::ContextParallelLayer::") + op, local_error);
}

template <class T>
Saved ContextParallelLayer<T>::forward(const Inputs<T>& in, Elem<T>* o) {
  agree_on("forward", call_fields("forward", in, exec_.algorithm), [&] {
    check_inputs(in);
    require(o, "o");
    require_plain(exchange_->rank(), "forward");
  });
  const Shape& s = in.shape;
  auto t0 = std::chrono::steady_clock::now();
  State offset(s.batch, s.value_heads, s.key_dim, s.value_dim, dtype_of<T>());
  State transfer(s.batch, s.value_heads, s.key_dim, s.key_dim, dtype_of<T>());
  chunk_summary(in, offset.data<T>(), transfer.data<T>(), exec_);
  fwd_.local = fwd_.summary = since(t0);
  t0 = std::chrono::steady_clock::now();
  State incoming = exchange_->forward(offset.view(), transfer.view());
  fwd_.exchange = since(t0);
  t0 = std::chrono::steady_clock::now();
  const auto cache = next_cache(in);
  kda::forward(in, incoming.data<T>(), o, nullptr, exec_, cache.get());
  fwd_.local += since(t0);
  if (check_finite_)
    require_finite_results<T>(where(comm_->rank(), "forward"), {{"o", o, {s.batch, s.tokens, s.value_heads, s.value_dim}}},
                              input_tensors(in), exec_.pool);
  Saved saved;
  saved.transfer.push_back(std::move(transfer));
  saved.incoming.push_back(std::move(incoming));
  saved.kept<T>() = cache;
  return saved;
}

template <class T>
std::shared_ptr<ForwardCache<Elem<T>>> ContextParallelLayer<T>::next_cache(const Inputs<T>& /*in*/) {
  if (!keep_forward_ || exec_.algorithm != Algorithm::chunk) return nullptr;
  for (const auto& c : caches_)
    if (c.use_count() == 1) {  // no Saved holds it: reuse its buffers
      c->clear();
      return c;
    }
  return caches_.emplace_back(std::make_shared<ForwardCache<Elem<T>>>());
}

template <class T>
ForwardCache<Elem<T>>* ContextParallelLayer<T>::kept_of(const Saved& saved) {
  ForwardCache<Elem<T>>* kept = saved.kept<T>().get();
  if (kept) kept->rewind();
  return kept;
}

template <class T>
std::size_t ContextParallelLayer<T>::forward_cache_bytes() const {
  std::size_t n = 0;
  for (const auto& c : caches_) n += c->bytes();
  return n;
}

template <class T>
void ContextParallelLayer<T>::backward(const Inputs<T>& in, const Saved& saved, const Elem<T>* d_o,
                                       const Grads<Elem<T>>& grads) {
  agree_on("backward", call_fields("backward", in, exec_.algorithm), [&] {
    check_inputs(in);
    if (saved.stream)
      throw InvalidArgument(
          "saved comes from the forward over a stream, expected the backward that takes h0, dht "
          "and dh0");
    if (saved.transfer.size() != 1 || saved.incoming.size() != 1)
      throw InvalidArgument("saved holds " + std::to_string(saved.transfer.size()) +
                            " parts, expected the one of the forward without a stream");
    require(d_o, "d_o");
    require(grads.dq, "dq");
    require(grads.dk, "dk");
    require(grads.dv, "dv");
    require(grads.dg, "dg");
    require(grads.dbeta, "dbeta");
    require_plain(exchange_->rank(), "backward");
  });
  const Shape& s = in.shape;
  auto t0 = std::chrono::steady_clock::now();
  State g(s.batch, s.value_heads, s.key_dim, s.value_dim, dtype_of<T>());
  incoming_grad(in, d_o, g.data<T>(), exec_);
  bwd_.local = bwd_.summary = since(t0);
  t0 = std::chrono::steady_clock::now();
  State d_final = exchange_->backward(g.view(), saved.transfer.front().view());
  bwd_.exchange = since(t0);
  t0 = std::chrono::steady_clock::now();
  kda::backward(in, saved.incoming.front().data<T>(), d_o, d_final.data<T>(), grads, exec_,
                kDefaultCheckpointInterval, kept_of(saved));
  bwd_.local += since(t0);
  if (check_finite_) {
    std::vector<Named<T>> inputs = input_tensors(in);
    inputs.push_back({"d_o", d_o, {s.batch, s.tokens, s.value_heads, s.value_dim}});
    require_finite_results<T>(where(comm_->rank(), "backward"), grad_tensors(grads, s), inputs, exec_.pool);
  }
}

namespace {

template <class Int>
Stream contiguous_stream_of(std::size_t rank, std::size_t ranks, std::size_t batch,
                            std::size_t tokens, std::span<const Int> cu_seqlens,
                            std::span<const std::size_t> counts) {
  std::optional<Stream> out;
  on_rank(rank, "contiguous_stream", [&] {
    Layout layout = Layout::contiguous(tokens, ranks, counts);
    out.emplace(Stream{cu_seqlens.empty() ? Sequences(batch, tokens)
                                          : Sequences(batch, tokens, cu_seqlens),
                       std::move(layout)});
  });
  return std::move(*out);
}

}  // namespace

template <class T>
Stream ContextParallelLayer<T>::contiguous_stream(std::size_t batch, std::size_t tokens,
                                                  std::span<const std::int64_t> cu_seqlens,
                                                  std::span<const std::size_t> counts) const {
  return contiguous_stream_of(exchange_->rank(), exchange_->size(), batch, tokens, cu_seqlens, counts);
}

template <class T>
Stream ContextParallelLayer<T>::contiguous_stream(std::size_t batch, std::size_t tokens,
                                                  std::span<const std::int32_t> cu_seqlens,
                                                  std::span<const std::size_t> counts) const {
  return contiguous_stream_of(exchange_->rank(), exchange_->size(), batch, tokens, cu_seqlens, counts);
}

template <class T>
void ContextParallelLayer<T>::require_plain(std::size_t rank, const char* op) const {
  if (!one_part_per_rank(part_owners_, exchange_->size()))
    throw InvalidArgument(std::string("kda::ContextParallelLayer::") + op + " on rank " +
                          std::to_string(rank) + ": the layer's layout has part owners " +
                          owners_text(part_owners_) +
                          ", expected one part per rank in rank order for the call without a "
                          "stream");
}

template <class T>
Saved ContextParallelLayer<T>::forward(const Inputs<T>& in, const Stream& stream,
                                       SequenceStates<const Elem<T>> h0, Elem<T>* o,
                                       SequenceStates<Elem<T>> ht) {
  const std::size_t rank = exchange_->rank();
  const Sequences& seqs = stream.sequences;
  auto t0 = std::chrono::steady_clock::now();
  std::vector<Part> parts;
  std::vector<PartInfo> infos;
  std::vector<State> offsets, transfers;
  std::vector<PartSummary> summaries;
  Fingerprint fields = call_fields("forward (stream)", in, exec_.algorithm);
  add_stream(fields, stream);
  fields.add_flag("h0 given", h0.data != nullptr);
  fields.add_flag("ht requested", ht.data != nullptr);
  agree_on("forward", fields, [&] {
    check_inputs(in);
    parts = checked_parts(stream, in.shape, rank, exchange_->size(), part_owners_);
    require(o, "o");
    check_states(h0, seqs, in.shape, "h0");
    check_states(ht, seqs, in.shape, "ht");
  });
  on_rank(rank, "forward", [&] {
    const Shape& s = in.shape;
    for (const Part& part : parts) {
      offsets.emplace_back(s.batch, s.value_heads, s.key_dim, s.value_dim, dtype_of<T>());
      // A cut's M is never read: the zero buffer stands for it.
      transfers.emplace_back(s.batch, s.value_heads, s.key_dim, s.key_dim, dtype_of<T>());
      infos.push_back(part_info(seqs, part));
      part_summary(in, seqs, part, h0, offsets.back().data<T>(),
                   infos.back().cut ? nullptr : transfers.back().data<T>(), exec_);
    }
    for (std::size_t i = 0; i < parts.size(); ++i)
      summaries.push_back({offsets[i].view(), transfers[i].view(), PartFlags{infos[i].cut}});
  });
  fwd_.local = fwd_.summary = since(t0);
  t0 = std::chrono::steady_clock::now();
  std::vector<State> incoming = exchange_->forward(summaries);
  fwd_.exchange = since(t0);
  t0 = std::chrono::steady_clock::now();
  const auto cache = next_cache(in);
  for (std::size_t i = 0; i < parts.size(); ++i)
    part_forward(in, seqs, parts[i], infos[i].starts_sequence ? nullptr : incoming[i].data<T>(),
                 h0, o, ht, exec_, cache.get());
  fwd_.local += since(t0);
  if (ht.data != nullptr) {
    t0 = std::chrono::steady_clock::now();
    share_rows(*comm_, ht, rows_by_part(stream, true));
    fwd_.exchange += since(t0);
  }
  // After the ht broadcasts, so that no rank stops before its peers' last
  // message; ht is the same bits on every rank, so every rank throws for it.
  if (check_finite_) {
    const Shape& s = in.shape;
    std::vector<Named<T>> inputs = input_tensors(in);
    inputs.push_back({"h0", h0.data, states_shape(h0)});
    require_finite_results<T>(where(comm_->rank(), "forward"),
                              {{"ht", ht.data, states_shape(ht)},
                               {"o", o, {s.batch, s.tokens, s.value_heads, s.value_dim}}},
                              inputs, exec_.pool);
  }
  Saved saved{std::move(transfers), std::move(incoming), stream, nullptr, nullptr};
  saved.kept<T>() = cache;
  return saved;
}

template <class T>
void ContextParallelLayer<T>::backward(const Inputs<T>& in, const Saved& saved,
                                       SequenceStates<const Elem<T>> h0, const Elem<T>* d_o,
                                       SequenceStates<const Elem<T>> dht,
                                       const Grads<Elem<T>>& grads, SequenceStates<Elem<T>> dh0) {
  const std::size_t rank = exchange_->rank();
  std::vector<Part> parts;
  std::vector<PartInfo> infos;
  Fingerprint fields = call_fields("backward (stream)", in, exec_.algorithm);
  if (saved.stream) add_stream(fields, *saved.stream);
  else fields.add_text("stream", "none (saved from the forward without one)");
  fields.add_flag("h0 given", h0.data != nullptr);
  fields.add_flag("dht given", dht.data != nullptr);
  fields.add_flag("dh0 requested", dh0.data != nullptr);
  agree_on("backward", fields, [&] {
    if (!saved.stream)
      throw InvalidArgument(
          "saved comes from the forward without a stream, expected the sequence forward's");
    check_inputs(in);
    parts = checked_parts(*saved.stream, in.shape, rank, exchange_->size(), part_owners_);
    require(d_o, "d_o");
    require(grads.dq, "dq");
    require(grads.dk, "dk");
    require(grads.dv, "dv");
    require(grads.dg, "dg");
    require(grads.dbeta, "dbeta");
    const Sequences& seqs = saved.stream->sequences;
    check_states(h0, seqs, in.shape, "h0");
    check_states(dht, seqs, in.shape, "dht");
    check_states(dh0, seqs, in.shape, "dh0");
    for (const Part& part : parts) infos.push_back(part_info(seqs, part));
  });
  const Stream& stream = *saved.stream;
  const Sequences& seqs = stream.sequences;
  const Shape& s = in.shape;
  auto t0 = std::chrono::steady_clock::now();
  std::vector<T> dht_sum;
  SequenceStates<const T> dht_total{};
  if (dht.data != nullptr) {
    dht_sum = summed_over_ranks(*comm_, dht);
    dht_total = dht;
    dht_total.data = dht_sum.data();
  }
  bwd_.exchange = since(t0);
  t0 = std::chrono::steady_clock::now();
  std::vector<State> gs;
  std::vector<PartSummary> summaries;
  for (std::size_t i = 0; i < parts.size(); ++i) {
    gs.emplace_back(s.batch, s.value_heads, s.key_dim, s.value_dim, dtype_of<T>());
    part_incoming_grad(in, seqs, parts[i], d_o, dht_total, gs.back().data<T>(), exec_);
  }
  for (std::size_t i = 0; i < parts.size(); ++i)
    summaries.push_back({gs[i].view(), saved.transfer[i].view(), PartFlags{infos[i].cut}});
  bwd_.local = bwd_.summary = since(t0);
  t0 = std::chrono::steady_clock::now();
  const std::vector<State> d_end = exchange_->backward(summaries);
  bwd_.exchange += since(t0);
  t0 = std::chrono::steady_clock::now();
  ForwardCache<Elem<T>>* kept = kept_of(saved);
  for (std::size_t i = 0; i < parts.size(); ++i) {
    // d_incoming is one state: that of the rank's first part.
    Grads<Elem<T>> part_grads = grads;
    if (i > 0) part_grads.d_incoming = nullptr;
    part_backward(in, seqs, parts[i],
                  infos[i].starts_sequence ? nullptr : saved.incoming[i].data<T>(), h0, d_o,
                  d_end[i].data<T>(), dht_total, part_grads, dh0, exec_, kDefaultCheckpointInterval,
                  kept);
  }
  bwd_.local += since(t0);
  if (dh0.data != nullptr) {
    t0 = std::chrono::steady_clock::now();
    share_rows(*comm_, dh0, rows_by_part(stream, false));
    bwd_.exchange += since(t0);
  }
  // After the dh0 broadcasts (see forward); dh0 first: every rank has it.
  if (check_finite_) {
    std::vector<Named<T>> outputs{{"dh0", dh0.data, states_shape(dh0)}};
    for (const Named<T>& g : grad_tensors(grads, s)) outputs.push_back(g);
    std::vector<Named<T>> inputs = input_tensors(in);
    inputs.push_back({"d_o", d_o, {s.batch, s.tokens, s.value_heads, s.value_dim}});
    inputs.push_back({"h0", h0.data, states_shape(h0)});
    inputs.push_back({"dht", dht.data, states_shape(dht)});
    require_finite_results<T>(where(comm_->rank(), "backward"), outputs, inputs, exec_.pool);
  }
}

template <class T>
LayerData<T> LayerData<T>::slice(TokenSplit range) const {
  LayerData<T> out;
  out.shape = shape;
  out.shape.tokens = range.count;
  const std::size_t b = shape.batch, t = shape.tokens;
  auto cut = [&](const std::vector<T>& full, std::size_t inner, std::vector<T>& local) {
    local.resize(b * range.count * inner);
    slice_tokens(full.data(), b, t, inner, range, local.data());
  };
  cut(q, shape.heads * shape.key_dim, out.q);
  cut(k, shape.heads * shape.key_dim, out.k);
  cut(v, shape.value_heads * shape.value_dim, out.v);
  cut(g, shape.value_heads * shape.key_dim, out.g);
  cut(beta, shape.value_heads, out.beta);
  return out;
}

template struct LayerData<float>;
template struct LayerData<double>;
template class ContextParallelLayer<float>;
template class ContextParallelLayer<double>;
template void slice_tokens<float>(const float*, std::size_t, std::size_t, std::size_t, TokenSplit, float*);
template void slice_tokens<double>(const double*, std::size_t, std::size_t, std::size_t, TokenSplit, double*);
template void unslice_tokens<float>(const float*, std::size_t, std::size_t, std::size_t, TokenSplit, float*);
template void unslice_tokens<double>(const double*, std::size_t, std::size_t, std::size_t, TokenSplit, double*);

}  // namespace kdacp::kda
