// A kdacp Communicator whose operations are carried out by a Python object,
// kdacp._comm.GroupBackend, over a torch.distributed process group. The
// protocols stay in C++; each communication call takes the GIL, hands the
// C++ buffer to Python as a uint8 tensor aliasing it (no copy), and releases
// the GIL again. The exchange calls themselves run with the GIL released.
//
// Errors: the backend raises TimeoutError when a wait ran past the timeout
// and another exception when a peer failed; both name the peer and become
// kdacp::Timeout and kdacp::RemoteError here.
#pragma once

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "kdacp/comm.hpp"

namespace kdacp::python {

class TorchCommunicator final : public Communicator {
 public:
  // `backend`: a kdacp._comm.GroupBackend (or any object with its methods
  // and attributes). Call with the GIL held.
  explicit TorchCommunicator(pybind11::object backend);
  ~TorchCommunicator() override;

  std::size_t rank() const override { return rank_; }
  std::size_t size() const override { return global_ranks_.size(); }
  const std::vector<std::size_t>& global_ranks() const override { return global_ranks_; }
  std::size_t world_size() const override { return world_size_; }
  std::string backend() const override { return name_; }

  void all_gather(std::span<std::byte> buffer) override;
  void broadcast(std::span<std::byte> buffer, std::size_t root) override;
  void barrier() override;
  std::unique_ptr<Request> isend(std::span<const std::byte> data, std::size_t peer,
                                 int tag) override;
  std::unique_ptr<Request> irecv(std::span<std::byte> data, std::size_t peer, int tag) override;
  std::shared_ptr<Communicator> split(int color, int key) override;

  std::chrono::milliseconds timeout() const override { return timeout_; }
  CommStats stats() const override { return stats_; }

 private:
  void check_peer(std::size_t peer, const char* op) const;

  pybind11::object backend_;
  std::size_t rank_ = 0;
  std::size_t world_size_ = 0;
  std::vector<std::size_t> global_ranks_;
  std::string name_;
  std::chrono::milliseconds timeout_{0};
  CommStats stats_;
};

}  // namespace kdacp::python
