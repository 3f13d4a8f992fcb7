// Typed errors. Every error names what failed, the offending value, what was
// expected and, where one exists, the rank / peer / operation involved.
#pragma once

#include <stdexcept>
#include <string>

namespace kdacp {

// Base of every exception thrown by kdacp.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A caller broke a documented precondition (shape, dtype, stride, rank,
// method, group size, mesh layout). Raised before any communication.
class InvalidArgument : public Error {
 public:
  using Error::Error;
};

// A blocking wait ran past the communicator's timeout.
class Timeout : public Error {
 public:
  using Error::Error;
};

// A peer failed, exited or disagreed; the local rank cannot complete.
class RemoteError : public Error {
 public:
  using Error::Error;
};

// A computation produced a NaN or an infinity (for example float32 overflow
// from finite inputs): the result would be silently wrong. The message names
// the tensor and its first non-finite element.
class NumericalError : public Error {
 public:
  using Error::Error;
};

// Reading or writing a file (for example a malformed .npy) failed.
class IoError : public Error {
 public:
  using Error::Error;
};

}  // namespace kdacp
