// The KDA layer as one object built from one config (docs/library.md):
//
//   LayerConfig config;                         // shapes, stream, strategy, names
//   config.shape = {B, T, H, HV, K, V};  config.cu_seqlens = {...};
//   auto layer = make_layer<float>(world, config);   // world null: one process
//   auto saved = layer->forward(in, h0, o, ht);       // this rank's tokens
//   layer->backward(in, saved, h0, d_o, dht, grads, dh0);
//
// The strategy (one process, state CP, Ulysses × state CP; the deterministic
// mode of either CP strategy) follows from the config and the communicator:
// callers never choose between layer classes. make_layer validates the config
// once, in the caller's terms (LayerNames: the CLI's flags, Python's
// keywords, user ranks, the stream's token positions), and agrees with every
// rank, in one fixed-size all-gather (kdacp/agreement.hpp), on everything
// that changes any rank's result or any message size, before the first
// message of the layer; every forward and backward agrees again on what a
// call can change. A rank that disagrees is named on every rank, which all
// throw InvalidArgument; none waits for a message that will not come.
#pragma once

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kdacp/agreement.hpp"
#include "kdacp/comm.hpp"
#include "kdacp/cost_model.hpp"
#include "kdacp/defaults.hpp"
#include "kdacp/exchange.hpp"
#include "kdacp/half.hpp"
#include "kdacp/kda.hpp"
#include "kdacp/kda_cp.hpp"
#include "kdacp/layout.hpp"

namespace kdacp {

class ThreadPool;

// How the caller's user spelled each setting. Every message of the config's
// validation and of the ranks' agreement names the setting this way.
struct LayerNames {
  std::string tokens = "T";
  std::string shape = "shape B,H,HV,K,V";
  std::string cu_seqlens = "cu_seqlens";
  std::string layout = "layout";
  std::string split = "split";
  std::string protocol = "protocol";
  std::string group_size = "allgather_group_size";
  std::string segments = "segments";
  std::string memory_budget = "memory_budget_bytes";
  std::string allow_reassociation = "allow_reassociation";
  std::string calibration = "calibration";
  std::string ulysses = "ulysses";
  std::string algorithm = "algorithm";
  std::string deterministic = "deterministic";
  std::string keep_forward = "keep_forward";
  std::string dtype = "dtype";
  std::string storage = "storage dtypes q,k,v,g,beta";
  std::string timeout = "timeout";
  std::string scale = "scale";
  std::string h0 = "initial_state";
  std::string ht = "output_final_state";
  std::string d_o = "d_o dtype";
  std::string dht = "dht";
  std::string dh0 = "dh0";
  std::string conv = "conv1d_kernel_size";
  // The transforms, agreed as one field shown as "l2,gate,A,dt,lb=-5,sig"
  // (q,k l2norm; the gate, with A_log, dt_bias, its lower bound; beta's
  // sigmoid; "none").
  std::string transforms = "in-kernel transforms";
  std::string gate = "use_gate_in_kernel";
  std::string lower_bound = "lower_bound";

  // kdacp.torch's keywords (the defaults above) and the CLI's flags.
  static LayerNames python() { return {}; }
  static LayerNames cli();
};

// flash-linear-attention's in-kernel input transforms (chunk_kda's flags;
// kdacp/kda.hpp's passes, applied to the raw inputs before the layer's
// kernels, their reverse modes after). Each changes every rank's result, so
// they are part of the config: validated and agreed with it.
struct InputTransforms {
  bool qk_l2norm = false;     // q, k <- x / sqrt(sum_K x^2 + 1e-6)
  bool gate = false;          // g from raw g, A_log and dt_bias (gate_forward)
  std::optional<double> lower_bound;  // the gate's sigmoid form: finite, < 0
  bool a_log = false;         // A_log given (else 0)
  bool dt_bias = false;       // dt_bias given (else 0)
  bool beta_sigmoid = false;  // beta <- sigmoid(beta)
  // flash-linear-attention's allow_neg_eigval: beta in [0, 2] (I - beta k k^T
  // may have eigenvalues down to -1); with beta_sigmoid beta <- 2 sigmoid(beta).
  bool allow_neg_eigval = false;
};

enum class LayoutKind { contiguous, zigzag };
// "contiguous" / "zigzag"; parse_layout_kind throws InvalidArgument naming
// `name` (the caller's spelling of the setting) otherwise.
const char* layout_kind_name(LayoutKind kind);
LayoutKind parse_layout_kind(const std::string& value, const std::string& name = "layout");

// Ulysses width chosen by the cost model (LayerConfig::ulysses).
inline constexpr std::size_t kLayerUlyssesAuto = 0;

// Everything a layer is built from. Every rank passes the same config (the
// agreement checks it); `threads` and `pool` are each rank's own.
struct LayerConfig {
  // B, H, HV, K, V of every call, and T: the whole stream's tokens (each
  // rank's inputs hold its own parts of them).
  kda::Shape shape;
  // The stream's packed sequences (B = 1): strictly increasing from 0 to T.
  // Empty: one sequence per batch row.
  std::vector<std::int64_t> cu_seqlens;
  LayoutKind layout = LayoutKind::contiguous;
  // Tokens per rank of a contiguous layout (P entries summing to T, none
  // zero). Empty: the first T mod P ranks ⌈T/P⌉, the others ⌊T/P⌋; with
  // zigzag empty or zigzag's own counts.
  std::vector<std::size_t> split;
  // Any other layout (its parts and owners, kdacp/layout.hpp) for callers
  // that build one: replaces `layout` and `split`; it must be for T tokens
  // on the communicator's P ranks.
  std::optional<Layout> parts;

  // Storage of q, k, v, g, beta (nullopt: the compute type T): 16-bit inputs
  // are widened by the caller; under Ulysses they travel the all-to-alls
  // in 16 bits, so they change message sizes and are agreed on. `out`: the
  // storage o and d_o are narrowed to (nullopt: T).
  std::array<std::optional<Half>, 5> storage{};
  std::optional<Half> out_storage;

  kda::Algorithm algorithm = defaults::kAlgorithm;
  bool deterministic = defaults::kDeterministic;
  bool keep_forward = defaults::kKeepForward;
  bool check_finite = true;
  // every_call: each forward and backward agrees on its call's arguments.
  // first_call: the first forward and the first backward that pass agree;
  // later calls run this rank's checks and send nothing (the caller holds
  // its calls to the first one's arguments: kdacp.torch's cp_context). The
  // construction always agrees.
  enum class CallAgreement { every_call, first_call };
  CallAgreement agree_calls = CallAgreement::every_call;

  // The state exchange: registry method (or "auto"), its group size, and
  // its options (segments, memory budget, reassociation, cost parameters;
  // the layer fills expected_shape and expected_cuts from the config).
  std::string protocol = "auto";
  long long group_size = 1;
  ExchangeOptions exchange;
  // Ulysses × state CP over head groups of U consecutive ranks (U divides
  // P, H and HV); 1: state CP alone; kLayerUlyssesAuto: the cost model's U
  // (protocol must be auto).
  std::size_t ulysses = 1;

  InputTransforms transforms;

  // Width of the short convolution that runs with the layer's layout (its
  // halo messages depend on it); nullopt: none. Agreed on, not run here.
  std::optional<std::size_t> conv_width;
  // The caller's own fields every rank must share (the CLI: a hash of its
  // input files' bytes, its seed).
  Fingerprint extra;
  LayerNames names;

  // This rank's pool (null: the calling thread), owned by the caller, alive
  // as long as the layer, used by one call at a time.
  ThreadPool* pool = nullptr;
};

// The layout `config` asks for over `ranks` ranks; InvalidArgument in the
// config's names (split not P entries, a zero, a sum other than T; zigzag
// with T < 2P or a split that is not zigzag's).
Layout make_layer_layout(const LayerConfig& config, std::size_t ranks);

// Checks `config` for `ranks` ranks (everything but the communicator):
// shapes, cu_seqlens, split and layout, protocol and its group size,
// Ulysses' width, the deterministic mode's chunk rule, the input transforms
// (lower_bound, A_log and dt_bias need the gate; lower_bound finite, < 0). Throws
// InvalidArgument naming the setting as config.names spells it.
void validate_layer_config(const LayerConfig& config, std::size_t ranks);

// A context's checks, before the calls' shapes are known (kdacp.torch's
// build_cp_context): config.shape.tokens (T) and cu_seqlens, layout and
// split, protocol and group size, the Ulysses width against P alone. Returns
// the layout; InvalidArgument in config.names' terms.
Layout validate_layer_context(const LayerConfig& config, std::size_t ranks);

// Collective over `world` (null: one process): validate_layer_context, then
// one agreement of the context's fields (T, cu_seqlens, layout, split, the
// exchange's settings, Ulysses width, convolution width, the timeout, and
// config.extra), with `local_error` (this rank's own argument error found
// before the call) shared, so that every rank raises the same
// InvalidArgument naming what differs and none waits for another. `what`
// names the call in the message. Returns the layout.
Layout agree_layer_context(const std::shared_ptr<Communicator>& world, const LayerConfig& config,
                           const std::string& what, const std::string& local_error = {});

// A call whose layout follows from the tokens each rank holds (kdacp.torch's
// kda(group=...): each rank passes its own part). config.shape.tokens is
// this rank's token count and config.split is ignored. Collective over
// `world` (null: one process): one agreement of everything in the config
// that must match (shape but T, dtype as `dtype`, storage, algorithm,
// deterministic, keep_forward, cu_seqlens, layout, the exchange's settings
// and the caller's expected_shape / expected_cuts, Ulysses, convolution,
// timeout, config.extra) and the call's own fields `call` (scale, which
// states are given), gathering each rank's token count in the same record;
// `local_error` as in agree_layer_context. Returns the config with T the
// sum and split the counts, for make_layer (whose layout check then names
// counts that zigzag does not hold, the same message on every rank).
LayerConfig agree_layer_call(const std::shared_ptr<Communicator>& world, LayerConfig config, const char* dtype,
                             const Fingerprint& call, const std::string& what, const std::string& local_error = {});

// The state exchange's settings alone (protocol, group size, segments,
// memory budget, reassociation, calibration, expected_shape, expected_cuts)
// and `timeout`, in config.names' terms: what the ranks of a bare exchange
// (kdacp.torch's build_kda_state_cp) agree on.
Fingerprint exchange_fingerprint(const LayerConfig& config, std::chrono::milliseconds timeout);

// The fields make_layer agrees on, named as config.names spells them.
Fingerprint layer_fingerprint(const LayerConfig& config, std::size_t ranks, std::size_t ulysses_width);

// The summary shape of the layer's state exchange: [B, HV, K, V].
SummaryShape layer_summary_shape(const kda::Shape& s);

// What the cost model knows of the layer's exchange on `layout`: P, B·HV, K,
// V, elem_bytes, part_owners = layout.owners() and part_cuts = `cuts` (the
// expected_cuts layer_exchange_options hands auto; empty: none).
ProblemShape layer_problem_shape(const kda::Shape& s, std::size_t elem_bytes, const Layout& layout,
                                 const std::vector<bool>& cuts = {});

// The exchange options the layer of `s` in `dtype` on `layout` runs `seqs`
// with: `given`, its expected_shape (unset: [B, HV, K, V] in dtype) and its
// expected_cuts (unset: layout.cuts(seqs)) filled in, so that auto and
// pipelined_p2p's segments weigh the stream's cuts.
ExchangeOptions layer_exchange_options(const ExchangeOptions& given, const kda::Shape& s, DType dtype,
                                       const Layout& layout, const kda::Sequences& seqs);

// The cost model's Ulysses width for the layer of `s` on `layout` with `eo`
// (layer_exchange_options' result) and activations of elem_bytes:
// best_ulysses over the U dividing P and H (predict_ulysses, each U's
// exchange auto's choice on the head groups' layout with HV/U heads; islands
// of eo.cost.node_ranks ranks, else UlyssesOptions' default). Every rank
// computes the same U from the same arguments.
std::size_t choose_ulysses(const kda::Shape& s, const Layout& layout, const ExchangeOptions& eo,
                           std::size_t elem_bytes);

// Bytes per element the Ulysses all-to-alls move for q, k, v, g, beta
// (16-bit storage travels as 16 bits, the rest as compute_bytes): their
// mean over a token's elements, rounded up. It prices ulysses auto.
std::size_t layer_activation_bytes(const LayerConfig& config, std::size_t compute_bytes);

// What forward returns for its backward; opaque.
struct LayerSaved;

// The state entering each of this rank's parts, in chain order ([B,HV,K,V]
// each, in the layer's element type), as the forward's exchange delivered
// it; a part whose first token starts a sequence does not read its own.
// Empty for one process; InvalidArgument under Ulysses (its parts are head
// groups' and hold no such state).
const std::vector<State>& incoming_states(const LayerSaved& saved);

// Lets the forward cache `saved` holds go (after its first backward): the
// layer's pool hands it to the next forward; a second backward of `saved`
// recomputes what it held, the same bits.
void release_forward_cache(LayerSaved& saved);

// Which states a call is given or asked for (per call: the one-process
// and the CP strategies alike).
template <class T>
struct LayerStates {
  kda::SequenceStates<const T> h0;  // data null: zero
  kda::SequenceStates<T> ht;        // data null: not produced
};

template <class T>
class Layer {
 public:
  virtual ~Layer() = default;

  // This rank's tokens of the config's stream: in [B,T_local,...] with
  // T_local = layout().local_tokens(rank()), o [B,T_local,HV,V]; h0
  // [N,HV,K,V] the same on every rank; ht, when asked for on every rank,
  // receives the final states, the same bits on every rank. Agrees first
  // on the call's arguments (scale, which states are given).
  virtual std::shared_ptr<LayerSaved> forward(const kda::Inputs<T>& in, kda::SequenceStates<const T> h0, T* o,
                                              kda::SequenceStates<T> ht) = 0;
  // The gradients of that forward; dht (given on every rank or none) is
  // summed over ranks; dh0, when asked for, is the same bits on every rank.
  virtual void backward(const kda::Inputs<T>& in, const LayerSaved& saved, kda::SequenceStates<const T> h0,
                        const T* d_o, kda::SequenceStates<const T> dht, const kda::Grads<T>& grads,
                        kda::SequenceStates<T> dh0) = 0;

  const LayerConfig& config() const { return config_; }
  const Layout& layout() const { return layout_; }
  const kda::Sequences& sequences() const { return stream_.sequences; }
  const kda::Stream& stream() const { return stream_; }
  std::size_t rank() const { return rank_; }
  std::size_t ranks() const { return layout_.ranks(); }
  // This rank's inputs' shape: the config's with T = its tokens.
  kda::Shape local_shape() const;

  // The state exchange (null on one process), the Ulysses width (1 without).
  virtual const StateExchange* exchange() const = 0;
  virtual std::size_t ulysses_width() const { return 1; }
  // "none" on one process.
  std::string method() const;
  bool exact() const;
  virtual const kda::PhaseTimes& forward_times() const = 0;
  virtual const kda::PhaseTimes& backward_times() const = 0;
  // Bytes of the forward caches the layer holds (in use or for reuse).
  virtual std::size_t forward_cache_bytes() const = 0;
  // Ulysses: how q, k, v, g, beta, then o (forward) or d_o (backward)
  // travel its all-to-alls (nullopt: as T); empty without Ulysses.
  virtual std::vector<std::optional<Half>> wire_types() const { return {}; }

 protected:
  Layer(LayerConfig config, Layout layout, std::size_t rank);
  LayerConfig config_;
  Layout layout_;
  kda::Stream stream_;
  std::size_t rank_ = 0;
};

// The layer of `config` on `world`'s ranks in order (null or a world of one
// rank with no CP: one process, the whole stream local). Collective over
// world: validates (every rank's own error shared in the agreement), agrees
// on layer_fingerprint, then builds the strategy. T: float or double (16-bit
// storage is widened by the caller, config.storage says from what).
template <class T>
std::unique_ptr<Layer<T>> make_layer(const std::shared_ptr<Communicator>& world, const LayerConfig& config);

}  // namespace kdacp
