// Runs the context-parallel KDA layer over a whole job — packed sequences,
// initial and final states, any layout (SPEC §10) — on any Communicator
// (in-process ranks or one process per rank) and collects outputs and
// gradients in the global layout, to compare it with one device or another
// implementation (`kdacp run`, `kdacp kda`). The job module of the core
// library (src/job/): no MPI, no torch.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "kdacp/comm.hpp"
#include "kdacp/cost_model.hpp"
#include "kdacp/defaults.hpp"
#include "kdacp/half.hpp"
#include "kdacp/kda_cp.hpp"
#include "kdacp/layer.hpp"

namespace kdacp::job {

// The layer's plan (kdacp/layer.hpp), under the job's names too.
using kdacp::choose_ulysses;
using kdacp::layer_exchange_options;
using kdacp::layer_problem_shape;
using kdacp::layer_summary_shape;

// The layout the CLI's --layout and --split ask for, built in one call:
// Layout::zigzag for `zigzag`, else Layout::contiguous(tokens, ranks,
// counts) (counts empty: the first T mod P ranks take ⌈T/P⌉, the others
// ⌊T/P⌋). Throws Layout's InvalidArgument (counts not P entries, a zero, a
// sum other than T; zigzag with T < 2P), and for counts given with zigzag.
kda::Layout make_layout(bool zigzag, std::span<const std::size_t> counts, std::size_t tokens, std::size_t ranks);

// A layer job: the whole stream's inputs and what to compute. Every process
// holds the whole job (read or generated from a seed) and takes its parts.
template <class T>
struct LayerJob {
  kda::LayerData<T> data;  // [B,T,...]
  T scale = 0;
  std::vector<std::int64_t> cu_seqlens;  // empty: each row one sequence (N = B)
  std::vector<T> h0;                     // [N,HV,K,V]; empty: zero
  std::vector<T> d_o;                    // [B,T,HV,V]; empty: forward only
  std::vector<T> dht;                    // [N,HV,K,V]; empty: zero
  // Produce ht (and, with d_o, dh0).
  bool final_states = true;
  // How the layer computes (kda::Exec::algorithm), on one device and on
  // every rank alike.
  kda::Algorithm algorithm = defaults::kAlgorithm;
  // With chunk: the forward keeps what the backward recomputes
  // (kda::ForwardCache; ContextParallelLayer::keep_forward), for a faster
  // backward at ≈ 1.25× the inputs' memory (layer_cache_bytes).
  bool keep_forward = defaults::kKeepForward;
  // The CP layer's deterministic mode (LayerConfig::deterministic,
  // docs/determinism.md): outputs the same bytes for every P and layout.
  bool deterministic = defaults::kDeterministic;
  // Untimed forward+backward steps before the timed one, on the same layer
  // and buffers (a training loop's steady state: no fresh pages, the
  // forward cache reused); the outputs are the same bits either way.
  std::size_t warmup_steps = 0;
  // The 16-bit type q, k, v, g, beta and d_o are stored in (their values
  // are its widening; o and the gradients will be narrowed to it), as
  // `kdacp kda` reads float16 files; nullopt: as computed. With Ulysses
  // (LayerRunOptions::ulysses > 1, T = float) the all-to-alls move them in
  // it (kda::UlyssesLayer::wire_types); the results are the same bits.
  std::optional<Half> storage;

  // Checks B = 1 with cu_seqlens and the rules of kda::Sequences, and the
  // sizes of h0, d_o and dht; throws InvalidArgument naming the array.
  kda::Sequences sequences() const;
  // N·HV·K·V.
  std::size_t state_elems() const;
  bool grads() const { return !d_o.empty(); }
};

// Where one rank's forward+backward went (`kdacp bench layer --phases`): the
// five phases sum to that rank's forward_seconds + backward_seconds. On one
// rank only forward and backward are non-zero.
struct LayerPhases {
  double summary = 0;        // the chunk summary before the forward's exchange (CP)
  double incoming_grad = 0;  // the G pass before the backward's exchange (CP)
  double exchange = 0;       // the state exchanges and the dht / ht / dh0 collectives, forward + backward
  double forward = 0;        // the rest of the forward: its walk over the chunks, checks and agreement
  double backward = 0;       // the rest of the backward
  std::size_t rank = 0;      // the rank they are of
  double total() const { return summary + incoming_grad + exchange + forward + backward; }
};

template <class T>
struct LayerOutputs {
  std::vector<T> o, dq, dk, dv, dg, dbeta;
  std::vector<T> ht, dh0;                            // [N,HV,K,V] when the job asks for them
  double forward_seconds = 0, backward_seconds = 0;  // slowest rank
  double exchange_seconds = 0;                       // slowest rank, forward + backward
  double summary_seconds = 0;  // slowest rank, the summary + the G pass (PhaseTimes::summary; CP only)
  LayerPhases phases;          // of the rank with the largest forward + backward
  std::string method;
  std::string backend = "single";
  std::size_t ranks = 1;
  std::size_t ulysses = 1;  // the head groups' width U (LayerRunOptions::ulysses); 1: plain state CP
  bool exact = true;  // the protocol performs the chain's operations (SPEC §5)
};

// Zeroed outputs of `job`: o, and the gradients with d_o; ht (and dh0 with
// d_o) when job.final_states.
template <class T>
LayerOutputs<T> allocate_outputs(const LayerJob<T>& job);

// One device: the whole stream on this process with `threads` threads
// (make_layer with no world: the one-process strategy of layer_config(job, {})).
template <class T>
LayerOutputs<T> run_single(const LayerJob<T>& job, std::size_t threads);

// What runs on every rank.
struct LayerRunOptions {
  std::string method = "auto";
  long long group_size = 1;
  std::size_t threads_per_rank = 1;
  ExchangeOptions exchange;  // expected_shape defaults to the job's summary shape
  // The layout of the job's T on the world's P: `layout_kind` with `split`
  // (LayerConfig's), or any other `layout` (replaces both).
  LayoutKind layout_kind = LayoutKind::contiguous;
  std::vector<std::size_t> split;
  std::optional<kda::Layout> layout;
  // How the messages name each setting (the CLI's flags by default).
  LayerNames names = LayerNames::cli();
  // Ulysses × state CP (kda::UlyssesLayer): head groups of U consecutive
  // ranks, the state exchange over P/U; U must divide P, H and HV. 1: the
  // context-parallel layer alone; kUlyssesAuto: the cost model's U
  // (choose_ulysses; needs method auto).
  std::size_t ulysses = 1;
  // Fields every rank must share beyond the layer's own (kda::LayerChecks::
  // agree): where each process reads or generates the whole job, a hash of
  // its input files or its seed.
  Fingerprint agree;
};

// The layer's config (kdacp/layer.hpp) of `job` run with `options`: the
// one every strategy is built from (make_layer), and the one the admission
// and compare_protocols read the layout of (make_layer_layout).
template <class T>
LayerConfig layer_config(const LayerJob<T>& job, const LayerRunOptions& options);

// Collective over `world` (P = world->size(), its ranks in order the CP
// ranks): every rank builds the layer for options.layout with
// make_state_exchange(mesh, method, group_size, exchange) and its own pool of
// threads_per_rank threads, takes its parts of the job, runs forward (and
// backward with d_o) with job.algorithm. Rank r's dht is the job's dht on
// rank 0 and zero on the others, so the gradient of ht the layer sums over
// ranks is the job's dht exactly. Every rank sends its local outputs to rank
// 0, which returns them in the global layout; the other ranks return
// nullopt. Times are the
// slowest rank's. Throws what the layer throws (before any message for bad
// inputs) and, for a layout that is not the job's T and P, InvalidArgument.
// A rank whose tokens are one range of the stream (B = 1 with a contiguous
// layout, or one rank) reads the job's arrays in place, without a copy, and
// rank 0 writes its outputs into the whole ones in place.
// `shared`: for ranks that are threads of one process (in-process), the
// job's whole outputs (allocate_outputs(job)), one object for all ranks,
// owned by the caller and alive until every rank has returned (past the
// world's join, even when a rank fails). Every rank then writes its tokens
// there (in place where they are one range, else copied in after the run)
// and nothing is sent: the run holds the outputs once, not twice. Rank 0
// stores ht, dh0, the times and the method there too, after a barrier that
// every rank's writes precede; every rank returns nullopt.
template <class T>
std::optional<LayerOutputs<T>> run_context_parallel(const std::shared_ptr<Communicator>& world,
                                                    const LayerJob<T>& job, const LayerRunOptions& options,
                                                    LayerOutputs<T>* shared = nullptr);

// The same on `ranks` in-process ranks, writing into one whole outputs
// (`shared` above); a rank that waits longer than timeout_s for a peer fails
// the run; the first error is rethrown.
template <class T>
LayerOutputs<T> run_context_parallel(const LayerJob<T>& job, std::size_t ranks, const LayerRunOptions& options,
                                     double timeout_s);



// Bytes of o and, with grads, of the gradients (as large as the inputs
// q, k, v, g, beta) of `s` in T of elem_bytes.
double layer_output_bytes(const kda::Shape& s, bool grads, std::size_t elem_bytes);

// Whether every rank of `layout` holds its tokens of `s` as one range of the
// stream that run_context_parallel reads and writes in place (B = 1 with
// every rank's parts in stream order and adjacent, e.g. the contiguous
// layout; or one rank): no rank then copies inputs or outputs.
bool layer_in_place(const kda::Shape& s, const kda::Layout& layout);

// Bytes run_context_parallel allocates for `s` with N = `sequences` on
// `ranks` ranks with T of elem_bytes: the ranks' slices, the outputs
// (gradients too when `grads`), h0, dht, ht and dh0 [N,HV,K,V] per rank, the
// checkpoints and the summaries, and rank_exchange_bytes per rank for its
// exchange (exchange_rank_bytes in kdacp/admission.hpp). `parts`: the
// layout's parts (each holds its S, M, incoming state and G); 0: one per
// rank. `in_place`: in-process ranks that share the whole outputs on a
// layout where layer_in_place holds, which hold no slices (the outputs are
// counted once). The job itself is not counted.
double layer_run_bytes(const kda::Shape& s, std::size_t sequences, std::size_t ranks, bool grads,
                       std::size_t elem_bytes, double rank_exchange_bytes, std::size_t parts = 0,
                       bool in_place = false);

// The share of one process holding one rank of run_context_parallel on
// `layout` (under a launcher, one rank per process): the largest rank's
// slices of inputs and outputs, rank 0's outputs gathered in the global
// layout, the checkpoints and summaries of its parts, its h0, dht, ht and dh0
// [N,HV,K,V], and rank_exchange_bytes for its exchange. The job itself is
// not counted.
double layer_rank_bytes(const kda::Shape& s, std::size_t sequences, const kda::Layout& layout, bool grads,
                        std::size_t elem_bytes, double rank_exchange_bytes);

// LayerRunOptions::ulysses: the cost model picks U.
inline constexpr std::size_t kUlyssesAuto = 0;


// `given` (LayerRunOptions::ulysses) resolved: choose_ulysses for
// kUlyssesAuto (InvalidArgument unless `method` is auto), else `given`.
std::size_t resolve_ulysses(std::size_t given, const std::string& method, const kda::Shape& s,
                            const kda::Layout& layout, const ExchangeOptions& eo, std::size_t elem_bytes);

// Throws InvalidArgument unless the Ulysses width U (LayerRunOptions::
// ulysses) is at least 1 and divides P, H and HV ("Ulysses width U = 3:
// expected a divisor of P = 4, H = 2 and HV = 2").
void check_ulysses(std::size_t width, std::size_t ranks, const kda::Shape& s);

// Bytes one rank of kda::UlyssesLayer (width U over `layout`) holds beyond
// the state-CP layer's own: the head slice of its group's inputs kept for
// the backward and their gradients, the o and d_o slices, the all-to-alls'
// send and receive buffers and the head group's state slots. The largest
// rank's (a bound on every rank's).
double ulysses_rank_bytes(const kda::Shape& s, std::size_t sequences, const kda::Layout& layout, std::size_t width,
                          bool grads, std::size_t elem_bytes);

// Bytes of the forward caches (kda::ForwardCache) a keep_forward job holds
// for `tokens` tokens of `s` cut into at most `pieces` sequence pieces: at
// most B·HV·(⌈tokens/C⌉·K·V + 2·C·tokens + 2·tokens·V) elements however
// many pieces (a record is sized by its piece's tokens; `pieces` no longer
// changes the bound). 0 for the recurrent algorithm.
double layer_cache_bytes(const kda::Shape& s, kda::Algorithm algorithm, std::size_t tokens, std::size_t pieces,
                         std::size_t elem_bytes);

// What the chunk backward reads besides its inputs, for `tokens` tokens of
// `s` cut into at most `pieces` pieces on `threads` threads: with
// keep_forward the forward's caches (layer_cache_bytes); without them the
// records it recomputes into per-thread scratch instead (the same layout,
// one per (row, value head) in flight: min(threads, B·HV) of the B·HV). 0
// for the recurrent algorithm (its checkpoints are layer_run_bytes').
double layer_backward_records_bytes(const kda::Shape& s, kda::Algorithm algorithm, std::size_t tokens,
                                    std::size_t pieces, std::size_t elem_bytes, bool keep_forward,
                                    std::size_t threads);

// Relative Frobenius errors (reference::relative_error) of `got` against
// `want`: o, dq, dk, dv, dg, dbeta, then ht and dh0 when both have them.
std::vector<double> relative_errors(const LayerOutputs<float>& got, const LayerOutputs<float>& want);

// Names of relative_errors' entries, in order: o, dq, dk, dv, dg, dbeta, ht, dh0.
inline const std::vector<std::string> kLayerErrorNames{"o", "dq", "dk", "dv", "dg", "dbeta", "ht", "dh0"};

// What two float32 runs of the layer on the same inputs may differ by,
// relative Frobenius per output (README: the algorithms and the ranks agree
// within 5e-5 in float32).
inline constexpr double kLayerFloat32Tolerance = 5e-5;

// The tolerance of a float32 run with the state exchange `method` (as
// LayerOutputs::method names it) on `ranks` ranks against one device:
// kLayerFloat32Tolerance plus the method's documented bound (error_bound in
// kdacp/protocol.hpp; 0 for exact protocols and "none").
double layer_error_tolerance(const std::string& method, std::size_t ranks, std::size_t key_dim);

// The entries of `errors` (relative_errors' order, kLayerErrorNames) that
// are NaN or above `tolerance`, as "dg 1.9e+00" / "dq nan"; empty when all
// are within it.
std::vector<std::string> errors_above(const std::vector<double>& errors, double tolerance);

// Whether o, every gradient, ht and dh0 are bitwise equal.
bool same_bits(const LayerOutputs<float>& a, const LayerOutputs<float>& b);


// Progress lines "<prefix>: <what> (<t> s elapsed)" on stderr, only once
// more than `quiet_seconds` have passed since construction, so that a short
// run prints none.
class Progress {
 public:
  explicit Progress(std::string prefix, double quiet_seconds = 2.0);
  void note(const std::string& what) const;

 private:
  std::string prefix_;
  double quiet_seconds_;
  std::chrono::steady_clock::time_point t0_ = std::chrono::steady_clock::now();
};

// One protocol's row in compare_protocols.
struct ProtocolRun {
  LayerOutputs<float> out;
  long long group_size = 1;
  std::string label;             // the method, with " w=<group size>" when it takes one
  std::optional<bool> bitwise;   // exact protocols that ran: same_bits with the first exact run
  std::string skipped;           // why it did not run ("" when it ran)
};

struct ProtocolComparison {
  std::vector<ProtocolRun> runs;  // in registry order
  bool all_bitwise = true;        // every exact run's `bitwise`
};

// The layer, forward and backward (the job must have d_o), with every
// protocol of the registry but auto, collective over `world`
// (run_context_parallel). With base.ulysses = U (a width, not auto) every
// run is the Ulysses layer and the exchange runs over P' = P/U ranks on the
// head groups' layout (P' = P without). A protocol that takes a group size
// runs at w = P'/2, and only when that is a proper divisor of P' (even
// P' >= 4). When that layout has several parts on a rank or parts out of
// rank order, a protocol whose registry row does not take layouts is listed
// with `skipped` set and not run. progress.note("running <method>") precedes each run. Rank 0 returns
// the comparison, the others nullopt.
std::optional<ProtocolComparison> compare_protocols(const std::shared_ptr<Communicator>& world,
                                                    const LayerJob<float>& job, const LayerRunOptions& base,
                                                    const Progress& progress);

// Bytes run_single and compare_protocols allocate for float `shape` with N
// = `sequences` on the ranks of `layout` beside the job:
// every run's outputs and gradients, kept for the comparison, and one
// context-parallel run at a time with the hungriest protocol of the cost
// model among those that run on the layout (its part_owners priced). With
// one_rank_per_process (a launcher's processes, P of them) the bytes of one
// process: the job it holds, rank 0's kept outputs, and one rank's share of
// a run (layer_rank_bytes) instead of all P ranks'.
// keep_forward: the jobs keep their chunk forward (LayerJob::keep_forward),
// whose caches (layer_cache_bytes) are counted too. ulysses (LayerRunOptions::
// ulysses): the Ulysses layer's buffers (ulysses_rank_bytes) per rank, for
// kUlyssesAuto those of the width that needs most.
double compare_protocols_bytes(const kda::Shape& shape, std::size_t sequences, const kda::Layout& layout,
                               bool one_rank_per_process = false,
                               bool keep_forward = defaults::kKeepForward, std::size_t ulysses = 1);

}  // namespace kdacp::job
