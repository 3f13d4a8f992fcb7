// pipelined_p2p (exact): the chain with the V columns cut into c segments
// whose widths are multiples of 16. M acts on every column alike and the step
// kernel computes each element independently of the column blocking
// (kernels.hpp), so each segment folds with exactly the chain's operations:
// bitwise identical to p2p. Rank r+1 folds segment j while rank r computes
// segment j+1, so the P-1 hops overlap: about (P + c - 2) stages of 1/c of a
// hop instead of P-1 whole hops.
//
// Messages are contiguous: the send and receive buffers are segment-major
// (segment j is a dense [B,H,K,w_j] block), the fold reads and writes those
// blocks directly, and only the received blocks are copied into the
// row-major result. Memory: two states per rank (receive and send buffers).
#include <sstream>
#include <vector>

#include "exchange/affine_pairs.hpp"
#include "exchange/common.hpp"
#include "exchange/cost_terms.hpp"
#include "kdacp/error.hpp"

namespace kdacp::detail {
namespace {

class PipelinedExchange final : public CommExchange {
 public:
  explicit PipelinedExchange(const ProtocolContext& ctx) : CommExchange(ctx, pipelined_p2p_protocol) {}

 private:
  // Column ranges of the segments: V/16 units of 16 columns dealt as evenly
  // as possible, the first ones one unit wider.
  std::vector<std::pair<std::size_t, std::size_t>> segments(const SummaryShape& shape) const {
    const std::size_t units = shape.value_dim / kDimMultiple;
    std::size_t c = config().segments;
    if (c == 0) {
      c = best_segments(options().cost,
                        ProblemShape{size_, shape.slabs(), shape.key_dim, shape.value_dim,
                                     dtype_size(shape.dtype)},
                        config().method);
    } else if (c > units) {
      std::ostringstream os;
      os << "rank " << rank_ << ": segments is " << c << " for value dim V = " << shape.value_dim
         << ", expected at most V/16 = " << units << " (segments are multiples of 16 columns)";
      throw InvalidArgument(os.str());
    }
    std::vector<std::pair<std::size_t, std::size_t>> out;
    std::size_t col = 0;
    for (std::size_t j = 0; j < c; ++j) {
      const std::size_t width = (units / c + (j < units % c ? 1 : 0)) * kDimMultiple;
      out.emplace_back(col, width);
      col += width;
    }
    return out;
  }

  // Columns [col, col+width) of a [B,H,K,V] view.
  static StateView columns(StateView v, std::size_t col, std::size_t width) {
    v.data = static_cast<char*>(v.data) + col * dtype_size(v.dtype);
    v.cols = width;
    return v;
  }
  // Segment block of a segment-major buffer: dense [B,H,K,width].
  static StateView block(const State& buf, const SummaryShape& shape, std::size_t col,
                         std::size_t width) {
    StateView v = StateView::dense(buf.data(), shape.batch, shape.heads, shape.key_dim, width);
    v.dtype = shape.dtype;
    v.data = static_cast<char*>(buf.view().data) +
             shape.slabs() * shape.key_dim * col * dtype_size(shape.dtype);
    return v;
  }
  static std::span<std::byte> block_bytes(const StateView& b) {
    return {static_cast<std::byte*>(b.data), b.slabs() * b.rows * b.cols * dtype_size(b.dtype)};
  }

  State run(const Call& call) override {
    const StateView& offset = call.offset;
    const SummaryShape& shape = call.shape;
    const Direction dir = call.direction;
    const int tag = call.tag;
    const auto segs = segments(shape);  // may throw: still before any message
    const bool fwd = dir == Direction::forward;
    const bool has_prev = fwd ? rank_ > 0 : rank_ + 1 < size_;
    const bool has_next = fwd ? rank_ + 1 < size_ : rank_ > 0;
    const std::size_t prev = fwd ? rank_ - 1 : rank_ + 1;
    const std::size_t next = fwd ? rank_ + 1 : rank_ - 1;

    // The segments cover every column: each buffer is received, folded or
    // copied whole (the first rank's result stays the zero state).
    constexpr auto kWhole = Buffer::Init::uninitialized;
    State result = make_state(shape, has_prev ? kWhole : Buffer::Init::zero);
    // One segment is the whole row-major state: receive straight into the
    // result (then c = 1 costs what p2p costs, no extra copy).
    const bool single = segs.size() == 1;
    State recv_buf, send_buf;
    if (has_prev && !single) recv_buf = make_state(shape, kWhole);
    const State& recv_into = single ? result : recv_buf;
    if (has_next) send_buf = make_state(shape, kWhole);
    // All receives up front: segments arrive in order, each completes as
    // soon as the previous rank sent it.
    std::vector<std::unique_ptr<Request>> recvs, sends;
    if (has_prev)
      for (const auto& [col, width] : segs)
        recvs.push_back(comm_->irecv(block_bytes(block(recv_into, shape, col, width)), prev, tag));
    // The first rank of the chain, and a cut, send their offset itself, the
    // cut before its own state arrives (the chain does not wait across it).
    const bool fold = has_prev && !call.cut;
    for (std::size_t j = 0; j < segs.size(); ++j) {
      const auto [col, width] = segs[j];
      const StateView in = has_prev ? block(recv_into, shape, col, width) : StateView{};
      if (fold) recvs[j]->wait();
      if (has_next) {
        const StateView out = block(send_buf, shape, col, width);
        if (fold) {
          scan(single_slot(columns(offset, col, width), call.transfer), 0, 1, dir, &in, out,
               std::nullopt, nullptr, options().exec);
        } else {
          copy_view(columns(offset, col, width), out);
        }
        sends.push_back(comm_->isend(block_bytes(out), next, tag));
      }
    }
    if (has_prev)
      for (std::size_t j = 0; j < segs.size(); ++j) {
        recvs[j]->wait();
        const auto [col, width] = segs[j];
        if (!single) copy_view(block(recv_into, shape, col, width), columns(result.view(), col, width));
      }
    for (auto& s : sends) s->wait();
    return result;
  }
};

// The first segment crosses P-1 hops and is folded on P-2 of them; every
// further segment arrives one stage later, a stage being the slowest rank's
// per-segment work (receive, fold, send).
CostTerms pipelined_cost(const ProblemShape& s, const ProtocolConfig& config) {
  CostTerms t;
  const std::size_t p = s.ranks, c = config.segments;
  if (p <= 1) return t;
  t.messages = dbl(p - 1 + c - 1);
  t.bytes = t.messages * dbl(state_bytes(s)) / dbl(c);
  t.folds = (chain_folds(p) + (p >= 3 ? dbl(c - 1) : 0)) / dbl(c);
  t.work_folds = chain_folds(p);
  // Receive and send buffers; the ends of the chain hold one of them.
  t.peak_extra_bytes = p >= 3 ? 2 * state_bytes(s) : state_bytes(s);
  return t;
}

}  // namespace

const ProtocolDescriptor pipelined_p2p_protocol{
    .name = "pipelined_p2p",
    .kind = ProtocolClass::exact,
    .takes_segments = true,
    .memory = "2 states",
    .use_when = "the exact default from P = 8 to a few hundred, any network",
    .cost = pipelined_cost,
    .build = [](const ProtocolContext& ctx) -> std::unique_ptr<StateExchange> {
      return std::make_unique<PipelinedExchange>(ctx);
    },
};

}  // namespace kdacp::detail
