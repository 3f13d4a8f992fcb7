// Packed sequences, initial and final states on the per-head kernels of
// recurrent.cpp and chunk.cpp: each piece of a part is run by the same kernel
// on the piece's tokens as a call of kda::forward / backward on those tokens
// would, so no recurrence is written twice and a piece's results are the
// bits the kernels give for it.
//
// Threading: one call makes one flat list of work items, (piece, batch row,
// value head), and runs it on the pool once: each participant allocates its
// scratch once and takes the next item, heaviest (most tokens) first, until
// none is left. So a stream of many short documents keeps every worker busy
// with one fork/join per call, not one per document, and an item's result
// does not depend on which participant computes it. Items read and write the
// caller's tensors through strided views (a piece of a head is an offset
// into them), never copies.
#include "kda/sequences.hpp"

#include "kda/backward_driver.hpp"
#include "kda/chunk.hpp"
#include "kda/kda_kernels.hpp"
#include "kda/parts.hpp"
#include "kda/validate.hpp"

#include <algorithm>
#include <atomic>
#include <numeric>
#include <string_view>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "kdacp/error.hpp"
#include "kdacp/layout.hpp"
#include "kdacp/thread_pool.hpp"

namespace kdacp::kda {
namespace {

using detail::HeadGrads;
using detail::HeadInputs;

// Segment n's row block of [N,HV,K,V] states: [1,HV,K,V] of sequence n when
// packed, all [B,HV,K,V] otherwise.
template <class T>
T* slot(const SequenceStates<T>& st, const Shape& s, std::size_t n) {
  return st.data ? st.data + n * s.state_elems() : nullptr;
}

// Row p = b·HV + j of a [B,HV,K,V] state block (null stays null).
template <class T>
T* pair_state(T* block, const Shape& s, std::size_t p) {
  return block ? block + p * s.key_dim * s.value_dim : nullptr;
}

// Tokens [lo, lo + count) of the local [B,T_local,...] tensors: one piece.
struct Span {
  std::size_t lo = 0, count = 0;
};

inline Span span_of(const Part& part, const Piece& piece) {
  return {part.local_begin + (piece.begin - part.begin), piece.end - piece.begin};
}

// The piece's inputs as kda::forward would see them: the local shape with
// the piece's token count (what ForwardCache::record_elems sizes).
inline Shape piece_shape(const Shape& s, std::size_t count) {
  Shape p = s;
  p.tokens = count;
  return p;
}

// Batch row b, value head j of the local inputs from token lo on.
template <class T>
HeadInputs<T> head_at(const Inputs<T>& local, std::size_t b, std::size_t j, std::size_t lo) {
  return detail::head_inputs(local, b, j).from(lo);
}

// Offset of token lo of (b, value head j) in a local [B,T_local,HV,D] tensor.
inline std::size_t token_at(const Shape& s, std::size_t b, std::size_t j, std::size_t lo,
                            std::size_t d) {
  return detail::token_major_offset(s, b, j, d) + lo * s.value_heads * d;
}

// A work item: piece `piece` (an index into the call's pieces) of the pair
// p = b·HV + j.
struct Item {
  std::size_t piece = 0, pair = 0;
};

// Every (piece, pair) of `spans`, heaviest piece first (ties in piece and
// pair order), so that the longest items start first and the short ones fill
// the gaps at the end.
inline std::vector<Item> items_of(const std::vector<Span>& spans, std::size_t pairs) {
  std::vector<std::size_t> order(spans.size());
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
    return spans[a].count > spans[b].count;
  });
  std::vector<Item> items;
  items.reserve(spans.size() * pairs);
  for (std::size_t i : order)
    for (std::size_t p = 0; p < pairs; ++p) items.push_back({i, p});
  return items;
}

// Runs fn(item, scratch) for every item on exec.pool in one fork/join: each
// participant makes one Scratch and takes items from a shared counter until
// none is left.
template <class Scratch, class Fn>
void run_items(const Exec& exec, const std::vector<Item>& items, Fn&& fn) {
  std::atomic<std::size_t> next{0};
  parallel_ranges(exec.pool, participants(exec.pool, items.size()),
                  [&](std::size_t, std::size_t, std::size_t) {
                    Scratch scratch;
                    for (std::size_t i = next.fetch_add(1, std::memory_order_relaxed);
                         i < items.size(); i = next.fetch_add(1, std::memory_order_relaxed))
                      fn(items[i], scratch);
                  });
}

template <class T>
struct SummaryScratch {
  detail::SweepScratch<T> sweep;
  std::vector<T> vecs;
};

// One forward run of a piece: the state it starts from and ends in
// ([B,HV,K,V] blocks, null: zero / not produced) and, with a cache, its
// record (B·HV records of chunk_saved_layout(count), pair p at p·per_pair).
template <class T>
struct ForwardRun {
  Span span;
  const T* incoming = nullptr;
  T* final_state = nullptr;
  T* record = nullptr;
  std::size_t per_pair = 0;
};

// Where a forward writes o: [B,tokens,HV,V] at `data`, local token t at
// row t - first.
template <class T>
struct OutRows {
  T* data = nullptr;
  std::size_t tokens = 0, first = 0;

  T* at(const Shape& s, std::size_t b, std::size_t j, std::size_t lo) const {
    return data + ((b * tokens + (lo - first)) * s.value_heads + j) * s.value_dim;
  }
};

// The forward of every run (pieces of one part): for each, what
// detail::forward_on gives on its tokens.
template <class T>
void forward_runs(const Inputs<T>& local, const std::vector<ForwardRun<T>>& runs,
                  const OutRows<T>& o, const Exec& exec) {
  if (exec.algorithm != Algorithm::chunk) detail::require_wide(local, "kda::part_forward");
  const Shape& s = local.shape;
  std::vector<Span> spans;
  for (const ForwardRun<T>& r : runs) spans.push_back(r.span);
  const std::vector<Item> items = items_of(spans, s.batch * s.value_heads);
  const std::size_t o_stride = s.value_heads * s.value_dim;
  if (exec.algorithm == Algorithm::chunk) {
    const detail::ChunkKernels<T>& kern = detail::chosen_chunk_kernels<T>();
    run_items<detail::ChunkWork<T>>(exec, items, [&](const Item& it, detail::ChunkWork<T>& w) {
      const ForwardRun<T>& r = runs[it.piece];
      const std::size_t b = it.pair / s.value_heads, j = it.pair % s.value_heads;
      kern.forward(head_at(local, b, j, r.span.lo), r.span.count, s.key_dim, s.value_dim,
                   local.scale, pair_state(r.incoming, s, it.pair),
                   o.at(s, b, j, r.span.lo), o_stride,
                   pair_state(r.final_state, s, it.pair), w,
                   r.record ? r.record + it.pair * r.per_pair : nullptr);
    });
    return;
  }
  const detail::Kernels<T>& kern = detail::chosen_kernels<T>();
  run_items<detail::SweepScratch<T>>(exec, items, [&](const Item& it, detail::SweepScratch<T>& ws) {
    const ForwardRun<T>& r = runs[it.piece];
    const std::size_t b = it.pair / s.value_heads, j = it.pair % s.value_heads;
    detail::SweepOut<T> out;
    out.o = o.at(s, b, j, r.span.lo);
    out.o_stride = o_stride;
    out.scale = local.scale;
    out.final_state = pair_state(r.final_state, s, it.pair);
    kern.sweep(head_at(local, b, j, r.span.lo), 0, r.span.count, s.key_dim, s.value_dim,
               pair_state(r.incoming, s, it.pair), out, ws);
  });
}

// One backward run of a piece: the state it started from, the gradient
// w.r.t. the state after its last token (null: zero), where the gradient
// w.r.t. its incoming state goes (null: not produced), all [B,HV,K,V] blocks,
// and the forward's record of it (or null), as in ForwardRun.
template <class T>
struct BackwardRun {
  Span span;
  const T* incoming = nullptr;
  const T* d_final = nullptr;
  T* d_start = nullptr;
  const T* record = nullptr;
  std::size_t per_pair = 0;
};

// The backward of every run (the pieces of one part, which spans local
// tokens `whole`), writing dq, dk, dv, dg, dbeta of grads (local [B,T_local,
// ...] tensors; grads.d_incoming is not used) for those tokens: for each
// run, what detail::backward_on gives on its tokens. With grouped value
// heads each pair writes its own dq/dk partial over `whole`, summed
// afterwards in value-head order as backward_over_heads does.
template <class T>
void backward_runs(const Inputs<T>& local, const std::vector<BackwardRun<T>>& runs, Span whole,
                   const T* d_o, const Grads<T>& grads, const Exec& exec,
                   std::size_t checkpoint_interval) {
  if (exec.algorithm != Algorithm::chunk) detail::require_wide(local, "kda::part_backward");
  const Shape& s = local.shape;
  const std::size_t group = s.group(), head_qk = whole.count * s.key_dim;
  std::vector<T> partial_dq(group > 1 ? s.batch * s.value_heads * head_qk : 0);
  std::vector<T> partial_dk(partial_dq.size());
  const auto grads_of = [&](const Item& it) {
    const std::size_t b = it.pair / s.value_heads, j = it.pair % s.value_heads, h = j / group;
    const std::size_t lo = runs[it.piece].span.lo;
    HeadGrads<T> out{};
    if (group > 1) {
      out.dq = partial_dq.data() + it.pair * head_qk + (lo - whole.lo) * s.key_dim;
      out.dk = partial_dk.data() + it.pair * head_qk + (lo - whole.lo) * s.key_dim;
      out.qk_stride = s.key_dim;
    } else {
      out.dq = grads.dq + ((b * s.tokens + lo) * s.heads + h) * s.key_dim;
      out.dk = grads.dk + ((b * s.tokens + lo) * s.heads + h) * s.key_dim;
      out.qk_stride = s.heads * s.key_dim;
    }
    out.dv = grads.dv + token_at(s, b, j, lo, s.value_dim);
    out.v_stride = s.value_heads * s.value_dim;
    out.dg = grads.dg + token_at(s, b, j, lo, s.key_dim);
    out.g_stride = s.value_heads * s.key_dim;
    out.dbeta = grads.dbeta + token_at(s, b, j, lo, 1);
    out.beta_stride = s.value_heads;
    out.d_incoming = pair_state(runs[it.piece].d_start, s, it.pair);
    return out;
  };
  std::vector<Span> spans;
  for (const BackwardRun<T>& r : runs) spans.push_back(r.span);
  const std::vector<Item> items = items_of(spans, s.batch * s.value_heads);
  const std::size_t do_stride = s.value_heads * s.value_dim;
  if (exec.algorithm == Algorithm::chunk) {
    const detail::ChunkKernels<T>& kern = detail::chosen_chunk_kernels<T>();
    using Scratch = detail::ChunkBackScratch<T>;
    run_items<Scratch>(exec, items, [&](const Item& it, Scratch& sc) {
      const BackwardRun<T>& r = runs[it.piece];
      const std::size_t b = it.pair / s.value_heads, j = it.pair % s.value_heads;
      kern.backward(head_at(local, b, j, r.span.lo), r.span.count, s.key_dim, s.value_dim,
                    local.scale, pair_state(r.incoming, s, it.pair),
                    d_o + token_at(s, b, j, r.span.lo, s.value_dim), do_stride,
                    pair_state(r.d_final, s, it.pair), grads_of(it), sc.w, sc.bw,
                    r.record ? r.record + it.pair * r.per_pair : nullptr);
    });
  } else {
    const detail::Kernels<T>& kern = detail::chosen_kernels<T>();
    run_items<detail::BackwardScratch<T>>(
        exec, items, [&](const Item& it, detail::BackwardScratch<T>& ws) {
          const BackwardRun<T>& r = runs[it.piece];
          const std::size_t b = it.pair / s.value_heads, j = it.pair % s.value_heads;
          kern.backward(head_at(local, b, j, r.span.lo), r.span.count, s.key_dim, s.value_dim,
                        local.scale, pair_state(r.incoming, s, it.pair),
                        d_o + token_at(s, b, j, r.span.lo, s.value_dim), do_stride,
                        pair_state(r.d_final, s, it.pair), grads_of(it), checkpoint_interval,
                        ws);
        });
  }
  if (group > 1)
    detail::sum_group_partials(s, grads, whole.lo, whole.count, partial_dq.data(), partial_dk.data(),
                               exec.pool);
}

template <class T>
PartInfo forward_impl(const Inputs<T>& local, const Sequences& seqs, const Part& part,
                      const T* incoming, SequenceStates<const T> h0, T* o,
                      SequenceStates<T> ht, const Exec& exec, ForwardCache<T>* keep,
                      T* outgoing = nullptr) {
  const std::vector<Piece> pieces = kdacp::pieces(seqs, part);
  const PartInfo info = part_info(seqs, part);
  const Shape& s = local.shape;
  // Records in piece order, as one forward call per piece appends them.
  const bool records = keep != nullptr && exec.algorithm == Algorithm::chunk;
  std::vector<ForwardRun<T>> runs;
  for (const Piece& piece : pieces) {
    ForwardRun<T> r;
    r.span = span_of(part, piece);
    r.incoming = piece.starts ? slot(h0, s, *piece.starts) : incoming;
    r.final_state = piece.ends ? slot(ht, s, *piece.ends)
                    : &piece == &pieces.back() ? outgoing : nullptr;
    if (records) {
      r.record = keep->append(
          ForwardCache<T>::record_elems(piece_shape(s, r.span.count), exec.algorithm));
      r.per_pair = detail::chunk_saved_layout(r.span.count, s.key_dim, s.value_dim).total;
    }
    runs.push_back(r);
  }
  forward_runs(local, runs, OutRows<T>{o, s.tokens, 0}, exec);
  return info;
}

template <class T>
PartInfo backward_impl(const Inputs<T>& local, const Sequences& seqs, const Part& part,
                       const T* incoming, SequenceStates<const T> h0,
                       const T* d_o, const T* d_end, SequenceStates<const T> dht,
                       const Grads<T>& grads, SequenceStates<T> dh0, const Exec& exec,
                       std::size_t checkpoint_interval, ForwardCache<T>* kept) {
  const std::vector<Piece> pieces = kdacp::pieces(seqs, part);
  const PartInfo info = part_info(seqs, part);
  const Shape& s = local.shape;
  const bool records = kept != nullptr && exec.algorithm == Algorithm::chunk;
  std::vector<BackwardRun<T>> runs;
  for (std::size_t i = 0; i < pieces.size(); ++i) {
    const Piece& piece = pieces[i];
    BackwardRun<T> r;
    r.span = span_of(part, piece);
    r.incoming = piece.starts ? slot(h0, s, *piece.starts) : incoming;
    r.d_final = piece.ends ? slot(dht, s, *piece.ends) : d_end;
    // The first piece's incoming state is the part's: its gradient is
    // grads.d_incoming (and dh0's row when the piece starts a sequence).
    r.d_start = piece.starts ? slot(dh0, s, *piece.starts) : grads.d_incoming;
    if (i == 0 && r.d_start == nullptr) r.d_start = grads.d_incoming;
    if (records) {
      r.record = kept->take(
          ForwardCache<T>::record_elems(piece_shape(s, r.span.count), exec.algorithm),
          "backward");
      r.per_pair = detail::chunk_saved_layout(r.span.count, s.key_dim, s.value_dim).total;
    }
    runs.push_back(r);
  }
  backward_runs(local, runs, Span{part.local_begin, part.end - part.begin}, d_o, grads, exec,
                checkpoint_interval);
  if (grads.d_incoming != nullptr && runs.front().d_start != grads.d_incoming)
    std::copy_n(runs.front().d_start, s.state_elems(), grads.d_incoming);
  return info;
}

}  // namespace

template <class T>
PartInfo part_summary(const Inputs<T>& local, const Sequences& seqs, const Part& part,
                      SequenceStates<const Elem<T>> h0, Elem<T>* state, Elem<T>* transfer,
                      const Exec& exec) {
  if (exec.algorithm != Algorithm::chunk) detail::require_wide(local, "kda::part_summary");
  const std::vector<Piece> pieces = kdacp::pieces(seqs, part);
  const PartInfo info = part_info(seqs, part);
  const Shape& s = local.shape;
  if (!info.cut) {
    const Span span = span_of(part, pieces.front());
    const std::vector<Item> items = items_of({span}, s.batch * s.value_heads);
    const std::size_t kv = s.key_dim * s.value_dim, kk = s.key_dim * s.key_dim;
    if (exec.algorithm == Algorithm::chunk) {
      const detail::ChunkKernels<T>& kern = detail::chosen_chunk_kernels<T>();
      run_items<detail::ChunkWork<T>>(exec, items, [&](const Item& it, detail::ChunkWork<T>& w) {
        kern.summary(head_at(local, it.pair / s.value_heads, it.pair % s.value_heads, span.lo),
                     span.count, s.key_dim, s.value_dim, state + it.pair * kv,
                     transfer + it.pair * kk, w);
      });
    } else {
      const detail::Kernels<T>& kern = detail::chosen_kernels<T>();
      run_items<SummaryScratch<T>>(exec, items, [&](const Item& it, SummaryScratch<T>& ws) {
        kern.summary(head_at(local, it.pair / s.value_heads, it.pair % s.value_heads, span.lo),
                     span.count, s.key_dim, s.value_dim, state + it.pair * kv,
                     transfer + it.pair * kk, ws.sweep, ws.vecs);
      });
    }
    return info;
  }
  // The last piece starts at the part's last sequence start: the part's
  // outgoing state is that sequence's state, run from its h0 row. Its o,
  // not needed, goes to scratch laid out as the piece's [B,count,HV,V].
  const Piece& last = pieces.back();
  ForwardRun<T> run;
  run.span = span_of(part, last);
  run.incoming = slot(h0, s, *last.starts);
  run.final_state = state;
  detail::ScratchVec<T> o(piece_shape(s, run.span.count).v_elems());
  forward_runs(local, {run}, OutRows<T>{o.data(), run.span.count, run.span.lo}, exec);
  return info;
}

template <class T>
PartInfo part_forward(const Inputs<T>& local, const Sequences& seqs, const Part& part,
                      const Elem<T>* incoming, SequenceStates<const Elem<T>> h0, Elem<T>* o,
                      SequenceStates<Elem<T>> ht, const Exec& exec, ForwardCache<Elem<T>>* keep,
                      Elem<T>* outgoing) {
  return forward_impl(local, seqs, part, incoming, h0, o, ht, exec, keep, outgoing);
}

template <class T>
PartInfo part_incoming_grad(const Inputs<T>& local, const Sequences& seqs, const Part& part,
                            const Elem<T>* d_o, SequenceStates<const Elem<T>> dht,
                            Elem<T>* g_state, const Exec& exec) {
  const std::vector<Piece> pieces = kdacp::pieces(seqs, part);
  const PartInfo info = part_info(seqs, part);
  const Shape& s = local.shape;
  if (info.starts_sequence) {
    std::fill_n(g_state, s.state_elems(), T(0));
    return info;
  }
  const Piece& first = pieces.front();
  const Span span = span_of(part, first);
  const std::vector<Item> items = items_of({span}, s.batch * s.value_heads);
  const std::size_t kv = s.key_dim * s.value_dim, do_stride = s.value_heads * s.value_dim;
  const bool chunk = exec.algorithm == Algorithm::chunk;
  if (!chunk) detail::require_wide(local, "kda::part_incoming_grad");
  const auto head = [&](const Item& it) {
    return head_at(local, it.pair / s.value_heads, it.pair % s.value_heads, span.lo);
  };
  const auto head_do = [&](const Item& it) {
    return d_o + token_at(s, it.pair / s.value_heads, it.pair % s.value_heads, span.lo,
                          s.value_dim);
  };
  const T* d_final = first.ends ? slot(dht, s, *first.ends) : nullptr;
  if (d_final == nullptr) {
    if (chunk) {
      const detail::ChunkKernels<T>& kern = detail::chosen_chunk_kernels<T>();
      run_items<detail::ChunkWork<T>>(exec, items, [&](const Item& it, detail::ChunkWork<T>& w) {
        kern.incoming_grad(head(it), span.count, s.key_dim, s.value_dim, local.scale,
                           head_do(it), do_stride, g_state + it.pair * kv, w);
      });
    } else {
      const detail::Kernels<T>& kern = detail::chosen_kernels<T>();
      run_items<std::vector<T>>(exec, items, [&](const Item& it, std::vector<T>& scratch) {
        kern.incoming_grad(head(it), span.count, s.key_dim, s.value_dim, local.scale,
                           head_do(it), do_stride, g_state + it.pair * kv, scratch);
      });
    }
    return info;
  }
  // ht of the sequence ending in this piece is one of the part's outputs: its
  // gradient reaches the incoming state through the piece's transfer, which
  // backward's state sweep applies; the parameter gradients are not needed
  // and go to each participant's scratch, one head's tokens at a time.
  struct Unused {
    std::vector<T> dq, dk, dv, dg, dbeta;
    HeadGrads<T> grads(const Shape& s, std::size_t count, T* d_incoming) {
      dq.resize(count * s.key_dim);
      dk.resize(count * s.key_dim);
      dv.resize(count * s.value_dim);
      dg.resize(count * s.key_dim);
      dbeta.resize(count);
      return {dq.data(), dk.data(),    s.key_dim, dv.data(), s.value_dim,
              dg.data(), s.key_dim,    dbeta.data(), 1,      d_incoming};
    }
  };
  if (chunk) {
    struct Scratch {
      detail::ChunkBackScratch<T> kernel;
      Unused unused;
    };
    const detail::ChunkKernels<T>& kern = detail::chosen_chunk_kernels<T>();
    run_items<Scratch>(exec, items, [&](const Item& it, Scratch& sc) {
      kern.backward(head(it), span.count, s.key_dim, s.value_dim, local.scale,
                    static_cast<const T*>(nullptr), head_do(it), do_stride,
                    d_final + it.pair * kv,
                    sc.unused.grads(s, span.count, g_state + it.pair * kv), sc.kernel.w,
                    sc.kernel.bw, static_cast<const T*>(nullptr));
    });
  } else {
    struct Scratch {
      detail::BackwardScratch<T> kernel;
      Unused unused;
    };
    const detail::Kernels<T>& kern = detail::chosen_kernels<T>();
    run_items<Scratch>(exec, items, [&](const Item& it, Scratch& sc) {
      kern.backward(head(it), span.count, s.key_dim, s.value_dim, local.scale,
                    static_cast<const T*>(nullptr), head_do(it), do_stride,
                    d_final + it.pair * kv,
                    sc.unused.grads(s, span.count, g_state + it.pair * kv),
                    kDefaultCheckpointInterval, sc.kernel);
    });
  }
  return info;
}

template <class T>
PartInfo part_backward(const Inputs<T>& local, const Sequences& seqs, const Part& part,
                       const Elem<T>* incoming, SequenceStates<const Elem<T>> h0,
                       const Elem<T>* d_o, const Elem<T>* d_end,
                       SequenceStates<const Elem<T>> dht, const Grads<Elem<T>>& grads,
                       SequenceStates<Elem<T>> dh0, const Exec& exec,
                       std::size_t checkpoint_interval, ForwardCache<Elem<T>>* kept) {
  return backward_impl(local, seqs, part, incoming, h0, d_o, d_end, dht, grads, dh0, exec,
                       checkpoint_interval, kept);
}

template <class T>
void forward_sequences(const Inputs<T>& in, const Sequences& seqs,
                       SequenceStates<const Elem<T>> h0, Elem<T>* o,
                       SequenceStates<Elem<T>> ht, const Exec& exec, ForwardCache<Elem<T>>* keep) {
  const std::string_view where = "kda::forward_sequences: ";
  check::inputs(in, where);
  check::algorithm(exec.algorithm, where);
  check::whole_stream(in.shape, seqs, where);
  check::pointer(o, where, "o");
  check::states(h0, seqs, in.shape, where, "h0");
  check::states(ht, seqs, in.shape, where, "ht");
  forward_impl(in, seqs, Part{0, seqs.tokens(), 0}, static_cast<const T*>(nullptr), h0, o, ht,
               exec, keep);
}

template <class T>
void backward_sequences(const Inputs<T>& in, const Sequences& seqs,
                        SequenceStates<const Elem<T>> h0, const Elem<T>* d_o,
                        SequenceStates<const Elem<T>> dht, const Grads<Elem<T>>& grads,
                        SequenceStates<Elem<T>> dh0, const Exec& exec,
                        std::size_t checkpoint_interval, ForwardCache<Elem<T>>* kept) {
  const std::string_view where = "kda::backward_sequences: ";
  check::inputs(in, where);
  check::algorithm(exec.algorithm, where);
  check::whole_stream(in.shape, seqs, where);
  check::pointer(d_o, where, "d_o");
  check::grads(grads, where);
  if (grads.d_incoming != nullptr)
    throw InvalidArgument(fmt::format("{}grads.d_incoming is set, expected null (the incoming "
                                      "states are h0; their gradient is dh0)",
                                      where));
  check::checkpoint_interval(checkpoint_interval, where);
  check::states(h0, seqs, in.shape, where, "h0");
  check::states(dht, seqs, in.shape, where, "dht");
  check::states(dh0, seqs, in.shape, where, "dh0");
  backward_impl(in, seqs, Part{0, seqs.tokens(), 0}, static_cast<const T*>(nullptr), h0,
                d_o, static_cast<const T*>(nullptr), dht, grads, dh0, exec,
                checkpoint_interval, kept);
}

#define KDACP_SEQUENCES_INSTANTIATE(T)                                                         \
  template PartInfo part_summary<T>(const Inputs<T>&, const Sequences&, const Part&,            \
                                    SequenceStates<const T>, T*, T*, const Exec&);        \
  template PartInfo part_forward<T>(const Inputs<T>&, const Sequences&, const Part&, const T*,  \
                                    SequenceStates<const T>, T*, SequenceStates<T>,             \
                                    const Exec&, ForwardCache<T>*, T*);                   \
  template PartInfo part_incoming_grad<T>(const Inputs<T>&, const Sequences&, const Part&,      \
                                          const T*, SequenceStates<const T>, T*,                \
                                          const Exec&);                                   \
  template PartInfo part_backward<T>(const Inputs<T>&, const Sequences&, const Part&, const T*, \
                                     SequenceStates<const T>, const T*, const T*,               \
                                     SequenceStates<const T>, const Grads<T>&,                  \
                                     SequenceStates<T>, const Exec&, std::size_t,         \
                                     ForwardCache<T>*);                                         \
  template void forward_sequences<T>(const Inputs<T>&, const Sequences&,                        \
                                     SequenceStates<const T>, T*, SequenceStates<T>,            \
                                     const Exec&, ForwardCache<T>*);                      \
  template void backward_sequences<T>(const Inputs<T>&, const Sequences&,                       \
                                      SequenceStates<const T>, const T*,                        \
                                      SequenceStates<const T>, const Grads<T>&,                 \
                                      SequenceStates<T>, const Exec&, std::size_t,        \
                                      ForwardCache<T>*);

KDACP_SEQUENCES_INSTANTIATE(float)
KDACP_SEQUENCES_INSTANTIATE(double)
#undef KDACP_SEQUENCES_INSTANTIATE

}  // namespace kdacp::kda
