#include "kdacp/tensor.hpp"

#include <cstdlib>
#include <cstring>
#include <new>
#include <utility>

#include "kdacp/error.hpp"
#include "kdacp/memory.hpp"

namespace kdacp {

std::string to_string(DType dtype) {
  switch (dtype) {
    case DType::f32: return "float32";
    case DType::f64: return "float64";
    case DType::f16: return "float16";
    case DType::bf16: return "bfloat16";
  }
  return "unknown";
}

std::size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::f32: return 4;
    case DType::f64: return 8;
    case DType::f16:
    case DType::bf16: return 2;
  }
  return 0;
}

std::string to_string(Device device) {
  const char* kind = device.kind == DeviceKind::cpu    ? "cpu"
                     : device.kind == DeviceKind::cuda ? "cuda"
                                                       : "npu";
  return std::string(kind) + ":" + std::to_string(device.index);
}

StateView StateView::dense(float* data, std::size_t batch, std::size_t heads, std::size_t rows,
                           std::size_t cols) {
  StateView v;
  v.data = data;
  v.batch = batch;
  v.heads = heads;
  v.rows = rows;
  v.cols = cols;
  v.row_stride = cols;
  v.head_stride = rows * cols;
  v.batch_stride = heads * rows * cols;
  return v;
}

namespace {
constexpr std::size_t kAlign = 64;
std::size_t allocated_bytes(std::size_t floats) {
  return (floats * sizeof(float) + kAlign - 1) / kAlign * kAlign;
}
}  // namespace

Buffer::Buffer(std::size_t count, Init init) : size_(count) {
  if (count == 0) return;
  data_ = static_cast<float*>(detail::buffer_allocate(allocated_bytes(count)));
  if (init == Init::zero) std::memset(data_, 0, count * sizeof(float));
#if defined(KDACP_FILL_UNINITIALIZED)
  if (init == Init::uninitialized) std::memset(data_, 0xff, count * sizeof(float));  // NaN
#endif
  MemoryScope::on_alloc(size_ * sizeof(float));
}

Buffer::Buffer(Buffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}

Buffer& Buffer::operator=(Buffer&& other) noexcept {
  if (this != &other) {
    release();
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

Buffer::~Buffer() { release(); }

void Buffer::release() noexcept {
  if (data_ == nullptr) return;
  detail::buffer_deallocate(data_, allocated_bytes(size_));
  MemoryScope::on_free(size_ * sizeof(float));
  data_ = nullptr;
  size_ = 0;
}

namespace {
std::size_t floats_for(std::size_t elements, DType dtype) {
  if (dtype != DType::f32 && dtype != DType::f64)
    throw InvalidArgument("State dtype " + to_string(dtype) + ", expected float32 or float64");
  return elements * (dtype_size(dtype) / sizeof(float));
}
}  // namespace

State::State(std::size_t batch, std::size_t heads, std::size_t rows, std::size_t cols, DType dtype,
             Buffer::Init init)
    : buf_(floats_for(batch * heads * rows * cols, dtype), init),
      batch_(batch),
      heads_(heads),
      rows_(rows),
      cols_(cols),
      dtype_(dtype) {}

StateView State::view() const {
  StateView v = StateView::dense(buf_.data(), batch_, heads_, rows_, cols_);
  v.dtype = dtype_;
  return v;
}

}  // namespace kdacp
