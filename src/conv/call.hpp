// A call's arguments of the CP convolution (kdacp/conv.hpp), and its
// per-call agreement: every rank
// of a CausalConv call must pass what sizes its halo messages and its final
// state's all-gather (B, T, D, W, the boundaries and layout, the element
// type, which states are given); a rank that differs is named on every rank
// before any halo moves, instead of a message of the wrong size aborting the
// receiver or a rank waiting for a message that never comes.
#pragma once

#include <cstddef>
#include <span>
#include <string>

#include "kdacp/comm.hpp"
#include "kdacp/conv.hpp"
#include "kdacp/layout.hpp"

namespace kdacp::conv {

// What one call of CausalConv::forward or ::backward passes, in the
// arguments' names of kdacp.torch.causal_conv1d.
struct ConvCall {
  std::size_t batch = 0, tokens = 0, dim = 0, width = 0;
  std::span<const std::size_t> boundaries;  // sequence starts and T
  std::span<const LayoutPart> parts;        // the layout, chain order
  const char* dtype = "float32";
  const char* activation = "none";
  bool bias = false;
  bool initial_state = false;
  bool final_state = false;    // forward: output_final_state; backward: its gradient given
};

// Collective over `comm`: kdacp::agree on the call's fields; `what` names
// the call ("causal_conv1d forward").
void agree_conv_call(Communicator& comm, const ConvCall& call, const std::string& what);

}  // namespace kdacp::conv
