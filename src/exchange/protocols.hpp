// Internal: what every protocol file sees — its place in the mesh and the
// registry's descriptors (protocols.def), so that a protocol may build
// another one (grouped with w = 1 is the chain).
#pragma once

#include <cstddef>
#include <memory>

#include "kdacp/exchange.hpp"
#include "kdacp/protocol.hpp"

namespace kdacp::detail {

// Everything a protocol needs to know about its place in the CP mesh.
struct ProtocolContext {
  const DeviceMesh* mesh = nullptr;  // 1-D chronological CP mesh, order validated
  std::size_t rank = 0;              // chronological position
  std::size_t size = 0;              // P
  std::size_t group_size = 1;        // w, as given
  ExchangeOptions options;
};

// The chooser's way to attach its prediction to the executor it picked.
struct ExchangeAccess {
  static void set_prediction(StateExchange& exchange, Prediction prediction);
};

#define KDACP_PROTOCOL(name) extern const ProtocolDescriptor name##_protocol;
#include "exchange/protocols.def"
#undef KDACP_PROTOCOL

}  // namespace kdacp::detail
