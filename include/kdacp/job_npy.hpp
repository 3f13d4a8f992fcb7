// The KDA layer's inputs and outputs as .npy files in flash-linear-attention's
// layout (SPEC §9), for comparison with other implementations (`kdacp kda`).
// The job module of the core library (src/job/).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "kdacp/kda_cp.hpp"
#include "kdacp/npy.hpp"
#include "kdacp/job.hpp"

namespace kdacp::job {

// q.npy, k.npy [B,T,H,K], v.npy [B,T,HV,V], g.npy [B,T,HV,K], beta.npy
// [B,T,HV] and optional do.npy [B,T,HV,V], all float16, all float32 or all
// float64; optional cu_seqlens.npy (int32 or int64, 1-D, B = 1) and the
// states h0.npy and dht.npy [N,HV,K,V] in q's dtype (N: sequences, B without
// cu_seqlens), float32 with float16 inputs (flash-linear-attention's
// training convention: 16-bit activations, float32 states). float16 arrays
// hold their float32 widening (NpyArray::half): the job runs in float32.
struct LayerNpy {
  NpyArray q, k, v, g, beta;
  std::optional<NpyArray> d_o, h0, dht;
  std::vector<std::int64_t> cu_seqlens;  // empty without cu_seqlens.npy
  std::size_t sequences = 0;             // N
};

// Reads and checks the files of `dir`: a missing file, a wrong rank, a shape
// that disagrees with q.npy and v.npy (h0/dht: with N, HV, K, V) or a dtype
// unlike q.npy's (h0/dht with float16 inputs: not float32) throws IoError
// naming the file. Values outside the layer's domain (the widened values of
// float16 files) throw InvalidArgument naming the file, the element and the domain:
// NaN or ±Inf anywhere, g > 0 (g is the log of a decay in (0, 1]), beta
// outside [0, 1], cu_seqlens not 0 = c_0 < c_1 < ... < c_N = T or given with
// B > 1.
LayerNpy read_layer_npy(const std::string& dir);

// What a process read, for ranks that each read the whole job (`kdacp kda`
// under a launcher) to compare before the layer's first message
// (LayerRunOptions::agree): one field per file, named "--inputs q.npy" etc.,
// an FNV-1a hash of its file dtype, shape and bytes ("absent" for an optional
// file not given), and cu_seqlens.npy's values.
Fingerprint layer_npy_fingerprint(const LayerNpy& in);

// cu_seqlens.npy at `path`: int32 or int64 ('<i4' / '<i8'), 1-D, at least
// two entries, as int64; anything else throws IoError naming the file. The
// values are not checked here (read_layer_npy does).
std::vector<std::int64_t> read_cu_seqlens_npy(const std::string& path);

// Bytes of the files read_layer_npy(dir) would read.
double layer_npy_bytes(const std::string& dir);

// Admission of `kdacp kda`: throws OutOfMemory before any work when the
// layer of `s` with N = `sequences` on the ranks of `layout` (layer_run_bytes,
// gradients too when `grads`), with the exchange make_state_exchange(mesh,
// method, group_size, options) builds for `summary`, the layout's part
// owners and options.expected_cuts (auto's choice is the one the layer
// makes from layer_exchange_options),
// beside inputs of input_bytes already read (counted once: take_layer_job
// holds them once, as T) exceeds the limit text max_memory (max_memory_bytes
// in kdacp/admission.hpp). With one_rank_per_process (under a launcher) the
// run counted is this process's rank's share (layer_rank_bytes), not all P
// ranks'. The message names the ranks and the protocol (auto: its choice).
// cache_bytes: the forward caches the run holds (layer_cache_bytes), added.
// ulysses > 1 (kUlyssesAuto: resolve_ulysses' choice): the Ulysses layer of
// that width (check_ulysses first): its
// exchange priced over the head groups' layout with HV/U heads, and
// ulysses_rank_bytes per rank added.
void admit_layer_run(const kda::Shape& s, std::size_t sequences, const SummaryShape& summary,
                     const kda::Layout& layout, bool grads, double input_bytes, const std::string& method,
                     long long group_size, const ExchangeOptions& options, const std::string& max_memory,
                     bool one_rank_per_process = false, double cache_bytes = 0, std::size_t ulysses = 1);

// admit_layer_run for `job`, read from `in` (input_bytes), on
// options.layout (nullopt: contiguous over `ranks`) with options' method,
// group size and exchange, for a summary of T; job.keep_forward adds the
// forward caches (layer_cache_bytes): the whole stream's in-process, the
// largest rank's with one_rank_per_process; a chunk backward without them
// (--recompute) the records it recomputes instead on threads_per_rank
// threads (layer_backward_records_bytes).
template <class T>
void admit_layer_job(const LayerNpy& in, const LayerJob<T>& job, const LayerRunOptions& options, std::size_t ranks,
                     double input_bytes, const std::string& max_memory, bool one_rank_per_process);

// The arrays as a layer job of T (T must be the files' dtype) with `scale`,
// asking for the final states; the shape is checked with kda::validate.
template <class T>
LayerJob<T> layer_job(const LayerNpy& in, T scale);

// The same, taking the data: each array's bytes are released as soon as
// they are copied, so that the inputs are held once (beside at most one
// array's copy), not twice. `in` keeps its shapes, dtypes, cu_seqlens and
// N (what admit_layer_job and save_layer_outputs read) with empty data:
// take its layer_npy_fingerprint before.
template <class T>
LayerJob<T> take_layer_job(LayerNpy& in, T scale);

// o.npy and ht.npy [N,HV,K,V] and, when `in` has do.npy,
// dq/dk/dv/dg/dbeta.npy and dh0.npy into `dir` (created if needed), in the
// shapes and dtype of the inputs; with float16 inputs o and dq..dbeta are
// narrowed to float16 (round to nearest even) and ht, dh0 stay float32.
inline const std::vector<std::string> kLayerOutputFiles{"o.npy",  "ht.npy", "dq.npy",    "dk.npy",
                                                        "dv.npy", "dg.npy", "dbeta.npy", "dh0.npy"};
template <class T>
void write_layer_outputs_npy(const std::string& dir, const LayerNpy& in, const LayerOutputs<T>& out);

// Checks every array write_layer_outputs_npy would write, in
// kLayerOutputFiles order, before anything is written: the first NaN or ±Inf
// throws Error naming the file (e.g. "dq.npy"), the element's index in the
// file's shape and its value ("inf", "nan", "-inf"); so does the first finite
// value of a float16 output beyond float16's range (|x| >= 65520 rounds to
// Inf), with its float32 value.
template <class T>
void require_finite_outputs(const LayerNpy& in, const LayerOutputs<T>& out);

// `kdacp kda`'s outputs into `dir`: a NaN or Inf from finite inputs is a
// failure, not a result (nor is a float16 output that overflows), so
// require_finite_outputs runs first (its Error
// adds "; nothing was written to <dir>"); then write_layer_outputs_npy into a
// StagedOutput of kLayerOutputFiles, committed once every file is written.
template <class T>
void save_layer_outputs(const std::string& dir, const LayerNpy& in, const LayerOutputs<T>& out);

}  // namespace kdacp::job
