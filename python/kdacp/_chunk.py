"""flash-linear-attention's chunk_kda on kdacp: the in-kernel transforms
(gate, l2norm, sigmoid) as autograd Functions around the C++ passes, then the
kda layer, with or without a CP context."""

import math
import numbers

import torch

from kdacp import _kdacp
from kdacp._autograd import cu_list, first_order
from kdacp._common import (_DEFAULTS, _DTYPES, _check_tensor, _compute_dtype, _from_numpy,
                           _require_finite_result)
from kdacp._context import CpContext
from kdacp._layer import _neg_eigval_signature, kda


def _guard_second_order(grads, anchors):
    """The transforms' C++ backward has no derivative of its own: under
    create_graph=True their gradients raise on a second backward (as kda's)."""
    return tuple(first_order("chunk_kda", grads, anchors))


def _name(t, compute):
    """(storage dtype name of t, or compute's for an absent t)."""
    return _DTYPES[compute] if t is None else _DTYPES[t.dtype]


def _ptr(t):
    return 0 if t is None else t.data_ptr()


# Each transform reads its input in the input's dtype and computes in
# `compute` (float64 for float64 calls, else float32: 16-bit inputs are
# widened in C++); its result feeds the kda layer, so it is stored in
# `compute`; the gradient of each input comes back in that input's dtype.

class _GateFunction(torch.autograd.Function):
    """g = -exp(A_log)·softplus(g_raw + dt_bias), or lower_bound·sigmoid(
    exp(A_log)·(g_raw + dt_bias)) (kdacp/kda.hpp gate_forward), one C++ pass;
    its backward gives g_raw's, A_log's and dt_bias's gradients."""

    @staticmethod
    def forward(ctx, lower_bound, compute, raw, a_log, dt_bias):
        b, t, hv, kd = raw.shape
        ctx.args = (b * t, hv, kd, lower_bound, _DTYPES[compute])
        ctx.dtypes = [_name(x, compute) for x in (raw, a_log, dt_bias)]
        ctx.save_for_backward(raw, a_log, dt_bias)
        (out,) = _kdacp.kda_gate(raw.data_ptr(), ctx.dtypes[0], _ptr(a_log), ctx.dtypes[1],
                                 _ptr(dt_bias), ctx.dtypes[2], b * t, hv, kd, lower_bound,
                                 _DTYPES[compute])
        return _from_numpy(out).view(b, t, hv, kd)

    @staticmethod
    def backward(ctx, d_g):
        raw, a_log, dt_bias = ctx.saved_tensors
        tokens, hv, kd, lower_bound, compute = ctx.args
        d_g = d_g.contiguous()
        with torch.no_grad():
            d_raw, d_a, d_b = _kdacp.kda_gate(
                raw.data_ptr(), ctx.dtypes[0], _ptr(a_log), ctx.dtypes[1], _ptr(dt_bias),
                ctx.dtypes[2], tokens, hv, kd, lower_bound, compute, d_g.data_ptr())
        grads = (_from_numpy(d_raw, raw.dtype).view(raw.shape),
                 None if d_a is None else _from_numpy(d_a, a_log.dtype).view(a_log.shape),
                 None if d_b is None else _from_numpy(d_b, dt_bias.dtype).view(dt_bias.shape))
        for x, name in zip(grads, ("g", "A_log", "dt_bias")):
            _require_finite_result(x, f"the gradient of {name}", "gate backward")
        return (None, None) + _guard_second_order(grads, (raw, a_log, dt_bias))


class _L2NormFunction(torch.autograd.Function):
    """x / sqrt(Σ_K x² + 1e-6) per (token, head) (kdacp/kda.hpp l2norm_forward)."""

    @staticmethod
    def forward(ctx, compute, x):
        rows, dim = x.numel() // x.shape[-1], x.shape[-1]
        y, rstd = _kdacp.kda_l2norm(x.data_ptr(), _DTYPES[x.dtype], rows, dim, _DTYPES[compute])
        y, rstd = _from_numpy(y), _from_numpy(rstd)
        ctx.save_for_backward(x, y, rstd)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, d_y):
        x, y, rstd = ctx.saved_tensors
        d_y = d_y.to(y.dtype).contiguous()
        with torch.no_grad():
            dx = _from_numpy(_kdacp.kda_l2norm_backward(
                y.data_ptr(), rstd.data_ptr(), d_y.data_ptr(), y.shape[0], y.shape[1],
                _DTYPES[y.dtype], _DTYPES[x.dtype]), x.dtype)
        _require_finite_result(dx, "the gradient of q or k", "l2norm backward")
        return (None,) + _guard_second_order((dx.view(x.shape),), (x,))


class _SigmoidFunction(torch.autograd.Function):
    """beta = sigmoid(beta_raw), or 2·sigmoid(beta_raw) with allow_neg_eigval
    (kdacp/kda.hpp sigmoid_forward)."""

    @staticmethod
    def forward(ctx, compute, x, allow_neg_eigval=False):
        ctx.save_for_backward(x)
        ctx.compute = _DTYPES[compute]
        ctx.allow_neg_eigval = allow_neg_eigval
        return _from_numpy(_kdacp.kda_sigmoid(x.data_ptr(), _DTYPES[x.dtype], x.numel(),
                                              ctx.compute, 0, allow_neg_eigval)).view(x.shape)

    @staticmethod
    def backward(ctx, d_y):
        (x,) = ctx.saved_tensors
        d_y = d_y.to(torch.float64 if ctx.compute == "float64" else torch.float32).contiguous()
        with torch.no_grad():
            dx = _from_numpy(_kdacp.kda_sigmoid(x.data_ptr(), _DTYPES[x.dtype], x.numel(),
                                                ctx.compute, d_y.data_ptr(),
                                                ctx.allow_neg_eigval), x.dtype)
        _require_finite_result(dx, "the gradient of beta", "sigmoid backward")
        return (None,) + _guard_second_order((dx.view(x.shape),), (x,)) + (None,)


def _transform_input(t, name, compute):
    """A CPU float tensor the transforms can read, contiguous: t itself when
    its dtype computes in `compute` (float64: float64; float32: float32,
    bfloat16 or float16), else converted to `compute` (an autograd op:
    gradients reach the original)."""
    _check_tensor(t, name)
    if compute == torch.float32 and t.dtype != torch.float64:
        return t.contiguous()
    return t.to(compute).contiguous()


def _lower_bound(lower_bound):
    if lower_bound is None:
        return None
    if isinstance(lower_bound, torch.Tensor) and lower_bound.numel() == 1:
        lower_bound = lower_bound.item()
    if isinstance(lower_bound, bool) or not isinstance(lower_bound, numbers.Real) or \
            not (math.isfinite(float(lower_bound)) and float(lower_bound) < 0):
        raise ValueError(f"lower_bound={lower_bound!r}, expected a finite number < 0 (the gate "
                         "then lies in [lower_bound, 0])")
    return float(lower_bound)


# flash-linear-attention's chunk_kda arguments kdacp does not implement: any
# value but the default raises NotImplementedError naming it.
_UNSUPPORTED_FLAGS = ("return_intermediate_states", "state_v_first")
# kdacp's extras chunk_kda accepts in **kwargs.
_CHUNK_KDA_EXTRAS = ("algorithm", "keep_forward", "threads", "deterministic")


def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
              use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, safe_gate=False,
              lower_bound=None, disable_recompute=False, return_intermediate_states=False,
              state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None, cp_context=None, *,
              A_log=None, dt_bias=None, **kwargs):
    """flash-linear-attention's ``fla.ops.kda.chunk_kda`` on kdacp (docs/python.md).

    Returns (o [B,T,HV,V], final_state [N,HV,K,V] or None). The in-kernel
    flags run kdacp's C++ transforms (kdacp/kda.hpp), then the kda layer:
    use_gate_in_kernel: g is raw, g = -exp(A_log)·softplus(g + dt_bias), or
    with lower_bound lower_bound·sigmoid(exp(A_log)·(g + dt_bias)); A_log [HV]
    and dt_bias [HV·K] are optional (None: A_log = 0, dt_bias = 0).
    use_qk_l2norm_in_kernel: q, k ← x / sqrt(Σ_K x² + 1e-6).
    use_beta_sigmoid_in_kernel: beta ← sigmoid(beta); with allow_neg_eigval
    (which needs it, ValueError otherwise) beta ← 2·sigmoid(beta), in [0, 2].
    safe_gate with the
    in-kernel gate needs lower_bound (as flash-linear-attention asserts); it is
    otherwise a numerics hint of flash-linear-attention's kernels that kdacp
    (exact for every g <= 0) does not need. disable_recompute: kdacp keeps
    the forward's intermediates by default (keep_forward); True forces it.
    cu_seqlens_cpu: the same boundaries (must equal cu_seqlens when both are
    given). cp_context: a CpContext (build_cp_context): the tensors are this
    rank's tokens of its layout, and no agreement message is sent per call.
    return_intermediate_states, state_v_first (other than
    their defaults) and any other keyword raise NotImplementedError naming
    them; kdacp extras: algorithm, keep_forward, threads, deterministic (kda's:
    with a cp_context every output and every gradient of q, k, v, g, beta,
    the raw g's with use_gate_in_kernel too, and the sum over the ranks of
    initial_state's, is the same bytes as one process, for every world size
    and layout). Under CP the gradients of initial_state, A_log and dt_bias
    are this rank's share (initial_state's: the rows of the sequences that
    start on this rank; A_log's, dt_bias's: its tokens' sums); summed over
    the ranks they are one process's (docs/python.md).
    """
    flags = {"return_intermediate_states": return_intermediate_states,
             "state_v_first": state_v_first}
    unsupported = [n for n in _UNSUPPORTED_FLAGS if flags[n] is not False]
    unsupported += sorted(n for n in kwargs if n not in _CHUNK_KDA_EXTRAS)
    if unsupported:
        raise NotImplementedError(
            f"kdacp.torch.chunk_kda does not support {unsupported} (flash-linear-attention "
            f"arguments kdacp does not implement; supported extras: {list(_CHUNK_KDA_EXTRAS)})")
    for name, flag in (("output_final_state", output_final_state),
                       ("use_qk_l2norm_in_kernel", use_qk_l2norm_in_kernel),
                       ("use_gate_in_kernel", use_gate_in_kernel),
                       ("use_beta_sigmoid_in_kernel", use_beta_sigmoid_in_kernel),
                       ("allow_neg_eigval", allow_neg_eigval),
                       ("safe_gate", safe_gate), ("disable_recompute", disable_recompute)):
        if not isinstance(flag, bool):
            raise ValueError(f"{name}={flag!r}, expected True or False")
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("allow_neg_eigval=True needs use_beta_sigmoid_in_kernel=True (beta is "
                         "then 2·sigmoid(beta), in [0, 2])")
    lower_bound = _lower_bound(lower_bound)
    if use_gate_in_kernel and safe_gate and lower_bound is None:
        raise ValueError("safe_gate=True with use_gate_in_kernel=True needs lower_bound (the "
                         "gate is then lower_bound·sigmoid(exp(A_log)·(g + dt_bias)))")
    if not use_gate_in_kernel and (A_log is not None or dt_bias is not None):
        raise ValueError("A_log / dt_bias given with use_gate_in_kernel=False: g is then the "
                         "ready log-decay and they would be ignored")
    if cu_seqlens is None:
        cu_seqlens = cu_seqlens_cpu
    elif cu_seqlens_cpu is not None and cu_list(cu_seqlens) != cu_list(cu_seqlens_cpu):
        raise ValueError("cu_seqlens and cu_seqlens_cpu differ, expected the same boundaries")
    algorithm = kwargs.get("algorithm", _DEFAULTS["algorithm"])
    deterministic = kwargs.get("deterministic", _DEFAULTS["deterministic"])
    keep_forward = kwargs.get("keep_forward", _DEFAULTS["keep_forward"])
    if disable_recompute:
        keep_forward = True
    for t, name, nd in ((q, "q", 4), (k, "k", 4), (g, "g", 4), (beta, "beta", 3)):
        _check_tensor(t, name, nd)
    compute = _compute_dtype(((q, "q"), (k, "k"), (g, "g"), (beta, "beta")))
    if use_gate_in_kernel:
        hv, kd = g.shape[2], g.shape[3]
        a = None
        if A_log is not None:
            a = _transform_input(A_log, "A_log", compute)
            if a.numel() != hv:
                raise ValueError(f"A_log has {a.numel()} elements (shape {list(A_log.shape)}), "
                                 f"expected HV = {hv}")
        bias = None
        if dt_bias is not None:
            bias = _transform_input(dt_bias, "dt_bias", compute)
            if bias.numel() != hv * kd:
                raise ValueError(f"dt_bias has {bias.numel()} elements (shape "
                                 f"{list(dt_bias.shape)}), expected HV*K = {hv * kd}")
        g = _GateFunction.apply(lower_bound, compute, _transform_input(g, "g", compute), a, bias)
    if use_qk_l2norm_in_kernel:
        q = _L2NormFunction.apply(compute, q.contiguous())
        k = _L2NormFunction.apply(compute, k.contiguous())
    if use_beta_sigmoid_in_kernel:
        beta = _SigmoidFunction.apply(compute, _transform_input(beta, "beta", compute),
                                      allow_neg_eigval)
    signature = {"use_qk_l2norm_in_kernel": use_qk_l2norm_in_kernel,
                 "use_gate_in_kernel": use_gate_in_kernel,
                 "use_beta_sigmoid_in_kernel": use_beta_sigmoid_in_kernel,
                 "lower_bound": lower_bound, "A_log given": A_log is not None,
                 "dt_bias given": dt_bias is not None}
    options = {"threads": kwargs["threads"]} if "threads" in kwargs else {}
    if cp_context is None:
        return kda(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                   algorithm=algorithm, keep_forward=keep_forward, deterministic=deterministic,
                   allow_neg_eigval=allow_neg_eigval, **options)
    if not isinstance(cp_context, CpContext):
        raise ValueError(f"cp_context is a {type(cp_context).__name__}, expected a "
                         "kdacp.torch.CpContext (build_cp_context)")
    if options:
        raise ValueError("threads with a cp_context: pass it to build_cp_context")
    signature = _neg_eigval_signature(signature, allow_neg_eigval)
    return cp_context._kda(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                           algorithm, keep_forward, signature, deterministic)
