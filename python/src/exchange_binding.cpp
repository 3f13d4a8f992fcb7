// The state exchange over a torch.distributed group (build_kda_state_cp), the
// serial fold (merge_affine_summaries) and the same exchange on in-process
// ranks, the C++ reference the Python tests compare with.
#include <pybind11/stl.h>

#include <cstring>
#include <optional>

#include <fmt/format.h>

#include "binding.hpp"
#include "kdacp/cost_model.hpp"
#include "kdacp/error.hpp"
#include "kdacp/exchange.hpp"
#include "kdacp/inprocess.hpp"
#include "kdacp/layer.hpp"
#include "kdacp/mesh.hpp"
#include "kdacp/summary.hpp"
#include "torch_comm.hpp"

namespace py = pybind11;

namespace kdacp::python {
namespace {

Direction to_direction(bool forward) { return forward ? Direction::forward : Direction::backward; }

// The options kdacp.torch forwards from build_kda_state_cp(**options).
ExchangeOptions make_options(std::size_t segments, std::size_t memory_budget_bytes,
                             bool allow_reassociation, const std::string& calibration,
                             const std::optional<std::vector<std::size_t>>& expected_shape,
                             const std::optional<std::string>& expected_dtype,
                             const std::optional<std::vector<bool>>& expected_cuts) {
  ExchangeOptions o;
  if (expected_cuts) o.expected_cuts = *expected_cuts;
  o.segments = segments;
  o.memory_budget_bytes = memory_budget_bytes;
  o.allow_reassociation = allow_reassociation;
  if (!calibration.empty()) o.cost = load_cost_params(calibration);
  if (expected_shape) {
    if (expected_shape->size() != 4)
      throw InvalidArgument(fmt::format("expected_shape has {} entries, expected 4 (B, H, K, V)",
                                        expected_shape->size()));
    SummaryShape s;
    s.batch = (*expected_shape)[0];
    s.heads = (*expected_shape)[1];
    s.key_dim = (*expected_shape)[2];
    s.value_dim = (*expected_shape)[3];
    s.dtype = expected_dtype && *expected_dtype == "float64" ? DType::f64 : DType::f32;
    o.expected_shape = s;
  }
  return o;
}

// One rank's executor over a torch group, with what it needs kept alive.
class Exchange {
 public:
  Exchange(py::object backend, const std::string& method, long long group_size,
           ExchangeOptions options, std::size_t threads)
      : pool_(threads) {
    comm_ = std::make_shared<TorchCommunicator>(std::move(backend));
    options.exec = pool_.exec();
    py::gil_scoped_release release;  // the grouped protocols split: collective
    mesh_ = DeviceMesh::from_group(comm_, comm_->global_ranks(), "cp");
    exchange_ = make_state_exchange(*mesh_, method, group_size, std::move(options));
  }

  py::array run(const py::tuple& offset, const py::tuple& transfer, bool forward, bool cut) {
    const StateView o = state_view(to_desc(offset), forward ? "state" : "gradient");
    const StateView m = state_view(to_desc(transfer), "matrix");
    State out;
    {
      py::gil_scoped_release release;
      out = forward ? exchange_->forward(o, m, PartFlags{cut}) : exchange_->backward(o, m, PartFlags{cut});
    }
    return state_array(std::move(out));
  }

  const StateExchange& get() const { return *exchange_; }

 private:
  Pool pool_;
  std::shared_ptr<Communicator> comm_;
  std::optional<DeviceMesh> mesh_;
  std::unique_ptr<StateExchange> exchange_;
};

// kernels' merge over stacked summaries: the allgather fold, which performs the
// chain's operations in the chain's order (SPEC §5).
py::array merge_stacked(const py::tuple& offsets, const py::tuple& transfers, std::size_t rank,
                        bool forward) {
  const StackView s = stack_view(to_desc(offsets), forward ? "states" : "gradients");
  const StackView m = stack_view(to_desc(transfers), "matrices");
  const SummaryShape shape = validate_stack(s, m, rank);
  if (rank >= s.ranks)
    throw InvalidArgument(fmt::format("rank {}, expected < P = {}", rank, s.ranks));
  State out(shape.batch, shape.heads, shape.key_dim, shape.value_dim, shape.dtype);
  {
    py::gil_scoped_release release;
    merge(Slots{s, m}, rank, to_direction(forward), out.view());
  }
  return state_array(std::move(out));
}

// The exchange on P in-process ranks (threads), rank r holding slot r of the
// stacks: the reference the tests hold the torch path to, bit for bit.
py::array inprocess_exchange(const std::string& method, long long group_size,
                             const py::tuple& offsets, const py::tuple& transfers, bool forward,
                             std::size_t segments, bool allow_reassociation) {
  const StackView s = stack_view(to_desc(offsets), forward ? "states" : "gradients");
  const StackView m = stack_view(to_desc(transfers), "matrices");
  const SummaryShape shape = validate_stack(s, m, 0);
  const std::size_t ranks = s.ranks;
  py::array out = new_array(shape.dtype, {ranks, shape.batch, shape.heads, shape.key_dim,
                                          shape.value_dim});
  auto* dst = static_cast<std::byte*>(out.mutable_data());
  const std::size_t slot_bytes = shape.state_elems() * dtype_size(shape.dtype);
  {
    py::gil_scoped_release release;
    run_in_process(ranks, [&](const std::shared_ptr<Communicator>& comm) {
      const DeviceMesh mesh = DeviceMesh::create(comm, {ranks}, {"cp"});
      ExchangeOptions o;
      o.segments = segments;
      o.allow_reassociation = allow_reassociation;
      o.expected_shape = shape;
      auto ex = make_state_exchange(mesh, method, group_size, o);
      const std::size_t r = comm->rank();
      const State res = forward ? ex->forward(s.slot(r), m.slot(r)) : ex->backward(s.slot(r), m.slot(r));
      std::memcpy(dst + r * slot_bytes, res.data<float>(), slot_bytes);
    });
  }
  return out;
}

// build_kda_state_cp's one agreement: protocol, group size, the options
// that shape the messages and the timeout (threads and check_ranks are each
// rank's own). A rank whose own arguments failed joins it through
// reject_call instead.
void agree_exchange(py::object backend, const std::string& protocol, long long group_size, ExchangeOptions options) {
  const auto comm = std::make_shared<TorchCommunicator>(std::move(backend));
  LayerConfig c;
  c.names = LayerNames::python();
  c.protocol = protocol;
  c.group_size = group_size;
  c.exchange = std::move(options);
  py::gil_scoped_release release;
  agree(*comm, exchange_fingerprint(c, comm->timeout()), "build_kda_state_cp");
}

// A StateExchange call's check_ranks agreement: the direction and the
// summary's shape and dtype, before the protocol's first message.
void agree_exchange_call(py::object backend, bool forward, const std::vector<std::size_t>& shape,
                         const std::string& dtype) {
  const auto comm = std::make_shared<TorchCommunicator>(std::move(backend));
  Fingerprint f;
  f.add_text("call", "state exchange call");
  f.add_text("direction", forward ? "forward" : "backward");
  f.add_bytes("shape B,H,K,V", std::as_bytes(std::span(shape)), list_text(std::span<const std::size_t>(shape)));
  f.add_text("dtype", dtype);
  py::gil_scoped_release release;
  agree(*comm, f, forward ? "StateExchange.forward" : "StateExchange.backward");
}

}  // namespace

void bind_exchange(py::module_& m) {
  m.def("agree_exchange", &agree_exchange, py::arg("backend"), py::arg("protocol"), py::arg("group_size"),
        py::arg("options"));
  m.def("agree_exchange_call", &agree_exchange_call, py::arg("backend"), py::arg("forward"), py::arg("shape"),
        py::arg("dtype"));
  m.def("make_options", &make_options, py::arg("segments"), py::arg("memory_budget_bytes"),
        py::arg("allow_reassociation"), py::arg("calibration"), py::arg("expected_shape"),
        py::arg("expected_dtype"), py::arg("expected_cuts") = std::nullopt);
  py::class_<ExchangeOptions>(m, "ExchangeOptions");
  py::class_<Exchange>(m, "Exchange")
      .def(py::init<py::object, const std::string&, long long, ExchangeOptions, std::size_t>(),
           py::arg("backend"), py::arg("method"), py::arg("group_size"), py::arg("options"),
           py::arg("threads"))
      .def("run", &Exchange::run, py::arg("offset"), py::arg("transfer"), py::arg("forward"),
           py::arg("cut") = false)
      .def_property_readonly("method", [](const Exchange& e) { return e.get().method(); })
      .def_property_readonly("exact", [](const Exchange& e) { return e.get().exact(); })
      .def_property_readonly("rank", [](const Exchange& e) { return e.get().rank(); })
      .def_property_readonly("size", [](const Exchange& e) { return e.get().size(); })
      .def_property_readonly("group_size",
                             [](const Exchange& e) { return e.get().config().group_size; })
      .def_property_readonly("segments",
                             [](const Exchange& e) { return e.get().config().segments; })
      .def_property_readonly("last_stats", [](const Exchange& e) {
        const ExchangeStats& s = e.get().last_stats();
        py::dict d;
        d["bytes_sent"] = s.bytes_sent;
        d["bytes_received"] = s.bytes_received;
        d["peak_extra_bytes"] = s.peak_extra_bytes;
        return d;
      });
  m.def("merge_stacked", &merge_stacked, py::arg("offsets"), py::arg("transfers"),
        py::arg("rank"), py::arg("forward"));
  m.def("inprocess_exchange", &inprocess_exchange, py::arg("method"), py::arg("group_size"),
        py::arg("offsets"), py::arg("transfers"), py::arg("forward"), py::arg("segments") = 0,
        py::arg("allow_reassociation") = false);
  m.def("exchange_methods", &exchange_methods);
}

}  // namespace kdacp::python
