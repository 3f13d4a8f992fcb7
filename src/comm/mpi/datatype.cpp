// Large buffers: MPI counts are int. A buffer over max_message_bytes
// (INT_MAX by default) is described as ONE element of a derived datatype
// (q chunks of max_message_bytes, then the remainder), resized to the exact
// byte extent, so the in-place all-gather still places slot i at i × slot.
#include <climits>

#include <fmt/format.h>

#include "comm/mpi/internal.hpp"
#include "kdacp/error.hpp"

namespace kdacp::mpi {

ByteType::ByteType(std::size_t bytes, std::size_t max_chunk, bool words) {
  if (words && bytes % 8 == 0 && bytes <= max_chunk) {
    type_ = MPI_UINT64_T;
    count_ = static_cast<int>(bytes / 8);
    return;
  }
  if (bytes <= max_chunk) {
    count_ = static_cast<int>(bytes);
    return;
  }
  const std::size_t chunks = bytes / max_chunk, rest = bytes % max_chunk;
  if (chunks > static_cast<std::size_t>(INT_MAX))
    throw InvalidArgument(
        fmt::format("MPI message of {} bytes, expected at most INT_MAX chunks of {} bytes", bytes, max_chunk));
  MPI_Datatype chunk = MPI_DATATYPE_NULL, body = MPI_DATATYPE_NULL;
  MPI_Type_contiguous(static_cast<int>(max_chunk), MPI_BYTE, &chunk);
  const int lengths[2] = {static_cast<int>(chunks), static_cast<int>(rest)};
  const MPI_Aint displs[2] = {0, static_cast<MPI_Aint>(chunks * max_chunk)};
  const MPI_Datatype types[2] = {chunk, MPI_BYTE};
  MPI_Type_create_struct(rest ? 2 : 1, lengths, displs, types, &body);
  // The extent must be exactly `bytes` so that slot i of a gather lands at
  // i × bytes whatever padding rules the struct constructor applies.
  MPI_Type_create_resized(body, 0, static_cast<MPI_Aint>(bytes), &type_);
  MPI_Type_commit(&type_);
  MPI_Type_free(&body);
  MPI_Type_free(&chunk);
  count_ = 1;
}

ByteType::~ByteType() {
  if (type_ != MPI_BYTE && type_ != MPI_UINT64_T && mpi_running()) MPI_Type_free(&type_);
}

}  // namespace kdacp::mpi
