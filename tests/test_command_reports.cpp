// What `kdacp run`, `kdacp plan`, `kdacp calibrate` and `kdacp bench`
// execute beyond their flags, as library code (kdacp_testing): the packed
// stream, the plan report, the calibration's flow and the layer bench's
// admission.
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "kdacp/admission.hpp"
#include "kdacp/cost_model.hpp"
#include "kdacp/error.hpp"
#include "kdacp/layout.hpp"
#include "kdacp/protocol.hpp"
#include "kdacp/report/bench_report.hpp"
#include "kdacp/report/model_validation.hpp"
#include "kdacp/report/packing.hpp"
#include "kdacp/report/plan_report.hpp"
#include "kdacp/testing/synthetic.hpp"

namespace kdacp {
namespace {

namespace fs = std::filesystem;
using report::Packing;

// The message of what `fn` throws as E ("" when it throws nothing).
template <class E, class F>
std::string message_of(F&& fn) {
  try {
    fn();
  } catch (const E& e) {
    return e.what();
  }
  return "";
}

TEST(Packing, TokensAreTheLengthsSum) {
  EXPECT_EQ(report::packed_tokens(Packing{}, 77, true, 100), 77u);
  const Packing lens{{3, 5, 4}, 0};
  EXPECT_EQ(report::packed_tokens(lens, 0, false, 100), 12u);
  EXPECT_EQ(report::packed_tokens(lens, 12, true, 100), 12u);
  EXPECT_EQ(message_of<InvalidArgument>([&] { report::packed_tokens(lens, 13, true, 100); }),
            "--seqlens sum to 12, expected --tokens 13 (or leave --tokens out)");
  EXPECT_EQ(message_of<InvalidArgument>([&] { report::packed_tokens(lens, 0, false, 11); }),
            "--seqlens sum to more than the most tokens this command takes, 11");
  EXPECT_EQ(message_of<InvalidArgument>([&] { report::packed_tokens(Packing{{3}, 2}, 0, false, 100); }),
            "--seqlens and --docs exclude each other");
}

TEST(Packing, SequencesAreCountedBeforeTheyAreDrawn) {
  EXPECT_EQ(report::packed_sequences(Packing{}, 3, 10), 3u);
  EXPECT_EQ(report::packed_sequences(Packing{{3, 5, 4}, 0}, 1, 12), 3u);
  EXPECT_EQ(report::packed_sequences(Packing{{}, 9}, 1, 12), 9u);
  EXPECT_EQ(message_of<InvalidArgument>([] { report::packed_sequences(Packing{{}, 2}, 2, 12); }),
            "--docs packs sequences into one row, expected --batch 1, not 2");
  EXPECT_EQ(message_of<InvalidArgument>([] { report::packed_sequences(Packing{{6, 6}, 0}, 3, 12); }),
            "--seqlens packs sequences into one row, expected --batch 1, not 3");
  EXPECT_EQ(message_of<InvalidArgument>([] { report::packed_sequences(Packing{{}, 13}, 1, 12); }),
            "--docs 13 is more documents than T = 12 tokens (each document needs a token)");
}

TEST(Packing, CuSeqlensOfLengthsOrOfRandomDocuments) {
  EXPECT_TRUE(report::packed_cu_seqlens(Packing{}, 2, 10, 0).empty());
  EXPECT_EQ(report::packed_cu_seqlens(Packing{{3, 5, 4}, 0}, 1, 12, 0), (std::vector<std::int64_t>{0, 3, 8, 12}));
  // --docs draws with the command's --seed + 2, so that plan and run pack alike.
  for (std::uint64_t seed : {0u, 7u}) {
    const auto cu = report::packed_cu_seqlens(Packing{{}, 5}, 1, 40, seed);
    EXPECT_EQ(cu, kda::random_cu_seqlens(40, 5, seed + 2));
    EXPECT_EQ(cu.size(), 6u);
  }
  EXPECT_THROW(report::packed_cu_seqlens(Packing{{}, 5}, 2, 40, 0), InvalidArgument);
}

TEST(PlanReport, FormatsSeconds) {
  EXPECT_EQ(report::format_seconds(0), "0");
  EXPECT_EQ(report::format_seconds(12.34e-6), "12.3 us");
  EXPECT_EQ(report::format_seconds(4.561e-3), "4.56 ms");
  EXPECT_EQ(report::format_seconds(1.2344), "1.234 s");
}

// Without tokens only the owners are known; with a packing, the parts where
// a sequence starts are cuts.
TEST(PlanReport, ShapeOfTheLayoutAndItsCuts) {
  report::PlanRequest r;
  r.batch = 2;
  r.heads = 3;
  r.key_dim = 32;
  r.value_dim = 64;
  r.zigzag = true;
  ProblemShape s = report::plan_shape_at(r, 4);
  EXPECT_EQ(s.ranks, 4u);
  EXPECT_EQ(s.slabs, 6u);
  EXPECT_EQ(s.key_dim, 32u);
  EXPECT_EQ(s.value_dim, 64u);
  ASSERT_TRUE(s.part_owners);
  EXPECT_EQ(s.part_owners->list(), PartOwners::zigzag(4).list());
  EXPECT_TRUE(s.part_cuts.empty());

  r.batch = 1;
  r.zigzag = false;
  r.tokens = 16;
  r.cu_seqlens = {0, 4, 6, 16};
  r.layout_at = [](std::size_t p) { return Layout::contiguous(16, p); };
  s = report::plan_shape_at(r, 4);
  ASSERT_TRUE(s.part_owners);
  EXPECT_EQ(s.part_owners->list(), (std::vector<std::size_t>{0, 1, 2, 3}));
  // Parts [0,4) [4,8) [8,12) [12,16): a sequence starts in the first two.
  EXPECT_EQ(s.part_cuts, Layout::contiguous(16, 4).cuts(Sequences(1, 16, r.cu_seqlens)));
  EXPECT_EQ(report::plan_shape_at(r, 2).ranks, 2u);
}

TEST(PlanReport, PrintsEveryRowAndAutosChoice) {
  report::PlanRequest r;
  r.ranks = 8;
  r.heads = 4;
  ::testing::internal::CaptureStdout();
  report::print_plan(r, CostParams{}, 0, "");
  std::fflush(stdout);
  const std::string out = ::testing::internal::GetCapturedStdout();
  EXPECT_NE(out.find("cluster: P=8, B*H=4, K=128, V=128; alpha 5.0 us, bandwidth 45 GB/s"), std::string::npos) << out;
  EXPECT_NE(out.find("layout: contiguous, 8 parts (at most 1 per rank); critical stretch 7 steps"), std::string::npos)
      << out;
  for (const ProtocolDescriptor* row : protocol_registry())
    if (!row->chooser()) {
      EXPECT_NE(out.find(std::string(row->name)), std::string::npos) << row->name;
    }
  EXPECT_NE(out.find("auto (exact): "), std::string::npos) << out;
  EXPECT_NE(out.find("auto --allow-reassociation: "), std::string::npos) << out;
}

// With Ulysses asked for: a table row per U (U = 1 and every U >= 2 dividing
// H and P) and the model's pick, in the text and in the JSON; without it,
// neither mentions Ulysses.
TEST(PlanReport, UlyssesTableAndJson) {
  report::PlanRequest r;
  r.ranks = 1024;
  r.heads = 32;
  auto capture = [&](bool json) {
    ::testing::internal::CaptureStdout();
    report::print_plan(r, CostParams{}, 0, "", json);
    std::fflush(stdout);
    return ::testing::internal::GetCapturedStdout();
  };
  const std::string plain_text = capture(false);
  EXPECT_EQ(plain_text.find("Ulysses"), std::string::npos);
  const auto plain_json = nlohmann::json::parse(capture(true));
  EXPECT_FALSE(plain_json.contains("ulysses"));
  const ProblemShape shape{1024, 32, 128, 128, 4};
  EXPECT_EQ(plain_json["rows"].size(), predict_all(CostParams{}, shape, true).size());
  EXPECT_EQ(plain_json["auto_exact"]["protocol"], protocol_label(choose_protocol(CostParams{}, shape, 0, false).config));

  UlyssesOptions o;
  o.tokens_per_rank = 1024;
  r.ulysses = o;
  o.heads = 32;
  const auto widths = predict_ulysses(CostParams{}, shape, o);
  const UlyssesPrediction pick = best_ulysses(widths);
  ASSERT_GT(pick.width, 1u);
  const std::string text = capture(false);
  EXPECT_EQ(text.rfind(plain_text, 0), 0u) << "the plain plan comes first, unchanged";
  EXPECT_NE(text.find("Ulysses x state CP: T/P=1024 tokens per rank, 2-byte activations, islands of 8 ranks"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find(fmt::format("Ulysses: the model picks U={} (state exchange over {} ranks)", pick.width,
                                  pick.state_ranks)),
            std::string::npos)
      << text;
  const auto json = nlohmann::json::parse(capture(true));
  ASSERT_TRUE(json.contains("ulysses"));
  const auto& u = json["ulysses"];
  EXPECT_EQ(u["pick"], pick.width);
  ASSERT_EQ(u["options"].size(), widths.size());
  for (std::size_t i = 0; i < widths.size(); ++i) {
    EXPECT_EQ(u["options"][i]["U"], widths[i].width);
    EXPECT_EQ(u["options"][i]["exchange_protocol"], protocol_label(widths[i].exchange.config));
    EXPECT_DOUBLE_EQ(u["options"][i]["seconds"].get<double>(), widths[i].seconds);
    EXPECT_DOUBLE_EQ(u["options"][i]["speedup_vs_plain"].get<double>(), widths[0].seconds / widths[i].seconds);
  }
}

// A layout that does not fit P fails before anything is printed.
TEST(PlanReport, LayoutErrorsComeFirst) {
  report::PlanRequest r;
  r.ranks = 4;
  r.tokens = 6;
  r.zigzag = true;
  r.layout_at = [](std::size_t p) { return Layout::zigzag(6, p); };
  ::testing::internal::CaptureStdout();
  EXPECT_THROW(report::print_plan(r, CostParams{}, 0, ""), InvalidArgument);
  std::fflush(stdout);
  EXPECT_EQ(::testing::internal::GetCapturedStdout(), "");
}

// The parameters file appears once the calibration succeeded and holds what
// was measured; loaded parameters are validated, never saved.
TEST(Calibration, MeasuresSavesAndValidates) {
  const fs::path dir = fs::temp_directory_path() / "kdacp_test_calibration";
  fs::remove_all(dir);
  fs::create_directories(dir);
  report::CalibrateRequest request;
  request.backend.backend = "inprocess";
  request.backend.ranks = 2;
  request.out = (dir / "calib.json").string();
  request.calibration = {20, std::size_t{1} << 16, 1, 0.01, SummaryShape{1, 1, 16, 16}};
  ::testing::internal::CaptureStdout();
  report::run_calibration(request, nullptr);
  std::fflush(stdout);
  const std::string measured = ::testing::internal::GetCapturedStdout();
  ASSERT_TRUE(fs::exists(request.out)) << measured;
  EXPECT_NE(measured.find("saved to " + request.out), std::string::npos) << measured;
  const CostParams p = load_cost_params(request.out);
  EXPECT_GT(p.alpha_s, 0);
  EXPECT_GT(p.gflops, 0);

  fs::remove(request.out);
  request.loaded = p;
  request.validate = true;
  request.validate_ranks = {2};
  request.min_time = 0.001;
  request.json = true;
  ::testing::internal::CaptureStdout();
  ::testing::internal::CaptureStderr();
  report::run_calibration(request, nullptr);
  std::fflush(stdout);
  std::fflush(stderr);
  const std::string records = ::testing::internal::GetCapturedStdout();
  const std::string progress = ::testing::internal::GetCapturedStderr();
  EXPECT_FALSE(fs::exists(request.out));
  EXPECT_EQ(records.front(), '[') << records;
  EXPECT_NE(records.find("\"mode\": \"model\""), std::string::npos) << records;
  EXPECT_NE(progress.find("kdacp calibrate: P=2 "), std::string::npos) << progress;
  fs::remove_all(dir);
}

// `kdacp bench layer` refuses a run larger than --max-memory before it starts.
TEST(LayerBenchReport, AdmissionComesFirst) {
  report::LayerBenchConfig c;
  report::make_quick(c);
  ::testing::internal::CaptureStdout();
  const std::string msg = message_of<OutOfMemory>([&] { report::run_layer_bench(c, "1KiB", {}); });
  std::fflush(stdout);
  EXPECT_EQ(::testing::internal::GetCapturedStdout(), "");
  EXPECT_NE(msg.find("kdacp bench layer on 2 ranks"), std::string::npos) << msg;
}

}  // namespace
}  // namespace kdacp
