"""The causal short convolution of flash-linear-attention (its
``fla.modules.convolution.causal_conv1d``) on kdacp's C++ kernels
(kdacp/conv.hpp), on one process or under context parallelism with a
``cp_context``; exported as ``kdacp.torch.causal_conv1d``. docs/conv.md.

    y, final_state = causal_conv1d(x, weight, bias=None, residual=None,
                                   initial_state=None, output_final_state=False,
                                   activation=None, backend="triton", cu_seqlens=None,
                                   cu_seqlens_cpu=None, chunk_indices=None,
                                   cp_context=None)
"""


import torch

from kdacp import _kdacp, _ops
from kdacp._autograd import cu_list, first_order
from kdacp._common import _DTYPES, _check_tensor, _compute_dtype, _from_numpy

__all__ = ["causal_conv1d"]

_ACTIVATIONS = {None: "none", "silu": "silu", "swish": "silu"}
# flash-linear-attention's keyword arguments read from **kwargs.
_KEYWORDS = ("seq_idx",)
_FLA_BACKENDS = ("triton", "cuda", "mix", None)


def _tensor(t, name, ndim):
    _check_tensor(t, name, prefix="causal_conv1d: ")
    if t.dim() != ndim and ndim is not None:
        raise ValueError(f"causal_conv1d: {name} has shape {list(t.shape)} ({t.dim()} dims), "
                         f"expected {ndim} dims")
    t = t.contiguous()
    _kdacp.check_tensor(t.data_ptr(), list(t.shape), _DTYPES[t.dtype], name, "finite")
    return t


def _seq_idx_cu(seq_idx, b, t):
    """The packed boundaries over the B·T tokens that seq_idx [B, T] (a
    sequence id per token, non-decreasing along each row, >= 0) describes:
    a new sequence wherever the id changes and at every row's start."""
    if not isinstance(seq_idx, torch.Tensor) or seq_idx.dtype.is_floating_point or \
            seq_idx.dtype == torch.bool or tuple(seq_idx.shape) != (b, t):
        raise ValueError(f"causal_conv1d: seq_idx must be an integer tensor of shape [B, T] = "
                         f"{[b, t]}, got {getattr(seq_idx, 'dtype', type(seq_idx).__name__)} "
                         f"{list(getattr(seq_idx, 'shape', []))}")
    cu = [0]
    for r, row in enumerate(seq_idx.tolist()):
        if row and min(row) < 0:
            raise ValueError(f"causal_conv1d: seq_idx row {r} holds {min(row)}, expected ids >= 0")
        if any(y < x for x, y in zip(row, row[1:])):
            raise ValueError(f"causal_conv1d: seq_idx row {r} decreases, expected non-decreasing "
                             "ids (each sequence one run of tokens)")
        cu += [r * t + j for j in range(1, t) if row[j] != row[j - 1]] + [(r + 1) * t]
    return cu


def _cu_list(cu_seqlens):
    return None if cu_seqlens is None else cu_list(cu_seqlens, "causal_conv1d")


class _ConvFunction(torch.autograd.Function):
    """The C++ forward and backward. x, weight, bias, initial_state: all
    float64, or each float32, bfloat16 or float16 (computed in float32); y
    and final_state are stored as x, each gradient as its input."""

    @staticmethod
    def forward(ctx, op, activation, want_ht, compute, x, weight, bias, h0):
        dtypes = [_DTYPES[compute if t is None else t.dtype] for t in (x, weight, bias, h0)]
        y, ht, saved = op.forward(_DTYPES[compute], dtypes, x.data_ptr(), weight.data_ptr(),
                                  0 if bias is None else bias.data_ptr(),
                                  0 if h0 is None else h0.data_ptr(), activation, want_ht)
        ctx.op, ctx.activation, ctx.want_ht, ctx.kdacp_saved = op, activation, want_ht, saved
        ctx.compute, ctx.dtypes = compute, dtypes
        ctx.save_for_backward(x, weight, bias, h0)
        y = _from_numpy(y, x.dtype)
        if want_ht:
            return y, _from_numpy(ht, x.dtype)
        empty = y.new_empty(0)
        ctx.mark_non_differentiable(empty)
        return y, empty

    @staticmethod
    def backward(ctx, dy, dht):
        x, weight, bias, h0 = ctx.saved_tensors
        with torch.no_grad():
            if dy is None:
                dy = torch.zeros_like(x)
            dy = dy.to(x.dtype).contiguous()
            _kdacp.check_tensor(dy.data_ptr(), list(dy.shape), _DTYPES[dy.dtype],
                                "the gradient of y", "finite")
            dht_ptr = 0
            if ctx.want_ht:
                # Every rank passes one (zeros when its loss does not use the
                # final state): the ranks' are summed collectively.
                if dht is None:
                    dht = torch.zeros(ctx.op.sequences, weight.shape[0], weight.shape[1],
                                      dtype=x.dtype)
                dht = dht.to(x.dtype).contiguous()
                _kdacp.check_tensor(dht.data_ptr(), list(dht.shape), _DTYPES[dht.dtype],
                                    "the gradient of final_state", "finite")
                dht_ptr = dht.data_ptr()
            grads = ctx.op.backward(ctx.kdacp_saved, _DTYPES[ctx.compute], ctx.dtypes,
                                    x.data_ptr(), weight.data_ptr(),
                                    0 if bias is None else bias.data_ptr(),
                                    0 if h0 is None else h0.data_ptr(), ctx.activation,
                                    dy.data_ptr(), dht_ptr)
            grads = [None if g is None else _from_numpy(g, t.dtype)
                     for g, t in zip(grads, (x, weight, bias, h0))]
        grads = first_order("causal_conv1d", grads, (x, weight, bias, h0))
        return (None, None, None, None) + tuple(grads)


def _context_layout(cp_context, x, cu):
    """(backend, layout, cu_seqlens) of a CP context; ValueError naming what
    does not fit this call."""
    for attr in ("backend", "global_layout", "rank", "world_size", "global_cu_seqlens",
                 "matches_cu_seqlens"):
        if not hasattr(cp_context, attr):
            raise ValueError(f"causal_conv1d: cp_context {cp_context!r} has no attribute "
                             f"'{attr}', expected a context of kdacp.torch.build_cp_context")
    cp_context._check_runnable("causal_conv1d")
    ctx_cu = cp_context.global_cu_seqlens
    if cu is not None and not cp_context.matches_cu_seqlens(cu):
        raise ValueError(f"causal_conv1d: cu_seqlens {cu} differ from the cp_context's (global "
                         f"{ctx_cu}, this rank's {cp_context.cu_seqlens_cpu}): with a cp_context "
                         f"pass cu_seqlens=None or one of them")
    layout = cp_context.global_layout
    if cp_context.backend is None or cp_context.world_size == 1:
        tokens = x.shape[1] if layout is None else layout.tokens
        if x.shape[1] != tokens:
            raise ValueError(f"causal_conv1d: x holds {x.shape[1]} tokens, the cp_context's "
                             f"single process holds {tokens}")
        return None, None, ctx_cu, tokens
    local = layout.local_tokens(cp_context.rank)
    if x.shape[1] != local:
        name = cp_context.layout
        raise ValueError(f"causal_conv1d: rank {cp_context.rank}: x holds {x.shape[1]} tokens, "
                         f"the cp_context's layout ({name}) gives this rank {local} of "
                         f"{layout.tokens}")
    return cp_context.backend, layout, ctx_cu, layout.tokens


@_ops.entry("causal_conv1d", _ops.conv_fake)  # torch.compile: kdacp::causal_conv1d
def causal_conv1d(x, weight=None, bias=None, residual=None, initial_state=None,
                  output_final_state=False, activation=None, backend="triton", cu_seqlens=None,
                  cu_seqlens_cpu=None, chunk_indices=None, cp_context=None, **kwargs):
    """Causal depthwise convolution, flash-linear-attention's semantics and
    its parameters in its order.

    x [B,T,D] (with a cp_context: this rank's tokens of the context's
    layout), weight [D,W] with 1 <= W <= 8 (None: ValueError), bias [D] or
    None, residual [B,T,D] or None (added after the activation: y =
    act(conv + bias) + residual, its gradient dy), activation None, "silu" or
    "swish"; backend "triton", "cuda", "mix" or None (kdacp runs its C++
    kernels whichever); cu_seqlens_cpu: the same boundaries (used when
    cu_seqlens is None; ValueError when they differ); chunk_indices: derived
    from cu_seqlens there, not needed here (ignored); CPU tensors, finite, all float64 or each float32,
    bfloat16 or float16 (computed in float32; y and final_state stored as x,
    each gradient as its input).
    initial_state [N,D,W] (N = B, or the number of packed sequences with
    cu_seqlens, B = 1): column W-1-i is the token i+1 before a sequence's
    first (column 0 is not read). Returns (y [B,T,D], final_state [N,D,W] or
    None): final_state holds each sequence's last W tokens (reaching into
    initial_state, or zeros, for a sequence shorter than W); with a
    cp_context it is complete on every rank and its gradient is the sum over
    ranks. Differentiable (once) w.r.t. x, weight, bias and initial_state;
    with a cp_context weight.grad, bias.grad and initial_state.grad are this
    rank's share (its tokens' sums; initial_state's: the rows of the
    sequences that start on this rank, -0.0 in the others): summed over the
    CP ranks they are the one-process gradient, as data parallel gradients
    are (docs/python.md).
    Every rank calls it, and its backward, in the same order.
    """
    unknown = sorted(k for k in kwargs if k not in _KEYWORDS)
    if unknown:
        raise TypeError(f"causal_conv1d() got unexpected keyword argument(s) {unknown}")
    seq_idx = kwargs.get("seq_idx")
    if backend not in _FLA_BACKENDS:
        raise ValueError(f"causal_conv1d: backend={backend!r}, expected 'triton', 'cuda' or "
                         "'mix' (flash-linear-attention's; kdacp runs its own C++ kernels)")
    if weight is None:
        raise ValueError("causal_conv1d: weight=None, expected a [D, W] tensor (the kernel width "
                         "W is weight's; flash-linear-attention 0.6 fails there too, with "
                         "AttributeError)")
    if activation not in _ACTIVATIONS:
        raise ValueError(f"causal_conv1d: activation={activation!r}, expected None, 'silu' or "
                         "'swish'")
    if not isinstance(output_final_state, bool):
        raise ValueError(f"causal_conv1d: output_final_state={output_final_state!r}, expected "
                         "True or False")
    weight = _tensor(weight, "weight", 2)
    x_shape = x.shape if isinstance(x, torch.Tensor) else None
    x = _tensor(x, "x", None)
    if x.dim() < 3:
        raise ValueError(f"causal_conv1d: x has shape {list(x.shape)}, expected [B, T, D] (or "
                         "[B, T, ...] whose trailing dims hold D elements)")
    x = x.reshape(x.shape[0], x.shape[1], -1)
    b, t, d = x.shape
    if weight.shape[0] != d:
        raise ValueError(f"causal_conv1d: weight has shape {list(weight.shape)}, expected "
                         f"[D, W] with D = {d} (x's last dim)")
    w = weight.shape[1]
    if not 1 <= w <= _kdacp.conv_max_width:
        raise ValueError(f"causal_conv1d: weight has shape {list(weight.shape)}: kernel width "
                         f"W = {w}, expected 1 <= W <= {_kdacp.conv_max_width}")
    if bias is not None:
        bias = _tensor(bias, "bias", 1)
        if bias.shape[0] != d:
            raise ValueError(f"causal_conv1d: bias has shape {list(bias.shape)}, expected [{d}]")
    if residual is not None:
        residual = _tensor(residual, "residual", None)
        if residual.shape == x_shape:
            residual = residual.reshape(x.shape)
        if residual.shape != x.shape:
            raise ValueError(f"causal_conv1d: residual has shape {list(residual.shape)}, "
                             f"expected x's {list(x.shape)}")
    if cu_seqlens is None:
        cu_seqlens = cu_seqlens_cpu
    elif cu_seqlens_cpu is not None and _cu_list(cu_seqlens) != _cu_list(cu_seqlens_cpu):
        raise ValueError("causal_conv1d: cu_seqlens and cu_seqlens_cpu differ, expected the "
                         "same boundaries")
    cu = _cu_list(cu_seqlens)
    rows = None
    if seq_idx is not None:
        cu, rows = _with_seq_idx(seq_idx, x, cu, initial_state, output_final_state, cp_context)
        if rows is not None:
            x = x.reshape(1, b * t, d)
            residual = None if residual is None else residual.reshape(x.shape)
            b, t = 1, b * t
    if cp_context is not None:
        kernel = getattr(cp_context, "conv1d_kernel_size", None)
        if kernel is not None and kernel != w:
            raise ValueError(f"causal_conv1d: weight has kernel width W = {w}, the cp_context "
                             f"was built with conv1d_kernel_size={kernel}")
        backend, layout, cu, tokens = _context_layout(cp_context, x, cu)
    else:
        backend, layout, tokens = None, None, t
    if cu is not None and b != 1:
        raise ValueError(f"causal_conv1d: x has batch B = {b} with cu_seqlens, expected B = 1 "
                         "(packed sequences)")
    n = b if cu is None else len(cu) - 1
    if initial_state is not None:
        initial_state = _tensor(initial_state, "initial_state", 3)
        if list(initial_state.shape) != [n, d, w]:
            raise ValueError(f"causal_conv1d: initial_state has shape "
                             f"{list(initial_state.shape)}, expected [N, D, W] = {[n, d, w]}")
    compute = _compute_dtype(((x, "x"), (weight, "weight"), (bias, "bias"),
                              (initial_state, "initial_state")), prefix="causal_conv1d: ")
    op = _kdacp.CausalConv(backend, layout, b, tokens, cu, d, w)
    y, ht = _ConvFunction.apply(op, _ACTIVATIONS[activation], output_final_state, compute, x,
                                weight, bias, initial_state)
    if residual is not None:
        y = (y.to(compute) + residual.to(compute)).to(x.dtype)
    return y.reshape(x_shape), (ht if output_final_state else None)


def _with_seq_idx(seq_idx, x, cu, initial_state, output_final_state, cp_context):
    """(cu_seqlens, rows) for a call given seq_idx: its sequences, which must
    be cu_seqlens' when both are given; without cu_seqlens a batch of B > 1
    rows runs packed (rows = B) and states are refused (flash-linear-
    attention's CUDA backend, the one that reads seq_idx, keeps a state per
    row there, not per sequence)."""
    if cp_context is not None:
        raise ValueError("causal_conv1d: seq_idx with a cp_context: the context's cu_seqlens "
                         "define the sequences, omit seq_idx")
    b, t, _ = x.shape
    derived = _seq_idx_cu(seq_idx, b, t)
    if cu is not None:
        if b != 1 or cu != derived:
            raise ValueError(f"causal_conv1d: seq_idx gives the boundaries {derived}, "
                             f"cu_seqlens {cu}: expected the same sequences")
        return cu, None
    if initial_state is not None or output_final_state:
        raise ValueError("causal_conv1d: seq_idx without cu_seqlens takes no initial_state and "
                         "gives no final_state (pass cu_seqlens for per-sequence states)")
    return derived, (b if b > 1 else None)
