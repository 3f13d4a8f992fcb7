// Kimi Delta Attention on the CPU (SPEC §9): chunk summaries, the forward
// from an incoming state, and its exact reverse-mode gradients.
//
// Per batch b, value head j and token t (α_t = exp g_t, q/k from head j / (HV/H)):
//
//     S_t = (I - β_t k_t k_tᵀ) Diag(α_t) S_{t-1} + β_t k_t v_tᵀ,   o_t = scale · S_tᵀ q_t
//
// the recurrence of flash-linear-attention's `naive_recurrent_kda`. Layouts are
// theirs, contiguous and row-major: q, k [B,T,H,K]; v, o [B,T,HV,V];
// g [B,T,HV,K]; beta [B,T,HV]; states and their gradients [B,HV,K,V]; chunk
// transfers M [B,HV,K,K].
//
// Every function is instantiated for float and double and accumulates in T
// (FP32 for the float path). Work is split over the B·HV (batch, value head)
// pairs on `exec.pool` (none: the calling thread); each pair is computed by
// one thread with the same code, so results are bitwise independent of the
// pool's size. The kernels are chosen once per process for the CPU and agree
// bit for bit on every instruction set, so `exec.kernel` does not apply.
// Outputs must not overlap inputs. Bad shapes or a non-finite scale throw
// InvalidArgument before anything is written.
#pragma once

#include <cstddef>
#include <memory>
#include <new>
#include <type_traits>
#include <vector>

#include "kdacp/half.hpp"
#include "kdacp/kernels.hpp"
#include "kdacp/layout.hpp"

namespace kdacp::kda {

struct Shape {
  std::size_t batch = 0;        // B
  std::size_t tokens = 0;       // T
  std::size_t heads = 0;        // H: query/key heads
  std::size_t value_heads = 0;  // HV: a multiple of H
  std::size_t key_dim = 0;      // K
  std::size_t value_dim = 0;    // V

  // Value heads per query/key head.
  std::size_t group() const { return value_heads / heads; }
  std::size_t state_elems() const { return batch * value_heads * key_dim * value_dim; }
  std::size_t transfer_elems() const { return batch * value_heads * key_dim * key_dim; }
  std::size_t qk_elems() const { return batch * tokens * heads * key_dim; }
  std::size_t v_elems() const { return batch * tokens * value_heads * value_dim; }
  std::size_t g_elems() const { return batch * tokens * value_heads * key_dim; }
  std::size_t beta_elems() const { return batch * tokens * value_heads; }
};

// The stream's sequences and parts are the layout module's (layout.hpp);
// terms (stream, part, piece, cut): docs/sequences.md.
using kdacp::Part;
using kdacp::part_info;
using kdacp::PartInfo;
using kdacp::SequenceRange;
using kdacp::Sequences;

// Per-sequence states h0, ht, dh0, dht of a stream (ContextParallelLayer's
// stream calls): dense [N,HV,K,V] at `data`, or absent (data == nullptr: h0
// and dht are then zero, ht and dh0 not produced). The dims are checked
// against the sequences and the inputs' shape.
template <class T>
struct SequenceStates {
  T* data = nullptr;
  std::size_t sequences = 0, value_heads = 0, key_dim = 0, value_dim = 0;

  operator SequenceStates<const T>() const
    requires(!std::is_const_v<T>)
  {
    return {data, sequences, value_heads, key_dim, value_dim};
  }
};

// `data` viewed as the [N,HV,K,V] states of `seqs` for inputs of `shape`.
template <class T>
SequenceStates<T> sequence_states(T* data, const Sequences& seqs, const Shape& shape) {
  return {data, seqs.count(), shape.value_heads, shape.key_dim, shape.value_dim};
}

// Throws InvalidArgument unless B, T, H, HV, K, V are all ≥ 1 and H divides HV.
void validate(const Shape& shape);

// The element type of a tensor argument. Only Inputs<T> deduces T, so
// nullptr may be passed for any optional tensor.
template <class T>
using Elem = std::type_identity_t<T>;

// 1/√K, the scale flash-linear-attention uses when none is given.
template <class T>
T default_scale(std::size_t key_dim);

// How the functions below compute: where (the Exec's pool and
// kernels) and with which Algorithm (kdacp/defaults.hpp).
// explicit: a function that takes an ExecPolicy and hands it on would
// otherwise drop the algorithm silently.
struct Exec : ExecPolicy {
  Exec() = default;
  explicit Exec(const ExecPolicy& where, Algorithm how = defaults::kAlgorithm) : ExecPolicy(where), algorithm(how) {}
  Algorithm algorithm = defaults::kAlgorithm;
};

// Tokens per chunk of Algorithm::chunk (the last chunk of a call may be
// shorter). Part of the results' definition: it fixes the rounding.
inline constexpr std::size_t kChunkSize = 64;

// "recurrent" / "chunk".
const char* algorithm_name(Algorithm algorithm);
// Parses algorithm_name's spelling; throws InvalidArgument otherwise.
Algorithm parse_algorithm(const char* name);

// The inputs among q, k, v, g, beta stored as 16-bit (T = float only). The
// chunk kernels (Algorithm::chunk) read such a field from its bits, widening
// each value exactly as they load a chunk's rows: the same float32 values,
// hence the same results bit for bit, as a widened copy, without the copy.
// A field given here has a null T pointer in Inputs. Algorithm::recurrent
// and the Ulysses layer read T only (they throw InvalidArgument).
struct HalfInputs {
  HalfField q, k, v, g, beta;
  bool any() const { return q.bits || k.bits || v.bits || g.bits || beta.bits; }
};

// One chunk of a layer's inputs (non-owning; every pointer is required,
// unless `half` holds that field).
template <class T>
struct Inputs {
  const T* q = nullptr;
  const T* k = nullptr;
  const T* v = nullptr;
  const T* g = nullptr;  // log-decay, α = exp(g); g ≤ 0 keeps the recurrence contractive
  const T* beta = nullptr;
  Shape shape{};

  T scale = 0;  // must be finite and positive; see default_scale

  HalfInputs half{};  // 16-bit fields (their T pointers null); T = float only
};

// Throws InvalidArgument (naming `op`, the calling function) unless
// validate(in.shape) holds, every tensor pointer is set and the scale is
// finite and > 0. Every function below checks its inputs with it.
template <class T>
void validate(const Inputs<T>& in, const char* op);

// The chunk's summary: `state` [B,HV,K,V] = the final state started from zero,
// `transfer` [B,HV,K,K] = M = Π_t (I - β_t k_t k_tᵀ) Diag(α_t), later tokens on
// the left, so that forward(h).final == M·h + state for every incoming h.
// O(T·K·(K+V)) per value head.
template <class T>
void chunk_summary(const Inputs<T>& in, Elem<T>* state, Elem<T>* transfer,
                   const Exec& exec = {});

// What Algorithm::chunk's forward can keep for the backward of the same call
// (same inputs, same incoming state), so that the backward skips its first
// pass over the chunks (recomputing the state entering every chunk, R, Δ, L
// and P: a quarter of its time at K = V = 128); the gradients are bitwise
// the same. Memory for a record: B·HV·((⌈T/C⌉ - 1)·K·V + 2·Σ_i c_i² + 2·T·V)
// elements, C = kChunkSize, c_i the tokens of chunk i (C for all but the
// last) (record_elems); the state entering the first chunk is the incoming
// state, which backward is given, and is not kept. Algorithm::recurrent
// keeps nothing.
// forward appends one record per call; backward takes the records in the
// order they were appended (a layer over several parts or sequence pieces
// runs its backward calls in its forward's order); rewind() lets a second
// backward read them again. One call at a time.
template <class T>
class ForwardCache {
 public:
  // Elements of one forward's record on `shape` with `algorithm`.
  static std::size_t record_elems(const Shape& shape, Algorithm algorithm);

  std::size_t records() const { return used_; }
  // Bytes held (records in use and buffers kept for reuse).
  std::size_t bytes() const;
  // Forgets the records but keeps their buffers: the next forward of the
  // same shape reuses them (no fresh pages to fault in, which cost as much
  // as the pass the record saves). release() frees them.
  void clear() {
    used_ = 0;
    next_ = 0;
  }
  void release();
  void rewind() { next_ = 0; }
  // The next take() reads record `record` (<= records(); the layer's
  // deterministic backward runs its parts in reverse).
  void seek(std::size_t record);

  // kda::forward's and kda::backward's side (any caller may pass a cache
  // through; these two are what they call).
  T* append(std::size_t elems);
  // The next record, which must have `elems` elements; InvalidArgument
  // naming `op` otherwise (no record left, or one of another call's size).
  const T* take(std::size_t elems, const char* op);

 private:
  // A record's storage: from 2 MiB on it starts on a huge page boundary
  // (append), so that every 2 MiB of it, its first included, can be one huge
  // page; a 4 KiB-aligned start left up to 511 small pages to fault in.
  struct Free {
    std::size_t align = alignof(T);
    void operator()(T* p) const noexcept { ::operator delete(p, std::align_val_t{align}); }
  };
  struct Record {
    std::unique_ptr<T[], Free> data;
    std::size_t elems = 0, capacity = 0;
  };
  std::vector<Record> records_;  // [0, used_) in use
  std::size_t used_ = 0, next_ = 0;
};

// Forward caches for reuse across calls: acquire() hands out one that nobody
// else holds any more (use_count 1: its Saved is gone or let it go), cleared
// with its buffers kept, else a new one. A training loop then faults the
// record's pages in once, not every step; with several forwards in flight
// (gradient accumulation) it holds one cache per forward not yet backed.
// One caller at a time.
template <class T>
class ForwardCachePool {
 public:
  std::shared_ptr<ForwardCache<T>> acquire();
  // Bytes held by every cache of the pool, in use or not.
  std::size_t bytes() const;
  std::size_t caches() const { return caches_.size(); }

 private:
  std::vector<std::shared_ptr<ForwardCache<T>>> caches_;
};

// Runs the recurrence from `incoming` [B,HV,K,V] (nullptr: the zero state),
// writing o [B,T,HV,V] and, when `final_state` is not null, S_T [B,HV,K,V].
// `keep` (optional): receives this call's record for its backward (see
// ForwardCache; nothing with Algorithm::recurrent). o and S_T are the same.
template <class T>
void forward(const Inputs<T>& in, const Elem<T>* incoming, Elem<T>* o, Elem<T>* final_state,
             const Exec& exec = {}, ForwardCache<Elem<T>>* keep = nullptr);

// Gradients of a loss L(o, S_T), in the layouts of the matching inputs.
// Every pointer is required except d_incoming (skipped when null).
template <class T>
struct Grads {
  T* dq = nullptr;
  T* dk = nullptr;
  T* dv = nullptr;
  T* dg = nullptr;
  T* dbeta = nullptr;
  T* d_incoming = nullptr;  // [B,HV,K,V]
};

// States saved by backward every this many tokens; the states in between are
// recomputed, one block at a time. Memory per busy thread is about
// (T / interval + interval) · K·V elements.
inline constexpr std::size_t kDefaultCheckpointInterval = 64;

// Exact reverse-mode gradients given d_o = ∂L/∂o [B,T,HV,V] and
// d_final = ∂L/∂S_T [B,HV,K,V] (nullptr: zero). `incoming` is the state
// forward ran from (nullptr: zero). dq and dk sum over the HV/H value heads
// sharing a query/key head, in value-head order. `checkpoint_interval` (≥ 1)
// trades memory for nothing else: results are bitwise the same for every value.
// Algorithm::chunk ignores it: it computes the record of one head
// (ForwardCache::record_elems / (B·HV) elements per busy thread), unless
// `kept` (optional) holds the forward's record of this call, taken in order
// (`incoming` must then be the forward's: the record does not hold the
// first chunk's state); the gradients are bitwise the same.
template <class T>
void backward(const Inputs<T>& in, const Elem<T>* incoming, const Elem<T>* d_o,
              const Elem<T>* d_final, const Grads<Elem<T>>& grads, const Exec& exec = {},
              std::size_t checkpoint_interval = kDefaultCheckpointInterval,
              ForwardCache<Elem<T>>* kept = nullptr);

// G = ∂L/∂S_0 [B,HV,K,V] for a loss on this chunk's outputs alone (d_final = 0),
// without parameter gradients: a single reverse sweep on the state gradient,
// O(T·K·V) per value head and no state recompute. S_T and o are affine in S_0
// with a linear part that does not depend on S_0, so neither does G, and the
// incoming state is not an argument. Equals backward's d_incoming with
// d_final = nullptr up to rounding.
template <class T>
void incoming_grad(const Inputs<T>& in, const Elem<T>* d_o, Elem<T>* g_state,
                   const Exec& exec = {});

// ---------------------------------------------------------------------------
// Input transforms of flash-linear-attention's chunk_kda (its "in kernel"
// flags), each one pass with its exact reverse mode. Contiguous row-major
// tensors; T is float or double; intermediates are computed in double, so a
// float result is the correctly rounded double one. Every result is finite
// for finite inputs, or InvalidArgument names the element whose exact value
// is beyond T's range (an overflowing gate); non-finite inputs throw
// InvalidArgument naming the element.

// The gate g [tokens, heads, key_dim] from raw g (use_gate_in_kernel):
//   g = -exp(A_log[h]) · softplus(raw + dt_bias[h,k])              (default)
//   g = lower_bound · sigmoid(exp(A_log[h]) · (raw + dt_bias[h,k]))  (with a lower bound)
// a_log [heads] and dt_bias [heads·key_dim] are optional (null: A_log = 0,
// dt_bias = 0). The lower bound, when used, must be finite and < 0. softplus
// and sigmoid are evaluated in forms exact over the whole finite domain
// (softplus(x) = max(x, 0) + log1p(exp(-|x|))).
template <class T>
struct GateParams {
  const T* a_log = nullptr;    // [heads] or null
  const T* dt_bias = nullptr;  // [heads·key_dim] or null
  bool use_lower_bound = false;
  double lower_bound = 0;
};

template <class T>
void gate_forward(const Elem<T>* raw, const GateParams<T>& params, std::size_t tokens,
                  std::size_t heads, std::size_t key_dim, Elem<T>* g);

// Gradients of a loss L(g): d_raw [tokens, heads, key_dim] and, when not
// null (and the parameter was given), d_a_log [heads] and d_dt_bias
// [heads·key_dim], summed over the tokens in token order (in double).
template <class T>
void gate_backward(const Elem<T>* raw, const GateParams<T>& params, std::size_t tokens,
                   std::size_t heads, std::size_t key_dim, const Elem<T>* d_g, Elem<T>* d_raw,
                   Elem<T>* d_a_log, Elem<T>* d_dt_bias);

// flash-linear-attention's l2norm epsilon: y = x / sqrt(Σ x² + ε) per row.
inline constexpr double kL2NormEpsilon = 1e-6;

// y [rows, dim] = x · rstd per row, rstd [rows] = 1/sqrt(Σ x² + ε) (use_qk_l2norm_in_kernel,
// rows = tokens · heads, dim = K). Rows of huge values are scaled first, so
// no square overflows.
template <class T>
void l2norm_forward(const T* x, std::size_t rows, std::size_t dim, T* y, T* rstd);

// d_x = rstd · (d_y - (d_y · y) y) per row, from l2norm_forward's y and rstd.
template <class T>
void l2norm_backward(const T* y, const T* rstd, const T* d_y, std::size_t rows,
                     std::size_t dim, T* d_x);

// y = sigmoid(x) elementwise (use_beta_sigmoid_in_kernel), and d_x = d_y · sigmoid'(x)
// (from x: exact where y rounds to 0 or 1). allow_neg_eigval (flash-linear-
// attention's flag of that name): y = 2·sigmoid(x) in [0, 2] and d_x = d_y ·
// 2·sigmoid'(x), so that I - beta k k^T may have eigenvalues down to -1.
template <class T>
void sigmoid_forward(const T* x, std::size_t n, T* y, bool allow_neg_eigval = false);
template <class T>
void sigmoid_backward(const T* x, const T* d_y, std::size_t n, T* d_x, bool allow_neg_eigval = false);

}  // namespace kdacp::kda
