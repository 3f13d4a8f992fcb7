// The MPI communicator's point-to-point messages: isend/irecv post an
// MPI_Isend / MPI_Irecv and return a request whose wait() polls within the
// communicator's timeout. Sizes are checked on the receiver from the
// status: MPI_ERR_TRUNCATE when longer, MPI_Get_elements_x when shorter.
#include <memory>
#include <string>

#include <fmt/format.h>

#include "comm/mpi/internal.hpp"
#include "kdacp/error.hpp"

namespace kdacp::mpi {

namespace {

class MpiRequest final : public Request {
 public:
  MpiRequest(std::shared_ptr<MpiComm> comm, bool is_recv, std::size_t peer, int tag, std::size_t bytes)
      : comm_(std::move(comm)),
        type_(bytes, comm_->options().max_message_bytes),
        is_recv_(is_recv),
        peer_(peer),
        tag_(tag),
        bytes_(bytes) {}

  ~MpiRequest() override {
    if (req_ == MPI_REQUEST_NULL || !mpi_running()) return;
    // Dropped before completion (an exception unwound past it). A receive
    // can be cancelled; a send cannot portably, so it is left to complete.
#if !defined(KDACP_SMPI)  // simulated: a wait on a cancelled receive could block for good
    if (is_recv_) {
      MPI_Cancel(&req_);
      int rc = MPI_SUCCESS;
      if (poll(&req_, MPI_STATUS_IGNORE, Clock::now() + std::chrono::milliseconds(100), &rc)) return;
    }
#endif
    MPI_Request_free(&req_);
  }
  MpiRequest(const MpiRequest&) = delete;
  MpiRequest& operator=(const MpiRequest&) = delete;

  void post(const void* data) {
    charge_compute();
    const int peer = static_cast<int>(peer_);
    const std::string op = describe();
    if (is_recv_)
      comm_->check(
          MPI_Irecv(const_cast<void*>(data), type_.count(), type_.type(), peer, tag_, comm_->handle(), &req_), op);
    else
      comm_->check(MPI_Isend(data, type_.count(), type_.type(), peer, tag_, comm_->handle(), &req_), op);
  }

  void wait() override {
    if (req_ == MPI_REQUEST_NULL) return;
    MPI_Status status;
    int rc = MPI_SUCCESS;
    if (!poll(&req_, &status, Clock::now() + comm_->timeout(), &rc))
      throw Timeout(fmt::format("{}{}: timed out after {} ms waiting for peer rank {}", comm_->who(), describe(),
                                comm_->timeout().count(), comm_->globals()[peer_]));
    if (rc != MPI_SUCCESS) {
      int cls = 0;
      MPI_Error_class(rc, &cls);
      if (cls == MPI_ERR_TRUNCATE)
        throw RemoteError(fmt::format("{}{}: the message from rank {} is longer than the {} bytes expected ({})",
                                      comm_->who(), describe(), comm_->globals()[peer_], bytes_, error_text(rc)));
      throw RemoteError(comm_->who() + describe() + ": " + error_text(rc));
    }
    if (is_recv_) check_received(status);
  }

 private:
  // A message shorter than posted completes without error: its length is
  // in the status.
  void check_received(MPI_Status& status) const {
#if defined(KDACP_SMPI)
    // SMPI lacks MPI_Get_elements_x; its statuses count bytes, and a
    // simulated message never needs a count beyond int.
    int received = 0;
    MPI_Get_count(&status, MPI_BYTE, &received);
    const MPI_Count elements = received;
#else
    MPI_Count elements = 0;
    MPI_Get_elements_x(&status, type_.type(), &elements);
#endif
    if (elements != static_cast<MPI_Count>(bytes_))
      throw RemoteError(fmt::format("{}{}: message of {} bytes from rank {}, expected {}", comm_->who(), describe(),
                                    elements, comm_->globals()[peer_], bytes_));
  }

  std::string describe() const {
    return fmt::format("{} rank {} (tag {}, {} bytes)", is_recv_ ? "irecv from" : "isend to",
                       comm_->globals()[peer_], tag_, bytes_);
  }

  std::shared_ptr<MpiComm> comm_;
  ByteType type_;
  bool is_recv_;
  std::size_t peer_;
  int tag_;
  std::size_t bytes_;
  MPI_Request req_ = MPI_REQUEST_NULL;
};

}  // namespace

std::unique_ptr<Request> MpiComm::isend(std::span<const std::byte> data, std::size_t peer, int tag) {
  check_peer(peer, "isend");
  check_tag(tag, "isend");
  auto req = std::make_unique<MpiRequest>(shared_from_this(), false, peer, tag, data.size());
  req->post(data.data());
  stats_.bytes_sent += data.size();
  ++stats_.messages_sent;
  return req;
}

std::unique_ptr<Request> MpiComm::irecv(std::span<std::byte> data, std::size_t peer, int tag) {
  check_peer(peer, "irecv");
  check_tag(tag, "irecv");
  auto req = std::make_unique<MpiRequest>(shared_from_this(), true, peer, tag, data.size());
  req->post(data.data());
  stats_.bytes_received += data.size();
  return req;
}

}  // namespace kdacp::mpi
