// The protocol registry: one descriptor per state exchange protocol, the only
// place where a protocol's facts live. The factory (make_state_exchange), auto,
// the cost model, `kdacp plan|bench|run|exchange`, the docs tables
// (`kdacp protocols --markdown`) and the test matrix all read these rows, so a
// protocol added to the registry is in every table, command and test.
//
// Adding a protocol: one file in src/exchange/ that defines its executor and
// its descriptor, and one line in src/exchange/protocols.def.
#pragma once

#include <cstddef>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kdacp/cost_model.hpp"

namespace kdacp {

class StateExchange;
namespace detail {
struct ProtocolContext;
}

// A protocol's critical path and memory in counts, not seconds: the cost model
// turns them into time with a machine's α, β, γ (cost_model.hpp), and the
// protocol benchmark into its floor with the host's measured copy and fold
// speed. Counts are for one forward call; a backward costs the same.
struct CostTerms {
  double messages = 0;        // network messages on the critical path (α each)
  double bytes = 0;           // network bytes on the critical path (β each)
  double group_messages = 0;  // messages inside an all-gather group (group α)
  double group_bytes = 0;     // bytes inside an all-gather group (group β)
  // What congestion adds, in network bytes (β each): the bytes that cross an
  // oversubscribed leaf switch with more senders than its uplinks carry,
  // times how much slower they go, less one (CostParams::oversubscription).
  double contention_bytes = 0;
  double folds = 0;           // K×V affine steps over all B·H slabs on the critical path
  double products = 0;        // K×K·K×K products over all slabs on the critical path
  double work_folds = 0;      // all ranks' fold steps together (bounds shared cores)
  double work_products = 0;   // all ranks' K×K products together
  std::size_t peak_extra_bytes = 0;  // largest over ranks; what ExchangeStats measures
};

// A row's cost terms, called as cost(shape, config[, waits]): `waits` is the
// pricing planner's memory of pipelined_p2p's stream waits (Planner), none
// to price afresh. A type of its own so that callers outside a planner need
// not name the memory.
struct CostFunction {
  using Fn = CostTerms (*)(const ProblemShape& shape, const ProtocolConfig& config, StreamWaitsCache* waits);
  Fn fn = nullptr;

  CostFunction() = default;
  CostFunction(Fn f) : fn(f) {}  // NOLINT(google-explicit-constructor): rows name their function
  CostTerms operator()(const ProblemShape& shape, const ProtocolConfig& config,
                       StreamWaitsCache* waits = nullptr) const {
    return fn(shape, config, waits);
  }
  bool operator==(std::nullptr_t) const { return fn == nullptr; }
};

enum class ProtocolClass {
  exact,          // the chain's operations in the chain's order: bitwise equal to p2p
  reassociating,  // regroups the products of transfers; within error_bound of FP64
  chooser,        // picks one of the other rows (auto)
};
std::string to_string(ProtocolClass kind);

struct ProtocolDescriptor {
  std::string_view name;
  ProtocolClass kind = ProtocolClass::exact;
  bool takes_group_size = false;  // accepts allgather_group_size w != 1 (w | P)
  bool takes_segments = false;    // accepts ExchangeOptions::segments c != 0 (c <= ceil(V/16))
  bool takes_layouts = false;     // accepts ExchangeOptions::part_owners other than one part per rank
  // One line each for the docs table and --help: extra memory in words, and
  // when a user should pick it.
  std::string_view memory{};
  std::string_view use_when{};
  // The critical path for `config` (group_size and segments in force, both
  // already checked); none (== nullptr) for the chooser.
  CostFunction cost{};
  // Documented relative Frobenius error bound against the FP64 chain for
  // transfers of spectral norm <= 1, as a function and as text; nullptr and
  // empty for exact protocols (bound 0).
  double (*error_bound)(std::size_t ranks, std::size_t key_dim) = nullptr;
  std::string_view error_bound_text{};
  // Builds the executor; collective over the mesh's root when it splits the mesh.
  std::unique_ptr<StateExchange> (*build)(const detail::ProtocolContext& ctx) = nullptr;

  bool exact() const { return kind == ProtocolClass::exact; }
  bool chooser() const { return kind == ProtocolClass::chooser; }
};

// The reference system's protocol: `kdacp plan` and the docs state speed-ups
// against it.
inline constexpr std::string_view kBaselineProtocol = "allgather";
// The chain (SPEC §3, §4): the operations every exact protocol reproduces bit
// for bit, and the result reports compare the others with.
inline constexpr std::string_view kChainProtocol = "p2p";

// Every row, in documentation order (the chooser last).
std::span<const ProtocolDescriptor* const> protocol_registry();
// The row named `name`; InvalidArgument naming the known ones otherwise.
const ProtocolDescriptor& find_protocol(std::string_view name);
// The names of every row, comma-separated (for messages and --help).
std::string protocol_names();

// The documented bound of `name` at P ranks and key dim K (0 for exact rows).
double error_bound(const ProtocolDescriptor& protocol, std::size_t ranks, std::size_t key_dim);
// The same for a shape with a layout (ProblemShape::part_owners): a
// reassociating row folds each run of a rank's consecutive parts serially
// and scans the runs, so its bound is that of R·2^(L-1) positions for R runs
// of at most L parts (P positions without a layout; at least n for n parts).
double error_bound(const ProtocolDescriptor& protocol, const ProblemShape& shape);

// "grouped_allgather_p2p w=4", "pipelined_p2p c=8", "p2p": the one label every
// table, benchmark record and report uses.
std::string protocol_label(const ProtocolConfig& config);

// Every configuration of `protocol` that is valid at P ranks and value dim V:
// each group size dividing P (1 and P included) when it takes one, each
// segment count 1..ceil(V/16) when it takes segments. The chooser has none.
std::vector<ProtocolConfig> valid_configs(const ProtocolDescriptor& protocol, std::size_t ranks,
                                          std::size_t value_dim);

}  // namespace kdacp
