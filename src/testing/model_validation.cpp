#include "kdacp/testing/model_validation.hpp"

#include "kdacp/testing/synthetic.hpp"

namespace kdacp::testing {

std::vector<ModelRow> validate_synthetic(const std::shared_ptr<Communicator>& comm, const CostParams& params,
                                         const SummaryShape& shape, const ValidationOptions& options) {
  const SyntheticSummary sm = synthetic_summary(shape, 0, comm->rank(), false);
  const SyntheticSummary gm = synthetic_summary(shape, 0, comm->rank(), true);
  std::vector<ModelRow> rows;
  for (ModelCheck& c :
       validate_cost_model(comm, params, sm.offset.view(), sm.transfer.view(), gm.offset.view(), options))
    rows.push_back({std::move(c), params});
  return rows;
}

std::vector<ModelRow> validate_in_process(const std::vector<std::size_t>& ranks, const LaunchOptions& world,
                                          const std::optional<CostParams>& params,
                                          const CalibrationOptions& calibration, const SummaryShape& shape,
                                          const ValidationOptions& options) {
  std::vector<ModelRow> rows;
  for (std::size_t p : ranks) {
    LaunchOptions o = world;
    o.backend = "inprocess";
    o.ranks = p;
    launch(o, [&](const std::shared_ptr<Communicator>& comm) {
      auto mine = validate_synthetic(comm, params ? *params : measure_cost_params(*comm, calibration), shape, options);
      if (comm->rank() == 0) rows.insert(rows.end(), mine.begin(), mine.end());
    }, nullptr);
  }
  return rows;
}

}  // namespace kdacp::testing
