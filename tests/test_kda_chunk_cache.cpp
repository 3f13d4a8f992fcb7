// The chunk forward's ForwardCache: it changes no bit of o, the final state
// or any gradient, is read again after rewind(), reuses its buffers after
// clear(), hands out only caches nobody holds, and keeps nothing for the
// recurrent algorithm.
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "kda_chunk_data.hpp"

namespace kdacp::kda {
namespace {

// The forward's ForwardCache changes no bit of o, the final state or any
// gradient (every T around the chunk size, safe and exact sub-chunks, 1 and
// 3 threads), is read again after rewind(), reuses its buffers after clear(),
// and keeps nothing for the recurrent algorithm.
template <class T>
void check_forward_cache(const Data<T>& d, ThreadPool* pool) {
  const Shape& s = d.shape;
  const std::string what = "T=" + std::to_string(s.tokens) + " threads=" +
                           std::to_string(pool ? pool->threads() : 1) + (sizeof(T) == 4 ? " float" : " double");
  const Inputs<T> in = d.inputs();
  std::vector<T> o1(s.v_elems()), o2(s.v_elems()), f1(s.state_elems()), f2(s.state_elems());
  forward(in, d.h0.data(), o1.data(), f1.data(), on(Algorithm::chunk, pool));
  ForwardCache<T> cache;
  forward(in, d.h0.data(), o2.data(), f2.data(), on(Algorithm::chunk, pool), &cache);
  EXPECT_TRUE(same_bits(o1, o2)) << what << " o";
  EXPECT_TRUE(same_bits(f1, f2)) << what << " final state";
  ASSERT_EQ(cache.records(), 1u) << what;
  EXPECT_EQ(cache.bytes(), ForwardCache<T>::record_elems(s, Algorithm::chunk) * sizeof(T)) << what;
  const GradOut<T> want = run_backward(d, Algorithm::chunk, true, pool);
  EXPECT_TRUE(run_backward(d, Algorithm::chunk, true, pool, &cache) == want) << what << " gradients";
  // Read again; then a record written over a reused buffer.
  cache.rewind();
  EXPECT_TRUE(run_backward(d, Algorithm::chunk, true, pool, &cache) == want) << what << " after rewind";
  cache.clear();
  EXPECT_EQ(cache.records(), 0u);
  forward(in, d.h0.data(), o2.data(), nullptr, on(Algorithm::chunk, pool), &cache);
  EXPECT_TRUE(run_backward(d, Algorithm::chunk, true, pool, &cache) == want) << what << " reused buffer";
  // Nothing left to take: a clear error, not a stale record.
  EXPECT_THROW(run_backward(d, Algorithm::chunk, true, pool, &cache), InvalidArgument) << what;
}

TEST(KdaChunk, ForwardCacheChangesNoBit) {
  ThreadPool pool(3);
  for (std::size_t t : kTokens)
    for (double g_min : {0.0, -7.0}) {
      check_forward_cache(Data<double>(shape_with(t), 90 + unsigned(t), g_min), nullptr);
      check_forward_cache(Data<float>(shape_with(t), 91 + unsigned(t), g_min), &pool);
    }
}

TEST(KdaChunk, ForwardCacheMismatchAndRecurrent) {
  const Data<double> a(shape_with(kC + 1), 95, 0), b(shape_with(2 * kC), 96, 0);
  const Shape& s = a.shape;
  std::vector<double> o(s.v_elems());
  ForwardCache<double> cache;
  // The recurrent algorithm keeps nothing and takes nothing.
  forward(a.inputs(), a.h0.data(), o.data(), nullptr, on(Algorithm::recurrent), &cache);
  EXPECT_EQ(cache.records(), 0u);
  EXPECT_EQ(ForwardCache<double>::record_elems(s, Algorithm::recurrent), 0u);
  EXPECT_TRUE(run_backward(a, Algorithm::recurrent, true, nullptr, &cache) ==
              run_backward(a, Algorithm::recurrent, true));
  // A record of another shape is refused by name.
  std::vector<double> ob(b.shape.v_elems());
  forward(b.inputs(), b.h0.data(), ob.data(), nullptr, on(Algorithm::chunk), &cache);
  try {
    run_backward(a, Algorithm::chunk, true, nullptr, &cache);
    ADD_FAILURE() << "a record of another shape was accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("another shape"), std::string::npos) << e.what();
  }
  // Two calls (the pieces of a sequence forward): taken in order.
  cache.clear();
  forward(a.inputs(), a.h0.data(), o.data(), nullptr, on(Algorithm::chunk), &cache);
  forward(b.inputs(), b.h0.data(), ob.data(), nullptr, on(Algorithm::chunk), &cache);
  EXPECT_EQ(cache.records(), 2u);
  EXPECT_TRUE(run_backward(a, Algorithm::chunk, true, nullptr, &cache) == run_backward(a, Algorithm::chunk, true));
  EXPECT_TRUE(run_backward(b, Algorithm::chunk, true, nullptr, &cache) == run_backward(b, Algorithm::chunk, true));
  cache.release();
  EXPECT_EQ(cache.bytes(), 0u);
}

TEST(KdaChunk, ForwardCachePoolHandsOutOnlyCachesNobodyHolds) {
  const Data<double> a(shape_with(kC + 1), 97, 0);
  std::vector<double> o(a.shape.v_elems());
  ForwardCachePool<double> pool;
  std::shared_ptr<ForwardCache<double>> first = pool.acquire();
  forward(a.inputs(), a.h0.data(), o.data(), nullptr, on(Algorithm::chunk), first.get());
  const std::size_t one = pool.bytes();
  EXPECT_GT(one, 0u);
  // Held: a second forward gets a cache of its own.
  std::shared_ptr<ForwardCache<double>> second = pool.acquire();
  EXPECT_NE(second.get(), first.get());
  EXPECT_EQ(pool.caches(), 2u);
  // Let go: handed out again, cleared, its buffers kept.
  ForwardCache<double>* was = first.get();
  first.reset();
  std::shared_ptr<ForwardCache<double>> third = pool.acquire();
  EXPECT_EQ(third.get(), was);
  EXPECT_EQ(third->records(), 0u);
  EXPECT_EQ(pool.bytes(), one);
  forward(a.inputs(), a.h0.data(), o.data(), nullptr, on(Algorithm::chunk), third.get());
  EXPECT_EQ(pool.bytes(), one);
  EXPECT_EQ(pool.caches(), 2u);
}

// A record of 2 MiB or more starts on a huge page boundary, so that its
// first 2 MiB can be a transparent huge page too (a 4 KiB-aligned start left
// up to 511 small pages to fault in on the first forward).
TEST(KdaChunk, ForwardCacheLargeRecordStartsOnAHugePage) {
  ForwardCache<float> cache;
  const std::size_t large = (std::size_t{5} << 20) / sizeof(float) + 3;
  const float* big = cache.append(large);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(big) % (std::size_t{2} << 20), 0u);
  const float* small = cache.append(1000);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(small) % 64, 0u);
  EXPECT_EQ(cache.bytes(), (large + 1000) * sizeof(float));
  cache.release();
  EXPECT_EQ(cache.bytes(), 0u);
}

}  // namespace
}  // namespace kdacp::kda
