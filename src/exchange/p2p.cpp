// p2p: the chain (SPEC §6). Rank r receives incoming_r from r-1 and sends
// M_r·incoming_r + S_r (S_0 on rank 0, S_r itself on a cut) to r+1; backward
// mirrors it with Mᵀ. P-1 dependent hops, fewer with cuts (the longest run
// between cuts); one extra state per rank (the one it sends).
#include <algorithm>

#include "exchange/common.hpp"
#include "exchange/cost_terms.hpp"

namespace kdacp::detail {
namespace {

class P2PExchange final : public CommExchange {
 public:
  explicit P2PExchange(const ProtocolContext& ctx) : CommExchange(ctx, p2p_protocol) {}

 private:
  // The chain over parts: each part receives from the rank holding the part
  // before it (or takes it locally) and hands its outgoing state on. One
  // part per rank is the chain over ranks: rank r receives from r-1 and
  // sends to r+1.
  std::vector<State> run(const Call& c) override {
    const Direction dir = c.direction;
    const std::size_t n = part_count();
    const std::vector<std::size_t>& own = own_parts();
    std::vector<std::size_t> order(own.size());
    for (std::size_t i = 0; i < order.size(); ++i) order[i] = dir == Direction::forward ? i : own.size() - 1 - i;
    auto index_of = [&](std::size_t j) {
      return static_cast<std::size_t>(std::lower_bound(own.begin(), own.end(), j) - own.begin());
    };
    std::vector<State> result(own.size()), sent_states;
    std::vector<std::unique_ptr<Request>> recvs(own.size()), sends;
    for (std::size_t i = 0; i < own.size(); ++i) {
      const auto prev = chain_prev(own[i], n, dir);
      result[i] = make_state(c.shape, prev ? Buffer::Init::uninitialized : Buffer::Init::zero);
      if (prev && owner(*prev) != rank_)
        recvs[i] = comm_->irecv(bytes_of(result[i]), owner(*prev), part_tag(own[i], dir));
    }
    auto hand_on = [&](std::size_t i, State out) {
      const auto next = chain_next(own[i], n, dir);
      if (owner(*next) == rank_) {
        result[index_of(*next)] = std::move(out);
      } else {
        sends.push_back(comm_->isend(bytes_of(out), owner(*next), part_tag(*next, dir)));
        sent_states.push_back(std::move(out));
      }
    };
    // The chain's first part and every cut hand on their offset itself (never
    // a product with the zero state), the cuts before their own state
    // arrives, so the chain does not wait across them. A dense offset goes to
    // another rank as it is, without a copy.
    for (std::size_t i : order) {
      const PartSummary& part = c.parts[i];
      const auto next = chain_next(own[i], n, dir);
      if ((chain_prev(own[i], n, dir) && !part.flags.cut) || !next) continue;
      if (owner(*next) != rank_ && part.offset.is_dense())
        sends.push_back(comm_->isend(bytes_of(part.offset), owner(*next), part_tag(*next, dir)));
      else
        hand_on(i, dense_copy(part.offset));
    }
    // The parts that hand on a fold, in chain order. A cut and the chain's
    // last part hand on nothing of their incoming state: their receives are
    // waited for at the end, so that a rank whose earlier part is a cut does
    // not hold its later parts' stretches until the cut's state arrives.
    for (std::size_t i : order) {
      const PartSummary& part = c.parts[i];
      if (!chain_prev(own[i], n, dir) || part.flags.cut || !chain_next(own[i], n, dir)) continue;
      if (recvs[i]) recvs[i]->wait();
      State out = make_state(c.shape, Buffer::Init::uninitialized);  // the step writes it all
      const StateView in = result[i].view();
      scan(single_slot(part.offset, part.transfer), 0, 1, dir, &in, out.view(), std::nullopt, nullptr,
           options().exec);
      hand_on(i, std::move(out));
    }
    for (auto& r : recvs)
      if (r) r->wait();
    for (auto& s : sends) s->wait();
    return result;
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
