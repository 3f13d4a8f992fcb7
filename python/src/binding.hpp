// Shared pieces of the binding: tensors arrive from Python as plain
// descriptors (data pointer, shape, strides in elements, dtype name) that
// kdacp views alias without a copy, and results leave as NumPy arrays that own
// their kdacp storage (torch.from_numpy aliases them, again without a copy).
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kdacp/kernels.hpp"
#include "kdacp/tensor.hpp"
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

// A worker pool owned by one Python object (exchange or layer): nothing is
// shared between objects, nothing is global.
struct Pool {
  explicit Pool(std::size_t threads)
      : pool(threads > 1 ? std::make_unique<ThreadPool>(threads) : nullptr) {}
  ExecPolicy exec() const { return ExecPolicy{pool.get(), KernelKind::best}; }
  std::unique_ptr<ThreadPool> pool;
};

void bind_exchange(pybind11::module_& m);
void bind_kda(pybind11::module_& m);
void bind_checks(pybind11::module_& m);
void bind_conv(pybind11::module_& m);

}  // namespace kdacp::python
