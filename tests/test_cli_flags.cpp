// The one parser behind every numeric flag (kdacp/units.hpp), the input
// checks (kdacp/finite.hpp), memory admission (kdacp/admission.hpp) and
// staged outputs (kdacp/output.hpp).
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>

#include <gtest/gtest.h>

#include "kdacp/admission.hpp"
#include "kdacp/cost_model.hpp"
#include "kdacp/error.hpp"
#include "kdacp/finite.hpp"
#include "kdacp/inprocess.hpp"
#include "kdacp/kda_cp.hpp"
#include "kdacp/mesh.hpp"
#include "kdacp/npy.hpp"
#include "kdacp/output.hpp"
#include "kdacp/protocol.hpp"
#include "kdacp/report/layer_bench.hpp"
#include "kdacp/report/bench_report.hpp"
#include "kdacp/job_npy.hpp"
#include "kdacp/job.hpp"
#include "kdacp/testing/synthetic.hpp"
#include "kdacp/units.hpp"

namespace kdacp {
namespace {

namespace fs = std::filesystem;

TEST(CliFlags, IntegersNeverWrap) {
  const IntRange dims{16, 256, 16};
  EXPECT_EQ(parse_integer("128", dims, "--key-dim"), 128u);
  for (const char* bad : {"-16", "17", "0", "272", "1e2", "0x10", "", " 16", "16 ", "+16", "99999999999999999999999"})
    EXPECT_THROW(parse_integer(bad, dims, "--key-dim"), InvalidArgument) << bad;
  EXPECT_EQ(parse_integer("18446744073709551615", IntRange{}, "--seed"), std::numeric_limits<std::uint64_t>::max());
  try {
    parse_integer("-16", dims, "--key-dim");
  } catch (const InvalidArgument& e) {
    EXPECT_STREQ(e.what(), "--key-dim is '-16', expected an integer in [16, 256] that is a multiple of 16");
  }
}

TEST(CliFlags, RealsAreFiniteAndInRange) {
  const RealRange positive{0, std::numeric_limits<double>::max(), true};
  EXPECT_DOUBLE_EQ(parse_real("0.125", positive, "--scale"), 0.125);
  for (const char* bad : {"0", "-1", "nan", "inf", "-inf", "1e999", "1x", "", "abc"})
    EXPECT_THROW(parse_real(bad, positive, "--scale"), InvalidArgument) << bad;
  EXPECT_DOUBLE_EQ(parse_real("86400", kTimeoutRange, "--timeout"), 86400);
  for (const char* bad : {"86401", "1e10", "1e300", "nan", "0"})
    EXPECT_THROW(parse_real(bad, kTimeoutRange, "--timeout"), InvalidArgument) << bad;
}

TEST(CliFlags, QuantitiesWithUnits) {
  EXPECT_DOUBLE_EQ(parse_seconds("5us", "--alpha"), 5e-6);
  EXPECT_DOUBLE_EQ(parse_rate("50GB/s", "--bandwidth"), 50e9);
  EXPECT_EQ(parse_bytes("2GiB", "--memory-budget"), std::size_t{2} << 30);
  EXPECT_EQ(parse_bytes("1.5KiB", "--memory-budget"), 1536u);
  // A fraction of a byte would truncate to 0, the "unlimited" budget (found by fuzz/units_fuzz.cpp).
  for (const char* bad : {"1e30GiB", "-1GiB", "0", "nanMiB", "5parsecs", "1e400", ".81", "0.5B"})
    EXPECT_THROW(parse_bytes(bad, "--memory-budget"), InvalidArgument) << bad;
  EXPECT_THROW(parse_seconds("inf", "--alpha"), InvalidArgument);
  EXPECT_THROW(parse_rate("-5GB/s", "--bandwidth"), InvalidArgument);
}

TEST(CliFlags, FindsTheFirstNonFiniteValue) {
  const std::vector<float> v{1.f, 2.f, NAN, INFINITY};
  EXPECT_EQ(find_non_finite(std::span<const float>(v)), std::optional<std::size_t>(2));
  const std::vector<double> ok{0.0, -1.0};
  EXPECT_EQ(find_non_finite(std::span<const double>(ok)), std::nullopt);
  EXPECT_EQ(find_outside(std::span<const double>(ok), -0.5, 1.0), std::optional<std::size_t>(1));
  EXPECT_EQ(index_string(7, {2, 2, 2}), "[1,1,1]");
  NpyArray a;
  a.shape = {2, 2};
  const std::vector<float> data{0.f, 0.5f, -INFINITY, 0.f};
  a.data.resize(sizeof(float) * data.size());
  std::memcpy(a.data.data(), data.data(), a.data.size());
  EXPECT_THROW(require_finite(a, "S.npy"), InvalidArgument);
  try {
    require_finite(a, "S.npy");
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("S.npy: element [1,0] is -inf"), std::string::npos) << e.what();
  }
}

// One validator for the CLI (.npy) and kdacp.torch (tensor memory): the name,
// the multi-index, the exact value (shortest round-trip text) and the rule.
TEST(CliFlags, ValidatorNamesTheElementAndItsExactValue) {
  const std::vector<float> beta{0.5f, 1.0000001f, 0.f, 0.f, 0.f, 0.f};
  try {
    require_kda_beta(tensor_ref("beta", {1, 2, 3}, std::span<const float>(beta)));
    ADD_FAILURE() << "beta 1.0000001 accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_EQ(std::string(e.what()), "beta: element [0,0,1] is 1.0000001, expected beta in [0, 1]");
  }
  const std::vector<double> g{-1.0, -0.0, 1e-300, -2.0};
  try {
    require_kda_gate(tensor_ref("g", {2, 2}, std::span<const double>(g)));
    ADD_FAILURE() << "g > 0 accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_EQ(std::string(e.what()), "g: element [1,0] is 1e-300, expected g <= 0 (the log of a decay in (0, 1])");
  }
  const std::vector<double> q{0.1, NAN};
  EXPECT_THROW(require_finite(tensor_ref("q", {2}, std::span<const double>(q))), InvalidArgument);
  EXPECT_THROW(tensor_ref("q", {3}, std::span<const double>(q)), InvalidArgument);
  EXPECT_EQ(exact_string(0.1), "0.1");
  EXPECT_EQ(exact_string(3.4028235e38f), "3.4028235e+38");
  // The .npy overloads are the same check: the same message.
  NpyArray a;
  a.shape = {1, 2, 3};
  a.data.resize(sizeof(float) * beta.size());
  std::memcpy(a.data.data(), beta.data(), a.data.size());
  try {
    require_kda_beta(tensor_ref(a, "beta"));
    ADD_FAILURE() << "beta.npy 1.0000001 accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_EQ(std::string(e.what()), "beta: element [0,0,1] is 1.0000001, expected beta in [0, 1]");
  }
}

TEST(CliFlags, MemoryAdmission) {
  EXPECT_GT(available_memory_bytes(), 0u);
  EXPECT_NO_THROW(require_memory(1024, 1024, "x", "--max-memory"));
  EXPECT_THROW(require_memory(1025, 1024, "x", "--max-memory"), OutOfMemory);
  const ProblemShape shape{4096, 1, 16, 16, 4};
  const Prediction ag = predict_exchange(shape, "allgather", 1, ExchangeOptions{});
  // allgather holds every rank's S and M: 4096 · (16·16 + 16·16) floats.
  EXPECT_GE(exchange_rank_bytes(shape, ag), 4096.0 * 512 * 4);
  EXPECT_THROW(predict_exchange(shape, "ring", 1, ExchangeOptions{}), InvalidArgument);
}

TEST(CliOutput, AppearsOnlyOnCommitAndRemovesStaleFiles) {
  const fs::path dir = fs::temp_directory_path() / ("kdacp_output_test_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  {
    StagedOutput out(dir.string(), {"a.npy", "b.npy"});
    std::ofstream(out.path("a.npy")) << "partial";
  }
  EXPECT_FALSE(fs::exists(dir)) << "an uncommitted output leaves nothing behind";
  fs::create_directories(dir);
  std::ofstream(dir / "b.npy") << "old run";
  std::ofstream(dir / "keep.txt") << "not ours";
  {
    StagedOutput out(dir.string(), {"a.npy", "b.npy"});
    std::ofstream(out.path("a.npy")) << "new";
    out.commit();
  }
  EXPECT_TRUE(fs::exists(dir / "a.npy"));
  EXPECT_FALSE(fs::exists(dir / "b.npy")) << "an earlier run's output this run did not write";
  EXPECT_TRUE(fs::exists(dir / "keep.txt"));
  EXPECT_EQ(std::distance(fs::directory_iterator(dir), fs::directory_iterator{}), 2);
  fs::remove_all(dir);
}

// `kdacp run --docs N`: a random packing, every document at least one token.
TEST(LayerJob, RandomPackingsAreValidAndSeeded) {
  for (std::size_t tokens : {1u, 2u, 7u, 100u})
    for (std::size_t docs = 1; docs <= tokens; docs += docs < 8 ? 1 : 37) {
      const std::vector<std::int64_t> cu = kda::random_cu_seqlens(tokens, docs, 5);
      ASSERT_EQ(cu.size(), docs + 1);
      EXPECT_EQ(cu.front(), 0);
      EXPECT_EQ(cu.back(), static_cast<std::int64_t>(tokens));
      for (std::size_t n = 0; n < docs; ++n) EXPECT_LT(cu[n], cu[n + 1]) << tokens << " " << docs << " " << n;
      EXPECT_EQ(cu, kda::random_cu_seqlens(tokens, docs, 5));
    }
  EXPECT_NE(kda::random_cu_seqlens(1000, 10, 1), kda::random_cu_seqlens(1000, 10, 2));
  EXPECT_THROW(kda::random_cu_seqlens(8, 9, 0), InvalidArgument);
  EXPECT_THROW(kda::random_cu_seqlens(8, 0, 0), InvalidArgument);
}

TEST(LayerJob, MakeLayout) {
  const std::vector<std::size_t> counts{3, 1, 4};
  EXPECT_EQ(job::make_layout(false, counts, 8, 3).local_tokens(2), 4u);
  EXPECT_EQ(job::make_layout(false, {}, 8, 3).local_tokens(2), 2u);
  EXPECT_THROW(job::make_layout(false, counts, 9, 3), InvalidArgument);
  EXPECT_THROW(job::make_layout(true, std::vector<std::size_t>{4, 4}, 8, 2), InvalidArgument);
  EXPECT_THROW(job::make_layout(true, {}, 7, 4), InvalidArgument);
  EXPECT_EQ(job::make_layout(true, {}, 8, 4).owners().list(), (std::vector<std::size_t>{0, 1, 2, 3, 3, 2, 1, 0}));
}

// A layout for another T or P than the job's is refused before any message.
TEST(LayerJob, LayoutOfAnotherStreamIsRefused) {
  job::LayerJob<float> job;
  const kda::Shape shape{1, 12, 1, 1, 16, 16};
  job.data = kda::synthetic_layer<float>(shape, 1);
  job.scale = kda::default_scale<float>(shape.key_dim);
  job::LayerRunOptions opts;
  opts.method = "p2p";
  for (const kda::Layout& other : {kda::Layout::contiguous(13, 3), kda::Layout::contiguous(12, 2)}) {
    opts.layout = other;
    try {
      job::run_context_parallel(job, 3, opts, 30);
      ADD_FAILURE() << other.str() << " accepted";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(" tokens on "), std::string::npos) << e.what();
    }
  }
}

// The job runner of `kdacp run` / `kdacp kda` on in-process ranks (the same
// code runs one process per rank): packed sequences with h0, dht and d_o in
// the zigzag and an uneven contiguous layout give one device's outputs, and
// exact protocols the same bits.
TEST(LayerJob, InProcessRunnerMatchesOneDevice) {
  job::LayerJob<double> job;
  const kda::Shape shape{1, 29, 1, 2, 16, 16};
  job.data = kda::synthetic_layer<double>(shape, 3);
  job.scale = kda::default_scale<double>(shape.key_dim);
  job.cu_seqlens = {0, 4, 5, 17, 29};
  const std::size_t states = 4 * shape.value_heads * shape.key_dim * shape.value_dim;
  job.h0 = kda::synthetic_tensor<double>(states, 4);
  job.d_o = kda::synthetic_tensor<double>(shape.v_elems(), 5);
  job.dht = kda::synthetic_tensor<double>(states, 6);
  const job::LayerOutputs<double> single = job::run_single(job, 1);
  ASSERT_EQ(single.ht.size(), states);
  ASSERT_EQ(single.dh0.size(), states);
  auto rel = [](const std::vector<double>& a, const std::vector<double>& b) {
    double num = 0, den = 0;
    for (std::size_t i = 0; i < a.size(); ++i) {
      num += (a[i] - b[i]) * (a[i] - b[i]);
      den += b[i] * b[i];
    }
    return std::sqrt(num / den);
  };
  for (const kda::Layout& layout : {kda::Layout::uneven(29, 3, std::vector<std::size_t>{2, 3, 24}),
                                    kda::Layout::zigzag(29, 3)}) {
    std::optional<job::LayerOutputs<double>> first;
    for (const char* method : {"p2p", "allgather"}) {
      job::LayerRunOptions opts;
      opts.method = method;
      opts.layout = layout;
      const job::LayerOutputs<double> got = job::run_context_parallel(job, 3, opts, 30);
      EXPECT_EQ(got.ranks, 3u);
      EXPECT_EQ(got.backend, "inprocess");
      const std::vector<const std::vector<double>*> g{&got.o, &got.dq, &got.dk, &got.dv, &got.dg, &got.dbeta,
                                                      &got.ht, &got.dh0},
          w{&single.o, &single.dq, &single.dk, &single.dv, &single.dg, &single.dbeta, &single.ht, &single.dh0};
      for (std::size_t i = 0; i < g.size(); ++i) {
        ASSERT_EQ(g[i]->size(), w[i]->size()) << i;
        EXPECT_LT(rel(*g[i], *w[i]), 1e-12) << layout.str() << " " << method << " field " << i;
      }
      if (!first) {
        first = got;
        continue;
      }
      const std::vector<const std::vector<double>*> f{&first->o,  &first->dq, &first->dk, &first->dv,
                                                      &first->dg, &first->dbeta, &first->ht, &first->dh0};
      for (std::size_t i = 0; i < g.size(); ++i)
        EXPECT_EQ(std::memcmp(g[i]->data(), f[i]->data(), g[i]->size() * sizeof(double)), 0)
            << layout.str() << " " << method << " field " << i << " differs from p2p";
    }
  }
  // Bad jobs are refused naming the array, before any rank starts.
  job.h0.pop_back();
  EXPECT_THROW(job.sequences(), InvalidArgument);
}

// The job's algorithm reaches both the one-device reference and every rank
// (`kdacp run/kda --algorithm`): chunk differs from recurrent in the last bits
// only, and the CP layer with chunk matches one device with chunk.
TEST(LayerJob, AlgorithmReachesOneDeviceAndEveryRank) {
  job::LayerJob<float> job;
  const kda::Shape shape{1, 150, 1, 2, 16, 32};  // chunks of 64: two whole, one partial
  job.data = kda::synthetic_layer<float>(shape, 8);
  job.scale = kda::default_scale<float>(shape.key_dim);
  job.cu_seqlens = {0, 70, 71, 150};
  const std::size_t states = 3 * shape.value_heads * shape.key_dim * shape.value_dim;
  job.h0 = kda::synthetic_tensor<float>(states, 9);
  job.d_o = kda::synthetic_tensor<float>(shape.v_elems(), 10);
  job.dht = kda::synthetic_tensor<float>(states, 11);
  job.algorithm = kda::Algorithm::recurrent;
  const job::LayerOutputs<float> recurrent = job::run_single(job, 1);
  job.algorithm = kda::Algorithm::chunk;
  const job::LayerOutputs<float> chunk = job::run_single(job, 2);
  EXPECT_FALSE(job::same_bits(chunk, recurrent));
  for (double e : job::relative_errors(chunk, recurrent)) EXPECT_LT(e, 5e-5);
  job::LayerRunOptions opts;
  opts.method = "p2p";
  opts.layout = kda::Layout::uneven(150, 3, std::vector<std::size_t>{40, 90, 20});
  const job::LayerOutputs<float> cp = job::run_context_parallel(job, 3, opts, 30);
  for (double e : job::relative_errors(cp, chunk)) EXPECT_LT(e, 2e-5);
  job.algorithm = kda::Algorithm::recurrent;
  const job::LayerOutputs<float> cp_recurrent = job::run_context_parallel(job, 3, opts, 30);
  EXPECT_FALSE(job::same_bits(cp, cp_recurrent));
  for (double e : job::relative_errors(cp_recurrent, recurrent)) EXPECT_LT(e, 2e-5);
}

// The chunk forward's kept states (LayerJob::keep_forward: kda::ForwardCache
// through forward_sequences and the CP layer's Saved, one record per sequence
// piece of every part) change no bit of any output, one device and CP, with
// several pieces per part, zigzag (two parts per rank) and a warm-up step
// (the layer reuses the cache once the first step's Saved is gone).
TEST(LayerJob, KeptForwardChangesNoBit) {
  job::LayerJob<float> job;
  const kda::Shape shape{1, 203, 1, 2, 16, 32};
  job.data = kda::synthetic_layer<float>(shape, 12);
  job.scale = kda::default_scale<float>(shape.key_dim);
  job.algorithm = kda::Algorithm::chunk;
  job.cu_seqlens = {0, 3, 70, 71, 140, 203};
  const std::size_t states = 5 * shape.value_heads * shape.key_dim * shape.value_dim;
  job.h0 = kda::synthetic_tensor<float>(states, 13);
  job.d_o = kda::synthetic_tensor<float>(shape.v_elems(), 14);
  job.dht = kda::synthetic_tensor<float>(states, 15);
  job.keep_forward = false;
  const job::LayerOutputs<float> want = job::run_single(job, 2);
  job.keep_forward = true;
  EXPECT_TRUE(job::same_bits(job::run_single(job, 2), want)) << "one device";
  job.warmup_steps = 1;
  EXPECT_TRUE(job::same_bits(job::run_single(job, 1), want)) << "one device, after a warm-up step";
  for (const kda::Layout& layout : {kda::Layout::uneven(203, 3, std::vector<std::size_t>{50, 120, 33}),
                                    kda::Layout::zigzag(203, 3)}) {
    job::LayerRunOptions opts;
    opts.method = "p2p";
    opts.layout = layout;
    job.keep_forward = false;
    job.warmup_steps = 0;
    const job::LayerOutputs<float> cp = job::run_context_parallel(job, 3, opts, 30);
    job.keep_forward = true;
    EXPECT_TRUE(job::same_bits(job::run_context_parallel(job, 3, opts, 30), cp)) << layout.str();
    job.warmup_steps = 2;
    EXPECT_TRUE(job::same_bits(job::run_context_parallel(job, 3, opts, 30), cp))
        << layout.str() << " after two warm-up steps";
  }
}

// A layer that keeps its chunk forward reuses one cache per step once the
// step's Saved is gone, holds one more while a Saved is alive, and a Saved
// without its cache (keep_forward off) recomputes: the same bits each way.
TEST(LayerJob, LayerReusesItsForwardCache) {
  const kda::Shape shape{1, 130, 1, 1, 16, 16};
  const kda::LayerData<float> data = kda::synthetic_layer<float>(shape, 16);
  const std::vector<float> d_o = kda::synthetic_tensor<float>(shape.v_elems(), 17);
  run_in_process(1, [&](const std::shared_ptr<Communicator>& world) {
    const DeviceMesh mesh = DeviceMesh::create(world, {1}, {"cp"});
    kda::ContextParallelLayer<float> layer(mesh, "p2p", 1, {}, kda::Exec{{nullptr, KernelKind::best}, kda::Algorithm::chunk});
    layer.keep_forward(false);
    const auto in = data.inputs(kda::default_scale<float>(shape.key_dim));
    std::vector<float> o(shape.v_elems()), dq(shape.qk_elems()), dk(shape.qk_elems()), dv(shape.v_elems()),
        dg(shape.g_elems()), db(shape.beta_elems());
    const kda::Grads<float> grads{dq.data(), dk.data(), dv.data(), dg.data(), db.data(), nullptr};
    const kda::Saved plain = layer.forward(in, o.data());
    EXPECT_EQ(plain.kept_f32, nullptr);
    layer.backward(in, plain, d_o.data(), grads);
    const std::vector<float> want = dk;
    layer.keep_forward(true);
    {
      const kda::Saved a = layer.forward(in, o.data());
      ASSERT_NE(a.kept_f32, nullptr);
      const kda::Saved b = layer.forward(in, o.data());  // a is alive: a second cache
      EXPECT_NE(a.kept_f32, b.kept_f32);
      layer.backward(in, b, d_o.data(), grads);
      EXPECT_EQ(dk, want);
      layer.backward(in, a, d_o.data(), grads);
      EXPECT_EQ(dk, want);
      layer.backward(in, a, d_o.data(), grads);  // twice: the cache is rewound
      EXPECT_EQ(dk, want);
    }
    const std::size_t held = layer.forward_cache_bytes();
    EXPECT_EQ(held, 2 * kda::ForwardCache<float>::record_elems(shape, kda::Algorithm::chunk) * sizeof(float));
    const kda::Saved c = layer.forward(in, o.data());  // reuses one of the two
    EXPECT_EQ(layer.forward_cache_bytes(), held);
    layer.backward(in, c, d_o.data(), grads);
    EXPECT_EQ(dk, want);
  });
}

TEST(CliFlags, ValuesPrintedExactly) {
  EXPECT_EQ(exact_string(1.0000001f), "1.0000001");
  EXPECT_EQ(exact_string(1.0000000000000002), "1.0000000000000002");
  EXPECT_EQ(exact_string(std::numeric_limits<float>::infinity()), "inf");
  NpyArray beta;
  beta.shape = {1, 2, 1};
  const float values[] = {0.5f, 1.0000001f};
  beta.data.resize(sizeof values);
  std::memcpy(beta.data.data(), values, sizeof values);
  try {
    require_within(beta, "beta.npy", 0, 1, "beta in [0, 1]");
    FAIL() << "beta 1.0000001 accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("element [0,1,0] is 1.0000001, expected beta in [0, 1]"), std::string::npos)
        << e.what();
  }
}

// Every output file kdacp kda would write is checked before any is: the
// first non-finite value is named by file, element and value.
TEST(LayerNpy, NonFiniteOutputsNamedBeforeWriting) {
  job::LayerNpy in;
  const std::size_t t = 3, k = 16;
  for (NpyArray* a : {&in.q, &in.k, &in.v, &in.g}) a->shape = {1, t, 1, k};
  in.beta.shape = {1, t, 1};
  in.d_o = in.v;
  in.sequences = 1;
  job::LayerOutputs<double> out;
  for (std::vector<double>* f : {&out.o, &out.dq, &out.dk, &out.dv, &out.dg}) f->assign(t * k, 0.25);
  out.dbeta.assign(t, 0.5);
  out.ht.assign(k * k, 1);
  out.dh0.assign(k * k, 1);
  EXPECT_NO_THROW(job::require_finite_outputs(in, out));
  out.dg[k + 3] = -std::numeric_limits<double>::infinity();
  out.dq[2 * k + 5] = std::nan("");
  try {
    job::require_finite_outputs(in, out);
    FAIL() << "a NaN in dq passed";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("dq.npy element [0,2,0,5] is nan (float64)"), std::string::npos) << e.what();
  }
  out.dq[2 * k + 5] = 0;
  EXPECT_THROW(job::require_finite_outputs(in, out), Error);
  try {
    job::require_finite_outputs(in, out);
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("dg.npy element [0,1,0,3] is -inf"), std::string::npos) << e.what();
  }
  // Without do.npy only o and ht are written, and only they are checked.
  in.d_o.reset();
  EXPECT_NO_THROW(job::require_finite_outputs(in, out));
  out.ht[17] = std::numeric_limits<double>::infinity();
  EXPECT_THROW(job::require_finite_outputs(in, out), Error);
}

// Inputs are regular files: a FIFO or a directory is refused by stat, before
// an open that would block.
TEST(CliFlags, InputsMustBeRegularFiles) {
  const fs::path dir = fs::temp_directory_path() / ("kdacp_fifo_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const fs::path fifo = dir / "q.npy";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  try {
    read_npy(fifo.string());
    FAIL() << "a FIFO was read";
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find("q.npy: is a FIFO (named pipe), expected a regular file"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(job::read_cu_seqlens_npy(fifo.string()), IoError);
  EXPECT_THROW(load_cost_params(fifo.string()), IoError);
  EXPECT_THROW(read_npy(dir.string()), IoError);
  fs::remove_all(dir);
}

// --cold: a fresh layer's first step per repeat and algorithm, timed beside
// the warm ones (twice the runs), its median in cold_seconds.
TEST(LayerErrors, NaNOrAboveToleranceIsNamed) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  EXPECT_EQ(job::errors_above({1e-7, nan, 1.88, 5e-5, 5.1e-5, 0, 0, 2e-4}, 5e-5),
            (std::vector<std::string>{"dq nan", "dk 1.88", "dg 5.1e-05", "dh0 0.0002"}));
  EXPECT_TRUE(job::errors_above({1e-7, 0, 5e-5}, 5e-5).empty());
  EXPECT_EQ(job::layer_error_tolerance("p2p", 4, 128), job::kLayerFloat32Tolerance);
  EXPECT_EQ(job::layer_error_tolerance("none", 1, 128), job::kLayerFloat32Tolerance);
  EXPECT_EQ(job::layer_error_tolerance("recursive_doubling", 8, 128),
            job::kLayerFloat32Tolerance + error_bound(find_protocol("recursive_doubling"), 8, 128));
  EXPECT_GT(error_bound(find_protocol("recursive_doubling"), 8, 128), 0);
  report::LayerBenchResult res;
  report::LayerBenchRecord base, ok, bad;
  base.mode = ok.mode = "single";
  bad.mode = "cp";
  base.algorithm = kda::Algorithm::recurrent;
  ok.algorithm = bad.algorithm = kda::Algorithm::chunk;
  base.rel_errors.assign(6, 0);
  ok.rel_errors.assign(6, 1e-6);
  bad.rel_errors = {1e-6, 1e-6, 1e-6, 1e-6, nan, 3e-4};
  for (report::LayerBenchRecord* r : {&base, &ok, &bad}) r->tolerance = job::kLayerFloat32Tolerance;
  res.records = {base, ok};
  EXPECT_TRUE(report::layer_bench_failures(res).empty());
  res.records.push_back(bad);
  EXPECT_EQ(report::layer_bench_failures(res),
            std::vector<std::string>{"context-parallel chunk vs recurrent: dg nan, dbeta 0.0003"});
}

}  // namespace
}  // namespace kdacp
