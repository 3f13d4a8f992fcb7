// Internal: the runs of a layout, what the protocols share to run one (SPEC
// §10): a chain of n parts whose owners are given per chain position, several
// parts per rank. (The Layout value itself is src/layout/layout.cpp.)
//
// The chain over parts is cut into runs: maximal stretches of consecutive
// chain positions whose owners lie in one block of w consecutive ranks (w = 1:
// one rank). Within a run everything the run's block needs is local after the
// block's gather (w > 1) or on the rank itself (w = 1), so only the state
// entering each run crosses blocks: the grouped protocols relay it (exact) or
// scan the runs' aggregate pairs by recursive doubling (reassociating), and
// every rank then folds its parts inside their run step by step, in chain
// order, exactly as the chain does.
#pragma once

#include <cstddef>
#include <optional>
#include <span>
#include <vector>

#include "exchange/affine_pairs.hpp"
#include "exchange/common.hpp"

namespace kdacp::detail {

// The layout as the protocols index it: owners per chain position, each
// part's index among its owner's parts, and k, the most parts a rank holds
// (every rank packs k slots so that the gathers are uniform).
struct LayoutIndex {
  std::vector<std::size_t> owner;  // chain position -> rank
  std::vector<std::size_t> local;  // chain position -> index among its owner's parts
  std::size_t per_rank = 1;        // k

  LayoutIndex(std::span<const std::size_t> owners, std::size_t ranks);
  std::size_t size() const { return owner.size(); }
};

// Runs of a layout for blocks of `width` consecutive ranks, in chain order.
struct Runs {
  std::vector<std::size_t> first, last;  // chain positions, first <= last
  std::vector<std::size_t> block;        // the block (rank / width) holding each run
  std::vector<std::size_t> run_of;       // chain position -> run

  Runs(const LayoutIndex& layout, std::size_t width);
  std::size_t size() const { return first.size(); }
  // The run before / after `run` in the direction the chain runs.
  std::optional<std::size_t> prev(std::size_t run, Direction d) const;
  std::optional<std::size_t> next(std::size_t run, Direction d) const;
  // The run's chain positions in the direction's order.
  std::vector<std::size_t> positions(std::size_t run, Direction d) const;
  // The runs of block b in the direction's order.
  std::vector<std::size_t> of_block(std::size_t b, Direction d) const;
};

// A state a fold over a run's slots writes: the state after its first
// `steps` slots (0: the incoming state).
struct FoldTarget {
  std::size_t steps = 0;
  StateView out;
};

// Writes every target's state, folding the slots of `order` (slot indices of
// `gathered`, in the direction's chain order) from `in` (nullptr: none, the
// chain's start), or from the last cut among a target's slots, whose offset
// is then the state exactly; a target of 0 steps gets `in` (zeros without).
// `targets` ascend in steps. One pass: every slot is folded once, a later
// target continuing from the earlier one, and each stretch of consecutive
// slots (ascending forward, descending backward) in one fused scan, as the
// chain folds them, so the bits are the chain's. With
// FoldFlags::consume_offsets the folded slots' offsets are overwritten with
// the states after them (a stretch that does not end a target ends in its
// last slot's offset: no scratch); without, the slots are left as they are
// and such a stretch ends in one temporary state.
void fold_run(const PackedSlots& gathered, std::span<const std::size_t> order,
              std::span<const FoldTarget> targets, Direction direction, const StateView* in,
              const ExecPolicy& exec, FoldFlags flags);

// The index in `order` of its last slot that is a cut, or none: the states
// after more steps than that do not depend on the incoming state.
std::optional<std::size_t> last_cut_in(const PackedSlots& gathered, std::span<const std::size_t> order);

// A run as one affine pair: its fold from no incoming state in the
// direction's order and the product of its transfers in chain order (the
// same product serves both directions: backward the pair's op is its
// transpose). A run with a cut is a cut pair: its fold from the cut nearest
// its end in the direction's order, no product.
void run_pair(const PackedSlots& gathered, std::span<const std::size_t> ascending_slots,
              Direction direction, const PairBuffer& pair, const ExecPolicy& exec);

// The recursive-doubling exclusive scan of affine pairs (affine_pairs.hpp) in
// chain order (forward: ascending, backward: reversed), ceil(log2 n) rounds,
// over n virtual positions, one or several per member: position j is held by
// member owner_of[j]; `own` are this member's positions' pairs in ascending
// chain position. A message between positions of one member stays local; the
// others are tagged by their receiving position (part_tag). Returns each own
// position's incoming state, the offset of the composition of all earlier
// pairs (zeros for the direction's first position). Last-round messages
// carry offsets only. One position per member is the scan over the members:
// at most three pairs per member (recursive_doubling_memory).
std::vector<State> rd_exclusive_scan_parts(Communicator& comm, std::span<const std::size_t> owner_of,
                                           std::span<const PairView> own, const SummaryShape& shape,
                                           Direction direction, const ExecPolicy& policy);

// How the state entering each run crosses blocks.
enum class RunRelay {
  chain,     // exact: each run's carrier folds it and sends its outgoing state on
  doubling,  // reassociating: the carriers scan the runs' pairs by recursive doubling
};

// A layout cut into runs for blocks of `width` ranks, as a protocol built on
// runs keeps it from its construction (the owners never change).
struct RunLayout {
  RunLayout(std::span<const std::size_t> owners, std::size_t ranks, std::size_t width);
  LayoutIndex index;
  std::size_t width;
  Runs runs;
};

// One call of a protocol built on runs (grouped_allgather_p2p,
// recursive_doubling, grouped_allgather_rd), its one code path: one part per
// rank is the layout of one part per rank. Each block gathers its ranks'
// parts, k slots per rank, in one collective over `intra` (nullptr when
// width is 1); the block's carrier (its last rank) obtains the state
// entering each of the block's runs over `cross` (chain: the CP group,
// carriers addressed by rank; doubling: a group whose rank is the block) and
// broadcasts them in the block in one message; every rank folds its parts
// inside their runs. Every rank folds each slot of its runs at most once,
// in place (fold_run, consuming the gathered offsets): the chain's carrier
// folds a run once for the state it sends and its own parts' results on the
// way. One part per rank with width w is then w slots, the block's incoming
// state and the carrier's outgoing one. Returns this rank's parts' results in
// chain order.
struct RunsCall {
  const RunLayout* layout = nullptr;
  std::size_t rank = 0;
  Communicator* intra = nullptr;
  Communicator* cross = nullptr;
  RunRelay relay = RunRelay::chain;
  std::span<const PartSummary> parts;
  SummaryShape shape{};
  Direction direction = Direction::forward;
  const ExecPolicy* exec = nullptr;
};
std::vector<State> run_layout_in_runs(const RunsCall& call);

// A [B,H,K,V] slice of a stack of states laid out [count][B,H,K,V].
StateView state_slice(const State& stack, const SummaryShape& shape, std::size_t index);
std::span<std::byte> state_slice_bytes(const State& stack, const SummaryShape& shape,
                                       std::size_t index);

}  // namespace kdacp::detail
