"""The differentiable KDA layer (kdacp.torch.kda): its argument conversion
and local checks, the C++ layers (kdacp._kdacp.KdaLayer) cached per group
and settings, and the autograd Function around the C++ forward and
backward. The ranks of a group agree on a call's arguments in C++."""

import atexit
import math
import numbers

import torch
import torch.distributed as dist

from kdacp import _comm, _kdacp, _ops
from kdacp._autograd import cu_list, first_order
from kdacp._comm import check_group, group_backend, reject
from kdacp._common import (_DEFAULTS, _DTYPES, SINGLE_PROCESS, ULYSSES_AUTO, _check_tensor,
                           _compute_dtype, _contiguous_cached, _expected_cuts, _from_numpy,
                           _group_size, _options, _parse_bytes, _require_finite_result, _segments,
                           _threads, _timeout, _ulysses)

_LAYERS = {}
_LAYER_CACHE_SIZE = 16


def _release_at_exit():
    """Drops the cached layers and group backends while the interpreter is
    whole: they hold C++ thread pools, communicators and the process groups
    they were built on, whose destruction during finalization (a group
    destroyed by the user but kept alive by this cache, its worker threads
    ending after Python's state is gone) could crash the process at exit."""
    _LAYERS.clear()
    _comm._BACKENDS.clear()


atexit.register(_release_at_exit)


def _option_key(options):
    """The converted values of the options a layer is built with (equal
    values, however spelled, share a layer)."""
    shape = options.get("expected_shape")
    cuts = _expected_cuts(options)
    return (_segments(options), _parse_bytes(options.get("memory_budget_bytes", 0)),
            bool(options.get("allow_reassociation", False)), options.get("calibration") or "",
            None if shape is None else tuple(int(x) for x in shape),
            None if cuts is None else tuple(cuts), _ulysses(options))


def _layer(backend, protocol, group_size, layout, dtype, threads, options):
    """The C++ layer of these settings: on a group, the layout's split is
    each call's tokens per rank, agreed with the call (KdaLayer)."""
    key = ("single", dtype, threads) if backend is None else \
        (id(backend), protocol, group_size, layout, dtype, threads, _option_key(options))
    cached = _LAYERS.get(key)
    if cached is not None:
        return cached
    layer = _kdacp.KdaLayer(backend, protocol, int(group_size), None, dtype, _options(options),
                            threads, _ulysses(options), layout)
    if len(_LAYERS) >= _LAYER_CACHE_SIZE:
        _LAYERS.pop(next(iter(_LAYERS)))
    _LAYERS[key] = layer
    return layer


def _storage_dtypes(*tensors):
    """'bfloat16,float32,...': how each of q, k, v, g, beta is stored."""
    return ",".join(str(t.dtype).replace("torch.", "") for t in tensors)


def _check_input(t, name, rule):
    """kdacp/finite.hpp's rules on a contiguous tensor: the CLI's messages."""
    _kdacp.check_tensor(t.data_ptr(), list(t.shape), _DTYPES[t.dtype], name, rule)


def layer_forward(layer, shape, scale, cu, want_ht, algorithm, keep_forward, deterministic,
                  tensors, h0):
    """The C++ layer's forward, outside autograd: (o stored as v, ht or None,
    the layer's saved state), each result checked finite."""
    inputs = [t.data_ptr() for t in tensors]
    dtypes = [_DTYPES[t.dtype] for t in tensors]
    h0_ptr = 0 if h0 is None else h0.data_ptr()
    o, ht, saved = layer.forward(inputs, dtypes, shape, scale, cu, h0_ptr, want_ht, algorithm,
                                 keep_forward, deterministic)
    o = _from_numpy(o, tensors[2].dtype)
    ht = torch.from_numpy(ht) if want_ht else None
    _require_finite_result(o, "o", "forward")
    _require_finite_result(ht, "ht", "forward")
    return o, ht, saved


class _KdaFunction(torch.autograd.Function):
    """The C++ layer's forward and backward. q, k, v, g, beta may each be
    float32, bfloat16 or float16 (computed in float32; o is stored as v, each
    gradient as its input), or all float64; states in the compute dtype."""

    @staticmethod
    def forward(ctx, layer, shape, scale, cu, want_ht, algorithm, keep_forward, deterministic,
                q, k, v, g, beta, h0):
        o, ht, saved = layer_forward(layer, shape, scale, cu, want_ht, algorithm, keep_forward,
                                     deterministic, (q, k, v, g, beta), h0)
        ctx.layer, ctx.shape, ctx.scale, ctx.cu, ctx.want_ht = layer, shape, scale, cu, want_ht
        ctx.algorithm = algorithm
        ctx.kdacp_saved = saved  # the layer's Saved: M and the incoming state per part
        ctx.save_for_backward(q, k, v, g, beta, h0)
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
        return (None,) * 8 + tuple(grads)

    @staticmethod
    def _backward(ctx, q, k, v, g, beta, h0, d_o, d_ht):
        tensors = (q, k, v, g, beta)
        state_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        if d_o is None:
            d_o = torch.zeros(ctx.shape[0], ctx.shape[1], ctx.shape[3], ctx.shape[5], dtype=v.dtype)
        d_o = _contiguous_cached(d_o)
        _check_input(d_o, "the gradient of o", "finite")
        dht_ptr = 0
        if ctx.want_ht:
            # Every rank passes dht (zeros when its loss does not use ht): the
            # layer gathers them collectively.
            if d_ht is None:
                n = (len(ctx.cu) - 1) if ctx.cu is not None else ctx.shape[0]
                d_ht = torch.zeros(n, ctx.shape[3], ctx.shape[4], ctx.shape[5], dtype=state_dtype)
            d_ht = d_ht.to(state_dtype).contiguous()
            _check_input(d_ht, "the gradient of ht", "finite")
            dht_ptr = d_ht.data_ptr()
        inputs = [t.data_ptr() for t in tensors]
        dtypes = [_DTYPES[t.dtype] for t in tensors]
        h0_ptr = 0 if h0 is None else h0.data_ptr()
        grads = ctx.layer.backward(
            ctx.kdacp_saved, inputs, dtypes, ctx.shape, ctx.scale, h0_ptr, d_o.data_ptr(),
            _DTYPES[d_o.dtype], dht_ptr, h0 is not None)
        grads = [_from_numpy(x, None if t is None else t.dtype) for x, t in zip(grads, tensors + (h0,))]
        for name, x in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), grads):
            _require_finite_result(x, name, "backward")
        return grads


def _check_kda(q, k, v, g, beta, initial_state, cu_seqlens):
    for t, name, nd in ((q, "q", 4), (k, "k", 4), (v, "v", 4), (g, "g", 4), (beta, "beta", 3)):
        _check_tensor(t, name, nd)
    dtype = _compute_dtype(((q, "q"), (k, "k"), (v, "v"), (g, "g"), (beta, "beta")))
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
            raise ValueError(f"initial_state has dtype {initial_state.dtype}, expected {dtype} "
                             "(states are float64 with float64 inputs, float32 otherwise, as in "
                             "flash-linear-attention)")
        if tuple(initial_state.shape[1:]) != (hv, kd, vd):
            raise ValueError(f"initial_state has shape {list(initial_state.shape)}, expected "
                             f"[N,{hv},{kd},{vd}] ([N,HV,K,V])")
    return (b, t_, h, hv, kd, vd), cu, _DTYPES[dtype]


_ALGORITHMS = ("recurrent", "chunk")
_LAYOUTS = ("contiguous", "zigzag")


def _neg_eigval_signature(signature, allow_neg_eigval):
    """A cp_context call's per-call signature with allow_neg_eigval (beta in
    [0, 2]) in it."""
    if not isinstance(allow_neg_eigval, bool):
        raise ValueError(f"allow_neg_eigval={allow_neg_eigval!r}, expected True or False")
    signature["allow_neg_eigval"] = allow_neg_eigval
    return signature


def _check_arguments(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                     layout, algorithm, keep_forward, options, deterministic=False,
                     allow_neg_eigval=False):
    """Every local check of kda's arguments (no message sent): the shapes,
    the options, then the values (finite inputs, g <= 0, beta in [0, 1], or
    [0, 2] with allow_neg_eigval, by the C++ validator the CLI uses). Returns
    what kda runs with."""
    shape, cu, dtype = _check_kda(q, k, v, g, beta, initial_state, cu_seqlens)
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
    if not isinstance(deterministic, bool):
        raise ValueError(f"deterministic={deterministic!r}, expected True or False")
    if not isinstance(allow_neg_eigval, bool):
        raise ValueError(f"allow_neg_eigval={allow_neg_eigval!r}, expected True or False")
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
    _check_input(tensors[4], "beta", "beta_neg_eigval" if allow_neg_eigval else "beta")
    if h0 is not None:
        _check_input(h0, "initial_state", "finite")
    return shape, cu, scale, threads, tensors, h0, dtype


@_ops.entry("kda", _ops.kda_fake)  # torch.compile: the op kdacp::kda (docs/compile.md)
def kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
        cu_seqlens=None, group=SINGLE_PROCESS, layout="contiguous", protocol="auto",
        allgather_group_size=1, algorithm=_DEFAULTS["algorithm"],
        keep_forward=_DEFAULTS["keep_forward"], cp_context=None,
        deterministic=_DEFAULTS["deterministic"], allow_neg_eigval=False, **options):
    """Kimi Delta Attention over this rank's tokens (SPEC §9-§11).

    q, k [B,T,H,K]; v [B,T,HV,V]; g [B,T,HV,K] (log decay, <= 0); beta
    [B,T,HV]; CPU tensors (flash-linear-attention layout), all float64, or
    each float32, bfloat16 or float16 (computed in float32, o stored as v and
    each gradient as its input; initial_state and ht float32),
    finite, with g <= 0 and beta in [0, 1] (ValueError naming the first bad
    element otherwise, the CLI's message); allow_neg_eigval=True admits beta
    in [0, 2] (flash-linear-attention's flag: I - beta k k^T may then have
    eigenvalues down to -1; exact as for [0, 1]). scale None: 1/sqrt(K).
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
    q, k, v, g, beta and initial_state; a double backward raises. On a
    group initial_state.grad is this rank's share, as for any parameter
    every rank holds: the rows of the sequences whose first token this rank
    holds, -0.0 in the others; summed over the ranks (the trainer's
    all-reduce) it is one process's gradient (docs/python.md). A
    non-finite o, ht or gradient raises RuntimeError naming it. Every rank
    must call kda, and its backward, in the same order. algorithm: "chunk"
    (the default: chunkwise WY form, chunks of 64 tokens) or "recurrent"
    (token by token, the reference); the same results up to rounding, the
    same on every rank of a group. keep_forward (default True, as
    kdacp.defaults() says): with "chunk", the forward keeps what its backward
    would recompute (about 1.25x the local q, k, v, g at K = V = 128) in the
    autograd context, for a faster backward; False saves that memory (a
    forward without backward, or memory short); the same results either way. options: as build_kda_state_cp,
    plus ulysses (on a group): U > 1 runs Ulysses x state CP, head groups of U
    consecutive ranks trading q, k, v, g, beta and o by all-to-all around the
    state exchange over P/U ranks (U divides the group's ranks, H and HV; the
    same call and results); "auto": the cost model's U (protocol "auto").
    cp_context: a CpContext (build_cp_context) instead of group, layout,
    protocol, allgather_group_size and options: no agreement message per
    call (chunk_kda's path, without its transforms).
    deterministic (default False, as kdacp.defaults() says): on a group, the
    state walks from part to part in chain order instead of the exchange
    composing the ranks' summaries, so o, ht, the gradients of q, k, v, g,
    beta and initial_state's shares summed over the ranks (exactly: the
    others add -0.0) are the same bytes for every group size,
    layout, protocol and thread count: those of one process (the one-process
    path is this mode at P = 1 whatever the flag; it only checks the
    value). With algorithm "chunk" every cut inside a sequence must fall on
    a multiple of 64 tokens of that sequence (ValueError on every rank
    naming the part and the rule otherwise). ht's gradient is summed over
    the ranks in rank order: the bytes are the same for every P when one
    rank gives it (or the sum is the same). Slower on a group: the parts run
    one after another (docs/determinism.md). A value other than True or
    False raises ValueError naming it.
    """
    if cp_context is not None:
        from kdacp._context import _NO_TRANSFORMS, CpContext  # it imports this module
        if not isinstance(cp_context, CpContext):
            raise ValueError(f"cp_context is a {type(cp_context).__name__}, expected a "
                             "kdacp.torch.CpContext (build_cp_context)")
        if group is not SINGLE_PROCESS or layout != "contiguous" or protocol != "auto" or \
                allgather_group_size != 1 or options:
            raise ValueError("kda: cp_context given with group, layout, protocol, "
                             "allgather_group_size or options: the context holds them")
        return cp_context._kda(q, k, v, g, beta, scale, initial_state, output_final_state,
                               cu_seqlens, algorithm, keep_forward,
                               _neg_eigval_signature(dict(_NO_TRANSFORMS), allow_neg_eigval),
                               deterministic)
    if group is SINGLE_PROCESS:
        shape, cu, scale, threads, tensors, h0, dtype = _check_arguments(
            q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, layout,
            algorithm, keep_forward, options, deterministic, allow_neg_eigval)
        if layout != "contiguous":
            raise ValueError("layout 'zigzag' needs a group (without one kda runs one process)")
        if _ulysses(options) not in (1, ULYSSES_AUTO):  # auto on one process: U = 1
            raise ValueError(f"ulysses={options['ulysses']!r} needs a group (without one kda runs one "
                             "process)")
        layer = _layer(None, "none", 1, "contiguous", dtype, threads, {})
    else:
        # The group and timeout first (a rank that cannot reach its peers
        # cannot tell them why). Then the arguments are converted and checked
        # locally; the layer's C++ agreement compares them across the ranks
        # (and gathers each rank's token count for the layout) before any
        # other message. A rank whose own check fails tells its peers in
        # that agreement: it raises its error, they name it; none waits.
        if group is None:
            raise ValueError(
                "kda: group=None, expected a process group: torch.distributed.group.WORLD is "
                "None before init_process_group and after destroy_process_group, so None "
                "cannot mean the default group here; omit group (or pass "
                "kdacp.torch.SINGLE_PROCESS) to run one process")
        group = _comm.as_process_group(group)
        check_group(group)
        backend = group_backend(group, _timeout(options))
        try:
            if not isinstance(protocol, str) or protocol not in _kdacp.exchange_methods():
                raise ValueError(f"unknown protocol {protocol!r}, expected one of "
                                 f"{_kdacp.exchange_methods()}")
            width = _group_size(allgather_group_size)
            shape, cu, scale, threads, tensors, h0, dtype = _check_arguments(
                q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, layout,
                algorithm, keep_forward, options, deterministic, allow_neg_eigval)
            layer = _layer(backend, protocol, width, layout, dtype, threads, options)
        except (ValueError, TypeError) as e:  # TypeError: an unknown option
            reject(backend, "kdacp.torch.kda", e)
    o, ht = _KdaFunction.apply(layer, list(shape), scale, cu, output_final_state, algorithm,
                               keep_forward, deterministic, *tensors, h0)
    return o, (ht if output_final_state else None)
