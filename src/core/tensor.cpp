#include "kdacp/tensor.hpp"

#include <cstdlib>
#include <cstring>
#include <new>
#include <utility>

#include <fmt/format.h>

#include "core/buffer_allocator.hpp"
#include "kdacp/error.hpp"
#include "kdacp/memory.hpp"

namespace kdacp {

std::string to_string(DType dtype) {
  switch (dtype) {
    case DType::f32: return "float32";
    case DType::f64: return "float64";
  }
  return "unknown";
}

std::size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::f32: return 4;
    case DType::f64: return 8;
  }
  throw InvalidArgument(fmt::format("dtype {}, expected float32 or float64", static_cast<int>(dtype)));
}

std::string to_string(Device device) {
  const char* kind = device.kind == DeviceKind::cpu    ? "cpu"
                     : device.kind == DeviceKind::cuda ? "cuda"
                                                       : "npu";
  return fmt::format("{}:{}", kind, device.index);
}

StateView StateView::dense(void* data, std::size_t batch, std::size_t heads, std::size_t rows,
                           std::size_t cols, DType dtype) {
  StateView v;
  v.data = data;
  v.dtype = dtype;
  v.batch = batch;
  v.heads = heads;
  v.rows = rows;
  v.cols = cols;
  v.row_stride = cols;
  v.head_stride = rows * cols;
  v.batch_stride = heads * rows * cols;
  return v;
}

Buffer::Buffer(std::size_t bytes, Init init) : bytes_(bytes) {
  if (bytes == 0) return;
  data_ = static_cast<std::byte*>(detail::buffer_allocate(detail::buffer_allocated_bytes(bytes)));
  if (init == Init::zero) std::memset(data_, 0, bytes);
#if defined(KDACP_FILL_UNINITIALIZED)
  if (init == Init::uninitialized) std::memset(data_, 0xff, bytes);  // NaN
#endif
  MemoryScope::on_alloc(bytes_);
}

Buffer::Buffer(Buffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}

Buffer& Buffer::operator=(Buffer&& other) noexcept {
  if (this != &other) {
    release();
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

Buffer::~Buffer() { release(); }

void Buffer::release() noexcept {
  if (data_ == nullptr) return;
  detail::buffer_deallocate(data_, detail::buffer_allocated_bytes(bytes_));
  MemoryScope::on_free(bytes_);
  data_ = nullptr;
  bytes_ = 0;
}

State::State(std::size_t batch, std::size_t heads, std::size_t rows, std::size_t cols, DType dtype,
             Buffer::Init init)
    : buf_(batch * heads * rows * cols * dtype_size(dtype), init),
      batch_(batch),
      heads_(heads),
      rows_(rows),
      cols_(cols),
      dtype_(dtype) {}

StateView State::view() const {
  return StateView::dense(buf_.data(), batch_, heads_, rows_, cols_, dtype_);
}

}  // namespace kdacp
