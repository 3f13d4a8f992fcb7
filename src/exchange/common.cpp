#include "exchange/common.hpp"

#include <cstdint>
#include <cstring>
#include <string>
#include <utility>

#include <fmt/format.h>

#include "kdacp/error.hpp"

namespace kdacp::detail {

PackedSlots::PackedSlots(const SummaryShape& shape, std::size_t count)
    : shape_(shape),
      count_(count),
      // Every slot is packed or gathered before it is read.
      // Each slot's flags after its data.
      buf_(count * stride_of(shape), FlagStripes{stride_of(shape), stride_of(shape) - kSlotTailBytes, kSlotTailBytes}) {}

std::size_t PackedSlots::stride_of(const SummaryShape& shape) {
  return shape.packed_elems() * dtype_size(shape.dtype) + kSlotTailBytes;
}

std::size_t PackedSlots::slot_stride_bytes() const { return stride_of(shape_); }

void PackedSlots::pack(std::size_t index, const StateView& offset, const StateView& transfer,
                       bool cut) {
  const Slots s = slots();
  const StateView so = s.offsets.slot(index), sm = s.transfers.slot(index);
  const std::size_t k = shape_.key_dim, e = dtype_size(shape_.dtype);
  auto at = [e](const StateView& v, std::size_t slab, std::size_t row) {
    return static_cast<char*>(v.data) +
           e * ((slab / v.heads) * v.batch_stride + (slab % v.heads) * v.head_stride + row * v.row_stride);
  };
  for (std::size_t slab = 0; slab < shape_.slabs(); ++slab) {
    for (std::size_t i = 0; i < k; ++i) {
      std::memcpy(at(so, slab, i), at(offset, slab, i), shape_.value_dim * e);
      if (!cut) std::memcpy(at(sm, slab, i), at(transfer, slab, i), k * e);
    }
  }
  std::byte* tail = slot_bytes(index).data() + slot_stride_bytes() - kSlotTailBytes;
  std::memset(tail, 0, kSlotTailBytes);
  tail[0] = std::byte{cut ? std::uint8_t{1} : std::uint8_t{0}};
}

bool PackedSlots::cut(std::size_t index) const {
  const std::byte* tail = slot_bytes(index).data() + slot_stride_bytes() - kSlotTailBytes;
  return tail[0] != std::byte{0};
}

std::optional<std::size_t> PackedSlots::last_cut(std::size_t first, std::size_t end) const {
  for (std::size_t i = end; i > first; --i)
    if (cut(i - 1)) return i - 1;
  return std::nullopt;
}

std::optional<std::size_t> PackedSlots::first_cut(std::size_t first, std::size_t end) const {
  for (std::size_t i = first; i < end; ++i)
    if (cut(i)) return i;
  return std::nullopt;
}

Slots PackedSlots::slots() const {
  const std::size_t k = shape_.key_dim, v = shape_.value_dim, cols = shape_.packed_cols();
  StateView off;
  off.data = buf_.data();
  off.dtype = shape_.dtype;
  off.batch = shape_.batch;
  off.heads = shape_.heads;
  off.rows = k;
  off.cols = v;
  off.row_stride = cols;
  off.head_stride = k * cols;
  off.batch_stride = shape_.heads * k * cols;
  StateView tr = off;
  // No slots (count 0): no buffer, and no offset into a null pointer either.
  tr.data = off.data ? static_cast<char*>(off.data) + v * dtype_size(shape_.dtype) : nullptr;
  tr.cols = k;
  const std::size_t stride = slot_stride_bytes() / dtype_size(shape_.dtype);
  return Slots{StackView{off, count_, stride}, StackView{tr, count_, stride}};
}

std::span<std::byte> PackedSlots::bytes() const {
  return {reinterpret_cast<std::byte*>(buf_.data()), buf_.bytes()};
}

std::span<std::byte> PackedSlots::slot_bytes(std::size_t index) const {
  const std::size_t n = slot_stride_bytes();
  return bytes().subspan(index * n, n);
}

std::span<std::byte> bytes_of(const State& s) {
  return {reinterpret_cast<std::byte*>(s.data()), s.bytes()};
}

std::span<const std::byte> bytes_of(const StateView& v) {
  const std::size_t n = v.batch * v.heads * v.rows * v.cols * dtype_size(v.dtype);
  return {static_cast<const std::byte*>(v.data), n};
}

void check_group_width(std::size_t rank, std::size_t size, std::size_t width) {
  if (size % width != 0)
    throw InvalidArgument(fmt::format(
        "rank {}: allgather_group_size {} does not divide the state CP size {}, expected a divisor",
        rank, width, size));
}

Slots single_slot(const StateView& offset, const StateView& transfer) {
  return Slots{StackView{offset, 1, 0}, StackView{transfer, 1, 0}};
}

State dense_copy(const StateView& view) {
  State out(view.batch, view.heads, view.rows, view.cols, view.dtype);
  const StateView o = out.view();
  const std::size_t e = dtype_size(view.dtype);
  for (std::size_t slab = 0; slab < view.slabs(); ++slab)
    for (std::size_t i = 0; i < view.rows; ++i)
      std::memcpy(static_cast<char*>(o.data) + e * (slab * o.head_stride + i * o.row_stride),
                  static_cast<const char*>(view.data) +
                      e * ((slab / view.heads) * view.batch_stride +
                           (slab % view.heads) * view.head_stride + i * view.row_stride),
                  view.cols * e);
  return out;
}

CallMeter::CallMeter(std::vector<const Communicator*> comms) : comms_(std::move(comms)) {
  for (const Communicator* c : comms_) before_.push_back(c ? c->stats() : CommStats{});
}

ExchangeStats CallMeter::finish(std::size_t returned_bytes) const {
  ExchangeStats st;
  for (std::size_t i = 0; i < comms_.size(); ++i) {
    if (!comms_[i]) continue;
    const CommStats now = comms_[i]->stats();
    st.bytes_sent += now.bytes_sent - before_[i].bytes_sent;
    st.bytes_received += now.bytes_received - before_[i].bytes_received;
  }
  const std::size_t peak = scope_.peak();
  st.peak_extra_bytes = peak > returned_bytes ? peak - returned_bytes : 0;
  return st;
}

}  // namespace kdacp::detail
