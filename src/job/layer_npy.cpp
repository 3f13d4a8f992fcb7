#include "kdacp/job_npy.hpp"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <optional>
#include <span>
#include <sstream>
#include <type_traits>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/copy_bytes.hpp"
#include "kdacp/admission.hpp"
#include "kdacp/agreement.hpp"
#include "kdacp/error.hpp"
#include "kdacp/finite.hpp"
#include "kdacp/half.hpp"
#include "kdacp/kda_ulysses.hpp"
#include "kdacp/output.hpp"
#include "kdacp/protocol.hpp"

namespace kdacp::job {

namespace {

namespace fs = std::filesystem;

std::string dims_str(const std::vector<std::size_t>& d) { return fmt::format("({})", fmt::join(d, ",")); }

NpyArray load(const fs::path& dir, const char* name, std::size_t ndim) {
  const fs::path p = dir / name;
  if (!fs::exists(p)) throw IoError(p.string() + ": missing");
  NpyArray a = read_npy(p.string());
  if (a.shape.size() != ndim)
    throw IoError(fmt::format("{}: shape {} has {} dims, expected {}", p.string(), dims_str(a.shape), a.shape.size(),
                              ndim));
  return a;
}

template <class T>
std::vector<T> values(const NpyArray& a) {
  return detail::copy_bytes_as<T>(a.data.data(), a.elements());
}

// 0 = c_0 < c_1 < ... < c_N = T, for B = 1; IoError/InvalidArgument naming
// the file and the entry.
void check_cu_seqlens(const std::vector<std::int64_t>& c, const std::string& path, std::size_t batch,
                      std::size_t tokens) {
  if (batch != 1)
    throw InvalidArgument(fmt::format("{}: packed sequences need B = 1, the inputs have B = {}", path, batch));
  if (c.front() != 0) throw InvalidArgument(fmt::format("{}: entry 0 is {}, expected 0", path, c.front()));
  for (std::size_t i = 1; i < c.size(); ++i)
    if (c[i] <= c[i - 1])
      throw InvalidArgument(fmt::format("{}: entry {} is {}, expected > entry {} = {} (strictly increasing)", path,
                                        i, c[i], i - 1, c[i - 1]));
  if (c.back() != static_cast<std::int64_t>(tokens))
    throw InvalidArgument(fmt::format("{}: last entry {} is {}, expected T = {} (the tokens of q.npy)", path,
                                      c.size() - 1, c.back(), tokens));
}

}  // namespace

std::vector<std::int64_t> read_cu_seqlens_npy(const std::string& path) {
  require_regular_file(path);
  std::ifstream in(path, std::ios::binary);
  if (!in) throw IoError(path + ": cannot open for reading");
  std::vector<char> raw((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  // The .npy reader takes floats only. An integer array of the same item
  // size is the same header with another descr: read it as its float twin,
  // which checks magic, version, shape and size, and take the bytes back as
  // integers. Only the header's descr value is touched.
  std::size_t head_end = 0;  // the header's end: 10 + 2-byte length (1.0), 12 + 4-byte length (2.0, 3.0)
  if (raw.size() >= 12) {
    const auto byte = [&](std::size_t i) { return static_cast<std::size_t>(static_cast<unsigned char>(raw[i])); };
    head_end = byte(6) == 1 ? 10 + (byte(8) | byte(9) << 8)
                            : 12 + (byte(8) | byte(9) << 8 | byte(10) << 16 | byte(11) << 24);
  }
  const std::string head(raw.data(), std::min(raw.size(), head_end));
  const std::size_t key = head.find("'descr'");
  std::string descr;
  std::size_t at = std::string::npos;
  if (key != std::string::npos) {
    at = head.find('\'', head.find(':', key));
    const std::size_t end = at == std::string::npos ? at : head.find('\'', at + 1);
    if (end != std::string::npos) descr = head.substr(at + 1, end - at - 1);
  }
  bool wide = false;
  if (descr == "<i8" || descr == "=i8") wide = true;
  else if (descr != "<i4" && descr != "=i4") {
    if (descr.empty()) read_npy(path);  // not a .npy file: its own message
    throw IoError(path + ": dtype '" + descr + "', expected int32 ('<i4') or int64 ('<i8')");
  }
  raw[at + 2] = 'f';
  NpyArray a = parse_npy(std::as_bytes(std::span(raw.data(), raw.size())), path);
  if (a.shape.size() != 1)
    throw IoError(fmt::format("{}: shape {} has {} dims, expected 1", path, dims_str(a.shape), a.shape.size()));
  if (a.shape[0] < 2)
    throw IoError(fmt::format("{}: {} entries, expected at least 2 (0 and T)", path, a.shape[0]));
  std::vector<std::int64_t> out(a.shape[0]);
  for (std::size_t i = 0; i < out.size(); ++i) {
    if (wide) {
      std::memcpy(&out[i], a.data.data() + i * 8, 8);
    } else {
      std::int32_t v;
      std::memcpy(&v, a.data.data() + i * 4, 4);
      out[i] = v;
    }
  }
  return out;
}

Fingerprint layer_npy_fingerprint(const LayerNpy& in) {
  Fingerprint f;
  auto add = [&](const char* name, const NpyArray* a) {
    if (a == nullptr) {
      f.add_text(name, "absent");
      return;
    }
    // The file's item size: a float16 file differs from the float32 file of its widened values.
    const std::uint64_t dtype = a->half ? 2 : a->dtype == DType::f64 ? 8 : 4;
    std::uint64_t h = fnv1a64(std::as_bytes(std::span(&dtype, 1)));
    h = fnv1a64(std::as_bytes(std::span(a->shape)), h);
    f.add_hash(name, fnv1a64(a->data, h));
  };
  add("--inputs q.npy", &in.q);
  add("--inputs k.npy", &in.k);
  add("--inputs v.npy", &in.v);
  add("--inputs g.npy", &in.g);
  add("--inputs beta.npy", &in.beta);
  add("--inputs do.npy", in.d_o ? &*in.d_o : nullptr);
  add("--inputs h0.npy", in.h0 ? &*in.h0 : nullptr);
  add("--inputs dht.npy", in.dht ? &*in.dht : nullptr);
  f.add_bytes("--inputs cu_seqlens.npy", std::as_bytes(std::span(in.cu_seqlens)),
              in.cu_seqlens.empty() ? std::string("absent") : list_text(std::span<const std::int64_t>(in.cu_seqlens)));
  return f;
}

LayerNpy read_layer_npy(const std::string& dir_name) {
  const fs::path dir(dir_name);
  if (!fs::is_directory(dir)) throw IoError(dir_name + ": not a directory");
  LayerNpy in{load(dir, "q.npy", 4), load(dir, "k.npy", 4), load(dir, "v.npy", 4), load(dir, "g.npy", 4),
              load(dir, "beta.npy", 3), std::nullopt, std::nullopt, std::nullopt, {}, 0};
  if (fs::exists(dir / "do.npy")) in.d_o = load(dir, "do.npy", 4);
  if (fs::exists(dir / "h0.npy")) in.h0 = load(dir, "h0.npy", 4);
  if (fs::exists(dir / "dht.npy")) in.dht = load(dir, "dht.npy", 4);
  const NpyArray& q = in.q;
  const std::size_t b = q.shape[0], t = q.shape[1], h = q.shape[2], kd = q.shape[3];
  const std::size_t hv = in.v.shape[2], vd = in.v.shape[3];
  auto expect = [&](const char* name, const NpyArray& a, const std::vector<std::size_t>& want) {
    if (a.shape != want)
      throw IoError(fmt::format("{}: shape {}, expected {} from q.npy (B,T,H,K) and v.npy (B,T,HV,V)", name,
                                dims_str(a.shape), dims_str(want)));
    if (a.dtype != q.dtype || a.half != q.half)
      throw IoError(fmt::format("{}: dtype {}, expected {} like q.npy", name, a.file_dtype(), q.file_dtype()));
  };
  if (h == 0 || hv % h != 0)
    throw IoError(fmt::format("v.npy: HV = {} value heads (dimension 2), expected a multiple of q.npy's H = {} "
                              "heads (each query/key head serves HV/H value heads)",
                              hv, h));
  expect("k.npy", in.k, {b, t, h, kd});
  expect("v.npy", in.v, {b, t, hv, vd});
  expect("g.npy", in.g, {b, t, hv, kd});
  expect("beta.npy", in.beta, {b, t, hv});
  if (in.d_o) expect("do.npy", *in.d_o, {b, t, hv, vd});
  in.sequences = b;
  if (const fs::path cu = dir / "cu_seqlens.npy"; fs::exists(cu)) {
    in.cu_seqlens = read_cu_seqlens_npy(cu.string());
    check_cu_seqlens(in.cu_seqlens, cu.string(), b, t);
    in.sequences = in.cu_seqlens.size() - 1;
  }
  auto expect_states = [&](const char* name, const NpyArray& a) {
    if (a.shape != std::vector<std::size_t>{in.sequences, hv, kd, vd})
      throw IoError(fmt::format("{}: shape {}, expected {} (N,HV,K,V) with N = {} ({})", name, dims_str(a.shape),
                                dims_str({in.sequences, hv, kd, vd}), in.sequences,
                                in.cu_seqlens.empty() ? "B rows, no cu_seqlens.npy" : "sequences of cu_seqlens.npy"));
    if (q.half && (a.half || a.dtype != DType::f32))
      throw IoError(fmt::format("{}: dtype {}, expected float32: with {} inputs the states h0.npy and dht.npy stay "
                                "float32, as flash-linear-attention keeps them (ht.npy and dh0.npy are written in "
                                "float32 too)",
                                name, a.file_dtype(), q.file_dtype()));
    if (!q.half && a.dtype != q.dtype)
      throw IoError(fmt::format("{}: dtype {}, expected {} like q.npy", name, a.file_dtype(), q.file_dtype()));
  };
  if (in.h0) expect_states("h0.npy", *in.h0);
  if (in.dht) expect_states("dht.npy", *in.dht);
  for (const auto& [name, a] : {std::pair<const char*, const NpyArray*>{"q.npy", &in.q}, {"k.npy", &in.k}, {"v.npy", &in.v}})
    require_finite(*a, (dir / name).string());
  if (in.d_o) require_finite(*in.d_o, (dir / "do.npy").string());
  if (in.h0) require_finite(*in.h0, (dir / "h0.npy").string());
  if (in.dht) require_finite(*in.dht, (dir / "dht.npy").string());
  require_kda_gate(tensor_ref(in.g, (dir / "g.npy").string()));
  require_kda_beta(tensor_ref(in.beta, (dir / "beta.npy").string()));
  return in;
}

double layer_npy_bytes(const std::string& dir) {
  double bytes = 0;
  for (const char* name :
       {"q.npy", "k.npy", "v.npy", "g.npy", "beta.npy", "do.npy", "cu_seqlens.npy", "h0.npy", "dht.npy"}) {
    std::error_code ec;
    const auto size = fs::file_size(fs::path(dir) / name, ec);
    if (!ec) bytes += double(size);
  }
  return bytes;
}

void admit_layer_run(const kda::Shape& s, std::size_t sequences, const SummaryShape& summary,
                     const kda::Layout& layout, bool grads, double input_bytes, const std::string& method,
                     long long group_size, const ExchangeOptions& options, const std::string& max_memory,
                     bool one_rank_per_process, double cache_bytes, std::size_t ulysses) {
  const std::size_t ranks = layout.ranks();
  ulysses = resolve_ulysses(ulysses, method, s, layout, options, dtype_size(summary.dtype));
  check_ulysses(ulysses, ranks, s);
  // The exchange runs over the head groups' layout with HV/U heads (U = 1:
  // the layout itself); auto's choice is the layer's (options from
  // layer_exchange_options).
  kda::Shape slice = s;
  slice.heads /= ulysses;
  slice.value_heads /= ulysses;
  const kda::Layout group = kda::ulysses_group_layout(layout, ulysses);
  const ExchangeOptions go = kda::ulysses_exchange_options(options, layout, ulysses);
  const ProblemShape ps = layer_problem_shape(slice, dtype_size(summary.dtype), group, go.expected_cuts);
  const Prediction pred = predict_exchange(ps, method, group_size, go);
  const double exchange = exchange_rank_bytes(ps, pred);
  const double extra = ulysses_rank_bytes(s, sequences, layout, ulysses, grads, ps.elem_bytes);
  const double run = one_rank_per_process
                         ? layer_rank_bytes(s, sequences, layout, grads, ps.elem_bytes, exchange) + extra
                         : layer_run_bytes(s, sequences, ranks, grads, ps.elem_bytes, exchange, layout.parts().size(),
                                           layer_in_place(s, layout)) +
                               double(ranks) * extra;
  std::ostringstream what;
  what << "kdacp kda on " << ranks << " ranks";
  if (one_rank_per_process) what << " (one per process, this process's rank)";
  what << " with ";
  if (ulysses > 1) what << "Ulysses U=" << ulysses << " + ";
  what << protocol_label(pred.config);
  require_memory(input_bytes + run + cache_bytes, max_memory_bytes(max_memory), what.str(),
                 max_memory_name(max_memory));
}

template <class T>
void admit_layer_job(const LayerNpy& in, const LayerJob<T>& job, const LayerRunOptions& options, std::size_t ranks,
                     double input_bytes, const std::string& max_memory, bool one_rank_per_process) {
  const kda::Shape& s = job.data.shape;
  const kda::Layout layout = make_layer_layout(layer_config(job, options), ranks);
  SummaryShape summary = layer_summary_shape(s);
  summary.dtype = std::is_same_v<T, double> ? DType::f64 : DType::f32;
  std::size_t cache_tokens = s.tokens;
  if (one_rank_per_process) {
    cache_tokens = 0;
    for (std::size_t r = 0; r < layout.ranks(); ++r) cache_tokens = std::max(cache_tokens, layout.local_tokens(r));
  }
  // The job holds the inputs as T (take_layer_job: the files' arrays are
  // released as they are copied); a float16 file's copy is twice its bytes.
  double widened = 0;
  for (const NpyArray* a : {&in.q, &in.k, &in.v, &in.g, &in.beta, in.d_o ? &*in.d_o : nullptr})
    if (a != nullptr && a->half) widened += double(a->elements()) * double(sizeof(float) - sizeof(std::uint16_t));
  input_bytes += widened;
  const double cache = job.grads() ? layer_backward_records_bytes(s, job.algorithm, cache_tokens,
                                                                  in.sequences + layout.parts().size(), sizeof(T),
                                                                  job.keep_forward, options.threads_per_rank)
                                   : 0.0;
  admit_layer_run(s, in.sequences, summary, layout, job.grads(), input_bytes, options.method, options.group_size,
                  layer_exchange_options(options.exchange, s, summary.dtype, layout, job.sequences()), max_memory,
                  one_rank_per_process, cache, options.ulysses);
}

namespace {

// The job of `in`; a `in` that is not const gives up each array's bytes as
// soon as they are copied, so that no more than one array is held twice.
template <class T, class Npy>
LayerJob<T> make_layer_job(Npy& in, T scale) {
  auto take = [](auto& a) {
    std::vector<T> out = values<T>(a);
    if constexpr (!std::is_const_v<Npy>) std::vector<std::byte>().swap(a.data);
    return out;
  };
  LayerJob<T> job;
  kda::LayerData<T>& data = job.data;
  data.shape = kda::Shape{in.q.shape[0], in.q.shape[1], in.q.shape[2], in.v.shape[2], in.q.shape[3], in.v.shape[3]};
  kda::validate(data.shape);
  data.q = take(in.q);
  data.k = take(in.k);
  data.v = take(in.v);
  data.g = take(in.g);
  data.beta = take(in.beta);
  job.scale = scale;
  job.storage = in.q.half;
  job.cu_seqlens = in.cu_seqlens;
  if (in.h0) job.h0 = take(*in.h0);
  if (in.d_o) job.d_o = take(*in.d_o);
  if (in.dht) job.dht = take(*in.dht);
  job.final_states = true;
  return job;
}

}  // namespace

template <class T>
LayerJob<T> layer_job(const LayerNpy& in, T scale) {
  return make_layer_job<T>(in, scale);
}

template <class T>
LayerJob<T> take_layer_job(LayerNpy& in, T scale) {
  return make_layer_job<T>(in, scale);
}

namespace {

// The files of LayerOutputs as write_layer_outputs_npy writes them: name,
// data and shape, in kLayerOutputFiles order.
template <class T>
struct OutputArray {
  const char* name;
  const std::vector<T>* data;
  std::vector<std::size_t> shape;
  std::optional<Half> half = std::nullopt;  // written narrowed to this type
};

template <class T>
std::vector<OutputArray<T>> output_arrays(const LayerNpy& in, const LayerOutputs<T>& out) {
  const std::vector<std::size_t> states{in.sequences, in.v.shape[2], in.q.shape[3], in.v.shape[3]};
  // o and the gradients of the inputs in the inputs' 16-bit type, if any;
  // the states ht and dh0 stay in the type computed in.
  const std::optional<Half> half = in.q.half;
  std::vector<OutputArray<T>> arrays{{"o.npy", &out.o, in.v.shape, half}, {"ht.npy", &out.ht, states}};
  if (!in.d_o) return arrays;
  for (OutputArray<T> a :
       {OutputArray<T>{"dq.npy", &out.dq, in.q.shape, half}, OutputArray<T>{"dk.npy", &out.dk, in.k.shape, half},
        OutputArray<T>{"dv.npy", &out.dv, in.v.shape, half}, OutputArray<T>{"dg.npy", &out.dg, in.g.shape, half},
        OutputArray<T>{"dbeta.npy", &out.dbeta, in.beta.shape, half}, OutputArray<T>{"dh0.npy", &out.dh0, states}})
    arrays.push_back(std::move(a));
  return arrays;
}

// a's values narrowed to a.half (float16 inputs compute in float32): a
// finite value beyond the 16-bit type's range throws Error naming the file,
// the element and the value.
template <class T>
std::vector<std::uint16_t> narrowed(const OutputArray<T>& a) {
  if constexpr (!std::is_same_v<T, float>) {
    throw Error(fmt::format("{}: a 16-bit output needs a float32 run", a.name));
  } else {
    std::vector<std::uint16_t> bits(a.data->size());
    const auto over = narrow(*a.half, a.data->data(), bits.size(), bits.data());
    if (over)
      throw Error(fmt::format("the run produced a result {} cannot hold: {} element {} is {} (float32; {}'s largest "
                              "finite value is {})",
                              half_name(*a.half), a.name, index_string(*over, a.shape), exact_string((*a.data)[*over]),
                              half_name(*a.half),
                              exact_string(*a.half == Half::f16 ? f16_to_float(0x7BFF) : bf16_to_float(0x7F7F))));
    return bits;
  }
}

}  // namespace

template <class T>
void require_finite_outputs(const LayerNpy& in, const LayerOutputs<T>& out) {
  for (const OutputArray<T>& a : output_arrays(in, out)) {
    const auto bad = find_non_finite(std::span<const T>(*a.data));
    if (!bad) {
      if (a.half) (void)narrowed(a);
      continue;
    }
    throw Error(std::string("the run produced a non-finite result from finite inputs: ") + a.name + " element " +
                index_string(*bad, a.shape) + " is " + exact_string((*a.data)[*bad]) + " (" +
                (std::is_same_v<T, double> ? "float64" : "float32") + ")");
  }
}

template <class T>
void write_layer_outputs_npy(const std::string& dir_name, const LayerNpy& in, const LayerOutputs<T>& out) {
  fs::create_directories(dir_name);
  const fs::path dir(dir_name);
  for (const OutputArray<T>& a : output_arrays(in, out)) {
    if (a.half) write_npy_f16((dir / a.name).string(), narrowed(a).data(), a.shape);
    else write_npy((dir / a.name).string(), a.data->data(), a.shape);
  }
}

template void admit_layer_job<float>(const LayerNpy&, const LayerJob<float>&, const LayerRunOptions&, std::size_t,
                                     double, const std::string&, bool);
template void admit_layer_job<double>(const LayerNpy&, const LayerJob<double>&, const LayerRunOptions&, std::size_t,
                                      double, const std::string&, bool);
template LayerJob<float> layer_job<float>(const LayerNpy&, float);
template LayerJob<double> layer_job<double>(const LayerNpy&, double);
template LayerJob<float> take_layer_job<float>(LayerNpy&, float);
template LayerJob<double> take_layer_job<double>(LayerNpy&, double);
template void write_layer_outputs_npy<float>(const std::string&, const LayerNpy&, const LayerOutputs<float>&);
template void write_layer_outputs_npy<double>(const std::string&, const LayerNpy&, const LayerOutputs<double>&);
template <class T>
void save_layer_outputs(const std::string& dir, const LayerNpy& in, const LayerOutputs<T>& out) {
  try {
    require_finite_outputs(in, out);
  } catch (const Error& e) {
    throw Error(fmt::format("{}; nothing was written to {}", e.what(), dir));
  }
  StagedOutput staged(dir, kLayerOutputFiles);
  write_layer_outputs_npy(staged.staging_dir(), in, out);
  staged.commit();
}

template void save_layer_outputs<float>(const std::string&, const LayerNpy&, const LayerOutputs<float>&);
template void save_layer_outputs<double>(const std::string&, const LayerNpy&, const LayerOutputs<double>&);
template void require_finite_outputs<float>(const LayerNpy&, const LayerOutputs<float>&);
template void require_finite_outputs<double>(const LayerNpy&, const LayerOutputs<double>&);

}  // namespace kdacp::job
