// auto: the cost model's choice (choose_protocol) behind the same interface.
// The choice is made at construction, identically on every rank (same
// parameters, same expected shape, deterministic model), because the grouped
// protocols split the mesh collectively there. The executor then is the
// chosen protocol; this wrapper only adds the prediction.
#include <sstream>

#include "exchange/protocols.hpp"
#include "kdacp/error.hpp"

namespace kdacp::detail {
namespace {

class AutoExchange final : public StateExchange {
 public:
  AutoExchange(std::unique_ptr<StateExchange> chosen, Prediction prediction)
      : StateExchange(chosen->rank(), chosen->size()),
        chosen_(std::move(chosen)),
        prediction_(std::move(prediction)) {}

  std::string method() const override { return chosen_->method(); }
  bool exact() const override { return chosen_->exact(); }
  std::optional<Prediction> prediction() const override { return prediction_; }

  State forward(const StateView& s, const StateView& m) override {
    State out = chosen_->forward(s, m);
    stats_ = chosen_->last_stats();
    return out;
  }
  State backward(const StateView& g, const StateView& m) override {
    State out = chosen_->backward(g, m);
    stats_ = chosen_->last_stats();
    return out;
  }

 private:
  std::unique_ptr<StateExchange> chosen_;
  Prediction prediction_;
};

}  // namespace

std::unique_ptr<StateExchange> make_auto(const ProtocolContext& ctx) {
  const ExchangeOptions& o = ctx.options;
  if (!o.expected_shape) {
    throw InvalidArgument("rank " + std::to_string(ctx.rank) +
                          ": method 'auto' needs ExchangeOptions::expected_shape (B, H, K, V) "
                          "to predict the protocols' cost, got none");
  }
  const SummaryShape& s = *o.expected_shape;
  if (s.batch == 0 || s.heads == 0 || s.key_dim == 0 || s.value_dim == 0) {
    std::ostringstream os;
    os << "rank " << ctx.rank << ": expected_shape is " << to_string(s)
       << ", expected positive B, H, K and V";
    throw InvalidArgument(os.str());
  }
  ProblemShape shape{ctx.size, s.slabs(), s.key_dim, s.value_dim, dtype_size(s.dtype)};
  Prediction choice = choose_protocol(o.cost, shape, o.memory_budget_bytes, o.allow_reassociation);
  // An explicit segment count overrides the model's (the prediction follows it).
  if (choice.config.method == "pipelined_p2p" && o.segments != 0) {
    ProtocolConfig forced = choice.config;
    forced.segments = o.segments;
    choice = predict(o.cost, shape, forced);
  }
  ExchangeOptions inner = o;
  inner.segments = choice.config.segments;
  auto chosen = make_state_exchange(*ctx.mesh, choice.config.method,
                                    static_cast<long long>(choice.config.group_size), inner);
  return std::make_unique<AutoExchange>(std::move(chosen), std::move(choice));
}

}  // namespace kdacp::detail
