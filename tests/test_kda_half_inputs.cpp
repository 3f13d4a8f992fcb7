// 16-bit inputs read in place (kda::Inputs::half): the chunk kernels widen
// each value as they load a chunk, so every result is bit for bit the float32
// call on the widened values (a widened copy), for kda::forward, backward,
// chunk_summary and incoming_grad, through the parts of a stream with
// cu_seqlens, and through the layer on one rank and on in-process ranks; the
// recurrent algorithm and the Ulysses layer, which read float32 rows, refuse
// them by name.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "kda_test_inputs.hpp"
#include "kdacp/error.hpp"
#include "kdacp/half.hpp"
#include "kdacp/inprocess.hpp"
#include "kdacp/kda.hpp"
#include "kdacp/layer.hpp"
#include "kdacp/thread_pool.hpp"

namespace kdacp::kda {
namespace {

// The five inputs as 16-bit bits (each field its own type, or float32 when
// `types[i]` is nullopt) and as their exact float32 widening.
struct HalfData {
  Shape shape;
  std::array<std::optional<Half>, 5> types;
  std::vector<std::uint16_t> bits[5];
  std::vector<float> wide[5];
  std::vector<float> d_o, d_final, incoming;

  HalfData(const Shape& s, std::array<std::optional<Half>, 5> t, std::uint64_t seed) : shape(s), types(t) {
    std::mt19937_64 rng(seed);
    const test::RandomInputs r = test::random_inputs(s, rng);
    const std::vector<double>* src[5] = {&r.q, &r.k, &r.v, &r.g, &r.beta};
    for (std::size_t i = 0; i < 5; ++i) {
      wide[i].resize(src[i]->size());
      for (std::size_t e = 0; e < wide[i].size(); ++e) wide[i][e] = static_cast<float>((*src[i])[e]);
      if (!types[i]) continue;
      bits[i].resize(wide[i].size());
      (void)narrow(*types[i], wide[i].data(), wide[i].size(), bits[i].data());
      widen(*types[i], bits[i].data(), bits[i].size(), wide[i].data());  // the values the call reads
    }
    for (const double x : test::uniform(s.v_elems(), -1, 1, rng)) d_o.push_back(static_cast<float>(x));
    for (const double x : test::uniform(s.state_elems(), -1, 1, rng)) d_final.push_back(static_cast<float>(x));
    for (const double x : test::uniform(s.state_elems(), -1, 1, rng)) incoming.push_back(static_cast<float>(x));
  }

  Inputs<float> widened() const {
    return {wide[0].data(), wide[1].data(), wide[2].data(), wide[3].data(), wide[4].data(), shape, 0.3f};
  }
  // The 16-bit fields in place, the float32 ones as they are.
  Inputs<float> in_place() const {
    Inputs<float> in = widened();
    const float** ptrs[5] = {&in.q, &in.k, &in.v, &in.g, &in.beta};
    HalfField* half[5] = {&in.half.q, &in.half.k, &in.half.v, &in.half.g, &in.half.beta};
    for (std::size_t i = 0; i < 5; ++i) {
      if (!types[i]) continue;
      *ptrs[i] = nullptr;
      *half[i] = HalfField{bits[i].data(), *types[i]};
    }
    return in;
  }
};

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// Every result of one call, by name.
struct Results {
  std::vector<std::pair<std::string, std::vector<float>>> all;
  void add(const std::string& name, std::vector<float> v) { all.emplace_back(name, std::move(v)); }
};

void expect_same(const Results& a, const Results& b, const std::string& label) {
  ASSERT_EQ(a.all.size(), b.all.size());
  for (std::size_t i = 0; i < a.all.size(); ++i)
    EXPECT_TRUE(same_bits(a.all[i].second, b.all[i].second)) << label << ": " << a.all[i].first;
}

Results run_calls(const HalfData& d, const Inputs<float>& in, ThreadPool* pool) {
  const Shape& s = d.shape;
  const Exec exec(ExecPolicy{pool, KernelKind::best}, Algorithm::chunk);
  Results r;
  std::vector<float> o(s.v_elems()), st(s.state_elems()), tr(s.transfer_elems()), gs(s.state_elems());
  ForwardCache<float> cache;
  forward(in, d.incoming.data(), o.data(), st.data(), exec, &cache);
  r.add("o", o);
  r.add("final state", st);
  chunk_summary(in, st.data(), tr.data(), exec);
  r.add("summary state", st);
  r.add("transfer", tr);
  incoming_grad(in, d.d_o.data(), gs.data(), exec);
  r.add("incoming_grad", gs);
  for (const bool kept : {false, true}) {
    std::vector<float> dq(s.qk_elems()), dk(s.qk_elems()), dv(s.v_elems()), dg(s.g_elems()), db(s.beta_elems()),
        di(s.state_elems());
    cache.rewind();
    backward(in, d.incoming.data(), d.d_o.data(), d.d_final.data(),
             Grads<float>{dq.data(), dk.data(), dv.data(), dg.data(), db.data(), di.data()}, exec,
             kDefaultCheckpointInterval, kept ? &cache : nullptr);
    const std::string tag = kept ? " (kept record)" : "";
    for (auto& [name, v] : {std::pair{"dq", &dq}, {"dk", &dk}, {"dv", &dv}, {"dg", &dg}, {"dbeta", &db},
                            {"d_incoming", &di}})
      r.add(name + tag, *v);
  }
  return r;
}

using Types = std::array<std::optional<Half>, 5>;
constexpr auto kBf = Half::bf16;
constexpr auto kF16 = Half::f16;

TEST(KdaHalfInputs, ChunkCallsGiveTheWidenedCallsBits) {
  ThreadPool pool(3);
  // T not a multiple of the chunk, grouped value heads, K and V off the lane width.
  const Shape s{2, 150, 2, 4, 24, 20};
  for (const Types& types : {Types{kBf, kBf, kBf, kBf, kBf}, Types{kF16, kF16, kF16, kF16, kF16},
                             Types{kBf, std::nullopt, kF16, kBf, std::nullopt}}) {
    const HalfData d(s, types, 11);
    for (ThreadPool* p : {static_cast<ThreadPool*>(nullptr), &pool})
      expect_same(run_calls(d, d.in_place(), p), run_calls(d, d.widened(), p),
                  types[0] == kF16 ? "float16" : types[1] ? "bfloat16" : "mixed");
  }
}

TEST(KdaHalfInputs, TheRecurrentAlgorithmRefusesThem) {
  const Shape s{1, 10, 1, 1, 8, 8};
  const HalfData d(s, Types{kBf, kBf, kBf, kBf, kBf}, 3);
  std::vector<float> o(s.v_elems());
  try {
    forward(d.in_place(), nullptr, o.data(), nullptr, Exec(ExecPolicy{}, Algorithm::recurrent));
    ADD_FAILURE() << "no error";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("16-bit inputs read in place need Algorithm::chunk"), std::string::npos)
        << e.what();
  }
}

// Forward + backward of `layer` on its rank's tokens of `d` (B = 1, the
// whole stream's tensors given; each rank runs its parts), results of this
// rank's tokens in stream positions.
Results run_layer(Layer<float>& layer, const HalfData& d, bool in_place) {
  const Shape& s = d.shape;
  const Shape ls = layer.local_shape();
  const auto parts = layer.layout().local_parts(layer.rank());
  const std::size_t inner[5] = {s.heads * s.key_dim, s.heads * s.key_dim, s.value_heads * s.value_dim,
                                s.value_heads * s.key_dim, s.value_heads};
  auto take = [&](const auto& full, std::size_t n) {
    std::remove_cvref_t<decltype(full)> local(ls.tokens * n);
    for (const Part& p : parts)
      std::copy_n(full.data() + p.begin * n, (p.end - p.begin) * n, local.data() + p.local_begin * n);
    return local;
  };
  std::vector<float> wide[5];
  std::vector<std::uint16_t> bits[5];
  for (std::size_t i = 0; i < 5; ++i) {
    wide[i] = take(d.wide[i], inner[i]);
    if (d.types[i]) bits[i] = take(d.bits[i], inner[i]);
  }
  Inputs<float> in{wide[0].data(), wide[1].data(), wide[2].data(), wide[3].data(), wide[4].data(), ls, 0.3f};
  if (in_place) {
    const float** ptrs[5] = {&in.q, &in.k, &in.v, &in.g, &in.beta};
    HalfField* half[5] = {&in.half.q, &in.half.k, &in.half.v, &in.half.g, &in.half.beta};
    for (std::size_t i = 0; i < 5; ++i)
      if (d.types[i]) *ptrs[i] = nullptr, *half[i] = HalfField{bits[i].data(), *d.types[i]};
  }
  const std::vector<float> d_o = take(d.d_o, inner[2]);
  std::vector<float> o(ls.tokens * inner[2]), dq(wide[0].size()), dk(wide[1].size()), dv(wide[2].size()),
      dg(wide[3].size()), db(wide[4].size());
  const Sequences& seqs = layer.sequences();
  std::vector<float> ht(seqs.count() * s.value_heads * s.key_dim * s.value_dim);
  auto saved = layer.forward(in, {}, o.data(), sequence_states(ht.data(), seqs, ls));
  layer.backward(in, *saved, {}, d_o.data(), {}, {dq.data(), dk.data(), dv.data(), dg.data(), db.data(), nullptr},
                 {});
  Results r;
  for (auto& [name, v] : {std::pair{"o", &o}, {"dq", &dq}, {"dk", &dk}, {"dv", &dv}, {"dg", &dg}, {"dbeta", &db},
                          {"ht", &ht}})
    r.add(name, *v);
  return r;
}

LayerConfig half_config(const Shape& s, const HalfData& d) {
  LayerConfig c;
  c.shape = s;
  c.cu_seqlens = {0, 37, 38, 130, 200};
  c.algorithm = Algorithm::chunk;
  c.storage = d.types;
  return c;
}

TEST(KdaHalfInputs, TheLayerGivesTheWidenedCallsBitsOnOneRankAndInContextParallel) {
  const Shape s{1, 200, 2, 4, 16, 16};
  const HalfData d(s, Types{kBf, kBf, kBf, kBf, kBf}, 7);
  {
    auto layer = make_layer<float>(nullptr, half_config(s, d));
    expect_same(run_layer(*layer, d, true), run_layer(*layer, d, false), "one rank");
  }
  for (const LayoutKind kind : {LayoutKind::contiguous, LayoutKind::zigzag}) {
    run_in_process(3, [&](const std::shared_ptr<Communicator>& comm) {
      LayerConfig c = half_config(s, d);
      c.layout = kind;
      auto layer = make_layer<float>(comm, c);
      expect_same(run_layer(*layer, d, true), run_layer(*layer, d, false),
                  std::string("3 ranks ") + layout_kind_name(kind));
    });
  }
}

TEST(KdaHalfInputs, TheUlyssesLayerRefusesThem) {
  const Shape s{1, 64, 2, 2, 8, 8};
  const HalfData d(s, Types{kBf, kBf, kBf, kBf, kBf}, 5);
  std::atomic<int> refused{0};
  run_in_process(2, [&](const std::shared_ptr<Communicator>& comm) {
    LayerConfig c = half_config(s, d);
    c.cu_seqlens.clear();
    c.ulysses = 2;
    auto layer = make_layer<float>(comm, c);
    ASSERT_EQ(layer->ulysses_width(), 2u);
    try {
      run_layer(*layer, d, true);
    } catch (const InvalidArgument& e) {
      if (std::string(e.what()).find("the Ulysses layer takes them widened") != std::string::npos) ++refused;
    }
  });
  EXPECT_EQ(refused.load(), 2);
}

}  // namespace
}  // namespace kdacp::kda
