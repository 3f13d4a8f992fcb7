#include "torch_comm.hpp"

#include <cstdint>
#include <utility>

#include <fmt/format.h>

#include "kdacp/error.hpp"

namespace py = pybind11;

namespace kdacp::python {
namespace {

// DLPack's ABI (dlpack.h, v0.x), enough for a 1-D uint8 CPU tensor.
struct DLDevice {
  std::int32_t device_type;
  std::int32_t device_id;
};
struct DLDataType {
  std::uint8_t code;
  std::uint8_t bits;
  std::uint16_t lanes;
};
struct DLTensor {
  void* data;
  DLDevice device;
  std::int32_t ndim;
  DLDataType dtype;
  std::int64_t* shape;
  std::int64_t* strides;
  std::uint64_t byte_offset;
};
struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(DLManagedTensor*);
};
constexpr std::int32_t kDLCPU = 1;
constexpr std::uint8_t kDLUInt = 1;

struct ByteTensor {
  DLManagedTensor managed{};
  std::int64_t shape = 0;
  std::int64_t stride = 1;
};

// A "dltensor" capsule of `bytes` bytes at `data`, which
// torch.utils.dlpack.from_dlpack turns into a uint8 tensor aliasing the C++
// buffer. Not NumPy: a NumPy-owned tensor takes the GIL when its last
// reference goes, which a backend's worker thread may drop while Python shuts
// down; this one's deleter frees a small struct and needs no GIL. The memory
// stays the caller's, valid while the C++ buffer is.
py::capsule byte_tensor(const void* data, std::size_t bytes) {
  auto* t = new ByteTensor;
  t->shape = static_cast<std::int64_t>(bytes);
  DLTensor& d = t->managed.dl_tensor;
  d.data = const_cast<void*>(data);
  d.device = DLDevice{kDLCPU, 0};
  d.ndim = 1;
  d.dtype = DLDataType{kDLUInt, 8, 1};
  d.shape = &t->shape;
  d.strides = &t->stride;
  d.byte_offset = 0;
  t->managed.manager_ctx = t;
  t->managed.deleter = [](DLManagedTensor* m) { delete static_cast<ByteTensor*>(m->manager_ctx); };
  PyObject* cap = PyCapsule_New(&t->managed, "dltensor", [](PyObject* c) {
    // Still named "dltensor": never consumed by from_dlpack, so ours to free.
    if (PyCapsule_IsValid(c, "dltensor")) {
      auto* m = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(c, "dltensor"));
      m->deleter(m);
    }
  });
  if (!cap) {
    delete t;
    throw py::error_already_set();
  }
  return py::reinterpret_steal<py::capsule>(cap);
}

// Runs fn with the GIL held; a Python exception becomes Timeout (TimeoutError)
// or RemoteError (anything else), carrying the Python message.
template <class F>
auto with_gil(const std::string& what, F&& fn) {
  py::gil_scoped_acquire gil;
  try {
    return fn();
  } catch (py::error_already_set& e) {
    std::string msg = what;
    msg += ": ";
    msg += e.what();
    if (e.matches(PyExc_TimeoutError)) throw Timeout(msg);
    throw RemoteError(msg);
  }
}

class TorchRequest final : public Request {
 public:
  TorchRequest(py::object backend, py::object handle, std::string what)
      : backend_(std::move(backend)), handle_(std::move(handle)), what_(std::move(what)) {}
  ~TorchRequest() override {
    if (!Py_IsInitialized()) {
      backend_.release();
      handle_.release();
      return;
    }
    py::gil_scoped_acquire gil;
    handle_ = py::object();
    backend_ = py::object();
  }
  void wait() override {
    if (done_) return;
    with_gil(what_, [&] {
      backend_.attr("wait")(handle_);
      handle_ = py::none();
    });
    done_ = true;
  }

 private:
  py::object backend_;
  py::object handle_;
  std::string what_;
  bool done_ = false;
};

std::string op_text(const char* op, std::size_t rank, std::size_t peer_global) {
  return fmt::format("rank {} {} peer (global rank) {}", rank, op, peer_global);
}

}  // namespace

TorchCommunicator::TorchCommunicator(py::object backend) : backend_(std::move(backend)) {
  rank_ = backend_.attr("rank").cast<std::size_t>();
  global_ranks_ = backend_.attr("global_ranks").cast<std::vector<std::size_t>>();
  world_size_ = backend_.attr("world_size").cast<std::size_t>();
  name_ = backend_.attr("name").cast<std::string>();
  timeout_ = std::chrono::milliseconds(backend_.attr("timeout_ms").cast<long long>());
  if (rank_ >= global_ranks_.size())
    throw InvalidArgument(fmt::format("torch communicator rank {} is outside its group of {}",
                                      rank_, global_ranks_.size()));
}

TorchCommunicator::~TorchCommunicator() {
  if (!Py_IsInitialized()) {
    backend_.release();
    return;
  }
  py::gil_scoped_acquire gil;
  backend_ = py::object();
}

void TorchCommunicator::check_peer(std::size_t peer, const char* op) const {
  if (peer >= size())
    throw InvalidArgument(
        fmt::format("{} peer {} is outside the group of {} ranks", op, peer, size()));
}

void TorchCommunicator::all_gather(std::span<std::byte> buffer) {
  if (buffer.size() % size() != 0)
    throw InvalidArgument(fmt::format(
        "all_gather buffer of {} bytes, expected a multiple of the group size {}", buffer.size(),
        size()));
  const std::string what = fmt::format("rank {} all_gather", global_ranks_[rank_]);
  with_gil(what, [&] { backend_.attr("all_gather")(byte_tensor(buffer.data(), buffer.size())); });
  const std::size_t slot = buffer.size() / size();
  stats_.bytes_sent += slot * (size() - 1);
  stats_.bytes_received += slot * (size() - 1);
  stats_.messages_sent += 1;
}

void TorchCommunicator::broadcast(std::span<std::byte> buffer, std::size_t root) {
  check_peer(root, "broadcast");
  const std::string what =
      fmt::format("rank {} broadcast from global rank {}", global_ranks_[rank_], global_ranks_[root]);
  with_gil(what, [&] {
    backend_.attr("broadcast")(byte_tensor(buffer.data(), buffer.size()), root);
  });
  if (root == rank_)
    stats_.bytes_sent += buffer.size() * (size() - 1);
  else
    stats_.bytes_received += buffer.size();
  stats_.messages_sent += 1;
}

void TorchCommunicator::barrier() {
  const std::string what = fmt::format("rank {} barrier", global_ranks_[rank_]);
  with_gil(what, [&] { backend_.attr("barrier")(); });
  stats_.messages_sent += 1;
}

std::unique_ptr<Request> TorchCommunicator::isend(std::span<const std::byte> data,
                                                  std::size_t peer, int tag) {
  check_peer(peer, "isend");
  const std::string what = op_text("send to", global_ranks_[rank_], global_ranks_[peer]);
  auto req = with_gil(what, [&] {
    py::object handle = backend_.attr("isend")(byte_tensor(data.data(), data.size()), peer, tag);
    return std::make_unique<TorchRequest>(backend_, std::move(handle), what);
  });
  stats_.bytes_sent += data.size();
  stats_.messages_sent += 1;
  return req;
}

std::unique_ptr<Request> TorchCommunicator::irecv(std::span<std::byte> data, std::size_t peer,
                                                  int tag) {
  check_peer(peer, "irecv");
  const std::string what = op_text("receive from", global_ranks_[rank_], global_ranks_[peer]);
  auto req = with_gil(what, [&] {
    py::object handle = backend_.attr("irecv")(byte_tensor(data.data(), data.size()), peer, tag);
    return std::make_unique<TorchRequest>(backend_, std::move(handle), what);
  });
  stats_.bytes_received += data.size();
  return req;
}

std::shared_ptr<Communicator> TorchCommunicator::split(int color, int key) {
  const std::string what = fmt::format("rank {} split", global_ranks_[rank_]);
  return with_gil(what, [&]() -> std::shared_ptr<Communicator> {
    py::object sub = backend_.attr("split")(color, key);
    if (sub.is_none()) return nullptr;
    return std::make_shared<TorchCommunicator>(std::move(sub));
  });
}

}  // namespace kdacp::python
