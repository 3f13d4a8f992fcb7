"""PyTorch interface of kdacp (SPEC §11): the state exchange over a
torch.distributed group, the serial fold, and a differentiable CP KDA layer.

    import kdacp.torch as kt
    ex = kt.build_kda_state_cp(group=None, protocol="auto", allgather_group_size=1, **options)
    incoming   = ex.forward(state, matrix)        # [B,H,K,V], [B,H,K,K]
    final_grad = ex.backward(gradient, matrix)
    x = kt.merge_affine_summaries(states, matrices, rank, forward=True)
    o, ht = kt.kda(q, k, v, g, beta, ...)

Tensors are CPU float32 or float64. Inputs C++ can view (unit column stride,
batch stride = H x head stride) are used in place; others are copied once.
Results alias C++-owned memory (no copy). Invalid input raises ValueError
before anything is sent; a failed or silent peer raises RuntimeError naming
it within the timeout.
"""

import math

import torch
import torch.distributed as dist

from kdacp import _kdacp
from kdacp._comm import backend_for

__all__ = ["build_kda_state_cp", "merge_affine_summaries", "kda", "StateExchange"]

_DTYPES = {torch.float32: "float32", torch.float64: "float64"}
_DEFAULT_TIMEOUT_S = 60.0
_EXCHANGE_OPTIONS = ("memory_budget_bytes", "allow_reassociation", "segments", "calibration",
                     "expected_shape", "timeout", "threads", "check_ranks")


# -- tensors as C++ views ----------------------------------------------------

def _check_tensor(t, name, ndim):
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} is a {type(t).__name__}, expected a torch.Tensor")
    if t.device.type != "cpu":
        raise ValueError(f"{name} is on {t.device}, expected a CPU tensor")
    if t.dtype not in _DTYPES:
        raise ValueError(f"{name} has dtype {t.dtype}, expected torch.float32 or torch.float64")
    if t.dim() != ndim:
        raise ValueError(f"{name} has shape {list(t.shape)} ({t.dim()} dims), expected {ndim} dims")


def _viewable(t):
    """t itself when C++ can view it (unit column stride, batch stride = H x
    head stride, as SPEC §2 asks), else a contiguous copy."""
    s = t.stride()
    if t.dim() >= 4 and s[-1] == 1 and s[-4] == t.shape[-3] * s[-3] and t.storage_offset() >= 0:
        return t
    return t.contiguous()


def _desc(t):
    return (t.data_ptr(), tuple(t.shape), tuple(t.stride()), _DTYPES[t.dtype])


def _from_numpy(a):
    return None if a is None else torch.from_numpy(a)


def _parse_bytes(value):
    if isinstance(value, int) and value >= 0:
        return value
    if isinstance(value, str):
        units = {"": 1, "B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30,
                 "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9}
        text = value.strip()
        num = text.rstrip("KMGiB")
        unit = text[len(num):]
        if unit in units:
            try:
                return int(float(num) * units[unit])
            except ValueError:
                pass
    raise ValueError(f"memory_budget_bytes={value!r}, expected a non-negative int or a size "
                     "such as '64MiB'")


def _options(options, part_owners=(), expected=None, expected_dtype=None):
    unknown = sorted(set(options) - set(_EXCHANGE_OPTIONS))
    if unknown:
        raise TypeError(f"unknown exchange option(s) {unknown}, expected some of "
                        f"{list(_EXCHANGE_OPTIONS)}")
    shape = options.get("expected_shape", expected)
    if shape is not None:
        shape = [int(x) for x in shape]
    return _kdacp.make_options(
        segments=int(options.get("segments", 0)),
        memory_budget_bytes=_parse_bytes(options.get("memory_budget_bytes", 0)),
        allow_reassociation=bool(options.get("allow_reassociation", False)),
        calibration=str(options.get("calibration", "") or ""),
        expected_shape=shape,
        expected_dtype=expected_dtype,
        part_owners=list(part_owners))


def _threads(options):
    return int(options.get("threads", torch.get_num_threads()))


def _timeout(options):
    t = float(options.get("timeout", _DEFAULT_TIMEOUT_S))
    if not t > 0:
        raise ValueError(f"timeout={t}, expected seconds > 0")
    return t


def _agree(backend, row, what):
    """All-gathers an int64 row from every rank; raises ValueError on every
    rank when the rows differ (the mismatch is then known everywhere)."""
    mine = torch.tensor(row, dtype=torch.int64)
    table = torch.zeros(backend.size, mine.numel(), dtype=torch.int64)
    table[backend.rank] = mine
    try:
        backend.all_gather(table.view(torch.uint8).reshape(-1))
    except (TimeoutError, RuntimeError) as e:
        raise RuntimeError(f"rank {dist.get_rank()}: {what} check: {e}") from None
    return table.numpy()


# -- the exchange ---------------------------------------------------------------

class StateExchange:
    """One rank's state exchange over a torch group (build_kda_state_cp)."""

    def __init__(self, backend, protocol, group_size, options):
        self._backend = backend
        self._protocol = protocol
        self._group_size = group_size
        self._options = options
        self._check = bool(options.get("check_ranks", True))
        self._cpp = None
        if protocol != "auto" or "expected_shape" in options:
            self._build(None, None)

    def _build(self, shape, dtype):
        opts = _options(self._options, expected=shape, expected_dtype=dtype)
        self._cpp = _kdacp.Exchange(self._backend, self._protocol, int(self._group_size),
                                    opts, _threads(self._options))

    @property
    def method(self):
        """The protocol that runs ("auto" until an auto exchange without
        expected_shape has chosen at its first call)."""
        return self._cpp.method if self._cpp is not None else "auto"

    @property
    def exact(self):
        return self._cpp.exact if self._cpp is not None else None

    @property
    def segments(self):
        """Column segments in force (pipelined_p2p; 0: chosen per call)."""
        return self._cpp.segments if self._cpp is not None else 0

    @property
    def group_size(self):
        return self._cpp.group_size if self._cpp is not None else self._group_size

    @property
    def rank(self):
        return self._backend.rank

    @property
    def size(self):
        return self._backend.size

    def forward(self, state, matrix):
        """This rank's incoming state [B,H,K,V] from its summary: state S
        [B,H,K,V] and matrix M [B,H,K,K] (SPEC §3)."""
        return self._run(state, matrix, True, "state")

    def backward(self, gradient, matrix):
        """This rank's final-state gradient [B,H,K,V] from G [B,H,K,V] and the
        M the forward used (SPEC §4)."""
        return self._run(gradient, matrix, False, "gradient")

    def _run(self, offset, matrix, forward, name):
        _check_tensor(offset, name, 4)
        _check_tensor(matrix, "matrix", 4)
        if offset.dtype != matrix.dtype:
            raise ValueError(f"{name} is {offset.dtype} but matrix is {matrix.dtype}, "
                             "expected one dtype")
        b, h, k, v = offset.shape
        if tuple(matrix.shape) != (b, h, k, k):
            raise ValueError(f"matrix has shape {list(matrix.shape)}, expected "
                             f"[{b},{h},{k},{k}] to match {name} {list(offset.shape)}")
        if self._check:
            row = [int(forward), b, h, k, v, 8 if offset.dtype == torch.float64 else 4]
            table = _agree(self._backend, row, "exchange shape")
            if not (table == table[0]).all():
                raise ValueError(
                    f"rank {dist.get_rank()}: exchange {'forward' if forward else 'backward'} "
                    f"called with different shapes on the group's ranks: "
                    + ", ".join(f"global rank {g}: (dir, B, H, K, V, bytes)={list(r)}"
                                for g, r in zip(self._backend.global_ranks, table.tolist())))
        if self._cpp is None:
            self._build([b, h, k, v], _DTYPES[offset.dtype])
        with torch.no_grad():
            out = self._cpp.run(_desc(_viewable(offset.detach())),
                                _desc(_viewable(matrix.detach())), forward)
        return torch.from_numpy(out)


def build_kda_state_cp(group=None, protocol="auto", allgather_group_size=1, **options):
    """The kdacp state exchange over a torch.distributed group.

    group: a ProcessGroup (None: the default group); its ranks in group order
    are the chronological CP order. protocol: one of kdacp.exchange_methods().
    Collective over the group (and, for the grouped protocols, their split).

    options: memory_budget_bytes (int or '64MiB'), allow_reassociation,
    segments, calibration (a `kdacp calibrate` JSON file), expected_shape
    (B, H, K, V) for auto (without it, auto chooses at the first call),
    timeout (seconds, default 60: every wait on a peer), threads (default
    torch.get_num_threads()), check_ranks (default True: each call first
    checks that every rank passes the same shape, so a mismatch is a
    ValueError on every rank).
    """
    _options(options)  # rejects unknown options before anything is sent
    if not isinstance(protocol, str):
        raise ValueError(f"protocol={protocol!r}, expected one of {_kdacp.exchange_methods()}")
    if protocol not in _kdacp.exchange_methods():
        raise ValueError(f"unknown protocol '{protocol}', expected one of "
                         f"{_kdacp.exchange_methods()}")
    backend = backend_for(group, _timeout(options))
    return StateExchange(backend, protocol, allgather_group_size, dict(options))


def merge_affine_summaries(states, matrices, rank, forward=True):
    """The serial fold for one rank over stacked summaries: states (or
    gradients) [P,B,H,K,V] and matrices [P,B,H,K,K]. forward: incoming_rank =
    the chain over slots 0..rank-1 (SPEC §3); backward: the transposed chain
    over slots P-1 down to rank+1 (SPEC §4). The same operations in the same
    order as the chain, so exact protocols equal it bit for bit."""
    _check_tensor(states, "states", 5)
    _check_tensor(matrices, "matrices", 5)
    if states.dtype != matrices.dtype:
        raise ValueError(f"states are {states.dtype} but matrices are {matrices.dtype}, "
                         "expected one dtype")
    if not isinstance(rank, int) or isinstance(rank, bool):
        raise ValueError(f"rank={rank!r}, expected an int")
    if rank < 0 or rank >= states.shape[0]:
        raise ValueError(f"rank {rank}, expected 0 <= rank < P = {states.shape[0]}")
    s = states.detach()
    m = matrices.detach()
    if s.stride(-1) != 1:
        s = s.contiguous()
    if m.stride(-1) != 1:
        m = m.contiguous()
    return torch.from_numpy(_kdacp.merge_stacked(_desc(s), _desc(m), rank, bool(forward)))


# -- the KDA layer -------------------------------------------------------------

_LAYERS = {}
_LAYER_CACHE_SIZE = 16


def _zigzag_counts(tokens, ranks):
    parts = 2 * ranks
    base, extra = divmod(tokens, parts)
    sizes = [base + (1 if j < extra else 0) for j in range(parts)]
    return [sizes[r] + sizes[parts - 1 - r] for r in range(ranks)]


def _layer(backend, key, protocol, group_size, layout, counts, tokens, dtype, options,
           summary_shape=None):
    cached = _LAYERS.get(key)
    if cached is not None:
        return cached
    opts = _options(options, expected=summary_shape, expected_dtype=dtype)
    layer = _kdacp.KdaLayer(backend, protocol, int(group_size), layout, list(counts),
                            int(tokens), dtype, opts, _threads(options))
    if len(_LAYERS) >= _LAYER_CACHE_SIZE:
        _LAYERS.pop(next(iter(_LAYERS)))
    _LAYERS[key] = layer
    return layer


class _KdaFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, layer, shape, scale, cu, want_ht, algorithm, keep_forward, q, k, v, g, beta, h0):
        inputs = [t.data_ptr() for t in (q, k, v, g, beta)]
        h0_ptr = 0 if h0 is None else h0.data_ptr()
        o, ht, saved = layer.forward(inputs, shape, scale, cu, h0_ptr, want_ht, algorithm, keep_forward)
        ctx.layer, ctx.shape, ctx.scale, ctx.cu, ctx.want_ht = layer, shape, scale, cu, want_ht
        ctx.algorithm = algorithm
        ctx.kdacp_saved = saved  # the layer's Saved: M and the incoming state per part
        ctx.save_for_backward(q, k, v, g, beta, h0)
        o = torch.from_numpy(o)
        if want_ht:
            return o, torch.from_numpy(ht)
        empty = o.new_empty(0)
        ctx.mark_non_differentiable(empty)
        return o, empty

    @staticmethod
    def backward(ctx, d_o, d_ht):
        q, k, v, g, beta, h0 = ctx.saved_tensors
        if d_o is None:
            d_o = torch.zeros(ctx.shape[0], ctx.shape[1], ctx.shape[3], ctx.shape[5], dtype=q.dtype)
        d_o = d_o.contiguous()
        dht_ptr = 0
        if ctx.want_ht:
            # Every rank passes dht (zeros when its loss does not use ht): the
            # layer gathers them collectively.
            if d_ht is None:
                d_ht = torch.zeros_like(h0) if h0 is not None else None
            if d_ht is None:
                n = (len(ctx.cu) - 1) if ctx.cu is not None else ctx.shape[0]
                d_ht = torch.zeros(n, ctx.shape[3], ctx.shape[4], ctx.shape[5], dtype=q.dtype)
            d_ht = d_ht.contiguous()
            dht_ptr = d_ht.data_ptr()
        inputs = [t.data_ptr() for t in (q, k, v, g, beta)]
        h0_ptr = 0 if h0 is None else h0.data_ptr()
        dq, dk, dv, dg, dbeta, dh0 = ctx.layer.backward(
            ctx.kdacp_saved, inputs, ctx.shape, ctx.scale, ctx.cu, h0_ptr, d_o.data_ptr(),
            dht_ptr, h0 is not None, ctx.algorithm)
        return (None, None, None, None, None, None, None, torch.from_numpy(dq), torch.from_numpy(dk),
                torch.from_numpy(dv), torch.from_numpy(dg), torch.from_numpy(dbeta),
                _from_numpy(dh0))


def _check_kda(q, k, v, g, beta, initial_state, cu_seqlens):
    for t, name, nd in ((q, "q", 4), (k, "k", 4), (v, "v", 4), (g, "g", 4), (beta, "beta", 3)):
        _check_tensor(t, name, nd)
    dtype = q.dtype
    for t, name in ((k, "k"), (v, "v"), (g, "g"), (beta, "beta")):
        if t.dtype != dtype:
            raise ValueError(f"{name} has dtype {t.dtype}, expected q's {dtype}")
    b, t_, h, kd = q.shape
    if tuple(k.shape) != (b, t_, h, kd):
        raise ValueError(f"k has shape {list(k.shape)}, expected q's {list(q.shape)} ([B,T,H,K])")
    if v.shape[0] != b or v.shape[1] != t_:
        raise ValueError(f"v has shape {list(v.shape)}, expected [{b},{t_},HV,V]")
    hv, vd = v.shape[2], v.shape[3]
    if hv == 0 or h == 0 or hv % h != 0:
        raise ValueError(f"v has {hv} value heads, expected a positive multiple of q's {h} heads")
    if tuple(g.shape) != (b, t_, hv, kd):
        raise ValueError(f"g has shape {list(g.shape)}, expected [{b},{t_},{hv},{kd}] ([B,T,HV,K])")
    if tuple(beta.shape) != (b, t_, hv):
        raise ValueError(f"beta has shape {list(beta.shape)}, expected [{b},{t_},{hv}] ([B,T,HV])")
    cu = None
    if cu_seqlens is not None:
        if isinstance(cu_seqlens, torch.Tensor):
            if cu_seqlens.dtype not in (torch.int32, torch.int64) or cu_seqlens.dim() != 1:
                raise ValueError(f"cu_seqlens is {cu_seqlens.dtype} with {cu_seqlens.dim()} dims, "
                                 "expected a 1-D int32 or int64 tensor")
            cu = [int(x) for x in cu_seqlens.tolist()]
        else:
            cu = [int(x) for x in cu_seqlens]
        if len(cu) < 2:
            raise ValueError(f"cu_seqlens has {len(cu)} entries, expected at least 2")
        if b != 1:
            raise ValueError(f"cu_seqlens given with batch {b}, expected B = 1 (packed sequences)")
    if initial_state is not None:
        _check_tensor(initial_state, "initial_state", 4)
        if initial_state.dtype != dtype:
            raise ValueError(f"initial_state has dtype {initial_state.dtype}, expected {dtype}")
        if tuple(initial_state.shape[1:]) != (hv, kd, vd):
            raise ValueError(f"initial_state has shape {list(initial_state.shape)}, expected "
                             f"[N,{hv},{kd},{vd}] ([N,HV,K,V])")
    return (b, t_, h, hv, kd, vd), cu


_ALGORITHMS = ("recurrent", "chunk")


def kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
        cu_seqlens=None, group=None, layout="contiguous", protocol="auto",
        allgather_group_size=1, algorithm="chunk", keep_forward=False, **options):
    """Kimi Delta Attention over this rank's tokens (SPEC §9-§11).

    q, k [B,T,H,K]; v [B,T,HV,V]; g [B,T,HV,K] (log decay, <= 0); beta
    [B,T,HV]; float32 or float64 CPU tensors (flash-linear-attention layout).
    scale None: 1/sqrt(K). initial_state h0 [N,HV,K,V]; cu_seqlens: N packed
    sequences (B = 1), global, identical on every rank. group None: one
    process, the whole stream local. Otherwise the group's ranks in group
    order are the CP order and the local tensors are this rank's tokens: with
    layout "contiguous" rank r holds the r-th run of tokens (any lengths),
    with "zigzag" parts r and 2P-1-r concatenated. Returns (o [B,T,HV,V], ht
    [N,HV,K,V] or None); ht, when requested, is complete on every rank.
    Differentiable w.r.t. q, k, v, g, beta and initial_state. Every rank must
    call kda, and its backward, in the same order. algorithm: "chunk"
    (the default: chunkwise WY form, chunks of 64 tokens) or "recurrent"
    (token by token, the reference); the same results up to rounding, the same on every rank of a
    group. keep_forward: with "chunk", the forward keeps what its backward
    would recompute (about 1.25x the local q, k, v, g at K = V = 128) in the
    autograd context, for a faster backward; the same results either way.
    options: as build_kda_state_cp.
    """
    shape, cu = _check_kda(q, k, v, g, beta, initial_state, cu_seqlens)
    b, t_local, h, hv, kd, vd = shape
    if scale is None:
        scale = 1.0 / math.sqrt(kd)
    scale = float(scale)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale={scale}, expected a finite value > 0")
    if layout not in ("contiguous", "zigzag"):
        raise ValueError(f"layout '{layout}', expected 'contiguous' or 'zigzag'")
    if not isinstance(algorithm, str) or algorithm not in _ALGORITHMS:
        raise ValueError(f"algorithm={algorithm!r}, expected 'recurrent' or 'chunk'")
    if not isinstance(keep_forward, bool):
        raise ValueError(f"keep_forward={keep_forward!r}, expected True or False")
    _options(options)
    dtype = _DTYPES[q.dtype]
    n_seq = (len(cu) - 1) if cu is not None else b
    if initial_state is not None and initial_state.shape[0] != n_seq:
        raise ValueError(f"initial_state has {initial_state.shape[0]} sequences, expected "
                         f"N = {n_seq}")
    threads = _threads(options)
    if group is None:
        if layout != "contiguous":
            raise ValueError("layout 'zigzag' needs a group (group=None runs one process)")
        key = ("single", dtype, threads)
        layer = _layer(None, key, "none", 1, layout, [], t_local, dtype, options)
    else:
        if protocol not in _kdacp.exchange_methods():
            raise ValueError(f"unknown protocol '{protocol}', expected one of "
                             f"{_kdacp.exchange_methods()}")
        backend = _group_backend(group, _timeout(options))
        cu_sum = sum(cu) if cu is not None else -1
        cu_wsum = sum(i * c for i, c in enumerate(cu)) if cu is not None else -1
        row = [b, h, hv, kd, vd, 8 if dtype == "float64" else 4,
               int(initial_state is not None), int(bool(output_final_state)),
               -1 if cu is None else len(cu), cu_sum, cu_wsum, _ALGORITHMS.index(algorithm), t_local]
        table = _agree(backend, row, "kda shape")
        if not (table[:, :-1] == table[0, :-1]).all():
            raise ValueError(
                f"rank {dist.get_rank()}: kda called with different arguments on the group's "
                "ranks: " + ", ".join(
                    f"global rank {gr}: (B, H, HV, K, V, bytes, h0, ht, len(cu), sums, algorithm)="
                    f"{list(r[:-1])}"
                    for gr, r in zip(backend.global_ranks, table.tolist())))
        counts = [int(x) for x in table[:, -1]]
        tokens = sum(counts)
        if layout == "zigzag":
            want = _zigzag_counts(tokens, backend.size)
            if counts != want:
                raise ValueError(f"rank {dist.get_rank()}: zigzag over {backend.size} ranks of "
                                 f"{tokens} tokens holds {want} tokens per rank, got {counts}")
        key = (id(backend), protocol, int(allgather_group_size), layout, tuple(counts), dtype,
               tuple(sorted((k_, repr(v_)) for k_, v_ in options.items())))
        key = key + ((b, hv, kd, vd),)
        layer = _layer(backend, key, protocol, allgather_group_size, layout, counts, tokens,
                       dtype, options, summary_shape=(b, hv, kd, vd))
    qc, kc, vc, gc, bc = (t.contiguous() for t in (q, k, v, g, beta))
    h0 = initial_state.contiguous() if initial_state is not None else None
    o, ht = _KdaFunction.apply(layer, list(shape), scale, cu, bool(output_final_state), algorithm,
                               bool(keep_forward), qc, kc, vc, gc, bc, h0)
    return o, (ht if output_final_state else None)


_BACKENDS = {}


def _group_backend(group, timeout_s):
    """One backend per (group, timeout), reused across kda calls, so the
    layers cached for it stay valid. Collective on first use."""
    key = (id(group) if group is not None else None, timeout_s)
    entry = _BACKENDS.get(key)
    if entry is not None and entry[0] is (group if group is not None else dist.group.WORLD):
        return entry[1]
    backend = backend_for(group, timeout_s)
    _BACKENDS[key] = (group if group is not None else dist.group.WORLD, backend)
    return backend
