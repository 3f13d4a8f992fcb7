"""flash-linear-attention's KDA gate ops (``fla.ops.kda.gate``: fused_kda_gate,
kda_gate_fwd, kda_gate_bwd, kda_gate_chunk_cumsum) on kdacp's C++ gate
transform (kdacp/kda.hpp gate_forward / gate_backward). docs/fla.md.

    g = -exp(A_log[h]) · softplus(g + dt_bias[h, k])                (no lower_bound)
    g = lower_bound · sigmoid(exp(A_log[h]) · (g + dt_bias[h, k]))  (lower_bound; A_log None: exp(A_log) = 1)
"""

import torch

from kdacp import _kdacp
from kdacp._autograd import cu_list
from kdacp._chunk import FlaAssertionError, _GateFunction, _lower_bound, _transform_input
from kdacp._common import _DTYPES, _check_tensor, _from_numpy

__all__ = ["fused_kda_gate", "kda_gate_fwd", "kda_gate_bwd", "kda_gate_chunk_cumsum"]


def _params(op, g, A_log, dt_bias, lower_bound):
    """(raw g as [1, tokens, H, K], A_log, dt_bias in the compute dtype or
    None, lower_bound, compute dtype), checked."""
    _check_tensor(g, "g", prefix=f"{op}: ")
    if g.dim() < 2:
        raise ValueError(f"{op}: g has shape {list(g.shape)}, expected [..., H, K]")
    lower_bound = _lower_bound(lower_bound)
    if A_log is None and lower_bound is None:
        raise ValueError(f"{op}: A_log=None needs lower_bound (the gate is then "
                         "lower_bound·sigmoid(g + dt_bias)), as flash-linear-attention documents; "
                         "its kernel would compute -e·softplus(g + dt_bias)")
    compute = torch.float64 if g.dtype == torch.float64 else torch.float32
    h, kd = g.shape[-2], g.shape[-1]
    a = b = None
    if A_log is not None:
        a = _transform_input(A_log, "A_log", compute)
        if a.numel() != h:
            raise ValueError(f"{op}: A_log has {a.numel()} elements, expected H = {h}")
    if dt_bias is not None:
        b = _transform_input(dt_bias, "dt_bias", compute)
        if b.numel() != h * kd:
            raise ValueError(f"{op}: dt_bias has {b.numel()} elements, expected H*K = {h * kd}")
    raw = _transform_input(g, "g", compute).reshape(1, -1, h, kd)
    return raw, a, b, lower_bound, compute


def _dtype(output_dtype, op):
    if output_dtype not in _DTYPES:
        raise ValueError(f"{op}: output_dtype={output_dtype!r}, expected torch.float32, "
                         "torch.float64, torch.bfloat16 or torch.float16")
    return output_dtype


def fused_kda_gate(g, A_log=None, dt_bias=None, lower_bound=None, output_dtype=torch.float32):
    """flash-linear-attention's fused_kda_gate: the gate of g [..., H, K]
    (A_log H elements, dt_bias H·K), in output_dtype, differentiable (once)
    w.r.t. g, A_log and dt_bias (each gradient in its input's dtype)."""
    output_dtype = _dtype(output_dtype, "fused_kda_gate")
    raw, a, b, lb, compute = _params("fused_kda_gate", g, A_log, dt_bias, lower_bound)
    y = _GateFunction.apply(lb, compute, raw, a, b)
    return y.reshape(g.shape).to(output_dtype)


def kda_gate_fwd(g, A_log=None, dt_bias=None, lower_bound=None, output_dtype=torch.float32):
    """flash-linear-attention's kda_gate_fwd: fused_kda_gate's value, outside
    autograd."""
    with torch.no_grad():
        return fused_kda_gate(g, A_log, dt_bias, lower_bound, output_dtype)


def kda_gate_bwd(g, A_log=None, dt_bias=None, dyg=None, lower_bound=None):
    """flash-linear-attention's kda_gate_bwd: (dg in g's dtype, dA_log in
    A_log's or None, ddt_bias in dt_bias's or None) for the gradient dyg of
    the gate (g's shape)."""
    op = "kda_gate_bwd"
    raw, a, b, lb, compute = _params(op, g, A_log, dt_bias, lower_bound)
    _check_tensor(dyg, "dyg", prefix=f"{op}: ")
    if tuple(dyg.shape) != tuple(g.shape):
        raise ValueError(f"{op}: dyg has shape {list(dyg.shape)}, expected g's {list(g.shape)}")
    with torch.no_grad():
        d = dyg.to(compute).contiguous()
        _kdacp.check_tensor(d.data_ptr(), list(d.shape), _DTYPES[compute], "dyg", "finite")
        _, tokens, h, kd = raw.shape
        name = _DTYPES[compute]
        dg, da, db = _kdacp.kda_gate(
            raw.data_ptr(), _DTYPES[raw.dtype], 0 if a is None else a.data_ptr(),
            name if a is None else _DTYPES[a.dtype], 0 if b is None else b.data_ptr(),
            name if b is None else _DTYPES[b.dtype], tokens, h, kd, lb, name, d.data_ptr())
        dg = _from_numpy(dg, raw.dtype).reshape(g.shape).to(g.dtype)
        da = None if da is None else _from_numpy(da, a.dtype).view(A_log.shape).to(A_log.dtype)
        db = None if db is None else _from_numpy(db, b.dtype).view(dt_bias.shape).to(dt_bias.dtype)
    return dg, da, db


def _chunk_rows(cu, b, t, chunk_size):
    """[(row, begin, end)] of every chunk: chunk_size tokens from each
    sequence's start (the last one shorter)."""
    seqs = [(0, cu[i], cu[i + 1]) for i in range(len(cu) - 1)] if cu is not None else \
        [(r, 0, t) for r in range(b)]
    return [(r, s, min(s + chunk_size, e)) for r, bos, e in seqs
            for s in range(bos, e, chunk_size)]


def kda_gate_chunk_cumsum(g, A_log, chunk_size, scale=None, dt_bias=None, cu_seqlens=None,
                          output_dtype=torch.float, chunk_indices=None, lower_bound=None,
                          use_graph=False, **kwargs):
    """flash-linear-attention's kda_gate_chunk_cumsum: the gate of g [B,T,H,K]
    summed over tokens within each chunk of chunk_size tokens of each
    sequence (cumulative, the chunk's first token first), times scale when
    given; output_dtype None: g's. Forward only. Tokens past cu_seqlens'
    end are 0. use_graph (CUDA graph capture there) changes nothing here."""
    op = "kda_gate_chunk_cumsum"
    if kwargs:
        raise NotImplementedError(f"kdacp.torch.{op} does not support {sorted(kwargs)}")
    _check_tensor(g, "g", prefix=f"{op}: ")
    if g.dim() != 4:
        raise FlaAssertionError(f"{op}: g has {g.dim()} dims, expected 4 ([B,T,H,K])")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1 or \
            chunk_size & (chunk_size - 1):
        raise FlaAssertionError(f"{op}: chunk_size={chunk_size!r}, expected a power of 2")
    if not isinstance(use_graph, bool):
        raise ValueError(f"{op}: use_graph={use_graph!r}, expected True or False")
    b, t = g.shape[0], g.shape[1]
    cu = None
    if cu_seqlens is not None:
        cu = cu_list(cu_seqlens, op)
        if b != 1:
            raise FlaAssertionError(f"{op}: cu_seqlens with batch B = {b}, expected B = 1")
        if len(cu) < 2 or cu[0] != 0 or any(y < x for x, y in zip(cu, cu[1:])) or cu[-1] > t:
            raise ValueError(f"{op}: cu_seqlens {cu}, expected non-decreasing from 0 to at most "
                             f"T = {t}")
    rows = _chunk_rows(cu, b, t, chunk_size)
    if chunk_indices is not None:
        if cu is None:
            raise ValueError(f"{op}: chunk_indices given without cu_seqlens")
        want = [[n, c] for n in range(len(cu) - 1)
                for c in range(-(-(cu[n + 1] - cu[n]) // chunk_size))]
        if torch.as_tensor(chunk_indices).tolist() != want:
            raise ValueError(f"{op}: chunk_indices differ from those of cu_seqlens and chunk_size "
                             f"({want})")
    if output_dtype is not None:
        _dtype(output_dtype, op)
    with torch.no_grad():
        gate = fused_kda_gate(g, A_log, dt_bias, lower_bound,
                              torch.float64 if g.dtype == torch.float64 else torch.float32)
        o = torch.zeros_like(gate)
        for r, s, e in rows:
            o[r, s:e] = gate[r, s:e].cumsum(0)
        if scale is not None:
            o = o * scale
        return o.to(output_dtype or g.dtype)
