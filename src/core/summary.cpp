#include "kdacp/summary.hpp"

#include <fmt/format.h>

#include "kdacp/error.hpp"

namespace kdacp {

std::string to_string(const SummaryShape& s) {
  return fmt::format("[B={},H={},K={},V={}]", s.batch, s.heads, s.key_dim, s.value_dim);
}

namespace {

[[noreturn]] void fail(std::size_t rank, const std::string& field, const std::string& what,
                       const std::string& value, const std::string& expected) {
  throw InvalidArgument(fmt::format("rank {}: {} {} is {}, expected {}", rank, field, what, value, expected));
}

std::string shape_str(const StateView& v) {
  return fmt::format("[{},{},{},{}]", v.batch, v.heads, v.rows, v.cols);
}

void check_dim(std::size_t value, const std::string& field, const std::string& what,
               std::size_t rank) {
  if (value < kMinDim || value > kMaxDim) {
    fail(rank, field, what, fmt::to_string(value), fmt::format("an integer in [{}, {}]", kMinDim, kMaxDim));
  }
}

}  // namespace

void validate_view(const StateView& v, const std::string& field, std::size_t rank) {
  if (v.dtype != DType::f32 && v.dtype != DType::f64)
    fail(rank, field, "dtype", to_string(v.dtype), "float32 (or float64 for verification)");
  if (v.device.kind != DeviceKind::cpu)
    fail(rank, field, "device", to_string(v.device), "a cpu device (the only one built)");
  if (v.data == nullptr) fail(rank, field, "data pointer", "null", "non-null");
  if (v.batch == 0) fail(rank, field, "batch size B", "0", "B >= 1");
  if (v.heads == 0) fail(rank, field, "head count H", "0", "H >= 1");
  if (v.col_stride != 1)
    fail(rank, field, "column stride", fmt::to_string(v.col_stride), "1 (contiguous columns)");
  if (v.row_stride < v.cols)
    fail(rank, field, "row stride", fmt::to_string(v.row_stride), fmt::format(">= cols = {}", v.cols));
  if (v.head_stride < v.rows * v.row_stride && v.heads > 1)
    fail(rank, field, "head stride", fmt::to_string(v.head_stride),
         fmt::format(">= rows * row stride = {}", v.rows * v.row_stride));
  if (v.batch_stride != v.heads * v.head_stride && v.batch > 1)
    fail(rank, field, "batch stride", fmt::to_string(v.batch_stride),
         fmt::format("heads * head stride = {}", v.heads * v.head_stride));
}

SummaryShape validate_summary(const StateView& offset, const StateView& transfer,
                              const std::string& offset_name, std::size_t rank) {
  validate_view(offset, offset_name, rank);
  validate_view(transfer, "M", rank);
  if (offset.dtype != transfer.dtype)
    fail(rank, "M", "dtype", to_string(transfer.dtype),
         fmt::format("the dtype of {} ({})", offset_name, to_string(offset.dtype)));
  if (!(offset.device == transfer.device))
    fail(rank, "M", "device", to_string(transfer.device),
         fmt::format("the device of {} ({})", offset_name, to_string(offset.device)));
  check_dim(offset.rows, offset_name, "key dim K (rows)", rank);
  check_dim(offset.cols, offset_name, "value dim V (cols)", rank);
  if (transfer.batch != offset.batch || transfer.heads != offset.heads ||
      transfer.rows != offset.rows || transfer.cols != offset.rows) {
    fail(rank, "M", "shape", shape_str(transfer),
         fmt::format("[{},{},{},{}] to match {} {}", offset.batch, offset.heads, offset.rows,
                     offset.rows, offset_name, shape_str(offset)));
  }
  return {offset.batch, offset.heads, offset.rows, offset.cols, offset.dtype};
}

SummaryShape validate_stack(const StackView& offsets, const StackView& transfers,
                            std::size_t rank) {
  if (offsets.ranks == 0) fail(rank, "stacked offsets", "rank count P", "0", "P >= 1");
  if (transfers.ranks != offsets.ranks)
    fail(rank, "stacked M", "rank count P", fmt::to_string(transfers.ranks),
         fmt::format("{} to match the offsets", offsets.ranks));
  SummaryShape shape = validate_summary(offsets.base, transfers.base, "S", rank);
  std::size_t slot_span = (offsets.base.batch - 1) * offsets.base.batch_stride +
                          (offsets.base.heads - 1) * offsets.base.head_stride;
  if (offsets.ranks > 1 && offsets.rank_stride <= slot_span)
    fail(rank, "stacked offsets", "rank stride", fmt::to_string(offsets.rank_stride),
         fmt::format("> {} (slots must not overlap)", slot_span));
  return shape;
}

}  // namespace kdacp
