// The layer job's memory (issue 21, item 4): in-process ranks whose tokens
// are one range of the stream read the job's arrays and write the whole
// outputs in place, every rank into one shared set; the job takes the .npy
// arrays' data instead of holding them twice. None of it changes a bit.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "kdacp/agreement.hpp"
#include "kdacp/error.hpp"
#include "kdacp/inprocess.hpp"
#include "kdacp/job.hpp"
#include "kdacp/job_npy.hpp"
#include "kdacp/npy.hpp"
#include "kdacp/testing/synthetic.hpp"

namespace kdacp {
namespace {

namespace fs = std::filesystem;

job::LayerJob<float> make_job(const kda::Shape& shape, std::vector<std::int64_t> cu, bool keep) {
  job::LayerJob<float> job;
  job.data = kda::synthetic_layer<float>(shape, 41);
  job.scale = kda::default_scale<float>(shape.key_dim);
  job.d_o = kda::synthetic_tensor<float>(shape.v_elems(), 42);
  job.cu_seqlens = std::move(cu);
  const std::size_t states = job.state_elems();
  job.h0 = kda::synthetic_tensor<float>(states, 43);
  job.dht = kda::synthetic_tensor<float>(states, 44);
  job.algorithm = kda::Algorithm::chunk;
  job.keep_forward = keep;
  return job;
}

// The outputs gathered by messages to rank 0 (no shared outputs).
job::LayerOutputs<float> gathered(const job::LayerJob<float>& job, std::size_t ranks,
                                  const job::LayerRunOptions& opts) {
  job::LayerOutputs<float> out;
  run_in_process(ranks, [&](const std::shared_ptr<Communicator>& comm) {
    if (auto r = job::run_context_parallel(comm, job, opts)) out = std::move(*r);
  });
  return out;
}

// Shared outputs written in place (contiguous, B = 1), copied in (zigzag,
// B = 2), and the outputs gathered by messages: the same bits as each other
// and as one device, with and without the forward cache, packed or not.
TEST(LayerMemory, SharedOutputsAreTheGatheredBits) {
  struct Case {
    kda::Shape shape;
    std::vector<std::int64_t> cu;
  };
  const std::vector<Case> cases{{{1, 200, 2, 2, 32, 32}, {}},
                                {{1, 200, 2, 4, 32, 16}, {0, 70, 71, 150, 200}},
                                {{2, 150, 1, 2, 16, 32}, {}}};
  for (const Case& c : cases)
    for (bool keep : {true, false})
      for (std::size_t ranks : {std::size_t{1}, std::size_t{3}})
        for (bool zigzag : {false, true}) {
          const job::LayerJob<float> job = make_job(c.shape, c.cu, keep);
          job::LayerRunOptions opts;
          opts.layout = job::make_layout(zigzag, {}, c.shape.tokens, ranks);
          const std::string what = opts.layout->str() + " B=" + std::to_string(c.shape.batch) +
                                   (keep ? " kept" : " recomputed");
          const job::LayerOutputs<float> shared = job::run_context_parallel(job, ranks, opts, 60);
          const job::LayerOutputs<float> sent = gathered(job, ranks, opts);
          EXPECT_TRUE(job::same_bits(shared, sent)) << what;
          EXPECT_EQ(shared.ranks, ranks) << what;
          EXPECT_EQ(shared.method, sent.method) << what;
          EXPECT_FALSE(shared.ht.empty()) << what;
          EXPECT_FALSE(shared.dh0.empty()) << what;
        }
}

// A job every rank refuses: the error comes back through the shared run.
TEST(LayerMemory, ARefusedJobThrowsThroughTheSharedRun) {
  job::LayerJob<float> job = make_job({1, 96, 1, 1, 16, 16}, {}, true);
  job.h0.resize(3);  // not [N,HV,K,V]
  EXPECT_THROW(job::run_context_parallel(job, 2, job::LayerRunOptions{}, 60), InvalidArgument);
}

TEST(LayerMemory, InPlaceWhereTokensAreOneRange) {
  const kda::Shape one_row{1, 64, 1, 1, 16, 16}, rows{2, 64, 1, 1, 16, 16};
  EXPECT_TRUE(job::layer_in_place(one_row, kda::Layout::contiguous(64, 4)));
  EXPECT_TRUE(job::layer_in_place(one_row, kda::Layout::contiguous(64, 3, std::vector<std::size_t>{10, 50, 4})));
  EXPECT_FALSE(job::layer_in_place(one_row, kda::Layout::zigzag(64, 4)));
  // Zigzag on one rank: its two parts are the stream in order.
  EXPECT_TRUE(job::layer_in_place(one_row, kda::Layout::zigzag(64, 1)));
  EXPECT_TRUE(job::layer_in_place(rows, kda::Layout::contiguous(64, 1)));
  EXPECT_FALSE(job::layer_in_place(rows, kda::Layout::contiguous(64, 2)));
  // In place, the run holds no slices: the inputs and one set of outputs less.
  const kda::Shape s{1, 4096, 4, 4, 128, 128};
  EXPECT_DOUBLE_EQ(job::layer_run_bytes(s, 1, 4, true, 4, 0, 4, false) -
                       job::layer_run_bytes(s, 1, 4, true, 4, 0, 4, true),
                   2 * job::layer_output_bytes(s, true, 4));
}

// Without the forward's cache the backward recomputes one record per
// (row, value head) in flight: as many as threads, at most B·HV, each the
// size of one pair's cache.
TEST(LayerMemory, RecomputedRecordsFollowTheThreads) {
  const kda::Shape s{2, 4096, 4, 4, 128, 128};  // B·HV = 8
  const auto chunk = kda::Algorithm::chunk;
  const double cache = job::layer_cache_bytes(s, chunk, s.tokens, 2, 4);
  EXPECT_GT(cache, 0);
  for (std::size_t threads : {0, 1, 3, 8, 64}) {
    EXPECT_DOUBLE_EQ(job::layer_backward_records_bytes(s, chunk, s.tokens, 2, 4, true, threads), cache);
    const double in_flight = double(std::min<std::size_t>(std::max<std::size_t>(threads, 1), 8));
    EXPECT_DOUBLE_EQ(job::layer_backward_records_bytes(s, chunk, s.tokens, 2, 4, false, threads),
                     cache * in_flight / 8)
        << threads;
  }
  EXPECT_EQ(job::layer_backward_records_bytes(s, kda::Algorithm::recurrent, s.tokens, 2, 4, true, 2), 0);
  EXPECT_EQ(job::layer_backward_records_bytes(s, kda::Algorithm::recurrent, s.tokens, 2, 4, false, 2), 0);
}

std::vector<std::uint64_t> hashes(const Fingerprint& f) {
  std::vector<std::uint64_t> out;
  for (const Fingerprint::Field& field : f.fields()) out.push_back(field.hash);
  return out;
}

// take_layer_job: the job of layer_job, and the files' data released while
// the shapes, dtypes and N stay for the admission and the writer.
TEST(LayerMemory, TakeLayerJobReleasesTheFilesData) {
  const fs::path dir = fs::temp_directory_path() / "kdacp_layer_memory_take";
  fs::remove_all(dir);
  fs::create_directories(dir);
  const kda::Shape s{1, 80, 2, 2, 16, 32};
  const kda::LayerData<float> data = kda::synthetic_layer<float>(s, 7);
  const std::vector<float> d_o = kda::synthetic_tensor<float>(s.v_elems(), 8);
  write_npy((dir / "q.npy").string(), data.q.data(), {1, 80, 2, 16});
  write_npy((dir / "k.npy").string(), data.k.data(), {1, 80, 2, 16});
  write_npy((dir / "v.npy").string(), data.v.data(), {1, 80, 2, 32});
  write_npy((dir / "g.npy").string(), data.g.data(), {1, 80, 2, 16});
  write_npy((dir / "beta.npy").string(), data.beta.data(), {1, 80, 2});
  write_npy((dir / "do.npy").string(), d_o.data(), {1, 80, 2, 32});
  const job::LayerNpy read = job::read_layer_npy(dir.string());
  const std::vector<std::uint64_t> before = hashes(job::layer_npy_fingerprint(read));
  job::LayerNpy in = read;
  const job::LayerJob<float> copied = job::layer_job<float>(read, 0.5f);
  const job::LayerJob<float> taken = job::take_layer_job<float>(in, 0.5f);
  EXPECT_EQ(taken.data.q, data.q);
  EXPECT_EQ(taken.data.beta, data.beta);
  EXPECT_EQ(taken.d_o, d_o);
  for (const auto& [a, b] : {std::pair{&taken.data.q, &copied.data.q}, {&taken.data.k, &copied.data.k},
                             {&taken.data.v, &copied.data.v}, {&taken.data.g, &copied.data.g},
                             {&taken.data.beta, &copied.data.beta}, {&taken.d_o, &copied.d_o}})
    EXPECT_EQ(*a, *b);
  for (const NpyArray* a : {&in.q, &in.k, &in.v, &in.g, &in.beta, &*in.d_o}) {
    EXPECT_TRUE(a->data.empty());
    EXPECT_EQ(a->dtype, DType::f32);
  }
  EXPECT_EQ(in.q.shape, read.q.shape);
  EXPECT_EQ(in.sequences, 1u);
  EXPECT_EQ(hashes(job::layer_npy_fingerprint(read)), before);  // the const one is untouched
  // The writer needs only what `in` kept.
  const job::LayerOutputs<float> out = job::run_context_parallel(taken, 2, job::LayerRunOptions{}, 60);
  job::save_layer_outputs((dir / "out").string(), in, out);
  EXPECT_EQ(read_npy((dir / "out" / "dq.npy").string()).shape, read.q.shape);
  EXPECT_EQ(read_npy((dir / "out" / "o.npy").string()).to_f32(false), out.o);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace kdacp
