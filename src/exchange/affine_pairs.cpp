#include "exchange/affine_pairs.hpp"

#include <cstdint>
#include <cstring>
#include <utility>

#include "exchange/common.hpp"
#include "kdacp/thread_pool.hpp"
#include "kernels/step.hpp"

namespace kdacp::detail {

namespace {

template <class T, class Step>
void apply_slabs(Step step, const StateView& m, const StateView& x, const StateView* s,
                 const StateView& c, bool transpose, const ExecPolicy& policy) {
  const std::size_t k = m.rows, cols = c.cols;
  // A zero offset for products: one shared read-only slab.
  Buffer zero(s ? 0 : k * cols * sizeof(T));
  const T* z = zero.as<T>();
  parallel_ranges(policy.pool, c.slabs(), [&](std::size_t begin, std::size_t end, std::size_t) {
    for (std::size_t slab = begin; slab < end; ++slab) {
      step(m.slab<T>(slab), m.row_stride, x.slab<T>(slab), x.row_stride,
           s ? s->slab<T>(slab) : z, s ? s->row_stride : cols, c.slab<T>(slab), c.row_stride, k,
           cols, transpose);
    }
  });
}

}  // namespace

void apply_step(const StateView& m, const StateView& x, const StateView* s, const StateView& c,
                bool transpose, const ExecPolicy& policy) {
  if (c.dtype == DType::f64) {
    apply_slabs<double>(step_kernel<double>(policy.kernel), m, x, s, c, transpose, policy);
  } else {
    apply_slabs<float>(step_kernel<float>(policy.kernel), m, x, s, c, transpose, policy);
  }
}

void copy_view(const StateView& src, const StateView& dst) {
  const std::size_t e = dtype_size(src.dtype);
  for (std::size_t slab = 0; slab < src.slabs(); ++slab)
    for (std::size_t i = 0; i < src.rows; ++i)
      std::memcpy(static_cast<char*>(dst.data) + e * ((slab / dst.heads) * dst.batch_stride +
                                           (slab % dst.heads) * dst.head_stride + i * dst.row_stride),
                  static_cast<const char*>(src.data) + e * ((slab / src.heads) * src.batch_stride +
                                           (slab % src.heads) * src.head_stride + i * src.row_stride),
                  src.cols * e);
}

PairBuffer::PairBuffer(const SummaryShape& shape)
    : shape_(shape),
      // Every part is written before it is read.
      buf_(kSlotTailBytes + (shape.state_elems() + shape.slabs() * shape.key_dim * shape.key_dim) *
                                dtype_size(shape.dtype),
           Buffer::Init::uninitialized) {}

StateView PairBuffer::offset() const {
  StateView v = StateView::dense(buf_.data() + kSlotTailBytes, shape_.batch, shape_.heads,
                                 shape_.key_dim, shape_.value_dim);
  v.dtype = shape_.dtype;
  return v;
}

StateView PairBuffer::transfer() const {
  StateView v = StateView::dense(buf_.data() + kSlotTailBytes, shape_.batch, shape_.heads,
                                 shape_.key_dim, shape_.key_dim);
  v.dtype = shape_.dtype;
  v.data = reinterpret_cast<char*>(buf_.data()) + kSlotTailBytes +
           shape_.state_elems() * dtype_size(shape_.dtype);
  return v;
}

bool PairBuffer::cut() const { return buf_.data()[0] != std::byte{0}; }

void PairBuffer::set_cut(bool cut) const {
  std::memset(buf_.data(), 0, kSlotTailBytes);
  buf_.data()[0] = std::byte{cut ? std::uint8_t{1} : std::uint8_t{0}};
}

std::span<std::byte> PairBuffer::bytes(bool with_transfer) const {
  const std::size_t e = dtype_size(shape_.dtype);
  const std::size_t n = with_transfer ? buf_.bytes() : kSlotTailBytes + shape_.state_elems() * e;
  return {reinterpret_cast<std::byte*>(buf_.data()), n};
}

void compose(const PairView& outer, const PairView& inner, const PairBuffer& dest,
             bool with_transfer, Direction direction, const ExecPolicy& policy) {
  const bool bwd = direction == Direction::backward;
  const StateView o = dest.offset();
  dest.set_cut(outer.cut || inner.cut);
  if (outer.cut) {
    // A constant map after anything is itself: no product with its zero transfer.
    copy_view(outer.offset, o);
    return;
  }
  apply_step(outer.transfer, inner.offset, &outer.offset, o, bwd, policy);
  if (!with_transfer || inner.cut) return;
  if (bwd) {
    apply_step(inner.transfer, outer.transfer, nullptr, dest.transfer(), false, policy);
  } else {
    apply_step(outer.transfer, inner.transfer, nullptr, dest.transfer(), false, policy);
  }
}

State rd_exclusive_scan(Communicator& comm, const PairView& own, const SummaryShape& shape,
                        Direction direction, const ExecPolicy& policy, int tag) {
  const std::size_t p = comm.size();
  const bool fwd = direction == Direction::forward;
  const std::size_t pos = fwd ? comm.rank() : p - 1 - comm.rank();
  auto rank_of = [&](std::size_t position) { return fwd ? position : p - 1 - position; };
  // Position q receives for the last time in the round of distance d with
  // d <= q < 2d: its prefix is then complete, and its later sends (all to
  // positions in their own last round) need offsets only. So last-round
  // messages carry states, not pairs, and last-round folds skip the K×K products.
  auto final_round = [](std::size_t q, std::size_t d) { return d <= q && q < 2 * d; };

  // prefix: composition of the positions received so far (the exclusive
  // result once complete); outgoing: own∘prefix, what this rank sends;
  // incoming: the receive buffer.
  PairBuffer prefix, outgoing, incoming;
  if (pos > 0) prefix = PairBuffer(shape), incoming = PairBuffer(shape);
  // The last position sends nothing but composes into `outgoing` too.
  if (p > 1) outgoing = PairBuffer(shape);
  bool have_prefix = false, packed_own = false;
  for (std::size_t d = 1; d < p; d *= 2) {
    const bool sends = pos + d < p, receives = pos >= d;
    const bool send_pair = sends && !final_round(pos + d, d);
    const bool recv_pair = receives && !final_round(pos, d);
    std::unique_ptr<Request> recv, sent;
    if (receives) recv = comm.irecv(incoming.bytes(recv_pair), rank_of(pos - d), tag);
    if (sends) {
      if (!have_prefix) {
        // Before its first receive a position sends its own pair. Only
        // position 0 sends more than once that way, always offsets only.
        if (!packed_own) {
          copy_view(own.offset, outgoing.offset());
          if (send_pair && !own.cut) copy_view(own.transfer, outgoing.transfer());
          outgoing.set_cut(own.cut);
          packed_own = true;
        }
      } else {
        compose(own, prefix.view(), outgoing, send_pair, direction, policy);
      }
      sent = comm.isend(outgoing.bytes(send_pair), rank_of(pos + d), tag);
    }
    if (receives) {
      recv->wait();
      if (!have_prefix) {
        std::swap(prefix, incoming);
        have_prefix = true;
      } else if (!recv_pair) {
        // prefix∘incoming, offset only, in place (the step may write over its
        // offset); a cut prefix does not depend on what came before it.
        if (!prefix.cut()) {
          const StateView po = prefix.offset();
          apply_step(prefix.transfer(), incoming.offset(), &po, po, !fwd, policy);
          prefix.set_cut(incoming.cut());
        }
      } else {
        // The composed pair goes to the outgoing buffer once its send is done.
        if (sent) sent->wait(), sent.reset();
        compose(prefix.view(), incoming.view(), outgoing, true, direction, policy);
        std::swap(prefix, outgoing);
      }
    }
    if (sent) sent->wait();
  }
  State result = make_state(shape);
  if (have_prefix) copy_view(prefix.offset(), result.view());
  return result;
}

}  // namespace kdacp::detail
