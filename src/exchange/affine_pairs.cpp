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

namespace {
// The flags, then S and M (a packed slot's elements).
std::size_t pair_bytes(const SummaryShape& s) { return kSlotTailBytes + s.packed_elems() * dtype_size(s.dtype); }
}  // namespace

PairBuffer::PairBuffer(const SummaryShape& shape)
    : shape_(shape),
      // Every part is written before it is read; one stripe of flags, first.
      buf_(pair_bytes(shape), FlagStripes{pair_bytes(shape), 0, kSlotTailBytes}) {}

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

}  // namespace kdacp::detail
