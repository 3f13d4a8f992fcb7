// The fold driver: runs a sequence of affine steps per (b,h) slab, in
// parallel over slabs. Each slab is folded by exactly one thread with the
// same step kernel, so results are independent of the thread count.
#include <algorithm>
#include <cstring>
#include <vector>

#include <fmt/format.h>

#include "kdacp/error.hpp"
#include "kdacp/kernels.hpp"
#include "kdacp/summary.hpp"
#include "kdacp/thread_pool.hpp"
#include "kernels/step.hpp"

namespace kdacp {

std::string to_string(Direction direction) {
  return direction == Direction::forward ? "forward" : "backward";
}

std::string to_string(KernelKind kind) {
  switch (kind) {
    case KernelKind::best: return "best";
    case KernelKind::scalar: return "scalar";
    case KernelKind::simd: return "simd";
  }
  return "unknown";
}

std::string simd_target_name() { return detail::simd_target(); }

namespace {

template <class T>
void copy_slab(const T* src, std::size_t lds, T* dst, std::size_t ldd, std::size_t rows,
               std::size_t cols) {
  for (std::size_t i = 0; i < rows; ++i) std::memcpy(dst + i * ldd, src + i * lds, cols * sizeof(T));
}

template <class T>
void zero_slab(T* dst, std::size_t ldd, std::size_t rows, std::size_t cols) {
  for (std::size_t i = 0; i < rows; ++i) std::memset(dst + i * ldd, 0, cols * sizeof(T));
}

void check_out(const StateView& out, const SummaryShape& shape, const std::string& field) {
  validate_view(out, field, 0);
  if (out.dtype != shape.dtype)
    throw InvalidArgument(fmt::format("{} dtype {} does not match the summaries' {}", field, to_string(out.dtype),
                                      to_string(shape.dtype)));
  if (out.batch != shape.batch || out.heads != shape.heads || out.rows != shape.key_dim ||
      out.cols != shape.value_dim) {
    throw InvalidArgument(fmt::format("{} shape [{},{},{},{}] does not match the summaries {}", field, out.batch,
                                      out.heads, out.rows, out.cols, to_string(shape)));
  }
}

template <class T>
void scan_impl(const Slots& slots, std::size_t first, std::size_t count, Direction direction,
               const StateView* incoming, const StateView& out, std::optional<std::size_t> prefix_steps,
               const StateView* prefix_out, const ExecPolicy& policy, FoldFlags flags,
               const SummaryShape& shape) {
  const bool fwd = direction == Direction::forward;
  const std::size_t k = shape.key_dim, v = shape.value_dim;
  const bool consume = (static_cast<unsigned>(flags) & static_cast<unsigned>(FoldFlags::consume_offsets)) != 0;
  const detail::StepFn<T> step = detail::step_kernel<T>(policy.kernel);
  const std::size_t slabs = shape.slabs();
  // Ping-pong partner of `out` per participant, only when the offsets may not
  // be overwritten: computed steps alternate so that the last lands in out.
  // Only a slab that computes two or more steps needs the partner: with one
  // step the result goes straight to out (so a p2p hop allocates nothing).
  const std::size_t computed_steps = incoming ? count : (count > 0 ? count - 1 : 0);
  const bool need_scratch = !consume && computed_steps >= 2;
  const std::size_t parts = participants(policy.pool, slabs);
  Buffer scratch(need_scratch ? parts * k * v * sizeof(T) : 0);

  parallel_ranges(policy.pool, slabs, [&](std::size_t begin, std::size_t end, std::size_t part) {
    T* tmp = need_scratch ? scratch.as<T>() + part * k * v : nullptr;
    for (std::size_t slab = begin; slab < end; ++slab) {
      const T* x = incoming ? incoming->slab<T>(slab) : nullptr;
      std::size_t ldx = incoming ? incoming->row_stride : 0;
      T* o = out.slab<T>(slab);
      T* pre = prefix_out ? prefix_out->slab<T>(slab) : nullptr;
      auto save_prefix = [&](std::size_t steps_done) {
        if (!prefix_steps || *prefix_steps != steps_done) return;
        if (x) copy_slab(x, ldx, pre, prefix_out->row_stride, k, v);
        else zero_slab(pre, prefix_out->row_stride, k, v);
      };
      save_prefix(0);
      const std::size_t computed = incoming ? count : (count > 0 ? count - 1 : 0);
      std::size_t done_computed = 0;
      for (std::size_t t = 0; t < count; ++t) {
        const std::size_t j = fwd ? first + t : first - t;
        const StateView so = slots.offsets.slot(j);
        const StateView sm = slots.transfers.slot(j);
        const T* sj = so.slab<T>(slab);
        if (x == nullptr) {
          // From the zero state the step yields the offset itself, exactly.
          x = sj;
          ldx = so.row_stride;
        } else {
          T* dst;
          std::size_t ldd;
          if (done_computed + 1 == computed) {
            dst = o, ldd = out.row_stride;
          } else if (consume) {
            dst = so.slab<T>(slab), ldd = so.row_stride;
          } else if ((computed - 1 - done_computed) % 2 == 0) {
            dst = o, ldd = out.row_stride;
          } else {
            dst = tmp, ldd = v;
          }
          step(sm.slab<T>(slab), sm.row_stride, x, ldx, sj, so.row_stride, dst, ldd, k, v, !fwd);
          ++done_computed;
          x = dst;
          ldx = ldd;
        }
        save_prefix(t + 1);
      }
      if (computed == 0) {
        // No arithmetic happened: out is the incoming state, a slot's offset or zero.
        if (x) copy_slab(x, ldx, o, out.row_stride, k, v);
        else zero_slab(o, out.row_stride, k, v);
      }
    }
  });
}

}  // namespace

void affine_step(const float* m, std::size_t ldm, const float* x, std::size_t ldx, const float* s,
                 std::size_t lds, float* c, std::size_t ldc, std::size_t k, std::size_t v,
                 Direction direction, KernelKind kernel) {
  detail::step_kernel<float>(kernel)(m, ldm, x, ldx, s, lds, c, ldc, k, v,
                                     direction == Direction::backward);
}

void scan(const Slots& slots, std::size_t first, std::size_t count, Direction direction,
          const StateView* incoming, const StateView& out, std::optional<std::size_t> prefix_steps,
          const StateView* prefix_out, const ExecPolicy& policy, FoldFlags flags) {
  const SummaryShape shape = validate_stack(slots.offsets, slots.transfers, 0);
  const std::size_t p = slots.offsets.ranks;
  const bool fwd = direction == Direction::forward;
  if (count > 0) {
    const bool in_range = first < p && (fwd ? first + count <= p : count <= first + 1);
    if (!in_range) {
      throw InvalidArgument(fmt::format("scan of {} slots from slot {} {} leaves the {} slots", count, first,
                                        to_string(direction), p));
    }
  }
  check_out(out, shape, "scan output");
  if (incoming != nullptr) check_out(*incoming, shape, "scan incoming state");
  if (prefix_steps) {
    if (*prefix_steps > count)
      throw InvalidArgument(
          fmt::format("scan prefix after {} steps, expected at most the {} steps scanned", *prefix_steps, count));
    if (prefix_out == nullptr) throw InvalidArgument("scan prefix requested without an output");
    check_out(*prefix_out, shape, "scan prefix output");
  }
  if (shape.dtype == DType::f64) {
    scan_impl<double>(slots, first, count, direction, incoming, out, prefix_steps, prefix_out, policy, flags, shape);
  } else {
    scan_impl<float>(slots, first, count, direction, incoming, out, prefix_steps, prefix_out, policy, flags, shape);
  }
}

void merge(const Slots& slots, std::size_t rank, Direction direction, const StateView& out,
           const ExecPolicy& policy, FoldFlags flags) {
  const std::size_t p = slots.offsets.ranks;
  if (rank >= p) {
    throw InvalidArgument(fmt::format("merge rank is {}, expected a position in [0, {})", rank, p));
  }
  if (direction == Direction::forward) {
    scan(slots, 0, rank, direction, nullptr, out, std::nullopt, nullptr, policy, flags);
  } else {
    scan(slots, p - 1, p - 1 - rank, direction, nullptr, out, std::nullopt, nullptr, policy, flags);
  }
}

}  // namespace kdacp
