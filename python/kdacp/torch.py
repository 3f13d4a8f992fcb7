"""PyTorch interface of kdacp (SPEC §11): the state exchange over a
torch.distributed group, the serial fold, and a differentiable CP KDA layer.

    import kdacp.torch as kt
    ex = kt.build_kda_state_cp(group=None, protocol="auto", allgather_group_size=1, **options)
    incoming   = ex.forward(state, matrix)        # [B,H,K,V], [B,H,K,K]
    final_grad = ex.backward(gradient, matrix)
    x = kt.merge_affine_summaries(states, matrices, rank, forward=True)
    o, ht = kt.kda(q, k, v, g, beta, ...)
    ctx = kt.build_cp_context(cu_seqlens, group, ...)        # once per batch
    o, ht = kt.chunk_kda(q, k, v, g, beta, ..., cp_context=ctx)  # flash-linear-attention's op

Tensors are CPU float32 or float64. Inputs C++ can view (unit column stride,
batch stride = H x head stride) are used in place; others are copied once.
Results alias C++-owned memory (no copy). Invalid input raises ValueError
before anything is sent (kda's values by the C++ validator the CLI uses, with
its messages); arguments that differ between ranks raise ValueError on every
rank naming them; a failed or silent peer raises RuntimeError naming it
within the timeout; a non-finite kda result raises RuntimeError naming it.
"""

import hashlib
import math
import numbers
import operator
import struct

import torch
import torch.distributed as dist

from kdacp import _kdacp
from kdacp._autograd import cu_list, first_order
from kdacp._conv import causal_conv1d
from kdacp._comm import backend_for, check_group

__all__ = ["build_kda_state_cp", "merge_affine_summaries", "kda", "StateExchange",
           "SINGLE_PROCESS", "chunk_kda", "build_cp_context", "CpContext", "causal_conv1d"]


class _SingleProcess:
    """kda's default group: one process, the whole stream local. Distinct
    from None, which torch.distributed.group.WORLD also is before
    init_process_group and after destroy_process_group."""

    def __repr__(self):
        return "kdacp.torch.SINGLE_PROCESS"


SINGLE_PROCESS = _SingleProcess()

_DTYPES = {torch.float32: "float32", torch.float64: "float64"}
# kdacp/defaults.hpp, the library's and the CLI's: algorithm, keep_forward, timeout.
_DEFAULTS = _kdacp.defaults()
_DEFAULT_TIMEOUT_S = _DEFAULTS["timeout"]
_EXCHANGE_OPTIONS = ("memory_budget_bytes", "allow_reassociation", "segments", "calibration",
                     "expected_shape", "timeout", "threads", "check_ranks")


# -- tensors as C++ views ----------------------------------------------------

def _check_tensor(t, name, ndim=None):
    """A CPU float32/float64 tensor (with ndim dims unless None), or ValueError
    naming it."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} is a {type(t).__name__}, expected a torch.Tensor")
    if t.device.type != "cpu":
        raise ValueError(f"{name} is on {t.device}, expected a CPU tensor")
    if t.dtype not in _DTYPES:
        raise ValueError(f"{name} has dtype {t.dtype}, expected torch.float32 or torch.float64")
    if ndim is not None and t.dim() != ndim:
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


def _integer(value, name, lo, hi):
    """An int option in [lo, hi], checked by the CLI's parser (kdacp/units.hpp):
    ValueError naming the option for anything else (bool, float, str, out of range)."""
    if isinstance(value, bool):
        raise ValueError(f"{name}={value!r}, expected an integer in [{lo}, {hi}]")
    try:
        value = operator.index(value)
    except TypeError:
        raise ValueError(f"{name}={value!r}, expected an integer in [{lo}, {hi}]") from None
    return _kdacp.parse_integer(str(value), name, lo, hi)


def _parse_bytes(value):
    """memory_budget_bytes: 0 or None (no budget), a positive int, or a size
    such as '64MiB', read by the CLI's --memory-budget parser (kdacp/units.hpp)."""
    name = "memory_budget_bytes"
    if value is None or (type(value) is int and value == 0):
        return 0
    if isinstance(value, bool) or not isinstance(value, (numbers.Integral, str)):
        raise ValueError(f"{name}={value!r}, expected 0 (no budget), a positive int or a size "
                         "such as '64MiB'")
    return _kdacp.parse_bytes(str(operator.index(value)) if not isinstance(value, str) else value,
                              name)


def _options(options, expected=None, expected_dtype=None):
    unknown = sorted(set(options) - set(_EXCHANGE_OPTIONS))
    if unknown:
        raise TypeError(f"unknown exchange option(s) {unknown}, expected some of "
                        f"{list(_EXCHANGE_OPTIONS)}")
    shape = options.get("expected_shape", expected)
    if shape is not None:
        if isinstance(shape, (str, bytes)) or not hasattr(shape, "__len__"):
            raise ValueError(f"expected_shape={shape!r}, expected (B, H, K, V)")
        shape = [_integer(x, "expected_shape", 1, 1 << 32) for x in shape]
    for flag in ("allow_reassociation", "check_ranks"):
        if flag in options and not isinstance(options[flag], bool):
            raise ValueError(f"{flag}={options[flag]!r}, expected True or False")
    calibration = options.get("calibration", "")
    if calibration is None:
        calibration = ""
    if not isinstance(calibration, str):
        raise ValueError(f"calibration={calibration!r}, expected the path of a "
                         "`kdacp calibrate` JSON file")
    return _kdacp.make_options(
        segments=_segments(options),
        memory_budget_bytes=_parse_bytes(options.get("memory_budget_bytes", 0)),
        allow_reassociation=bool(options.get("allow_reassociation", False)),
        calibration=calibration,
        expected_shape=shape,
        expected_dtype=expected_dtype)


def _segments(options):
    return _integer(options.get("segments", 0), "segments", *_kdacp.segments_range)


def _threads(options):
    """threads: the C++ pool's size, in the CLI's --threads range; 0 or
    absent: torch.get_num_threads() (capped at the range's top)."""
    lo, hi = _kdacp.threads_range
    n = _integer(options.get("threads", 0), "threads", lo, hi)
    return n if n > 0 else max(1, min(torch.get_num_threads(), hi))


def _timeout(options):
    """timeout: seconds, a finite number in (0, one day], read by the CLI's
    --timeout parser (kdacp/units.hpp)."""
    t = options.get("timeout", _DEFAULT_TIMEOUT_S)
    if isinstance(t, bool) or not isinstance(t, (numbers.Real, str)):
        raise ValueError(f"timeout={t!r}, expected seconds: a finite number > 0")
    if isinstance(t, numbers.Integral):
        text = str(operator.index(t))
    elif isinstance(t, str):
        text = t
    else:
        text = repr(float(t))
    return _kdacp.parse_timeout(text, "timeout")


def _group_size(value):
    return _integer(value, "allgather_group_size", 1, 1 << 31)


def _agree(backend, row, what):
    """All-gathers an int64 row from every rank (one fixed-size collective,
    bounded by the backend's timeout); returns the [size, len(row)] table."""
    mine = torch.tensor(row, dtype=torch.int64)
    table = torch.zeros(backend.size, mine.numel(), dtype=torch.int64)
    table[backend.rank] = mine
    try:
        backend.all_gather(table.view(torch.uint8).reshape(-1))
    except (TimeoutError, RuntimeError) as e:
        raise RuntimeError(f"rank {dist.get_rank()}: {what} check: {e}") from None
    return table.numpy()


def _digest(*parts):
    """A signed 64-bit hash of the exact bytes of `parts` (bytes, or text)."""
    h = hashlib.blake2b(digest_size=8)
    for p in parts:
        b = p if isinstance(p, bytes) else repr(p).encode()
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return int.from_bytes(h.digest(), "little", signed=True)


def _float_bits(x):
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _bits_float(b):
    return struct.unpack("<d", struct.pack("<q", int(b)))[0]


class _Fingerprint:
    """The arguments every rank must pass alike, as one fixed-size int64 row:
    (name, value, shown) per argument, where shown(value) prints it (None:
    a hash, printed as such). ok=False marks a rank whose own checks failed:
    its error is raised on it, and its peers name it, instead of them waiting
    for it in the next collective."""

    def __init__(self, fields):
        # Every rank sends a row of the same length, whatever its own checks
        # found (a shorter row would abort the process inside gloo).
        self.fields = tuple(fields)
        self.names, self.values, self.shows = [], [], []

    def add(self, name, value, show=str):
        assert name == self.fields[len(self.names)], (name, self.fields)
        self.names.append(name)
        self.values.append(int(value))
        self.shows.append(show)

    def add_hash(self, name, *parts):
        self.add(name, _digest(*parts), None)

    def check(self, backend, what, ok=True, error=None, extra=()):
        """Gathers [ok] + fingerprint + extra (per-rank values, not compared)
        from every rank. Raises on every rank: `error` on the ranks that
        failed their own checks, ValueError naming them on the others, and
        ValueError naming each argument that differs and which global ranks
        hold which value. Returns the gathered `extra` columns."""
        if ok:
            assert len(self.values) == len(self.fields), (self.names, self.fields)
        row = [int(ok)] + (self.values if ok else [0] * len(self.fields)) + \
            [int(x) for x in extra]
        table = _agree(backend, row, what)
        ranks = backend.global_ranks
        me = dist.get_rank()
        if error is not None:
            raise error
        bad = [ranks[j] for j in range(backend.size) if not table[j, 0]]
        if bad:
            raise ValueError(f"rank {me}: {what}: global rank(s) {bad} rejected their own "
                             "arguments (their error says why); nothing was sent")
        diffs = []
        for c, (name, show) in enumerate(zip(self.names, self.shows)):
            col = table[:, 1 + c]
            if (col == col[0]).all():
                continue
            groups = {}
            for j, x in enumerate(col.tolist()):
                groups.setdefault(x, []).append(ranks[j])
            diffs.append(f"{name} differs: " + "; ".join(
                f"global rank(s) {g}" + ("" if show is None else f": {show(x)}")
                for x, g in groups.items()))
        if diffs:
            raise ValueError(f"rank {me}: {what} called with different arguments on the "
                             "group's ranks: " + "; ".join(diffs) + " (every rank must pass the same)")
        return table[:, 1 + len(self.fields):]


_OPTION_FIELDS = ("protocol", "allgather_group_size", "segments", "memory_budget_bytes",
                  "allow_reassociation", "calibration", "expected_shape", "timeout")
_KDA_FIELDS = ("B", "H", "HV", "K", "V", "dtype", "scale", "algorithm", "layout",
               "initial_state given", "output_final_state", "cu_seqlens length",
               "cu_seqlens") + _OPTION_FIELDS
_SHAPE_FIELDS = ("direction", "B", "H", "K", "V", "dtype")


def _options_fingerprint(fp, options, protocol, group_size, timeout_s):
    """The exchange's arguments that must match: protocol, width, options that
    shape the messages, timeout (threads and check_ranks are per-rank)."""
    fp.add_hash("protocol", protocol)
    fp.add("allgather_group_size", group_size)
    fp.add("segments", _segments(options))
    budget = _parse_bytes(options.get("memory_budget_bytes", 0))  # < 2^64: as signed bits
    fp.add("memory_budget_bytes", budget - (1 << 64) if budget >= 1 << 63 else budget,
           lambda b: str(b % (1 << 64)))
    fp.add("allow_reassociation", bool(options.get("allow_reassociation", False)))
    fp.add_hash("calibration", options.get("calibration", "") or "")
    shape = options.get("expected_shape")
    fp.add_hash("expected_shape", None if shape is None else [int(x) for x in shape])
    fp.add("timeout", _float_bits(timeout_s), lambda b: f"{_bits_float(b)!r} s")


# -- the exchange ---------------------------------------------------------------

class StateExchange:
    """One rank's state exchange over a torch group (build_kda_state_cp)."""

    def __init__(self, backend, protocol, group_size, options):
        self._backend = backend
        self._protocol = protocol
        self._options = options
        self._cpp = None
        # Local checks, then one fixed-size collective: every rank learns
        # whether all ranks passed the same protocol, width, options and
        # timeout before anything that depends on them runs (a split, a
        # protocol's first message).
        fp = _Fingerprint(_OPTION_FIELDS)
        error = None
        try:
            self._group_size = _group_size(group_size)
            _options(options)
            self._check = bool(options.get("check_ranks", True))
            _options_fingerprint(fp, options, protocol, self._group_size, backend.timeout_s)
        except (ValueError, TypeError) as e:
            error = e
        fp.check(backend, "build_kda_state_cp", ok=error is None, error=error)
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
        if torch.is_grad_enabled() and (offset.requires_grad or matrix.requires_grad):
            raise ValueError(
                f"{name if offset.requires_grad else 'matrix'} requires grad: the exchange is "
                "not differentiable (its result would silently carry no gradient); detach the "
                "inputs, and use StateExchange.backward for the adjoint")
        if self._check:
            fp = _Fingerprint(_SHAPE_FIELDS)
            fp.add("direction", int(forward), lambda x: "forward" if x else "backward")
            for dim, n in zip("BHKV", (b, h, k, v)):
                fp.add(dim, n)
            fp.add("dtype", 8 if offset.dtype == torch.float64 else 4,
                   lambda x: "float64" if x == 8 else "float32")
            fp.check(self._backend, f"exchange {'forward' if forward else 'backward'} "
                     "(different shapes)")
        if self._cpp is None:
            self._build([b, h, k, v], _DTYPES[offset.dtype])
        with torch.no_grad():
            out = self._cpp.run(_desc(_viewable(offset.detach())),
                                _desc(_viewable(matrix.detach())), forward)
        return torch.from_numpy(out)


def build_kda_state_cp(group=None, protocol="auto", allgather_group_size=1, **options):
    """The kdacp state exchange over a torch.distributed group.

    group: a live ProcessGroup (None: the default group, which must be
    initialised); its ranks in group order are the chronological CP order.
    protocol: one of kdacp.exchange_methods(). Collective over the group (and,
    for the grouped protocols, their split): the ranks first compare protocol,
    allgather_group_size, the options and timeout (ValueError on every rank
    naming what differs and the ranks).

    options (ValueError naming the option when out of range, from the CLI's
    parsers): memory_budget_bytes (0/None: no budget, a positive int or
    '64MiB'), allow_reassociation, segments (0..16), calibration (a `kdacp
    calibrate` JSON file), expected_shape (B, H, K, V) for auto (without it,
    auto chooses at the first call), timeout (seconds in (0, 86400], default
    kdacp.defaults()["timeout"], 120: every wait on a peer, the first gather over the group included),
    threads (0..1024; 0 or absent: torch.get_num_threads()), check_ranks
    (default True: each call first checks that every rank passes the same
    direction and shape, so a mismatch is a ValueError on every rank).
    The exchange is not differentiable: a state or matrix that requires grad
    (with grad mode on) is a ValueError.
    """
    _options(options)  # rejects unknown options before anything is sent
    if not isinstance(protocol, str):
        raise ValueError(f"protocol={protocol!r}, expected one of {_kdacp.exchange_methods()}")
    if protocol not in _kdacp.exchange_methods():
        raise ValueError(f"unknown protocol '{protocol}', expected one of "
                         f"{_kdacp.exchange_methods()}")
    _group_size(allgather_group_size)
    _threads(options)
    timeout_s = _timeout(options)
    try:
        backend = backend_for(group, timeout_s)
    except TimeoutError as e:
        raise RuntimeError(str(e)) from None
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


def _layout(layout, counts):
    """The C++ layout (kdacp/layout.hpp) of ranks holding `counts` tokens:
    "contiguous" with those counts, or "zigzag", whose rule lives in C++
    alone; zigzag's per-rank token counts must then be its own."""
    ranks, tokens = len(counts), sum(counts)
    if layout == "contiguous":
        return _kdacp.Layout.contiguous(tokens, ranks, counts)
    built = _kdacp.Layout.zigzag(tokens, ranks)
    want = [built.local_tokens(r) for r in range(ranks)]
    if counts != want:
        raise ValueError(f"rank {dist.get_rank()}: zigzag over {ranks} ranks of "
                         f"{tokens} tokens holds {want} tokens per rank, got {counts}")
    return built


def _layer(backend, key, protocol, group_size, layout, dtype, options, summary_shape=None):
    cached = _LAYERS.get(key)
    if cached is not None:
        return cached
    opts = _options(options, expected=summary_shape, expected_dtype=dtype)
    layer = _kdacp.KdaLayer(backend, protocol, int(group_size), layout, dtype, opts,
                            _threads(options))
    if len(_LAYERS) >= _LAYER_CACHE_SIZE:
        _LAYERS.pop(next(iter(_LAYERS)))
    _LAYERS[key] = layer
    return layer


def _require_finite_result(t, name, what):
    """RuntimeError naming the tensor, its first non-finite element and value
    when a forward or backward produced one from finite inputs (the C++
    validator's scan, without the GIL: faster than torch.isfinite().all())."""
    if t is None:
        return
    try:
        _kdacp.check_tensor(t.data_ptr(), list(t.shape), _DTYPES[t.dtype], name, "finite")
    except ValueError as e:
        raise RuntimeError(f"kdacp.torch.kda: the {what} produced a non-finite value from "
                           f"finite inputs: {e}") from None


def _check_input(t, name, rule):
    """kdacp/finite.hpp's rules on a contiguous tensor: the CLI's messages."""
    _kdacp.check_tensor(t.data_ptr(), list(t.shape), _DTYPES[t.dtype], name, rule)


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
        ht = torch.from_numpy(ht) if want_ht else None
        _require_finite_result(o, "o", "forward")
        _require_finite_result(ht, "ht", "forward")
        if want_ht:
            return o, ht
        empty = o.new_empty(0)
        ctx.mark_non_differentiable(empty)
        return o, empty

    @staticmethod
    def backward(ctx, d_o, d_ht):
        q, k, v, g, beta, h0 = ctx.saved_tensors
        with torch.no_grad():
            grads = _KdaFunction._backward(ctx, q, k, v, g, beta, h0, d_o, d_ht)
        # create_graph=True: the C++ backward is not itself differentiable, so
        # a backward through these gradients raises instead of silently
        # dropping kda's second-order part.
        grads = first_order("kda", grads, (q, k, v, g, beta, h0))
        return (None, None, None, None, None, None, None) + tuple(grads)

    @staticmethod
    def _backward(ctx, q, k, v, g, beta, h0, d_o, d_ht):
        if d_o is None:
            d_o = torch.zeros(ctx.shape[0], ctx.shape[1], ctx.shape[3], ctx.shape[5], dtype=q.dtype)
        d_o = d_o.contiguous()
        _check_input(d_o, "the gradient of o", "finite")
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
            _check_input(d_ht, "the gradient of ht", "finite")
            dht_ptr = d_ht.data_ptr()
        inputs = [t.data_ptr() for t in (q, k, v, g, beta)]
        h0_ptr = 0 if h0 is None else h0.data_ptr()
        grads = ctx.layer.backward(
            ctx.kdacp_saved, inputs, ctx.shape, ctx.scale, ctx.cu, h0_ptr, d_o.data_ptr(),
            dht_ptr, h0 is not None, ctx.algorithm)
        grads = [_from_numpy(x) for x in grads]
        for name, x in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), grads):
            _require_finite_result(x, name, "backward")
        return grads


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
        cu = cu_list(cu_seqlens)
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
_LAYOUTS = ("contiguous", "zigzag")


def _check_arguments(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                     layout, algorithm, keep_forward, options):
    """Every local check of kda's arguments (no message sent): the shapes,
    the options, then the values (finite inputs, g <= 0, beta in [0, 1], by
    the C++ validator the CLI uses). Returns what kda runs with."""
    shape, cu = _check_kda(q, k, v, g, beta, initial_state, cu_seqlens)
    b, t_local, h, hv, kd, vd = shape
    if scale is None:
        scale = 1.0 / math.sqrt(kd)
    if isinstance(scale, torch.Tensor) and scale.numel() == 1 and not scale.requires_grad:
        scale = scale.item()
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise ValueError(f"scale={scale!r}, expected a finite number > 0")
    scale = float(scale)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale={scale}, expected a finite value > 0")
    if layout not in _LAYOUTS:
        raise ValueError(f"layout '{layout}', expected 'contiguous' or 'zigzag'")
    if not isinstance(algorithm, str) or algorithm not in _ALGORITHMS:
        raise ValueError(f"algorithm={algorithm!r}, expected 'recurrent' or 'chunk'")
    if not isinstance(keep_forward, bool):
        raise ValueError(f"keep_forward={keep_forward!r}, expected True or False")
    if not isinstance(output_final_state, bool):
        raise ValueError(f"output_final_state={output_final_state!r}, expected True or False")
    _options(options)
    _timeout(options)
    threads = _threads(options)
    n_seq = (len(cu) - 1) if cu is not None else b
    if initial_state is not None and initial_state.shape[0] != n_seq:
        raise ValueError(f"initial_state has {initial_state.shape[0]} sequences, expected "
                         f"N = {n_seq}")
    tensors = [t.contiguous() for t in (q, k, v, g, beta)]
    h0 = initial_state.contiguous() if initial_state is not None else None
    for t, name in zip(tensors[:3], ("q", "k", "v")):
        _check_input(t, name, "finite")
    _check_input(tensors[3], "g", "gate")
    _check_input(tensors[4], "beta", "beta")
    if h0 is not None:
        _check_input(h0, "initial_state", "finite")
    return shape, cu, scale, threads, tensors, h0


def kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
        cu_seqlens=None, group=SINGLE_PROCESS, layout="contiguous", protocol="auto",
        allgather_group_size=1, algorithm=_DEFAULTS["algorithm"],
        keep_forward=_DEFAULTS["keep_forward"], cp_context=None, **options):
    """Kimi Delta Attention over this rank's tokens (SPEC §9-§11).

    q, k [B,T,H,K]; v [B,T,HV,V]; g [B,T,HV,K] (log decay, <= 0); beta
    [B,T,HV]; float32 or float64 CPU tensors (flash-linear-attention layout),
    finite, with g <= 0 and beta in [0, 1] (ValueError naming the first bad
    element otherwise, the CLI's message). scale None: 1/sqrt(K).
    initial_state h0 [N,HV,K,V]; cu_seqlens: N packed sequences (B = 1),
    integers, global, identical on every rank. group omitted
    (SINGLE_PROCESS): one process, the whole stream local. Otherwise a live
    torch.distributed group (None is an error: pass
    torch.distributed.group.WORLD or a new_group); the group's ranks in group order are the CP order and the
    local tensors are this rank's tokens: with layout "contiguous" rank r
    holds the r-th run of tokens (any lengths), with "zigzag" parts r and
    2P-1-r concatenated. Before any other message the ranks compare every
    argument that must match (ValueError on every rank naming it and the
    ranks that differ). Returns (o [B,T,HV,V], ht [N,HV,K,V] or None); ht,
    when requested, is complete on every rank. Differentiable (once) w.r.t.
    q, k, v, g, beta and initial_state; a double backward raises. A
    non-finite o, ht or gradient raises RuntimeError naming it. Every rank
    must call kda, and its backward, in the same order. algorithm: "chunk"
    (the default: chunkwise WY form, chunks of 64 tokens) or "recurrent"
    (token by token, the reference); the same results up to rounding, the
    same on every rank of a group. keep_forward (default True, as
    kdacp.defaults() says): with "chunk", the forward keeps what its backward
    would recompute (about 1.25x the local q, k, v, g at K = V = 128) in the
    autograd context, for a faster backward; False saves that memory (a
    forward without backward, or memory short); the same results either way. options: as build_kda_state_cp.
    cp_context: a CpContext (build_cp_context) instead of group, layout,
    protocol, allgather_group_size and options: no agreement message per
    call (chunk_kda's path, without its transforms).
    """
    if cp_context is not None:
        if not isinstance(cp_context, CpContext):
            raise ValueError(f"cp_context is a {type(cp_context).__name__}, expected a "
                             "kdacp.torch.CpContext (build_cp_context)")
        if group is not SINGLE_PROCESS or layout != "contiguous" or protocol != "auto" or \
                allgather_group_size != 1 or options:
            raise ValueError("kda: cp_context given with group, layout, protocol, "
                             "allgather_group_size or options: the context holds them")
        return cp_context._kda(q, k, v, g, beta, scale, initial_state, output_final_state,
                               cu_seqlens, algorithm, keep_forward, dict(_NO_TRANSFORMS))
    if group is SINGLE_PROCESS:
        shape, cu, scale, threads, tensors, h0 = _check_arguments(
            q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, layout,
            algorithm, keep_forward, options)
        if layout != "contiguous":
            raise ValueError("layout 'zigzag' needs a group (without one kda runs one process)")
        dtype = _DTYPES[q.dtype]
        key = ("single", dtype, threads)
        layer = _layer(None, key, "none", 1, None, dtype, options)
    else:
        # The group and timeout first (a rank that cannot reach its peers
        # cannot tell them why); every other check runs locally and its
        # outcome travels in the agreement row, so a rank with a bad argument
        # raises its own error and its peers name it, none waits for it.
        if group is None:
            raise ValueError(
                "kda: group=None, expected a process group: torch.distributed.group.WORLD is "
                "None before init_process_group and after destroy_process_group, so None "
                "cannot mean the default group here; omit group (or pass "
                "kdacp.torch.SINGLE_PROCESS) to run one process")
        check_group(group)
        backend = _group_backend(group, _timeout(options))
        fp = _Fingerprint(_KDA_FIELDS)
        error = None
        t_local = 0
        try:
            if not isinstance(protocol, str) or protocol not in _kdacp.exchange_methods():
                raise ValueError(f"unknown protocol {protocol!r}, expected one of "
                                 f"{_kdacp.exchange_methods()}")
            width = _group_size(allgather_group_size)
            shape, cu, scale, threads, tensors, h0 = _check_arguments(
                q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, layout,
                algorithm, keep_forward, options)
            b, t_local, h, hv, kd, vd = shape
            dtype = _DTYPES[q.dtype]
            for name, n in (("B", b), ("H", h), ("HV", hv), ("K", kd), ("V", vd)):
                fp.add(name, n)
            fp.add("dtype", 8 if dtype == "float64" else 4,
                   lambda x: "float64" if x == 8 else "float32")
            fp.add("scale", _float_bits(scale), lambda x: repr(_bits_float(x)))
            fp.add("algorithm", _ALGORITHMS.index(algorithm), lambda x: _ALGORITHMS[x])
            fp.add("layout", _LAYOUTS.index(layout), lambda x: _LAYOUTS[x])
            fp.add("initial_state given", int(h0 is not None), lambda x: str(bool(x)))
            fp.add("output_final_state", int(output_final_state), lambda x: str(bool(x)))
            fp.add("cu_seqlens length", -1 if cu is None else len(cu),
                   lambda x: "None" if x < 0 else str(x))
            fp.add_hash("cu_seqlens", b"" if cu is None else
                        torch.tensor(cu, dtype=torch.int64).numpy().tobytes())
            _options_fingerprint(fp, options, protocol, width, backend.timeout_s)
        except (ValueError, TypeError) as e:  # TypeError: an unknown option
            error = e
        what = "kda"
        extra = fp.check(backend, what, ok=error is None, error=error, extra=[t_local])
        counts = [int(x) for x in extra[:, 0]]
        key = (id(backend), protocol, width, layout, tuple(counts), dtype,
               tuple(sorted((k_, repr(v_)) for k_, v_ in options.items())))
        key = key + ((b, hv, kd, vd),)
        layer = _LAYERS.get(key)
        if layer is None:  # the layout is built once per context, with its layer
            layer = _layer(backend, key, protocol, width, _layout(layout, counts), dtype,
                           options, summary_shape=(b, hv, kd, vd))
    o, ht = _KdaFunction.apply(layer, list(shape), scale, cu, output_final_state, algorithm,
                               keep_forward, *tensors, h0)
    return o, (ht if output_final_state else None)


_BACKENDS = {}


def _group_backend(group, timeout_s):
    """One backend per (group, timeout), reused across kda calls, so the
    layers cached for it stay valid. Only the first call on a group is
    collective (it gathers the members, bounded by timeout_s); a new timeout
    on a known group reuses them, so ranks that pass different timeouts still
    meet in the agreement that names the difference. The group must be live
    (check_group)."""
    key = (id(group), timeout_s)
    entry = _BACKENDS.get(key)
    if entry is not None and entry[0] is group:
        return entry[1]
    known = next((e[1] for k_, e in _BACKENDS.items() if k_[0] == id(group) and e[0] is group),
                 None)
    if known is not None:
        backend = known.with_timeout(timeout_s)
    else:
        try:
            backend = backend_for(group, timeout_s)
        except TimeoutError as e:
            raise RuntimeError(str(e)) from None
    _BACKENDS[key] = (group, backend)
    return backend


# -- flash-linear-attention's chunk_kda: in-kernel transforms, CP context ------

def _np(t):
    return torch.from_numpy(t)


def _guard_second_order(grads, anchors):
    """The transforms' C++ backward has no derivative of its own: under
    create_graph=True their gradients raise on a second backward (as kda's)."""
    return tuple(first_order("chunk_kda", grads, anchors))


class _GateFunction(torch.autograd.Function):
    """g = -exp(A_log)·softplus(g_raw + dt_bias), or lower_bound·sigmoid(
    exp(A_log)·(g_raw + dt_bias)) (kdacp/kda.hpp gate_forward), one C++ pass;
    its backward gives g_raw's, A_log's and dt_bias's gradients."""

    @staticmethod
    def forward(ctx, lower_bound, raw, a_log, dt_bias):
        b, t, hv, kd = raw.shape
        dtype = _DTYPES[raw.dtype]
        ctx.args = (b * t, hv, kd, lower_bound, dtype)
        ctx.save_for_backward(raw, a_log, dt_bias)
        (out,) = _kdacp.kda_gate(raw.data_ptr(), 0 if a_log is None else a_log.data_ptr(),
                                 0 if dt_bias is None else dt_bias.data_ptr(), b * t, hv, kd,
                                 lower_bound, dtype)
        return _np(out).view(b, t, hv, kd)

    @staticmethod
    def backward(ctx, d_g):
        raw, a_log, dt_bias = ctx.saved_tensors
        tokens, hv, kd, lower_bound, dtype = ctx.args
        d_g = d_g.contiguous()
        with torch.no_grad():
            d_raw, d_a, d_b = _kdacp.kda_gate(
                raw.data_ptr(), 0 if a_log is None else a_log.data_ptr(),
                0 if dt_bias is None else dt_bias.data_ptr(), tokens, hv, kd, lower_bound, dtype,
                d_g.data_ptr())
        grads = (_np(d_raw).view(raw.shape), None if d_a is None else _np(d_a).view(a_log.shape),
                 None if d_b is None else _np(d_b).view(dt_bias.shape))
        for x, name in zip(grads, ("g", "A_log", "dt_bias")):
            _require_finite_result(x, f"the gradient of {name}", "gate backward")
        return (None,) + _guard_second_order(grads, (raw, a_log, dt_bias))


class _L2NormFunction(torch.autograd.Function):
    """x / sqrt(Σ_K x² + 1e-6) per (token, head) (kdacp/kda.hpp l2norm_forward)."""

    @staticmethod
    def forward(ctx, x):
        rows, dim = x.numel() // x.shape[-1], x.shape[-1]
        y, rstd = _kdacp.kda_l2norm(x.data_ptr(), rows, dim, _DTYPES[x.dtype])
        y, rstd = _np(y), _np(rstd)
        ctx.save_for_backward(x, y, rstd)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, d_y):
        x, y, rstd = ctx.saved_tensors
        d_y = d_y.contiguous()
        with torch.no_grad():
            dx = _np(_kdacp.kda_l2norm_backward(y.data_ptr(), rstd.data_ptr(), d_y.data_ptr(),
                                                y.shape[0], y.shape[1], _DTYPES[y.dtype]))
        _require_finite_result(dx, "the gradient of q or k", "l2norm backward")
        return _guard_second_order((dx.view(d_y.shape),), (x,))


class _SigmoidFunction(torch.autograd.Function):
    """beta = sigmoid(beta_raw) (kdacp/kda.hpp sigmoid_forward)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return _np(_kdacp.kda_sigmoid(x.data_ptr(), x.numel(), _DTYPES[x.dtype])).view(x.shape)

    @staticmethod
    def backward(ctx, d_y):
        (x,) = ctx.saved_tensors
        d_y = d_y.contiguous()
        with torch.no_grad():
            dx = _np(_kdacp.kda_sigmoid(x.data_ptr(), x.numel(), _DTYPES[x.dtype], d_y.data_ptr()))
        _require_finite_result(dx, "the gradient of beta", "sigmoid backward")
        return _guard_second_order((dx.view(x.shape),), (x,))


def _transform_input(t, name, dtype):
    """A CPU float tensor in the compute dtype, contiguous (the transforms read
    raw memory). A conversion is an autograd op: gradients reach the original."""
    _check_tensor(t, name)
    return t.to(dtype).contiguous()


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
_UNSUPPORTED_FLAGS = ("allow_neg_eigval", "return_intermediate_states", "state_v_first")
# kdacp's extras chunk_kda accepts in **kwargs.
_CHUNK_KDA_EXTRAS = ("algorithm", "keep_forward", "threads")


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
    use_beta_sigmoid_in_kernel: beta ← sigmoid(beta). safe_gate with the
    in-kernel gate needs lower_bound (as flash-linear-attention asserts); it is
    otherwise a numerics hint of flash-linear-attention's kernels that kdacp
    (exact for every g <= 0) does not need. disable_recompute: kdacp keeps
    the forward's intermediates by default (keep_forward); True forces it.
    cu_seqlens_cpu: the same boundaries (must equal cu_seqlens when both are
    given). cp_context: a CpContext (build_cp_context): the tensors are this
    rank's tokens of its layout, and no agreement message is sent per call.
    allow_neg_eigval, return_intermediate_states, state_v_first (other than
    their defaults) and any other keyword raise NotImplementedError naming
    them; kdacp extras: algorithm, keep_forward, threads.
    """
    flags = {"allow_neg_eigval": allow_neg_eigval,
             "return_intermediate_states": return_intermediate_states,
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
                       ("safe_gate", safe_gate), ("disable_recompute", disable_recompute)):
        if not isinstance(flag, bool):
            raise ValueError(f"{name}={flag!r}, expected True or False")
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
    keep_forward = kwargs.get("keep_forward", _DEFAULTS["keep_forward"])
    if disable_recompute:
        keep_forward = True
    for t, name, nd in ((q, "q", 4), (k, "k", 4), (g, "g", 4), (beta, "beta", 3)):
        _check_tensor(t, name, nd)
    dtype = q.dtype
    if use_gate_in_kernel:
        hv, kd = g.shape[2], g.shape[3]
        a = None
        if A_log is not None:
            a = _transform_input(A_log, "A_log", dtype)
            if a.numel() != hv:
                raise ValueError(f"A_log has {a.numel()} elements (shape {list(A_log.shape)}), "
                                 f"expected HV = {hv}")
        bias = None
        if dt_bias is not None:
            bias = _transform_input(dt_bias, "dt_bias", dtype)
            if bias.numel() != hv * kd:
                raise ValueError(f"dt_bias has {bias.numel()} elements (shape "
                                 f"{list(dt_bias.shape)}), expected HV*K = {hv * kd}")
        g = _GateFunction.apply(lower_bound, _transform_input(g, "g", dtype), a, bias)
    if use_qk_l2norm_in_kernel:
        q = _L2NormFunction.apply(q.contiguous())
        k = _L2NormFunction.apply(k.contiguous())
    if use_beta_sigmoid_in_kernel:
        beta = _SigmoidFunction.apply(_transform_input(beta, "beta", dtype))
    signature = {"use_qk_l2norm_in_kernel": use_qk_l2norm_in_kernel,
                 "use_gate_in_kernel": use_gate_in_kernel,
                 "use_beta_sigmoid_in_kernel": use_beta_sigmoid_in_kernel,
                 "lower_bound": lower_bound, "A_log given": A_log is not None,
                 "dt_bias given": dt_bias is not None}
    options = {"threads": kwargs["threads"]} if "threads" in kwargs else {}
    if cp_context is None:
        return kda(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                   algorithm=algorithm, keep_forward=keep_forward, **options)
    if not isinstance(cp_context, CpContext):
        raise ValueError(f"cp_context is a {type(cp_context).__name__}, expected a "
                         "kdacp.torch.CpContext (build_cp_context)")
    if options:
        raise ValueError("threads with a cp_context: pass it to build_cp_context")
    return cp_context._kda(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                           algorithm, keep_forward, signature)


_NO_TRANSFORMS = {"use_qk_l2norm_in_kernel": False, "use_gate_in_kernel": False,
                  "use_beta_sigmoid_in_kernel": False, "lower_bound": None,
                  "A_log given": False, "dt_bias given": False}
_CONTEXT_FIELDS = ("layout", "world size", "cu_seqlens length", "cu_seqlens", "split",
                   "conv1d_kernel_size") + _OPTION_FIELDS
_CALL_FIELDS = ("B", "H", "HV", "K", "V", "dtype", "scale", "algorithm", "initial_state given",
                "output_final_state", "use_qk_l2norm_in_kernel", "use_gate_in_kernel",
                "use_beta_sigmoid_in_kernel", "lower_bound", "A_log given", "dt_bias given")


class CpContext:
    """A context-parallel context (build_cp_context): every cross-rank
    agreement done once, the C++ Layout and the backend built once.

    Attributes: group, backend (the kdacp comm backend; None for a single
    process), layout (the global kdacp._kdacp.Layout), layout_name
    ("contiguous" or "zigzag"), rank, world_size, cu_seqlens (global list of
    ints, or None), split (tokens per rank), conv1d_kernel_size (int or
    None), protocol, allgather_group_size, options (dict), timeout_s.
    """

    def __init__(self, group, backend, layout, layout_name, cu, split, conv1d_kernel_size,
                 protocol, width, options, timeout_s):
        self.group = group
        self.backend = backend
        self.layout = layout
        self.layout_name = layout_name
        self.rank = 0 if backend is None else backend.rank
        self.world_size = 1 if backend is None else backend.size
        self.cu_seqlens = cu
        self.split = split
        self.conv1d_kernel_size = conv1d_kernel_size
        self.protocol = protocol
        self.allgather_group_size = width
        self.options = options
        self.timeout_s = timeout_s
        self._layers = {}
        self._signature = None  # the per-call arguments the ranks agreed on at the first call

    def __repr__(self):
        return (f"<kdacp CpContext rank {self.rank}/{self.world_size} {self.layout_name} "
                f"{self.layout} protocol {self.protocol}>")

    @property
    def local_tokens(self):
        return self.layout.local_tokens(self.rank)

    def _call_row(self, shape, dtype, scale, algorithm, h0_given, want_ht, signature):
        b, _, h, hv, kd, vd = shape
        row = {"B": b, "H": h, "HV": hv, "K": kd, "V": vd, "dtype": dtype, "scale": scale,
               "algorithm": algorithm, "initial_state given": h0_given,
               "output_final_state": want_ht}
        row.update(signature)
        return row

    def _agree_call(self, row, error):
        """The first call's one agreement: every rank learns that all passed the
        same per-call arguments (or which differ) before any exchange message."""
        fp = _Fingerprint(_CALL_FIELDS)
        if error is None:
            shows = {"dtype": None, "algorithm": None, "lower_bound": None}
            for name in _CALL_FIELDS:
                x = row[name]
                if name == "scale":
                    fp.add(name, _float_bits(x), lambda b: repr(_bits_float(b)))
                elif name in shows:
                    fp.add_hash(name, x)
                elif isinstance(x, bool):
                    fp.add(name, int(x), lambda b: str(bool(b)))
                else:
                    fp.add(name, x)
        fp.check(self.backend, "chunk_kda (first call on its cp_context)", ok=error is None,
                 error=error)
        self._signature = row

    def _kda(self, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
             algorithm, keep_forward, signature):
        """kda over the context's layout. Only the first call sends an
        agreement (of the per-call arguments); later calls compare theirs
        with it locally and send nothing but the exchange."""
        if self.backend is None:
            return kda(q, k, v, g, beta, scale, initial_state, output_final_state,
                       self.cu_seqlens if cu_seqlens is None else cu_seqlens,
                       algorithm=algorithm, keep_forward=keep_forward, **self.options)
        error = None
        row = None
        try:
            if cu_seqlens is not None and cu_list(cu_seqlens) != self.cu_seqlens:
                raise ValueError(f"rank {dist.get_rank()}: cu_seqlens differs from its "
                                 f"cp_context's {self.cu_seqlens} (pass None or the same)")
            shape, cu, scale, threads, tensors, h0 = _check_arguments(
                q, k, v, g, beta, scale, initial_state, output_final_state, self.cu_seqlens,
                self.layout_name, algorithm, keep_forward, self.options)
            want = self.local_tokens
            if shape[1] != want:
                raise ValueError(f"rank {dist.get_rank()}: q has {shape[1]} tokens, expected "
                                 f"{want}: this rank's part of the cp_context's layout "
                                 f"{self.layout}")
            row = self._call_row(shape, _DTYPES[q.dtype], scale, algorithm, h0 is not None,
                                 output_final_state, signature)
        except (ValueError, TypeError) as e:
            error = e
        if self._signature is None:
            self._agree_call(row, error)
        elif error is not None:
            raise error
        elif row != self._signature:
            diffs = [f"{n}={row[n]!r} (agreed at the first call: {self._signature[n]!r})"
                     for n in _CALL_FIELDS if row[n] != self._signature[n]]
            raise ValueError(
                f"rank {dist.get_rank()}: chunk_kda on a cp_context called with other "
                f"arguments than at its first call, where every rank agreed on them: "
                f"{'; '.join(diffs)}; nothing was sent (its peers wait for it until the "
                f"timeout); build a new context for other arguments")
        b, _, _, hv, kd, vd = shape
        dtype = _DTYPES[q.dtype]
        key = (dtype, b, hv, kd, vd)
        layer = self._layers.get(key)
        if layer is None:
            opts = _options(self.options, expected=(b, hv, kd, vd), expected_dtype=dtype)
            layer = _kdacp.KdaLayer(self.backend, self.protocol, int(self.allgather_group_size),
                                    self.layout, dtype, opts, threads)
            # The layer's construction agreed (collectively, at this first call of
            # the shape); its calls need not: the context's first call did.
            layer.agree_per_call(False)
            self._layers[key] = layer
        o, ht = _KdaFunction.apply(layer, list(shape), scale, cu, output_final_state, algorithm,
                                   keep_forward, *tensors, h0)
        return o, (ht if output_final_state else None)


def build_cp_context(cu_seqlens, group, conv1d_kernel_size=None, layout="contiguous", split=None,
                     protocol="auto", allgather_group_size=1, **options):
    """A CpContext for chunk_kda(..., cp_context=ctx), built once per batch
    (flash-linear-attention's build_cp_context; kdacp's extras after its
    arguments). Collective over `group` (one agreement; plus the group's
    first gather the first time kdacp meets it).

    cu_seqlens: the global boundaries (1-D int tensor or ints; None: B
    sequences, one per batch row, then `split` is required). group: a live
    torch.distributed group (its ranks in order are the CP order), or
    SINGLE_PROCESS. layout: "contiguous" (rank r holds the r-th run of
    tokens) or "zigzag". split: tokens per rank for a contiguous layout (any
    lengths; None: cu_seqlens[-1] / world size, which must divide); with
    zigzag None or zigzag's own counts. protocol, allgather_group_size and
    options as build_kda_state_cp. Checked at build, in the agreement: the
    layout, world size, cu_seqlens, split, conv1d_kernel_size, protocol,
    allgather_group_size, options and timeout. Checked at the first chunk_kda
    call (its one agreement): B, H, HV, K, V, dtype, scale, algorithm, the
    flags and which of initial_state, A_log, dt_bias are given; later calls
    must pass the same (a rank that does not raises ValueError before sending;
    its peers time out naming it) and send only the exchange's messages.
    """
    if layout not in _LAYOUTS:
        raise ValueError(f"layout {layout!r}, expected 'contiguous' or 'zigzag'")
    if conv1d_kernel_size is not None:
        conv1d_kernel_size = _integer(conv1d_kernel_size, "conv1d_kernel_size", 1, 1 << 16)
    cu = None
    if cu_seqlens is not None:
        cu = cu_list(cu_seqlens)
        if len(cu) < 2 or cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])):
            raise ValueError(f"cu_seqlens {cu}: expected at least 2 non-decreasing entries "
                             "from 0")
    options = dict(options)
    _options(options)
    timeout_s = _timeout(options)
    _threads(options)
    if not isinstance(protocol, str) or protocol not in _kdacp.exchange_methods():
        raise ValueError(f"unknown protocol {protocol!r}, expected one of "
                         f"{_kdacp.exchange_methods()}")
    width = _group_size(allgather_group_size)
    if group is SINGLE_PROCESS:
        world, backend = 1, None
    else:
        if group is None:
            raise ValueError("build_cp_context: group=None, expected a process group "
                             "(torch.distributed.group.WORLD or a new_group), or "
                             "kdacp.torch.SINGLE_PROCESS for one process")
        check_group(group)
        backend = _group_backend(group, timeout_s)
        world = backend.size
    fp = _Fingerprint(_CONTEXT_FIELDS)
    error = None
    built = None
    try:
        if split is not None:
            if isinstance(split, torch.Tensor):
                split = split.tolist()
            split = [_integer(x, "split", 0, 1 << 62) for x in split]
            if len(split) != world:
                raise ValueError(f"split has {len(split)} entries, expected one per rank "
                                 f"({world})")
            if cu is not None and sum(split) != cu[-1]:
                raise ValueError(f"split {split} sums to {sum(split)} tokens, expected "
                                 f"cu_seqlens[-1] = {cu[-1]}")
        elif cu is None:
            raise ValueError("cu_seqlens=None and split=None: pass split (tokens per rank), "
                             "the layout cannot be known otherwise")
        tokens = cu[-1] if cu is not None else sum(split)
        if layout == "zigzag":
            built = _kdacp.Layout.zigzag(tokens, world)
            own = [built.local_tokens(r) for r in range(world)]
            if split is not None and split != own:
                raise ValueError(f"split {split}, but zigzag over {world} ranks of {tokens} "
                                 f"tokens holds {own}")
        else:
            if split is None:
                if tokens % world:
                    raise ValueError(f"{tokens} tokens do not split evenly over {world} ranks: "
                                     "pass split (tokens per rank)")
                split = [tokens // world] * world
            built = _kdacp.Layout.contiguous(tokens, world, split)
        split = [built.local_tokens(r) for r in range(world)]
        fp.add("layout", _LAYOUTS.index(layout), lambda x: _LAYOUTS[x])
        fp.add("world size", world)
        fp.add("cu_seqlens length", -1 if cu is None else len(cu),
               lambda x: "None" if x < 0 else str(x))
        fp.add_hash("cu_seqlens", b"" if cu is None else
                    torch.tensor(cu, dtype=torch.int64).numpy().tobytes())
        fp.add_hash("split", torch.tensor(split, dtype=torch.int64).numpy().tobytes())
        fp.add("conv1d_kernel_size", -1 if conv1d_kernel_size is None else conv1d_kernel_size,
               lambda x: "None" if x < 0 else str(x))
        _options_fingerprint(fp, options, protocol, width, timeout_s)
    except (ValueError, TypeError) as e:
        error = e
    if backend is None:
        if error is not None:
            raise error
    else:
        fp.check(backend, "build_cp_context", ok=error is None, error=error)
    return CpContext(group, backend, built, layout, cu, split, conv1d_kernel_size, protocol,
                     width, options, timeout_s)
