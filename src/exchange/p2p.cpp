// p2p: the chain (SPEC §6). Rank r receives incoming_r from r-1 and sends
// M_r·incoming_r + S_r (S_0 on rank 0, S_r itself on a cut) to r+1; backward
// mirrors it with Mᵀ. P-1 dependent hops, fewer with cuts (the longest run
// between cuts); one extra state per rank (the one it sends). Its walk of
// the chain (walk_chain, p2p.hpp) also runs the layer's deterministic mode.
#include "exchange/p2p.hpp"

#include <algorithm>
#include <chrono>
#include <stdexcept>

#include <fmt/format.h>

#include "exchange/common.hpp"
#include "exchange/cost_terms.hpp"

namespace kdacp::detail {

ChainWalk walk_chain(Communicator& comm, const PartOwners& owners, std::size_t rank,
                     Direction direction, const SummaryShape& shape,
                     std::span<const ChainInput> inputs, ChainOrder order, const ChainStep& step) {
  using Clock = std::chrono::steady_clock;
  const auto since = [](Clock::time_point t0) {
    return std::chrono::duration<double>(Clock::now() - t0).count();
  };
  const std::size_t n = owners.size();
  const std::vector<std::size_t> own = owners.parts_of(rank);
  if (inputs.size() != own.size())
    throw std::logic_error(fmt::format("walk_chain: {} inputs for the {} parts of rank {}",
                                       inputs.size(), own.size(), rank));
  auto index_of = [&](std::size_t j) {
    return static_cast<std::size_t>(std::lower_bound(own.begin(), own.end(), j) - own.begin());
  };
  ChainWalk walk;
  walk.incoming.resize(own.size());
  std::vector<bool> handed(own.size(), false);  // by this rank's own step
  std::vector<State> sent_states;
  std::vector<std::unique_ptr<Request>> recvs(own.size()), sends;
  for (std::size_t i = 0; i < own.size(); ++i) {
    const auto prev = chain_prev(own[i], n, direction);
    const bool arrives = inputs[i] != ChainInput::none;
    if (arrives && !prev)
      throw std::logic_error(fmt::format("walk_chain: part {} has no part before it", own[i]));
    walk.incoming[i] = make_state(shape, arrives ? Buffer::Init::uninitialized : Buffer::Init::zero);
    if (arrives && owners[*prev] != rank)
      recvs[i] = comm.irecv(bytes_of(walk.incoming[i]), owners[*prev], part_tag(own[i], direction));
  }
  auto hand_on = [&](std::size_t i, ChainOut out) {
    if (std::holds_alternative<std::monostate>(out)) return;
    const auto next = chain_next(own[i], n, direction);
    if (!next) throw std::logic_error(fmt::format("walk_chain: part {} has no part after it", own[i]));
    const std::size_t to = owners[*next];
    if (const StateView* view = std::get_if<StateView>(&out)) {
      if (to != rank && view->is_dense()) {
        sends.push_back(comm.isend(bytes_of(*view), to, part_tag(*next, direction)));
        return;
      }
      out = dense_copy(*view);
    }
    State& state = std::get<State>(out);
    if (to == rank) {
      walk.incoming[index_of(*next)] = std::move(state);
      handed[index_of(*next)] = true;
    } else {
      sends.push_back(comm.isend(bytes_of(state), to, part_tag(*next, direction)));
      sent_states.push_back(std::move(state));
    }
  };
  auto run_step = [&](std::size_t i) {
    const State* incoming = nullptr;
    if (inputs[i] == ChainInput::awaited) {
      const auto t0 = Clock::now();
      if (recvs[i]) recvs[i]->wait();
      else if (!handed[i])
        throw std::logic_error(fmt::format("walk_chain: nothing handed part {} its state", own[i]));
      walk.waiting += since(t0);
      incoming = &walk.incoming[i];
    }
    const auto t0 = Clock::now();
    ChainOut out = step(i, incoming);
    walk.stepping += since(t0);
    hand_on(i, std::move(out));
  };
  // This rank's parts in the direction's order.
  std::vector<std::size_t> steps(own.size());
  for (std::size_t k = 0; k < steps.size(); ++k)
    steps[k] = direction == Direction::forward ? k : own.size() - 1 - k;
  if (order == ChainOrder::unwaited_first) {
    for (std::size_t i : steps)
      if (inputs[i] != ChainInput::awaited) run_step(i);
    for (std::size_t i : steps)
      if (inputs[i] == ChainInput::awaited) run_step(i);
  } else {
    for (std::size_t i : steps) run_step(i);
  }
  const auto t0 = Clock::now();
  for (auto& r : recvs)
    if (r) r->wait();
  for (auto& s : sends) s->wait();
  walk.waiting += since(t0);
  return walk;
}

namespace {

class P2PExchange final : public CommExchange {
 public:
  explicit P2PExchange(const ProtocolContext& ctx) : CommExchange(ctx, p2p_protocol) {}

 private:
  // The chain over parts (walk_chain): each part receives from the rank
  // holding the part before it (or takes it locally) and hands its outgoing
  // state on. One part per rank is the chain over ranks: rank r receives
  // from r-1 and sends to r+1.
  std::vector<State> run(const Call& c) override {
    const Direction dir = c.direction;
    const std::size_t n = part_count();
    const std::vector<std::size_t>& own = own_parts();
    // A cut and the chain's last part hand on nothing of their incoming
    // state: their receives are waited for at the end, so that a rank whose
    // earlier part is a cut does not hold its later parts' stretches until
    // the cut's state arrives.
    std::vector<ChainInput> inputs(own.size(), ChainInput::awaited);
    for (std::size_t i = 0; i < own.size(); ++i) {
      if (!chain_prev(own[i], n, dir)) inputs[i] = ChainInput::none;
      else if (c.parts[i].flags.cut || !chain_next(own[i], n, dir)) inputs[i] = ChainInput::kept;
    }
    // The chain's first part and every cut hand on their offset itself (never
    // a product with the zero state), before any state arrives (unwaited
    // first), so the chain does not wait across them. A dense offset goes to
    // another rank as it is, without a copy. The others fold.
    const ChainStep fold = [&](std::size_t i, const State* incoming) -> ChainOut {
      const PartSummary& part = c.parts[i];
      if (!chain_next(own[i], n, dir)) return {};
      if (incoming == nullptr) return part.offset;
      State out = make_state(c.shape, Buffer::Init::uninitialized);  // the step writes it all
      const StateView in = incoming->view();
      scan(single_slot(part.offset, part.transfer), 0, 1, dir, &in, out.view(), std::nullopt, nullptr,
           options().exec);
      return out;
    };
    return walk_chain(*comm_, part_owners(), rank_, dir, c.shape, inputs, ChainOrder::unwaited_first, fold)
        .incoming;
  }
};

// The critical path is the longest stretch between cuts: one message per
// step that changes rank, one fold per step after the stretch's first.
CostTerms p2p_cost(const ProblemShape& s, const ProtocolConfig&, StreamWaitsCache*) {
  CostTerms t;
  const ChainProfile chain = chain_profile(s, 1);
  // On nodes, the hops between two ranks of one node go over it (any
  // layout: zigzag's hops are between neighbouring ranks too).
  const double crossings = dbl(chain.node_relays);
  add_messages(t, false, crossings, dbl(state_bytes(s)));
  add_messages(t, true, dbl(chain.relays) - crossings, dbl(state_bytes(s)));
  add_port_waits(t, chain, dbl(state_bytes(s)));
  t.folds = stretch_folds(chain.steps);
  t.work_folds = chain_folds(chain.parts);
  // The states a rank's parts fold and send on (one part per rank: a middle
  // rank's one, none at P = 2), and one handed to a part of its own.
  t.peak_extra_bytes = chain.chain_sends * state_bytes(s);
  return t;
}

}  // namespace

const ProtocolDescriptor p2p_protocol{
    .name = "p2p",
    .kind = ProtocolClass::exact,
    .takes_layouts = true,
    .memory = "1 state",
    .use_when = "tiny P, or the least memory",
    .cost = p2p_cost,
    .build = [](const ProtocolContext& ctx) -> std::unique_ptr<StateExchange> {
      return std::make_unique<P2PExchange>(ctx);
    },
};

}  // namespace kdacp::detail
