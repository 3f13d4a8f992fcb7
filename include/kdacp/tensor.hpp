// Non-owning strided views for summaries and states, and an owning,
// 64-byte-aligned byte buffer. Deliberately tiny: no tensor library dependency.
//
// Layouts (SPEC §2): per-rank state/summary [B,H,rows,cols] and rank-stacked
// [P,B,H,rows,cols]. Strides are in elements. The column stride must be 1 and
// the batch stride must equal heads * head_stride (validated by summary.hpp,
// not here: a view can describe anything, the contract decides what is valid).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace kdacp {

// float32 is the exchange's production type, float64 the verification path.
enum class DType : std::uint8_t { f32, f64 };
std::string to_string(DType dtype);
std::size_t dtype_size(DType dtype);

enum class DeviceKind : std::uint8_t { cpu, cuda, npu };
struct Device {
  DeviceKind kind = DeviceKind::cpu;
  int index = 0;
  friend bool operator==(const Device&, const Device&) = default;
};
std::string to_string(Device device);

// [B,H,rows,cols] view. `data` points at element (0,0,0,0).
struct StateView {
  void* data = nullptr;
  DType dtype = DType::f32;
  Device device{};
  std::size_t batch = 0, heads = 0, rows = 0, cols = 0;
  std::size_t batch_stride = 0, head_stride = 0, row_stride = 0, col_stride = 1;

  // Dense row-major view of `dtype` elements at `data`.
  static StateView dense(void* data, std::size_t batch, std::size_t heads, std::size_t rows,
                         std::size_t cols, DType dtype = DType::f32);
  std::size_t slabs() const { return batch * heads; }
  // Start of the (b,h) matrix; T must match dtype (float for f32).
  template <class T = float>
  T* slab(std::size_t b, std::size_t h) const {
    return static_cast<T*>(data) + b * batch_stride + h * head_stride;
  }
  // Start of the i-th (b,h) matrix in b-major order.
  template <class T = float>
  T* slab(std::size_t i) const {
    return slab<T>(i / heads, i % heads);
  }
  bool is_dense() const {
    return col_stride == 1 && row_stride == cols && head_stride == rows * cols &&
           batch_stride == heads * head_stride;
  }
};

// [P,B,H,rows,cols] view; slot(r) is rank r's [B,H,rows,cols] view.
struct StackView {
  StateView base{};  // slot 0
  std::size_t ranks = 0;
  std::size_t rank_stride = 0;

  StateView slot(std::size_t r) const {
    StateView v = base;
    v.data = static_cast<char*>(base.data) + r * rank_stride * dtype_size(base.dtype);
    return v;
  }
};

// Owning, 64-byte-aligned raw storage of `bytes` bytes, zero-filled unless
// asked not to. Allocation is reported to the calling thread's MemoryScope
// (see memory.hpp) so that protocols can measure their peak extra bytes.
class Buffer {
 public:
  // Storage a caller overwrites completely need not be zeroed first.
  enum class Init { zero, uninitialized };
  Buffer() = default;
  explicit Buffer(std::size_t bytes, Init init = Init::zero);
  Buffer(Buffer&&) noexcept;
  Buffer& operator=(Buffer&&) noexcept;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer();

  std::byte* data() const { return data_; }
  std::size_t bytes() const { return bytes_; }
  // The storage as an array of T (float or double): the caller sized it in
  // elements of T, and the 64-byte alignment suits either.
  template <class T>
  T* as() const {
    return static_cast<T*>(static_cast<void*>(data_));
  }

 private:
  void release() noexcept;
  std::byte* data_ = nullptr;
  std::size_t bytes_ = 0;
};

// A dense, zero-initialised [B,H,rows,cols] tensor of float32 (the exchange's
// production type) or float64 (the verification path): a Buffer plus shape.
class State {
 public:
  State() = default;
  // Zeroed unless `init` says the caller overwrites every element.
  State(std::size_t batch, std::size_t heads, std::size_t rows, std::size_t cols,
        DType dtype = DType::f32, Buffer::Init init = Buffer::Init::zero);

  StateView view() const;
  // T must match dtype (float for f32, double for f64).
  template <class T = float>
  T* data() const {
    return buf_.as<T>();
  }
  DType dtype() const { return dtype_; }
  // Elements (not floats) and bytes.
  std::size_t size() const { return batch_ * heads_ * rows_ * cols_; }
  std::size_t bytes() const { return size() * dtype_size(dtype_); }
  std::size_t batch() const { return batch_; }
  std::size_t heads() const { return heads_; }
  std::size_t rows() const { return rows_; }
  std::size_t cols() const { return cols_; }

 private:
  Buffer buf_;
  std::size_t batch_ = 0, heads_ = 0, rows_ = 0, cols_ = 0;
  DType dtype_ = DType::f32;
};

}  // namespace kdacp
