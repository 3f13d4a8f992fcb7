// The causal short convolution and its CP halo (kdacp/conv.hpp).
//
// Each local part is computed piece by piece (a piece: the part's tokens of
// one sequence) over an extended row [history; tokens], the history being the
// W-1 positions before the piece: for a part's first piece the halo received
// from earlier parts, with initial-state columns (or zeros) where the
// sequence starts less than W-1 tokens before it; for a piece that starts a
// sequence inside the part, the initial state alone. Sums run in double for
// float32 and float64 in one fixed order (row, piece, token, tap), so results
// do not depend on the thread count (there is one thread) and a halo token's
// value is the bits its owner holds. The backward keeps that order across
// cuts: a part continuing a sequence hands the parts before it the gradient
// of its first W-1 tokens' pre-activations (g, double), and each owner adds
// their terms to its last rows after its own, as one device does; so every
// result but dweight and dbias (each rank's share) is one device's bits
// whatever the layout.
#include "kdacp/conv.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <span>
#include <type_traits>
#include <utility>

#include <fmt/format.h>

#include "conv/call.hpp"
#include "conv/pointwise.hpp"
#include "kdacp/comm.hpp"
#include "kdacp/error.hpp"
#include "kdacp/finite.hpp"

namespace kdacp::conv {

using detail::require_finite_result;
using detail::sigmoid;

namespace {

// Message tags: above the exchange protocols' (< 2^16) and below kdacp._comm's
// VIEW_TAG (2^20). Part i's transfer from part i-k (k <= 7) in direction dir
// (0 forward, 1 backward) is kTagBase + 16 i + 2 k + dir.
constexpr int kTagBase = 1 << 17;
constexpr std::size_t kMaxParts = ((std::size_t{1} << 20) - (std::size_t{1} << 17)) / 16;
constexpr std::size_t npos = std::numeric_limits<std::size_t>::max();

template <class T>
std::span<std::byte> bytes(std::vector<T>& v) {
  return std::as_writable_bytes(std::span<T>(v));
}

}  // namespace

struct LocalPart {
  std::size_t index = 0;  // global part (chain position)
  Part part;
  std::vector<Piece> pieces;
  std::size_t seq = 0;        // sequence holding the part's first token (packed)
  std::size_t seq_start = 0;  // its first token
};

struct CausalConv::Impl {
  std::shared_ptr<Communicator> comm;  // null: one device
  Sequences seqs;
  std::size_t batch = 0, tokens_local = 0, dim = 0, width = 0, rank = 0, ranks = 1;
  std::vector<LayoutPart> parts;        // global, chain order
  std::vector<LocalPart> local;         // this rank's, token order
  std::vector<std::size_t> local_of;    // global part -> local index, or npos
  std::vector<Transfer> transfers;      // every rank's, ascending `to`
  std::vector<std::size_t> last_owner;  // sequence -> rank holding its last token

  Impl(std::shared_ptr<Communicator> cm, const Layout& layout, Sequences s, std::size_t d,
       std::size_t w)
      : comm(std::move(cm)), seqs(std::move(s)), batch(seqs.batch()), dim(d), width(w) {
    if (w < 1 || w > kMaxWidth)
      throw InvalidArgument(fmt::format(
          "causal_conv1d: kernel width W = {} (weight [D,W]), expected 1 <= W <= {}", w,
          kMaxWidth));
    if (d < 1) throw InvalidArgument("causal_conv1d: D = 0 channels, expected D >= 1");
    if (layout.tokens() != seqs.tokens())
      throw InvalidArgument(fmt::format(
          "causal_conv1d: the layout covers T = {} tokens, the sequences (cu_seqlens) T = {}",
          layout.tokens(), seqs.tokens()));
    if (comm) {
      if (comm->size() != layout.ranks())
        throw InvalidArgument(fmt::format(
            "causal_conv1d: layout over {} ranks on a communicator of {} ranks", layout.ranks(),
            comm->size()));
      rank = comm->rank();
      ranks = comm->size();
    }
    parts = layout.parts();
    if (parts.size() > kMaxParts)
      throw InvalidArgument(fmt::format(
          "causal_conv1d: a layout of {} parts, expected at most {} (message tags)",
          parts.size(), kMaxParts));
    tokens_local = layout.local_tokens(rank);
    const std::vector<std::size_t>& c = seqs.boundaries();
    auto seq_of = [&](std::size_t t) {
      return static_cast<std::size_t>(std::upper_bound(c.begin(), c.end(), t) - c.begin()) - 1;
    };
    local_of.assign(parts.size(), npos);
    const std::vector<Part> mine = layout.local_parts(rank);
    for (const Part& p : mine) {
      LocalPart lp;
      lp.part = p;
      lp.index = static_cast<std::size_t>(
          std::find_if(parts.begin(), parts.end(),
                       [&](const LayoutPart& q) { return q.begin == p.begin; }) -
          parts.begin());
      lp.pieces = pieces(seqs, p);
      lp.seq = seq_of(p.begin);
      lp.seq_start = c[lp.seq];
      local_of[lp.index] = local.size();
      local.push_back(std::move(lp));
    }
    const std::size_t h = width - 1;
    for (std::size_t i = 0; i < parts.size(); ++i) {
      const std::size_t b = parts[i].begin;
      const std::size_t lo = b - std::min(h, b - c[seq_of(b)]);
      for (std::size_t j = i; j-- > 0 && parts[j].end > lo;)
        transfers.push_back(Transfer{i, j, std::max(lo, parts[j].begin), parts[j].end});
    }
    last_owner.resize(seqs.count());
    for (std::size_t n = 0; n < seqs.count(); ++n) {
      const std::size_t last = seqs.packed() ? c[n + 1] - 1 : seqs.tokens() - 1;
      for (const LayoutPart& p : parts)
        if (p.begin <= last && last < p.end) last_owner[n] = p.rank;
    }
  }

  std::size_t hist_rows() const { return width - 1; }
  // Under CP: every rank's call agrees before its first message.
  template <class T>
  void agree(const Tensors<T>& in, bool final_state, const char* what) const {
    if (!comm || ranks == 1) return;
    agree_conv_call(*comm, {batch, seqs.tokens(), dim, width, seqs.boundaries(), parts,
                            std::is_same_v<T, double> ? "float64" : "float32",
                            activation_name(in.activation).data(), in.bias != nullptr,
                            in.initial_state != nullptr, final_state}, what);
  }
  std::size_t owner(std::size_t part) const { return parts[part].rank; }
  // Sequence (row of the states) of piece `pc` of row b.
  std::size_t seq_index(std::optional<std::size_t> s, std::size_t b) const {
    return seqs.packed() ? *s : b;
  }
  std::size_t state_row(const LocalPart& lp, std::size_t b) const {
    return seqs.packed() ? lp.seq : b;
  }
  int tag(const Transfer& t, int dir) const {
    return kTagBase + static_cast<int>(16 * t.to + 2 * (t.to - t.from)) + dir;
  }
  // Local position of token `tok` of global part `part` (held here).
  std::size_t local_pos(std::size_t part, std::size_t tok) const {
    const LocalPart& lp = local[local_of[part]];
    return lp.part.local_begin + (tok - lp.part.begin);
  }

  // Initial-state columns (or zeros) of the history rows before the
  // sequence start; the halo rows are filled by the exchange.
  template <class T>
  void fill_initial(const T* h0, std::vector<T>& hist) const {
    const std::size_t h = hist_rows(), d = dim, w = width;
    for (std::size_t li = 0; li < local.size(); ++li) {
      const LocalPart& lp = local[li];
      const std::size_t avail = std::min(h, lp.part.begin - lp.seq_start);
      for (std::size_t b = 0; b < batch; ++b) {
        T* rows = hist.data() + (li * batch + b) * h * d;
        for (std::size_t r = 0; r + avail < h; ++r) {
          // rel = r - (h - avail) < 0: initial-state column rel + W.
          const std::size_t col = w - (h - avail) + r;
          for (std::size_t k = 0; k < d; ++k)
            rows[r * d + k] = h0 ? h0[(state_row(lp, b) * d + k) * w + col] : T(0);
        }
      }
    }
  }

  template <class T>
  T* hist_row(std::vector<T>& hist, std::size_t li, std::size_t b, std::size_t tok) const {
    const LocalPart& lp = local[li];
    const std::size_t r = tok - (lp.part.begin - hist_rows());
    return hist.data() + ((li * batch + b) * hist_rows() + r) * dim;
  }

  // The halo exchange, one plan for both directions. Transfer t carries
  // tokens [begin, end) of part `from` into the history rows of part `to`.
  // Forward: part `from`'s x rows, copied into `to`'s history. Backward
  // (g_rows): part `to` hands `from` the g (double) of its first g_count(t)
  // tokens, those within W-1 tokens after `from`'s end, into `from`'s
  // rows of `next` at their offset from its end.
  enum Dir : int { kForward = 0, kBackward = 1 };  // also the tag's last bit
  template <Dir dir, class E, class Src, class Dst>
  void exchange(const Src& src_rows, const Dst& dst_rows) const {
    constexpr bool fwd = dir == kForward;
    const std::size_t d = dim;
    auto src_part = [](const Transfer& t) { return fwd ? t.from : t.to; };
    auto dst_part = [](const Transfer& t) { return fwd ? t.to : t.from; };
    auto count = [&](const Transfer& t) { return fwd ? t.end - t.begin : g_count(t); };
    std::vector<std::vector<E>> bufs(transfers.size());
    std::vector<std::unique_ptr<Request>> reqs;
    for (std::size_t q = 0; q < transfers.size(); ++q) {
      const Transfer& t = transfers[q];
      if (owner(dst_part(t)) != rank || owner(src_part(t)) == rank) continue;
      bufs[q].resize(batch * count(t) * d);
      reqs.push_back(comm->irecv(bytes(bufs[q]), owner(src_part(t)), tag(t, dir)));
    }
    for (std::size_t q = 0; q < transfers.size(); ++q) {
      const Transfer& t = transfers[q];
      if (owner(src_part(t)) != rank || owner(dst_part(t)) == rank) continue;
      const std::size_t n = count(t);
      bufs[q].resize(batch * n * d);
      for (std::size_t b = 0; b < batch; ++b)
        std::memcpy(bufs[q].data() + b * n * d, src_rows(t, b), n * d * sizeof(E));
      reqs.push_back(comm->isend(std::as_bytes(std::span<const E>(bufs[q])),
                                 owner(dst_part(t)), tag(t, dir)));
    }
    for (auto& r : reqs) r->wait();
    for (std::size_t q = 0; q < transfers.size(); ++q) {
      const Transfer& t = transfers[q];
      if (owner(dst_part(t)) != rank) continue;
      const std::size_t n = count(t);
      for (std::size_t b = 0; b < batch; ++b) {
        const E* src =
            owner(src_part(t)) == rank ? src_rows(t, b) : bufs[q].data() + b * n * d;
        std::memcpy(dst_rows(t, b), src, n * d * sizeof(E));
      }
    }
  }

  // Forward: x rows into the history.
  template <class T>
  void exchange_x(const T* x, std::vector<T>& hist) const {
    exchange<kForward, T>(
        [&](const Transfer& t, std::size_t b) {
          return x + (b * tokens_local + local_pos(t.from, t.begin)) * dim;
        },
        [&](const Transfer& t, std::size_t b) {
          return hist_row(hist, local_of[t.to], b, t.begin);
        });
  }

  // The tokens of part t.to whose g part t.from's last rows need: from its
  // first token to W-1 after t.from's end, within its first piece.
  std::size_t g_count(const Transfer& t) const {
    const LayoutPart& to = parts[t.to];
    const std::vector<std::size_t>& c = seqs.boundaries();
    const std::size_t seq_end =
        *std::upper_bound(c.begin(), c.end(), to.begin);  // the sequence's end
    return std::min({to.end, seq_end, parts[t.from].end + hist_rows()}) - to.begin;
  }

  // Backward: `first` [local part][b][W-1][D] holds g of each part's first
  // tokens (a part continuing a sequence); `next` [local part][b][W-1][D]
  // receives g of the W-1 tokens after each part's end.
  void exchange_g(const std::vector<double>& first, std::vector<double>& next) const {
    const std::size_t h = hist_rows();
    exchange<kBackward, double>(
        [&](const Transfer& t, std::size_t b) {
          return first.data() + (local_of[t.to] * batch + b) * h * dim;
        },
        [&](const Transfer& t, std::size_t b) {
          const std::size_t at = parts[t.to].begin - parts[t.from].end;
          return next.data() + ((local_of[t.from] * batch + b) * h + at) * dim;
        });
  }

  // Sums `mine` (N*D*W doubles) over the ranks in rank order, on every rank.
  void sum_over_ranks(std::vector<double>& mine) const {
    if (!comm || ranks == 1) return;
    const std::size_t n = mine.size();
    std::vector<double> all(n * ranks);
    std::copy(mine.begin(), mine.end(), all.begin() + rank * n);
    comm->all_gather(bytes(all));
    for (std::size_t k = 0; k < n; ++k) {
      double s = 0;
      for (std::size_t r = 0; r < ranks; ++r) s += all[r * n + k];
      mine[k] = s;
    }
  }

  // History of a piece: the part's (first piece) or the initial state's.
  template <class T>
  const T* piece_history(const T* h0, const std::vector<T>& hist, std::size_t li, std::size_t pi,
                         std::size_t b, std::vector<T>& scratch) const {
    const std::size_t h = hist_rows(), d = dim, w = width;
    if (pi == 0) return hist.data() + (li * batch + b) * h * d;
    const std::size_t n = seq_index(local[li].pieces[pi].starts, b);
    scratch.assign(h * d, T(0));
    if (h0)
      for (std::size_t r = 0; r < h; ++r)
        for (std::size_t k = 0; k < d; ++k) scratch[r * d + k] = h0[(n * d + k) * w + r + 1];
    return scratch.data();
  }
};

CausalConv::CausalConv(Sequences seqs, std::size_t dim, std::size_t width)
    : impl_(std::make_unique<Impl>(nullptr, Layout::contiguous(seqs.tokens(), 1), seqs, dim,
                                   width)) {}

CausalConv::CausalConv(std::shared_ptr<Communicator> comm, Layout layout, Sequences seqs,
                       std::size_t dim, std::size_t width) {
  if (!comm) throw InvalidArgument("causal_conv1d: a CP convolution needs a communicator");
  impl_ = std::make_unique<Impl>(std::move(comm), layout, std::move(seqs), dim, width);
}

CausalConv::~CausalConv() = default;
CausalConv::CausalConv(CausalConv&&) noexcept = default;
CausalConv& CausalConv::operator=(CausalConv&&) noexcept = default;

std::size_t CausalConv::batch() const { return impl_->batch; }
std::size_t CausalConv::local_tokens() const { return impl_->tokens_local; }
std::size_t CausalConv::dim() const { return impl_->dim; }
std::size_t CausalConv::width() const { return impl_->width; }
std::size_t CausalConv::sequences() const { return impl_->seqs.count(); }
std::size_t CausalConv::rank() const { return impl_->rank; }
const std::vector<CausalConv::Transfer>& CausalConv::transfers() const {
  return impl_->transfers;
}

template <class T>
Saved<T> CausalConv::forward(const Tensors<T>& in, std::type_identity_t<T>* y,
                             std::type_identity_t<T>* final_state) const {
  const Impl& m = *impl_;
  if (!in.x || !in.weight || !y)
    throw InvalidArgument("causal_conv1d: x, weight and y must be given");
  const std::size_t h = m.hist_rows(), d = m.dim, w = m.width, B = m.batch;
  const std::size_t N = m.seqs.count();
  Saved<T> saved;
  m.agree(in, final_state != nullptr, "causal_conv1d forward");
  saved.history.assign(m.local.size() * B * h * d, T(0));
  m.fill_initial(in.initial_state, saved.history);
  m.exchange_x(in.x, saved.history);

  std::vector<double> wt(w * d);  // weight transposed: [W][D]
  for (std::size_t c = 0; c < d; ++c)
    for (std::size_t k = 0; k < w; ++k) wt[k * d + c] = static_cast<double>(in.weight[c * w + k]);
  const bool want_ht = final_state != nullptr;
  const bool gather_ht = want_ht && m.comm && m.ranks > 1;
  std::vector<T> ht_slots(gather_ht ? N * d * w * m.ranks : 0, T(0));
  T* ht = gather_ht ? ht_slots.data() + m.rank * N * d * w : final_state;

  std::vector<double> acc(d);
  std::vector<T> scratch;
  for (std::size_t li = 0; li < m.local.size(); ++li) {
    const LocalPart& lp = m.local[li];
    for (std::size_t b = 0; b < B; ++b) {
      for (std::size_t pi = 0; pi < lp.pieces.size(); ++pi) {
        const Piece& pc = lp.pieces[pi];
        const std::size_t len = pc.end - pc.begin;
        const std::size_t pos = lp.part.local_begin + (pc.begin - lp.part.begin);
        const T* hist = m.piece_history(in.initial_state, saved.history, li, pi, b, scratch);
        const T* xs = in.x + (b * m.tokens_local + pos) * d;
        auto ext = [&](std::size_t e) { return e < h ? hist + e * d : xs + (e - h) * d; };
        T* ys = y + (b * m.tokens_local + pos) * d;
        for (std::size_t p = 0; p < len; ++p) {
          for (std::size_t c = 0; c < d; ++c)
            acc[c] = in.bias ? static_cast<double>(in.bias[c]) : 0.0;
          for (std::size_t k = 0; k < w; ++k) {
            const T* src = ext(p + k);
            const double* wk = wt.data() + k * d;
            for (std::size_t c = 0; c < d; ++c) acc[c] += wk[c] * static_cast<double>(src[c]);
          }
          T* out = ys + p * d;
          if (in.activation == Activation::silu)
            for (std::size_t c = 0; c < d; ++c) out[c] = static_cast<T>(acc[c] * sigmoid(acc[c]));
          else
            for (std::size_t c = 0; c < d; ++c) out[c] = static_cast<T>(acc[c]);
        }
        if (want_ht && pc.ends) {
          const std::size_t n = m.seq_index(pc.ends, b);
          for (std::size_t j = 0; j < w; ++j) {
            const T* src = ext(len - 1 + j);
            for (std::size_t c = 0; c < d; ++c) ht[(n * d + c) * w + j] = src[c];
          }
        }
      }
    }
  }
  if (gather_ht) {
    m.comm->all_gather(bytes(ht_slots));
    const std::size_t row = d * w;
    for (std::size_t n = 0; n < N; ++n)
      std::memcpy(final_state + n * row, ht_slots.data() + (m.last_owner[n] * N + n) * row,
                  row * sizeof(T));
  }
  require_finite_result<T>({y, B * m.tokens_local * d}, {B, m.tokens_local, d}, "y", "forward");
  if (want_ht)
    require_finite_result<T>({final_state, N * d * w}, {N, d, w}, "final_state", "forward");
  return saved;
}

template <class T>
void CausalConv::backward(const Tensors<T>& in, const Saved<T>& saved,
                          const std::type_identity_t<T>* dy,
                          const std::type_identity_t<T>* d_final_state,
                          const Grads<T>& grads) const {
  const Impl& m = *impl_;
  if (!in.x || !in.weight || !dy || !grads.dx || !grads.dweight)
    throw InvalidArgument("causal_conv1d backward: x, weight, dy, dx and dweight must be given");
  if (in.bias && !grads.dbias)
    throw InvalidArgument("causal_conv1d backward: a bias is given, expected its gradient dbias");
  if (in.initial_state && !grads.dinitial_state)
    throw InvalidArgument(
        "causal_conv1d backward: an initial state is given, expected its gradient "
        "dinitial_state");
  const std::size_t h = m.hist_rows(), d = m.dim, w = m.width, B = m.batch;
  const std::size_t N = m.seqs.count();
  if (saved.history.size() != m.local.size() * B * h * d)
    throw InvalidArgument(fmt::format(
        "causal_conv1d backward: saved history of {} elements, expected {} (another forward's?)",
        saved.history.size(), m.local.size() * B * h * d));
  m.agree(in, d_final_state != nullptr, "causal_conv1d backward");

  // The final state's gradient, summed over the ranks.
  std::vector<double> dht;
  if (d_final_state) {
    dht.assign(d_final_state, d_final_state + N * d * w);
    m.sum_over_ranks(dht);
  }
  std::vector<double> wt(w * d), dw(w * d, 0.0), db(d, 0.0);
  std::vector<double> dh0(in.initial_state ? N * d * w : 0, 0.0);
  for (std::size_t c = 0; c < d; ++c)
    for (std::size_t k = 0; k < w; ++k) wt[k * d + c] = static_cast<double>(in.weight[c * w + k]);
  std::vector<T> scratch;
  // Blocks of kBlock tokens: g (the gradient of the pre-activation z) of
  // the block, and the gradient of the extended row [history; tokens] over
  // the block's ext rows plus the W-1 after it (carried to the next block).
  constexpr std::size_t kBlock = 64;
  std::vector<double> g(kBlock * d), dext((kBlock + h) * d);
  // Across cuts: g of the first W-1 tokens of each part that continues a
  // sequence (sent to the parts before it), the last W-1 ext rows of each
  // part whose last piece continues into a later part (finished once the g
  // of the W-1 tokens after it, `next`, arrived).
  const std::size_t rows = m.local.size() * B * h * d;
  std::vector<double> first(rows, 0.0), next(rows, 0.0), carry(rows, 0.0);
  const std::vector<std::size_t>& bounds = m.seqs.boundaries();
  // Piece pi of local part li, row b: where its ext rows' gradients go.
  using Target = detail::PieceTarget<T>;
  auto target = [&](std::size_t li, std::size_t b, std::size_t pi) {
    const LocalPart& lp = m.local[li];
    const Piece& pc = lp.pieces[pi];
    const std::size_t pos = lp.part.local_begin + (pc.begin - lp.part.begin);
    const std::size_t seq = pi == 0 ? m.state_row(lp, b) : m.seq_index(pc.starts, b);
    const std::size_t seq_end = m.seqs.packed() ? bounds[seq + 1] : m.seqs.tokens();
    return Target{grads.dx + (b * m.tokens_local + pos) * d, pc.end - pc.begin, seq, seq_end,
                  pc.end, pi == 0 && lp.part.begin > lp.seq_start,
                  pi + 1 == lp.pieces.size() && !pc.ends};
  };
  // The final gradient of ext row e of a piece: its final-state term (the
  // last W rows of a sequence), then into dx (a token of the piece), dh0 (a
  // history row of a piece that starts its sequence) or nowhere (history
  // rows of a continuing piece: their owners, or the sequence's first part
  // for initial-state columns, have all their terms).
  auto emit = [&](const Target& tg, std::size_t e, double* de) {
    if (!dht.empty() && tg.end + e + 1 >= tg.seq_end + tg.len) {
      const std::size_t col = tg.end + e + 1 - tg.seq_end - tg.len;  // e + 1 - len at the end
      for (std::size_t c = 0; c < d; ++c) de[c] += dht[(tg.seq * d + c) * w + col];
    }
    if (e >= h) {
      T* dst = tg.dx + (e - h) * d;
      for (std::size_t c = 0; c < d; ++c) dst[c] = static_cast<T>(de[c]);
    } else if (!tg.continues_in && !dh0.empty()) {
      const std::size_t col = w - h + e;
      for (std::size_t c = 0; c < d; ++c) dh0[(tg.seq * d + c) * w + col] += de[c];
    }
  };
  for (std::size_t li = 0; li < m.local.size(); ++li) {
    const LocalPart& lp = m.local[li];
    for (std::size_t b = 0; b < B; ++b) {
      for (std::size_t pi = 0; pi < lp.pieces.size(); ++pi) {
        const Piece& pc = lp.pieces[pi];
        const Target tg = target(li, b, pi);
        const std::size_t len = tg.len;
        const std::size_t pos = lp.part.local_begin + (pc.begin - lp.part.begin);
        const T* hist = m.piece_history(in.initial_state, saved.history, li, pi, b, scratch);
        const T* xs = in.x + (b * m.tokens_local + pos) * d;
        auto ext = [&](std::size_t e) { return e < h ? hist + e * d : xs + (e - h) * d; };
        const T* dys = dy + (b * m.tokens_local + pos) * d;
        std::fill(dext.begin(), dext.begin() + static_cast<std::ptrdiff_t>(h * d), 0.0);
        for (std::size_t p0 = 0; p0 < len; p0 += kBlock) {
          const std::size_t nb = std::min(kBlock, len - p0);
          // dext row i is ext row p0 + i; rows [0, h) carry over.
          std::fill(dext.begin() + static_cast<std::ptrdiff_t>(h * d),
                    dext.begin() + static_cast<std::ptrdiff_t>((h + nb) * d), 0.0);
          for (std::size_t i = 0; i < nb; ++i) {
            const std::size_t p = p0 + i;
            double* gp = g.data() + i * d;
            detail::pre_activation_grad(in, wt.data(), d, w, [&](std::size_t k) { return ext(p + k); },
                                        dys + p * d, gp);
            if (tg.continues_in && p < h)
              std::copy_n(gp, d, first.data() + ((li * B + b) * h + p) * d);
            for (std::size_t c = 0; c < d; ++c) db[c] += gp[c];
            for (std::size_t k = 0; k < w; ++k) {
              const T* src = ext(p + k);
              const double* wk = wt.data() + k * d;
              double* dwk = dw.data() + k * d;
              double* de = dext.data() + (i + k) * d;
              for (std::size_t c = 0; c < d; ++c) {
                dwk[c] += gp[c] * static_cast<double>(src[c]);
                de[c] += gp[c] * wk[c];
              }
            }
          }
          // Ext rows p0 .. p0+nb-1 have all their terms (from tokens <= them).
          for (std::size_t i = 0; i < nb; ++i) emit(tg, p0 + i, dext.data() + i * d);
          std::copy(dext.begin() + static_cast<std::ptrdiff_t>(nb * d),
                    dext.begin() + static_cast<std::ptrdiff_t>((nb + h) * d), dext.begin());
        }
        // The last W-1 ext rows (the piece's last tokens): complete, or
        // waiting for the terms of the tokens after the part.
        if (tg.continues_out)
          std::copy_n(dext.begin(), h * d, carry.begin() + static_cast<std::ptrdiff_t>((li * B + b) * h * d));
        else
          for (std::size_t i = 0; i < h; ++i) emit(tg, len + i, dext.data() + i * d);
      }
    }
  }
  m.exchange_g(first, next);
  for (std::size_t li = 0; li < m.local.size(); ++li) {
    for (std::size_t b = 0; b < B; ++b) {
      const Target tg = target(li, b, m.local[li].pieces.size() - 1);
      if (!tg.continues_out) continue;
      double* rows_b = carry.data() + (li * B + b) * h * d;
      const double* gn = next.data() + (li * B + b) * h * d;
      // Token j after the part reads ext rows len + j + k: carry row j + k.
      const std::size_t after = std::min(h, tg.seq_end - tg.end);
      for (std::size_t j = 0; j < after; ++j)
        for (std::size_t k = 0; j + k < h; ++k) {
          const double* wk = wt.data() + k * d;
          double* de = rows_b + (j + k) * d;
          for (std::size_t c = 0; c < d; ++c) de[c] += gn[j * d + c] * wk[c];
        }
      for (std::size_t i = 0; i < h; ++i) emit(tg, tg.len + i, rows_b + i * d);
    }
  }
  for (std::size_t c = 0; c < d; ++c) {
    for (std::size_t k = 0; k < w; ++k) grads.dweight[c * w + k] = static_cast<T>(dw[k * d + c]);
    if (grads.dbias && in.bias) grads.dbias[c] = static_cast<T>(db[c]);
  }
  if (in.initial_state) {
    m.sum_over_ranks(dh0);
    for (std::size_t k = 0; k < dh0.size(); ++k) grads.dinitial_state[k] = static_cast<T>(dh0[k]);
  }
  detail::require_finite_grads(in, grads, B, m.tokens_local, d, w, N);
}

template Saved<float> CausalConv::forward(const Tensors<float>&, float*, float*) const;
template Saved<double> CausalConv::forward(const Tensors<double>&, double*, double*) const;
template void CausalConv::backward(const Tensors<float>&, const Saved<float>&, const float*,
                                   const float*, const Grads<float>&) const;
template void CausalConv::backward(const Tensors<double>&, const Saved<double>&, const double*,
                                   const double*, const Grads<double>&) const;

}  // namespace kdacp::conv
