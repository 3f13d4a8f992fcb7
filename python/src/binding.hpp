// Shared pieces of the binding: tensors arrive from Python as plain
// descriptors (data pointer, shape, strides in elements, dtype name) that
// kdacp views alias without a copy, and results leave as NumPy arrays that own
// their kdacp storage (torch.from_numpy aliases them, again without a copy).
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "kdacp/half.hpp"
#include "kdacp/tensor.hpp"
#include "kdacp/kernels.hpp"
#include "kdacp/layout.hpp"
#include "kdacp/thread_pool.hpp"

namespace kdacp::python {

// (data_ptr, shape, strides, dtype) of a CPU tensor, as kdacp.torch builds it.
struct TensorDesc {
  std::uintptr_t data = 0;
  std::vector<std::size_t> shape;
  std::vector<std::size_t> strides;
  DType dtype = DType::f32;
};
TensorDesc to_desc(const pybind11::tuple& t);

// A 4-D descriptor as a [B,H,rows,cols] view.
StateView state_view(const TensorDesc& d, const char* field);
// A 5-D descriptor as a [P,B,H,rows,cols] stack.
StackView stack_view(const TensorDesc& d, const char* field);

// NumPy array owning `state` (moved to the heap, freed with the array).
pybind11::array state_array(State&& state);

// A fresh, uninitialised NumPy array of `dtype` and `shape` (C order).
pybind11::array new_array(DType dtype, const std::vector<std::size_t>& shape);

// Storage types by kdacp.torch's names: "float32", "float64", "bfloat16",
// "float16". The KDA layer, its transforms and the convolution compute in T
// = float for the first and the 16-bit ones, double for float64; a 16-bit
// input is read in place by the chunk kernels (kda::HalfInputs) or widened
// once on the way in, and a result narrowed once on the way out
// (kdacp/half.hpp).

// The 16-bit type of `dtype`, nullopt for T's own name; InvalidArgument
// naming `name` for a dtype T cannot hold.
template <class T>
std::optional<Half> storage_of(std::string_view dtype, std::string_view name);

// An input of n elements at address p (0: absent) stored as `dtype`, read
// as T: the memory itself, or a widened copy made on first use (no GIL
// needed); or, for a 16-bit input the kernels read in place, its bits
// (half(): no copy).
template <class T>
class InputOf {
 public:
  InputOf(std::uintptr_t p, std::string_view dtype, std::size_t n, std::string_view name)
      : p_(reinterpret_cast<const void*>(p)), half_(storage_of<T>(dtype, name)), n_(n) {}
  const T* get() {
    if (!p_ || !half_) return static_cast<const T*>(p_);
    if constexpr (std::is_same_v<T, float>) {
      if (!wide_.data()) {
        wide_ = Buffer(n_ * sizeof(float), Buffer::Init::uninitialized);
        widen(*half_, static_cast<const std::uint16_t*>(p_), n_, wide_.as<float>());
      }
      return wide_.as<float>();
    } else {
      return nullptr;  // unreachable: storage_of<double> accepts float64 only
    }
  }
  // The bits of a 16-bit input (null bits for T's own storage or absent).
  HalfField half() const {
    if (!p_ || !half_) return {};
    return {static_cast<const std::uint16_t*>(p_), *half_};
  }

 private:
  const void* p_;
  std::optional<Half> half_;
  std::size_t n_;
  Buffer wide_;  // from the buffer cache: the next call's widening reuses its pages
};

// A result of `shape` stored as `dtype`: a NumPy array (int16 bits for a
// 16-bit type; kdacp.torch views them as the torch dtype) made with the GIL
// held; computed into get() and, for a 16-bit type, narrowed by finish()
// (no GIL needed), which throws InvalidArgument naming `op`, the result, the
// element and its value when a finite value overflows the type.
template <class T>
class OutputOf {
 public:
  OutputOf(std::string_view dtype, const std::vector<std::size_t>& shape, std::string name);
  T* get() {
    if constexpr (std::is_same_v<T, float>)
      if (wide_.data()) return wide_.as<float>();
    return static_cast<T*>(array.mutable_data());
  }
  void finish(const char* op);

  pybind11::array array;

 private:
  std::optional<Half> half_;
  std::vector<std::size_t> shape_;
  std::string name_;
  std::size_t n_ = 0;
  Buffer wide_;
};

// A worker pool owned by one Python object (exchange or layer): nothing is
// shared between objects, nothing is global.
struct Pool {
  explicit Pool(std::size_t threads)
      : pool(threads > 1 ? std::make_unique<ThreadPool>(threads) : nullptr) {}
  ExecPolicy exec() const { return ExecPolicy{pool.get(), KernelKind::best}; }
  std::unique_ptr<ThreadPool> pool;
};

// A tensor's address from Python as a typed pointer.
template <class T>
const T* ptr(std::uintptr_t p) {
  return reinterpret_cast<const T*>(p);
}

// The rule for the gradient of an initial state every rank holds whole
// (`grad`: [N, row elements], the complete gradient, the same on every rank):
// each rank keeps its share, the rows of the sequences whose first token it
// holds in `layout` (without cu_seqlens: token 0, so every batch row, on the
// rank holding it) and -0.0 in the others. Summed over the ranks, as the
// trainer's all-reduce sums every parameter's gradient, that is the complete
// gradient bit for bit in any order: -0.0 + x is x for every x, -0.0 too.
template <class T>
void keep_started_rows(T* grad, std::size_t row, const Layout& layout, std::size_t rank,
                       const Sequences& seqs) {
  std::vector<bool> mine(seqs.count(), false);
  for (const Part& part : layout.local_parts(rank)) {
    const SequenceRange started = part_info(seqs, part).started;
    for (std::size_t n = started.first; n < started.first + started.count; ++n) mine[n] = true;
  }
  for (std::size_t n = 0; n < mine.size(); ++n)
    if (!mine[n]) std::fill(grad + n * row, grad + (n + 1) * row, static_cast<T>(-0.0));
}

void bind_exchange(pybind11::module_& m);
void bind_kda(pybind11::module_& m);
void bind_kda_layer(pybind11::module_& m);
void bind_checks(pybind11::module_& m);
void bind_conv(pybind11::module_& m);

}  // namespace kdacp::python
