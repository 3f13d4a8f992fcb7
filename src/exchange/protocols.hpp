// Internal: the builders the factory table points at, one per protocol file.
#pragma once

#include <cstddef>
#include <memory>

#include "kdacp/exchange.hpp"

namespace kdacp::detail {

// Everything a protocol needs to know about its place in the CP mesh.
struct ProtocolContext {
  const DeviceMesh* mesh = nullptr;  // 1-D chronological CP mesh, order validated
  std::size_t rank = 0;              // chronological position
  std::size_t size = 0;              // P
  std::size_t group_size = 1;        // w, as given
  ExchangeOptions options;
};

std::unique_ptr<StateExchange> make_p2p(const ProtocolContext& ctx);
std::unique_ptr<StateExchange> make_allgather(const ProtocolContext& ctx);
std::unique_ptr<StateExchange> make_grouped_allgather_p2p(const ProtocolContext& ctx);
std::unique_ptr<StateExchange> make_pipelined_p2p(const ProtocolContext& ctx);
std::unique_ptr<StateExchange> make_recursive_doubling(const ProtocolContext& ctx);
std::unique_ptr<StateExchange> make_grouped_allgather_rd(const ProtocolContext& ctx);
std::unique_ptr<StateExchange> make_auto(const ProtocolContext& ctx);

}  // namespace kdacp::detail
