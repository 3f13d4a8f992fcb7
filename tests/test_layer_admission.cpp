// Admission of `kdacp run` / `kdacp kda` with the job's layout (issue 12):
// the protocol auto names is the one the layer runs, zigzag's extra parts
// are counted, cuts follow the packing, and under a launcher a process
// counts its own rank's share.
#include <cstdint>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "kdacp/admission.hpp"
#include "kdacp/cost_model.hpp"
#include "kdacp/error.hpp"
#include "kdacp/job_npy.hpp"
#include "kdacp/job.hpp"
#include "kdacp/testing/synthetic.hpp"

namespace kdacp {
namespace {

job::LayerJob<float> small_job(const kda::Shape& shape) {
  job::LayerJob<float> job;
  job.data = kda::synthetic_layer<float>(shape, 21);
  job.scale = kda::default_scale<float>(shape.key_dim);
  job.d_o = kda::synthetic_tensor<float>(shape.v_elems(), 22);
  job.final_states = false;
  return job;
}

// With the default cost parameters, P = 4 and K = V = 32, auto picks p2p for
// one part per rank but allgather for zigzag (two parts per rank): an
// admission priced without the layout named p2p while the layer ran
// allgather. (P = 2 showed it until the model priced each collective's
// agreement.)
TEST(LayerAdmission, AutoNamesTheProtocolTheLayerRuns) {
  const kda::Shape shape{1, 16, 1, 1, 32, 32};
  const job::LayerJob<float> job = small_job(shape);
  const std::size_t ranks = 4;
  std::vector<std::string> ran;
  for (bool zigzag : {false, true}) {
    const kda::Layout layout = job::make_layout(zigzag, {}, shape.tokens, ranks);
    job::LayerRunOptions opts;
    opts.method = "auto";
    opts.layout = layout;
    const job::LayerOutputs<float> out = job::run_context_parallel(job, ranks, opts, 30);
    ran.push_back(out.method);
    const ProblemShape ps = job::layer_problem_shape(shape, sizeof(float), layout);
    EXPECT_EQ(needs_layout_rows(ps), zigzag) << layout.str();
    ExchangeOptions eo;
    eo.expected_shape = job::layer_summary_shape(shape);
    EXPECT_EQ(predict_exchange(ps, "auto", 1, eo).config.method, out.method) << layout.str();
    // The admission's message names the protocol auto will run.
    try {
      job::admit_layer_run(shape, 1, *eo.expected_shape, layout, true, 0, "auto", 1, eo, "1B");
      ADD_FAILURE() << "1 byte admitted the run";
    } catch (const OutOfMemory& e) {
      EXPECT_NE(std::string(e.what()).find("with " + out.method), std::string::npos) << e.what();
    }
  }
  // The shape tells the layouts apart (else this test shows nothing: pick
  // another shape if the cost model changed).
  EXPECT_NE(ran[0], ran[1]);
}

// Two packed documents over eight ranks (parts 0 and 4 are cuts) on a
// 12 GB/s, 5 µs network: auto weighs the stream's cuts (the chain is four
// steps long) and runs p2p, where without them it would run a grouped
// all-gather;
// the admission names the same protocol, and the outputs are the chain's.
TEST(LayerAdmission, AutoWeighsThePackingsCuts) {
  const kda::Shape shape{1, 128, 2, 2, 32, 64};
  job::LayerJob<float> job = small_job(shape);
  job.cu_seqlens = {0, 64, 128};
  const std::size_t ranks = 8;
  const kda::Layout layout = kda::Layout::contiguous(shape.tokens, ranks);
  job::LayerRunOptions opts;
  opts.method = "auto";
  opts.exchange.cost.alpha_s = 5e-6;
  opts.exchange.cost.beta_s_per_byte = 1 / 12e9;
  const ExchangeOptions eo =
      job::layer_exchange_options(opts.exchange, shape, DType::f32, layout, job.sequences());
  EXPECT_EQ(eo.expected_cuts, (std::vector<bool>{true, false, false, false, true, false, false, false}));
  const ProblemShape ps = job::layer_problem_shape(shape, sizeof(float), layout);
  ASSERT_EQ(predict_exchange(ps, "auto", 1, eo).config.method, "grouped_allgather_p2p")
      << "the model changed: pick another case";
  const job::LayerOutputs<float> out = job::run_context_parallel(job, ranks, opts, 60);
  EXPECT_EQ(out.method, "p2p");
  opts.method = "p2p";
  EXPECT_TRUE(job::same_bits(out, job::run_context_parallel(job, ranks, opts, 60)));
  opts.method = "auto";
  try {
    job::admit_layer_job(job::LayerNpy{}, job, opts, ranks, 0, "1B", false);
    ADD_FAILURE() << "1 byte admitted the run";
  } catch (const OutOfMemory& e) {
    EXPECT_NE(std::string(e.what()).find("with p2p"), std::string::npos) << e.what();
  }
}

// A zigzag rank holds two parts: its exchange holds two offsets, transfers
// and returned states, and the layer two parts' summaries.
TEST(LayerAdmission, ZigzagCountsItsExtraParts) {
  const kda::Shape shape{1, 64, 2, 2, 64, 64};
  const std::size_t ranks = 4;
  const kda::Layout plain = kda::Layout::contiguous(shape.tokens, ranks);
  const kda::Layout zigzag = kda::Layout::zigzag(shape.tokens, ranks);
  const ProblemShape ps_plain = job::layer_problem_shape(shape, 4, plain);
  const ProblemShape ps_zig = job::layer_problem_shape(shape, 4, zigzag);
  EXPECT_TRUE(ps_zig.part_owners == PartOwners::zigzag(ranks));
  const Prediction p2p_plain = predict(CostParams{}, ps_plain, {"p2p", 1, 0});
  const Prediction p2p_zig = predict(CostParams{}, ps_zig, {"p2p", 1, 0});
  const double state = 2.0 * 64 * 64 * 4, transfer = 2.0 * 64 * 64 * 4;  // B·HV = 2, K = V = 64
  EXPECT_DOUBLE_EQ(exchange_rank_bytes(ps_zig, p2p_zig) - double(p2p_zig.peak_extra_bytes),
                   2 * (exchange_rank_bytes(ps_plain, p2p_plain) - double(p2p_plain.peak_extra_bytes)));
  EXPECT_DOUBLE_EQ(exchange_rank_bytes(ps_plain, p2p_plain) - double(p2p_plain.peak_extra_bytes),
                   2 * state + transfer);
  EXPECT_GT(job::layer_run_bytes(shape, 1, ranks, true, 4, 0, zigzag.parts().size()),
            job::layer_run_bytes(shape, 1, ranks, true, 4, 0));
}

// Cuts: the parts holding a sequence start, which shorten the chain.
TEST(LayerAdmission, LayoutCutsFollowThePacking) {
  const kda::Layout contiguous = kda::Layout::contiguous(8, 4);
  auto packed = [](std::vector<std::int64_t> cu) { return Sequences(1, 8, cu); };
  EXPECT_EQ(contiguous.cuts(packed({0, 4, 8})), (std::vector<bool>{true, false, true, false}));
  EXPECT_EQ(contiguous.cuts(packed({0, 3, 8})), (std::vector<bool>{true, true, false, false}));
  EXPECT_EQ(contiguous.cuts(Sequences(3, 8)), (std::vector<bool>{true, false, false, false}));
  EXPECT_THROW(contiguous.cuts(Sequences(1, 9, std::vector<std::int64_t>{0, 4, 9})), InvalidArgument);
  EXPECT_THROW(packed({0, 4, 9}), InvalidArgument);
  const kda::Layout zigzag = kda::Layout::zigzag(16, 4);  // 8 parts of 2 tokens
  ProblemShape ps{4, 1, 32, 32, 4};
  ps.part_owners = zigzag.owners();
  EXPECT_EQ(chain_profile(ps, 1).steps, 7u);
  ps.part_cuts = zigzag.cuts(Sequences(1, 16, std::vector<std::int64_t>{0, 8, 16}));
  EXPECT_EQ(ps.part_cuts, (std::vector<bool>{true, false, false, false, true, false, false, false}));
  // Stretches 0-4 and 4-7, but rank 2 handles part 5 only after part 2
  // (two steps in): 0 -> 1 -> 2, then 5 -> 6 -> 7 is the critical path.
  EXPECT_EQ(chain_profile(ps, 1).steps, 5u);
  EXPECT_TRUE(contiguous.owners().is_one_per_rank());
  EXPECT_FALSE(needs_layout_rows(job::layer_problem_shape(kda::Shape{1, 8, 1, 1, 16, 16}, 4, contiguous)));
}

// Under a launcher each process holds one rank: its estimate is one rank's
// share plus the job and rank 0's outputs, not the whole run of P ranks.
TEST(LayerAdmission, OneRankPerProcessCountsItsShare) {
  const kda::Shape shape{1, 1 << 16, 4, 4, 128, 128};
  // On one rank the share is the whole run.
  const kda::Layout one = kda::Layout::contiguous(shape.tokens, 1);
  EXPECT_DOUBLE_EQ(job::layer_rank_bytes(shape, 1, one, true, 4, 1e6),
                   job::layer_run_bytes(shape, 1, 1, true, 4, 1e6));
  for (bool zig : {false, true}) {
    const kda::Layout layout = job::make_layout(zig, {}, shape.tokens, 16);
    const double whole = job::compare_protocols_bytes(shape, 1, layout, false);
    const double share = job::compare_protocols_bytes(shape, 1, layout, true);
    EXPECT_LT(share, whole) << layout.str();
    // Still at least the job and rank 0's gathered outputs.
    EXPECT_GT(share, 2 * job::layer_output_bytes(shape, true, 4)) << layout.str();
    EXPECT_LT(job::layer_rank_bytes(shape, 1, layout, true, 4, 0),
              job::layer_run_bytes(shape, 1, 16, true, 4, 0, layout.parts().size()) / 2)
        << layout.str();
  }
}

// The Ulysses layer's admission: its buffers per rank (the kept head slice
// and its gradients, the all-to-alls' send and receive buffers: at least
// four times a rank's inputs) on top of the plain run, its exchange priced
// over the head groups; the message names the width.
TEST(LayerAdmission, UlyssesCountsItsBuffersAndNamesTheWidth) {
  const kda::Shape shape{1, 1 << 14, 8, 8, 128, 128};
  const kda::Layout layout = kda::Layout::contiguous(shape.tokens, 8);
  const double rank_inputs = double(shape.tokens / 8) * (8 * (2 * 128 + 128 + 128 + 1)) * 4;
  const double extra = job::ulysses_rank_bytes(shape, 1, layout, 2, true, 4);
  EXPECT_GE(extra, 4 * rank_inputs);
  EXPECT_EQ(job::ulysses_rank_bytes(shape, 1, layout, 1, true, 4), 0.0);
  ExchangeOptions eo;
  eo.expected_shape = job::layer_summary_shape(shape);
  auto admitted = [&](std::size_t ulysses, double limit) {
    try {
      job::admit_layer_run(shape, 1, *eo.expected_shape, layout, true, 0, "auto", 1, eo,
                           std::to_string(static_cast<long long>(limit)) + "B", false, 0, ulysses);
      return std::string();
    } catch (const OutOfMemory& e) {
      return std::string(e.what());
    }
  };
  // Find the plain run's need, then give exactly that: Ulysses needs more.
  double lo = 1, hi = 1e12;
  while (hi - lo > 1e3) {
    const double mid = (lo + hi) / 2;
    (admitted(1, mid).empty() ? hi : lo) = mid;
  }
  EXPECT_TRUE(admitted(1, hi).empty());
  const std::string refused = admitted(2, hi);
  EXPECT_NE(refused.find("with Ulysses U=2 + "), std::string::npos) << refused;
  EXPECT_TRUE(admitted(2, hi + 8 * extra).empty());
  EXPECT_THROW(admitted(3, 1e12), InvalidArgument);
}

}  // namespace
}  // namespace kdacp
