// float16 .npy inputs of `kdacp kda` (issue 20 item 2): read widened to
// float32 once, run in float32, o and the gradients written narrowed to
// float16, the states float32. Checked against the float32 job on the same
// widened values, bit for bit.
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include <unistd.h>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "kdacp/agreement.hpp"
#include "kdacp/error.hpp"
#include "kdacp/half.hpp"
#include "kdacp/job.hpp"
#include "kdacp/job_npy.hpp"
#include "kdacp/npy.hpp"

namespace kdacp {
namespace {

namespace fs = std::filesystem;

using Shape = std::vector<std::size_t>;

std::size_t count(const Shape& s) {
  std::size_t n = 1;
  for (std::size_t d : s) n *= d;
  return n;
}

std::vector<char> file_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// A fresh directory under the test's temporary folder.
fs::path fresh_dir(const std::string& name) {
  const fs::path d = fs::temp_directory_path() /
                     fmt::format("kdacp_npy_f16_{}_{}_{}", ::getpid(),
                                 ::testing::UnitTest::GetInstance()->current_test_info()->name(), name);
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

// Removes the directories fresh_dir made for the running test.
void remove_dirs() {
  const std::string prefix = fmt::format("kdacp_npy_f16_{}_{}_", ::getpid(),
                                         ::testing::UnitTest::GetInstance()->current_test_info()->name());
  std::vector<fs::path> mine;
  for (const fs::directory_entry& e : fs::directory_iterator(fs::temp_directory_path()))
    if (e.path().filename().string().starts_with(prefix)) mine.push_back(e.path());
  for (const fs::path& p : mine) fs::remove_all(p);
}

// cu_seqlens.npy as int32: a float32 file of the same item size whose descr
// is changed to '<i4' and whose data are the integers' bytes.
void write_cu_seqlens(const fs::path& p, const std::vector<std::int32_t>& cu) {
  std::vector<float> raw(cu.size());
  std::memcpy(raw.data(), cu.data(), cu.size() * sizeof(std::int32_t));
  write_npy(p.string(), raw.data(), {cu.size()});
  std::vector<char> bytes = file_bytes(p);
  const std::string text(bytes.begin(), bytes.end());
  const std::size_t at = text.find("<f4");
  ASSERT_NE(at, std::string::npos);
  bytes[at + 1] = 'i';
  std::ofstream(p, std::ios::binary | std::ios::trunc).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// One input array: its float16 bits and their exact float32 values.
struct Input {
  Shape shape;
  std::vector<std::uint16_t> bits;
  std::vector<float> wide;
};

Input make_input(const Shape& shape, std::mt19937& rng, float lo, float hi) {
  std::uniform_real_distribution<float> u(lo, hi);
  Input in{shape, std::vector<std::uint16_t>(count(shape)), std::vector<float>(count(shape))};
  for (std::size_t i = 0; i < in.bits.size(); ++i) {
    in.bits[i] = float_to_f16(u(rng));
    in.wide[i] = f16_to_float(in.bits[i]);
  }
  return in;
}

// The same layer twice: `f16` with float16 files, `f32` with the float32
// files of their widened values; h0.npy and dht.npy float32 in both.
struct Dirs {
  fs::path f16, f32;
};

Dirs write_layer(const std::string& name, std::size_t b, std::size_t t, std::size_t h, std::size_t hv,
                 std::size_t kd, std::size_t vd, const std::vector<std::int32_t>& cu, bool grads, bool states) {
  std::mt19937 rng(20);
  const Dirs d{fresh_dir(name + "_f16"), fresh_dir(name + "_f32")};
  const std::size_t n = cu.empty() ? b : cu.size() - 1;
  const struct {
    const char* file;
    Shape shape;
    float lo, hi;
  } arrays[] = {{"q.npy", {b, t, h, kd}, -1, 1},         {"k.npy", {b, t, h, kd}, -0.3f, 0.3f},
                {"v.npy", {b, t, hv, vd}, -1, 1},        {"g.npy", {b, t, hv, kd}, -1, 0},
                {"beta.npy", {b, t, hv}, 0, 1},           {"do.npy", {b, t, hv, vd}, -1, 1}};
  for (const auto& a : arrays) {
    if (!grads && std::string(a.file) == "do.npy") continue;
    const Input in = make_input(a.shape, rng, a.lo, a.hi);
    write_npy_f16((d.f16 / a.file).string(), in.bits.data(), in.shape);
    write_npy((d.f32 / a.file).string(), in.wide.data(), in.shape);
  }
  if (states) {
    std::uniform_real_distribution<float> u(-0.5f, 0.5f);
    for (const char* file : {"h0.npy", "dht.npy"}) {
      std::vector<float> s(n * hv * kd * vd);
      for (float& x : s) x = u(rng);
      for (const fs::path& dir : {d.f16, d.f32}) write_npy((dir / file).string(), s.data(), {n, hv, kd, vd});
    }
  }
  if (!cu.empty())
    for (const fs::path& dir : {d.f16, d.f32}) write_cu_seqlens(dir / "cu_seqlens.npy", cu);
  return d;
}

// What `kdacp kda --inputs in --out out --ranks ranks` does, in-process.
void run_kda(const fs::path& in_dir, const fs::path& out_dir, std::size_t ranks, bool zigzag = false) {
  const job::LayerNpy in = job::read_layer_npy(in_dir.string());
  job::LayerJob<float> job = job::layer_job<float>(in, 0.25f);
  job::LayerRunOptions opts;
  if (zigzag) opts.layout = kda::Layout::zigzag(job.data.shape.tokens, ranks);
  const job::LayerOutputs<float> out = job::run_context_parallel(job, ranks, opts, 60);
  job::save_layer_outputs(out_dir.string(), in, out);
}

TEST(NpyF16, ReadWidensOnceAndRemembersTheFileType) {
  const fs::path dir = fresh_dir("read");
  // Zero, a subnormal, the smallest normal, one, float16's largest, a
  // negative value, -0 and Inf: every one widens exactly.
  const std::vector<std::uint16_t> bits{0x0000, 0x0001, 0x0400, 0x3C00, 0x7BFF, 0xC123, 0x8000, 0x7C00};
  write_npy_f16((dir / "a.npy").string(), bits.data(), {2, 4});
  const NpyArray a = read_npy((dir / "a.npy").string());
  EXPECT_EQ(a.half, Half::f16);
  EXPECT_EQ(a.dtype, DType::f32);
  EXPECT_EQ(a.file_dtype(), "float16");
  EXPECT_EQ(a.shape, (Shape{2, 4}));
  ASSERT_EQ(a.data.size(), bits.size() * sizeof(float));
  const std::vector<float> values = a.to_f32(false);
  for (std::size_t i = 0; i < bits.size(); ++i) {
    const float want = f16_to_float(bits[i]);
    EXPECT_EQ(std::memcmp(&values[i], &want, sizeof(float)), 0) << "element " << i;
  }
  EXPECT_FLOAT_EQ(values[4], 65504.0f);
  // The header NumPy would write for float16, and a truncated file.
  const std::vector<char> raw = file_bytes(dir / "a.npy");
  EXPECT_NE(std::string(raw.begin(), raw.end()).find("'descr': '<f2'"), std::string::npos);
  std::ofstream(dir / "short.npy", std::ios::binary).write(raw.data(), static_cast<std::streamsize>(raw.size() - 1));
  try {
    (void)read_npy((dir / "short.npy").string());
    FAIL() << "a truncated float16 file was read";
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find("needs 16 bytes, the file holds 15"), std::string::npos) << e.what();
  }
  // A float32 file is still plain float32.
  const std::vector<float> f{1.5f, -2};
  write_npy((dir / "f.npy").string(), f.data(), {2});
  const NpyArray fa = read_npy((dir / "f.npy").string());
  EXPECT_FALSE(fa.half);
  EXPECT_EQ(fa.file_dtype(), "float32");
  remove_dirs();
}

// The fingerprint ranks compare tells a float16 file from the float32 file
// of its widened values (the same bytes in memory).
TEST(NpyF16, FingerprintTellsFloat16FromFloat32) {
  const Dirs d = write_layer("fingerprint", 1, 5, 1, 1, 4, 4, {}, false, false);
  const job::LayerNpy a = job::read_layer_npy(d.f16.string());
  const job::LayerNpy b = job::read_layer_npy(d.f32.string());
  EXPECT_EQ(a.q.data, b.q.data);
  const auto hashes = [](const job::LayerNpy& in) {
    std::vector<std::uint64_t> h;
    const Fingerprint fp = job::layer_npy_fingerprint(in);
    for (const Fingerprint::Field& f : fp.fields()) h.push_back(f.hash);
    return h;
  };
  const std::vector<std::uint64_t> ha = hashes(a), hb = hashes(b);
  ASSERT_EQ(ha.size(), hb.size());
  for (std::size_t i = 0; i < 5; ++i) EXPECT_NE(ha[i], hb[i]) << "field " << i << " (q, k, v, g, beta)";
  EXPECT_EQ(ha, hashes(job::read_layer_npy(d.f16.string())));
  remove_dirs();
}

// float16 inputs give exactly narrow(the float32 run on the widened values)
// for o and the gradients, and the float32 run's ht and dh0, on one rank
// and on three (zigzag), with packed sequences and both states.
TEST(NpyF16, OutputsAreTheNarrowedFloat32Run) {
  for (const bool grads : {false, true}) {
    const Dirs d = write_layer(grads ? "grads" : "forward", 1, 37, 2, 4, 16, 16, {0, 5, 6, 30, 37}, grads, true);
    for (const std::size_t ranks : {std::size_t{1}, std::size_t{3}}) {
      const std::string what = fmt::format("{}, P = {}: ", grads ? "with do.npy" : "forward", ranks);
      const fs::path out16 = fresh_dir("out16"), out32 = fresh_dir("out32"), expect = fresh_dir("expect");
      run_kda(d.f16, out16, ranks, ranks > 1);
      run_kda(d.f32, out32, ranks, ranks > 1);
      std::vector<std::string> files{"o.npy", "ht.npy"};
      if (grads) files = {"o.npy", "ht.npy", "dq.npy", "dk.npy", "dv.npy", "dg.npy", "dbeta.npy", "dh0.npy"};
      for (const std::string& file : files) {
        ASSERT_TRUE(fs::exists(out16 / file)) << what << file;
        const NpyArray r32 = read_npy((out32 / file).string());
        const NpyArray r16 = read_npy((out16 / file).string());
        if (file == "ht.npy" || file == "dh0.npy") {
          EXPECT_FALSE(r16.half) << what << file << " is a state: float32";
          EXPECT_EQ(file_bytes(out16 / file), file_bytes(out32 / file)) << what << file;
          continue;
        }
        EXPECT_EQ(r16.half, Half::f16) << what << file;
        const std::vector<float> wide = r32.to_f32(false);
        std::vector<std::uint16_t> bits(wide.size());
        EXPECT_FALSE(narrow(Half::f16, wide.data(), wide.size(), bits.data())) << what << file;
        write_npy_f16((expect / file).string(), bits.data(), r32.shape);
        EXPECT_EQ(file_bytes(out16 / file), file_bytes(expect / file)) << what << file << " differs";
        // Not vacuous: narrowing changed some of the float32 values.
        EXPECT_NE(r16.data, r32.data) << what << file;
      }
      if (!grads) {
        EXPECT_FALSE(fs::exists(out16 / "dq.npy")) << what;
      }
    }
  }
  remove_dirs();
}

// A finite float32 result beyond float16's range is an error naming the
// file, the element and the value, and nothing is written: an earlier run's
// outputs stay as they were.
TEST(NpyF16, OverflowIsNamedAndNothingIsWritten) {
  const fs::path dir = fresh_dir("overflow"), out = fresh_dir("overflow_out");
  const std::size_t t = 2, kd = 16, vd = 16;
  // k = q = e_0, beta = 1, g = 0: the state after token t holds v_t in row
  // 0, so o_t = scale · v_t; with scale 4 a float16 v of 30000 gives 120000.
  std::vector<std::uint16_t> q(t * kd, float_to_f16(0)), v(t * vd, float_to_f16(1)), g(t * kd, float_to_f16(0)),
      beta(t, float_to_f16(1));
  for (std::size_t i = 0; i < t; ++i) q[i * kd] = float_to_f16(1);
  v[1 * vd + 2] = float_to_f16(30000);  // token 1, value 2: o = 4 · 30000 = 120000 > 65504
  write_npy_f16((dir / "q.npy").string(), q.data(), {1, t, 1, kd});
  write_npy_f16((dir / "k.npy").string(), q.data(), {1, t, 1, kd});
  write_npy_f16((dir / "v.npy").string(), v.data(), {1, t, 1, vd});
  write_npy_f16((dir / "g.npy").string(), g.data(), {1, t, 1, kd});
  write_npy_f16((dir / "beta.npy").string(), beta.data(), {1, t, 1});
  const std::vector<float> old{7};
  write_npy((out / "o.npy").string(), old.data(), {1});
  const std::vector<char> before = file_bytes(out / "o.npy");

  const job::LayerNpy in = job::read_layer_npy(dir.string());
  const job::LayerJob<float> job = job::layer_job<float>(in, 4.0f);
  const job::LayerOutputs<float> res = job::run_context_parallel(job, 2, job::LayerRunOptions{}, 60);
  ASSERT_EQ(res.o[1 * vd + 2], 120000.0f);  // finite in float32
  try {
    job::save_layer_outputs(out.string(), in, res);
    FAIL() << "o = 120000 was written as float16";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("float16 cannot hold: o.npy element [0,1,0,2] is 120000 (float32; float16's largest finite "
                       "value is 65504)"),
              std::string::npos)
        << msg;
    EXPECT_NE(msg.find("nothing was written to " + out.string()), std::string::npos) << msg;
  }
  EXPECT_EQ(file_bytes(out / "o.npy"), before);
  EXPECT_FALSE(fs::exists(out / "ht.npy"));
  // o = 65504 exactly, float16's largest value, is written.
  v[1 * vd + 2] = float_to_f16(65504.0f / 4);
  write_npy_f16((dir / "v.npy").string(), v.data(), {1, t, 1, vd});
  const job::LayerNpy in2 = job::read_layer_npy(dir.string());
  job::save_layer_outputs(out.string(), in2,
                          job::run_context_parallel(job::layer_job<float>(in2, 4.0f), 2, job::LayerRunOptions{}, 60));
  EXPECT_EQ(read_npy((out / "o.npy").string()).to_f32(false)[1 * vd + 2], 65504.0f);
  remove_dirs();
}

// Every input but the states in one dtype; the states float32 with float16
// inputs; the domain checks on the widened values, naming the file.
TEST(NpyF16, DtypesAndDomainsAreChecked) {
  const auto expect_error = [](const fs::path& dir, const std::string& want) {
    try {
      (void)job::read_layer_npy(dir.string());
      ADD_FAILURE() << dir << " accepted, expected " << want;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
    }
  };
  const Dirs d = write_layer("dtypes", 2, 4, 1, 1, 16, 16, {}, true, true);
  EXPECT_NO_THROW((void)job::read_layer_npy(d.f16.string()));  // float32 states with float16 inputs

  const fs::path mixed = fresh_dir("mixed");
  fs::copy(d.f16, mixed, fs::copy_options::recursive | fs::copy_options::overwrite_existing);
  fs::copy_file(d.f32 / "k.npy", mixed / "k.npy", fs::copy_options::overwrite_existing);
  expect_error(mixed, "k.npy: dtype float32, expected float16 like q.npy");
  fs::copy(d.f32, mixed, fs::copy_options::recursive | fs::copy_options::overwrite_existing);
  fs::copy_file(d.f16 / "do.npy", mixed / "do.npy", fs::copy_options::overwrite_existing);
  expect_error(mixed, "do.npy: dtype float16, expected float32 like q.npy");

  const fs::path state = fresh_dir("state");
  fs::copy(d.f16, state, fs::copy_options::recursive | fs::copy_options::overwrite_existing);
  const NpyArray h0 = read_npy((d.f16 / "h0.npy").string());
  std::vector<float> h0v = h0.to_f32(false);
  std::vector<std::uint16_t> h0b(h0v.size());
  narrow(Half::f16, h0v.data(), h0v.size(), h0b.data());
  write_npy_f16((state / "dht.npy").string(), h0b.data(), h0.shape);
  expect_error(state, "dht.npy: dtype float16, expected float32: with float16 inputs the states");
  std::vector<double> h0d(h0v.begin(), h0v.end());
  write_npy((state / "dht.npy").string(), h0d.data(), h0.shape);
  expect_error(state, "dht.npy: dtype float64, expected float32: with float16 inputs the states");

  // Domains, on the widened values: g > 0, beta > 1, NaN and Inf.
  const struct {
    const char* file;
    std::uint16_t value;
    const char* want;
  } cases[] = {{"g.npy", 0x0001, "g.npy: element [0,0,0,0] is 5.9604645e-08, expected g <= 0"},
               {"beta.npy", 0x3C01, "beta.npy: element [0,0,0] is 1.0009766, expected beta in [0, 1]"},
               {"q.npy", 0x7E00, "q.npy: element [0,0,0,0] is nan"},
               {"v.npy", 0xFC00, "v.npy: element [0,0,0,0] is -inf"}};
  for (const auto& c : cases) {
    const fs::path bad = fresh_dir(std::string("domain_") + c.file);
    fs::copy(d.f16, bad, fs::copy_options::recursive | fs::copy_options::overwrite_existing);
    NpyArray a = read_npy((d.f16 / c.file).string());
    std::vector<float> w = a.to_f32(false);
    std::vector<std::uint16_t> b(w.size());
    narrow(Half::f16, w.data(), w.size(), b.data());
    b[0] = c.value;
    write_npy_f16((bad / c.file).string(), b.data(), a.shape);
    expect_error(bad, c.want);
  }
  remove_dirs();
}

}  // namespace
}  // namespace kdacp
