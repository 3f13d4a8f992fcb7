"""flash-linear-attention's chunk_kda on kdacp: the in-kernel transforms
(gate, l2norm, sigmoid) as autograd Functions around the C++ passes, then the
kda layer, with or without a CP context."""

import math
import numbers
import warnings

import torch

from kdacp import _kdacp, _ops
from kdacp._autograd import cu_list, first_order
from kdacp._common import (_DEFAULTS, _DTYPES, _check_tensor, _compute_dtype, _from_numpy,
                           _require_finite_result, _threads, caller_stacklevel)
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
    """x / sqrt(Σ_K x² + 1e-6) per (token, head) (kdacp/kda.hpp l2norm_forward),
    in `compute` (a 16-bit q or k is normalized in float32 and stays float32:
    rounding it back measured farther from both of flash-linear-attention's
    references, docs/fla.md)."""

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


def transform_inputs(q, k, g, beta, compute, flags, A_log=None, dt_bias=None,
                     lower_bound=None):
    """chunk_kda's in-kernel transforms, as autograd Functions over the C++
    passes (fused_recurrent_kda_fwd's too): flags (use_qk_l2norm_in_kernel,
    use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval).
    Returns q, k, g, beta."""
    l2norm, use_gate, sigmoid, neg = flags
    if use_gate:
        g = _gate_in_kernel(g, A_log, dt_bias, lower_bound, compute)
    if l2norm:
        q = _L2NormFunction.apply(compute, q.contiguous())
        k = _L2NormFunction.apply(compute, k.contiguous())
    if sigmoid:
        beta = _SigmoidFunction.apply(compute, _transform_input(beta, "beta", compute), neg)
    return q, k, g, beta


def _gate_in_kernel(g, A_log, dt_bias, lower_bound, compute):
    """use_gate_in_kernel: the gate of raw g [B,T,HV,K] (A_log [HV], dt_bias
    [HV·K] checked), differentiable w.r.t. all three."""
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
    return _GateFunction.apply(lower_bound, compute, _transform_input(g, "g", compute), a, bias)


class FlaAssertionError(AssertionError, ValueError):
    """A condition flash-linear-attention checks with ``assert`` (so raises
    AssertionError): kdacp raises this subclass of AssertionError and
    ValueError, so code written for either catches it."""


def _fla_keywords(op, state_v_first, kwargs, chunk_size=True):
    """flash-linear-attention's keywords read from **kwargs: the deprecated
    transpose_state_layout (the old name of state_v_first: a
    DeprecationWarning; both given is a ValueError, as there) and, for
    chunk_kda, chunk_size (32 or 64, else ValueError, as there). Pops them."""
    if "transpose_state_layout" in kwargs:
        if state_v_first:
            raise ValueError(f"{op}: state_v_first and transpose_state_layout are both given; "
                             "transpose_state_layout is the deprecated name of state_v_first, "
                             "pass state_v_first only")
        warnings.warn(f"{op}: transpose_state_layout is deprecated, it is now called "
                      "state_v_first", DeprecationWarning, stacklevel=caller_stacklevel())
        state_v_first = kwargs.pop("transpose_state_layout")
    if not chunk_size:
        return state_v_first
    size = kwargs.pop("chunk_size", 64)
    if isinstance(size, bool) or size not in (32, 64):
        raise ValueError(f"{op}: `chunk_size` must be either 32 or 64 for KDA, got {size!r} "
                         "(flash-linear-attention's condition and words; kdacp's kernels tile 64 "
                         "tokens either way)")
    return state_v_first, int(size)


def _state_in(initial_state, state_v_first):
    """initial_state in kdacp's [N,HV,K,V] layout (a differentiable transpose
    of a state_v_first [N,HV,V,K] one)."""
    if initial_state is None or not state_v_first:
        return initial_state
    _check_tensor(initial_state, "initial_state", 4)
    return initial_state.transpose(-1, -2)


def _check_intermediate(wanted, disable_recompute):
    if not wanted:
        return
    if not torch.is_inference_mode_enabled():
        raise FlaAssertionError("return_intermediate_states=True is only allowed in inference "
                                "mode (torch.inference_mode()), as in flash-linear-attention: the "
                                "states bypass autograd")
    if disable_recompute:
        raise FlaAssertionError("return_intermediate_states=True needs disable_recompute=False, "
                                "as in flash-linear-attention")


def _no_tokens(k, v, output_final_state, compute):
    """(o, final_state of no sequence) of a batch whose sequences are all empty."""
    b, t, hv, vd = v.shape
    o = torch.zeros(b, t, hv, vd, dtype=v.dtype)
    return o, (torch.zeros(0, hv, k.shape[3], vd, dtype=compute) if output_final_state else None)


class _Padding:
    """cu_seqlens with zero-length sequences or, with use_graph, ending before
    T (flash-linear-attention's padded graph batches): the layer runs the
    non-empty sequences on tokens [0, end) and restore() puts the results back
    in the padded shapes (o = 0 past end, an empty sequence's final state is
    its initial state or zero)."""

    def __init__(self, cu, keep, end, graph_chunks):
        self.cu, self.end, self.graph_chunks = cu, end, graph_chunks
        self.lengths = graph_chunks[1]
        self.keep = torch.tensor(keep, dtype=torch.long)
        self.empty = not keep

    @staticmethod
    def of(cu_seqlens, tokens, use_graph, max_num_seqs, cp_context):
        if max_num_seqs is not None and (isinstance(max_num_seqs, bool) or
                                         not isinstance(max_num_seqs, numbers.Integral) or
                                         max_num_seqs < 1):
            raise ValueError(f"max_num_seqs={max_num_seqs!r}, expected an integer >= 1")
        if cp_context is not None:
            # CUDA-graph capture has no CPU counterpart and a context holds
            # real sequences only (no zero-length tail): nothing to unpad.
            n = getattr(cp_context, "num_seqs", None)
            if use_graph and max_num_seqs is not None and n is not None and n != max_num_seqs:
                raise FlaAssertionError(f"use_graph=True: the cp_context holds {n} local "
                                        f"sequences, expected max_num_seqs = {max_num_seqs} "
                                        "(kdacp's context takes no zero-length padding)")
            return None
        if cu_seqlens is None:
            return None
        cu = cu_list(cu_seqlens)
        n = len(cu) - 1
        if use_graph and max_num_seqs is not None and n != max_num_seqs:
            raise FlaAssertionError(f"use_graph=True: cu_seqlens has {n} sequences, expected "
                                    f"max_num_seqs = {max_num_seqs} (pad it with zero-length tail "
                                    "sequences to max_num_seqs + 1 entries)")
        if n < 1 or cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])) or cu[-1] > tokens:
            return None  # kda names what is wrong
        lengths = [b - a for a, b in zip(cu, cu[1:])]
        end = cu[-1] if use_graph else tokens
        if all(lengths) and end == tokens:
            return None
        keep = [i for i, n_ in enumerate(lengths) if n_]
        packed = [0]
        for i in keep:
            packed.append(packed[-1] + lengths[i])
        return _Padding(packed, keep, end, (use_graph, lengths))

    def restore(self, o, ht, h, full_state, tokens, chunk_size):
        if o.shape[1] < tokens:
            o = torch.cat([o, o.new_zeros(o.shape[0], tokens - o.shape[1], *o.shape[2:])], 1)
        if ht is not None:
            n = len(self.graph_chunks[1])
            base = full_state if full_state is not None else ht.new_zeros(n, *ht.shape[1:])
            ht = base.index_copy(0, self.keep, ht) if len(self.keep) else base
        if h is not None and self.graph_chunks[0]:
            nt_max = -(-tokens // chunk_size) + len(self.graph_chunks[1]) - 1
            h = torch.cat([h, h.new_zeros(1, nt_max - h.shape[1], *h.shape[2:])], 1)
        return o, ht, h


def _intermediate_states(tensors, initial_state, scale, cu_seqlens, compute, chunk_size,
                         algorithm, options, dtype):
    """h [B,NT,HV,K,V] in `dtype`: the state entering every chunk of
    chunk_size tokens of every sequence (B = 1 with cu_seqlens), from kdacp's
    C++ forward run chunk by chunk (_kdacp.kda_chunk_states)."""
    q, k, v, g, beta = (x.detach().to(compute).contiguous() for x in tensors)
    b, t, h_, kd = q.shape
    hv, vd = v.shape[2], v.shape[3]
    if scale is None:
        scale = 1.0 / math.sqrt(kd)
    h0 = None if initial_state is None else initial_state.detach().to(compute).contiguous()
    cu = None if cu_seqlens is None else cu_list(cu_seqlens)
    if cu == [0]:  # no sequence left (all empty)
        states = torch.zeros(0, hv, kd, vd, dtype=compute)
    else:
        states = _from_numpy(_kdacp.kda_chunk_states(
            q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(), beta.data_ptr(),
            [b, t, h_, hv, kd, vd], float(scale), cu, 0 if h0 is None else h0.data_ptr(),
            chunk_size, _DTYPES[compute], algorithm, _threads(options))[1])
    states = states.view(b, -1, hv, kd, vd) if cu is None else states.unsqueeze(0)
    out = states.to(dtype)
    if dtype in (torch.float16, torch.bfloat16) and not torch.isfinite(out).all():
        raise ValueError(f"chunk_kda: an intermediate state is beyond {dtype}'s range (h is "
                         "stored as k); use float32 inputs or rescale")
    return out


def _cp_intermediate_states(ctx, incoming, tensors, initial_state, scale, compute, chunk_size,
                            algorithm, dtype):
    """h under CP: the state entering every chunk of each local sequence
    piece of this rank (chunks counted from each piece's first local token,
    pieces in local order, flash-linear-attention's), part by part: a piece
    that continues a sequence from earlier ranks starts from its part's
    incoming state (the forward's exchange), one that starts here from
    initial_state (or zero)."""
    cu = ctx.global_cu_seqlens
    b, kd = tensors[0].shape[0], tensors[0].shape[3]
    hv, vd = tensors[2].shape[2], tensors[2].shape[3]
    pieces, local = [], 0
    for p, (first, end) in enumerate(ctx._parts()):
        n = end - first
        part = tuple(x[:, local:local + n] for x in tensors)
        local += n
        if n == 0:
            continue
        if cu is None:  # a sequence per batch row
            part_cu, seqs, starts = None, [None] * b, first == 0
        else:
            inner = [c for c in cu if first < c < end]
            part_cu = [0] + [c - first for c in inner] + [n]
            seqs = [i for i in range(len(cu) - 1) if cu[i] < end and cu[i + 1] > first]
            starts = first in cu
        h0 = torch.zeros(len(seqs), hv, kd, vd, dtype=compute)
        if initial_state is not None:
            rows = initial_state if cu is None else initial_state[seqs]
            h0.copy_(rows)
        if not starts:
            h0[:1 if cu is not None else b] = incoming[p].reshape(-1, hv, kd, vd)[:h0.shape[0]]
        pieces.append(_intermediate_states(part, h0, scale, part_cu, compute, chunk_size,
                                           algorithm, {}, dtype))
    if not pieces:
        return torch.zeros(b, 0, hv, kd, vd, dtype=dtype)
    return torch.cat(pieces, 1)


# kdacp's extras chunk_kda accepts in **kwargs.
_CHUNK_KDA_EXTRAS = ("algorithm", "keep_forward", "threads", "deterministic")


@_ops.entry("chunk_kda", _ops.chunk_kda_fake)  # torch.compile: kdacp::chunk_kda (docs/compile.md)
def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
              use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, safe_gate=False,
              lower_bound=None, disable_recompute=False, return_intermediate_states=False,
              state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None, cp_context=None,
              use_graph=False, max_num_seqs=None, *, A_log=None, dt_bias=None, **kwargs):
    """flash-linear-attention's ``fla.ops.kda.chunk_kda`` on kdacp (docs/fla.md).

    Returns (o [B,T,HV,V], final_state [N,HV,K,V] or None), and with
    return_intermediate_states=True (under torch.inference_mode() only)
    (o, final_state, h): h [B,NT,HV,K,V] in k's dtype, the state entering
    every chunk of chunk_size tokens (B = 1 and NT the chunks of all
    sequences with cu_seqlens). The in-kernel flags run kdacp's C++
    transforms (kdacp/kda.hpp), then the kda layer:
    use_gate_in_kernel: g is raw, g = -exp(A_log)·softplus(g + dt_bias), or
    with lower_bound lower_bound·sigmoid(exp(A_log)·(g + dt_bias)); A_log [HV]
    is required unless lower_bound is set (then None: A_log = 0), dt_bias
    [HV·K] is optional (None: 0).
    use_qk_l2norm_in_kernel: q, k ← x / sqrt(Σ_K x² + 1e-6).
    use_beta_sigmoid_in_kernel: beta ← sigmoid(beta); with allow_neg_eigval
    (which needs it, ValueError otherwise) beta ← 2·sigmoid(beta), in [0, 2].
    A ready beta (no sigmoid flag) may lie anywhere in [0, 2], as
    flash-linear-attention's kernels take it (they check no range).
    safe_gate with the
    in-kernel gate needs lower_bound (as flash-linear-attention asserts); it is
    otherwise a numerics hint of flash-linear-attention's kernels that kdacp
    (exact for every g <= 0) does not need. disable_recompute: kdacp keeps
    the forward's intermediates by default (keep_forward); True forces it.
    state_v_first (or the deprecated transpose_state_layout keyword, with a
    DeprecationWarning): initial_state and final_state are [N,HV,V,K].
    chunk_size (keyword, 32 or 64, else ValueError): the chunks of h; kdacp's
    kernels tile 64 tokens whatever it is, o and final_state do not depend
    on it. use_graph: cu_seqlens may end with zero-length sequences and
    before T (tokens past its end give o = 0), exactly max_num_seqs + 1
    entries when max_num_seqs is given; zero-length sequences are accepted
    anywhere (their final state is their initial state).
    cu_seqlens_cpu: the same boundaries (must equal cu_seqlens when both are
    given). cp_context: a CpContext (build_cp_context): the tensors are this
    rank's tokens of its layout, and no agreement message is sent per call.
    Any other keyword raises NotImplementedError naming it; kdacp extras:
    algorithm, keep_forward, threads, deterministic (kda's:
    with a cp_context every output and every gradient of q, k, v, g, beta,
    the raw g's with use_gate_in_kernel too, and the sum over the ranks of
    initial_state's, is the same bytes as one process, for every world size
    and layout). Under CP the gradients of initial_state, A_log and dt_bias
    are this rank's share (initial_state's: the rows of the sequences that
    start on this rank; A_log's, dt_bias's: its tokens' sums); summed over
    the ranks they are one process's (docs/python.md).
    """
    state_v_first, chunk_size = _fla_keywords("chunk_kda", state_v_first, kwargs)
    unsupported = sorted(n for n in kwargs if n not in _CHUNK_KDA_EXTRAS)
    if unsupported:
        raise NotImplementedError(
            f"kdacp.torch.chunk_kda does not support {unsupported} (flash-linear-attention "
            f"arguments kdacp does not implement; supported extras: {list(_CHUNK_KDA_EXTRAS)})")
    for name, flag in (("output_final_state", output_final_state),
                       ("use_qk_l2norm_in_kernel", use_qk_l2norm_in_kernel),
                       ("use_gate_in_kernel", use_gate_in_kernel),
                       ("use_beta_sigmoid_in_kernel", use_beta_sigmoid_in_kernel),
                       ("allow_neg_eigval", allow_neg_eigval),
                       ("safe_gate", safe_gate), ("disable_recompute", disable_recompute),
                       ("return_intermediate_states", return_intermediate_states),
                       ("state_v_first", state_v_first), ("use_graph", use_graph)):
        if not isinstance(flag, bool):
            raise ValueError(f"{name}={flag!r}, expected True or False")
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("allow_neg_eigval=True needs use_beta_sigmoid_in_kernel=True (beta is "
                         "then 2·sigmoid(beta), in [0, 2])")
    lower_bound = _lower_bound(lower_bound)
    if use_gate_in_kernel and A_log is None and lower_bound is None:
        raise ValueError("use_gate_in_kernel=True needs A_log unless lower_bound is set (as in "
                         "flash-linear-attention: the gate is -exp(A_log)·softplus(g + dt_bias))")
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
    for t, name, nd in ((q, "q", 4), (k, "k", 4), (v, "v", 4), (g, "g", 4), (beta, "beta", 3)):
        _check_tensor(t, name, nd)
    _check_intermediate(return_intermediate_states, disable_recompute)
    tokens, k_dtype, q_dtype = q.shape[1], k.dtype, q.dtype
    initial_state = _state_in(initial_state, state_v_first)
    pad = _Padding.of(cu_seqlens, tokens, use_graph, max_num_seqs, cp_context)
    if pad is not None:
        q, k, v, g, beta = (x[:, :pad.end] for x in (q, k, v, g, beta))
        cu_seqlens, full_state = pad.cu, initial_state
        if initial_state is not None:
            _check_tensor(initial_state, "initial_state", 4)
            if initial_state.shape[0] != len(pad.lengths):
                raise ValueError(f"initial_state has {initial_state.shape[0]} sequences, "
                                 f"expected N = {len(pad.lengths)} (cu_seqlens' sequences)")
            initial_state = initial_state.index_select(0, pad.keep)
        if pad.empty:  # no token to transform
            use_gate_in_kernel = use_qk_l2norm_in_kernel = use_beta_sigmoid_in_kernel = False
    compute = _compute_dtype(((q, "q"), (k, "k"), (g, "g"), (beta, "beta")))
    q, k, g, beta = transform_inputs(q, k, g, beta, compute, (
        use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
        allow_neg_eigval), A_log, dt_bias, lower_bound)
    signature = {"use_qk_l2norm_in_kernel": use_qk_l2norm_in_kernel,
                 "use_gate_in_kernel": use_gate_in_kernel,
                 "use_beta_sigmoid_in_kernel": use_beta_sigmoid_in_kernel,
                 "lower_bound": lower_bound, "A_log given": A_log is not None,
                 "dt_bias given": dt_bias is not None}
    options = {"threads": kwargs["threads"]} if "threads" in kwargs else {}
    wide = allow_neg_eigval or not use_beta_sigmoid_in_kernel  # a ready beta: [0, 2]
    if v.dtype != q_dtype and v.dtype in (torch.bfloat16, torch.float16):
        v = v.float()  # o is q's dtype, rounded once: from float32, not from v's 16 bits
    if pad is not None and pad.empty:
        o, ht = _no_tokens(k, v, output_final_state, compute)
    elif cp_context is None:
        o, ht = kda(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                    algorithm=algorithm, keep_forward=keep_forward, deterministic=deterministic,
                    allow_neg_eigval=wide, **options)
    else:
        if not isinstance(cp_context, CpContext):
            raise ValueError(f"cp_context is a {type(cp_context).__name__}, expected a "
                             "kdacp.torch.CpContext (build_cp_context)")
        if options:
            raise ValueError("threads with a cp_context: pass it to build_cp_context")
        signature = _neg_eigval_signature(signature, wide)
        out = cp_context._kda(q, k, v, g, beta, scale, initial_state, output_final_state,
                              cu_seqlens, algorithm, keep_forward, signature, deterministic,
                              want_incoming=return_intermediate_states)
        o, ht = out[:2]
    h = None
    if return_intermediate_states and cp_context is not None:  # (no padding with a context)
        h = _cp_intermediate_states(cp_context, out[2], (q, k, v, g, beta), initial_state,
                                    scale, compute, chunk_size, algorithm, k_dtype)
    elif return_intermediate_states:
        h = _intermediate_states((q, k, v, g, beta), initial_state, scale, cu_seqlens, compute,
                                 chunk_size, algorithm, options, k_dtype)
    if pad is not None:
        o, ht, h = pad.restore(o, ht, h, full_state, tokens, chunk_size)
    if o.dtype != q_dtype:  # flash-linear-attention's o is q's dtype
        o = o.to(q_dtype)
    if ht is not None and state_v_first:
        ht = ht.transpose(-1, -2).contiguous()
    if h is not None and state_v_first:
        h = h.transpose(-1, -2).contiguous()
    return (o, ht, h) if return_intermediate_states else (o, ht)
